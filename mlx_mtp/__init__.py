"""mlx-mtp: several tokens per forward pass for MLX language models.

Methods: ``probe`` (ESP embedding-space probing, lossless), ``pld`` (prompt
lookup, lossless) and ``ntp`` (plain decoding). See :func:`load`.
"""

import os as _os

from ._blas import preload_openblas as _preload_openblas

_os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
_preload_openblas()  # before anything imports mlx (Linux CPU speed, docs/design.md §9)

from .api import ChatSession, Chunk, MTPModel, Result, load  # noqa: E402
from .decoding import GenerationStats  # noqa: E402
from .errors import MTPError  # noqa: E402

__version__ = "0.1.0"
__all__ = ["load", "MTPModel", "ChatSession", "Chunk", "Result", "GenerationStats", "MTPError"]
