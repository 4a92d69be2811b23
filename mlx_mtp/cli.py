"""``mlx-mtp`` command line: ``generate``, ``chat``, ``models`` here; the
sub-commands of :mod:`mlx_mtp.commands` (bench, serve, train, convert) are
added automatically."""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import pkgutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import typer

from . import commands, distributed, load
from .errors import InvalidArgumentError, MTPError
from .loading import ALIASES, cache_home, cached_models
from .methods import DESCRIPTIONS, available_methods
from .validation import LIMITS, check_generation_args, typer_range

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    help="Several tokens per forward pass for MLX language models.",
)

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
PIPELINE = typer.Option(
    False,
    "--pipeline",
    help="Under mlx.launch (several ranks): shard the model by layers (pipeline parallel) "
    "instead of by heads (tensor parallel, the default).",
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


def _load(
    model,
    method,
    dtype,
    max_kv_size,
    options,
    pipeline=False,
    thinking=False,
    kv_bits=None,
    kv_group_size=64,
):
    check_choices(method, options, dtype)
    where = f" over {distributed.size()} ranks" if distributed.size() > 1 else ""
    typer.echo(f"loading {model} ({method}){where} ...", err=True)
    with interrupted_note(f"interrupted while loading {model}: nothing was generated."):
        m = load(
            model,
            method,
            dtype=dtype,
            max_kv_size=max_kv_size,
            pipeline=pipeline,
            thinking=thinking,
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
            **options,
        )
    if where:
        typer.echo(f"sharded: {distributed.sharding(m.model)} parallel{where}", err=True)
    return m


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


@app.command()
@with_options(LOAD, SAMPLING, METHOD_OPTIONS)
def generate(
    prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt text ('-' reads stdin)."),
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
    thinking: bool = THINKING,
    pipeline: bool = PIPELINE,
    *,
    load: dict,
    sampling: dict,
    options: dict,
):
    """Generate one answer and print statistics."""
    if prompt == "-":
        # read on rank 0 only (a launcher gives stdin to rank 0), shared with all
        prompt = distributed.agree(sys.stdin.read() if distributed.is_main() else None)
    if not prompt.strip():
        raise typer.BadParameter("the prompt is empty", param_hint="'--prompt'")
    last = None
    check_generation_args(**sampling)  # before the slow load
    m = _load(**load, options=options, pipeline=pipeline, thinking=thinking)
    try:
        for chunk in m.stream_generate(prompt, **sampling, chat_template=not raw):
            typer.echo(chunk.text, nl=False)
            last = chunk
    except KeyboardInterrupt:
        n = last.stats.generated_tokens if last is not None else 0
        typer.echo("")
        if last is not None:
            typer.echo(last.stats.summary(), err=True)
        typer.echo(f"interrupted after {n} new tokens: the answer above is cut short.", err=True)
        raise
    typer.echo("")
    _end_note(last)


def _end_note(last: Any) -> None:
    """After an answer: a line saying it was cut at ``-n`` (its finish reason
    ``"length"``), then the stats line, both on stderr."""
    if last is None:
        return
    if last.finish_reason == "length":
        typer.echo(cut_note(last.stats.generated_tokens), err=True)
    typer.echo(last.stats.summary(), err=True)


def cut_note(n: int) -> str:
    """The line that says an answer stopped at its new-token limit ``n``, not
    at its end."""
    return f"[cut at {n} tokens: raise -n for a longer answer]"


#: chat's own commands and what they do (``/help`` lists them)
CHAT_COMMANDS = {
    "/help": "show these commands",
    "/reset": "start a new conversation (forget the history)",
    "/quit": "leave (also /exit or Ctrl-D)",
}


@app.command()
@with_options(LOAD, SAMPLING, METHOD_OPTIONS)
def chat(
    thinking: bool = THINKING,
    pipeline: bool = PIPELINE,
    *,
    load: dict,
    sampling: dict,
    options: dict,
):
    """Interactive multi-turn chat (KV cache reused across turns). /help lists the commands."""
    check_generation_args(**sampling)  # before the slow load
    m = _load(**load, options=options, pipeline=pipeline, thinking=thinking)
    session = m.chat()
    _line_editing()
    typer.echo("Type a message (/help for commands, /quit or Ctrl-D to exit).", err=True)
    while True:
        # rank 0 reads the line; every rank of a sharded model gets it (Ctrl-C too)
        line = distributed.agree(_read_line() if distributed.is_main() else None)
        if line == CTRL_C:
            raise KeyboardInterrupt
        if line is None:
            typer.echo("")
            return
        text = line.strip()
        if not text:
            continue
        if text.startswith("/") and not text.startswith("//"):
            word = text.split()[0]
            if word in ("/quit", "/exit"):
                return
            if word == "/reset":
                session = m.chat()
                typer.echo("(new conversation)", err=True)
            elif word == "/help":
                for name, what in CHAT_COMMANDS.items():
                    typer.echo(f"  {name:8s} {what}", err=True)
                typer.echo("  a line starting with // is sent with one / removed", err=True)
            else:
                typer.echo(f"unknown command {word}; /help lists the commands.", err=True)
            continue
        if text.startswith("//"):
            line = line.replace("//", "/", 1)
        _chat_turn(session, line, sampling)


def _chat_turn(session: Any, line: str, sampling: dict) -> None:
    """One chat turn: the answer on stdout, the stats (or what went wrong) on
    stderr on a line of its own; a failed turn leaves the session as it was."""
    last, wrote = None, False
    try:
        for chunk in session.send(line, **sampling):
            typer.echo(chunk.text, nl=False)
            wrote = wrote or bool(chunk.text)
            last = chunk
    except KeyboardInterrupt:
        typer.echo("")
        typer.echo("(interrupted; the partial answer stays in the conversation)", err=True)
        return
    except Exception as e:  # the session outlives any one turn (MLX raises RuntimeError)
        if wrote:
            typer.echo("")
        what = str(e) if isinstance(e, (MTPError, OSError)) else f"{type(e).__name__}: {e}"
        typer.echo(f"error: {what}", err=True)
        typer.echo("(this turn was dropped; the conversation goes on)", err=True)
        return
    typer.echo("")
    _end_note(last)


def _line_editing() -> None:
    """Arrow keys, line editing and history (this session's lines) for
    ``input()``, where Python has ``readline`` and stdin is a terminal; and
    bytes that are not UTF-8 read as lone surrogates (that turn is then
    refused by name, the session goes on) instead of ending the session."""
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")
    if not sys.stdin.isatty():
        return
    try:
        import readline  # noqa: F401  (importing it is what turns line editing on)
    except ImportError:  # Windows without pyreadline: plain input
        return


#: what :func:`_read_line` returns for Ctrl-C at the prompt (the CLI then exits 130)
CTRL_C = ("ctrl-c",)


def _read_line() -> str | tuple | None:
    """One line from the user, None at end of input, :data:`CTRL_C` for Ctrl-C."""
    try:
        return input(">> ")
    except EOFError:
        return None
    except KeyboardInterrupt:
        return CTRL_C


@app.command()
def models(
    families: bool = typer.Option(
        False,
        "--families",
        help="List every model type of the installed mlx-lm and what runs on it "
        "(tree / chain / plain), with the reason.",
    ),
    markdown: bool = typer.Option(False, "--markdown", help="With --families: as Markdown."),
):
    """List model aliases, methods, and converted models in the cache."""
    if families:
        from .families import families_markdown, family_table

        if markdown:
            typer.echo(families_markdown(), nl=False)
            return
        for mtype, kind, why in family_table():
            typer.echo(f"{mtype:24s} {kind:6s} {why}")
        return
    typer.echo("aliases:")
    for k, v in ALIASES.items():
        typer.echo(f"  {k:18s} {v}")
    typer.echo("methods:")
    for name in available_methods():
        typer.echo(f"  {name:18s} {DESCRIPTIONS[name]}")
    typer.echo(f"cache: {cache_home()}")
    for p in cached_models():
        typer.echo(f"  {p.name}")


def _register_commands() -> None:
    """Add the sub-commands of every module in ``mlx_mtp/commands`` (each
    defines ``register(app)``), so features add commands without editing this
    file."""
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda i: i.name):
        importlib.import_module(f"{commands.__name__}.{info.name}").register(app)
    for name, sub in commands.groups().items():
        app.add_typer(sub, name=name)


