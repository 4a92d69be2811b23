"""One home for what mlx-mtp writes and finds: cost curves, learned masks,
CLP and MTP heads, confadapt adapters, imported models.

- Where: ``<cache_home()>/<kind>`` (``$MLX_MTP_HOME``, default
  ``~/.cache/mlx-mtp``; :data:`KINDS`); some ship in ``mlx_mtp/assets/<kind>``.
- Writing, atomically: a file through a temporary file in the same folder
  (:func:`atomic_write`), a folder built under a temporary name and swapped
  into place (:func:`atomic_folder`); MLX's write failures (a full disk) are
  ``OSError`` naming the file (:func:`mlx_write_errors`). A reader never sees
  half an artifact; a failed write leaves what was there. A command checks
  its output folder before it works (:func:`check_writable`) and refuses to
  replace what it did not make (:func:`check_destination`).
- Finding: :func:`find_artifact`, the first artifact in :func:`search_dirs`
  (the cache, then the shipped assets) made for the model
  (:func:`mlx_mtp.fingerprint.same_model`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.nn as nn

from .errors import InvalidArgumentError
from .fingerprint import same_model

#: the kinds of artifact, each a folder of that name (GGUF imports are ``models``)
KINDS = ("cost_curves", "masks", "clp", "confadapt", "models")

#: artifacts that ship inside the package (learned masks, CLP heads, adapters)
ASSETS = Path(__file__).resolve().parent / "assets"


def cache_home() -> Path:
    """The user cache folder for converted models and trained weights."""
    return Path(os.environ.get("MLX_MTP_HOME", Path.home() / ".cache" / "mlx-mtp"))


def artifact_dir(kind: str, home: Path | None = None) -> Path:
    """``<home or cache_home()>/<kind>`` (not created).

    Raises:
        KeyError: an unknown kind.
    """
    if kind not in KINDS:
        raise KeyError(kind)
    return (home or cache_home()) / kind


def search_dirs(kind: str, shipped: bool = True) -> list[Path]:
    """Where artifacts of ``kind`` are looked for, in order: the user's cache
    folder, then (``shipped``) the package's ``assets/<kind>``."""
    return [artifact_dir(kind)] + ([ASSETS / kind] if shipped else [])


# ------------------------------------------------------------------ writing
def atomic_write(path: Path, write: Callable[[Path], None], mode: int = 0o644) -> Path:
    """Write ``path`` atomically: ``write(tmp)`` fills a temporary file in the
    same folder (created if missing; its name keeps ``path``'s suffix, for
    writers that choose the format by it), which then replaces ``path`` with
    permissions ``mode``.

    Raises:
        OSError: the folder cannot be created or written, or MLX cannot write
            (:func:`mlx_write_errors`; nothing changed).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    os.close(fd)
    try:
        with mlx_write_errors(path):
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
def mlx_write_errors(path: Path) -> Iterator[None]:
    """MLX's write failures (a full disk: a ``RuntimeError`` naming no file,
    ``[write] Unable to write N bytes to file.``) inside the block raised as an
    ``OSError`` naming ``path``, the write failure callers and the CLI (one
    line, exit 2) expect. Other errors (a lazy array whose source cannot be
    read) pass unchanged. :func:`atomic_write` and :func:`atomic_folder` apply it."""
    try:
        yield
    except RuntimeError as e:
        if not str(e).startswith(("[write]", "[save")):
            raise
        raise OSError(f"cannot write {path} ({e}): is the disk full?") from e


@contextmanager
def atomic_folder(dest: Path) -> Iterator[Path]:
    """Build a folder in the temporary folder it yields, next to ``dest``, and
    move it into place when the block ends without an exception; an existing
    ``dest`` is replaced only then (kept aside until the new one is in place).
    On an exception the temporary folder is removed, ``dest`` left as it was.

    Raises:
        OSError: the folder cannot be created or written, or MLX cannot write
            in it (:func:`mlx_write_errors`; nothing changed).
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; artifacts are ordinary folders
    try:
        with mlx_write_errors(dest):
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


def check_writable(folder: Path, what: str = "--out") -> None:
    """Refuse an output ``folder`` (chosen by ``what``) that cannot take a new
    file, before any work is done: the folder or, where it does not exist
    yet, its nearest existing parent. Leaves nothing (a probe file is made and
    removed).

    Raises:
        InvalidArgumentError: a file where a folder is needed, or a read-only
            or forbidden folder.
    """
    folder = near = Path(folder).expanduser()
    while not near.exists() and near != near.parent:
        near = near.parent
    try:
        if not near.is_dir():
            raise NotADirectoryError(f"{near} is a file")
        fd, probe = tempfile.mkstemp(dir=near, prefix=".mlx-mtp-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        reason = f"{e.strerror}: {near}" if e.strerror else str(e)
        raise InvalidArgumentError(
            f"{what}: cannot write in {folder} ({reason}); choose another {what}."
        ) from e


def check_destination(
    dest: Path, overwrite: bool = False, what: str = "--out", ours: bool = False
) -> None:
    """Refuse an existing ``dest`` (chosen by ``what``) that a command would
    replace or write into, before any work is done: a file, or a folder that
    is not empty. Free: a path that does not exist, an empty folder,
    ``overwrite`` (the user asked to replace it) and ``ours`` (the command's
    own earlier output, e.g. the run a ``--resume`` continues).

    Raises:
        InvalidArgumentError: ``dest`` exists; the message names it and says
            to pass --overwrite or to choose another path.
    """
    if overwrite or ours:
        return
    path = Path(dest).expanduser()
    if not (path.exists() or path.is_symlink()):
        return
    if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
        return
    kind = "a folder" if path.is_dir() else "a file"
    raise InvalidArgumentError(
        f"{what} {dest} already exists ({kind} this command did not make); pass --overwrite "
        f"to replace it, or choose another {what}."
    )


# ------------------------------------------------------------------ finding
def find_artifact(
    model: nn.Module | str,
    roots: list[Path],
    meta: str,
    keys: tuple[str, str] = ("fingerprint", "signature"),
    accept: Callable[[Path, dict[str, Any]], bool] | None = None,
) -> Path | None:
    """The first artifact in ``roots`` (in order, entries by name) made for
    ``model`` (fingerprint, else signature: :func:`~mlx_mtp.fingerprint.same_model`;
    a fingerprint string: exact match), or None. An artifact is a root's entry
    whose JSON object ``root.glob(meta)`` finds: ``"*.json"`` (the entry is
    that file), ``"*/config.json"`` (the folder). ``keys`` name the metadata's
    fingerprint and signature; ``accept(path, metadata)`` may refuse more."""
    for root in roots:
        for path in sorted(root.glob(meta), key=lambda p: p.relative_to(root).parts):
            try:
                info = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if not isinstance(info, dict) or (accept is not None and not accept(path, info)):
                continue
            fp, sig = info.get(keys[0]), info.get(keys[1])
            if fp == model if isinstance(model, str) else same_model(model, fp, sig):
                return root / path.relative_to(root).parts[0]
    return None
