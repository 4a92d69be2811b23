"""Pipelined one-token steps (:class:`PlainSteps`), as mlx-lm's
``generate_step`` runs them: what ``ntp`` decodes with and what a method's
plain mode runs."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .engine import Engine
from .sampling import draw
from .verify import Sampler, top_tokens


class PlainSteps:
    """One-token steps, pipelined like mlx-lm's ``generate_step``.

    Greedy: each step queues the forward pass of the token it is about to
    return (its id still a lazy argmax, ``mx.async_eval``) before reading
    that id, so the device computes token n+1 while the host hands out token
    n; one synchronisation per token. The cache then holds one token more
    than committed between steps (the decoding loop trims it when the
    generation ends, :meth:`unqueue` before a draft step). With a sampler
    each step is one forward pass and one synchronisation, not pipelined (the
    random draws stay one per returned token).

    With ``topk`` > 0 every step also builds the graph of the ``topk`` best
    ids of its logits (:func:`~mlx_mtp.verify.top_tokens`) beside the argmax
    or draw, evaluated with it (the pipeline and its one synchronisation per
    token stay); :attr:`last_top` holds those of the token just returned.
    """

    def __init__(self, sampler: Sampler | None, topk: int = 0):
        self.sampler, self.topk = sampler, topk
        #: (lazy argmax after the queued token, its lazy top-k or None, cache
        #: offset after it, when the clock has it done, its logits where the
        #: engine records log-probabilities, else None)
        self.next: tuple[mx.array, mx.array | None, int, float, mx.array | None] | None = None
        self.last_top: np.ndarray | None = None
        #: seconds the last greedy step's read waited for the device
        self.waited = 0.0

    def _top(self, logits: mx.array) -> mx.array | None:
        return top_tokens(logits[-1:], self.topk)[0] if self.topk else None

    def step(self, engine: Engine, root: int, queue_next: bool = True) -> list[int]:
        """Commit one token after ``root``; with ``queue_next`` also start the
        forward pass of that token (only where the cache can drop it again)."""
        clock = engine.clock
        if self.sampler is not None:
            logits, _ = engine.forward_chain([root], wait=False)
            last = logits[-1:].astype(mx.float32)
            lp = last - mx.logsumexp(last, axis=-1, keepdims=True)
            tok = draw(self.sampler, lp, engine.slot_positions[-1:] + 1)
            top = self._top(logits)
            engine.timed_eval(tok, *([] if top is None else [top]))
            self.last_top = None if top is None else np.array(top)
            if engine.logprobs is not None:
                engine.logprobs.record(last, [int(tok.item())])
            return [int(tok.item())]
        t0 = clock.now()
        held, nxt, self.next = self.holds(engine, root), self.next, None
        # the queued pass must be droppable again (root's pass too, when not held)
        pipelined = queue_next and engine.trimmable(2 if held else 3)
        if held:
            # root's forward was queued by the last step
            y, top, done, row = nxt[0], nxt[1], nxt[3], nxt[4]
            engine.count_forward()  # that pass is used now
        elif pipelined:
            # the pipeline starts here (after a draft step, a prefill): root's
            # pass is started before the graph of the next one is built, so
            # that building it overlaps the device as in the steady state
            logits = engine.queue_token(mx.array([root]))
            engine.resolve_last(root)
            engine.count_forward()
            y, top, row = mx.argmax(logits, axis=-1), self._top(logits), logits
            done = clock.launch([y, *([] if top is None else [top])], 1)
        else:
            logits, _ = engine.forward_chain([root], wait=False)
            y, top, done = mx.argmax(logits[-1:], axis=-1), self._top(logits), 0.0
            row = logits[-1:]
            engine.timed_eval(y, *([] if top is None else [top]))
            t0 = clock.now()

        def read() -> int:
            self.last_top = None if top is None else np.array(top)
            return int(y.item())

        if pipelined:
            # queue the forward of y before reading it: the device works on while
            # the host waits for y and hands it out
            logits = engine.queue_token(y)
            following, after = mx.argmax(logits, axis=-1), self._top(logits)
            queued = clock.launch([following, *([] if after is None else [after])], 1)
            tb = clock.now()
            tok = clock.block(read, done)
            engine.resolve_last(tok)
            kept = logits if engine.logprobs is not None else None
            self.next = (following, after, engine.offset, queued, kept)
        else:
            tb = clock.now()
            tok = clock.block(read, done)
        self.waited = clock.now() - tb
        clock.add(clock.now() - t0)
        if engine.logprobs is not None:
            engine.logprobs.record(row, [tok])
        return [tok]

    @property
    def queued(self) -> bool:
        """Whether the forward pass of the last token is queued."""
        return self.next is not None

    def holds(self, engine: Engine, root: int) -> bool:
        """Whether the cache holds ``root``'s queued forward pass (the last
        step was pipelined), so that the next one-token step is half done."""
        nxt = self.next
        return nxt is not None and engine.offset == nxt[2] and engine.cached[-1] == root

    def unqueue(self, engine: Engine, root: int) -> None:
        """Drop a queued forward pass whose token a draft step feeds itself."""
        if self.holds(engine, root):
            engine.trim_to(engine.offset - 1)
        self.next = None
