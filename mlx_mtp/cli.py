"""``mlx-mtp`` command line: ``generate``, ``chat``, ``models`` here; the
sub-commands of :mod:`mlx_mtp.commands` (bench, serve, train, convert) are
added automatically."""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
from typing import Any

import typer

from . import commands, distributed, load
from .cli_options import (
    LOAD,
    METHOD_OPTIONS,
    RUNNER,
    SAMPLING,
    SHARDING,
    THINKING,
    check_choices,
    interrupted_note,
    with_options,
)
from .errors import MTPError
from .loading import ALIASES, cache_home, cached_models
from .methods import DESCRIPTIONS, available_methods
from .runners import check_runner
from .validation import check_generation_args

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    help="Several tokens per forward pass for MLX language models.",
)


def _load(
    model,
    method,
    dtype,
    max_kv_size,
    options,
    pipeline_parallel=False,
    thinking=False,
    runner="auto",
    kv_bits=None,
    kv_group_size=64,
):
    check_choices(method, options, dtype)
    check_runner(runner)
    where = f" over {distributed.size()} ranks" if distributed.size() > 1 else ""
    typer.echo(f"loading {model} ({method}){where} ...", err=True)
    with interrupted_note(f"interrupted while loading {model}: nothing was generated."):
        m = load(
            model,
            method,
            dtype=dtype,
            max_kv_size=max_kv_size,
            pipeline_parallel=pipeline_parallel,
            thinking=thinking,
            runner=runner,
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
            **options,
        )
    if where:
        typer.echo(f"sharded: {distributed.sharding(m.model)} parallel{where}", err=True)
    return m


@app.command()
@with_options(LOAD, SAMPLING, METHOD_OPTIONS, SHARDING)
def generate(
    prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt text ('-' reads stdin)."),
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
    thinking: bool = THINKING,
    runner: str = RUNNER,
    *,
    load: dict,
    sampling: dict,
    options: dict,
    pipeline_parallel: bool,
):
    """Generate one answer and print statistics."""
    if prompt == "-":
        # read on rank 0 only (a launcher gives stdin to rank 0), shared with all
        prompt = distributed.agree(sys.stdin.read() if distributed.is_main() else None)
    if not prompt.strip():
        raise typer.BadParameter("the prompt is empty", param_hint="'--prompt'")
    last = None
    check_generation_args(**sampling)  # before the slow load
    m = _load(
        **load,
        options=options,
        pipeline_parallel=pipeline_parallel,
        thinking=thinking,
        runner=runner,
    )
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
@with_options(LOAD, SAMPLING, METHOD_OPTIONS, SHARDING)
def chat(
    thinking: bool = THINKING,
    runner: str = RUNNER,
    *,
    load: dict,
    sampling: dict,
    options: dict,
    pipeline_parallel: bool,
):
    """Interactive multi-turn chat (KV cache reused across turns). /help lists the commands."""
    check_generation_args(**sampling)  # before the slow load
    m = _load(
        **load,
        options=options,
        pipeline_parallel=pipeline_parallel,
        thinking=thinking,
        runner=runner,
    )
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
