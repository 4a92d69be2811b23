"""One home for what mlx-mtp writes: cost curves, learned masks, CLP and MTP
heads, confadapt adapters, imported models.

Everything lives under :func:`cache_home` (``$MLX_MTP_HOME``, default
``~/.cache/mlx-mtp``), one folder per kind (:data:`KINDS`), and is written
atomically: a file through a temporary file in the same folder and
``os.replace`` (:func:`atomic_write`), a folder by building it under a
temporary name and swapping it into place (:func:`atomic_folder`). A reader
never sees half an artifact, and a failed write (a full disk, an interrupt)
leaves what was there before.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

#: kind -> folder under the cache home
KINDS = {
    "cost_curves": "cost_curves",
    "masks": "masks",
    "clp": "clp",
    "confadapt": "confadapt",
    "models": "models",
    "gguf": "gguf",
}

#: artifacts that ship inside the package (learned masks, CLP heads, adapters)
ASSETS = Path(__file__).resolve().parent / "assets"


def cache_home() -> Path:
    """The user cache folder for converted models and trained weights."""
    return Path(os.environ.get("MLX_MTP_HOME", Path.home() / ".cache" / "mlx-mtp"))


def artifact_dir(kind: str, home: Path | None = None) -> Path:
    """``<home or cache_home()>/<kind's folder>`` (not created).

    Raises:
        KeyError: an unknown kind.
    """
    return (home or cache_home()) / KINDS[kind]


def atomic_write(path: Path, write: Callable[[Path], None], mode: int = 0o644) -> Path:
    """Write ``path`` atomically: ``write(tmp)`` fills a temporary file in the
    same folder (created if missing), which then replaces ``path``.

    Args:
        path: the destination.
        write: fills the file it is given (its name keeps ``path``'s suffix,
            for writers that choose the format by it).
        mode: permissions of the written file (temporary files are private).

    Raises:
        OSError: the folder cannot be created or written (nothing changed).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: Path, text: str) -> Path:
    """:func:`atomic_write` of a text file (UTF-8)."""
    return atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))


@contextmanager
def atomic_folder(dest: Path) -> Iterator[Path]:
    """Build a folder under a temporary name next to ``dest`` and move it into
    place when the block ends without an exception; an existing ``dest`` is
    replaced only then (kept aside until the new one is in place). On an
    exception the temporary folder is removed and ``dest`` is left as it was.

    Yields:
        The temporary folder to fill.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; artifacts are ordinary folders
    try:
        yield tmp
        if dest.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
            os.replace(dest, old / dest.name)
            try:
                os.replace(tmp, dest)
            except BaseException:
                os.replace(old / dest.name, dest)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
