"""One generation's ledger (docs/budget.md): its time, what drafting lost of
it against plain steps of the same tokens, and what the steps of an offer
that takes device work (a draft model's) gained. The
:class:`~mlx_mtp.planner.Planner` records every step here and grants
drafting credit from it."""

from __future__ import annotations

from .steptimes import average


class Ledger:
    """Steps of one generation, in one-token forwards (see the module doc).

    Drafting's loss counts draft steps, the plain steps that stop and restart
    the pipeline around them (a restart after a stop that did not draft too;
    a restart before any pass was queued is the start plain decoding pays as
    well: not counted) and plain steps whose offer took device work.

    Args:
        gain: the gain carried from the last generation (None: none measured).

    Attributes:
        time: the generation's time so far.
        loss: what drafting lost of it (negative while it gains).
        gain: what the steps of an offer that takes device work gained over
            plain steps, per step (a draft step's with the restart after it),
            averaged at :data:`~mlx_mtp.steptimes.RATE`.
        last: the last step's kind (``""`` before the first).
    """

    def __init__(self, gain: float | None = None):
        self.time = self.loss = 0.0
        self.gain, self.last = gain, ""
        self._pending: float | None = None  # a draft step's gain, its restart to come
        self._piped = False  # a plain step has queued a pass in this generation

    def record(
        self, kind: str, cost: float, tokens: int, plain: float, sunk: bool, queued: bool
    ) -> None:
        """One step.

        Args:
            kind: ``"draft"``, ``"plain"``, or ``"stop"`` (a plain step that
                finished the queued pass to draft after it).
            cost: the step's time, in one-token forwards.
            tokens: tokens it committed.
            plain: a plain step's time, in one-token forwards.
            sunk: its offer took device work beside the target's passes.
            queued: it left the forward pass of its token queued.
        """
        draft = kind == "draft"
        restart = not draft and self._piped and self.last in ("draft", "stop")
        self.time += cost
        gained = tokens * plain - cost
        if draft or kind == "stop" or sunk or restart:
            self.loss -= gained
        if self._pending is not None:
            after = gained if restart and not sunk else 0.0
            self.gain = average(self.gain, self._pending + after)
        self._pending = gained if sunk and draft else None
        if sunk and not draft:
            self.gain = average(self.gain, gained)
        self.last, self._piped = kind, self._piped or queued

    @property
    def paying(self) -> bool:
        """Whether the steps of an offer that takes device work gain."""
        return self.gain is not None and self.gain > 0
