"""``probe``: training-free multi-token prediction by embedding-space probing.

Goel, Gagrani, Lee, Lott, *Efficient Training-Free Multi-Token Prediction via
Embedding-Space Probing* (ESP, arXiv 2603.17942). Read top to bottom:

1. Mask slots are vectors in the input-embedding space, not vocabulary tokens.
   One vector ``m`` starts as the mean embedding of the prompt (§3.1) and moves
   towards each committed token ``e``: ``m <- m + lam * (e - m)``, lam = 0.1.
2. One forward pass carries the root (the last committed token), the draft-tree
   nodes, and k mask slots after every one of them (k = 1 or 2). A node at depth
   d sits at position L + d, its masks at L + d + 1 ... L + d + k. A node sees
   the cache, its ancestors and itself; a node's masks see that node's path and
   the earlier masks of the same set (§3.2).
3. Verification is lossless (greedy or sampling): the accepted path plus one
   bonus token, done by the shared stage :mod:`mlx_mtp.speculative` on the
   draft :meth:`Probe.propose` builds.
4. The k masks after the deepest accepted node predict the tokens 2..k+1
   positions after it, i.e. depths 1..k of the next step's tree, which is grown
   by cumulative probability within the block-complexity budget
   ``BC = (k + 1) * (1 + nodes)`` (§3.3), or laid out by a fixed template.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.utils import does_model_support_input_embeddings

from ..budget import DepthAcceptance, best_prefix, chain_values, tree_size
from ..engine import Engine, check_tree_support
from ..errors import InvalidArgumentError, UnsupportedModelError
from ..learned_masks import load_learned_masks
from ..speculative import Draft, Verified
from ..tree import block_complexity, build_tree, heavy_path_order, reorder_tree
from ..verify import Sampler
from .base import SpeculativeMethod, parse_bc, parse_int


def parse_template(tree: str, masks: int) -> list[int] | None:
    """``"dynamic"`` -> None; ``"14"`` or ``"6,3"`` -> nodes per depth.

    Raises:
        InvalidArgumentError: not a list of positive integers, or deeper than
            the number of masks (mask i can only draft depth i).
    """
    if tree == "dynamic":
        return None
    try:
        per_depth = [int(x) for x in str(tree).replace("x", ",").split(",") if x.strip()]
    except ValueError:
        per_depth = []
    if not per_depth or min(per_depth) < 1:
        raise InvalidArgumentError(
            f"--tree must be 'dynamic' or nodes per depth like '14' or '6,3', got {tree!r}"
        )
    if len(per_depth) > masks:
        raise InvalidArgumentError(
            f"--tree {tree} has depth {len(per_depth)} but --masks {masks} can draft only "
            f"{masks} level(s); use --masks {len(per_depth)} or a shallower template."
        )
    return per_depth


def mask_candidates(rows: mx.array, m: int, engine: Engine) -> list[tuple[np.ndarray, np.ndarray]]:
    """The ``m`` most probable tokens of each mask row, best first: the
    per-depth candidate lists that :func:`~mlx_mtp.tree.build_tree` grows the
    next draft tree from (ESP §3.2).

    Args:
        rows: (k, V) float32 logits of the k mask slots after the deepest
            accepted node.
        m: candidates per row (clipped to [1, V]).
        engine: the top-k runs through ``engine.timed_eval`` (device time).

    Returns:
        k pairs (tokens (m,) int, probabilities (m,) float32), probabilities
        descending.
    """
    top, top_p = top_candidates(rows, m)
    engine.timed_eval(top, top_p)  # vocabulary-wide top-k on k rows: device work
    return candidate_lists(top, top_p)


def top_candidates(rows: mx.array, m: int) -> tuple[mx.array, mx.array]:
    """The graph (not evaluated) behind :func:`mask_candidates`: token ids
    (k, m) and their probabilities (k, m) float32 of the ``m`` most probable
    tokens of each row of ``rows`` (k, V), in no particular order."""
    vocab = rows.shape[-1]
    m = min(max(m, 1), vocab)
    rows = rows.astype(mx.float32)
    top = mx.argpartition(rows, kth=vocab - m, axis=-1)[:, vocab - m :]
    top_p = mx.exp(
        mx.take_along_axis(rows, top, axis=-1) - mx.logsumexp(rows, axis=-1, keepdims=True)
    )
    return top, top_p


def candidate_lists(top: mx.array, top_p: mx.array) -> list[tuple[np.ndarray, np.ndarray]]:
    """Evaluated :func:`top_candidates` output -> per-row (tokens, probabilities)
    sorted by probability descending."""
    out = []
    for toks, ps in zip(np.array(top), np.array(top_p)):
        order = np.argsort(-ps, kind="stable")
        out.append((toks[order], ps[order]))
    return out


class MaskVectors:
    """ESP's mask slots (§3.1): ``slots`` vectors in the input-embedding space
    that stand for "some token to come" after a draft node.

    ``init="mean"`` (the paper): every slot starts as the mean embedding of
    the prompt and moves towards each committed token ``e``:
    ``m <- m + lam * (e - m)``. ``init="learned"``: fixed per-slot vectors
    trained by ``mlx-mtp train masks`` for this model
    (:mod:`mlx_mtp.learned_masks`), never updated. Shared by ``probe`` and
    ``hybrid``.

    Args:
        slots: mask slots after a node (k).
        lam: update step in [0, 1] (0.1 in the paper).
        init: ``"mean"`` or ``"learned"``.

    Raises:
        InvalidArgumentError: lam not a number in [0, 1], unknown init.
    """

    def __init__(self, slots: int, lam: Any = 0.1, init: str = "mean"):
        try:
            self.lam = float(lam)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"option lam must be a number, got {lam!r}") from None
        if not 0.0 <= self.lam <= 1.0:
            raise InvalidArgumentError(f"option lam must be in [0, 1], got {self.lam}")
        if init not in ("mean", "learned"):
            raise InvalidArgumentError(f"mask_init must be 'mean' or 'learned', got {init!r}")
        self.slots = slots
        self.init = init
        #: (slots, D) learned vectors once :meth:`prepare` loaded them
        self.learned: mx.array | None = None
        #: (slots, D) current vectors, set by :meth:`begin`
        self.embedding: mx.array | None = None

    def prepare(self, engine: Engine) -> None:
        """Load the learned vectors for this model (``init="learned"``).

        Raises:
            CheckpointMismatchError, ModelNotFoundError: see
                :func:`~mlx_mtp.learned_masks.load_learned_masks`.
            InvalidArgumentError: the file has fewer slots than needed.
        """
        if self.init != "learned":
            return

        learned = load_learned_masks(engine.model)  # (slots, D), checked for this model
        if learned.shape[0] < self.slots:
            raise InvalidArgumentError(
                f"the learned mask file has {learned.shape[0]} slot(s); --masks "
                f"{self.slots} needs {self.slots}. Retrain with more slots."
            )
        self.learned = learned[: self.slots]

    def begin(self, engine: Engine, prompt: list[int]) -> None:
        """Start a generation: learned vectors, or the prompt's mean embedding."""
        if self.learned is not None:
            self.embedding = self.learned
        else:
            mean = mx.mean(engine.embed_tokens(prompt), axis=0)
            self.embedding = mx.broadcast_to(mean, (self.slots, mean.shape[0]))

    def update(self, engine: Engine, tokens: list[int]) -> None:
        """``m <- m + lam (e - m)`` once per committed token, in order (mean
        init only; learned vectors stay fixed)."""
        if self.learned is not None:
            return
        e = engine.embed_tokens(tokens)  # (n, D)
        m, n, lam = self.embedding, len(tokens), self.lam
        if n == 1:
            self.embedding = m + lam * (e - m)
        else:  # the n updates in closed form: (1-lam)^n m + sum_i lam (1-lam)^(n-1-i) e_i
            w = mx.array([lam * (1 - lam) ** (n - 1 - i) for i in range(n)], dtype=e.dtype)
            self.embedding = (1 - lam) ** n * m + (w @ e)

    def sets(self, count: int, dtype: mx.Dtype) -> mx.array:
        """``count`` mask sets, one after another: (count * slots, D)."""
        return mx.tile(self.embedding.astype(dtype), (count, 1))


