"""What a draft method's steps take on this machine, measured online
(:class:`StepTimes`): a pipelined plain step, and a draft step's host work.

A plain step pipelined like mlx-lm's ``generate_step`` waits for one forward
pass in the steady state. Where a draft step breaks the pipeline, the plain
step that stops it (finishing the queued pass, queuing none) finds that pass
mostly done, and the one that starts it again waits for two (MLX on a CPU:
19 ms and 140 ms against 77 ms, SmolLM2-135M float32). So a draft step's host
work is measured with both around it: the pair costs about two plain steps,
and the restart's excess alone would price every draft step about one pass
too dear.
"""

from __future__ import annotations

from dataclasses import dataclass

#: weight of a new sample in the averages of measured step times
RATE = 0.2


def average(old: float | None, sample: float) -> float:
    """``sample`` averaged into ``old`` at :data:`RATE` (``sample`` where
    ``old`` is None)."""
    return sample if old is None else old + RATE * (sample - old)


@dataclass
class StepTimes:
    """Measured step times of one draft method on this machine, in seconds,
    averaged online at :data:`RATE` (see the module doc).

    Attributes:
        host: what a draft step takes beyond the device time priced for its
            pass and the work beside it, with what the steps that stop and
            restart the pipeline around it take beyond two pipelined plain
            steps (None: none measured).
        plain: a pipelined plain step in the steady state (None: none
            measured).
    """

    host: float | None = None
    plain: float | None = None
    _pending: float | None = None  # the last draft step's host sample, restart to come
    _lead: float = 0.0  # what the step that stopped the pipeline took less than a plain one

    def record(self, kind: str, wall: float, device: float = 0.0, steady: bool = True) -> None:
        """One step of ``wall`` seconds: ``"stop"`` (a plain step that
        finished the queued pass and queued none, to draft after it),
        ``"draft"`` (``device``: the seconds priced for its pass and the work
        beside it) or ``"plain"`` (``steady``: pipelined on both sides, or on
        neither)."""
        lead, self._lead = self._lead, 0.0
        if kind == "stop":
            if self.plain is not None:
                self._lead = wall - self.plain
        elif kind == "draft":
            self.flush()
            self._pending = wall - device + lead
        elif self._pending is not None:  # the restart after a draft step
            if self.plain is not None:
                self._pending += wall - self.plain
            self.flush()
        elif steady:
            self.plain = average(self.plain, wall)

    def flush(self) -> None:
        """Average a draft step's pending host sample in (the generation
        ended, or another draft step follows it without a restart)."""
        if self._pending is not None:
            self.host, self._pending = average(self.host, self._pending), None
        self._lead = 0.0
