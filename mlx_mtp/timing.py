"""Device time: how long the forward passes of a generation take.

:class:`DeviceClock` counts forward passes, their slots, and the seconds the
device spends on them, including vocabulary-wide work on their outputs
(argmax, top-k, sampling). The decoding statistics call everything else host
time. A pass can be started without waiting (``mx.async_eval``): the host then
builds the graphs that read its outputs while the device runs, and
:meth:`DeviceClock.wait` counts the device time from the pass's start.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx


class DeviceClock:
    """Forward passes, slots and device seconds of one engine.

    Attributes:
        passes: forward passes counted (prefill chunks excluded).
        slots: input slots (tokens and masks) over those passes.
        seconds: wall seconds inside those passes (graph build + evaluation)
            and the device work on their outputs.
        pending: a pass started without waiting: (start time, its outputs).
    """

    def __init__(self) -> None:
        self.passes = 0
        self.slots = 0
        self.seconds = 0.0
        self.pending: tuple[float, list[mx.array]] | None = None

    def count(self, slots: int = 1) -> None:
        """Count one forward pass of ``slots`` input slots."""
        self.passes += 1
        self.slots += int(slots)

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def finish(self, t0: float, outputs: list[mx.array], wait: bool) -> None:
        """A pass whose graph building began at ``t0``: evaluate ``outputs``
        now (``wait``) or start them and leave the pass pending."""
        if wait:
            mx.eval(*outputs)
            self.seconds += time.perf_counter() - t0
        else:
            mx.async_eval(*outputs)
            self.pending = (t0, outputs)

    def wait(self, *arrays: mx.array) -> None:
        """Evaluate ``arrays`` (and a pending pass) and count the time as
        device time, from the pending pass's start if there is one."""
        t0, running = self.pending or (time.perf_counter(), [])
        mx.eval(*arrays, *running)
        self.pending = None
        self.seconds += time.perf_counter() - t0

    def settle(self) -> None:
        """Finish a pass started without waiting, if any."""
        if self.pending is not None:
            self.wait()

    @contextmanager
    def untimed(self) -> Iterator[None]:
        """Passes run inside the block (a cost measurement) are not counted."""
        saved = (self.passes, self.slots, self.seconds)
        try:
            yield
        finally:
            self.settle()
            self.passes, self.slots, self.seconds = saved
