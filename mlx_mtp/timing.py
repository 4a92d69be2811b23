"""Device time: how long the forward passes of a generation take.

:class:`DeviceClock` counts forward passes, their slots, and the seconds the
device spends on them, including vocabulary-wide work on their outputs
(argmax, top-k, sampling). The decoding statistics call everything else host
time. A pass can be started without waiting (``mx.async_eval``): the host then
builds the graphs that read its outputs while the device runs, and
:meth:`DeviceClock.wait` counts the device time from the pass's start.

Every :class:`~mlx_mtp.engine.Engine` gets its clock from :func:`make_clock`,
a real one unless a tool has installed another with :func:`use_clock`: the
benchmark's simulated device (:mod:`mlx_mtp.bench.simulate`) is such a clock,
installed by the command line under ``MLX_MTP_SIMULATE_DEVICE``. The decoding
path only counts and waits through this interface.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx


class DeviceClock:
    """Forward passes, slots and device seconds of one engine.

    Attributes:
        passes: forward passes counted (prefill chunks excluded).
        slots: input slots (tokens and masks) over those passes.
        seconds: seconds inside those passes (graph build + evaluation) and
            the device work on their outputs, and of device work beside them
            (a draft model's or an MTP layer's passes).
        aside: the part of ``seconds`` spent beside the target's passes (not
            a measurement of its forward cost: :meth:`beside`).
        pending: a pass started without waiting: (start time, its outputs,
            when it is done).
        outside: seconds spent waiting for this engine's queued pass outside
            its decoding steps (an interleaved benchmark synchronises the
            device after each step, so that the pass a pipelined plain step
            left queued does not run in another method's time); the next
            step's timing counts them (:meth:`take_outside`), as the step
            would have waited for that pass itself.
    """

    #: seconds the device sat idle waiting for the host, where the clock
    #: knows them (a simulated device's; None: not known)
    idle: float | None = None

    def __init__(self) -> None:
        self.passes = 0
        self.slots = 0
        self.seconds = 0.0
        self.aside = 0.0
        self.pending: tuple[float, list[mx.array], float] | None = None
        self.outside = 0.0

    def now(self) -> float:
        """The clock's time in seconds (``time.perf_counter`` here)."""
        return time.perf_counter()

    @property
    def overlaps(self) -> bool:
        """Whether pipelined steps are this device's default
        (:func:`mlx_mtp.runners.choose_runner`): a GPU, where a pass started
        without waiting runs while the host goes on and a slot costs little.
        (On a CPU the pass runs on MLX's thread too, and overlaps the host
        where a second core is free, but its cost grows steeply with its
        slots.)"""
        return mx.default_device().type == mx.gpu

    def pass_seconds(self, slots: int) -> float | None:
        """Seconds a pass of ``slots`` slots takes where the clock knows it
        (a simulated device), else None."""
        return None

    def known_curve(self) -> Any:
        """The device's cost curve where the clock defines it (a simulated
        device: a :class:`~mlx_mtp.budget.CostCurve` with the seconds of a
        one-token pass), else None: measured by :mod:`mlx_mtp.costs`."""
        return None

    def fork(self, scale: float) -> DeviceClock:
        """A clock for another engine on the same device whose passes take
        ``scale`` times this one's (a draft model: its weight bytes' share)."""
        return DeviceClock()

    def count(self, slots: int = 1) -> None:
        """Count one forward pass of ``slots`` input slots."""
        self.passes += 1
        self.slots += int(slots)

    def launch(self, outputs: list[mx.array], slots: int, cost: float | None = None) -> float:
        """Start a pass of ``slots`` slots (``mx.async_eval``); returns when
        it will be done on this clock (0: not known, a real device).
        ``cost``: other device work instead, of that many one-token passes'
        time (a draft model's pass; used by a simulated device)."""
        mx.async_eval(*outputs)
        return 0.0

    def block(self, read: Callable[[], Any], done: float = 0.0) -> Any:
        """``read()`` (which waits for the device: ``int(y.item())``), the
        pass behind it done at ``done`` (from :meth:`launch`)."""
        return read()

    def finish(self, t0: float, outputs: list[mx.array], wait: bool, slots: int = 1) -> None:
        """A pass of ``slots`` slots whose graph building began at ``t0``:
        evaluate ``outputs`` now (``wait``) or start them and leave the pass
        pending for :meth:`wait`."""
        done = self.launch(outputs, slots)
        if wait:
            self.block(lambda: mx.eval(*outputs), done)
            self.seconds += self.now() - t0
        else:
            self.pending = (t0, outputs, done)

    def extend(self, outputs: list[mx.array], slots: int = 1) -> None:
        """Start a pass of ``slots`` slots queued behind the pending one (its
        input is read from that pass's outputs; a pass must be pending):
        :meth:`wait` then waits for both and counts the time from the pending
        pass's start."""
        t0, running, _ = self.pending
        done = self.launch(outputs, slots)
        self.pending = (t0, [*running, *outputs], done)

    def wait(self, *arrays: mx.array) -> None:
        """Evaluate ``arrays`` (and a pending pass) and count the time as
        device time, from the pending pass's start if there is one."""
        if self.pending is None:
            t0 = self.now()
            mx.eval(*arrays)
        else:
            t0, running, done = self.pending
            self.pending = None
            self.block(lambda: mx.eval(*arrays, *running), done)
        self.seconds += self.now() - t0

    def settle(self) -> None:
        """Finish a pass started without waiting, if any."""
        if self.pending is not None:
            self.wait()

    def sync(self) -> None:
        """Wait until the device has finished everything queued."""
        mx.synchronize()

    def take_outside(self) -> float:
        """The seconds waited for this engine's work outside its steps since
        the last call (:attr:`outside`; not in :attr:`seconds`)."""
        waited, self.outside = self.outside, 0.0
        return waited

    def start_idle_count(self) -> None:
        """Decoding starts (the idle time is not known here)."""

    def add(self, seconds: float) -> None:
        """Count ``seconds`` of device time (a pipelined step, timed whole)."""
        self.seconds += seconds

    def add_beside(self, seconds: float) -> None:
        """Count ``seconds`` of device work beside the target's passes (a draft
        model's passes, timed on its own engine)."""
        self.seconds += seconds
        self.aside += seconds

    @contextmanager
    def beside(self) -> Iterator[None]:
        """Device time counted inside the block is work beside the target's
        forward passes (an MTP layer's passes): device time all the same, but
        not part of the target's cost curve."""
        before = self.seconds
        try:
            yield
        finally:
            self.aside += self.seconds - before

    @contextmanager
    def work_of(self, other: DeviceClock) -> Iterator[None]:
        """Another engine's passes run inside the block (a draft model's, on
        ``other``, its own clock): their device seconds count as work beside
        this clock's passes, and this clock's time moves as ``other``'s did
        (on a simulated device: the simulated time of those passes, not this
        machine's compute of them)."""
        s0, v0, r0 = other.seconds, other.now(), time.perf_counter()
        try:
            yield
        finally:
            self.add_beside(other.seconds - s0)
            self._shift((other.now() - v0) - (time.perf_counter() - r0))

    def _shift(self, seconds: float) -> None:
        """Move this clock's time by ``seconds`` (a real clock cannot)."""

    @contextmanager
    def untimed(self) -> Iterator[None]:
        """Passes run inside the block (a cost measurement) are not counted."""
        saved = (self.passes, self.slots, self.seconds, self.aside)
        try:
            yield
        finally:
            self.settle()
            self.passes, self.slots, self.seconds, self.aside = saved


_factory: Callable[[], DeviceClock] = DeviceClock


def make_clock() -> DeviceClock:
    """A new engine's clock: a real one, or what :func:`use_clock` installed."""
    return _factory()


def use_clock(factory: Callable[[], DeviceClock] | None) -> Callable[[], DeviceClock]:
    """Give every engine made from now on a clock from ``factory`` (None: a
    real one again), e.g. the bench's simulated device; returns the factory
    it replaces."""
    global _factory
    previous, _factory = _factory, factory or DeviceClock
    return previous
