"""Which runner decodes a generation, chosen in one place: :func:`choose_runner`.

A generation's steps run in one of these runners (the name is
:attr:`GenerationStats.runner <mlx_mtp.decoding.GenerationStats.runner>`,
in the stats line, the bench's results and the server's ``mtp`` usage):

- ``plain``: a method that never drafts (``ntp``) decodes one token per step,
  mlx-lm's loop (:class:`~mlx_mtp.plain.PlainSteps`), whatever runner was
  asked for (the choice is about draft steps).
- ``pipelined``: a :class:`~mlx_mtp.pipeline.Pipeline`, which drafts on the
  device and launches each pass before the host reads the one before.
- ``synchronous``: the :class:`~mlx_mtp.planner.Planner`, which reads each
  pass before it plans the next.
- ``batched``: rows of continuous batching (:mod:`mlx_mtp.batching`, the
  server and :func:`~mlx_mtp.api.batch_generate`); not chosen here.

The caller asks for ``auto``, ``pipelined`` or ``synchronous``
(``--runner``, ``runner=`` of :func:`~mlx_mtp.api.load` and
:meth:`LoadedModel.bind <mlx_mtp.loading.LoadedModel.bind>`). ``auto`` runs
pipelined steps where they can run and the device's passes overlap the host
(:attr:`DeviceClock.overlaps <mlx_mtp.timing.DeviceClock.overlaps>`: a GPU),
else the planner's. ``pipelined`` where pipelined steps cannot run is an
:class:`~mlx_mtp.errors.InvalidArgumentError` that says why. A method whose
drafts exist only on pipelined steps (``confadapt`` in verified mode:
:attr:`DraftMethod.planner_steps <mlx_mtp.methods.base.DraftMethod.planner_steps>`)
runs them under ``auto`` on every device, each pass read before the next
where the device does not overlap the host, and ``synchronous`` is an error.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import distributed
from .errors import InvalidArgumentError
from .methods.base import DraftMethod, Method
from .pipeline import Pipeline, pipeline_for
from .planner import Planner

if TYPE_CHECKING:
    from .context import Context
    from .costs import LiveCurves
    from .verify import Sampler

#: what a caller may ask for
RUNNERS = ("auto", "pipelined", "synchronous")
#: the deprecated environment variable read when ``auto`` is asked for:
#: ``1`` pipelined, ``0`` synchronous, ``sync`` pipelined steps launched
#: one after the other (no overlap)
ENV = "MLX_MTP_PIPELINE"


def check_runner(runner: Any) -> str:
    """``runner`` if it is one of :data:`RUNNERS`.

    Raises:
        InvalidArgumentError: anything else.
    """
    if not isinstance(runner, str) or runner not in RUNNERS:
        raise InvalidArgumentError(f"runner must be one of {', '.join(RUNNERS)}; got {runner!r}.")
    return runner


@dataclass(frozen=True)
class RunnerChoice:
    """The runner of one generation and why it was chosen.

    Attributes:
        name: ``plain``, ``pipelined`` or ``synchronous``.
        reason: one line: why this runner.
        runner: the :class:`~mlx_mtp.pipeline.Pipeline` or
            :class:`~mlx_mtp.planner.Planner` whose ``step`` the decoding
            loop calls; None for ``plain`` (the method's own ``step``).
    """

    name: str
    reason: str
    runner: Pipeline | Planner | None = None


def _requested(runner: str) -> tuple[str, bool | None, str]:
    """The runner asked for, after the deprecated :data:`ENV` where ``auto``
    was asked: (runner, overlap forced or None, where it came from)."""
    forced = os.environ.get(ENV)
    if runner != "auto" or forced not in ("0", "1", "sync"):
        return runner, None, "asked for"
    warnings.warn(
        f"{ENV} is deprecated: use --runner pipelined|synchronous (runner= in the API).",
        DeprecationWarning,
        stacklevel=4,
    )
    if forced == "0":
        return "synchronous", None, f"{ENV}=0"
    return "pipelined", forced == "1", f"{ENV}={forced}"


def _why_not_pipelined(
    ctx: Context, method: DraftMethod, sampler: Sampler | None, logprobs: bool
) -> tuple[str | None, Any]:
    """Why pipelined steps cannot run this generation (None where they can),
    and the method's device drafter where they can."""
    if sampler is not None:
        return "pipelined steps decode greedily only, and temperature > 0 samples", None
    if logprobs:
        return "pipelined steps read back tokens, not the logits logprobs need", None
    if distributed.size() > 1:
        return "the model is sharded over several ranks", None
    if not ctx.engine.lazy_ready():
        return (
            "the model's cache is not plain (sliding window, quantized or recurrent "
            "layers) or its family has no verified tree pass",
            None,
        )
    drafter = method.device_drafter(ctx)
    if drafter is None:
        return f"{method.describe()} has no device drafter with these options", None
    return None, drafter


def choose_runner(
    ctx: Context,
    method: Method,
    sampler: Sampler | None,
    curves: LiveCurves | None,
    *,
    logprobs: bool = False,
    runner: str = "auto",
) -> RunnerChoice:
    """The runner of a generation of ``method`` on ``ctx`` (see the module
    doc), built, with the reason it was chosen.

    Args:
        ctx: the method's context, its prompt prefilled.
        method: the method.
        sampler: None for greedy decoding.
        curves: the cost curves the runner plans with.
        logprobs: the generation reports log-probabilities.
        runner: ``auto``, ``pipelined`` or ``synchronous``.

    Raises:
        InvalidArgumentError: an unknown ``runner``, or ``pipelined`` where
            pipelined steps cannot run (the message says why).
    """
    asked, overlap, source = _requested(check_runner(runner))
    if not isinstance(method, DraftMethod):  # no draft steps to run either way
        return RunnerChoice("plain", f"{method.describe()} decodes one token per step")
    why_not, drafter = _why_not_pipelined(ctx, method, sampler, logprobs)
    if not method.planner_steps:  # its drafts exist on pipelined steps only
        if asked == "synchronous":
            raise InvalidArgumentError(
                f"{method.describe()} drafts on pipelined steps only, and runner "
                "'synchronous' was asked for. Use the runner 'auto' or 'pipelined'."
            )
        if why_not is not None:
            raise InvalidArgumentError(
                f"{method.describe()} drafts on pipelined steps only, and they cannot "
                f"run: {why_not}. Use another mode or method for this."
            )
        if overlap is None:
            overlap = asked == "pipelined" or ctx.engine.clock.overlaps
        reason = "the method drafts on pipelined steps only" + (
            "" if overlap else " (each pass read before the next: this device does not overlap)"
        )
        return RunnerChoice(
            "pipelined", reason, pipeline_for(ctx, method, drafter, curves, overlap)
        )
    if asked == "pipelined":
        if why_not is not None:
            if source != "asked for":  # the deprecated variable falls back, as it did
                return RunnerChoice("synchronous", why_not, Planner(ctx, method, sampler, curves))
            raise InvalidArgumentError(f"runner 'pipelined' cannot run: {why_not}.")
        overlap = True if overlap is None else overlap
        reason = f"{source}" + ("" if overlap else " (each pass read before the next)")
        return RunnerChoice(
            "pipelined", reason, pipeline_for(ctx, method, drafter, curves, overlap)
        )
    if asked == "synchronous":
        return RunnerChoice("synchronous", source, Planner(ctx, method, sampler, curves))
    if why_not is not None:
        return RunnerChoice("synchronous", why_not, Planner(ctx, method, sampler, curves))
    if not ctx.engine.clock.overlaps:
        reason = (
            "auto: on this device a pass's cost grows steeply with its slots, so the "
            "planner's steps (each sized from drafts already read) are faster"
        )
        return RunnerChoice("synchronous", reason, Planner(ctx, method, sampler, curves))
    reason = "auto: this device runs a pass while the host builds the next"
    return RunnerChoice("pipelined", reason, pipeline_for(ctx, method, drafter, curves, True))