_register_commands()


def _click_exceptions() -> tuple[type[BaseException], ...]:
    """Click's exception base classes: typer >= 0.17 raises those of its own
    bundled click copy (``typer._click``), which are not subclasses of
    ``click.ClickException``; older typer raises click's. Imported only when
    an error is reported: typer >= 0.17 does not load click otherwise."""
    import click

    found: list[type[BaseException]] = [click.ClickException]
    try:
        from typer._click.exceptions import ClickException as BundledClickException
    except ImportError:
        pass
    else:
        found.append(BundledClickException)
    return tuple(found)


def usage_error_line(e: BaseException) -> str:
    """Click's message of a usage error on one line, with the command whose
    ``--help`` lists the options (click's own report takes three lines:
    usage, "Try ... --help", "Error: ...")."""
    text = " ".join(e.format_message().split())  # type: ignore[attr-defined]
    ctx = getattr(e, "ctx", None)
    if ctx is not None:
        text += f" (see '{ctx.command_path} --help')"
    return text


def main() -> None:
    """Console entry point (OpenBLAS is preloaded by ``import mlx_mtp``).

    Exit status 2 with one line on stderr for bad input, ``error: ...``: usage
    errors (unknown flag, missing or unparsable value, out-of-range value:
    :func:`usage_error_line`) and every :class:`MTPError`.
    Never a traceback for either. Exit status 130 on Ctrl-C (SIGINT), whatever
    the command was doing (loading, generating, converting, serving)."""
    if not distributed.is_main():
        _quiet_rank()
    try:
        # MLX_MTP_SIMULATE_DEVICE: every command's engines on the simulated device
        from .bench.simulate import install

        install()
        code = app(standalone_mode=False)
    except (MTPError, OSError) as e:  # OSError: an --out/--data path that cannot be used
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except _click_exceptions() as e:
        if type(e).__name__ == "Abort":
            sys.exit(130)
        if type(e).__name__ == "NoArgsIsHelpError":  # a group called bare: its help
            e.show()  # type: ignore[attr-defined]
        else:
            typer.echo(f"error: {usage_error_line(e)}", err=True)
        sys.exit(e.exit_code)  # type: ignore[attr-defined]
    # typer turns Ctrl-C (KeyboardInterrupt) into the return value 130, and a
    # typer.Exit(code) into its code
    if isinstance(code, int) and not isinstance(code, bool) and code != 0:
        sys.exit(code)


def _quiet_rank() -> None:
    """On ranks other than 0 of an MLX group (``mlx.launch``): output and
    progress bars go nowhere, so only rank 0 prints; error lines still reach
    the real stderr, marked with the rank."""
    real = sys.__stderr__

    class _ErrorsOnly:
        failing = False  # from the first error line on, everything passes

        def write(self, text: str) -> int:
            if not self.failing and text.startswith(("error:", "Error:", "Traceback")):
                self.failing = True
                text = f"[rank {distributed.rank()}] {text}"
            if self.failing and real is not None:
                real.write(text)
            return len(text)

        def flush(self) -> None:
            if real is not None:
                real.flush()

        def isatty(self) -> bool:
            return False

    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)
    sys.stderr = _ErrorsOnly()


if __name__ == "__main__":
    main()
