"""``hybrid``: one lossless draft tree filled from several candidate sources.

Not from a paper: it combines ESP embedding-space probing (Goel et al., arXiv
2603.17942) with prompt-lookup decoding (Saxena, 2023) and a pool of the
model's own earlier predictions (as lookahead decoding keeps, Fu et al., 2024).
Read top to bottom:

1. Candidate sources, each a set of token paths under the root:
   ``pld`` (the most recent prompt-lookup match) and ``pld_alt`` (further
   distinct matches) as chains; ``pool``: a chain followed through a table
   ``(previous token, token) -> the model's own target token`` filled from
   every verified slot of earlier trees, rejected branches included;
   ``probe``: the masks after the previous step's deepest accepted node
   predict depths 1..k, every depth-d candidate may hang under every
   depth-(d-1) node (as in ESP's tree); ``mtp``: where the checkpoint ships
   a native MTP layer (Qwen3.5 / Qwen3-Next ``mtp.*``, DeepSeek nextn, or a
   ``native-mtp-layer`` heads folder), the chain that layer drafts
   (:class:`~mlx_mtp.methods.mtp.NativeDrafter`).
2. One scale for all: each candidate child gets a conditional acceptance
   estimate q (probability it is accepted given its parent is). Chains: per
   source and depth, a Beta-smoothed acceptance rate learned online from this
   generation's own accept/reject history (priors :data:`PRIORS`). Probe: the
   mask probability times a per-depth calibration factor learned the same way.
   Where sources propose the same token at the same place they are merged:
   same source -> max, different sources -> noisy-or ``1 - prod(1 - q)``.
3. Budget: block complexity ``BC`` = every slot of one forward pass (root +
   nodes + mask slots). :func:`allocate` spends it best-first by value per
   slot: a node's value is its path acceptance probability (product of q
   along the path, so parents always come before children); a mask set (k
   slots) after an anchor is worth ``P(path) * (1 - sum q of its candidate
   children) * gain``, the estimated chance that this anchor ends up the
   deepest accepted node (the only case where its masks are read) times the
   tokens probe drafts add when masks are available (``gain``, learned online).
   So masks are attached only where the next step is likely to need them.
4. Verification: the shared lossless stage :mod:`mlx_mtp.speculative` on
   the draft :meth:`Hybrid.propose` builds; :meth:`Hybrid.observe` learns the
   acceptance statistics, the pool and the next probe candidates from it.

Chain shape (``shape="chain"``, and ``"auto"`` on hybrid recurrent models such
as Qwen3.5 / Qwen3-Next, whose gated delta-net layers cannot run a branching
tree): the same merged candidates, but one path, the most likely child at
every depth, cut where expected tokens per unit of time peaks, with the k mask
slots after its last node (they draft the next step's probe candidates if the
whole chain is accepted; no masks on models that take no input embeddings).
The recurrent state is rolled back to the accepted prefix
(:mod:`mlx_mtp.recurrent`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.utils import does_model_support_input_embeddings

from ..budget import PrefixBound, best_prefix, chain_values
from ..engine import Engine, check_tree_support
from ..errors import InvalidArgumentError, UnsupportedModelError
from ..native_mtp import has_native_mtp
from ..speculative import Draft, Verified
from ..tree import heavy_path_order, reorder_tree, worth_adding
from ..verify import Sampler
from .base import SpeculativeMethod, parse_bc, parse_int
from .pld import lookup_candidates
from .probe import MaskVectors, candidate_lists, mask_candidates, top_candidates

#: prior conditional acceptance rate per chain source (Beta prior mean)
PRIORS = {"pld": 0.5, "pld_alt": 0.3, "pool": 0.3, "mtp": 0.5}
#: weight of the priors, in pseudo-observations
PRIOR_WEIGHT = 4.0
#: deepest depth with its own statistics (deeper ones share the last bucket)
MAX_STAT_DEPTH = 12
#: ``bc=auto``'s check of the node estimates: prior weight (in tokens) of the
#: ratio accepted / predicted, and its decay per draft step
CALIBRATION_WEIGHT, CALIBRATION_DECAY = 1.0, 0.9
#: ``bc=auto``: chain nodes whose own path estimate falls below this (expected
#: accepted tokens) are not offered: host time for nothing the cut would keep
CHAIN_FLOOR = 1e-3

Source = tuple[str, int, float]  # (source name, depth 1.., raw score: mask prob or q)


@dataclass
class Child:
    """A candidate child of a tree node: token, conditional acceptance estimate
    q in [0, 1], and the sources that proposed it."""

    token: int
    q: float
    sources: list[Source] = field(default_factory=list)


@dataclass
class Allocation:
    """A draft tree chosen within a slot budget.

    ``tokens``/``parents``/``probs``/``sources`` describe nodes in selection
    order (parents index earlier nodes, -1 = root; probs = path acceptance
    estimates). ``mask_anchors`` are slot indices (0 = root, node i -> i + 1)
    that get a mask set, in selection order.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    sources: list[list[Source]] = field(default_factory=list)
    mask_anchors: list[int] = field(default_factory=list)
    #: every item in selection order: (is a mask set, value, slots)
    order: list[tuple[bool, float, int]] = field(default_factory=list)

    def prefix(self, n: int) -> Allocation:
        """The allocation of the first ``n`` selected items (a valid tree:
        parents and anchors are always selected before what hangs off them)."""
        items = self.order[:n]
        nodes = sum(1 for m, _, _ in items if not m)
        masks = sum(1 for m, _, _ in items if m)
        return Allocation(
            self.tokens[:nodes],
            self.parents[:nodes],
            self.probs[:nodes],
            self.sources[:nodes],
            self.mask_anchors[:masks],
            items,
        )

    def heavy_first(self) -> Allocation:
        """The same tree with its nodes laid out most probable path first
        (:func:`~mlx_mtp.tree.heavy_path_order`), mask anchors renumbered: an
        accepted most-probable branch is then a prefix of the pass, which the
        cache keeps by trimming alone."""
        order = heavy_path_order(self.parents, self.probs)
        pos = {old + 1: new + 1 for new, old in enumerate(order)}
        pos[0] = 0
        return Allocation(
            [self.tokens[i] for i in order],
            reorder_tree(order, self.parents),
            [self.probs[i] for i in order],
            [self.sources[i] for i in order],
            [pos[a] for a in self.mask_anchors],
            self.order,
        )

    def slots(self, masks: int) -> int:
        """Slots of the forward pass: root + nodes + mask slots."""
        return 1 + len(self.tokens) + masks * len(self.mask_anchors)


