"""``ntp``: plain next-token decoding, the baseline every method is measured against."""

from __future__ import annotations

import mlx.core as mx

from ..engine import Engine
from ..sampling import draw
from .base import Method, StepOutput


class NTP(Method):
    """One token per forward pass: argmax (greedy) or a draw from mlx-lm's sampler."""

    name = "ntp"
    lossless = True
    needs_trimmable_cache = False

    def step(self, engine: Engine, root: int) -> StepOutput:
        logits, _ = engine.forward_chain([root])
        last = logits[-1:]
        if self.sampler is None:
            tok = mx.argmax(last, axis=-1)
        else:
            last = last.astype(mx.float32)
            lp = last - mx.logsumexp(last, axis=-1, keepdims=True)
            tok = draw(self.sampler, lp, engine.slot_positions[-1:] + 1)
        engine.timed_eval(tok)
        return StepOutput([int(tok.item())])
