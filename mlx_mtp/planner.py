"""The planner: one place that spends the device's forward time on drafts.

A draft method only *offers* (:class:`Offer`: a best-first list of draft
items, each an :class:`Item` with the expected accepted tokens it adds and the
slots it takes, and a way to build the draft of any prefix) and *observes*
what was committed. The :class:`Planner`, run by the decoding loop for every
:class:`~mlx_mtp.methods.base.DraftMethod`, decides the rest. Read top to
bottom:

1. Fixed settings (``auto`` off): the whole offer is sent.
2. ``auto``: the offer is cut at the prefix that maximises expected tokens per
   unit of forward time under the device's cost curve
   (:func:`~mlx_mtp.budget.best_prefix`, online with an early stop when the
   offer can bound what it has not produced yet:
   :class:`~mlx_mtp.budget.PrefixBound`); node values are scaled by the
   whole-draft calibration when the method learns one.
   The whole step is priced: a draft step's time is its forward pass
   ``c(n)`` plus the host work this method's draft steps measured (drafting,
   tree building, the walk, keeping the cache), and it is compared with a
   plain step's measured, pipelined time, all in one-token forwards (where
   the curve knows the seconds of a forward; ``MLX_MTP_HOST_TERM=0`` leaves
   the host out).
3. If no prefix beats a plain step, the method enters *plain
   mode*: pipelined one-token steps exactly as ``ntp`` runs them
   (:class:`PlainSteps`); so does one whose drafting has lost the
   generation more than ``REPROBE_SHARE`` of its time (:attr:`Planner.losing`).
   Plain mode lasts for an interval sized so that the next *re-probe*
   costs at most ``REPROBE_OVERHEAD`` of the time, and waits while it would
   cost the generation it falls in more than ``REPROBE_SHARE`` of that
   generation's decoding steps so far (:func:`reprobe_fits`) or the
   generation has too few tokens left to run it; a re-probe sends at least
   ``reprobe_items`` items whatever their estimates. A method whose drafts
   come from the pass before (probe's masks, clp's heads) declares
   ``primes``: after plain steps its first pass only makes candidates, and
   the re-probe's items go in the pass after it. A nearly free device
   (``c(re-probe) <= 1 + REPROBE_OVERHEAD``) never enters plain mode.
4. Verification: :func:`~mlx_mtp.speculative.speculative_step` for lossless
   offers; a lossy offer runs its own pass (``run``).
5. The acceptance statistics (:class:`~mlx_mtp.acceptance.Acceptance`) are
   the planner's: after each step it records, for every draft node whose
   parent was accepted, whether it was accepted, under the tags of the
   sources that proposed it; sources read them through ``ctx.acceptance``.

The policy is the expected-tokens-per-time objective of Leviathan et al. 2023
(§3.4) with a measured cost instead of a constant ratio; plain mode and the
re-probe interval are this package's own (docs/budget.md).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import distributed
from .acceptance import Acceptance
from .budget import CostCurve, CostCurves, PrefixBound, as_curves
from .costs import LiveCurves
from .offers import Budget, Item, Offer, PlainResult, StepOutput
from .plain import PlainSteps
from .speculative import Draft, Verified, speculative_step
from .verify import Sampler

if TYPE_CHECKING:
    from .context import Context
    from .methods.base import DraftMethod

#: share of decode time the periodic re-probes may cost
REPROBE_OVERHEAD = 0.01
#: bounds of the plain-mode interval (steps)
MIN_PLAIN_STEPS, MAX_PLAIN_STEPS = 4, 256
#: share of one generation's time that drafting may lose in it: past it the
#: generation goes on in plain mode (draft steps measured slower than plain
#: steps, :attr:`Planner.loss`), and a due re-probe waits until the
#: generation is long enough to carry it
REPROBE_SHARE = 0.02
#: tokens a generation must have left for a re-probe to come due in it
REPROBE_TOKENS = 4
#: a re-probe's cost, until one was measured, in times its price: the price
#: leaves out a cold draft step's extra host work (clp's first re-probe on a
#: simulated 12 ms device: priced 0.6-1.0 forwards, measured 2.2)
UNMEASURED_REPROBE = 2.0
#: weight of a new step in the averages of host and plain-step time
HOST_RATE = 0.2


@dataclass
class Learned:
    """What a :class:`Planner` at ``auto`` learned in one generation, kept for
    the next on the same :class:`~mlx_mtp.context.Context`.

    Attributes:
        acceptance: the acceptance estimates.
        host: seconds of host work per draft step (None: none measured).
        plain_time: seconds of a pipelined plain step (None: none measured).
        plain_left: plain-mode steps left before the next re-probe.
        restart: seconds a plain step right after a draft step takes beyond a
            pipelined one (None: none measured).
        ends: share of draft steps after which the pipeline starts again
            (a plain step follows; None: none measured).
        reprobe_cost: the next re-probe's extra cost over plain steps, in
            one-token forwards (:func:`reprobe_cost`).
        reprobe_seen: the extra cost of the last re-probes as measured, net
            of the tokens they committed, in one-token forwards (None: none
            measured).
    """

    acceptance: Acceptance
    host: float | None = None
    plain_time: float | None = None
    plain_left: int = 0
    restart: float | None = None
    ends: float | None = None
    reprobe_cost: float = 0.0
    reprobe_seen: float | None = None


def _average(old: float | None, sample: float) -> float:
    """The running average of host and plain-step times: ``sample`` weighted
    ``HOST_RATE`` (the first sample as it is)."""
    return sample if old is None else old + HOST_RATE * (sample - old)


def reprobe_cost(
    curve: CostCurve,
    reprobe: Sequence[int],
    host: float = 0.0,
    plain: float = 1.0,
    restart: float = 0.0,
) -> float:
    """The extra cost of a re-probe whose steps take ``reprobe`` slots over as
    many plain steps, in one-token forwards: ``sum(c(s) + host - plain) +
    restart`` (``host``: a draft step's host work, ``plain``: a plain step's
    time, ``restart``: what the plain step after the re-probe takes beyond a
    pipelined one, all in one-token forwards; each step's share at least 0)."""
    return sum(max(curve(s) + host - plain, 0.0) for s in reprobe) + max(restart, 0.0)


def plain_interval(
    curve: CostCurve,
    reprobe: Sequence[int],
    host: float = 0.0,
    plain: float = 1.0,
    restart: float = 0.0,
) -> int:
    """Plain steps between re-probes whose steps take ``reprobe`` slots: their
    extra cost (:func:`reprobe_cost`, same arguments) spread over the interval
    is ``REPROBE_OVERHEAD``, within ``[MIN_PLAIN_STEPS, MAX_PLAIN_STEPS]``."""
    extra = reprobe_cost(curve, reprobe, host, plain, restart)
    n = math.ceil(extra / REPROBE_OVERHEAD - 1e-9) if extra > 0 else MIN_PLAIN_STEPS
    return int(min(max(n, MIN_PLAIN_STEPS), MAX_PLAIN_STEPS))


def reprobe_fits(cost: float, elapsed: float) -> bool:
    """Whether a re-probe costing ``cost`` one-token forwards over plain steps
    may run in a generation that has taken ``elapsed`` one-token forwards so
    far: it then costs that generation at most ``REPROBE_SHARE`` of its time
    (a short reply is not the one that pays for a re-probe; the interval's
    ``REPROBE_OVERHEAD`` bounds the share over many)."""
    return cost <= REPROBE_SHARE * (max(elapsed, 0.0) + cost)


def cut_offer(
    curve: CostCurve, offer: Offer, scale: float = 1.0, host: float = 0.0
) -> tuple[list[Item], int, float]:
    """Take an offer's items (until no longer prefix can pay, where the offer
    bounds what it has not produced: :class:`~mlx_mtp.budget.PrefixBound`)
    and find the best prefix under ``curve``, node values times ``scale``,
    a draft step costing ``host`` one-token forwards of host work besides.

    Returns:
        ``(items taken, n, rate)``: the best prefix keeps ``n`` items, at
        ``rate`` expected tokens per one-token forward of time.
    """
    bound = PrefixBound(
        curve, offer.max_slots, offer.base_slots, offer.base_value, offer.item_cost, host
    )
    stop = offer.remaining if offer.max_slots is not None else None
    items: list[Item] = []
    for it in offer.items:
        items.append(it)
        bound.add(it.value * scale if it.node else it.value, it.slots)
        if stop is not None and len(items) >= offer.reprobe_items:
            if bound.exhausted(stop(scale)):
                break
    return items, bound.best_n, bound.best


class Planner:
    """Runs one generation's steps of a :class:`~mlx_mtp.methods.base.DraftMethod`
    (see the module doc).

    Args:
        ctx: the method's context (this planner sets ``ctx.budget`` and
            ``ctx.plain``).
        method: a prepared draft method (its ``auto`` turns the budget on).
        sampler: None for greedy decoding, else the sampler of plain decoding.
        curves: the forward cost curves (only read when ``method.auto``): a
            :class:`~mlx_mtp.costs.LiveCurves` is refined from this
            generation's passes; fixed curves are used as they are.

    Attributes:
        acceptance: this generation's acceptance estimates.
        curve: the cost curve at the cache's current length (``auto``).
        plain_steps: one-token steps run instead of a draft so far (plain
            mode, and a step whose offer had nothing to send).
        reprobes: re-probes after plain mode so far.
        plain_spells: times plain mode began because no prefix of an offer
            paid for its slots.
        loss: seconds this generation's drafting lost against plain steps
            of the same tokens (with the host term; negative while it gains):
            :attr:`losing`.
    """

    def __init__(
        self,
        ctx: Context,
        method: DraftMethod,
        sampler: Sampler | None,
        curves: LiveCurves | CostCurve | CostCurves | None = None,
    ):
        self.ctx, self.method, self.sampler = ctx, method, sampler
        self.auto = bool(method.auto)
        if curves is not None and not isinstance(curves, LiveCurves):
            curves = LiveCurves(as_curves(curves), learn=False)
        self.curves = curves
        self._key = method.settings_key()
        # auto goes on from what the last generation on this context learned
        learned = ctx.learned.get(self._key) if self.auto else None
        if learned is None:
            learned = Learned(Acceptance(method.acceptance_model()))
        self.acceptance = learned.acceptance
        self.curve = self.curves.at(ctx.engine.offset) if self.auto else None
        self.plain = ctx.plain = PlainSteps(sampler, method.plain_topk)
        ctx.budget = Budget(self.acceptance)
        self.plain_steps = self.reprobes = self.plain_spells = 0
        self.plain_left = learned.plain_left  # plain mode goes on across generations
        self.reprobe_cost, self.reprobe_seen = learned.reprobe_cost, learned.reprobe_seen
        #: the re-probe under way: (clock time it began, tokens, steps)
        self._episode: tuple[float, int, int] | None = None
        self.steps = 0  # this generation's steps so far
        self._due = False  # this step is a re-probe
        self._primed = False  # the last step primed a re-probe
        # the whole step (docs/budget.md): the host work of this method's draft
        # steps and a plain step's (pipelined) time, in seconds, averaged online;
        # counted only where the curve knows the seconds of one forward, and
        # not on a model sharded over several ranks: each rank would measure
        # its own host time, and all ranks must draft the same
        known = self.auto and self.curves.t1 is not None and distributed.size() == 1
        self.host_term = known and os.environ.get("MLX_MTP_HOST_TERM") != "0"
        self.host, self.plain_time = learned.host, learned.plain_time
        self.restart, self.ends = learned.restart, learned.ends
        self._kind = self._last_kind = ""
        self.loss = 0.0
        self._leaving = False  # this step finishes a queued pass to draft after it
        self._brief()  # what the method's begin() may read (lookahead's window)

    def _brief(self) -> None:
        """Tell the method's sources what this step costs (``ctx.budget``)."""
        b = self.ctx.budget
        b.curve, b.t1 = self.curve, self.t1
        b.host_cost, b.plain_cost = self.host_cost, self.plain_cost
        b.probing = self.auto and (self._due or self._cheap((3,)))

    # ----------------------------------------------------------------- step
    def step(self, root: int) -> StepOutput:
        """One decoding step after ``root`` (the last committed token, not yet
        in the cache): a plain step or a draft step."""
        engine = self.ctx.engine
        clock, start = engine.clock, engine.offset
        t0, seconds, slots, aside = clock.now(), clock.seconds, clock.slots, clock.aside
        self._kind, self._leaving = "", False
        if self._due and self._episode is None:  # a re-probe starts: time it
            self._episode = (t0, 0, 0)
        out = self._step(root)
        self.steps += 1
        if self._episode is not None:
            self._time_reprobe(clock.now(), len(out.tokens))
        if self.auto and self._kind != "last":  # a measurement of the curve at this step's slots
            device = clock.seconds - seconds
            if out.forwards == 1 and clock.slots > slots:  # the target's pass alone
                self.curves.observe(clock.slots - slots, device - (clock.aside - aside), start)
            wall = clock.now() - t0
            if self._kind == "draft":
                # host work: all but the device time the planner priced (the
                # curve's time of the target's pass, and work beside it), so
                # that what the clock counts inside a pass but the curve does
                # not (building its graph, on a simulated device) is host work
                n = clock.slots - slots
                if out.forwards == 1 and n > 0 and self.t1 is not None:
                    priced = self.t1 * self.curve(n) + (clock.aside - aside)
                else:
                    priced = device
                self.host = _average(self.host, wall - priced)
            if self.host_term and (
                self._kind == "draft" or self._last_kind == "draft" or self._leaving
            ):
                # what drafting cost this step beyond plain steps of its tokens:
                # a draft step, the plain step that restarts the pipeline after
                # one, a queued pass finished unpipelined to draft after it
                self.loss += wall - len(out.tokens) * self.plain_cost * self.t1
            if self._last_kind == "draft":
                # after a draft step: whether the pipeline starts again here
                self.ends = _average(self.ends, float(self._kind == "plain"))
            if self._kind == "plain" and self._last_kind == "draft":
                # the pipeline starts again after a draft step: what this step
                # takes beyond a pipelined one is the draft step's cost too
                if self.plain_time is not None:
                    self.restart = _average(self.restart, max(wall - self.plain_time, 0.0))
            elif self._kind == "plain":
                self.plain_time = _average(self.plain_time, wall)
            self._last_kind = self._kind
        return out

    def _time_reprobe(self, now: float, tokens: int) -> None:
        """Count a step of the re-probe under way (``now``: the clock after
        it, ``tokens``: what it committed); when plain mode begins again (the
        step that restarts the pipeline included), the re-probe's measured
        extra cost over plain steps, net of the tokens it committed, enters
        ``reprobe_seen``. A re-probe whose
        drafts go on paying is no cost: after 8 steps it is no longer timed."""
        t0, n, k = self._episode
        self._episode = (t0, n + tokens, k + 1)
        if self.plain_left > 0:
            self._episode = None
            if self.host_term and self.plain_time is not None and self.t1:
                extra = max(now - t0 - (n + tokens) * self.plain_time, 0.0) / self.t1
                self.reprobe_seen = _average(self.reprobe_seen, extra)
        elif k + 1 >= 8:
            self._episode = None

    @property
    def host_cost(self) -> float:
        """A draft step's host work in one-token forwards (0 without the host
        term): its own, and the pipeline restart after it times the share of
        draft steps a plain step follows."""
        return self.draft_host_cost + (self.ends or 0.0) * self.restart_cost

    @property
    def draft_host_cost(self) -> float:
        """The host work of a draft step itself, in one-token forwards (0
        without the host term or a measurement)."""
        if not self.host_term or self.host is None:
            return 0.0
        return max(self.host, 0.0) / self.t1

    @property
    def plain_cost(self) -> float:
        """A plain step's time in one-token forwards (1 until one is measured,
        or without the host term)."""
        if not self.host_term or self.plain_time is None:
            return 1.0
        return max(self.plain_time / self.t1, 1e-3)

    @property
    def restart_cost(self) -> float:
        """What the plain step after a draft step takes beyond a pipelined one,
        in one-token forwards (0 without the host term or a measurement)."""
        if not self.host_term or self.restart is None:
            return 0.0
        return max(self.restart, 0.0) / self.t1

    @property
    def losing(self) -> bool:
        """Whether drafting has lost this generation more than
        ``REPROBE_SHARE`` of its time so far (measured with the host term:
        each draft step's time, the pipeline restart after it and a queued
        pass finished unpipelined before it, against plain steps of the
        tokens they committed). The generation then goes on in plain mode:
        estimates carried over from another text, or an optimistic prior,
        cost a reply at most that share and the step that crossed it."""
        if not self.host_term:
            return False
        return self.loss > REPROBE_SHARE * self.steps * self.plain_cost * self.t1

    def finish(self) -> None:
        """The generation ended: cache what the cost curve learned, keep what
        this generation learned for the next one on the context."""
        if self.auto:
            self.curves.save()
            self.ctx.learned[self._key] = Learned(
                self.acceptance,
                self.host,
                self.plain_time,
                self.plain_left,
                self.restart,
                self.ends,
                self.reprobe_cost,
                self.reprobe_seen,
            )

    @property
    def t1(self) -> float | None:
        """Seconds of a one-token forward of the target, as the curve knows it
        now (None: not known, or fixed settings)."""
        return self.curves.t1 if self.auto else None

    def _sunk(self, seconds: float) -> float:
        """``seconds`` of device work beside the target's passes in one-token
        forwards (0 where the curve does not know a forward's seconds)."""
        t1 = self.t1
        return max(seconds, 0.0) / t1 if t1 else 0.0

    def _cheap(self, slots: Sequence[int], sunk: float = 0.0) -> bool:
        """Whether the largest step of ``slots`` slots (and ``sunk`` one-token
        forwards of drafting) costs a plain step's time up to
        ``REPROBE_OVERHEAD`` (a memory-bound device with little host work):
        probing every step then costs no more than a periodic re-probe."""
        draft = self.curve(max(slots)) + self.host_cost + sunk
        return draft <= (1.0 + REPROBE_OVERHEAD) * self.plain_cost

    def _step(self, root: int) -> StepOutput:
        engine = self.ctx.engine
        if self.plain_left > 0:  # plain mode: pipelined one-token steps until the re-probe
            if self.plain_left == 1 and not self._reprobe_now():
                return self._plain(root, queue_next=True)
            self.plain_left -= 1
            if self.plain_left == 0:
                self.reprobes += 1
                self._due = True
            return self._plain(root, queue_next=True)
        if self.ctx.left is not None and self.ctx.left <= 1:
            # the generation's last token: no draft could be kept. A one-token
            # step, neither a draft nor plain mode (whose steps the next
            # generation on the context would inherit), and nothing learned from it
            out = self._plain(root, queue_next=False, counted=False)
            self._kind = "last"
            return out
        # root's forward pass is queued when the last step was a pipelined one
        # (plain mode, an offer that waits: auto only); anything else is stale
        queued = self.auto and self.plain.holds(engine, root)
        if not queued:
            self.plain.unqueue(engine, root)
        if self.auto:  # the cost of a draft slot grows with the context
            self.curve = self.curves.at(engine.offset)
        self._brief()
        aside = engine.clock.aside
        offer = self.method.propose(self.ctx, root)
        reprobe, self._due = self._due, False
        primed, self._primed = self._primed, False
        if not self.auto:
            items = list(offer.items)
            return self._send(offer, items, len(items), forced=False)

        def send(n: int, forced: bool = False) -> StepOutput:
            if queued:  # the half-done plain step first, unpipelined: the draft
                # (a re-probe too) is offered again after its token (dropping
                # the queued pass would waste a whole forward)
                self._due, self._primed = reprobe, False
                self._leaving = True
                return self._plain(root, queue_next=False, offer=offer)
            return self._send(offer, items, n, forced)

        # a step costs the device work its offer already took too (a draft
        # model's or an MTP layer's passes run by propose): a plain step saves it
        sunk = self._sunk(engine.clock.aside - aside)
        host, plain = self.host_cost + sunk, self.plain_cost
        items, n, rate = cut_offer(self.curve, offer, self.acceptance.factor, host)
        slots = self._reprobe_slots(offer, items)
        losing = not reprobe and self.losing
        if not items:
            # no candidates yet (after plain steps, at the start): this pass makes
            # them; right after a draft step, whose pass made them, an empty
            # offer has nothing to send and plain mode follows, unless a
            # priming pass costs next to nothing here
            if (
                offer.primes
                and not primed
                and not losing
                and (reprobe or self._last_kind != "draft" or self._cheap(slots, sunk))
            ):
                self._due = self._primed = reprobe
                return send(0)
            if offer.required:
                return send(0)
            if offer.wait and not primed:
                # nothing after this root, maybe after the next: a pipelined
                # plain step, whose queued pass the next step uses or finishes
                return self._plain(root, queue_next=True, offer=offer)
        elif reprobe or (self._cheap(slots, sunk) and not losing):
            # a re-probe, or a nearly free device: a few items whatever they are
            # worth; a re-probe whose best prefix does not pay sends only those,
            # the step its interval was sized for (a larger tree costs more host)
            few = min(len(items), offer.reprobe_items)
            n = few if reprobe and rate * plain <= 1.0 else max(n, few)
            return send(n, forced=reprobe)
        elif offer.required or (rate * plain > 1.0 and not losing):
            return send(n)  # beats a plain step's tokens per time
        # a re-probe pays its own host work and the restart after it, in full
        own = self.draft_host_cost + sunk
        self.plain_left = plain_interval(self.curve, slots, own, plain, self.restart_cost)
        self.reprobe_cost = reprobe_cost(self.curve, slots, own, plain, self.restart_cost)
        self.plain_spells += 1
        return self._plain(root, queue_next=True, offer=offer)

    def _reprobe_now(self) -> bool:
        """Whether the due re-probe may come now: this generation is long
        enough to carry it (:func:`reprobe_fits`, its decoding steps so far)
        and has tokens left to run it (the queued plain step, a priming pass,
        the draft step and a token after it); otherwise it waits, across
        generations on the context too."""
        left = self.ctx.left
        if left is not None and left <= REPROBE_TOKENS:
            return False
        # the cost as priced, or as the last re-probes took where that was
        # more; with the host term, until one was measured, UNMEASURED_REPROBE
        # times the price (without it the price leaves host work out anyway)
        seen = self.reprobe_seen
        if seen is None and self.host_term:
            seen = UNMEASURED_REPROBE * self.reprobe_cost
        cost = max(self.reprobe_cost, seen or 0.0)
        if self.host_term and self.t1:  # on top of what drafting lost already
            cost += max(self.loss, 0.0) / self.t1
        return reprobe_fits(cost, self.steps * self.plain_cost)

    @staticmethod
    def _reprobe_slots(offer: Offer, items: list[Item]) -> tuple[int, ...]:
        """Slots of the steps of a re-probe of this offer: the base and
        ``reprobe_items`` items (a primed re-probe: the base alone first)."""
        r = offer.reprobe_items
        taken = [it.slots for it in items[:r]]
        step = offer.base_slots + sum(taken) + offer.item_slots * (r - len(taken))
        return (offer.base_slots, step) if offer.primes else (step,)

    def _plain(
        self, root: int, queue_next: bool, offer: Offer | None = None, counted: bool = True
    ) -> StepOutput:
        self.plain_steps += counted
        self._kind = "plain"
        if not self.method.lossless:  # a lossy method's one-token step is its own
            offer = offer if offer is not None else self.method.propose(self.ctx, root)
            return offer.run(0)
        plain = self.plain
        tokens = plain.step(self.ctx.engine, root, queue_next)
        self.method.observe(self.ctx, None, PlainResult(tokens, plain.queued, root, plain.last_top))
        return StepOutput(tokens)

    def _send(self, offer: Offer, items: list[Item], n: int, forced: bool) -> StepOutput:
        """Run the step with the first ``n`` items; learn from its outcome."""
        self._kind = "draft"
        acc = self.acceptance
        reset = forced and acc.model.reset_on_reprobe_hit
        if offer.run is not None:  # lossy: the method's own pass
            out = offer.run(n)
            if n and offer.source:
                if reset and out.accepted == out.drafted:
                    acc.reset()  # the text changed: old rates no longer apply
                acc.source(offer.source).record(out.drafted, out.accepted)
            return out
        draft = offer.build(n)
        verified = speculative_step(self.ctx.engine, draft, self.sampler)
        self.method.observe(self.ctx, draft, verified)
        self._learn(offer, items[:n], draft, verified, reset)
        return StepOutput(verified.tokens, draft.drafted, len(verified.path))

    def _learn(
        self, offer: Offer, kept: list[Item], draft: Draft, verified: Verified, reset: bool
    ) -> None:
        acc = self.acceptance
        path = verified.path
        if self.auto and acc.calibration is not None and any(it.node for it in kept):
            acc.calibration.record(sum(it.value for it in kept if it.node), len(path))
        if not draft.tags:
            return
        if reset and draft.drafted and len(path) == draft.drafted:
            acc.reset()  # a re-probe's whole draft accepted: the text changed
        on_path = {0, *path}
        parents = draft.parent_slots()
        gained = dict.fromkeys(offer.gains, 0)
        for i, tags in enumerate(draft.tags):
            slot = i + 1
            if int(parents[slot]) in on_path:
                hit = slot in on_path
                acc.record(tags, hit)
                if hit:
                    for name in {t[0] for t in tags} & gained.keys():
                        gained[name] += 1
        for name, tokens in gained.items():
            acc.record_gain(name, tokens)
