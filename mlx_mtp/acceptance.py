"""Online acceptance estimates: what the planner learns from verified steps.

Every draft node a method sends is tagged with the source that proposed it,
its depth under the root, and a raw score (1 for a plain token guess, the mask
probability for a probe candidate). After verification the planner records,
for every node whose parent was accepted, whether the node was accepted
(:meth:`Acceptance.record`). Read top to bottom:

1. :class:`DepthAcceptance`: per depth, ``(decayed accepted + w * prior) /
   (decayed tried + w)``. With raw scores of 1 this is the conditional
   acceptance rate ``q(d)`` of a chain source; with probabilities as raw
   scores, ``tried`` sums them and the ratio becomes a calibration factor
   (accepted per predicted), the prior 1.
2. :class:`Calibration`: accepted draft tokens per predicted one over recent
   draft steps, one factor for a whole draft (the sum of node estimates can
   stay too hopeful while each node's own estimate looks right).
3. :class:`Acceptance`: one :class:`DepthAcceptance` per source, the mean
   tokens each source earns per step it offered candidates in (``gain``), and
   the :class:`Calibration`; configured per method by an
   :class:`AcceptanceModel`.

Not from a paper: Beta-smoothed rates with exponential forgetting, the usual
choice for non-stationary Bernoulli estimates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

#: weight of what one generation learned when the next one on the context
#: starts (:meth:`Acceptance.soften`)
CARRY_WEIGHT = 0.5

#: a node's provenance: (source name, depth 1.., raw score)
Tag = tuple[str, int, float]


def chain_values(q: Sequence[float]) -> list[float]:
    """Expected-accept value of each chain position: ``prod(q[:d+1])``, the
    chance that the first d+1 drafts are all accepted."""
    out, p = [], 1.0
    for x in q:
        p *= float(x)
        out.append(p)
    return out


class DepthAcceptance:
    """Acceptance ratio per draft depth, Beta-smoothed and decayed.

    ``ratio(d) = (decayed accepted + w * prior) / (decayed tried + w)``; every
    observation at a depth multiplies the earlier counts there by ``decay``,
    so the estimate follows the text. The prior's weight ``w`` decays with the
    observations too (``weight * decay^k`` after k of them): a prior that kept
    its weight against decayed counts capped at ``1 / (1 - decay)`` would
    hold the estimate above ``prior * weight / (weight + 1 / (1 - decay))``
    however often drafts fail, and on a device where a second slot costs
    less than that a one-token draft would always look worth it.

    Args:
        prior: prior ratio (before any observation), or one per depth 1..
            (the last one for deeper depths).
        weight: prior weight in pseudo-observations.
        decay: per-observation forgetting factor in (0, 1] (1: no forgetting).
        max_depth: deeper depths share the last bucket.
    """

    def __init__(
        self,
        prior: float | Sequence[float] = 0.5,
        weight: float = 2.0,
        decay: float = 0.8,
        max_depth: int = 16,
    ):
        self.weight, self.decay, self.max_depth = weight, decay, max_depth
        ps = [float(prior)] if isinstance(prior, (int, float)) else [float(p) for p in prior]
        #: the prior of every depth bucket (index 0 unused)
        self.prior = np.array([ps[0], *(ps[min(d, len(ps)) - 1] for d in range(1, max_depth + 1))])
        self.acc = np.zeros(max_depth + 1)
        self.tried = np.zeros(max_depth + 1)
        self.prior_weight = np.full(max_depth + 1, float(weight))

    def q(self, depth: int) -> float:
        """The ratio at ``depth`` (1..)."""
        d = min(depth, self.max_depth)
        w = self.prior_weight[d]
        return float((self.acc[d] + w * self.prior[d]) / (self.tried[d] + w))

    def qs(self, n: int) -> list[float]:
        """``[q(1), ..., q(n)]``."""
        return [self.q(d) for d in range(1, n + 1)]

    def reset(self) -> None:
        """Forget every observation."""
        self.acc[:] = 0.0
        self.tried[:] = 0.0
        self.prior_weight[:] = self.weight

    def add(self, depth: int, accepted: bool, raw: float = 1.0) -> None:
        """One tried node at ``depth`` (its parent was accepted), with raw
        score ``raw``, and whether it was accepted."""
        b = min(depth, self.max_depth)
        self.acc[b] = self.acc[b] * self.decay + (1.0 if accepted else 0.0)
        self.tried[b] = self.tried[b] * self.decay + raw
        self.prior_weight[b] *= self.decay

    def record(self, drafted: int, accepted: int) -> None:
        """One verified chain: depths 1..accepted accepted, depth accepted+1
        rejected (if it was drafted); deeper ones were not tried."""
        for d in range(1, min(drafted, accepted + 1) + 1):
            self.add(d, d <= accepted)


@dataclass(frozen=True)
class CalibrationModel:
    """Settings of a :class:`Calibration`: decay of the counts per draft
    step, the prior's weight in tokens and its own decay per step, and a cap."""

    decay: float = 0.9
    weight: float = 1.0
    weight_decay: float = 1.0
    cap: float = math.inf