def combine(qs_by_source: dict[str, float]) -> float:
    """Noisy-or over sources: ``1 - prod(1 - q)``."""
    out = 1.0
    for q in qs_by_source.values():
        out *= 1.0 - min(max(q, 0.0), 1.0)
    return 1.0 - out


def merge_chains(
    chains: Sequence[tuple[str, Sequence[int], Sequence[float]]],
) -> dict[tuple[int, ...], dict[int, Child]]:
    """Merge candidate chains into a trie: path (tokens below the root) ->
    {token: Child}.

    Args:
        chains: (source name, tokens, per-depth conditional q) triples; q[d] is
            the estimate for tokens[d] given tokens[:d] accepted.

    Returns:
        The trie. Where chains agree on a prefix they share nodes; a token
        proposed by several chains gets q = noisy-or over sources of the max q
        per source, and every proposing source is recorded.
    """
    per: dict[tuple[int, ...], dict[int, dict[str, float]]] = {}
    srcs: dict[tuple[int, ...], dict[int, list[Source]]] = {}
    for name, toks, qs in chains:
        path: tuple[int, ...] = ()
        for d, (t, q) in enumerate(zip(toks, qs)):
            t, q = int(t), float(q)
            slot = per.setdefault(path, {}).setdefault(t, {})
            slot[name] = max(slot.get(name, 0.0), q)
            lst = srcs.setdefault(path, {}).setdefault(t, [])
            if all(s[0] != name for s in lst):
                lst.append((name, d + 1, q))
            path += (t,)
    return {
        path: {t: Child(t, combine(by_src), srcs[path][t]) for t, by_src in kids.items()}
        for path, kids in per.items()
    }


def merged_children(
    path: tuple[int, ...],
    parent_token: int,
    trie: dict[tuple[int, ...], dict[int, Child]],
    probe_levels: Sequence[tuple[np.ndarray, np.ndarray]],
    probe_scale: Sequence[float] = (),
) -> list[Child]:
    """Children of the node at ``path``: chain children from ``trie`` plus the
    probe candidates of depth ``len(path) + 1`` (merged by noisy-or), most
    probable first. One node's worth of :class:`CandidateChildren`.

    Args:
        path: tokens from below the root to this node (empty for the root).
        parent_token: this node's token (probe candidates repeating it are
            pruned, as in ESP).
        probe_levels: per depth, (tokens, mask probabilities).
        probe_scale: per depth, calibration factor for mask probabilities.
    """
    return CandidateChildren(trie, probe_levels, probe_scale)(path, parent_token)


