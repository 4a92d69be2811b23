"""Make MLX's CPU backend use OpenBLAS on Linux (docs/design.md §9).

mlx-cpu ships a reference BLAS (a separate shared library next to ``libmlx``)
that makes matmuls about ten times slower than OpenBLAS. Loading Debian's
``libopenblas0-pthread`` with ``RTLD_GLOBAL`` *before* MLX is imported puts its
``cblas_*`` symbols first in the global lookup scope, so ``libmlx`` binds to
them instead - the same effect as ``LD_PRELOAD``, without restarting the
process. :mod:`mlx_mtp` does this on import, so it is automatic whenever
``mlx_mtp`` is imported before ``mlx`` (the CLI and the tests do). Set
``MLX_MTP_NO_BLAS_FIX=1`` to turn it off. Where MLX was imported first, use
``LD_PRELOAD=<path printed by blas_status()>``.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
)

_loaded: str | None = None


def openblas_path() -> str | None:
    """Path of Debian's OpenBLAS ``libblas.so.3``, or None if it is not installed."""
    for p in OPENBLAS_CANDIDATES:
        if Path(p).exists():
            return p
    return None


def preload_openblas() -> bool:
    """Load OpenBLAS globally so that MLX binds to it. Returns True if it is (or
    already was) loaded ahead of MLX; False on macOS, when disabled with
    ``MLX_MTP_NO_BLAS_FIX=1``, when OpenBLAS is missing, or when ``mlx.core``
    was imported first (then it is too late in this process)."""
    global _loaded
    if _loaded:
        return True
    if sys.platform != "linux" or os.environ.get("MLX_MTP_NO_BLAS_FIX") == "1":
        return False
    lib = openblas_path()
    if lib is None:
        return False
    if lib in os.environ.get("LD_PRELOAD", ""):
        _loaded = lib
        return True
    if "mlx.core" in sys.modules:
        return False
    try:
        ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return False
    _loaded = lib
    return True


def blas_status() -> str:
    """Which BLAS MLX uses in this process: 'metal' (macOS), 'openblas',
    'reference' (slow, see the module docstring) or 'unknown'."""
    if sys.platform == "darwin":
        return "metal"
    if _loaded or "openblas" in os.environ.get("LD_PRELOAD", ""):
        return "openblas"
    return "reference" if sys.platform == "linux" else "unknown"
