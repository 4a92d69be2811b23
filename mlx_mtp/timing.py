"""Device time: how long the forward passes of a generation take.

:class:`DeviceClock` counts forward passes, their slots, and the seconds the
device spends on them, including vocabulary-wide work on their outputs
(argmax, top-k, sampling). The decoding statistics call everything else host
time. A pass can be started without waiting (``mx.async_eval``): the host then
builds the graphs that read its outputs while the device runs, and
:meth:`DeviceClock.wait` counts the device time from the pass's start.

:class:`SimulatedClock` (``MLX_MTP_SIMULATE_DEVICE``) is a virtual clock for
judging the budget against a fast GPU on a machine that has none: every
forward pass takes the simulated device's time for its slot count instead of
this machine's, host work takes its real time, and a pass queued before the
host goes on overlaps that host work, as on a real device (see
:func:`simulated_device` and docs/mac.md).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx

from .errors import InvalidArgumentError


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
    """

    simulated = False
    #: seconds the device sat idle waiting for the host (known on a
    #: simulated device only: :class:`SimulatedClock`)
    idle = 0.0

    def __init__(self) -> None:
        self.passes = 0
        self.slots = 0
        self.seconds = 0.0
        self.aside = 0.0
        self.pending: tuple[float, list[mx.array], float] | None = None

    def now(self) -> float:
        """The clock's time in seconds (``time.perf_counter`` here)."""
        return time.perf_counter()

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


class SimulatedClock(DeviceClock):
    """A virtual clock: forward passes take a simulated device's time.

    Virtual time runs with real time, except while the host waits for this
    machine's computation of a pass: that wait is left out, and the clock
    moves on to when the simulated device would have finished the pass. The
    simulated device runs one pass at a time; a pass of ``n`` slots takes
    ``seconds_per_token * curve(n)``. So a pipelined one-token step (the next
    pass queued before the host reads the current token) costs the larger of
    its host work and the device time, a draft step its serial host work plus
    the device time. This machine computes each pass when it is launched,
    so that its compute never shares the cores with the host work measured
    meanwhile. Device work outside passes (top-k, an MTP layer) keeps its
    real time.

    Args:
        seconds_per_token: the simulated one-token pass.
        curve: the simulated relative cost ``c(n)`` (a
            :class:`~mlx_mtp.budget.CostCurve`).
    """

    simulated = True

    def __init__(self, seconds_per_token: float, curve: Any):
        super().__init__()
        self.seconds_per_token, self.curve = seconds_per_token, curve
        self.offset = 0.0  # virtual - real time
        self.free = 0.0  # when the simulated device finishes its queue
        self.paused: float | None = None  # virtual time stopped at (pause)
        #: seconds the simulated device sat idle, its queue empty, before a
        #: pass was launched: the host work on the critical path
        self.idle = 0.0

    def now(self) -> float:
        return time.perf_counter() + self.offset

    def launch(self, outputs: list[mx.array], slots: int, cost: float | None = None) -> float:
        # computed here and now, its time left out: this machine's compute must
        # not run beside the host work that the virtual clock measures (on a
        # CPU it would share the cores and slow that work down)
        r0 = time.perf_counter()
        mx.eval(*outputs)
        self.offset -= time.perf_counter() - r0
        now = self.now()
        if self.free:  # a gap since the last pass ended (none before the first)
            self.idle += max(now - self.free, 0.0)
        start = max(now, self.free)
        self.free = start + self.seconds_per_token * (self.curve(slots) if cost is None else cost)
        return self.free

    def block(self, read: Callable[[], Any], done: float = 0.0) -> Any:
        r0 = time.perf_counter()
        out = read()
        self.offset -= time.perf_counter() - r0  # this machine's compute: not counted
        self.offset += max(done - self.now(), 0.0)  # the simulated device's instead
        return out

    def sync(self) -> None:
        self.block(mx.synchronize, self.free)

    def _shift(self, seconds: float) -> None:
        self.offset += seconds
        self.free = max(self.free, self.now())  # the other's passes held the device

    def start_idle_count(self) -> None:
        """Decoding starts: the device's idle time counts from now on (a gap
        before, such as a prefill, is not the decoding steps' host work)."""
        self.free = max(self.free, self.now())

    def pause(self) -> None:
        """Stop virtual time (another engine's steps run meanwhile: an
        interleaved bench); a pass still queued stays in flight."""
        self.paused = self.now()

    def resume(self) -> None:
        """Let virtual time run on from where :meth:`pause` stopped it."""
        if self.paused is not None:
            self.offset += self.paused - self.now()
            self.paused = None


def simulated_device(spec: str | None = None) -> tuple[float, Any] | None:
    """The simulated device of ``MLX_MTP_SIMULATE_DEVICE`` (or ``spec``):
    ``"ms_per_token=12,curve=1:1,16:1.05,64:1.3"`` -> (seconds per token,
    :class:`~mlx_mtp.budget.CostCurve`), None when not set.

    Raises:
        InvalidArgumentError: a malformed specification.
    """
    from .budget import parse_curve

    spec = os.environ.get("MLX_MTP_SIMULATE_DEVICE") if spec is None else spec
    if not spec:
        return None
    ms, _, curve = spec.replace(" ", "").partition(",curve=")
    key, _, value = ms.partition("=")
    try:
        per_token = float(value) / 1000.0
        if key != "ms_per_token" or not curve or not 0 < per_token < 60:
            raise ValueError
        return per_token, parse_curve(curve)
    except (ValueError, InvalidArgumentError):
        raise InvalidArgumentError(
            f"MLX_MTP_SIMULATE_DEVICE={spec!r} is not a device: give "
            "'ms_per_token=MS,curve=SLOTS:COST,...', e.g. "
            "'ms_per_token=12,curve=1:1,16:1.05,64:1.3'."
        ) from None


def make_clock() -> DeviceClock:
    """A :class:`SimulatedClock` under ``MLX_MTP_SIMULATE_DEVICE``, else a real one."""
    sim = simulated_device()
    return SimulatedClock(*sim) if sim is not None else DeviceClock()