class CandidateChildren:
    """:func:`merged_children` for every node of one draft step: the probe
    levels are read into :class:`Child` lists once (per depth, q descending),
    shared by every node without chain children at that depth.

    Args:
        trie: chain candidates (:func:`merge_chains`).
        probe_levels: per depth, (tokens (m,) int, mask probabilities (m,)).
        probe_scale: per depth, calibration factor for mask probabilities.

    Calling it with ``(path, parent_token)`` returns the children of that node,
    most probable first; the returned :class:`Child` objects must not be changed.
    """

    def __init__(
        self,
        trie: dict[tuple[int, ...], dict[int, Child]],
        probe_levels: Sequence[tuple[np.ndarray, np.ndarray]],
        probe_scale: Sequence[float] = (),
    ):
        self.trie = trie
        self.levels: list[list[Child]] = []
        for d, (toks, ps) in enumerate(probe_levels):
            scale = probe_scale[d] if d < len(probe_scale) else 1.0
            row = []
            for t, p in zip(toks.tolist(), ps.tolist()):
                q = min(scale * p, 1.0)
                if q > 0.0:
                    row.append(Child(t, q, [("probe", d + 1, p)]))
            row.sort(key=lambda c: -c.q)  # stable: ties keep the level's order
            self.levels.append(row)

    def __call__(self, path: tuple[int, ...], parent_token: int) -> list[Child]:
        d = len(path)
        probe = self.levels[d] if d < len(self.levels) else []
        chain = self.trie.get(path)
        if not chain:
            return [c for c in probe if c.token != parent_token]
        kids = {t: Child(c.token, c.q, list(c.sources)) for t, c in chain.items()}
        for c in probe:
            if c.token == parent_token:
                continue
            k = kids.get(c.token)
            if k is None:
                kids[c.token] = c
            else:
                k.q = 1.0 - (1.0 - k.q) * (1.0 - c.q)
                k.sources.append(c.sources[0])
        return sorted(kids.values(), key=lambda c: -c.q)


def allocate(
    children: Callable[[tuple[int, ...], int], list[Child]],
    root_token: int,
    budget: int,
    masks: int,
    mask_gain: float,
    slot_cost: float = 0.0,
    bound: PrefixBound | None = None,
    node_scale: float = 1.0,
    min_items: int = 0,
) -> Allocation:
    """Spend ``budget`` slots (root included) best-first by value per slot.

    Items: a node (cost 1, value = its path acceptance estimate) and, for the
    root and every chosen node, a mask set (cost ``masks``, value = path
    estimate * max(0, 1 - sum of its candidates' q) * ``mask_gain``). Children
    are offered only once their parent is chosen, so parents come first.

    Args:
        children: ``(path, token of the node at path) -> candidate children``,
            most probable first (q descending, as :func:`merged_children`).
        root_token: the root's token.
        budget: BC, total slots of the forward pass (>= 1).
        masks: mask slots per mask set (0 = never attach masks).
        mask_gain: expected tokens the masks' drafts add next step.
        slot_cost: marginal cost of a slot as a fraction of a one-token forward
            (``bc=auto``); an item is taken only if it raises expected tokens
            per unit time (:func:`mlx_mtp.tree.worth_adding`). 0 fills the budget.
        bound: ``bc=auto``'s cut (:class:`~mlx_mtp.budget.PrefixBound` over the
            device's cost curve): allocation stops, after ``min_items`` items,
            once no longer prefix can beat the best one, so that
            :func:`~mlx_mtp.budget.best_prefix` of the items taken (node values
            times ``node_scale``) is the same as of a full allocation. It saves
            the host time of items that would be cut anyway.
        node_scale: factor on node values in ``bound`` (hybrid's calibration).
        min_items: items to take before ``bound`` may stop the allocation.

    Returns:
        The :class:`Allocation` (``slots(masks) <= budget``).
    """
    out = Allocation()
    left = budget - 1
    # (-value per slot, (offer number, rank), item): a node's children are pushed
    # one at a time, the next sibling when one is popped (they come best first),
    # and the (offer, rank) tie-break pops them in the order of pushing them all
    heap: list[tuple[float, tuple[int, int], Any]] = []
    offers = 0
    paths: list[tuple[int, ...]] = [()]  # by slot index

    def offer(slot: int, prob: float) -> None:
        nonlocal offers
        path = paths[slot]
        tok = root_token if slot == 0 else out.tokens[slot - 1]
        kids = children(path, tok)
        if kids:
            heapq.heappush(heap, (-prob * kids[0].q, (offers, 0), ("node", slot, kids, 0, prob)))
        if masks > 0 and mask_gain > 0:
            stay = max(0.0, 1.0 - sum(c.q for c in kids))
            value = prob * stay * mask_gain
            if value > 0:
                heapq.heappush(heap, (-value / masks, (offers, len(kids)), ("masks", slot)))
        offers += 1

    offer(0, 1.0)
    total = 0.0  # value taken so far
    # per slot, no item not taken yet is worth more than the heap's top times this
    # (children are worth at most their parent; a mask set gain / masks of it)
    lift = max(node_scale, 1.0, mask_gain / masks if masks else 0.0)
    while heap and left > 0:
        if bound is not None and len(out.order) >= min_items:
            if bound.exhausted(-heap[0][0] * lift):
                break
        neg, (seq, rank), item = heap[0]
        cost = masks if item[0] == "masks" else 1
        used = budget - 1 - left
        if slot_cost > 0 and not worth_adding(-neg * cost, cost, slot_cost, total, used):
            break  # best remaining value per slot is not worth a slot
        if item[0] == "masks":
            heapq.heappop(heap)
            if masks <= left:
                total += -neg * masks
                out.mask_anchors.append(item[1])
                out.order.append((True, -neg * masks, masks))
                left -= masks
                if bound is not None:
                    bound.add(-neg * masks, masks)
            continue
        _, parent_slot, kids, i, parent_prob = item
        c, prob = kids[i], -neg
        if i + 1 < len(kids):  # the next sibling takes this one's place
            nxt = ("node", parent_slot, kids, i + 1, parent_prob)
            heapq.heapreplace(heap, (-parent_prob * kids[i + 1].q, (seq, i + 1), nxt))
        else:
            heapq.heappop(heap)
        if prob <= 0.0:
            continue
        out.tokens.append(c.token)
        out.parents.append(parent_slot - 1)
        out.probs.append(prob)
        out.sources.append(c.sources)
        out.order.append((False, prob, 1))
        paths.append(paths[parent_slot] + (c.token,))
        total += prob
        left -= 1
        if bound is not None:
            bound.add(prob * node_scale, 1)
        offer(len(out.tokens), prob)
    return out


