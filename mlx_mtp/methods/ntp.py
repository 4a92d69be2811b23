"""``ntp``: plain next-token decoding, the baseline every method is measured against."""

from __future__ import annotations

import time

import mlx.core as mx

from ..engine import Engine
from ..sampling import draw
from ..verify import Sampler
from .base import Method, StepOutput


class NTP(Method):
    """One token per forward pass: argmax (greedy) or a draw from mlx-lm's sampler.

    Greedy decoding is pipelined like mlx-lm's ``generate_step``: each step
    queues the forward pass of the token it is about to return (its id still a
    lazy argmax, ``mx.async_eval``) before reading that id, so the device
    computes token n+1 while the host hands out token n; one synchronisation
    per token. The cache therefore holds one token more than committed
    between steps (the decoding loop trims it when the generation ends), and
    one forward pass after the last token is computed and discarded, as in
    mlx-lm. With a sampler each step is one forward pass and one
    synchronisation, not pipelined (the random draws stay one per returned
    token).
    """

    name = "ntp"
    lossless = True
    needs_trimmable_cache = False

    def begin(self, engine: Engine, prompt: list[int], sampler: Sampler | None) -> None:
        super().begin(engine, prompt, sampler)
        # (lazy argmax after the queued token, cache offset after it) of the pipeline
        self._next: tuple[mx.array, int] | None = None

    def step(self, engine: Engine, root: int) -> StepOutput:
        if self.sampler is not None:
            logits, _ = engine.forward_chain([root], wait=False)
            last = logits[-1:].astype(mx.float32)
            lp = last - mx.logsumexp(last, axis=-1, keepdims=True)
            tok = draw(self.sampler, lp, engine.slot_positions[-1:] + 1)
            engine.timed_eval(tok)
            return StepOutput([int(tok.item())])
        t0 = time.perf_counter()
        nxt, self._next = getattr(self, "_next", None), None
        if nxt is not None and engine.offset == nxt[1] and engine.cached[-1] == root:
            y = nxt[0]  # root's forward was queued by the last step; y is its argmax
            engine.count_forward()  # that pass is used now
        else:
            logits, _ = engine.forward_chain([root], wait=False)
            y = mx.argmax(logits[-1:], axis=-1)
            engine.timed_eval(y)
            t0 = time.perf_counter()
        if getattr(self, "pipeline", True) and engine.trimmable(2):
            # queue the forward of y before reading it (the device works on while we
            # wait); the loop trims this one extra token when the generation ends, so
            # only where the cache can drop it (no recurrent layers, no full window)
            following = mx.argmax(engine.queue_token(y), axis=-1)
            mx.async_eval(following)
            tok = int(y.item())
            engine.resolve_last(tok)
            self._next = (following, engine.offset)
        else:
            tok = int(y.item())
        engine.forward_seconds += time.perf_counter() - t0
        return StepOutput([tok])
