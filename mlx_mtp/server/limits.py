"""What a request may ask of the server, and the time bound on one forward pass.

A request chooses a method and its options, ``max_tokens`` and sampling
settings. Without bounds one request can hold the only worker for as long as
it likes (a forward pass of 7,000 slots fits in memory and takes many
minutes) or make the server read any file or download any hub repo. So:

- **Slots per forward pass**: a method's block complexity (the most slots one
  of its forward passes sends; with ``auto`` its cap) must be at most
  :attr:`Limits.slots`: the smaller of ``--max-bc`` and the largest pass this
  device runs within ``--max-forward-s``, measured when the server starts
  (:func:`measure_forward_bounds`). Prefill chunks are sized to the same time
  bound, so the worker reaches a point where it can stop (a cancelled request,
  shutdown) at least every ``--max-forward-s`` seconds.
- **New tokens**: ``max_tokens`` at most ``--max-tokens-limit``.
- **Files and repos**: options naming a file, folder, hub repo or model
  (:data:`ARTIFACT_OPTIONS`) are refused unless the server was started with
  ``--allow-artifacts DIR``; then they must name a path inside one of those
  folders (symbolic links resolved), never a repo. The answer to a refused
  path is the same whether it exists or not.
- **Method settings**: ``--max-methods`` distinct (method, options) pairs are
  kept at once, each with its KV cache (the least recently used one is
  dropped, never the default).

Every refusal is a 400 whose message names the bound and the flag that sets it.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import distributed
from ..costs import CURVE_SIZES, LiveCurves, device_curves, measure_cost_curve
from ..engine import PREFILL_STEP, Engine
from ..errors import InvalidArgumentError
from .protocol import OpenAIError

#: method options that name a file, a folder or a hub repo (``draft_model``:
#: also an alias, which may name a hub repo)
ARTIFACT_OPTIONS = frozenset({"heads", "adapter", "draft_model", "clp_heads"})
#: method options that take a number, a boolean or one of a few words
VALUE_OPTIONS = frozenset(
    {
        "bc", "masks", "tree", "lam", "mask_init", "max_bc", "shape", "window", "max_draft",
        "mode", "k", "predictor", "tau", "max_k", "level", "guess", "seed", "matches",
        "pool", "mtp", "mtp_depth", "depth", "hidden_state", "max_depth", "draft_cost",
        "draft_width", "num_draft_tokens", "width", "recycle", "reset", "clp",
    }
)  # fmt: skip

#: default of ``--max-bc``: the cap every ``auto`` tree method uses by default
DEFAULT_MAX_BC = 64
#: default of ``--max-tokens-limit`` (raised to ``--max-tokens`` if that is larger)
DEFAULT_MAX_TOKENS_LIMIT = 4096
#: default of ``--max-forward-s``
DEFAULT_MAX_FORWARD_S = 5.0
#: the smallest prefill chunk the time bound may choose
MIN_PREFILL_STEP = 16


@dataclass(frozen=True)
class ForwardBounds:
    """The largest forward passes that run within ``seconds`` on this device,
    as measured by :func:`measure_forward_bounds`.

    Attributes:
        seconds: the time bound.
        slots: the most slots one decoding pass may send.
        slot_seconds: the measured (or interpolated) time of a pass of ``slots``.
        prefill_step: prompt tokens per prefill pass.
        prefill_seconds: the measured time of a prefill pass of that many tokens
            (0 when not measured: a cache that cannot take and drop them).
        measured: slots -> seconds of every decoding pass timed.
    """

    seconds: float
    slots: int
    slot_seconds: float
    prefill_step: int
    prefill_seconds: float
    measured: dict[int, float] = field(default_factory=dict)


def _largest_within(times: dict[int, float], seconds: float) -> tuple[int, float]:
    """The largest slot count whose time, linear between the measured sizes,
    is at most ``seconds``: (slots, its time)."""
    sizes = sorted(times)
    best = (sizes[0], times[sizes[0]])
    for a, b in zip(sizes, sizes[1:]):
        ta, tb = times[a], times[b]
        if tb <= seconds:
            best = (b, tb)
            continue
        if ta <= seconds < tb:  # the crossing lies between a and b
            n = a + int((seconds - ta) / (tb - ta) * (b - a))
            best = (n, ta + (tb - ta) * (n - a) / (b - a))
        break
    return best


def measure_forward_bounds(
    engine: Engine,
    seconds: float,
    most_slots: int,
    most_prefill: int = PREFILL_STEP,
    curves: LiveCurves | None = None,
) -> ForwardBounds:
    """Find the largest forward passes that take at most ``seconds`` on this
    device, from its cost curve and its own timings.

    Decoding passes up to 64 slots: this device's cost curve (``curves``, as
    :func:`~mlx_mtp.costs.device_curves` keeps it: cached, measured once,
    refined by every generation) times its one-slot time; where that time is
    not known (a curve pinned by ``$MLX_MTP_COST_CURVE``, or no ``curves``),
    the cost curve's own timing (a chain of ``n`` slots with logits for every
    slot, :func:`~mlx_mtp.costs.measure_cost_curve`) at its sizes. Beyond 64
    slots: timed at doubling sizes up to ``most_slots`` (and the memory
    bound), stopping at the first size over ``seconds``: nothing is
    extrapolated, and the slowest pass timed takes about the growth of one
    doubling over the bound. Prefill passes: chunks of 256 tokens doubling up
    to ``most_prefill`` (halving below 256 if that is already too slow; a
    size that would take more than ``seconds`` at the last one's time per
    token is not timed).
    Everything runs on the engine's cache, which is left as it was.

    On a model sharded over several ranks every decision follows rank 0's
    timings, so that all ranks run the same passes.

    Raises:
        InvalidArgumentError: a one-slot pass already takes longer than
            ``seconds`` (raise ``--max-forward-s``).
    """
    cap = max(1, min(int(most_slots), engine.max_slots(engine.offset)))
    times: dict[int, float] = {}
    if engine.backbone is not None and cap > 1:
        first = [s for s in CURVE_SIZES if s <= cap]
        if curves is not None and curves.t1:  # (every rank holds rank 0's curves)
            curve, t1 = curves.at(engine.offset), float(curves.t1)
        else:
            curve = measure_cost_curve(engine, sizes=first, repeats=1)
            t1 = distributed.agree(curve.seconds or 0.0)
        times = {s: t1 * curve(s) for s in curve.sizes if s <= cap}
        n = max(times)
        while n < cap and distributed.agree_flag(times[n] <= seconds):
            n = min(2 * n, cap)
            c = measure_cost_curve(engine, sizes=(1, n), repeats=1)
            if n not in c.sizes:  # the cache cannot drop n more tokens
                break
            times[n] = distributed.agree((c.seconds or 0.0) * c(n))
    else:
        times = {1: distributed.agree(_time_one_token(engine))}
    if times[1] > seconds:
        raise InvalidArgumentError(
            f"One forward pass of one token takes {times[1]:.2f} s on this device, over "
            f"--max-forward-s {seconds:g}; raise --max-forward-s."
        )
    slots, slot_s = _largest_within(times, seconds)
    step, step_s = _prefill_bound(engine, seconds, most_prefill)
    return ForwardBounds(seconds, slots, slot_s, step, step_s, times)


def _time_one_token(engine: Engine) -> float:
    """Seconds of a one-token forward pass (a model without the llama layout:
    plain decoding only), the median of three after a warm-up."""
    tok = engine.cached[-1] if engine.cached else 0
    out = []
    with engine.scratch():
        start = engine.offset
        for _ in range(4):
            t0 = time.perf_counter()
            engine.forward_chain([tok])
            out.append(time.perf_counter() - t0)
            engine.trim_to(start)
    return sorted(out[1:])[1]


def _prefill_bound(engine: Engine, seconds: float, most: int) -> tuple[int, float]:
    """The largest prefill chunk (a power of two times 16, at most ``most``)
    that runs within ``seconds``, and its time; ``(most, 0.0)`` where the
    cache cannot take the chunks and drop them again (a sliding window, a
    recurrent model)."""
    most = max(int(most), MIN_PREFILL_STEP)
    if engine.rollback is not None or not engine.trimmable(most):
        return most, 0.0
    tok = engine.cached[-1] if engine.cached else 0

    def timed(n: int) -> float:
        with engine.scratch():
            t0 = time.perf_counter()
            engine.sync([*engine.cached, *([tok] * n)], chunk=n)
            return distributed.agree(time.perf_counter() - t0)

    timed(min(MIN_PREFILL_STEP, most))  # warm-up
    n = min(256, most)
    t = timed(n)
    if t > seconds:  # halve until one fits
        while n > MIN_PREFILL_STEP:
            n //= 2
            t = timed(n)
            if distributed.agree_flag(t <= seconds):
                break
        return n, t
    while n < most:
        nxt = min(2 * n, most)
        if not distributed.agree_flag(t * nxt / n <= seconds):
            break  # a prefill pass takes at least its share of tokens: not worth timing
        tn = timed(nxt)
        if not distributed.agree_flag(tn <= seconds):
            break
        n, t = nxt, tn
    return n, t


@dataclass
class Limits:
    """The bounds on what a request may ask (see the module doc).

    Args:
        max_bc: ``--max-bc``: the most slots per forward pass a method may send;
            None: :data:`DEFAULT_MAX_BC`, or the server's own method's block
            complexity if larger (:meth:`resolve`).
        max_tokens: ``--max-tokens-limit``: the most new tokens a request may
            ask; None: :data:`DEFAULT_MAX_TOKENS_LIMIT`, or the server's
            ``--max-tokens`` if larger.
        max_forward_s: ``--max-forward-s``: seconds one forward pass may take.
        allow_artifacts: ``--allow-artifacts``: folders whose files requests
            may name (heads, adapters); empty: none.

    Attributes:
        forward: the measured :class:`ForwardBounds` (None until
            :meth:`measure`).
    """

    max_bc: int | None = None
    max_tokens: int | None = None
    max_forward_s: float = DEFAULT_MAX_FORWARD_S
    allow_artifacts: tuple[Path, ...] = ()
    forward: ForwardBounds | None = None

    def __post_init__(self) -> None:
        for name, flag in (("max_bc", "--max-bc"), ("max_tokens", "--max-tokens-limit")):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise InvalidArgumentError(f"{flag} must be >= 1, got {v!r}.")
        s = self.max_forward_s
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s < math.inf:
            raise InvalidArgumentError(f"--max-forward-s must be a number > 0, got {s!r}.")
        folders = []
        for d in self.allow_artifacts:
            p = Path(d).expanduser()
            if not p.is_dir():
                raise InvalidArgumentError(
                    f"--allow-artifacts {d}: not a folder. Give a folder whose heads and "
                    "adapters requests may name."
                )
            folders.append(Path(os.path.realpath(p)))
        self.allow_artifacts = tuple(folders)

    def resolve(self, default_bc: int, default_max_tokens: int) -> None:
        """Fill in the bounds left None from the server's own settings: its
        method's block complexity and its ``--max-tokens``."""
        if self.max_bc is None:
            self.max_bc = max(DEFAULT_MAX_BC, int(default_bc))
        if self.max_tokens is None:
            self.max_tokens = max(DEFAULT_MAX_TOKENS_LIMIT, int(default_max_tokens))

    @property
    def slots(self) -> int:
        """The most slots one forward pass of a request's method may send."""
        top = self.max_bc if self.max_bc is not None else DEFAULT_MAX_BC
        return top if self.forward is None else min(top, self.forward.slots)

    @property
    def prefill_step(self) -> int:
        """Prompt tokens per prefill pass (within the time bound)."""
        return self.forward.prefill_step if self.forward is not None else PREFILL_STEP

    def measure(self, engine: Engine) -> ForwardBounds:
        """Measure this device's :class:`ForwardBounds` on ``engine`` (see
        :func:`measure_forward_bounds`); needed once, at start-up."""
        curves = device_curves(engine)  # also what every auto method plans with
        self.forward = measure_forward_bounds(
            engine, float(self.max_forward_s), self.slots, curves=curves
        )
        return self.forward

    def describe(self) -> dict[str, Any]:
        """The bounds, for ``/health`` and the start-up line."""
        out: dict[str, Any] = {
            "max_slots_per_forward": self.slots,
            "max_bc": self.max_bc,
            "max_tokens": self.max_tokens,
            "max_forward_s": self.max_forward_s,
            "artifact_folders": len(self.allow_artifacts),
        }
        if self.forward is not None:
            out["prefill_step"] = self.forward.prefill_step
            out["forward_s_at_max_slots"] = round(self.forward.slot_seconds, 4)
        return out

    # -------------------------------------------------------------- checks
    def slot_problem(self, block_complexity: int) -> str | None:
        """Why a method of this block complexity is over the bound, or None."""
        if block_complexity <= self.slots:
            return None
        if self.forward is not None and self.forward.slots < (self.max_bc or DEFAULT_MAX_BC):
            return (
                f"the largest forward pass this server runs is {self.slots} slots (a pass over "
                f"that takes longer than --max-forward-s {self.max_forward_s:g} s on this "
                "device)"
            )
        return f"the largest forward pass this server runs is {self.slots} slots (--max-bc)"

    def check_default(self, method: Any) -> None:
        """The server's own method must keep to the limits it sets for requests.

        Raises:
            InvalidArgumentError: naming the flags to change.
        """
        why = self.slot_problem(method.block_complexity)
        if why is not None:
            raise InvalidArgumentError(
                f"--method {method.describe()} sends up to {method.block_complexity} slots per "
                f"forward pass, but {why}. Lower --bc (or --opt max_bc=...), or raise "
                "--max-bc / --max-forward-s."
            )

    def check_method(self, method: Any) -> None:
        """Refuse a request's method whose forward passes may exceed :attr:`slots`.

        Raises:
            OpenAIError: 400 ``bc_limit``.
        """
        why = self.slot_problem(method.block_complexity)
        if why is not None:
            raise OpenAIError(
                400,
                f"{method.describe()} sends up to {method.block_complexity} slots per forward "
                f"pass, but {why}. Ask for a smaller block complexity (e.g. mtp.bc or "
                "mtp.max_bc).",
                param="mtp",
                code="bc_limit",
            )

    def check_tokens(self, max_tokens: int | None) -> None:
        """Refuse a ``max_tokens`` over :attr:`max_tokens`.

        Raises:
            OpenAIError: 400 ``max_tokens_limit``.
        """
        top = self.max_tokens if self.max_tokens is not None else DEFAULT_MAX_TOKENS_LIMIT
        if isinstance(max_tokens, int) and max_tokens > top:
            raise OpenAIError(
                400,
                f"max_tokens {max_tokens} is over this server's bound of {top} new "
                "tokens per request (--max-tokens-limit).",
                param="max_tokens",
                code="max_tokens_limit",
            )

    def request_options(self, method: str, options: dict[str, Any]) -> dict[str, Any]:
        """A request's method options, with artifact paths checked against
        ``--allow-artifacts`` and replaced by their resolved absolute paths.

        Raises:
            OpenAIError: 400 ``artifact_not_allowed`` for an artifact option
                without ``--allow-artifacts``, a value that is not a path
                inside those folders (a repo id, a path outside, a missing
                path: one message for all), or a non-string value.
        """
        out = dict(options)
        for name in sorted(set(options) & ARTIFACT_OPTIONS):
            out[name] = self._artifact(method, name, options[name])
        return out

    def _artifact(self, method: str, name: str, value: Any) -> str:
        param = f"mtp.{name}"
        if not self.allow_artifacts:
            raise OpenAIError(
                400,
                f"mtp.{name} names a file, folder or hub repo, which requests may not choose "
                f"on this server: it uses {method}'s default {name}. An operator can allow "
                "folders with `mlx-mtp serve --allow-artifacts DIR`.",
                param=param,
                code="artifact_not_allowed",
            )
        refused = OpenAIError(
            400,
            f"mtp.{name} must be an existing path inside a folder this server allows "
            f"(--allow-artifacts; {len(self.allow_artifacts)} folder(s)); hub repos are never "
            "taken from requests.",
            param=param,
            code="artifact_not_allowed",
        )
        if not isinstance(value, str) or not value.strip() or "\x00" in value:
            raise refused
        for root in self.allow_artifacts:
            path = Path(value) if os.path.isabs(value) else root / value
            real = Path(os.path.realpath(path))
            if (real == root or root in real.parents) and real.exists():
                return str(real)
        raise refused
