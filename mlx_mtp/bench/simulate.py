"""A simulated device for benchmarks: :class:`SimulatedClock`.

A virtual clock for judging drafting against a fast GPU on a machine that has
none: every forward pass takes the simulated device's time for its slot
count instead of this machine's, host work takes its real time, and a pass
queued before the host goes on overlaps that host work, as on a real device
(docs/mac.md). ``MLX_MTP_SIMULATE_DEVICE="ms_per_token=12,curve=1:1,16:1.05,64:1.3"``,
or a named curve, ``"profile=m4pro-4bit,ms_per_token=12"``
(:mod:`mlx_mtp.bench.profiles`), selects it for the command line
(:func:`install`, called by ``mlx-mtp`` and by the bench); the engines then get it through
:func:`mlx_mtp.timing.use_clock`, and the decoding path sees only the
:class:`~mlx_mtp.timing.DeviceClock` interface.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx

from ..errors import InvalidArgumentError
from ..timing import DeviceClock, use_clock


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

    @property
    def overlaps(self) -> bool:
        return True

    def pass_seconds(self, slots: int) -> float:
        return self.seconds_per_token * self.curve(slots)

    def known_curve(self) -> Any:
        from ..budget import CostCurve

        return CostCurve(self.curve.sizes, self.curve.costs, seconds=self.seconds_per_token)

    def fork(self, scale: float) -> SimulatedClock:
        # a memory-bound device reads every weight once per pass: another
        # model's pass takes this one's time in their weight bytes
        return SimulatedClock(self.seconds_per_token * scale, self.curve)

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
    ``"ms_per_token=12,curve=1:1,16:1.05,64:1.3"`` or, with a named cost
    curve (:data:`mlx_mtp.bench.profiles.PROFILES`),
    ``"profile=m4pro-4bit,ms_per_token=12"`` -> (seconds per one-token pass,
    :class:`~mlx_mtp.budget.CostCurve`), None when not set. ``curve=``
    takes the rest of the text, so it comes last.

    Raises:
        InvalidArgumentError: a malformed specification, or an unknown
            profile (the message lists the known ones).
    """
    from ..budget import parse_curve
    from .profiles import profile_curve

    spec = os.environ.get("MLX_MTP_SIMULATE_DEVICE") if spec is None else spec
    if not spec:
        return None
    head, _, curve = spec.replace(" ", "").partition("curve=")
    fields: dict[str, str] = {}
    try:
        for item in filter(None, head.split(",")):
            key, sep, value = item.partition("=")
            if not sep or key not in ("ms_per_token", "profile") or key in fields:
                raise ValueError
            fields[key] = value
        per_token = float(fields["ms_per_token"]) / 1000.0
        if not 0 < per_token < 60 or bool(curve) == ("profile" in fields):
            raise ValueError
    except (ValueError, KeyError):
        raise InvalidArgumentError(
            f"MLX_MTP_SIMULATE_DEVICE={spec!r} is not a device: give "
            "'ms_per_token=MS,curve=SLOTS:COST,...' (e.g. "
            "'ms_per_token=12,curve=1:1,16:1.05,64:1.3') or 'profile=NAME,ms_per_token=MS'."
        ) from None
    if "profile" in fields:
        try:
            curve = profile_curve(fields["profile"])
        except InvalidArgumentError as e:
            raise InvalidArgumentError(f"MLX_MTP_SIMULATE_DEVICE={spec!r}: {e}") from None
    try:
        return per_token, parse_curve(curve)
    except InvalidArgumentError:
        raise InvalidArgumentError(
            f"MLX_MTP_SIMULATE_DEVICE={spec!r} is not a device: its curve is not "
            "SLOTS:COST pairs with slots increasing from 1 (e.g. 1:1,16:1.05,64:1.3)."
        ) from None


def device_spec(profile: str, ms_per_token: float) -> str:
    """The ``MLX_MTP_SIMULATE_DEVICE`` text of profile ``profile`` at
    ``ms_per_token`` milliseconds per one-token pass."""
    return f"profile={profile},ms_per_token={ms_per_token:g}"


def install(spec: str | None = None) -> tuple[float, Any] | None:
    """Give the engines made from now on the simulated device of ``spec``
    (default: ``MLX_MTP_SIMULATE_DEVICE``), or a real clock when there is
    none; returns the device as :func:`simulated_device` does.

    Raises:
        InvalidArgumentError: a malformed specification.
    """
    sim = simulated_device(spec)
    use_clock(None if sim is None else lambda: SimulatedClock(*sim))
    return sim


@contextmanager
def simulating(spec: str | None = None) -> Iterator[tuple[float, Any] | None]:
    """:func:`install` for the block only: the clocks of engines made
    afterwards are as before it."""
    previous = use_clock(None)
    try:
        yield install(spec)
    finally:
        use_clock(previous)
