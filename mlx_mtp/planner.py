"""The planner: one place that spends the device's forward time on drafts.

A draft method only *offers* (:class:`~mlx_mtp.offers.Offer`: best-first
draft items, each worth the expected accepted tokens it adds) and *observes*
what was committed. The :class:`Planner` decides the rest (docs/budget.md):

1. Fixed settings (``auto`` off): the whole offer is sent.
2. *The cut*: the prefix that maximises expected tokens per unit of time
   (Leviathan et al. 2023, §3.4) under the device's cost curve and the
   measured host work of a draft step (:mod:`~mlx_mtp.steptimes`), sent
   where it beats a measured, pipelined plain step. Device work an offer
   already took (a draft model's passes) is spent either way: not priced.
3. *The ledger* (:mod:`~mlx_mtp.ledger`): per generation, drafting (draft
   steps, the pipeline's stop and restart around them, drafts made and not
   sent) may lose at most ``EPSILON`` of the time so far plus one plain
   step, against plain steps of the same tokens. Past that, and for an
   offer that takes device work once the credit cannot pay a probe of it,
   the steps are pipelined one-token steps as ``ntp`` runs them (*plain
   mode*); *probes* (a few items the cut does not send, where certain
   drafts would pay) cost at most ``EPSILON`` of the time since the last
   one.
4. *Shadow scoring*: a free offer (prompt lookup, the recycling table) is
   made at plain steps too and scored against the tokens they commit
   (:class:`~mlx_mtp.scoring.Shadow`): its estimates follow the text.

The ledger and shadow scoring are this package's own.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from . import distributed
from .acceptance import CARRY_WEIGHT, Acceptance
from .budget import CostCurve, CostCurves, as_curves
from .costs import LiveCurves
from .ledger import EPSILON, Ledger
from .offers import Budget, Item, Offer, PlainResult, StepOutput
from .plain import PlainSteps
from .scoring import Shadow, learn
from .speculative import speculative_step
from .steptimes import StepTimes
from .verify import Sampler

if TYPE_CHECKING:
    from .context import Context
    from .methods.base import DraftMethod


@dataclass
class Learned:
    """What a :class:`Planner` at ``auto`` learned in one generation, kept for
    the next on the same :class:`~mlx_mtp.context.Context`.

    Attributes:
        acceptance: the acceptance estimates.
        times: the measured step times (a draft step's host work, a plain step).
        gain: average gain over plain steps of an offer that takes device work
            (a draft model's), in one-token forwards per step (None: unmeasured).
    """

    acceptance: Acceptance
    times: StepTimes = field(default_factory=StepTimes)
    gain: float | None = None


class Planner:
    """Runs one generation's steps of a :class:`~mlx_mtp.methods.base.DraftMethod`
    (see the module doc).

    Args:
        ctx: the method's context (this planner sets ``ctx.budget`` and
            ``ctx.plain``).
        method: a prepared draft method (its ``auto`` turns the planning on).
        sampler: None for greedy decoding, else the sampler of plain decoding.
        curves: the forward cost curves (read only at ``auto``): a
            :class:`~mlx_mtp.costs.LiveCurves` is refined from this
            generation's passes; fixed curves are used as they are.

    Attributes:
        acceptance: this generation's acceptance estimates.
        curve: the cost curve at the cache's current length (``auto``).
        plain_steps: one-token steps run instead of a draft so far.
        reprobes: probes so far (draft steps the cut did not predict to pay).
        plain_spells: times plain mode began (a plain step where the method
            offered a draft, after a step that was not plain).
        ledger: this generation's :class:`~mlx_mtp.ledger.Ledger` (steps
            measured where the curve knows a forward's seconds, else priced).
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
        learned = ctx.learned.get(self._key) if self.auto else None
        if learned is None:
            learned = Learned(Acceptance(method.acceptance_model()))
        else:  # what one text taught counts less in the next
            learned.acceptance.soften(CARRY_WEIGHT)
        self.acceptance, self.times = learned.acceptance, learned.times
        self.ledger = Ledger(learned.gain)
        self.times.flush()
        self.curve = self.curves.at(ctx.engine.offset) if self.auto else None
        self.plain = ctx.plain = PlainSteps(sampler, method.plain_topk)
        ctx.engine.clock.take_outside()  # a wait after the last generation is not this one's
        ctx.budget = Budget(self.acceptance)
        self.plain_steps = self.reprobes = self.plain_spells = 0
        # measured times count where the curve knows a forward's seconds, not on
        # a model sharded over ranks (all must draft the same; each has its host)
        known = self.auto and self.curves.t1 is not None and distributed.size() == 1
        self.host_term = known and os.environ.get("MLX_MTP_HOST_TERM") != "0"
        self._paid = 0  # steps of a probe paid from the credit, still to run
        self._probed = 0.0  # the generation's time when the last probe began
        self._shadows: list[Shadow] = []
        self._kind = ""
        # this step: finishes a queued pass to draft after it, found its pass
        # queued; the last offer took device work beside the passes
        self._leaving = self._held = self._costly = False
        self._drafts = 0.0  # the last draft step's item cost, in one-token forwards
        # plain mode's probe price, this step offer's (offers that take device work)
        self._waiting: float | None = None
        self._price: float | None = None
        self._brief()

    # ------------------------------------------------------------- the ledger
    @property
    def t1(self) -> float | None:
        """Seconds of a one-token forward (None: not known, or fixed settings)."""
        return self.curves.t1 if self.auto else None

    @property
    def host_cost(self) -> float:
        """A draft step's host work in one-token forwards (0: not measured)."""
        host = self.times.host
        return max(host, 0.0) / self.t1 if self.host_term and host is not None else 0.0

    @property
    def plain_cost(self) -> float:
        """A plain step's time in one-token forwards (1 until measured)."""
        plain = self.times.plain if self.host_term else None
        return 1.0 if plain is None else max(plain / self.t1, 1e-3)

    @property
    def credit(self) -> float:
        """What drafting may still lose in this generation, in one-token
        forwards: ``EPSILON`` of its time so far plus one plain step, less
        what it lost."""
        return EPSILON * self.ledger.time + self.plain_cost - self.ledger.loss

    def _probe_credit(self) -> float:
        """What a probe may cost now, in one-token forwards: within the
        credit, and ``EPSILON`` of the time since the last probe (the
        generation's first: one plain step), so that probes cost at most
        that share of the time however much drafting gained before."""
        time = self.ledger.time
        if not self.reprobes:
            return min(self.credit, self.plain_cost + EPSILON * time)
        return min(self.credit, EPSILON * (time - self._probed))

    def _probe_cost(self, offer: Offer, items: list[Item], host: float) -> float | None:
        """The worst case of a probe of this offer over plain steps, in
        one-token forwards (its steps' time less a plain step's each: every
        draft rejected), or None where even certain drafts would not pay."""
        plain, k, r = self.plain_cost, max(offer.probe_items, len(items)), offer.probe_items
        if (1 + k) * plain <= self.curve(offer.slots(items, k)) + host + k * offer.item_cost:
            return None  # every item made (at least r) certain: k tokens more
        slots = offer.slots(items, r)
        steps = (offer.base_slots, slots) if offer.primes and not items else (slots,)
        drafts = r * offer.item_cost
        return sum(max(self.curve(s) + host - plain, 0.0) for s in steps) + drafts

    def _brief(self) -> None:  # what this step costs, for the sources (ctx.budget)
        b, host = self.ctx.budget, self.host_cost
        b.curve, b.t1, b.host_cost, b.plain_cost = self.curve, self.t1, host, self.plain_cost
        probe = self._probe_cost(Offer([], probe_items=1), [], host) if self.auto else None
        b.probing = self._paid > 0 or (probe is not None and probe <= self._probe_credit())
        b.credit = self.credit if self.auto else math.inf

    # ------------------------------------------------------------------ step
    def step(self, root: int) -> StepOutput:
        """One decoding step after ``root`` (the last committed token, not yet
        in the cache): a plain step or a draft step."""
        clock = self.ctx.engine.clock
        t0, seconds, slots, aside = clock.now(), clock.seconds, clock.slots, clock.aside
        start = self.ctx.engine.offset
        self._kind, self._leaving, self._price = "", False, None
        out = self._step(root)
        # a wait a benchmark took outside the steps is this step's time alone
        waited, leaving = clock.take_outside(), self._leaving
        t0, seconds = t0 - waited, seconds - waited
        if not self.auto or self._kind == "last":
            return out
        device, n = clock.seconds - seconds, clock.slots - slots
        # a pipelined plain step takes a pass's time only in the steady state:
        # where the pipeline stops (to draft) the pass is mostly done before
        # the step begins, and where it starts again the step waits for two
        steady = self._kind != "plain" or self._held == self.plain.queued
        if out.forwards == 1 and n > 0 and steady:  # the curve at this step's slots
            self.curves.observe(n, device - (clock.aside - aside), start)
        wall, tokens, draft = clock.now() - t0, len(out.tokens), self._kind == "draft"
        # priced: a pass of its slots and the work beside it
        priced = (self.curve(n) + self._drafts if draft else 1.0) + self._sunk(clock.aside - aside)
        if self.host_term:  # measured; a stall past twice the price is the machine's
            plain = self.plain_cost
            cost = min(wall / self.t1, 2.0 * (priced + self.host_cost + plain))
        else:
            cost, plain = priced, 1.0
        kind = "stop" if leaving else self._kind
        self.ledger.record(kind, cost, tokens, plain, clock.aside > aside, self.plain.queued)
        if draft and self.t1 and out.forwards == 1 and n > 0:  # the device time priced
            device = self.t1 * self.curve(n) + clock.aside - aside
        self.times.record(kind, wall, device, steady)
        paying = self.ledger.paying and self.credit > 0
        if self._price is not None and self._price > self.credit and not paying:
            # an offer that costs device work is made again while its steps
            # gain, or the credit pays for a probe of it; past that, not until
            # a probe can be paid for (plain mode: its drafts would be wasted)
            self._waiting = self._price
        return out

    def _sunk(self, seconds: float) -> float:
        """Device ``seconds`` beside the passes, in one-token forwards (0: t1 unknown)."""
        t1 = self.t1
        return max(seconds, 0.0) / t1 if t1 else 0.0

    def finish(self) -> None:
        """The generation ended: cache what the cost curve learned, keep what
        this generation learned for the next one on the context."""
        if self.auto:
            self.times.flush()
            self.curves.save()
            self.ctx.learned[self._key] = Learned(self.acceptance, self.times, self.ledger.gain)

    def _step(self, root: int) -> StepOutput:
        engine = self.ctx.engine
        if self.ctx.left is not None and self.ctx.left <= 1:
            # the generation's last token: no draft could be kept, nothing learned
            out = self._plain(root, queue_next=False, counted=False)
            self._kind = "last"
            return out
        # root's pass is queued when the last step was a pipelined plain step
        queued = self._held = self.auto and self.plain.holds(engine, root)
        if not queued:
            self.plain.unqueue(engine, root)
        if self.auto:  # the cost of a draft slot grows with the context
            self.curve = self.curves.at(engine.offset)
        self._brief()
        if self._waiting is not None:
            if self._waiting > self._probe_credit():
                return self._plain(root, queue_next=True)
            self._waiting = None
        if queued and self._costly:  # finish the half-done plain step before drafting
            self._leaving = True
            return self._plain(root, queue_next=False)
        aside = engine.clock.aside
        offer = self.method.propose(self.ctx, root)
        if not self.auto:
            items = list(offer.items)
            return self._send(offer, items, len(items), probe=False)
        # device work the offer already took (a draft model's passes) is spent
        # whatever this step sends: the cut prices what sending adds, and
        # drafts made go where they pay; a probe would take that work again
        items, n, rate = offer.cut(self.curve, self.acceptance.factor, self.host_cost)
        host = self.host_cost + self._sunk(engine.clock.aside - aside)
        self._costly = engine.clock.aside > aside
        if not offer.free and not offer.required:
            price = self._probe_cost(offer, items, host)
            self._price = math.inf if price is None else price
        # the cut: a prefix beats a plain step (while drafting has credit left)
        pays = items and rate * self.plain_cost > 1.0 and (self.credit > 0 or self._costly)
        gains = offer.required or pays
        if not gains and not self._paid and (offer.primes or not offer.free):
            cost = self._probe_cost(offer, items, host) if items or offer.primes else None
            if cost is not None and cost <= self._probe_credit():  # a probe
                self._paid = 2 if offer.primes and not items else 1
                self.reprobes, self._probed = self.reprobes + 1, self.ledger.time
        if not gains and not self._paid:  # plain mode, or nothing to draft
            self.plain_spells += bool(items or offer.primes) and self.ledger.last != "plain"
            return self._plain(root, queue_next=True, offer=offer, shadow=(offer, items))
        if queued:  # finish the half-done plain step first; the draft goes in after it
            self._leaving = True
            return self._plain(root, queue_next=False, offer=offer)
        if gains:
            self._paid = 0
            return self._send(offer, items, n, probe=False)
        self._paid -= 1
        if not items:  # a priming pass makes the next step's candidates
            if offer.primes and self._paid:
                return self._send(offer, items, 0, probe=True)
            self._paid = 0  # it made none: nothing to probe
            return self._plain(root, queue_next=True)
        self._paid = 0
        return self._send(offer, items, max(n, min(len(items), offer.probe_items)), probe=True)

    def _plain(
        self,
        root: int,
        queue_next: bool,
        offer: Offer | None = None,
        counted: bool = True,
        shadow: tuple[Offer, list[Item]] | None = None,
    ) -> StepOutput:
        self.plain_steps += counted
        self._kind = "plain"
        if not self.method.lossless:  # a lossy method's one-token step is its own
            offer = offer if offer is not None else self.method.propose(self.ctx, root)
            return offer.run(0)
        tokens = self.plain.step(self.ctx.engine, root, queue_next)
        self.method.observe(
            self.ctx, None, PlainResult(tokens, self.plain.queued, root, self.plain.last_top)
        )
        acc = self.acceptance
        new = [Shadow.of(*shadow)] if shadow is not None else []
        self._shadows = [s for s in self._shadows + new if s and s.score(tokens[0], acc)]
        return StepOutput(tokens)

    def _send(self, offer: Offer, items: list[Item], n: int, probe: bool) -> StepOutput:
        """Run the step with the first ``n`` items; learn from its outcome."""
        self._kind, self._shadows = "draft", []
        acc = self.acceptance
        reset = probe and acc.model.reset_on_probe_hit
        if offer.run is not None:  # lossy: the method's own pass
            out = offer.run(n)
            if n and offer.source:
                if reset and out.accepted == out.drafted:
                    acc.reset()  # the text changed: old rates no longer apply
                acc.source(offer.source).record(out.drafted, out.accepted)
            return out
        draft = offer.build(n)
        self._drafts = offer.item_cost * draft.drafted  # priced: the drafts' own passes
        verified = speculative_step(self.ctx.engine, draft, self.sampler)
        self.method.observe(self.ctx, draft, verified)
        learn(acc, offer, items[:n], draft, verified, reset, calibrate=self.auto)
        return StepOutput(verified.tokens, draft.drafted, len(verified.path))