def _worth(qs: Sequence[float]) -> int:
    """Length of the chain prefix whose nodes are each worth at least
    ``CHAIN_FLOOR`` expected tokens on their own (product of q down to them)."""
    return sum(v >= CHAIN_FLOOR for v in chain_values(qs))


class AcceptanceStats:
    """Online acceptance estimates of one generation (Beta-smoothed).

    ``q(source, depth)``: chance a chain source's node at ``depth`` is accepted
    given its parent is. ``probe_scale(depth)``: accepted / sum of mask
    probabilities of tried probe nodes (prior 1). ``gain``: probe-drafted
    tokens accepted per step in which mask drafts were available.
    """

    def __init__(self, priors: dict[str, float] | None = None, gain_prior: float = 0.5):
        self.priors = dict(PRIORS if priors is None else priors)
        self.acc: dict[tuple[str, int], float] = {}
        self.tried: dict[tuple[str, int], float] = {}
        self.gain_prior = gain_prior
        self.gain_sum = 0.0
        self.gain_n = 0
        self.predicted = 0.0
        self.realized = 0.0

    @staticmethod
    def _key(source: str, depth: int) -> tuple[str, int]:
        return source, min(depth, MAX_STAT_DEPTH)

    def q(self, source: str, depth: int) -> float:
        k = self._key(source, depth)
        p0 = self.priors.get(source, 0.3)
        return (self.acc.get(k, 0.0) + PRIOR_WEIGHT * p0) / (self.tried.get(k, 0.0) + PRIOR_WEIGHT)

    def qs(self, source: str, n: int) -> list[float]:
        """``[q(source, 1), ..., q(source, n)]`` (depths past
        ``MAX_STAT_DEPTH`` share its estimate)."""
        out = [self.q(source, d) for d in range(1, min(n, MAX_STAT_DEPTH) + 1)]
        return out + out[-1:] * (n - len(out))

    def probe_scale(self, depth: int) -> float:
        k = self._key("probe", depth)
        return (self.acc.get(k, 0.0) + PRIOR_WEIGHT) / (self.tried.get(k, 0.0) + PRIOR_WEIGHT)

    @property
    def gain(self) -> float:
        return (self.gain_sum + PRIOR_WEIGHT * self.gain_prior) / (self.gain_n + PRIOR_WEIGHT)

    def record(self, sources: list[Source], accepted: bool) -> None:
        """One tried node (its parent was accepted) and whether it was accepted.
        For probe, ``tried`` accumulates the mask probability (calibration)."""
        for name, depth, raw in sources:
            k = self._key(name, depth)
            self.tried[k] = self.tried.get(k, 0.0) + (raw if name == "probe" else 1.0)
            self.acc[k] = self.acc.get(k, 0.0) + float(accepted)

    def record_gain(self, probe_tokens: int) -> None:
        self.gain_sum += probe_tokens
        self.gain_n += 1

    @property
    def calibration(self) -> float:
        """Accepted draft tokens per predicted one, over recent draft steps
        (prior 1, :data:`CALIBRATION_WEIGHT` tokens; decayed by
        :data:`CALIBRATION_DECAY` per step; capped at 1.5). The per-source
        estimates above are learned node by node and can stay too hopeful as a
        sum (on prose with SmolLM2-135M, mt_bench: 0.38 predicted, 0.09
        accepted per step); ``bc=auto`` scales the node values it weighs
        against the forward cost by this ratio."""
        w = CALIBRATION_WEIGHT
        return min((self.realized + w) / (self.predicted + w), 1.5)

    def record_step(self, predicted: float, accepted: int) -> None:
        """One verified draft: the sum of its nodes' path estimates and the
        nodes accepted."""
        self.predicted = self.predicted * CALIBRATION_DECAY + predicted
        self.realized = self.realized * CALIBRATION_DECAY + accepted