class Calibration:
    """Accepted draft tokens per predicted one over recent draft steps:
    ``(realized + w) / (predicted + w)`` (prior 1), capped."""

    def __init__(self, model: CalibrationModel):
        self.model = model
        self.predicted = self.realized = 0.0
        self.weight = model.weight

    @property
    def factor(self) -> float:
        w = self.weight
        return min((self.realized + w) / (self.predicted + w), self.model.cap)

    def record(self, predicted: float, accepted: int) -> None:
        """One verified draft: the sum of its nodes' estimates and the nodes accepted."""
        m = self.model
        self.predicted = self.predicted * m.decay + predicted
        self.realized = self.realized * m.decay + accepted
        self.weight *= m.weight_decay


@dataclass(frozen=True)
class AcceptanceModel:
    """How a method's acceptance estimates are learned (see the module doc).

    Attributes:
        priors: prior ratio per source name (a rate for token guesses, 1 for
            sources whose raw scores are probabilities), or a tuple of them
            per depth; ``default_prior`` for other names.
        weight, decay, max_depth: as :class:`DepthAcceptance`.
        gain_prior: prior of the tokens a source earns per step (``gain``).
        reset_on_probe_hit: forget the estimates when a probe's whole
            draft is accepted (the text has changed: a repetitive stretch).
        calibration: the whole-draft :class:`Calibration` (None: none).
    """

    priors: dict[str, float | tuple[float, ...]] = field(default_factory=dict)
    default_prior: float = 0.5
    weight: float = 2.0
    decay: float = 0.8
    max_depth: int = 16
    gain_prior: float = 0.5
    reset_on_probe_hit: bool = True
    calibration: CalibrationModel | None = None


class Acceptance:
    """A generation's acceptance estimates, per source (see the module doc).

    Args:
        model: the method's :class:`AcceptanceModel`.
    """

    def __init__(self, model: AcceptanceModel | None = None):
        self.model = model or AcceptanceModel()
        self.depths: dict[str, DepthAcceptance] = {}
        self.gains: dict[str, list[float]] = {}
        cal = self.model.calibration
        self.calibration = Calibration(cal) if cal is not None else None

    def source(self, name: str) -> DepthAcceptance:
        """The per-depth estimates of source ``name`` (created at its prior)."""
        d = self.depths.get(name)
        if d is None:
            m = self.model
            prior = m.priors.get(name, m.default_prior)
            d = self.depths[name] = DepthAcceptance(prior, m.weight, m.decay, m.max_depth)
        return d

    def q(self, name: str, depth: int) -> float:
        """Conditional acceptance estimate (or calibration ratio) of a node of
        source ``name`` at ``depth``."""
        return self.source(name).q(depth)

    def qs(self, name: str, n: int) -> list[float]:
        """``[q(name, 1), ..., q(name, n)]``."""
        return self.source(name).qs(n)

    def gain(self, name: str) -> float:
        """Tokens accepted per step from source ``name`` over the steps it
        offered candidates in (prior ``gain_prior``, weight as ``weight``)."""
        total, n = self.gains.get(name, (0.0, 0.0))
        w = self.model.weight
        return (total + w * self.model.gain_prior) / (n + w)

    @property
    def factor(self) -> float:
        """The whole-draft calibration factor (1 without a calibration)."""
        return self.calibration.factor if self.calibration is not None else 1.0

    def record(self, tags: Sequence[Tag], accepted: bool) -> None:
        """One tried node, proposed by every source in ``tags``."""
        for name, depth, raw in tags:
            self.source(name).add(depth, accepted, raw)

    def record_gain(self, name: str, tokens: int) -> None:
        """A step in which source ``name`` offered candidates got ``tokens`` of them accepted."""
        total, n = self.gains.get(name, (0.0, 0.0))
        self.gains[name] = [total + tokens, n + 1]

    def reset(self) -> None:
        """Forget every per-depth observation."""
        for d in self.depths.values():
            d.reset()

    def soften(self, weight: float) -> None:
        """Weigh every observation so far ``weight`` (0..1): what one text
        taught counts less once another begins."""
        for d in self.depths.values():
            d.acc *= weight
            d.tried *= weight
