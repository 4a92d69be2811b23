"""The options and checks that the ``mlx-mtp`` commands share: :mod:`mlx_mtp.cli`
(``generate``, ``chat``) and the sub-commands of :mod:`mlx_mtp.commands` import
them from here."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import typer

from .errors import InvalidArgumentError
from .validation import LIMITS, typer_range

MODEL = typer.Option("smollm2-135m", "--model", "-m", help="Alias, folder, .gguf or HF repo id.")
METHOD = typer.Option("ntp", "--method", help="ntp, pld, probe, ... (see `mlx-mtp models`).")
DTYPE = typer.Option(None, "--dtype", help="float32, bfloat16, float16 or auto (as stored).")


def _ranged(name: str, default, *flags: str, help: str):
    """A typer option whose range comes from :data:`mlx_mtp.validation.LIMITS`
    (the API checks the same table), so out-of-range values are usage errors."""
    lim = LIMITS[name]
    return typer.Option(default, lim.cli, *flags, help=help, **typer_range(name))


MAX_TOKENS = _ranged("max_tokens", 256, "-n", help="Maximum new tokens per answer (>= 1).")
TEMP = _ranged("temp", 0.0, help="Sampling temperature (0 = greedy).")
TOP_P = _ranged("top_p", 0.0, help="Nucleus sampling threshold in [0, 1] (0 = off).")
TOP_K = _ranged("top_k", 0, help="Sample from the k most likely tokens (0 = off).")
MIN_P = _ranged("min_p", 0.0, help="Min-p threshold in [0, 1] (0 = off).")
SEED = _ranged(
    "seed", None, help="Seed in [0, 2^64): fixes sampled output whatever the draft trees."
)
BC = typer.Option(
    None,
    "--bc",
    help="probe/hybrid: block complexity (tokens per forward), e.g. 10/30/60, or 'auto' "
    "(each step keeps the draft nodes worth their cost on this device).",
)
MASKS = typer.Option(
    None, "--masks", help="probe/hybrid: mask slots per node (probe 1-3, hybrid 0-3)."
)
TREE = typer.Option(None, "--tree", help="probe: 'dynamic' or nodes per depth, e.g. '14'.")
K = typer.Option(None, "--k", help="clp/confadapt: horizon / block size k.")
TAU = typer.Option(None, "--tau", help="confadapt: confidence threshold tau.")
OPT = typer.Option(None, "--opt", help="Extra method option key=value (repeatable).")
DRAFT_MODEL = typer.Option(
    None,
    "--draft-model",
    help="draft/hybrid: a smaller model of the same tokenizer that drafts for --model "
    "(alias, folder, GGUF file or hub id).",
)
NUM_DRAFT = typer.Option(
    None,
    "--num-draft-tokens",
    help="draft: draft tokens per step, or 'auto' (default: as many as pay on this device).",
)
MAX_KV = _ranged("max_kv_size", None, help="Sliding-window KV cache size in tokens (>= 16).")
KV_BITS = typer.Option(
    None,
    "--kv-bits",
    help="Keep the KV cache quantized to 4 or 8 bits (bounds its memory; not with --max-kv-size).",
)
KV_GROUP = typer.Option(64, "--kv-group-size", help="Quantization group size of --kv-bits.")
THINKING = typer.Option(
    False, "--thinking/--no-thinking", help="Hybrid-thinking chat templates (Qwen3): think first."
)
PIPELINE_PARALLEL = typer.Option(
    False,
    "--pipeline-parallel",
    help="Under mlx.launch (several ranks): shard the model by layers (pipeline parallel) "
    "instead of by heads (tensor parallel, the default).",
)
#: ``--pipeline``: the former name of ``--pipeline-parallel``, hidden
PIPELINE_ALIAS = typer.Option(False, "--pipeline", hidden=True)
RUNNER = typer.Option(
    "auto",
    "--runner",
    help="auto, pipelined or synchronous: run draft steps pipelined (drafts chosen on the "
    "device, each pass launched before the last is read) or synchronous (the planner). "
    "auto: pipelined on a GPU where they can run. The stats line says which ran.",
)


def _options(
    bc, masks, tree, opt, k=None, tau=None, draft_model=None, num_draft_tokens=None
) -> dict:
    """The method options of the flags and ``--opt key=value`` items.

    Raises:
        typer.BadParameter: an ``--opt`` that is not key=value, or a key given twice.
    """
    out = {}
    flags = {"bc": bc, "masks": masks, "tree": tree, "k": k, "tau": tau}
    flags.update(draft_model=draft_model, num_draft_tokens=num_draft_tokens)
    for key, val in flags.items():
        if val is not None:
            out[key] = val
    for item in opt or []:
        key, eq, v = item.partition("=")
        if not eq or not key.strip():
            raise typer.BadParameter(f"expects key=value, got {item!r}", param_hint="'--opt'")
        if key.strip() in out:
            raise typer.BadParameter(
                f"{key.strip()} is given twice (as a flag or an earlier --opt)",
                param_hint="'--opt'",
            )
        out[key.strip()] = v.strip()
    return out


@dataclass(frozen=True)
class OptionGroup:
    """Options that several commands take, handed to a command as one value.

    Attributes:
        name: the keyword-only parameter of the command that receives the group.
        options: parameter name -> (type, ``typer.Option``), in ``--help`` order.
        pack: builds the value from the options given as keyword arguments.
    """

    name: str
    options: dict[str, tuple[Any, Any]]
    pack: Callable[..., Any] = dict


#: what to load: passed on as ``load`` (a dict for :func:`_load`)
LOAD = OptionGroup(
    "load",
    {
        "model": (str, MODEL),
        "method": (str, METHOD),
        "dtype": (str | None, DTYPE),
        "max_kv_size": (int | None, MAX_KV),
        "kv_bits": (int | None, KV_BITS),
        "kv_group_size": (int, KV_GROUP),
    },
)
#: sampling settings: passed on as ``sampling`` (keyword arguments of
#: :func:`~mlx_mtp.validation.check_generation_args` and ``stream_generate``)
SAMPLING = OptionGroup(
    "sampling",
    {
        "max_tokens": (int, MAX_TOKENS),
        "temp": (float, TEMP),
        "top_p": (float, TOP_P),
        "top_k": (int, TOP_K),
        "min_p": (float, MIN_P),
        "seed": (int | None, SEED),
    },
)
#: method options (flags and --opt): passed on as ``options``, see :func:`_options`
METHOD_OPTIONS = OptionGroup(
    "options",
    {
        "bc": (str | None, BC),
        "masks": (int | None, MASKS),
        "tree": (str | None, TREE),
        "k": (int | None, K),
        "tau": (float | None, TAU),
        "draft_model": (str | None, DRAFT_MODEL),
        "num_draft_tokens": (str | None, NUM_DRAFT),
        "opt": (list[str] | None, OPT),
    },
    _options,
)


def _sharding(pipeline_parallel: bool, pipeline: bool) -> bool:
    return pipeline_parallel or pipeline


#: layer sharding over ranks: passed on as ``pipeline_parallel`` (a bool)
SHARDING = OptionGroup(
    "pipeline_parallel",
    {"pipeline_parallel": (bool, PIPELINE_PARALLEL), "pipeline": (bool, PIPELINE_ALIAS)},
    _sharding,
)


def with_options(*groups: OptionGroup) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: a command takes the options of ``groups`` after its own.

    The command declares one keyword-only parameter per group (``*, load,
    sampling``); typer sees the groups' options instead, and the command gets
    each group packed into one value. So ``generate``, ``chat`` and ``serve``
    define the shared flags once (apply it under ``@app.command()``).
    """

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        names = {g.name for g in groups}
        own = [p for p in inspect.signature(func).parameters.values() if p.name not in names]
        shared = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=tp)
            for g in groups
            for name, (tp, opt) in g.options.items()
        ]

        @functools.wraps(func)
        def command(**kwargs: Any) -> Any:
            for g in groups:
                kwargs[g.name] = g.pack(**{name: kwargs.pop(name) for name in g.options})
            return func(**kwargs)

        params = own + shared
        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate


@contextmanager
def interrupted_note(note: str) -> Iterator[None]:
    """Say ``note`` on stderr when Ctrl-C ends the block (the CLI then exits
    130), so that an interrupted load is not a silent exit."""
    try:
        yield
    except KeyboardInterrupt:
        typer.echo(note, err=True)
        raise


def check_choices(method: str, options: dict, dtype: str | None) -> None:
    """Check the method, its options and the dtype before anything is loaded.

    Raises:
        UnknownMethodError, InvalidArgumentError: naming the bad choice.
    """
    from .loading import DTYPES
    from .methods import make_method

    make_method(method, **options)
    if dtype is not None and dtype not in (*DTYPES, "auto"):
        raise InvalidArgumentError(
            f"Unknown dtype {dtype!r}; use one of float32, bfloat16, float16, auto."
        )
