"""The interface between the decoding loop and a multi-token method."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

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

    def step(self, engine: Engine, root: int) -> StepOutput:
        draft = self.propose(engine, root)
        verified = speculative_step(engine, draft, self.sampler)
        self.observe(engine, draft, verified)
        return StepOutput(verified.tokens, draft.drafted, len(verified.path))


class ChainDraftMethod(SpeculativeMethod):
    """A lossless method whose drafts are one chain of tokens (prompt lookup),
    verified in one causal forward pass: implement :meth:`draft`. Chains run
    on hybrid recurrent models too (:mod:`mlx_mtp.recurrent`)."""

    chain_shaped = True

    def draft(self, engine: Engine, root: int) -> list[int]:
        """Draft tokens to follow ``root`` (may be empty)."""
        raise NotImplementedError

    def propose(self, engine: Engine, root: int) -> Draft:
        return Draft.chain(root, self.draft(engine, root))


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
