"""The forward cost curve and the cut of a best-first draft under it.

Speculative methods pay for their drafts in forward time: a pass over ``n``
slots (tokens and mask vectors) costs ``c(n)`` one-token forwards. On a
memory-bound GPU ``c`` is nearly flat up to a knee (a 30-slot tree costs little
more than one token); on a CPU it rises from the second slot (this machine,
SmolLM2-135M float32: ``c(2) = 1.24``, ``c(16) = 1.88``). The same draft size
can therefore be a win on one device and a loss on another
(docs/design.md, failure class 11). Pure functions and small classes, read
top to bottom:

1. :class:`CostCurve`: ``c(n)`` at a few measured sizes, linear in between and
   beyond the last one; :class:`CostCurves`, the curve as a function of the
   context length (every draft slot attends over the whole cache). Measured,
   cached and refined online by :mod:`mlx_mtp.costs`.
2. :func:`best_prefix`: a draft whose items (nodes, mask sets, chain tokens)
   are offered best first, each with its expected accepted tokens, is cut at
   the prefix that maximises ``(1 + expected accepted) / c(slots)`` (the
   classic speculative-decoding objective, Leviathan et al. 2023, §3.4, with
   a measured cost instead of a constant ratio). :class:`PrefixBound` runs it
   online with an early stop. The planner (:mod:`mlx_mtp.planner`) decides
   with it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import InvalidArgumentError

#: how far beyond the longest measured context a curve is extrapolated, in
#: multiples of the measured span (longer contexts use the limit)
MAX_EXTRAPOLATION = 4.0


class CostCurve:
    """Relative cost ``c(n)`` of a forward pass of ``n`` slots (1.0 = one token).

    Args:
        sizes: increasing slot counts, the first one 1.
        costs: the relative cost at each size (``costs[0]`` is 1.0); a
            decreasing measurement (timing noise) is flattened so that ``c``
            never decreases.
        context: tokens in the cache when it was measured (None: not known,
            or the same at every context).
        seconds: the measured time of one slot (None: not known).
        measured: the costs are timings at these sizes only: between two
            sizes ``c`` takes the larger one's cost, so that a step of the
            device's kernels between them (Metal's quantized matmul works in
            32-row tiles) is never priced below what was measured. Otherwise
            (a curve given by hand, a simulated device) ``c`` is linear in
            between.

    ``c(n)`` extends the last segment's slope beyond the largest size;
    ``c(n) = 1`` for ``n <= 1``.

    Raises:
        ValueError: sizes not increasing from 1, or lengths differ.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        costs: Sequence[float],
        context: int | None = None,
        seconds: float | None = None,
        measured: bool = False,
    ):
        sizes = [int(s) for s in sizes]
        costs = [float(c) for c in costs]
        if len(sizes) != len(costs) or not sizes or sizes[0] != 1:
            raise ValueError("a cost curve needs sizes starting at 1 and one cost per size")
        if any(b <= a for a, b in zip(sizes, sizes[1:])):
            raise ValueError(f"cost curve sizes must increase, got {sizes}")
        mono = [1.0]
        for c in costs[1:]:
            mono.append(max(mono[-1], c if math.isfinite(c) else mono[-1]))
        self.sizes, self.costs, self.context, self.seconds = sizes, mono, context, seconds
        self.measured = measured
        self._least: dict[int, list[float]] = {}

    @classmethod
    def flat(cls, knee: int = 16, slope: float = 0.01, upto: int = 256) -> CostCurve:
        """A memory-bound device: ``c(n) = 1`` up to ``knee`` slots, then rising
        by ``slope`` per slot (a simulated GPU, for tests and planning)."""
        sizes = [1, knee, upto]
        return cls(sizes, [1.0, 1.0, 1.0 + slope * (upto - knee)])

    @classmethod
    def linear(cls, slot_cost: float, upto: int = 256) -> CostCurve:
        """``c(n) = 1 + slot_cost * (n - 1)``: one marginal cost per slot, the
        model behind :meth:`Engine.slot_cost`."""
        return cls([1, upto], [1.0, 1.0 + slot_cost * (upto - 1)])

    def __call__(self, n: float) -> float:
        if n <= 1:
            return 1.0
        s, c = self.sizes, self.costs
        if len(s) == 1:
            return 1.0
        i = bisect.bisect_left(s, n)  # on the list: called per draft item, every step
        if i >= len(s):
            i = len(s) - 1
        elif self.measured:  # up to the next measured size: never below a measured step
            return c[i]
        a, b = i - 1, i
        return c[a] + (c[b] - c[a]) * (n - s[a]) / (s[b] - s[a])

    def least_slopes(self, max_slots: int) -> list[float]:
        """``m[s]``, the least average slope ``(c(t) - c(s)) / (t - s)`` over
        ``s < t <= max_slots``, for ``s = 1 .. max_slots`` (index by slots;
        0 at ``max_slots``), computed once per curve and size."""
        hit = self._least.get(max_slots)
        if hit is None:
            n = np.arange(1, max_slots + 1)
            c = np.array([self(int(x)) for x in n])
            dc = c[None, :] - c[:, None]
            dn = (n[None, :] - n[:, None]).astype(float)
            with np.errstate(divide="ignore", invalid="ignore"):
                avg = np.where(dn > 0, dc / np.where(dn > 0, dn, 1.0), np.inf)
            least = np.maximum(avg.min(axis=1), 0.0)
            hit = self._least[max_slots] = [0.0, *least.tolist()]
        return hit

    def slot_cost(self, n: int = 32) -> float:
        """Mean marginal cost of a slot up to ``n``: ``(c(n) - 1) / (n - 1)``."""
        return (self(n) - 1.0) / (n - 1) if n > 1 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = {
            "context": self.context,
            "sizes": self.sizes,
            "costs": [round(c, 4) for c in self.costs],
        }
        if self.seconds is not None:
            out["seconds"] = self.seconds
        return out

    def __repr__(self) -> str:
        pts = ", ".join(f"{s}:{c:.2f}" for s, c in zip(self.sizes, self.costs))
        return f"CostCurve({pts})"


