"""The interface between the decoding loop and a multi-token method."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..budget import Budget, DepthAcceptance, PlainSteps, best_prefix, chain_values, cost_curves
from ..engine import Engine
from ..errors import InvalidArgumentError
from ..speculative import Draft, Verified, speculative_step
from ..verify import Sampler


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


class Method:
    """A multi-token method plugged into the shared decoding loop.

    Subclasses set ``name`` and ``lossless``, validate their options in
    ``__init__``, check the model in :meth:`prepare`, reset per-generation state
    in :meth:`begin` and commit tokens in :meth:`step`. Lossless methods
    subclass :class:`SpeculativeMethod` instead and only propose and observe;
    only lossy decoding (confadapt, clp ``mode=paper``) writes its own ``step``.
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
        """Tokens per forward pass (BC); 1 for plain decoding."""
        return 1

    def describe(self) -> str:
        """Short settings string shown in stats lines."""
        return self.name

    def prepare(self, engine: Engine) -> None:
        """Check once that the model can run this method (raise a clear error)."""

    def begin(self, engine: Engine, prompt: list[int], sampler: Sampler | None) -> None:
        """Start a new generation after the prompt (all but its last token) is cached."""
        self.sampler = sampler

    def step(self, engine: Engine, root: int) -> StepOutput:
        """Commit at least one token after ``root`` (the last committed token,
        not yet in the cache)."""
        raise NotImplementedError


class SpeculativeMethod(Method):
    """A lossless method: it proposes, the shared stage verifies.

    Subclasses implement :meth:`propose` (build this step's draft tree or
    chain from their own state) and, if they learn from the outcome,
    :meth:`observe`. They never run the verification themselves:
    :meth:`step` hands the draft to
    :func:`~mlx_mtp.speculative.speculative_step` (forward pass, target
    tokens, tree walk, keep the accepted path, bonus token; greedy or
    sampling), which makes the output equal plain decoding's whatever the
    draft. ``begin`` resets per-generation state as for every method.
    """

    def propose(self, engine: Engine, root: int) -> Draft:
        """This step's draft after ``root`` (the last committed token, not yet
        in the cache): slot 0 of the draft is ``root``. May read
        ``engine.cached`` and embed tokens; must not run a forward pass or
        change the cache."""
        raise NotImplementedError

    def observe(self, engine: Engine, draft: Draft, verified: Verified) -> None:
        """Update the method's own state (mask vectors, n-gram pools, acceptance
        statistics) from a verified step. ``engine`` is passed for device work
        on the pass's outputs (``engine.lm_head`` on hidden rows, top-k through
        ``engine.timed_eval``); the cache already holds the accepted path."""

    #: the device-aware draft budget of an ``auto`` setting (None: fixed sizes);
    #: set by :meth:`begin_budget`
    budget: Any = None

    def begin_budget(self, engine: Engine, sampler: Sampler | None, on: bool) -> None:
        """Per generation: the :class:`~mlx_mtp.budget.Budget` of an ``auto``
        method (``on``), its pipelined one-token steps, no re-probe due."""
        if on:
            curves = cost_curves(engine)
            self.budget = Budget(curves.at(engine.offset), curves=curves)
        else:
            self.budget = None
        self.plain_steps = PlainSteps(sampler)
        self._reprobe = self._reprobe_step = False

    def observe_plain(self, engine: Engine, tokens: list[int]) -> None:
        """A one-token step of the budget's plain mode committed ``tokens``
        (e.g. move probe's mask vectors); default: nothing."""

    def _plain(self, engine: Engine, root: int, queue_next: bool) -> StepOutput:
        out = self.plain_steps.step(engine, root, queue_next)
        self.observe_plain(engine, out.tokens)
        return out

    def step(self, engine: Engine, root: int) -> StepOutput:
        b = self.budget
        if b is not None:  # plain mode: pipelined one-token steps until the re-probe
            if b.plain:
                self._reprobe = b.tick()
                return self._plain(engine, root, queue_next=not self._reprobe)
            self.plain_steps.unqueue(engine, root)
            b.at(engine.offset)  # the cost of a draft slot grows with the context
        draft = self.propose(engine, root)
        if draft is None:  # the budget found nothing worth drafting: plain mode
            return self._plain(engine, root, queue_next=True)
        self._reprobe_step, self._reprobe = getattr(self, "_reprobe", False), False
        verified = speculative_step(engine, draft, self.sampler)
        self.observe(engine, draft, verified)
        return StepOutput(verified.tokens, draft.drafted, len(verified.path))


class ChainDraftMethod(SpeculativeMethod):
    """A lossless method whose drafts are one chain of tokens (prompt lookup),
    verified in one causal forward pass: implement :meth:`draft`. Chains run
    on hybrid recurrent models too (:mod:`mlx_mtp.recurrent`).

    With ``self.auto`` set (the default of ``pld``), each step's chain is cut
    at the length that maximises expected tokens per unit of forward time
    under the device's cost curve, from per-depth acceptance rates learned
    online; when no length pays, the method runs pipelined one-token steps
    with a periodic re-probe (:mod:`mlx_mtp.budget`).
    """

    chain_shaped = True
    auto: bool = False
    #: drafts a re-probe verifies even when the policy says none pay
    REPROBE_DRAFT: ClassVar[int] = 2

    def draft(self, engine: Engine, root: int) -> list[int]:
        """Draft tokens to follow ``root`` (may be empty)."""
        raise NotImplementedError

    def begin(self, engine: Engine, prompt: list[int], sampler: Sampler | None) -> None:
        super().begin(engine, prompt, sampler)

        self.begin_budget(engine, sampler, self.auto)
        self.acceptance = DepthAcceptance()

    def propose(self, engine: Engine, root: int) -> Draft | None:
        draft = self.draft(engine, root)
        b = self.budget
        if b is not None and draft:
            n, rate = best_prefix(b.curve, chain_values(self.acceptance.qs(len(draft))), 1)
            if self._reprobe or b.cheap(1 + self.REPROBE_DRAFT):  # re-probe, or nearly free
                n = max(n, min(len(draft), self.REPROBE_DRAFT))
            elif not b.pays(rate):
                b.go_plain(1 + self.REPROBE_DRAFT)
                return None
            draft = draft[:n]
        return Draft.chain(root, draft)

    def observe(self, engine: Engine, draft: Draft, verified: Verified) -> None:
        if self.budget is not None and draft.drafted:
            if self._reprobe_step and len(verified.path) == draft.drafted:
                self.acceptance.reset()  # the text changed: old rates no longer apply
            self.acceptance.record(draft.drafted, len(verified.path))


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
