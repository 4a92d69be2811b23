"""One generation's ledger (docs/budget.md): its time, what drafting lost of
it against plain steps of the same tokens, and what the steps of an offer
that takes device work (a draft model's) gained. The
:class:`~mlx_mtp.planner.Planner` and the pipelined steps'
:class:`~mlx_mtp.pipeline.WidthPolicy` record every step here and grant
drafting credit from it (:data:`EPSILON` of the time so far)."""

from __future__ import annotations

import statistics
from collections import deque

from .steptimes import average

#: the share of a generation's time drafting may lose against plain steps of
#: the same tokens (besides one plain step), and probes may cost: 1% keeps a
#: 64-token reply within about 3% of plain decoding at worst. Every runner's
#: policy (the planner, the pipelined steps, the batch) spends it.
EPSILON = 0.01


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


#: plain steps kept per kind for the baseline (:class:`StepLedger`), and the
#: fewest that make one
PLAIN_SAMPLES = 9
PLAIN_MIN_SAMPLES = 3


class StepLedger:
    """Drafting's account in seconds for steps whose time is measured one by
    one (the pipelined steps' :class:`~mlx_mtp.pipeline.WidthPolicy`): what
    the steps that plain decoding would not have run took, against plain
    decoding's steps of the same tokens as measured in the same generation
    (the median of the newest :data:`PLAIN_SAMPLES` plain steps: a spell's,
    as ``ntp`` runs them, once :data:`PLAIN_MIN_SAMPLES` were measured, else
    pipelined plain ones, else an estimate). Past steps are priced at the
    newest baseline, so a cost curve whose one-token time is wrong misleads
    it only until plain steps were measured.

    Attributes:
        time: seconds of every step recorded.
        spent: seconds of drafting's steps.
        tokens: tokens those steps committed.
        steps: steps recorded.
    """

    KINDS = ("spell", "plain")

    def __init__(self) -> None:
        self.time = self.spent = 0.0
        self.tokens = self.steps = 0
        self.samples: dict[str, deque[float]] = {k: deque(maxlen=PLAIN_SAMPLES) for k in self.KINDS}
        self._drafted = False

    def record(self, seconds: float, tokens: int, drafting: bool, plain: str = "") -> None:
        """One step: ``seconds`` from the read before, ``tokens`` committed.

        Args:
            drafting: a step plain decoding would not have run (drafts or
                mask slots, the switch out of a spell, a pipelined plain
                step where a spell's is the baseline).
            plain: otherwise its kind (:attr:`KINDS`), a baseline sample;
                the first spell step after drafting is drafting's (the
                switch in). The generation's first step is plain decoding's
                start: neither.
        """
        first = self.steps == 0
        self.steps += 1
        self.time += seconds
        if not first and (drafting or (plain == "spell" and self._drafted)):
            self.spent += seconds
            self.tokens += tokens
        elif not first and plain in self.samples:
            self.samples[plain].append(seconds)
        self._drafted = drafting

    def baseline(self, estimate: float) -> float:
        """Seconds of plain decoding's step (``estimate`` until measured)."""
        for kind in self.KINDS:
            got = self.samples[kind]
            if len(got) >= PLAIN_MIN_SAMPLES:
                return statistics.median(got)
        return estimate

    @property
    def measured(self) -> bool:
        """Whether a spell's steps make the baseline."""
        return len(self.samples["spell"]) >= PLAIN_MIN_SAMPLES

    def credit(self, plain: float) -> float:
        """Seconds drafting may still lose: :data:`EPSILON` of the time so
        far plus one plain step (``plain`` seconds), less what it lost."""
        return EPSILON * self.time + plain - (self.spent - self.tokens * plain)