class CostCurves:
    """The forward cost curve as a function of the context length.

    Every slot of a draft attends over the whole cache, so the marginal cost
    of a slot grows with the context while a one-token step's grows less
    (this machine, SmolLM2-135M float32, one core: ``c(16) = 1.61`` at 64
    tokens of context, ``1.93`` at 1,536; ``c(32)`` 2.36 and 3.27). A budget
    planned with a short-context curve overspends on long prompts (RAG).

    Args:
        curves: curves measured at different ``context`` lengths (a curve
            without a context counts as context 0). One curve: the same cost
            at every context.

    :meth:`at` interpolates the costs linearly in the context length between
    the two nearest measured curves (at the first curve's sizes), is constant
    below the shortest, extrapolates linearly beyond the longest up to
    ``MAX_EXTRAPOLATION`` times the measured span, and never lets ``c(n)``
    exceed ``n`` there. Results are kept per 64-token bucket.

    Raises:
        ValueError: no curve.
    """

    BUCKET = 64

    def __init__(self, curves: Sequence[CostCurve]):
        if not curves:
            raise ValueError("CostCurves needs at least one curve")
        self.curves = sorted(curves, key=lambda c: c.context or 0)
        self._at: dict[int, CostCurve] = {}

    def at(self, context: int) -> CostCurve:
        """The curve for a cache of ``context`` tokens."""
        if len(self.curves) == 1:
            return self.curves[0]
        bucket = max(int(context), 0) // self.BUCKET
        hit = self._at.get(bucket)
        if hit is None:
            hit = self._at[bucket] = self._interpolate(bucket * self.BUCKET)
        return hit

    def _interpolate(self, context: int) -> CostCurve:
        cs = self.curves
        ctx = [c.context or 0 for c in cs]
        if context <= ctx[0]:
            return cs[0]
        i = min(int(np.searchsorted(ctx, context)), len(cs) - 1)
        lo, hi = cs[i - 1], cs[i]
        span = max(ctx[i] - ctx[i - 1], 1)
        w = min((context - ctx[i - 1]) / span, MAX_EXTRAPOLATION)
        costs = [lo(n) + w * (hi(n) - lo(n)) for n in lo.sizes]
        if w > 1.0:  # extrapolated: never above n one-token passes
            costs = [min(c, float(n)) for c, n in zip(costs, lo.sizes)]
        return CostCurve(lo.sizes, costs, context=context, seconds=lo.seconds, measured=lo.measured)

    def to_list(self) -> list[dict[str, Any]]:
        return [c.to_dict() for c in self.curves]

    def __repr__(self) -> str:
        return "CostCurves(" + "; ".join(f"{c.context}: {c!r}" for c in self.curves) + ")"


def as_curves(curve: CostCurve | CostCurves) -> CostCurves:
    """A :class:`CostCurves` (a single curve: the same at every context)."""
    return curve if isinstance(curve, CostCurves) else CostCurves([curve])


def parse_curve(spec: str) -> CostCurve:
    """``"1:1,16:1,64:1.2"`` (slots:relative cost pairs) -> :class:`CostCurve`.

    Raises:
        InvalidArgumentError: not such a list, or sizes not increasing from 1.
    """
    try:
        pairs = [p.split(":") for p in spec.replace(" ", "").split(",") if p]
        return CostCurve([int(n) for n, _ in pairs], [float(c) for _, c in pairs])
    except ValueError as e:
        raise InvalidArgumentError(
            f"MLX_MTP_COST_CURVE={spec!r} is not a cost curve: give slots:cost pairs with "
            f"increasing slots from 1, e.g. '1:1,16:1,64:1.2' ({e})."
        ) from None


