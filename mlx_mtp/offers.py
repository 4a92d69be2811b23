"""What a draft method hands the planner and gets back (no policy here).

A method *offers* (:class:`Offer`: a best-first list of draft items, each an
:class:`Item` with the expected accepted tokens it adds and the slots it
takes, and a way to build the draft of any prefix; :func:`chain_offer` for
one chain) and is told what a step committed (:class:`StepOutput`; after a
one-token step in plain mode, :class:`PlainResult`). The planner
(:mod:`mlx_mtp.planner`) decides how much of an offer each step sends, and
tells the sources what a step costs as data (:class:`Budget`, ``ctx.budget``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .acceptance import Acceptance, chain_values
from .budget import CostCurve, PrefixBound, best_prefix
from .speculative import Draft


@dataclass
class StepOutput:
    """What one decoding step commits.

    Attributes:
        tokens: committed token ids, bonus token included (at least one). On
            return the engine's cache holds every committed token but the last.
        drafted: draft tokens sent to verification this step (0 for ntp).
        accepted: draft tokens accepted (``len(tokens) - 1`` for lossless
            methods).
        forwards: target-model forward passes this step used.
    """

    tokens: list[int]
    drafted: int = 0
    accepted: int = 0
    forwards: int = 1


@dataclass
class Item:
    """One draft item of an :class:`Offer`.

    Attributes:
        value: expected accepted tokens it adds (a node: its path acceptance
            estimate; a mask set: the tokens its drafts are expected to add).
        slots: slots it adds to the forward pass.
        node: a draft node (scaled by the whole-draft calibration) or not.
    """

    value: float
    slots: int = 1
    node: bool = True


@dataclass
class Offer:
    """What a draft method proposes for one step (see the module doc).

    Attributes:
        items: the draft items, best first; a prefix of any length must be a
            valid draft. May be a generator (produced as the planner takes
            them).
        build: ``build(n)`` -> the :class:`~mlx_mtp.speculative.Draft` of the
            first ``n`` items (lossless offers).
        run: ``run(n)`` -> the :class:`~mlx_mtp.methods.base.StepOutput` of
            a lossy step with the first ``n`` items (its own forward pass, no
            verification); ``run(0)`` is its one-token step. Set instead of
            ``build``.
        base_slots: slots the pass has anyway (the root, its masks, a Jacobi
            window).
        base_value: expected accepted tokens of the base slots.
        item_cost: time each item costs besides its slots, in one-token
            forwards (a drafter's own pass per drafted token).
        item_slots: slots of an item not offered yet (sizes a probe).
        max_slots: the most slots the pass may take (BC); with ``remaining``
            it lets the planner stop taking items early.
        remaining: ``remaining(scale)`` -> an upper bound on the value per
            slot of any item not produced yet, node values times ``scale``.
        primes: after plain steps the method's first pass only makes
            candidates (see the module doc).
        free: making the offer took no device work and its nodes are token
            guesses (prompt lookup, the recycling table): the planner makes
            it at plain steps too and scores it against the tokens they
            commit (shadow scoring), and does not probe for it.
        required: the base slots must be sent every step (lookahead's
            Jacobi window): the planner may cut items, never go plain.
        probe_items: items a probe sends whatever their estimates.
        gains: sources whose tokens per step the planner learns this step
            (:meth:`~mlx_mtp.acceptance.Acceptance.gain`).
        source: a lossy offer's source, whose per-depth acceptance the
            planner records from the run's drafted / accepted counts.
    """

    items: Iterable[Item]
    build: Callable[[int], Draft] | None = None
    run: Callable[[int], StepOutput] | None = None
    base_slots: int = 1
    base_value: float = 0.0
    item_cost: float = 0.0
    item_slots: int = 1
    max_slots: int | None = None
    remaining: Callable[[float], float] | None = None
    primes: bool = False
    free: bool = False
    required: bool = False
    probe_items: int = 2
    gains: Sequence[str] = ()
    source: str = ""

    def slots(self, items: list[Item], n: int) -> int:
        """Slots of a pass with the first ``n`` of ``items`` (taken from this
        offer; those past them sized by ``item_slots``)."""
        few = items[:n]
        return self.base_slots + sum(it.slots for it in few) + self.item_slots * (n - len(few))

    def cut(
        self, curve: CostCurve, scale: float = 1.0, host: float = 0.0
    ) -> tuple[list[Item], int, float]:
        """Take the items (until no longer prefix can pay, where the offer
        bounds what it has not produced: :class:`~mlx_mtp.budget.PrefixBound`)
        and find the best prefix under ``curve`` (Leviathan et al. 2023,
        §3.4), node values times ``scale``, a draft step costing ``host``
        one-token forwards of host work besides.

        Returns:
            ``(items taken, n, rate)``: the best prefix keeps ``n`` items, at
            ``rate`` expected tokens per one-token forward of time.
        """
        bound = PrefixBound(
            curve, self.max_slots, self.base_slots, self.base_value, self.item_cost, host
        )
        stop = self.remaining if self.max_slots is not None else None
        items: list[Item] = []
        for it in self.items:
            items.append(it)
            bound.add(it.value * scale if it.node else it.value, it.slots)
            if stop is not None and len(items) >= self.probe_items:
                if bound.exhausted(stop(scale)):
                    break
        return items, bound.best_n, bound.best


def chain_offer(
    root: int,
    tokens: Sequence[int],
    source: str,
    acceptance: Acceptance,
    **draft: Any,
) -> Offer:
    """An :class:`Offer` of one chain of token guesses from one source: item d
    is worth the chance that drafts 1..d are all accepted (the source's
    per-depth estimates), each one slot; ``draft`` goes to
    :meth:`Draft.chain <mlx_mtp.speculative.Draft.chain>`, and ``free`` /
    ``item_cost`` / ... given there go to the offer instead."""
    offer_keys = {"free", "item_cost", "primes", "required", "probe_items", "base_slots"}
    opts = {k: draft.pop(k) for k in list(draft) if k in offer_keys}
    toks = [int(t) for t in tokens]
    values = chain_values(acceptance.qs(source, len(toks)))
    tags = [[(source, d + 1, 1.0)] for d in range(len(toks))]

    def build(n: int) -> Draft:
        return Draft.chain(root, toks[:n], tags=tags[:n], **draft)

    return Offer([Item(v) for v in values], build, **opts)


@dataclass
class PlainResult:
    """The outcome of a one-token step in plain mode (what :meth:`observe
    <mlx_mtp.methods.base.DraftMethod.observe>` gets instead of a
    :class:`~mlx_mtp.speculative.Verified`).

    Attributes:
        tokens: the committed token.
        queued: the step also started the forward pass of its token (the
            pipeline goes on; that pass's outputs come with the next step).
        root: the token whose logits gave it.
        top: (k,) int32 the ``k`` best token ids of those logits, best first,
            when the method asks for them (``plain_topk``), else None.
    """

    tokens: list[int]
    queued: bool = False
    root: int = -1
    top: np.ndarray | None = None


@dataclass
class Budget:
    """What the planner of the generation under way tells a method's sources
    (``ctx.budget``, refreshed before each offer): data, no policy.

    Attributes:
        acceptance: this generation's acceptance estimates.
        curve: the forward cost curve at the cache's current length, in
            one-token forwards (None: fixed settings).
        t1: seconds of a one-token forward of the target, as the curve knows
            it (None: not known, or fixed settings).
        host_cost: a draft step's host work, in one-token forwards (0 without
            the planner's host term).
        plain_cost: a plain step's time, in one-token forwards.
        probing: this step may send a draft token whatever it is worth (a
            probe the planner's ledger can pay for).
        credit: what drafting may still lose in this generation, in
            one-token forwards (the planner's ledger; inf: fixed settings).
    """

    acceptance: Acceptance
    curve: CostCurve | None = None
    t1: float | None = None
    host_cost: float = 0.0
    plain_cost: float = 1.0
    probing: bool = False
    credit: float = math.inf

    def worst(self, drafts: int, item_cost: float) -> float:
        """What a step of a chain of ``drafts`` tokens, each costing
        ``item_cost`` one-token forwards to make, loses against a plain step
        where every draft is rejected (0 with fixed settings)."""
        if self.curve is None:
            return 0.0
        made = drafts * item_cost + self.curve(1 + drafts) + self.host_cost
        return made - self.plain_cost

    def chain_length(self, source: str, most: int, item_cost: float) -> int:
        """How many drafts a source whose drafts cost ``item_cost`` one-token
        forwards each should make (a native MTP layer): the best prefix of its
        per-depth estimates under the cost curve (Leviathan et al. 2023, §3.4);
        ``most`` with fixed settings, at least one while probing."""
        if self.curve is None:
            return most
        values = chain_values(self.acceptance.qs(source, most))
        n, _ = best_prefix(self.curve, values, 1, item_cost=item_cost, base_cost=self.host_cost)
        return max(n, 1) if self.probing else n

    def prefix_bound(self, item_cost: float, max_slots: int) -> PrefixBound:
        """A :class:`~mlx_mtp.budget.PrefixBound` on this step's curve, for a
        source that decides while it drafts whether drafting more can pay
        (each draft costing ``item_cost`` one-token forwards: a draft model).

        Raises:
            ValueError: fixed settings (no curve to plan with)."""
        if self.curve is None:
            raise ValueError("prefix_bound needs a curve: only auto plans a draft's length")
        return PrefixBound(self.curve, max_slots, 1, 0.0, item_cost, self.host_cost)
