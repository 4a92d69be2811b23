"""``mlx-mtp convert gguf``: import a GGUF file (llama, qwen2, qwen3) into an MLX folder."""

from __future__ import annotations

from pathlib import Path

import typer

from ..artifacts import check_destination, check_writable
from . import group


def register(app: typer.Typer) -> None:
    """Add ``convert gguf``."""

    @group("convert").command("gguf")
    def convert_gguf_cmd(
        src: Path = typer.Argument(..., help="The .gguf file."),
        dst: Path = typer.Argument(..., help="Output model folder (created atomically)."),
        dtype: str = typer.Option(
            "float16",
            "--dtype",
            help="float16, bfloat16 or float32: storage of tensors MLX cannot load natively "
            "(K-quants, Q5_0, ...), once dequantized.",
        ),
        quantize: int = typer.Option(
            0, "--quantize", "-q", help="4 or 8: re-quantize with MLX (affine, group 64); 0 keeps."
        ),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing DST."),
    ):
        """Import a GGUF file into an MLX model folder (see converters/gguf.py)."""
        from ..converters.gguf import convert_gguf

        check_writable(dst.parent, "DST")  # before the weights are read
        check_destination(dst, overwrite, "DST")
        # GGUFImportError, FileExistsError, OSError (a full disk): one line from cli.main
        out = convert_gguf(src, dst, overwrite=overwrite, dtype=dtype, quantize=quantize or None)
        typer.echo(f"model written to {out}")
