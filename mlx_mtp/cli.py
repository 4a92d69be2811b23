"""``mlx-mtp`` command line: chat, generate, models (and more as methods land)."""

from __future__ import annotations

import sys

import typer

from .errors import MTPError
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
MASKS = typer.Option(None, "--masks", help="probe: mask slots per node (1 or 2).")
TREE = typer.Option(None, "--tree", help="probe: 'dynamic' or nodes per depth, e.g. '14'.")
K = typer.Option(None, "--k", help="clp/confadapt: horizon / block size k.")
TAU = typer.Option(None, "--tau", help="confadapt: confidence threshold tau.")
OPT = typer.Option(None, "--opt", help="Extra method option key=value (repeatable).")
MAX_KV = _ranged("max_kv_size", None, help="Sliding-window KV cache size in tokens (>= 16).")
THINKING = typer.Option(
    False, "--thinking/--no-thinking", help="Hybrid-thinking chat templates (Qwen3): think first."
)


def _options(bc, masks, tree, opt, k=None, tau=None) -> dict:
    out = {}
    for key, val in (("bc", bc), ("masks", masks), ("tree", tree), ("k", k), ("tau", tau)):
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


def _load(model, method, dtype, max_kv, options, thinking=False):
    from . import load

    typer.echo(f"loading {model} ({method}) ...", err=True)
    return load(model, method, dtype=dtype, max_kv_size=max_kv, thinking=thinking, **options)


@app.command()
def generate(
    prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt text ('-' reads stdin)."),
    model: str = MODEL,
    method: str = METHOD,
    dtype: str | None = DTYPE,
    max_tokens: int = MAX_TOKENS,
    temp: float = TEMP,
    top_p: float = TOP_P,
    top_k: int = TOP_K,
    min_p: float = MIN_P,
    seed: int | None = SEED,
    bc: str | None = BC,
    masks: int | None = MASKS,
    tree: str | None = TREE,
    k: int | None = K,
    tau: float | None = TAU,
    opt: list[str] | None = OPT,
    max_kv_size: int | None = MAX_KV,
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
    thinking: bool = THINKING,
):
    """Generate one answer and print statistics."""
    if prompt == "-":
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise typer.BadParameter("the prompt is empty", param_hint="'--prompt'")
    last = None
    sampling = dict(max_tokens=max_tokens, temp=temp, top_p=top_p, top_k=top_k, min_p=min_p)
    check_generation_args(**sampling, seed=seed)  # before the slow load
    m = _load(model, method, dtype, max_kv_size, _options(bc, masks, tree, opt, k, tau), thinking)
    for chunk in m.stream_generate(prompt, **sampling, seed=seed, chat_template=not raw):
        typer.echo(chunk.text, nl=False)
        last = chunk
    typer.echo("")
    if last is not None:
        typer.echo(last.stats.summary(), err=True)


@app.command()
def chat(
    model: str = MODEL,
    method: str = METHOD,
    dtype: str | None = DTYPE,
    max_tokens: int = MAX_TOKENS,
    temp: float = TEMP,
    top_p: float = TOP_P,
    top_k: int = TOP_K,
    min_p: float = MIN_P,
    seed: int | None = SEED,
    bc: str | None = BC,
    masks: int | None = MASKS,
    tree: str | None = TREE,
    k: int | None = K,
    tau: float | None = TAU,
    opt: list[str] | None = OPT,
    max_kv_size: int | None = MAX_KV,
    thinking: bool = THINKING,
):
    """Interactive multi-turn chat (KV cache reused across turns). /reset clears, /quit exits."""
    sampling = dict(max_tokens=max_tokens, temp=temp, top_p=top_p, top_k=top_k, min_p=min_p)
    check_generation_args(**sampling, seed=seed)  # before the slow load
    m = _load(model, method, dtype, max_kv_size, _options(bc, masks, tree, opt, k, tau), thinking)
    session = m.chat()
    typer.echo("Type a message (/reset to start over, /quit or Ctrl-D to exit).", err=True)
    while True:
        try:
            line = input(">> ")
        except (EOFError, KeyboardInterrupt):
            typer.echo("")
            return
        if line.strip() in ("/quit", "/exit"):
            return
        if line.strip() == "/reset":
            session = m.chat()
            continue
        if not line.strip():
            continue
        last = None
        try:
            for chunk in session.send(line, **sampling, seed=seed):
                typer.echo(chunk.text, nl=False)
                last = chunk
        except KeyboardInterrupt:
            typer.echo("\n(interrupted)", err=True)
        typer.echo("")
        if last is not None:
            typer.echo(last.stats.summary(), err=True)


@app.command()
def models():
    """List model aliases, methods, and converted models in the cache."""
    from .loading import ALIASES, cache_home, cached_models
    from .methods import DESCRIPTIONS, available_methods

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
    import importlib
    import pkgutil

    from . import commands

    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda i: i.name):
        importlib.import_module(f"{commands.__name__}.{info.name}").register(app)
    for name, sub in commands.groups().items():
        app.add_typer(sub, name=name)


_register_commands()


def _click_exceptions() -> tuple[type[BaseException], ...]:
    """Click's exception base classes: typer >= 0.17 raises those of its own
    bundled click copy (``typer._click``), which are not subclasses of
    ``click.ClickException``; older typer raises click's."""
    import click

    found: list[type[BaseException]] = [click.ClickException]
    try:
        from typer._click.exceptions import ClickException as BundledClickException
    except ImportError:
        pass
    else:
        found.append(BundledClickException)
    return tuple(found)


def main() -> None:
    """Console entry point (OpenBLAS is preloaded by ``import mlx_mtp``).

    Exit status 2 with one line on stderr for bad input: usage errors (unknown
    flag, missing or unparsable value, out-of-range value: click prints the
    usage line and ``Error: ...``) and every :class:`MTPError` (``error: ...``).
    Never a traceback for either."""
    try:
        app(standalone_mode=False)
    except (MTPError, OSError) as e:  # OSError: an --out/--data path that cannot be used
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except _click_exceptions() as e:
        if type(e).__name__ == "Abort":
            sys.exit(130)
        e.show()  # type: ignore[attr-defined]
        sys.exit(e.exit_code)  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