class Probe(SpeculativeMethod):
    """ESP embedding-space probing with a lossless draft tree.

    Args:
        bc: block complexity, tokens per forward pass (10 and 30 are the edge
            settings, 60 the paper's large one; None: "auto"). A template sets its
            own BC, ``(masks + 1) * (1 + sum(template))``; a different ``bc``
            with it is refused. ``"auto"`` (default): up to ``max_bc`` slots,
            each step keeps the prefix of the best-first tree that maximises
            expected tokens per unit of time under this device's forward cost
            curve (:mod:`mlx_mtp.budget`), with the mask probabilities
            calibrated online against this generation's accepted tokens, and
            runs one-token steps (no masks) while no tree pays, re-probing
            periodically (not in the ESP paper). ``30`` is the paper's edge
            setting.
        masks: mask slots after every node, k = 1 or 2 (3 allowed).
        tree: ``"dynamic"`` or a template of nodes per depth (``"14"``, ``"6,3"``).
        lam: step size of the mask-vector update (0.1 in the paper).
        mask_init: ``"mean"`` (the paper: mean prompt embedding, moved towards
            every committed token) or ``"learned"`` (fixed per-slot vectors
            trained by ``mlx-mtp train masks`` for this model; see
            :mod:`mlx_mtp.learned_masks`).
        max_bc: the cap of ``bc="auto"`` (default 64).
        shape: ``"tree"`` (the paper) or ``"chain"``: one forward pass is the
            chain ``[root, d1..dk, m1..mk]`` (d_i the top-1 token of mask i of
            the last pass, the k masks after the last draft only), so it can
            run through the recurrent layers of hybrid models (Qwen3.5); the
            masks draft the next chain only when every draft was accepted
            (otherwise the next pass is ``[root, m1..mk]``). Not in the ESP
            paper. Block complexity ``2k + 1``. With ``bc="auto"`` (the
            default) the chain is cut per step at the length that maximises
            expected tokens per unit of time under the device's cost curve
            (per-depth acceptance learned online, the k masks counted as
            base slots), and the method runs one-token steps with periodic
            re-probes while no chain pays (:mod:`mlx_mtp.budget`); a fixed
            ``bc`` must be ``2k + 1``.

    Raises:
        InvalidArgumentError: a BC too small for one node, bad masks or tree.
    """

    name = "probe"
    lossless = True

    def __init__(
        self,
        bc: Any = None,
        masks: Any = 1,
        tree: str = "dynamic",
        lam: Any = 0.1,
        mask_init: str = "mean",
        max_bc: Any = 64,
        shape: str = "tree",
    ):
        if shape not in ("tree", "chain"):
            raise InvalidArgumentError(f"option shape must be 'tree' or 'chain', got {shape!r}")
        self.shape = shape
        #: a chain-shaped probe also runs on hybrid recurrent models
        self.chain_shaped = shape == "chain"
        self.masks = parse_int("masks", masks, 1, 3)
        self.template = parse_template(str(tree), self.masks)
        if self.template is None and shape == "chain" and bc is not None and str(bc) != "auto":
            # a fixed chain: [root, d1..dk, m1..mk], block complexity 2k + 1
            if parse_int("bc", bc, 1) != 2 * self.masks + 1:
                raise InvalidArgumentError(
                    f"probe shape=chain with masks={self.masks} has block complexity "
                    f"{2 * self.masks + 1}; bc={bc} does not match it. Use bc=auto (the "
                    "default) or drop bc."
                )
            self.auto, self.nodes = False, 0
        elif self.template is None:
            self.auto, bc = parse_bc("auto" if bc is None else bc, max_bc, 2 * (self.masks + 1))
            self.nodes = bc // (self.masks + 1) - 1
        else:
            if str(bc) == "auto":
                raise InvalidArgumentError("bc=auto sizes a dynamic tree; drop --tree or bc=auto.")
            self.auto = False
            self.nodes = sum(self.template)
            fixed = block_complexity(self.masks, self.nodes)
            if bc is not None and parse_bc(bc, max_bc, 2)[1] != fixed:
                raise InvalidArgumentError(
                    f"--tree {tree} with --masks {self.masks} has block complexity {fixed}; "
                    f"--bc {bc} does not match it. Drop --bc (the template sets the tree size)."
                )
        self.vectors = MaskVectors(self.masks, lam, mask_init)
        self.mask_init = mask_init

    @property
    def block_complexity(self) -> int:
        if self.shape == "chain":
            return 2 * self.masks + 1
        return block_complexity(self.masks, self.nodes)

    def describe(self) -> str:
        if self.shape == "chain":
            bc = "auto" if self.auto else str(2 * self.masks + 1)
            return f"probe(shape=chain, masks={self.masks}, bc={bc})"
        tree = "dynamic" if self.template is None else ",".join(map(str, self.template))
        init = "" if self.mask_init == "mean" else ", mask_init=learned"
        bc = f"auto<={self.block_complexity}" if self.auto else str(self.block_complexity)
        return f"probe(bc={bc}, masks={self.masks}, tree={tree}{init})"

    def prepare(self, engine: Engine) -> None:
        if self.shape == "chain" and engine.rollback is not None:
            if not does_model_support_input_embeddings(engine.model):
                raise UnsupportedModelError(
                    f"--method probe: model type {engine.model.model_type!r} does not accept "
                    "input embeddings (mask slots are vectors). Use --method mtp or pld."
                )
        else:
            check_tree_support(engine.model, self.name)
        self.vectors.prepare(engine)

    @property
    def learned(self) -> mx.array | None:
        """(masks, D) learned mask vectors (``mask_init="learned"``), else None."""
        return self.vectors.learned

    @property
    def mask_embedding(self) -> mx.array:
        """(masks, D) current mask vectors."""
        return self.vectors.embedding

    def _update_mask(self, engine: Engine, tokens: list[int]) -> None:
        self.vectors.update(engine, tokens)

    def begin(self, engine: Engine, prompt: list[int], sampler: Sampler | None) -> None:
        super().begin(engine, prompt, sampler)
        self.vectors.begin(engine, prompt)
        self.dists: list[tuple[np.ndarray, np.ndarray]] = []
        # bc=auto: the device's cost curve and plain mode (mlx_mtp.budget), and
        # accepted / expected drafted nodes (decayed: the calibration follows the text)
        self.begin_budget(engine, sampler, self.auto)
        # accepted / expected draft tokens, decayed; the prior (scale 1) has a
        # weight that decays with them, so that a tree whose nodes keep failing
        # is scaled down to what they really get (a fixed +1 kept the scale
        # about 3x too high at 6% acceptance: probe drafted on every step)
        self.expected, self.hits, self.prior_weight = 0.0, 0.0, 1.0
        #: shape=chain, bc=auto: acceptance per chain depth
        self.acceptance = DepthAcceptance()
        self._reprobe_next = False

    def _propose_chain(self, root: int, engine: Engine) -> Draft | None:
        # [root, d1..dn, m1..mk]: one chain (the top candidate of each mask
        # slot, then k masks after the last one), so a prefix can be kept on
        # any cache, recurrent layers included
        k = self.masks
        drafts = [int(toks[0]) for toks, _ in self.dists[:k]]
        b = self.budget
        if b is not None:  # bc=auto: cut the chain where it stops paying
            # the masks ride along on every draft step (they draft the next
            # chain): base slots 1 + k; the rate of a step with the longest
            # chain the estimates can offer also decides a masks-only step
            # (after a partial accept), an investment in the next chain
            values = chain_values(self.acceptance.qs(k))
            n, rate = best_prefix(b.curve, values[: len(drafts)] or values, 1, base_slots=1 + k)
            if self._reprobe_next:  # the second step of a re-probe: verify its drafts
                self._reprobe, self._reprobe_next = True, False
            if self._reprobe or b.cheap(1 + 2 * k):  # a re-probe (or a nearly free step)
                n = len(drafts)
                # a re-probe from plain mode has no drafts yet: its masks draft
                # the chain the next step verifies
                self._reprobe_next = self._reprobe and not drafts
            elif not b.pays(rate):
                b.go_plain(1 + k)
                return None
            drafts = drafts[:n]
        n_tok = 1 + len(drafts)
        slot_tokens = np.array([root, *drafts] + [-1] * k, dtype=np.int64)
        emb = engine.embed_tokens(slot_tokens[:n_tok])

        def masks_top(logits: mx.array, hidden: Any, targets: Any) -> tuple[mx.array, ...]:
            return top_candidates(logits[n_tok:], 1)

        return Draft(
            slot_tokens,
            np.arange(-1, n_tok + k - 1),
            mx.concatenate([emb, self.vectors.embedding.astype(emb.dtype)]),
            verify=n_tok,
            extras=masks_top,
            info="chain",
        )

    def observe_plain(self, engine: Engine, tokens: list[int]) -> None:
        # a one-token step: no masks ran, so the next draft step starts from a
        # re-probe of the root's masks
        self.vectors.update(engine, tokens)
        self.dists = []

    def propose(self, engine: Engine, root: int) -> Draft | None:
        if self.shape == "chain":
            return self._propose_chain(root, engine)
        k = self.masks
        node_toks, node_par, node_p = build_tree(self.dists, self.nodes, root, self.template)
        b = self.budget
        if b is not None:
            w = self.prior_weight
            scale = (self.hits + w) / (self.expected + w)
            n, rate = tree_size(b.curve, node_p, k, scale)
            # no tree pays: one-token steps, unless this is the re-probe (or the
            # first step), whose root masks give the next step's candidates;
            # the step after a re-probe drafts one node anyway (fresh evidence
            # for the calibration, which no longer falls back to its prior)
            explore = self._reprobe_step and self.dists
            if self.dists and not (self._reprobe or explore or b.pays(rate) or b.cheap(k + 1)):
                b.go_plain(k + 1, 2 * (k + 1))  # the re-probe and its one-node step
                return None
            if explore:
                n = max(n, min(1, len(node_toks)))
            node_toks, node_par = node_toks[:n], node_par[:n]
            if n:
                self.expected = 0.95 * self.expected + float(sum(node_p[:n]))
                self.prior_weight *= 0.95
        # the most probable path first: an accepted prefix needs no KV-row move
        order = heavy_path_order(node_par, node_p[: len(node_toks)])
        node_toks, node_par = [node_toks[i] for i in order], reorder_tree(order, node_par)
        n_tok = 1 + len(node_toks)
        # slots: [root, nodes...] then k chained masks after every token slot
        parents = [-1] + [p + 1 for p in node_par]
        for anchor in range(n_tok):
            for j in range(k):
                parents.append(anchor if j == 0 else len(parents) - 1)
        slot_tokens = np.array([root, *node_toks] + [-1] * (n_tok * k), dtype=np.int64)
        emb = engine.embed_tokens(slot_tokens[:n_tok])
        nodes = self.nodes

        def root_masks_top(logits: mx.array, hidden: Any, targets: Any) -> tuple[mx.array, ...]:
            # when no draft is accepted (most steps) the root's masks draft the next
            # tree: their top-k is built while the pass runs
            return top_candidates(logits[n_tok : n_tok + k], nodes)

        # logits only for the token slots and the root's masks (n_tok .. n_tok+k-1);
        # other mask rows go through the LM head in observe() if they are needed
        return Draft(
            slot_tokens,
            np.array(parents, dtype=np.int64),
            mx.concatenate([emb, self.vectors.sets(n_tok, emb.dtype)]),
            verify=n_tok,
            logit_rows=n_tok + k,
            hidden=True,
            extras=root_masks_top,
        )

    def observe(self, engine: Engine, draft: Draft, verified: Verified) -> None:
        if draft.info == "chain":
            # the masks follow the last draft: they predict after the bonus
            # token only if every draft was accepted
            a = len(verified.path)
            full = a == draft.drafted
            self.dists = candidate_lists(*verified.extras) if full else []
            self.vectors.update(engine, verified.tokens)
            if self.budget is not None and draft.drafted:
                if self._reprobe_step and full:
                    self.acceptance.reset()  # the text changed: old rates no longer apply
                self.acceptance.record(draft.drafted, a)
            return
        # the k masks after the deepest accepted node draft the next tree
        k, n_tok, vstar = self.masks, draft.n_verify, verified.deepest
        if vstar == 0:
            self.dists = candidate_lists(*verified.extras)
        else:
            h_masks = verified.hidden[n_tok + vstar * k : n_tok + (vstar + 1) * k]
            self.dists = mask_candidates(engine.lm_head(h_masks), self.nodes, engine)
        if draft.drafted:
            self.hits = 0.95 * self.hits + len(verified.path)
        self.vectors.update(engine, verified.tokens)
