"""CLI sub-commands.

Each module here defines ``register(app: typer.Typer) -> None`` and is picked
up by :mod:`mlx_mtp.cli` automatically. Commands that share a group (``convert``,
``train``) get it from :func:`group`, so several modules can add to one group.

Imports: what ``import mlx_mtp`` loads anyway (loading, data, errors,
distributed) and the standard library are imported at the top of a command
module; the feature modules a command runs (training, bench, server,
converters, fingerprint, confadapt_format, learned_masks) inside the command,
because every ``mlx-mtp`` call imports every command module: importing those
at the top made each start-up about 1.4 s slower (``python -X importtime``
and a timed import of each after ``import mlx_mtp.cli``, 2-core x86 Linux;
``training.clp`` alone 0.8 s). The server's ``fastapi``/``uvicorn`` are an
optional extra as well.
"""

from __future__ import annotations

import typer

_GROUPS: dict[str, typer.Typer] = {}
_HELP = {
    "convert": "Import heads and checkpoints from other formats.",
    "train": "Train MTP heads, mask vectors or adapters on this machine.",
}

#: --dtype help of the commands that train on or import for a base model
BASE_DTYPE_HELP = (
    "float32, bfloat16, float16, or auto (the stored weights: a 4-bit model is used as "
    "4-bit, no float copy). Default: float32 on Linux, auto on a Mac."
)
#: the --dtype option of those commands
BASE_DTYPE = typer.Option(None, "--dtype", help=BASE_DTYPE_HELP)


def group(name: str) -> typer.Typer:
    """The shared sub-app ``mlx-mtp NAME ...`` (created on first use)."""
    if name not in _GROUPS:
        _GROUPS[name] = typer.Typer(help=_HELP.get(name, ""), no_args_is_help=True)
    return _GROUPS[name]


def groups() -> dict[str, typer.Typer]:
    """All groups created so far."""
    return dict(_GROUPS)