# --------------------------------------------------------------------- policy
def best_prefix(
    curve: CostCurve,
    values: Sequence[float],
    slots: Sequence[int] | int,
    base_slots: int = 1,
    base_value: float = 0.0,
    item_cost: float = 0.0,
    base_cost: float = 0.0,
) -> tuple[int, float]:
    """The prefix of a best-first list of draft items that maximises expected
    tokens per unit of time.

    Args:
        curve: the device's forward cost.
        values: expected accepted tokens each item adds (nodes: their path
            acceptance probability; mask sets: their expected future tokens).
        slots: slots each item takes (one int for all, or one per item).
        base_slots: slots present anyway (the root, and the root's masks).
        base_value: expected accepted tokens of the base slots.
        item_cost: time each item costs besides its slots, in one-token
            forwards (a draft model's pass per drafted token: ``mtp``'s
            layer and LM head); 0 for drafts that cost nothing to make.
        base_cost: time a draft step costs besides its forward pass, in
            one-token forwards (the host work of drafting and verifying).

    Returns:
        ``(n, rate)``: items to keep (0 = none) and the rate
        ``(1 + base_value + sum(values[:n])) / (c(base_slots + slots[:n]) + n * item_cost
        + base_cost)``.
    """
    p = PrefixBound(curve, None, base_slots, base_value, item_cost, base_cost)
    for i, v in enumerate(values):
        p.add(v, slots if isinstance(slots, int) else slots[i])
    return p.best_n, p.best


class PrefixBound:
    """:func:`best_prefix` run online, with an early stop: while a best-first
    allocation takes items one by one, whether any longer prefix could still
    beat the best one so far.

    Not from a paper. The allocation's remaining items are worth at most ``u``
    expected tokens per slot (the caller's bound), and ``c`` rises at least as
    fast as ``m(s)``, its least average slope from ``s`` slots on (over whole
    slots up to ``max_slots``). Adding ``d`` slots to a prefix of value ``A``
    (1 + expected tokens) at ``s`` slots therefore yields at most
    ``(A + u d) / (c(s) + m(s) d)``, which is monotone in ``d``: it cannot
    beat the best rate when both ends (``d = 0`` and ``d = max_slots - s``)
    do not. Stopping there leaves :func:`best_prefix` of the items taken with
    the same answer as of all items (ties included).

    Args:
        curve: the device's forward cost.
        max_slots: the most slots a prefix may take (BC); needed only by
            :meth:`exhausted`.
        base_slots, base_value, item_cost, base_cost: as :func:`best_prefix`.

    Attributes:
        best_n, best: the best prefix of the items added so far and its rate
            (what :func:`best_prefix` of them returns).
    """

    def __init__(
        self,
        curve: CostCurve,
        max_slots: int | None,
        base_slots: int = 1,
        base_value: float = 0.0,
        item_cost: float = 0.0,
        base_cost: float = 0.0,
    ):
        self.curve, self.max_slots, self.item_cost = curve, max_slots, item_cost
        self.base_cost = base_cost
        self.total, self.used, self.items = 1.0 + base_value, base_slots, 0
        self.best_cost = curve(self.used) + base_cost
        self.best_n, self.best = 0, self.total / self.best_cost

    def add(self, value: float, slots: int) -> None:
        """Take the next item: ``value`` expected tokens over ``slots`` slots."""
        v = max(float(value), 0.0)
        self.total += v
        self.used += slots
        self.items += 1
        cost = self.curve(self.used) + self.item_cost * self.items + self.base_cost
        r = self.total / cost
        # a free item of any value is taken (1 + 1e-19 rounds to 1 in a ratio)
        if r > self.best or (v > 0.0 and cost <= self.best_cost):
            self.best_n, self.best, self.best_cost = self.items, r, cost

    def exhausted(self, per_slot: float) -> bool:
        """Whether items worth at most ``per_slot`` expected tokens per slot can
        no longer give a better prefix (or no slot is left)."""
        s, top = self.used, self.max_slots
        if top is None:
            raise ValueError("PrefixBound.exhausted needs max_slots")
        if s >= top:
            return True
        u, a, m = max(per_slot, 0.0), self.total, self.curve.least_slopes(top)[s]
        c = self.curve(s) + self.base_cost + self.item_cost * self.items
        if u == 0.0 or u * c < m * a * (1.0 - 1e-9):  # the bound falls with every slot
            return True
        d = top - s  # a margin for rounding: stop only when clearly done
        return (a + u * d) / (c + m * d) < self.best * (1.0 - 1e-9)
