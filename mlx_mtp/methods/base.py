"""The interface between the decoding loop and a multi-token method."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ..engine import Engine
from ..errors import InvalidArgumentError
from ..verify import Sampler, verify


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
    in :meth:`begin` and commit tokens in :meth:`step`.
    """

    name: ClassVar[str] = ""
    lossless: ClassVar[bool] = True
    #: whether the method drops tokens from the KV cache (rejected drafts, mask
    #: slots); such methods cannot run on recurrent or hybrid-cache models
    needs_trimmable_cache: ClassVar[bool] = True

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


class ChainDraftMethod(Method):
    """A lossless method whose drafts are one chain, verified in one causal
    forward pass (prompt lookup, lookahead candidates, CLP verified mode).

    With ``self.auto`` set (the default of ``pld``), :meth:`begin_budget`
    gives it a :class:`~mlx_mtp.budget.Budget`: each step's chain is cut at
    the length that maximises expected tokens per unit of forward time under
    the device's cost curve, from per-depth acceptance rates learned online;
    when no length pays, the method runs pipelined one-token steps with a
    periodic re-probe (:mod:`mlx_mtp.budget`).
    """

    auto: bool = False
    #: drafts a re-probe verifies even when the policy says none pay
    REPROBE_DRAFT: ClassVar[int] = 2

    def draft(self, engine: Engine, root: int) -> list[int]:
        raise NotImplementedError

    def begin(self, engine: Engine, prompt: list[int], sampler: Sampler | None) -> None:
        super().begin(engine, prompt, sampler)
        self.begin_budget(engine, sampler)

    def begin_budget(self, engine: Engine, sampler: Sampler | None) -> None:
        """Set up the draft budget of an ``auto`` method (no-op otherwise)."""
        from ..budget import Budget, DepthAcceptance, PlainSteps, cost_curve

        self.budget = Budget(cost_curve(engine)) if self.auto else None
        self.acceptance = DepthAcceptance()
        self.plain_steps = PlainSteps(sampler)
        self._reprobe = False

    def step(self, engine: Engine, root: int) -> StepOutput:
        b = getattr(self, "budget", None)
        if b is not None and b.plain:
            self._reprobe = b.tick()
            return self.plain_steps.step(engine, root, queue_next=not self._reprobe)
        if b is not None:
            self.plain_steps.unqueue(engine, root)
        draft = self.draft(engine, root)
        if b is not None and draft:
            from ..budget import best_prefix, chain_values

            n, rate = best_prefix(b.curve, chain_values(self.acceptance.qs(len(draft))), 1)
            if self._reprobe or b.cheap(1 + self.REPROBE_DRAFT):  # re-probe, or nearly free
                n = max(n, min(len(draft), self.REPROBE_DRAFT))
            elif not b.pays(rate):
                b.go_plain(1 + self.REPROBE_DRAFT)
                return self.plain_steps.step(engine, root, queue_next=True)
            draft = draft[:n]
        self._reprobe_step, self._reprobe = self._reprobe, False
        start = engine.offset
        if draft:
            engine._require_trimmable(len(draft) + 1)
        logits, _ = engine.forward_chain([root, *draft])
        n = len(draft) + 1
        parents = np.arange(-1, n - 1)
        slot_tokens = np.array([root, *draft])
        path, bonus = verify(logits, parents, slot_tokens, self.sampler, engine)
        engine.keep(start, [0, *path])
        if b is not None and draft:
            if self._reprobe_step and len(path) == len(draft):
                self.acceptance.reset()  # the text changed: old rates no longer apply
            self.acceptance.record(len(draft), len(path))
        return StepOutput([*(int(slot_tokens[s]) for s in path), bonus], len(draft), len(path))


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
