"""``confadapt``: decoding of self-distilled multi-token-prediction checkpoints.

Kirchenbauer, Hans, Bartoldson, Goldblum, Panda, Goldstein, *Multi-Token
Prediction via Self-Distillation* (arXiv 2602.06019; docs/methods.md). Read top to
bottom:

1. The model is an ordinary causal LM whose vocabulary has one extra mask token
   ``<|mtp_special_token_0|>`` (its id is looked up in the tokenizer, or in the
   metadata of an on-device adapter; never hard-coded).
2. One forward pass carries the tokens committed since the last pass (the
   "pending" ones, not yet in the KV cache), the root (the last committed
   token) and k-1 mask tokens, at contiguous positions under the plain causal
   mask. The root and the k-1 masks give k next-token distributions: the root
   predicts the next token, mask i the token i positions further on.
3. ConfAdapt(tau): keep the leading tokens whose top-1 probability is >= tau,
   always at least one; static-k keeps all k. The block ends at its first EOS.
4. The masks' KV is dropped. The emitted tokens are fed again at the next step,
   so each step processes n + k - 1 tokens (n = tokens emitted last step).

Lossy by design: the mask predictions are not verified. "Eff. k" (tokens per
forward pass) is the acceleration the paper reports; the decoding loop's tau is
exactly that number.

``mode=verified`` (not in the paper) makes it lossless: the masks' top
tokens are a draft that the next pass verifies against the model's own
greedy tokens, as ESP verifies its mask candidates (Goel et al. §3.2). It
runs on pipelined steps (:mod:`mlx_mtp.pipeline`): every token slot carries
the mask token in the slots after it (:class:`~mlx_mtp.sources.masks.TokenMaskLayer`),
and the masks after the deepest accepted slot give the next draft
(:class:`~mlx_mtp.sources.masks.MaskDrafter`). With a gated adapter the
real tokens see the base model only, so the committed tokens are the base
model's greedy decoding.

Cache contract (differs from lossless methods, see :class:`ConfAdapt`): after
:meth:`ConfAdapt.step` the cache holds the committed tokens up to and including
this step's root; the tokens emitted by the step are not cached yet (the last
one is the loop's next root, the others are re-fed by the method). The cache
never holds anything that was not committed, so the loop's final trim and the
next chat turn's prefix reuse (:meth:`Engine.sync`) stay correct.

The mask token, the ``mtp_config.json`` format, the embedding surgery and
on-device adapters are the library :mod:`mlx_mtp.confadapt_format` (shared with
``mlx-mtp train mtp`` and ``mlx-mtp convert mtp-checkpoint``); this file is the
decoding method only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import distributed
from ..acceptance import AcceptanceModel, chain_values
from ..confadapt_format import (  # noqa: F401  (re-exported: the names before the split)
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MASK_TOKEN,
    MTP_CONFIG,
    PROMPT_FORMATS,
    SHIPPED_ADAPTERS,
    GatedLoRALinear,
    MaskedEmbedding,
    MaskGate,
    MissingMaskTokenError,
    MTPMetadata,
    apply_adapter,
    clone_modules,
    find_adapter,
    find_mtp_source,
    read_adapter_config,
    read_metadata,
    tokenizer_eos_ids,
    tokenizer_mask_id,
    write_metadata,
)
from ..context import Context
from ..errors import InvalidArgumentError, UnsupportedModelError
from ..offers import Item, Offer, StepOutput
from ..sampling import draw
from ..sources.masks import PROBE_RANK_PRIORS, MaskDrafter, TokenMaskLayer
from ..verify import Sampler
from .base import DraftMethod, parse_int

#: mask slots after each token slot in verified mode (at most)
VERIFIED_MASKS = 3
#: candidates per mask in verified mode (the draft tree's ranks)
VERIFIED_TOP = 4


class ConfAdapt(DraftMethod):
    """ConfAdapt(tau) and static-k decoding of a self-distilled MTP model.

    Args:
        k: block size, tokens predicted per forward pass (1 + k-1 masks), or
            ``"auto"`` (default): up to ``max_k``, the planner cuts the masks
            of each step to those whose tokens are expected to be kept often
            enough to pay for their slots on this device (the rate of kept
            mask tokens learned per position), down to one-token steps while
            none pays (:mod:`mlx_mtp.planner`; not in the paper, whose k is
            fixed at 16).
        max_k: the cap of ``k="auto"`` (default 16).
        tau: confidence threshold in [0, inf): keep the leading tokens whose
            top-1 probability is >= tau (at least one). ``tau > 1`` is plain
            greedy decoding; ``tau = 0`` keeps all k (static-k).
        mode: ``"confadapt"`` (default), ``"static"`` (keep all k) or
            ``"verified"`` (lossless: the masks' tokens drafted and verified
            on pipelined steps, ``min(k - 1, 3)`` masks after every token
            slot, a draft tree of up to ``k - 1`` nodes; greedy only).
        adapter: folder of an on-device adapter (``mlx-mtp train mtp``);
            default: found by the model's fingerprint.

    Raises:
        InvalidArgumentError: bad k, tau or mode.
        MissingMaskTokenError (in :meth:`prepare`): no mask token, no adapter.

    Cache contract: after :meth:`step` the cache holds the committed tokens up
    to this step's root; the step's emitted tokens except the last are kept in
    ``self.pending`` and fed, before the new root, at the next step.
    """

    name = "confadapt"
    lossless = False

    def __init__(
        self,
        k: Any = "auto",
        tau: Any = 0.9,
        mode: str = "confadapt",
        adapter: Any = None,
        max_k: Any = 16,
    ):
        self.auto = str(k) == "auto"
        self.k = parse_int("max_k", max_k, 1, 64) if self.auto else parse_int("k", k, 1, 64)
        try:
            self.tau = float(tau)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"option tau must be a number, got {tau!r}") from None
        if not np.isfinite(self.tau) or self.tau < 0:
            raise InvalidArgumentError(f"option tau must be >= 0, got {self.tau}")
        if mode not in ("confadapt", "static", "verified"):
            raise InvalidArgumentError(
                f"option mode must be 'confadapt', 'static' or 'verified', got {mode!r}"
            )
        if mode == "verified" and self.k < 2:
            raise InvalidArgumentError("mode=verified drafts from k - 1 masks: give k >= 2")
        self.static = mode == "static"
        self.verified = mode == "verified"
        # instance attribute: exactness depends on mode
        self.lossless = self.verified
        self.planner_steps = not self.verified
        self.adapter = None if adapter in (None, "") else Path(str(adapter)).expanduser()
        self.meta: MTPMetadata | None = None
        self.pending: list[int] = []

    @property
    def block_complexity(self) -> int:
        return self.k

    def describe(self) -> str:
        # the stats line's "tau" (tokens per forward) is the paper's Eff. k; the
        # confidence threshold is printed as "conf>=" to keep the two apart
        rule = "static" if self.static else f"conf>={self.tau:g}"
        if self.verified:
            rule = "verified"
        k = f"auto<={self.k}" if self.auto else str(self.k)
        return f"confadapt(k={k}, {rule})"

    # -------------------------------------------------------------- setup
    def prepare(self, ctx: Context) -> None:
        """Find the mask token (and apply an on-device adapter if that is where
        it comes from). With an adapter, ``engine`` gets a copy of its model
        with the adapter applied (:func:`apply_adapter`); the caller's model
        object is not modified.

        Raises:
            MissingMaskTokenError: neither the model nor an adapter has a mask token.
            CheckpointMismatchError: an adapter made for another base model.
        """
        engine, loaded = ctx.engine, ctx.loaded
        if engine.backbone is None:
            raise UnsupportedModelError(
                "--method confadapt needs the llama-style model layout (model.embed_tokens)."
            )
        refuse_sharded_adapter(engine.model, loaded, self.adapter)
        meta, adapter = find_mtp_source(engine.model, loaded, self.adapter)
        if adapter is not None:
            cfg = read_adapter_config(adapter)
            engine.use_model(apply_adapter(engine.model, adapter, cfg))
        self.meta = meta
        self.mask_id = meta.mask_token_id
        self.eos = set(meta.eos_token_ids)

    def begin(self, ctx: Context, prompt: list[int], sampler: Sampler | None) -> None:
        super().begin(ctx, prompt, sampler)
        self.pending = []

    # ------------------------------------------------------ verified mode
    #: verified mode's estimates: per depth d of the next draft (mask d), the
    #: acceptance of the candidate of each rank given its parent accepted
    PIPELINE_ACCEPTANCE = AcceptanceModel(
        priors={
            f"confadapt/{d}": tuple(f * p for p in PROBE_RANK_PRIORS)
            for d, f in ((1, 1.0), (2, 0.6), (3, 0.4))
        },
        default_prior=0.01,
        weight=2.0,
        decay=0.95,
        max_depth=16,
    )

    def pipeline_acceptance(self) -> AcceptanceModel:
        return self.PIPELINE_ACCEPTANCE

    def device_drafter(self, ctx: Context) -> MaskDrafter | None:
        """Verified mode's drafts on pipelined steps: the mask token after
        every token slot, its candidates the next draft tree (see the module
        doc); None in the lossy modes, whose blocks are not verified."""
        if not self.verified:
            return None
        layer = TokenMaskLayer(self.mask_id, min(self.k - 1, VERIFIED_MASKS), VERIFIED_TOP)
        return MaskDrafter(layer, name="confadapt")

    # --------------------------------------------------------------- step
    def propose(self, ctx: Context, root: int) -> Offer:
        if self.verified:  # the runner never asks (planner_steps is False)
            raise InvalidArgumentError("confadapt mode=verified runs on pipelined steps only")
        # mask i is worth the chance that the tokens of masks 1..i are all kept;
        # the tokens committed last step are fed again anyway
        values = chain_values(ctx.acceptance.qs("confadapt", self.k - 1))
        return Offer(
            [Item(v) for v in values],
            run=lambda n: self._run(ctx, root, n),
            base_slots=1 + len(self.pending),
            source="confadapt",
        )

    def _run(self, ctx: Context, root: int, masks: int) -> StepOutput:
        """One block: the pending tokens, the root and ``masks`` mask tokens."""
        engine, k = ctx.engine, masks + 1
        real = [*self.pending, root]
        if masks:
            engine.check_droppable(len(real) + masks)  # the masks are dropped after the pass
        start = engine.offset
        logits, _ = engine.forward_chain(real + [self.mask_id] * (k - 1))
        # the root and the k-1 masks give k next-token distributions
        dist = logits[len(real) - 1 :].astype(mx.float32)
        if self.mask_id < dist.shape[-1]:  # the mask token is input-only
            col = mx.arange(dist.shape[-1]) == self.mask_id
            dist = mx.where(col, -mx.inf, dist)
        logp = dist - mx.logsumexp(dist, axis=-1, keepdims=True)
        conf = mx.exp(mx.max(logp, axis=-1))
        if self.sampler is None:
            toks = mx.argmax(logp, axis=-1)
        else:
            toks = draw(self.sampler, logp, engine.slot_positions[len(real) - 1 :] + 1)
        engine.timed_eval(toks, conf)
        toks_np, conf_np = np.array(toks).tolist(), np.array(conf)
        # drop the masks' KV; the root's KV is exact and stays
        engine.trim_to(start + len(real))

        n = k if self.static else confadapt_length(conf_np, self.tau)
        out = toks_np[:n]
        for i, t in enumerate(out):  # the block ends at its first EOS
            if t in self.eos:
                out = out[: i + 1]
                break
        self.pending = out[:-1]
        return StepOutput([int(t) for t in out], drafted=k - 1, accepted=len(out) - 1)


def confadapt_length(confidence: np.ndarray, tau: float) -> int:
    """ConfAdapt's rule: the number of leading tokens whose top-1 probability
    is >= tau, at least one (Kirchenbauer et al. §3).

    Args:
        confidence: (k,) top-1 probabilities of the k positions of a block.
        tau: threshold; tau > 1 always gives 1, tau = 0 gives k.
    """
    below = np.flatnonzero(np.asarray(confidence) < tau)
    n = int(below[0]) if below.size else len(confidence)
    return max(n, 1)


def refuse_sharded_adapter(model: nn.Module, loaded: Any, adapter: Path | None) -> None:
    """Refuse an on-device adapter on a model sharded over several ranks
    (:mod:`mlx_mtp.distributed`): the adapter's LoRA tensors are made for the
    whole model and are not sharded. A checkpoint with the mask token built in
    (``mtp_config.json`` or the tokenizer's token) needs no adapter and runs
    sharded.

    Raises:
        UnsupportedModelError: naming the sharding and what to use instead.
    """
    how = distributed.sharding(model)
    if how is None:
        return
    built_in = loaded is not None and (
        read_metadata(loaded.path) is not None
        or tokenizer_mask_id(getattr(loaded, "tokenizer", None)) is not None
    )
    if adapter is None and built_in:
        return
    raise UnsupportedModelError(
        f"--method confadapt: this model is sharded ({how} parallel) and its mask "
        "token would come from an on-device "
        "adapter, whose LoRA weights are made for the unsharded model and are not "
        "sharded. Use a released MTP checkpoint with the mask token built in (e.g. "
        "qwen3-4b-mtp), or run confadapt in one process."
    )