class Hybrid(SpeculativeMethod):
    """Hybrid draft tree: prompt lookup + probe masks + the model's own earlier
    predictions, one acceptance scale, one block-complexity budget; lossless.

    Args:
        bc: block complexity = slots per forward pass (root + nodes + masks),
            or ``"auto"`` (default): up to ``max_bc`` slots, cut per step at
            the best-first prefix that maximises expected tokens per unit of
            time under the device's forward cost curve, and one-token steps
            (with a periodic re-probe) while nothing pays
            (:mod:`mlx_mtp.budget`). 10 and 30 are fixed edge settings.
        masks: mask slots per mask set, k = 0..3 (0 disables probing);
            default 1, or 0 in chain shape on a model that takes no input
            embeddings (mask slots are vectors).
        matches: distinct prompt-lookup continuations per step.
        window: longest n-gram matched by prompt lookup.
        max_draft: longest chain per source (default: bc - 1).
        pool: 1 to draft from the table of the model's earlier predictions.
        max_bc: the cap of ``bc="auto"`` (default 64).
        lam, mask_init: as in :class:`~mlx_mtp.methods.probe.Probe`
            (``mask_init="learned"`` loads :mod:`mlx_mtp.learned_masks`).
        shape: ``"auto"`` (default: a chain on hybrid recurrent models, a
            tree elsewhere), ``"tree"`` or ``"chain"`` (see module doc).
        mtp: ``"auto"`` (default: draft from the checkpoint's native MTP
            layer when it has one), 1 (required: an error when it has none)
            or 0 (off).
        mtp_depth: the longest MTP chain per step (default 3); with
            ``bc="auto"`` each step drafts the depth that pays under the cost
            curve (the layer's own pass counted, as ``--method mtp`` does).
        heads: a folder holding the MTP layer (default: the model's own
            checkpoint folder).

    Raises:
        InvalidArgumentError: bad option values (bc < 2, a fixed tree, ...).
        UnsupportedModelError: (prepare) ``shape="tree"`` on a recurrent
            model, masks on a model without input embeddings, ``mtp=1``
            without a native MTP layer.
    """

    name = "hybrid"
    lossless = True
    #: items (nodes, mask sets) a re-probe step keeps even when none pays
    REPROBE_ITEMS = 2

    def __init__(
        self,
        bc: Any = "auto",
        masks: Any = None,
        tree: str = "dynamic",
        lam: Any = 0.1,
        mask_init: str = "mean",
        matches: Any = 3,
        window: Any = 3,
        max_draft: Any = None,
        pool: Any = 1,
        max_bc: Any = 64,
        shape: str = "auto",
        mtp: Any = "auto",
        mtp_depth: Any = 3,
        heads: Any = None,
    ):
        if str(tree) != "dynamic":
            raise InvalidArgumentError(
                f"--method hybrid builds its own tree; --tree {tree} is for probe only."
            )
        if shape not in ("auto", "tree", "chain"):
            raise InvalidArgumentError(
                f"option shape must be 'auto', 'tree' or 'chain', got {shape!r}"
            )
        self.shape = shape
        #: may run through recurrent layers (a chain there; prepare decides)
        self.chain_shaped = shape != "tree"
        self.chain = shape == "chain"
        self.masks_given = masks is not None
        self.masks = parse_int("masks", 1 if masks is None else masks, 0, 3)
        self._masks_opt = self.masks  # prepare may turn the default off per model
        if str(mtp) == "auto":
            self.mtp_opt: str | int = "auto"
        else:
            self.mtp_opt = parse_int("mtp", mtp, 0, 1)
        self.mtp_depth = parse_int("mtp_depth", mtp_depth, 1, 16)
        self.heads = heads
        self.drafter: Any = None
        self.auto, self.bc = parse_bc(bc, max_bc, 2)
        # ESP mask vectors (lam / mask_init parsed even when masks=0 turns probing off)
        self.vectors = MaskVectors(max(self.masks, 1), lam, mask_init)
        self.mask_init = mask_init
        self.matches = parse_int("matches", matches, 0, 16)
        self.window = parse_int("window", window, 1)
        self.max_draft = parse_int("max_draft", max_draft, 1) if max_draft is not None else None
        self.use_pool = bool(parse_int("pool", pool, 0, 1))

    @property
    def block_complexity(self) -> int:
        return self.bc

    def describe(self) -> str:
        init = "" if self.mask_init == "mean" else ", mask_init=learned"
        bc = f"auto<={self.bc}" if self.auto else str(self.bc)
        shape = ", shape=chain" if self.chain else ""
        mtp = f", mtp<={self.mtp_depth}" if self.drafter is not None else ""
        return f"hybrid(bc={bc}, masks={self.masks}, matches={self.matches}{shape}{mtp}{init})"

    def prepare(self, engine: Engine) -> None:
        recurrent = engine.rollback is not None
        mtype = getattr(engine.model, "model_type", "")
        self.masks = self._masks_opt
        if recurrent and self.shape == "tree":
            raise UnsupportedModelError(
                f"--method hybrid shape=tree cannot run model type {mtype!r}: its recurrent "
                "layers cannot run a branching draft tree. Use shape=chain (the default "
                "shape=auto picks it on such models)."
            )
        self.chain = self.shape == "chain" or (self.shape == "auto" and recurrent)
        if self.chain:
            if self.masks and not does_model_support_input_embeddings(engine.model):
                if self.masks_given:
                    raise UnsupportedModelError(
                        f"--method hybrid: model type {mtype!r} does not accept input "
                        "embeddings, so it cannot run mask slots (vectors). Use masks=0."
                    )
                self.masks = 0
            if self.masks and not recurrent:  # chain-shaped tree pass over attention layers
                check_tree_support(engine.model, self.name)
        else:
            check_tree_support(engine.model, self.name)
        if self.masks:
            self.vectors.prepare(engine)
        self.drafter = None
        if self.mtp_opt == 1 or (self.mtp_opt == "auto" and self._has_mtp(engine)):
            from .mtp import NativeDrafter

            self.drafter = NativeDrafter()
            self.drafter.prepare(engine, self.heads)

    def _has_mtp(self, engine: Engine) -> bool:
        """Whether the model's checkpoint (or ``heads``) has a native MTP layer."""
        loaded = getattr(engine, "loaded", None)
        folder = self.heads if self.heads is not None else getattr(loaded, "path", None)
        return folder is not None and has_native_mtp(folder, engine.model)

    @property
    def learned(self) -> mx.array | None:
        """(masks, D) learned mask vectors (``mask_init="learned"``), else None."""
        return self.vectors.learned

    def begin(self, engine: Engine, prompt: list[int], sampler: Sampler | None) -> None:
        super().begin(engine, prompt, sampler)
        if self.masks:
            self.vectors.begin(engine, prompt)
        if self.drafter is not None:
            self.drafter.begin(engine, prompt)
        self.begin_budget(engine, sampler, self.auto)
        self.dists: list[tuple[np.ndarray, np.ndarray]] = []
        self.stats = AcceptanceStats()
        self.table: dict[tuple[int, int], int] = {}

    # ------------------------------------------------------------ candidates
    def _chains(self, engine: Engine, root: int) -> list[tuple[str, list[int], list[float]]]:
        depth = self.max_draft or self.bc - 1
        qs = {src: self.stats.qs(src, depth) for src in ("pld", "pld_alt", "pool")}
        if self.budget is not None:  # bc=auto: no node worth next to nothing
            qs = {src: q[: _worth(q)] for src, q in qs.items()}
        chains: list[tuple[str, list[int], list[float]]] = []
        if self.matches > 0:
            context = np.array([*engine.cached, root], dtype=np.int64)
            most = max(len(qs["pld"]), len(qs["pld_alt"]))
            conts = lookup_candidates(context, self.window, most, self.matches) if most else []
            for r, toks in enumerate(conts):
                src = "pld" if r == 0 else "pld_alt"
                toks = toks[: len(qs[src])]
                if toks:
                    chains.append((src, toks, qs[src][: len(toks)]))
        if self.use_pool and self.table:
            prev = engine.cached[-1] if engine.cached else -1
            toks, a, b = [], prev, root
            while len(toks) < len(qs["pool"]) and (a, b) in self.table:
                nxt = self.table[(a, b)]
                toks.append(nxt)
                a, b = b, nxt
            if toks:
                chains.append(("pool", toks, qs["pool"][: len(toks)]))
        if self.drafter is not None:
            toks = self.drafter.draft(engine, min(self._mtp_depth(), depth))  # sized by auto
            if toks:
                chains.append(("mtp", toks, self.stats.qs("mtp", len(toks))))
        return chains

    def _mtp_depth(self) -> int:
        """MTP drafts this step: ``mtp_depth``, or with ``bc="auto"`` the depth
        at which the layer's drafts pay for themselves and their slots (its
        own pass per draft counted; at least one on a re-probe)."""
        b = self.budget
        if b is None:
            return self.mtp_depth
        qs = self.stats.qs("mtp", self.mtp_depth)
        n, _ = best_prefix(b.curve, chain_values(qs), 1, item_cost=self.drafter.draft_cost)
        if self._reprobe or b.cheap(1 + self.REPROBE_ITEMS):
            n = max(n, 1)
        return n

    # ------------------------------------------------------------------ step
    def observe_plain(self, engine: Engine, tokens: list[int]) -> None:
        # a one-token step of bc=auto's plain mode: no masks ran
        self.dists = []
        if self.masks:
            self.vectors.update(engine, tokens)
        if self.drafter is not None:
            self.drafter.plain(tokens, queued=self.plain_steps.ntp._next is not None)

    def propose(self, engine: Engine, root: int) -> Draft | None:
        k = self.masks
        trie = merge_chains(self._chains(engine, root))
        levels = self.dists
        scale = [self.stats.probe_scale(d + 1) for d in range(len(levels))]
        children = CandidateChildren(trie, levels, scale)

        if self.chain:
            return self._propose_chain(engine, root, children, levels)

        b = self.budget
        gain = self.stats.gain if k else 0.0
        if b is None:
            alloc = allocate(children, root, self.bc, k, gain)
        else:  # bc=auto: the best prefix under the device's cost curve
            cal = self.stats.calibration  # node values as recent steps bore them out
            bound = PrefixBound(b.curve, self.bc)  # allocates no further than it can pay
            alloc = allocate(children, root, self.bc, k, gain, 0.0, bound, cal, self.REPROBE_ITEMS)
            n, rate = bound.best_n, bound.best  # best_prefix of the items allocated
            reprobe = 1 + self.REPROBE_ITEMS * max(k, 1)
            if self._reprobe or b.cheap(reprobe):  # a re-probe (or a nearly free one)
                n = max(n, min(len(alloc.order), self.REPROBE_ITEMS))  # drafts a little anyway
            elif not b.pays(rate):
                b.go_plain(reprobe)
                return None
            alloc = alloc.prefix(n)
        alloc = alloc.heavy_first()  # an accepted best branch: no KV-row move in keep
        prev = engine.cached[-1] if engine.cached else -1  # token before the root
        n_tok = 1 + len(alloc.tokens)
        parents = [-1] + [p + 1 for p in alloc.parents]
        mask_row: dict[int, int] = {}  # anchor slot -> first mask slot
        for anchor in alloc.mask_anchors:
            mask_row[anchor] = len(parents)
            for j in range(k):
                parents.append(anchor if j == 0 else len(parents) - 1)
        n_mask = len(parents) - n_tok
        slot_tokens = np.array([root, *alloc.tokens] + [-1] * n_mask, dtype=np.int64)
        emb = engine.embed_tokens(slot_tokens[:n_tok])
        if n_mask:
            emb = mx.concatenate([emb, self.vectors.sets(len(alloc.mask_anchors), emb.dtype)])
        first_masks_top = None
        if n_mask:
            m = self.bc

            def first_masks_top(logits: mx.array, hidden: Any, targets: Any) -> tuple:
                # the first mask set (the most valuable anchor, usually the root)
                # is the one the next step reads most often: its top-k is built
                # while the pass runs and evaluated with the target tokens
                return top_candidates(logits[n_tok : n_tok + k], m)

        # with masks, logits only for the token slots and the first mask set;
        # another mask set goes through the LM head in observe() when its
        # anchor is the deepest accepted node (rows of the pass's hidden states)
        return Draft(
            slot_tokens,
            np.array(parents, dtype=np.int64),
            emb,
            n_tok,
            logit_rows=n_tok + k if n_mask else None,
            hidden=bool(n_mask) or self.drafter is not None,
            extras=first_masks_top,
            info=(alloc, levels, mask_row, prev),
        )

    def _propose_chain(
        self,
        engine: Engine,
        root: int,
        children: Callable[[tuple[int, ...], int], list[Child]],
        levels: list,
    ) -> Draft | None:
        """The chain shape: the most likely child at every depth, cut at the
        best length, then (masks > 0) k mask slots after its last node."""
        k = self.masks
        toks: list[int] = []
        probs: list[float] = []
        sources: list[list[Source]] = []
        path: tuple[int, ...] = ()
        tok, p = root, 1.0
        while len(toks) < self.bc - 1 - k:
            kids = children(path, tok)
            if not kids or kids[0].q <= 0.0:
                break
            c = kids[0]
            p *= c.q
            toks.append(c.token)
            probs.append(p)
            sources.append(c.sources)
            path, tok = path + (c.token,), c.token
        n, use_masks = len(toks), k > 0
        b = self.budget
        if b is not None:  # bc=auto: the best length, with or without the masks
            cal = self.stats.calibration  # node values as recent steps bore them out
            n, rate = best_prefix(b.curve, [p * cal for p in probs], 1)  # without masks
            use_masks = False
            if k:  # masks after node m: worth P(all m accepted) * gain next step
                gain = self.stats.gain
                for m in range(len(toks) + 1):
                    full = probs[m - 1] if m else 1.0
                    r = (1.0 + cal * sum(probs[:m]) + full * gain) / b.curve(1 + m + k)
                    if r > rate:
                        n, rate, use_masks = m, r, True
            if self._reprobe or b.cheap(1 + k + self.REPROBE_ITEMS):
                n = max(n, min(len(toks), self.REPROBE_ITEMS))
                use_masks = k > 0
            elif not b.pays(rate):
                b.go_plain(1 + k + self.REPROBE_ITEMS)
                return None
        toks, probs, sources = toks[:n], probs[:n], sources[:n]
        alloc = Allocation(toks, list(range(-1, n - 1)), probs, sources)
        prev = engine.cached[-1] if engine.cached else -1
        n_tok = 1 + n
        hidden = self.drafter is not None
        if not use_masks:
            return Draft.chain(root, toks, hidden=hidden, info=(alloc, levels, {}, prev))
        alloc.mask_anchors = [n_tok - 1]
        slot_tokens = np.array([root, *toks] + [-1] * k, dtype=np.int64)
        emb = engine.embed_tokens(slot_tokens[:n_tok])
        emb = mx.concatenate([emb, self.vectors.sets(1, emb.dtype)])
        info = (alloc, levels, {n_tok - 1: n_tok}, prev)
        parents = np.arange(-1, n_tok + k - 1, dtype=np.int64)
        return Draft(slot_tokens, parents, emb, n_tok, hidden=hidden, info=info)

    def observe(self, engine: Engine, draft: Draft, verified: Verified) -> None:
        alloc, levels, mask_row, prev = draft.info
        if self.drafter is not None:  # the MTP layer's pairs along the accepted path
            rows = verified.hidden[mx.array([0, *verified.path])]
            self.drafter.verified(rows, verified.tokens)
        # next step's probe candidates: the masks after v*, if it has any
        self.dists = []
        r0 = mask_row.get(verified.deepest)
        if r0 is not None:
            k = self.masks
            if draft.extras is not None and r0 == draft.n_verify:  # the first mask set
                self.dists = candidate_lists(*verified.extras)
            elif r0 + k <= verified.logits.shape[0]:
                self.dists = mask_candidates(verified.logits[r0 : r0 + k], self.bc, engine)
            else:  # a mask set outside the pass's logit rows
                rows = engine.lm_head(verified.hidden[r0 : r0 + k])
                self.dists = mask_candidates(rows, self.bc, engine)
        tgt = dict(enumerate(verified.targets.tolist()))
        parents = draft.parents
        if parents is None:  # a chain
            parents = np.arange(-1, len(draft.tokens) - 1, dtype=np.int64)
        self._learn(alloc, verified.path, levels, draft.tokens, parents, tgt, prev)
        if self.masks:
            self.vectors.update(engine, verified.tokens)

    def _learn(
        self,
        alloc: Allocation,
        path: list[int],
        levels: list,
        slot_tokens: np.ndarray,
        parents: np.ndarray,
        tgt: dict[int, int],
        prev: int,
    ) -> None:
        """Update acceptance statistics and the table of the model's predictions."""
        on_path = {0, *path}
        if self.budget is not None and alloc.tokens:  # only bc=auto reads it
            self.stats.record_step(sum(alloc.probs), len(path))
        probe_acc = 0
        for i, srcs in enumerate(alloc.sources):
            slot = i + 1
            if int(parents[slot]) in on_path:
                self.stats.record(srcs, slot in on_path)
                if slot in on_path and any(s[0] == "probe" for s in srcs):
                    probe_acc += 1
        if levels:
            self.stats.record_gain(probe_acc)
        if self.use_pool:
            for slot, t in tgt.items():
                p = int(parents[slot])
                before = prev if p < 0 else int(slot_tokens[p])
                self.table[(before, int(slot_tokens[slot]))] = int(t)
