"""What a method receives besides the root token: :class:`Context`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .acceptance import Acceptance
    from .budget import CostCurve, CostCurves
    from .engine import Engine
    from .offers import Budget
    from .plain import PlainSteps


@dataclass
class Context:
    """The engine a method decodes with and what else it may need.

    Attributes:
        engine: the model, its KV cache and the forward passes.
        loaded: the :class:`~mlx_mtp.loading.LoadedModel` the engine's model
            came from (its folder, config and tokenizer: confadapt's mask
            token, the native MTP layer's tensors); None for a bare model.
        curves: the forward cost curves to plan with (a simulated device, a
            test); None: this device's own (:func:`mlx_mtp.costs.device_curves`).
        budget: what the planner of the generation under way tells the
            method's sources: acceptance estimates, the cost curve, a draft
            step's host cost (:class:`~mlx_mtp.offers.Budget`; set by the
            planner, None before its first generation).
        plain: the one-token steps of the generation under way
            (:class:`~mlx_mtp.plain.PlainSteps`: whether root's forward pass is
            queued in the cache; None outside one).
        left: tokens the generation under way may still commit (set by the
            decoding loop before each step; None outside one): a source whose
            drafting costs passes of its own (a draft model) drafts no deeper
            than the tokens that can still be kept.
        learned: what the planner of a method at ``auto`` learned in its last
            generation (:class:`~mlx_mtp.planner.Learned`: acceptance
            estimates, host time; a pipelined method's acceptance estimates),
            by the method's description: the next
            generation on this context starts from it instead of the priors
            (a conversation's turns, a server's requests: the same model and
            method).
    """

    engine: Engine
    loaded: Any = None
    curves: CostCurve | CostCurves | None = None
    budget: Budget | None = None
    plain: PlainSteps | None = None
    learned: dict[str, Any] = field(default_factory=dict)
    left: int | None = None

    @property
    def acceptance(self) -> Acceptance:
        """This generation's acceptance estimates (sources value their
        candidates with them)."""
        return self.budget.acceptance

    @property
    def curve(self) -> CostCurve:
        """The cost curve at the cache's current length (for choices of
        shape, such as lookahead's window)."""
        return self.budget.curve

    def history(self, root: int) -> list[int]:
        """The committed tokens up to ``root``: the cache's and ``root``
        (counted once where a pipelined plain step has queued its forward
        pass, so that the cache holds it already)."""
        cached = self.engine.cached
        return list(cached) if self._queued(root) else [*cached, root]

    def previous(self, root: int) -> int:
        """The committed token before ``root`` (-1: none), as :meth:`history`
        counts the tokens."""
        cached = self.engine.cached
        before = len(cached) - (2 if self._queued(root) else 1)
        return cached[before] if before >= 0 else -1

    def _queued(self, root: int) -> bool:
        # a pipelined plain step has queued root's forward pass in the cache
        return self.plain is not None and self.plain.holds(self.engine, root)

    @property
    def tokenizer(self) -> Any:
        """The loaded model's tokenizer (None for a bare model)."""
        return getattr(self.loaded, "tokenizer", None)

    @property
    def folder(self) -> Any:
        """The loaded model's folder (None for a bare model)."""
        return getattr(self.loaded, "path", None)
