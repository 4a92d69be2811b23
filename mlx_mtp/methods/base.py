"""The interface between the decoding loop and a multi-token method.

Two kinds of method:

- :class:`DraftMethod` (every speculative and adaptive method): it
  *proposes* an :class:`~mlx_mtp.offers.Offer` (best-first draft items and
  how to build the draft of any prefix) and *observes* what was committed.
  The :class:`~mlx_mtp.planner.Planner` decides how much of the offer a step
  sends, when to run plain one-token steps instead and when to probe, and
  keeps the acceptance statistics; lossless drafts are verified by
  :func:`~mlx_mtp.speculative.speculative_step`. Writing ``propose`` and
  ``observe`` is all a new method needs (docs/contributing.md).
- :class:`Method`: one that commits tokens itself each step (``ntp``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from ..acceptance import AcceptanceModel
from ..context import Context
from ..errors import InvalidArgumentError
from ..families import check_tree_support
from ..offers import Offer, PlainResult, StepOutput
from ..plain import PlainSteps
from ..speculative import Draft, Verified
from ..verify import Sampler

if TYPE_CHECKING:
    from ..pipeline import DeviceDrafter


class Method:
    """A multi-token method plugged into the shared decoding loop.

    Subclasses set ``name`` and ``lossless``, validate their options in
    ``__init__``, check the model in :meth:`prepare` and reset per-generation
    state in :meth:`begin`. A plain :class:`Method` commits tokens in
    :meth:`step`; draft methods subclass :class:`DraftMethod` instead.
    """

    name: ClassVar[str] = ""
    lossless: ClassVar[bool] = True
    #: whether the method drops tokens from the KV cache (rejected drafts, mask
    #: slots); such methods cannot run on recurrent or hybrid-cache models
    needs_trimmable_cache: ClassVar[bool] = True
    #: whether every forward pass is one causal chain (root + drafts) of which a
    #: prefix is kept: such methods also run on hybrid recurrent models, whose
    #: recurrent state is rolled back by :mod:`mlx_mtp.recurrent`
    chain_shaped: ClassVar[bool] = False

    def __init__(self, **options: Any):
        if options:
            raise InvalidArgumentError(
                f"--method {self.name} takes no option(s) {', '.join(sorted(options))}."
            )

    @property
    def block_complexity(self) -> int:
        """Tokens per forward pass (BC): the most one step may send; 1 for
        plain decoding."""
        return 1

    def describe(self) -> str:
        """Short settings string shown in stats lines."""
        return self.name

    def prepare(self, ctx: Context) -> None:
        """Check once that the model can run this method (raise a clear error)."""

    def begin(self, ctx: Context, prompt: list[int], sampler: Sampler | None) -> None:
        """Start a new generation after the prompt (all but its last token) is cached."""
        self.sampler = sampler

    def step(self, ctx: Context, root: int) -> StepOutput:
        """Commit at least one token after ``root`` (the last committed token,
        not yet in the cache)."""
        raise NotImplementedError


class DraftMethod(Method):
    """A method that offers drafts; the planner spends the budget on them.

    Subclasses implement :meth:`propose` and, if they learn from the outcome,
    :meth:`observe`. ``auto`` turns the device-aware budget on (the planner
    cuts each offer under the cost curve and runs plain steps while nothing
    pays); with fixed settings the whole offer is sent.
    """

    #: whether the planner cuts the offers under the device's cost curve
    auto: bool = False
    #: how the planner learns this method's acceptance estimates
    ACCEPTANCE: ClassVar[AcceptanceModel] = AcceptanceModel()
    #: the best token ids of a plain step's logits that :meth:`observe` reads
    #: (``PlainResult.top``); 0: none are computed
    plain_topk: int = 0

    def acceptance_model(self) -> AcceptanceModel:
        """The :class:`~mlx_mtp.acceptance.AcceptanceModel` of this method's
        settings (default: the class's ``ACCEPTANCE``)."""
        return self.ACCEPTANCE

    def settings_key(self) -> str:
        """The settings under which the planner keeps what one generation
        learned for the next (:class:`~mlx_mtp.planner.Learned`); default
        :meth:`describe`, which must then not change between generations."""
        return self.describe()

    @property
    def max_width(self) -> int:
        """The most draft nodes one step may send (BC - 1)."""
        return self.block_complexity - 1

    #: whether the planner's synchronous steps can run this method; where
    #: not, it drafts on pipelined steps only (:func:`mlx_mtp.runners.choose_runner`)
    planner_steps: bool = True

    def device_drafter(self, ctx: Context) -> DeviceDrafter | None:
        """The method's drafts chosen on the device, for pipelined steps
        (:mod:`mlx_mtp.pipeline`: the next pass launched before the host reads
        the one in flight); None (default): every step goes through the
        planner."""
        return None

    def pipeline_acceptance(self) -> AcceptanceModel:
        """The :class:`~mlx_mtp.acceptance.AcceptanceModel` of the pipelined
        steps' estimates (default: :meth:`acceptance_model`)."""
        return self.acceptance_model()

    def propose(self, ctx: Context, root: int) -> Offer:
        """This step's offer after ``root`` (the last committed token, not yet
        in the cache). May read ``ctx.engine.cached`` and embed tokens; must
        not run a forward pass or change the cache (``build`` / ``run`` of
        the offer do, once the planner has cut it)."""
        raise NotImplementedError

    def observe(self, ctx: Context, draft: Draft | None, result: Verified | PlainResult) -> None:
        """Update the method's own state (mask vectors, pools) from a step:
        a verified draft (``draft`` and its :class:`~mlx_mtp.speculative.Verified`),
        or a one-token step of plain mode (``draft`` None, a
        :class:`~mlx_mtp.offers.PlainResult`). ``ctx.engine`` is there for
        device work on the pass's outputs (``lm_head`` on hidden rows, top-k
        through ``timed_eval``); the cache already holds the accepted path."""


class SourceMethod(DraftMethod):
    """A draft method built around one draft source, ``self.source`` (an
    object with ``prepare(ctx)`` and ``begin(prompt)``, such as
    :class:`~mlx_mtp.sources.draft.DraftModel`): :meth:`prepare` checks
    that the model can run a draft tree (unless the method is
    ``chain_shaped``) and prepares the source; :meth:`begin` begins it.

    Raises:
        UnsupportedModelError: (prepare) a tree-shaped method on a model that
            cannot run a draft tree.
    """

    source: Any

    def prepare(self, ctx: Context) -> None:
        if not self.chain_shaped:
            check_tree_support(ctx.engine.model, self.name)
        self.source.prepare(ctx)

    def begin(self, ctx: Context, prompt: list[int], sampler: Sampler | None) -> None:
        super().begin(ctx, prompt, sampler)
        self.source.begin(prompt)


def parse_int(name: str, value: Any, lo: int, hi: int | None = None) -> int:
    """Parse a positive integer option or raise InvalidArgumentError."""
    bad = InvalidArgumentError(f"option {name} must be an integer, got {value!r}")
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise bad  # no silent truncation of 2.7 or True
    try:
        v = int(value)
    except (TypeError, ValueError, OverflowError):
        raise bad from None
    if v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise InvalidArgumentError(f"option {name} must be {rng}, got {v}")
    return v


def parse_bc(bc: Any, max_bc: Any, lo: int) -> tuple[bool, int]:
    """Parse a block-complexity option: an integer >= ``lo``, or ``"auto"``.

    Returns:
        ``(auto, slots)``: ``slots`` is the BC, or for ``"auto"`` the cap
        ``max_bc``.

    Raises:
        InvalidArgumentError: neither an integer nor ``"auto"``, or below ``lo``.
    """
    if str(bc) == "auto":
        return True, parse_int("max_bc", max_bc, lo)
    if not str(bc).strip().lstrip("-").isdigit():
        raise InvalidArgumentError(f"option bc must be an integer or 'auto', got {bc!r}")
    return False, parse_int("bc", bc, lo)


__all__ = ["DraftMethod", "Method", "Offer", "PlainSteps", "StepOutput", "parse_bc", "parse_int"]
