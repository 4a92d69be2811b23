"""``hybrid``: one lossless draft tree filled from several draft sources.

Not from a paper: it combines ESP embedding-space probing (Goel et al., arXiv
2603.17942), prompt-lookup decoding (Saxena, 2023), the model's own earlier
predictions (lookahead's pool, Fu et al., 2024; token recycling, Luo et al.,
2024). Read top to bottom:

1. Sources (:mod:`mlx_mtp.sources`): ``pld`` (the most recent prompt-lookup
   match) and ``pld_alt`` (further matches) as chains; ``pool``: a chain
   through the model's target tokens after every earlier verified slot;
   ``recycle``: under every node, the model's top-k after its token
   (:mod:`~mlx_mtp.sources.recycle`); ``probe``: the masks after the last
   step's deepest accepted node predict depths 1..k, under every node of the
   depth before; ``mtp`` / ``draft``: a native MTP layer's chain, a draft
   model's chain and alternatives.
2. One scale: each candidate gets a conditional acceptance estimate q per
   source and depth (rank for ``recycle``), learned online by the planner; a
   mask candidate's is its probability times a per-depth calibration.
   Sources that agree are merged by noisy-or (:mod:`mlx_mtp.allocate`).
3. The slot budget ``BC`` (root + nodes + mask slots) is spent best-first by
   value per slot (:class:`~mlx_mtp.allocate.Allocator`); with
   ``bc="auto"`` the planner cuts it where expected tokens per time peak.
4. Verification: the shared lossless stage; :meth:`Hybrid.observe` feeds the
   pool, the table, the next probe candidates and the MTP layer.

Chain shape (``shape="chain"``, and ``"auto"`` on hybrid recurrent models such
as Qwen3.5 / Qwen3-Next, which cannot run a branching tree): the most likely
child at every depth, then k mask slots (none on models that take no input
embeddings); the recurrent state is rolled back (:mod:`mlx_mtp.recurrent`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.utils import does_model_support_input_embeddings

from ..acceptance import AcceptanceModel, CalibrationModel, chain_values
from ..allocate import Allocation, Allocator, CandidateChildren, merge_chains
from ..context import Context
from ..errors import InvalidArgumentError, UnsupportedModelError
from ..families import check_tree_support
from ..native_mtp import has_native_mtp
from ..offers import Item, Offer, PlainResult
from ..pipeline import CompositeDrafter
from ..sources.draft import DraftModel, parse_width
from ..sources.lookup import LookupDrafter, PromptLookup
from ..sources.masks import (
    MaskDrafter,
    MaskLayer,
    MaskVectors,
    candidate_lists,
    mask_candidates,
    top_candidates,
)
from ..sources.native import NativeDrafter
from ..sources.pool import PredictionPool
from ..sources.recycle import DEEP, DEEP_PRIORS, RANK_PRIORS, RecycleDrafter, RecycleTable
from ..speculative import Draft, Verified
from ..verify import Sampler
from .base import DraftMethod, parse_bc, parse_int
from .clp import CLP, HeadsDrafter, span_priors
from .pld import PLD
from .probe import Probe

#: prior conditional acceptance rate per chain source (Beta prior mean)
PRIORS = {"pld": 0.5, "pld_alt": 0.3, "pool": 0.3, "mtp": 0.5}
Chain = tuple[str, list[int], list[float]]  # (source, tokens, conditional estimates)
#: deepest depth with its own statistics (deeper ones share the last bucket)
MAX_STAT_DEPTH = 12
#: ``bc=auto``: chain nodes whose own path estimate falls below this (expected
#: accepted tokens) are not offered: host time for nothing the cut would keep
CHAIN_FLOOR = 1e-3


def _worth(qs: Sequence[float]) -> int:
    """Length of the chain prefix whose nodes are each worth at least
    ``CHAIN_FLOOR`` expected tokens on their own (product of q down to them)."""
    return sum(v >= CHAIN_FLOOR for v in chain_values(qs))


class Hybrid(DraftMethod):
    """Hybrid draft tree (see the module doc): every source, one acceptance
    scale, one block-complexity budget; lossless.

    Args:
        bc: block complexity = slots per forward pass (root + nodes + masks),
            or ``"auto"`` (default): up to ``max_bc`` slots, cut per step
            under the device's cost curve, plain steps while nothing pays
            (:mod:`mlx_mtp.planner`). 10 and 30 are fixed edge settings.
        masks: mask slots per mask set, k = 0..3 (0: no probing); default 1,
            or 0 in chain shape on a model that takes no input embeddings.
        matches: distinct prompt-lookup continuations per step.
        window: longest n-gram matched by prompt lookup.
        max_draft: longest chain per source (default: bc - 1).
        pool: 1 to draft from the table of the model's earlier predictions.
        recycle: 1 to draft from token recycling's table of the model's
            top-8 after every token, kept across generations (default 0:
            every plain step then also computes the top-8, and the tau gain
            is not yet measured to pay for it).
        max_bc: the cap of ``bc="auto"`` (default 64).
        lam, mask_init: as in :class:`~mlx_mtp.methods.probe.Probe`
            (``mask_init="learned"`` loads :mod:`mlx_mtp.learned_masks`).
        shape: ``"auto"`` (default: a chain on hybrid recurrent models, a
            tree elsewhere), ``"tree"`` or ``"chain"`` (see module doc).
        mtp: ``"auto"`` (default: the checkpoint's native MTP layer if it has
            one), 1 (required: an error without one) or 0 (off).
        mtp_depth: the longest MTP chain per step (default 3; with ``auto``
            the depth that pays, the layer's passes counted).
        heads: the MTP layer's folder (default: the model's own).
        draft_model, draft_width: a draft model (as ``--method draft`` takes
            it) and its candidates per depth (default 4).
        clp: 1 to draft from the model's CLP heads too (Xie & Zhou, CLP §3:
            their chain after each step's deepest accepted slot), found as
            ``--method clp`` finds them or named by ``clp_heads``; pipelined
            steps only (:attr:`planner_steps`), as a part of the pipelined
            tree (:class:`~mlx_mtp.methods.clp.HeadsDrafter`).
        clp_heads: the heads' folder or hub repo id (default: by fingerprint).

    Raises:
        InvalidArgumentError: bad option values (bc < 2, a fixed tree, ...).
        UnsupportedModelError: (prepare) ``shape="tree"`` on a recurrent
            model, masks on a model without input embeddings, ``mtp=1``
            without a native MTP layer.
    """

    name = "hybrid"
    lossless = True
    #: per source and depth, no forgetting; mask candidates calibrated per
    #: depth (prior 1); the whole draft scaled by accepted / predicted tokens
    ACCEPTANCE = AcceptanceModel(
        priors={**PRIORS, "probe": 1.0, "draft": 1.0, "recycle": RANK_PRIORS},
        default_prior=0.3,
        weight=4.0,
        decay=1.0,
        max_depth=MAX_STAT_DEPTH,
        reset_on_probe_hit=False,
        calibration=CalibrationModel(decay=0.9, weight=1.0, cap=1.5),
    )

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
        recycle: Any = 0,
        max_bc: Any = 64,
        shape: str = "auto",
        mtp: Any = "auto",
        mtp_depth: Any = 3,
        heads: Any = None,
        draft_model: Any = None,
        draft_width: Any = 4,
        clp: Any = 0,
        clp_heads: Any = None,
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
        self.mtp_opt: str | int = "auto" if str(mtp) == "auto" else parse_int("mtp", mtp, 0, 1)
        self.mtp_depth = parse_int("mtp_depth", mtp_depth, 1, 16)
        self.heads = heads
        self.drafter: NativeDrafter | None = None
        self.auto, self.bc = parse_bc(bc, max_bc, 2)
        # ESP mask vectors (lam / mask_init parsed even when masks=0 turns probing off)
        self.vectors = MaskVectors(max(self.masks, 1), lam, mask_init)
        self.mask_init = mask_init
        self.lookup = PromptLookup(
            parse_int("window", window, 1), parse_int("matches", matches, 0, 16)
        )
        self.max_draft = parse_int("max_draft", max_draft, 1) if max_draft is not None else None
        self.use_pool = bool(parse_int("pool", pool, 0, 1))
        self.recycle = RecycleTable() if parse_int("recycle", recycle, 0, 1) else None
        self.plain_topk = self.recycle.k if self.recycle is not None else 0
        drafting = draft_model not in (None, "")
        self.draft = DraftModel(draft_model, parse_width(draft_width)) if drafting else None
        self._pool_table: RecycleTable | None = None  # the pool's, for pipelined steps
        use_clp = bool(parse_int("clp", clp, 0, 1))
        clp_heads = None if clp_heads in (None, "") else str(clp_heads)
        if clp_heads is not None and not use_clp:
            raise InvalidArgumentError("option clp_heads names CLP heads for clp=1; add clp=1.")
        self.clp = CLP(heads=clp_heads) if use_clp else None
        #: the planner's tree has no CLP source: with clp=1, pipelined steps only
        self.planner_steps = self.clp is None

    @property
    def block_complexity(self) -> int:
        return self.bc

    def describe(self) -> str:
        init = "" if self.mask_init == "mean" else ", mask_init=learned"
        bc = f"auto<={self.bc}" if self.auto else str(self.bc)
        shape = ", shape=chain" if self.chain else ""
        mtp = f", mtp<={self.mtp_depth}" if self.drafter is not None else ""
        loaded = getattr(self.draft, "loaded", None)
        draft = "" if self.draft is None else f", draft={getattr(loaded, 'name', self.draft.spec)}"
        rec = "" if self.recycle is None else ", recycle"
        rec += "" if self.clp is None else ", clp"
        m = self.lookup.matches
        return f"hybrid(bc={bc}, masks={self.masks}, matches={m}{shape}{mtp}{draft}{rec}{init})"

    def prepare(self, ctx: Context) -> None:
        model = ctx.engine.model
        recurrent = ctx.engine.rollback is not None
        mtype = getattr(model, "model_type", "")
        self.masks = self._masks_opt
        if recurrent and self.shape == "tree":
            raise UnsupportedModelError(
                f"--method hybrid shape=tree cannot run model type {mtype!r}: its recurrent "
                "layers cannot run a branching draft tree. Use shape=chain (the default "
                "shape=auto picks it on such models)."
            )
        self.chain = self.shape == "chain" or (self.shape == "auto" and recurrent)
        if self.chain and self.masks and not does_model_support_input_embeddings(model):
            if self.masks_given:
                raise UnsupportedModelError(
                    f"--method hybrid: model type {mtype!r} does not accept input "
                    "embeddings, so it cannot run mask slots (vectors). Use masks=0."
                )
            self.masks = 0
        if not self.chain or (self.masks and not recurrent):  # a tree pass over attention
            check_tree_support(model, self.name)
        if self.masks:
            self.vectors.prepare(ctx.engine)
        self.drafter = None
        folder = self.heads if self.heads is not None else ctx.folder
        has_mtp = folder is not None and has_native_mtp(folder, model)
        if self.mtp_opt == 1 or (self.mtp_opt == "auto" and has_mtp):
            self.drafter = NativeDrafter()
            self.drafter.prepare(ctx, self.heads)
        if self.clp is not None and (self.drafter or self.draft or self.chain):
            raise InvalidArgumentError(
                "--method hybrid clp=1 runs on pipelined steps, whose tree takes no "
                "MTP layer, draft model or chain shape; drop clp=1, or use mtp=0, no "
                "draft_model and shape=tree with it."
            )
        for source in (self.draft, self.recycle, self.clp):  # models and tables of their own
            if source is not None:
                source.prepare(ctx)

    def device_drafter(self, ctx: Context) -> CompositeDrafter | None:
        """Pipelined steps (:mod:`mlx_mtp.pipeline`) draft from prompt lookup
        and a table of the model's own predictions (token recycling's with
        ``recycle=1``, else one prediction per token, which stands in for the
        pool), the mask slots' candidates and, with ``clp=1``, the CLP
        heads' chain; a hybrid with an MTP layer, a draft model or chain
        shape runs the planner's steps."""
        if self.drafter is not None or self.draft is not None or self.chain:
            return None
        most = self.max_width
        parts: list[Any] = [LookupDrafter(self.lookup.window, most)]
        if self.recycle is not None or self.use_pool:
            if self.recycle is None and self._pool_table is None:
                self._pool_table = RecycleTable(k=1)
            table = self.recycle if self.recycle is not None else self._pool_table
            table.prepare(ctx)
            parts.append(RecycleDrafter(table))
        if self.masks:
            parts.append(MaskDrafter(MaskLayer(self.vectors, top=min(most, 16))))
        if self.clp is not None:
            parts.append(HeadsDrafter(self.clp))
        return CompositeDrafter(parts)

    @property
    def max_width(self) -> int:
        return max(self.bc // (self.masks + 1) - 1, 1)

    def pipeline_acceptance(self) -> AcceptanceModel:
        k = self.recycle.k if self.recycle is not None else 1
        return AcceptanceModel(
            priors={
                **PLD.PIPELINE_ACCEPTANCE.priors,
                **Probe.PIPELINE_ACCEPTANCE.priors,
                "recycle": RANK_PRIORS[:k],
                DEEP: DEEP_PRIORS[:k],
                **(span_priors(self.clp.k) if self.clp is not None else {}),
            },
            default_prior=0.6,
            weight=2.0,
            decay=0.95,
            max_depth=max(MAX_STAT_DEPTH, k),
        )

    @property
    def learned(self) -> mx.array | None:
        """(masks, D) learned mask vectors (``mask_init="learned"``), else None."""
        return self.vectors.learned

    def begin(self, ctx: Context, prompt: list[int], sampler: Sampler | None) -> None:
        super().begin(ctx, prompt, sampler)
        if self.masks:
            self.vectors.begin(ctx.engine, prompt)
        if self.drafter is not None:
            self.drafter.begin(ctx.engine, prompt)
        self.dists: list[tuple[np.ndarray, np.ndarray]] = []
        self.pool = PredictionPool()
        for source in (self.recycle, self.draft):
            if source is not None:
                source.begin(prompt)

    # ------------------------------------------------------------ candidates
    def _chains(self, ctx: Context, root: int, drafted: bool) -> list[Chain]:
        depth = self.max_draft or self.bc - 1
        acc, engine = ctx.acceptance, ctx.engine
        qs = {src: acc.qs(src, depth) for src in ("pld", "pld_alt", "pool")}
        if self.auto:  # no node worth next to nothing
            qs = {src: q[: _worth(q)] for src, q in qs.items()}
        chains: list[Chain] = []
        most = max(len(qs["pld"]), len(qs["pld_alt"]))
        for r, toks in enumerate(self.lookup.candidates(ctx, root, most)):
            src = "pld" if r == 0 else "pld_alt"
            toks = toks[: len(qs[src])]
            if toks:
                chains.append((src, toks, qs[src][: len(toks)]))
        if self.use_pool:
            toks = self.pool.chain(ctx.previous(root), root, len(qs["pool"]))
            if toks:
                chains.append(("pool", toks, qs["pool"][: len(toks)]))
        if self.drafter is not None:
            # the layer's drafts cost a pass each: the planner sizes the chain
            n = ctx.budget.chain_length("mtp", self.mtp_depth, self.drafter.draft_cost)
            toks = self.drafter.draft(engine, min(n, depth))
            if toks:
                chains.append(("mtp", toks, acc.qs("mtp", len(toks))))
        if drafted:  # the draft model's chain and its alternatives
            chains += self.draft.candidates(ctx, root, min(depth, 8), self.auto)
        return chains

    # ------------------------------------------------------------------ step
    def propose(self, ctx: Context, root: int) -> Offer:
        k, acc = self.masks, ctx.acceptance
        levels = self.dists
        scale = [acc.q("probe", d + 1) for d in range(len(levels))]
        by_token = self.recycle.children(acc) if self.recycle is not None else None
        drafted = self.draft is not None and (not self.auto or self.draft.pays(ctx))
        trie = merge_chains(self._chains(ctx, root, drafted))
        children = CandidateChildren(trie, levels, scale, by_token=by_token)
        gains = ("probe",) * bool(levels) + ("draft",) * drafted
        # no mask candidates, draft model or MTP layer: the draft took no device work
        free = not levels and not drafted and self.drafter is None
        if self.chain:
            offer = self._chain_offer(ctx, root, children, gains)
            offer.free = free
            return offer
        tree = Allocator(children, root, self.bc, k, acc.gain("probe") if k else 0.0)

        def build(n: int) -> Draft:
            # an accepted best branch laid out first: no KV-row move in keep
            return self._draft(ctx, root, tree.alloc.prefix(n).heavy_first())

        return Offer(
            tree, build, max_slots=self.bc, remaining=tree.remaining, gains=gains, free=free
        )

    def _chain_offer(self, ctx: Context, root: int, children: Any, gains: tuple) -> Offer:
        """The chain shape: the most likely child at every depth, then (masks
        > 0) k mask slots after its last node, riding along on every step."""
        k = self.masks
        alloc = Allocation()
        path: tuple[int, ...] = ()
        tok, p = root, 1.0
        while len(alloc.tokens) < self.bc - 1 - k:
            kids = children(path, tok)
            if not kids or kids[0].q <= 0.0:
                break
            c = kids[0]
            p *= c.q
            alloc.tokens.append(c.token)
            alloc.parents.append(len(alloc.tokens) - 2)
            alloc.probs.append(p)
            alloc.sources.append(c.sources)
            alloc.order.append((False, p, 1))
            path, tok = path + (c.token,), c.token

        def build(n: int) -> Draft:
            a = alloc.prefix(n)
            if k:
                a.mask_anchors = [n]
            return self._draft(ctx, root, a, chain=True)

        items = [Item(v) for v in alloc.probs]
        return Offer(items, build, base_slots=1 + k, primes=k > 0, gains=gains)

    def _draft(self, ctx: Context, root: int, alloc: Allocation, chain: bool = False) -> Draft:
        """The forward pass of an allocation: its nodes, then k mask slots
        after every mask anchor."""
        k, engine, prev = self.masks, ctx.engine, ctx.previous(root)
        n_tok = 1 + len(alloc.tokens)
        parents = [-1] + [p + 1 for p in alloc.parents]
        mask_row: dict[int, int] = {}  # anchor slot -> first mask slot
        for anchor in alloc.mask_anchors:
            mask_row[anchor] = len(parents)
            for j in range(k):
                parents.append(anchor if j == 0 else len(parents) - 1)
        n_mask = len(parents) - n_tok
        hidden = bool(n_mask) or self.drafter is not None
        info = (mask_row, prev)
        first, rec, m = bool(n_mask) and not chain, self.recycle, self.bc
        extras = None
        if first or rec is not None:

            def extras(logits: mx.array, hidden: Any, targets: Any) -> list:
                # built while the pass runs, evaluated with the target tokens: the
                # first mask set's top-k (its anchor, usually the root, is the one
                # the next step reads most often) and the token slots' for the table
                out = list(top_candidates(logits[n_tok : n_tok + k], m)) if first else []
                return out + ([rec.graph(logits, n_tok)] if rec is not None else [])

        if chain and not n_mask:
            return Draft.chain(
                root, alloc.tokens, hidden=hidden, extras=extras, tags=alloc.sources, info=info
            )
        slot_tokens = np.array([root, *alloc.tokens] + [-1] * n_mask, dtype=np.int64)
        emb = engine.embed_tokens(slot_tokens[:n_tok])
        if n_mask:
            emb = mx.concatenate([emb, self.vectors.sets(len(alloc.mask_anchors), emb.dtype)])
        # with masks, logits only for the token slots and the first mask set;
        # another mask set goes through the LM head in observe() when its
        # anchor is the deepest accepted node (rows of the pass's hidden states)
        return Draft(
            slot_tokens,
            np.array(parents, dtype=np.int64),
            emb,
            n_tok,
            logit_rows=n_tok + k if first else None,
            hidden=hidden,
            extras=extras,
            tags=alloc.sources,
            info=info,
        )

    def observe(self, ctx: Context, draft: Draft | None, result: Verified | PlainResult) -> None:
        engine = ctx.engine
        if self.masks:
            self.vectors.update(engine, result.tokens)
        self.dists = []
        if draft is None:  # a one-token step of plain mode: no masks ran
            if self.drafter is not None:
                self.drafter.plain(result.tokens, queued=result.queued)
            if self.recycle is not None:
                self.recycle.plain(result)
            return
        mask_row, prev = draft.info
        if self.drafter is not None:  # the MTP layer's pairs along the accepted path
            rows = result.hidden[mx.array([0, *result.path])]
            self.drafter.verified(rows, result.tokens)
        # next step's probe candidates: the masks after v*, if it has any
        r0 = mask_row.get(result.deepest)
        if r0 is not None:
            k = self.masks
            if draft.logit_rows is not None and r0 == draft.n_verify:  # the first mask set
                self.dists = candidate_lists(*result.extras[:2])
            elif r0 + k <= result.logits.shape[0]:
                self.dists = mask_candidates(result.logits[r0 : r0 + k], self.bc, engine)
            else:  # a mask set outside the pass's logit rows
                rows = engine.lm_head(result.hidden[r0 : r0 + k])
                self.dists = mask_candidates(rows, self.bc, engine)
        if self.use_pool:
            self.pool.learn(draft, result, prev)
        if self.recycle is not None:
            self.recycle.learn(draft, result, result.extras[-1])
