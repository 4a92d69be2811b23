"""``mlx-mtp`` command line: chat, generate, models (and more as methods land)."""

from __future__ import annotations

import sys

import typer

from .errors import MTPError

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    help="Several tokens per forward pass for MLX language models.",
)

MODEL = typer.Option("smollm2-135m", "--model", "-m", help="Alias, folder, .gguf or HF repo id.")
METHOD = typer.Option("ntp", "--method", help="ntp, pld, probe, ... (see `mlx-mtp models`).")
DTYPE = typer.Option(None, "--dtype", help="float32, bfloat16, float16 or auto (as stored).")
MAX_TOKENS = typer.Option(256, "--max-tokens", "-n", help="Maximum new tokens per answer.")
TEMP = typer.Option(0.0, "--temp", help="Sampling temperature (0 = greedy).")
TOP_P = typer.Option(0.0, "--top-p", help="Nucleus sampling threshold (with --temp > 0).")
SEED = typer.Option(None, "--seed", help="Random seed for sampling.")
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
MAX_KV = typer.Option(None, "--max-kv-size", help="Sliding-window KV cache size in tokens.")


def _options(bc, masks, tree, opt, k=None, tau=None) -> dict:
    out = {}
    for key, val in (("bc", bc), ("masks", masks), ("tree", tree), ("k", k), ("tau", tau)):
        if val is not None:
            out[key] = val
    for item in opt or []:
        if "=" not in item:
            raise typer.BadParameter(f"--opt expects key=value, got {item!r}")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def _load(model, method, dtype, max_kv, options):
    from . import load

    typer.echo(f"loading {model} ({method}) ...", err=True)
    return load(model, method, dtype=dtype, max_kv_size=max_kv, **options)


@app.command()
def generate(
    prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt text ('-' reads stdin)."),
    model: str = MODEL,
    method: str = METHOD,
    dtype: str | None = DTYPE,
    max_tokens: int = MAX_TOKENS,
    temp: float = TEMP,
    top_p: float = TOP_P,
    seed: int | None = SEED,
    bc: str | None = BC,
    masks: int | None = MASKS,
    tree: str | None = TREE,
    k: int | None = K,
    tau: float | None = TAU,
    opt: list[str] | None = OPT,
    max_kv_size: int | None = MAX_KV,
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
):
    """Generate one answer and print statistics."""
    if prompt == "-":
        prompt = sys.stdin.read()
    m = _load(model, method, dtype, max_kv_size, _options(bc, masks, tree, opt, k, tau))
    last = None
    for chunk in m.stream_generate(
        prompt, max_tokens=max_tokens, temp=temp, top_p=top_p, seed=seed, chat_template=not raw
    ):
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
    seed: int | None = SEED,
    bc: str | None = BC,
    masks: int | None = MASKS,
    tree: str | None = TREE,
    k: int | None = K,
    tau: float | None = TAU,
    opt: list[str] | None = OPT,
    max_kv_size: int | None = MAX_KV,
):
    """Interactive multi-turn chat (KV cache reused across turns). /reset clears, /quit exits."""
    m = _load(model, method, dtype, max_kv_size, _options(bc, masks, tree, opt, k, tau))
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
            for chunk in session.send(
                line, max_tokens=max_tokens, temp=temp, top_p=top_p, seed=seed
            ):
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


def main() -> None:
    """Console entry point (OpenBLAS is preloaded by ``import mlx_mtp``); errors
    from mlx-mtp are printed without a traceback and exit with status 2."""
    try:
        app(standalone_mode=False)
    except MTPError as e:
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)
    except FileExistsError as e:
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):
        sys.exit(130)
    except Exception as e:  # click usage errors
        import click

        if isinstance(e, click.ClickException):
            e.show()
            sys.exit(e.exit_code)
        raise


if __name__ == "__main__":
    main()
