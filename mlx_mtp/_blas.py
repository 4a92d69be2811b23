"""Make MLX's CPU backend use OpenBLAS on Linux (see DESIGN §4).

mlx-cpu bundles a reference BLAS that makes matmuls about ten times slower than
OpenBLAS. Preloading Debian's ``libopenblas0-pthread`` swaps it in. A preload
only works before the process starts, so :func:`ensure_fast_blas` re-executes
the current command once with ``LD_PRELOAD`` set. It does nothing on macOS
(Metal), when the library is absent, when it is already loaded, or when
``MLX_MTP_NO_BLAS_FIX=1``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
)


def openblas_path() -> str | None:
    """Return the path of Debian's OpenBLAS ``libblas.so.3``, or None if absent."""
    for p in OPENBLAS_CANDIDATES:
        if Path(p).exists():
            return p
    return None


def blas_status() -> str:
    """Describe which BLAS this process uses: 'metal', 'openblas' or 'reference'."""
    if sys.platform == "darwin":
        return "metal"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    return "openblas" if "openblas" in maps else "reference"


def ensure_fast_blas() -> None:
    """Re-execute this process with OpenBLAS preloaded, when that helps.

    Called by the CLI entry point and the test suite before MLX does any work.
    Raises nothing: if the re-exec is not possible the process goes on as is.
    """
    if sys.platform != "linux" or os.environ.get("MLX_MTP_NO_BLAS_FIX") == "1":
        return
    lib = openblas_path()
    if lib is None or lib in os.environ.get("LD_PRELOAD", ""):
        return
    if os.environ.get("_MLX_MTP_BLAS_REEXEC") == "1":  # tried once already
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    env["_MLX_MTP_BLAS_REEXEC"] = "1"
    argv = list(getattr(sys, "orig_argv", [])) or [sys.executable, *sys.argv]
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *argv[1:]], env)
    except OSError:
        return
