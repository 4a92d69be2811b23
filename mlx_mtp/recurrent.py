"""Rejection on recurrent layers: roll a hybrid model's recurrent state back to
the accepted prefix of a chain verify pass (docs/design.md, failure class 3).

Hybrid models (Qwen3.5 / Qwen3-Next: Gated DeltaNet layers with a short
convolution next to full-attention layers) keep, per recurrent layer, a state
that summarises every token seen (mlx-lm's ``ArraysCache``: ``[conv_state,
ssm_state]``). A verify pass over ``[root, d1..dk]`` advances that state over
all k+1 tokens; when only the first m are accepted, the attention layers'
KV caches are trimmed as usual, but the recurrent state must be that after m
tokens, which no trim can give.

:class:`RecurrentRollback` does it by *replay*:

1. :meth:`arm` before the verify pass: the recurrent caches' arrays are kept
   (MLX arrays are immutable and the layers assign new ones, so the snapshot
   is a list of references: no copy), and each recurrent mixer
   (``layer.linear_attn``) records its input ``x`` (B, n, D) for this pass.
2. :meth:`rewind` (keep m < n tokens): restore the snapshot and run each
   recurrent mixer alone over the first m rows of its recorded input, which
   advances conv and delta-net state over the accepted tokens only. The inputs
   of accepted positions do not depend on later (rejected) tokens (causal), so
   the replayed state equals that of a pass over the accepted tokens alone.
   Cost: the recurrent mixers over m tokens (no attention, no MLP, no LM head),
   a fraction of one forward (measured in ``examples/native_mtp_bench.py``).

The alternative, keeping a state per position, needs a delta-net kernel that
emits every intermediate state (mlx-lm's returns the last one only): (n, H,
Dk, Dv) per layer and pass.

Only chains are possible: a recurrent layer reads its tokens in sequence, so a
branching draft tree cannot run through it (``Engine.forward_tree`` refuses it
with :class:`~mlx_mtp.errors.UnsupportedModelError`).

Mixers are wrapped without forking mlx-lm's model files and without changing
the parameter tree: the mixer instance's class is swapped for a subclass whose
``__call__`` records and calls the original.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from .errors import CacheNotTrimmableError, UnsupportedModelError

#: attribute names under which mlx-lm decoder layers keep their recurrent mixer
#: (called as ``mixer(x, mask, cache)``)
MIXER_NAMES = ("linear_attn",)
#: model types whose rollback is tested (gated delta-net + conv state next to
#: attention); other recurrent families (mamba, lfm2, ...) stay refused
ROLLBACK_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")

_RECORDING_CLASSES: dict[type, type] = {}


def is_recurrent(cache: Any) -> bool:
    """Whether a layer cache keeps recurrent state (mlx-lm's ``ArraysCache``,
    ``MambaCache``) rather than per-token keys and values."""
    return isinstance(cache, ArraysCache)


def _recording_class(cls: type) -> type:
    """A subclass of the mixer class ``cls`` that records its input while armed."""
    if cls not in _RECORDING_CLASSES:

        def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
            rec = self.__dict__.get("_mtp_record")
            if rec is not None:
                rec.append(x)
            return cls.__call__(self, x, mask, cache)

        _RECORDING_CLASSES[cls] = type(f"Recording{cls.__name__}", (cls,), {"__call__": __call__})
    return _RECORDING_CLASSES[cls]


def _mixer(layer: nn.Module) -> nn.Module | None:
    for name in MIXER_NAMES:
        m = getattr(layer, name, None) if name in layer else None
        if isinstance(m, nn.Module):
            return m
    return None


class RecurrentRollback:
    """Snapshot / replay of every recurrent layer of one model (see module doc).

    Args:
        model: an mlx-lm model with ``model.layers``.
        cache: its cache list (one entry per layer), to find the recurrent ones.

    Raises:
        UnsupportedModelError: a model type outside :data:`ROLLBACK_FAMILIES`, or
            a recurrent layer whose mixer this module does not know (attribute
            not in :data:`MIXER_NAMES`).
    """

    def __init__(self, model: nn.Module, cache: list[Any]):
        mtype = getattr(model, "model_type", type(model).__name__)
        if mtype not in ROLLBACK_FAMILIES:
            raise UnsupportedModelError(
                f"recurrent-state rollback is implemented and tested for "
                f"{', '.join(ROLLBACK_FAMILIES)}, not model type {mtype!r}. Use --method ntp."
            )
        self.index: list[int] = [i for i, c in enumerate(cache) if is_recurrent(c)]
        layers = list(model.layers)
        self.mixers: list[nn.Module] = []
        for i in self.index:
            m = _mixer(layers[i])
            if m is None:
                raise UnsupportedModelError(
                    f"layer {i} ({type(layers[i]).__name__}) keeps recurrent state but has none "
                    f"of the mixers {', '.join(MIXER_NAMES)}; speculative decoding cannot roll "
                    "it back. Use --method ntp for this model."
                )
            if type(m) not in _RECORDING_CLASSES.values():
                m.__class__ = _recording_class(type(m))
            self.mixers.append(m)
        self._snapshot: list[tuple[list[Any], Any]] | None = None
        #: cache offset (tokens) at which the armed pass began
        self.start = 0
        #: number of tokens of the armed pass
        self.length = 0
        #: rewinds done and seconds spent in them (restore cost, for reports)
        self.rewinds = 0
        self.rewind_seconds = 0.0

    @property
    def armed(self) -> bool:
        return self._snapshot is not None

    def arm(self, cache: list[Any], start: int, length: int) -> None:
        """Before a chain forward pass of ``length`` tokens at cache offset ``start``:
        keep the recurrent states and record the mixers' inputs."""
        self._snapshot = [(list(cache[i].cache), cache[i].lengths) for i in self.index]
        self.start, self.length = start, length
        for m in self.mixers:
            m.__dict__["_mtp_record"] = []

    def disarm(self) -> None:
        """Forget the snapshot and the recorded inputs (the pass is kept whole)."""
        self._snapshot = None
        for m in self.mixers:
            m.__dict__.pop("_mtp_record", None)

    def rewind(self, cache: list[Any], keep: int) -> None:
        """Make every recurrent layer's state that after the first ``keep`` tokens
        of the armed pass. The snapshot stays (a later, shorter rewind of the same
        pass is allowed: the decoding loop cuts a block at EOS or max_tokens)
        until the next :meth:`arm` or :meth:`disarm`.

        Raises:
            CacheNotTrimmableError: nothing armed, or ``keep`` outside the pass.
        """
        if self._snapshot is None:
            raise CacheNotTrimmableError(
                "recurrent layers cannot drop tokens outside a verify pass (no state snapshot)"
            )
        if not 0 <= keep <= self.length:
            raise CacheNotTrimmableError(
                f"cannot keep {keep} tokens of a {self.length}-token pass on recurrent layers"
            )
        t0 = time.perf_counter()
        states = []
        for i, m, (arrays, lengths) in zip(self.index, self.mixers, self._snapshot):
            rec = m.__dict__.get("_mtp_record") or []
            if len(rec) != 1:
                raise CacheNotTrimmableError(
                    f"recurrent layer {i} saw {len(rec)} inputs in the armed pass, expected 1"
                )
            c = cache[i]
            c.cache, c.lengths = list(arrays), lengths
            m.__dict__["_mtp_record"] = None  # replay without recording
            try:
                if keep:
                    m(rec[0][:, :keep], None, c)
            finally:
                m.__dict__["_mtp_record"] = rec
            states += [a for a in c.cache if a is not None]
        mx.eval(states)
        self.rewinds += 1
        self.rewind_seconds += time.perf_counter() - t0


def has_recurrent(cache: list[Any]) -> bool:
    """Whether any layer cache keeps recurrent state."""
    return any(is_recurrent(c) for c in cache)
