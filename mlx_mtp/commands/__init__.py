"""CLI sub-commands. Each module defines ``register(app: typer.Typer) -> None``
and is picked up by :mod:`mlx_mtp.cli` automatically."""
