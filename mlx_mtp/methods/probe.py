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
   draft the offer of :meth:`Probe.propose` builds.
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

from ..acceptance import AcceptanceModel, CalibrationModel
from ..allocate import build_tree
from ..context import Context
from ..errors import InvalidArgumentError, UnsupportedModelError
from ..families import check_tree_support
from ..offers import Item, Offer, PlainResult, chain_offer
from ..sources.masks import (
    PROBE_RANK_PRIORS,
    MaskDrafter,
    MaskLayer,
    MaskVectors,
    candidate_lists,
    mask_candidates,
    top_candidates,
)
from ..speculative import Draft, Verified
from ..tree import block_complexity, heavy_path_order, reorder_tree
from ..verify import Sampler
from .base import DraftMethod, parse_bc, parse_int


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


class Probe(DraftMethod):
    """ESP embedding-space probing with a lossless draft tree.

    Args:
        bc: block complexity, tokens per forward pass (10 and 30 are the edge
            settings, 60 the paper's large one; None: "auto"). A template sets its
            own BC, ``(masks + 1) * (1 + sum(template))``; a different ``bc``
            with it is refused. ``"auto"`` (default): up to ``max_bc`` slots,
            each step keeps the prefix of the best-first tree that maximises
            expected tokens per unit of time under this device's forward cost
            curve (:mod:`mlx_mtp.planner`), with the mask probabilities
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
            base slots), and the method runs one-token steps, probing
            now and then, while no chain pays (:mod:`mlx_mtp.planner`); a fixed
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

    #: pipelined steps' estimates: per depth d of the next tree (mask d), the
    #: acceptance of the candidate of each rank given its parent accepted
    PIPELINE_ACCEPTANCE = AcceptanceModel(
        priors={
            "probe/1": PROBE_RANK_PRIORS,
            "probe/2": tuple(0.6 * p for p in PROBE_RANK_PRIORS),
            "probe/3": tuple(0.4 * p for p in PROBE_RANK_PRIORS),
        },
        default_prior=0.01,
        weight=2.0,
        decay=0.95,
        max_depth=16,
    )

    @property
    def max_width(self) -> int:
        return self.nodes

    def device_drafter(self, ctx: Context) -> MaskDrafter | None:
        """ESP's tree on pipelined steps (:mod:`mlx_mtp.pipeline`); a fixed
        ``--tree`` template and ``shape=chain`` run the planner's steps."""
        if self.template is not None or self.shape != "tree" or self.nodes < 1:
            return None
        return MaskDrafter(MaskLayer(self.vectors, top=min(self.nodes, 16)))

    def pipeline_acceptance(self) -> AcceptanceModel:
        return self.PIPELINE_ACCEPTANCE

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

    def prepare(self, ctx: Context) -> None:
        model = ctx.engine.model
        if self.shape == "chain" and ctx.engine.rollback is not None:
            if not does_model_support_input_embeddings(model):
                raise UnsupportedModelError(
                    f"--method probe: model type {model.model_type!r} does not accept "
                    "input embeddings (mask slots are vectors). Use --method mtp or pld."
                )
        else:
            check_tree_support(model, self.name)
        self.vectors.prepare(ctx.engine)

    @property
    def learned(self) -> mx.array | None:
        """(masks, D) learned mask vectors (``mask_init="learned"``), else None."""
        return self.vectors.learned

    @property
    def mask_embedding(self) -> mx.array:
        """(masks, D) current mask vectors."""
        return self.vectors.embedding

    #: the tree's estimates are its mask probabilities, scaled by accepted /
    #: predicted draft tokens (decayed, with a prior whose weight decays too:
    #: a tree whose nodes keep failing is scaled down to what they really get)
    TREE_ACCEPTANCE = AcceptanceModel(
        calibration=CalibrationModel(decay=0.95, weight=1.0, weight_decay=0.95)
    )

    def acceptance_model(self) -> AcceptanceModel:
        return self.ACCEPTANCE if self.shape == "chain" else self.TREE_ACCEPTANCE

    def begin(self, ctx: Context, prompt: list[int], sampler: Sampler | None) -> None:
        super().begin(ctx, prompt, sampler)
        self.vectors.begin(ctx.engine, prompt)
        #: per depth, (tokens, probabilities) the masks after the last deepest
        #: accepted node predict: the next tree's candidates
        self.dists: list[tuple[np.ndarray, np.ndarray]] = []

    def propose(self, ctx: Context, root: int) -> Offer:
        if self.shape == "chain":
            return self._propose_chain(ctx, root)
        k, engine = self.masks, ctx.engine
        node_toks, node_par, node_p = build_tree(self.dists, self.nodes, root, self.template)
        nodes = self.nodes

        def build(n: int) -> Draft:
            # the most probable path first: an accepted prefix needs no KV-row move
            order = heavy_path_order(node_par[:n], node_p[:n])
            toks, par = [node_toks[i] for i in order], reorder_tree(order, node_par[:n])
            n_tok = 1 + n
            # slots: [root, nodes...] then k chained masks after every token slot
            parents = [-1] + [p + 1 for p in par]
            for anchor in range(n_tok):
                for j in range(k):
                    parents.append(anchor if j == 0 else len(parents) - 1)
            slot_tokens = np.array([root, *toks] + [-1] * (n_tok * k), dtype=np.int64)
            emb = engine.embed_tokens(slot_tokens[:n_tok])

            def root_masks_top(logits: mx.array, hidden: Any, targets: Any) -> tuple:
                # when no draft is accepted (most steps) the root's masks draft the
                # next tree: their top-k is built while the pass runs
                return top_candidates(logits[n_tok : n_tok + k], nodes)

            # logits only for the token slots and the root's masks; other mask
            # rows go through the LM head in observe() if they are needed
            return Draft(
                slot_tokens,
                np.array(parents, dtype=np.int64),
                mx.concatenate([emb, self.vectors.sets(n_tok, emb.dtype)]),
                verify=n_tok,
                logit_rows=n_tok + k,
                hidden=True,
                extras=root_masks_top,
            )

        # a node adds its mask probability (calibrated by the planner) and k + 1
        # slots; the root and its masks take k + 1 slots anyway. After plain
        # steps the first pass only runs the root's masks (primes), and one node
        # is verified at a probe
        return Offer(
            [Item(p, k + 1) for p in node_p],
            build,
            base_slots=k + 1,
            item_slots=k + 1,
            primes=True,
            probe_items=1,
        )

    def _propose_chain(self, ctx: Context, root: int) -> Offer:
        # [root, d1..dn, m1..mk]: one chain (the top candidate of each mask
        # slot, then k masks after the last one), so a prefix can be kept on
        # any cache, recurrent layers included; the masks ride along on every
        # step (they draft the next chain)
        k, engine = self.masks, ctx.engine
        drafts = [int(toks[0]) for toks, _ in self.dists[:k]]
        offer = chain_offer(root, drafts, "probe", ctx.acceptance)
        chain = offer.build

        def build(n: int) -> Draft:
            d = chain(n)
            n_tok = 1 + n
            emb = engine.embed_tokens(d.tokens)

            def masks_top(logits: mx.array, hidden: Any, targets: Any) -> tuple:
                return top_candidates(logits[n_tok:], 1)

            d.tokens = np.concatenate([d.tokens, np.full(k, -1, dtype=np.int64)])
            d.parents = np.arange(-1, n_tok + k - 1)
            d.embeddings = mx.concatenate([emb, self.vectors.embedding.astype(emb.dtype)])
            d.verify, d.extras, d.info = n_tok, masks_top, "chain"
            return d

        offer.build, offer.base_slots, offer.primes = build, 1 + k, True
        return offer

    def observe(self, ctx: Context, draft: Draft | None, result: Verified | PlainResult) -> None:
        engine = ctx.engine
        self.vectors.update(engine, result.tokens)
        if draft is None:  # a one-token step: no masks ran
            self.dists = []
        elif draft.info == "chain":
            # the masks follow the last draft: they predict after the bonus
            # token only if every draft was accepted
            full = len(result.path) == draft.drafted
            self.dists = candidate_lists(*result.extras) if full else []
        else:  # the k masks after the deepest accepted node draft the next tree
            k, n_tok, vstar = self.masks, draft.n_verify, result.deepest
            if vstar == 0:
                self.dists = candidate_lists(*result.extras)
            else:
                h_masks = result.hidden[n_tok + vstar * k : n_tok + (vstar + 1) * k]
                self.dists = mask_candidates(engine.lm_head(h_masks), self.nodes, engine)
