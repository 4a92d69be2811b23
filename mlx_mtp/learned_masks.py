"""Learned mask embeddings: fixed per-slot mask vectors trained for one model.

ESP (Goel et al., arXiv 2603.17942, §3.1) probes with a training-free mask
vector: the mean prompt embedding, moved towards each committed token. A few
hundred trained parameters do better: one hidden-size vector per mask slot,
learned with the model frozen so that slot j's logits predict the token j + 2
positions after its anchor (see :mod:`mlx_mtp.training.masks` and
``mlx-mtp train masks``).

File format: ``<name>.safetensors`` holds one array ``masks`` of shape
(slots, hidden_size), float32; the sidecar ``<name>.json`` holds the model
fingerprint (:func:`mlx_mtp.fingerprint.model_fingerprint`), the shape and the
training summary. Files are refused for any other model.

Where :func:`load_learned_masks` looks (first hit wins):

1. an explicit ``path`` (a ``.json``/``.safetensors`` file or a folder holding
   ``<fingerprint>.json``);
2. the user's cache ``cache_home()/masks/<fingerprint>.json`` (where
   ``mlx-mtp train masks`` writes by default);
3. the masks shipped with the package, ``mlx_mtp/assets/masks/<fingerprint>.json``
   (learned masks for the embedded SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .dims import model_dims
from .errors import CheckpointMismatchError, InvalidArgumentError, MTPError
from .fingerprint import model_fingerprint, model_signature, same_model
from .loading import cache_home

#: version of the file format written by :func:`save_learned_masks`
FORMAT_VERSION = 1
#: shipped learned masks (keyed by model fingerprint)
ASSETS_DIR = Path(__file__).parent / "assets" / "masks"


class LearnedMasksNotFoundError(MTPError):
    """No learned mask file exists for this model."""


def user_masks_dir() -> Path:
    """``cache_home()/masks``: where ``mlx-mtp train masks`` saves by default."""
    return cache_home() / "masks"


def _sidecar(path: Path) -> Path:
    return path.with_suffix(".json")


def save_learned_masks(
    masks: mx.array | np.ndarray,
    model: nn.Module,
    path: str | Path | None = None,
    info: dict[str, Any] | None = None,
    overwrite: bool = True,
) -> Path:
    """Write learned mask vectors for ``model`` (atomically: temp file, then rename).

    Args:
        masks: (slots, hidden_size) mask vectors, any float dtype (stored float32).
        model: the model they were trained for (its fingerprint is stored).
        path: target ``.safetensors`` file (the ``.json`` sidecar goes beside it),
            or a folder (file named ``<fingerprint>.safetensors``); default
            :func:`user_masks_dir`.
        info: extra JSON-serialisable metadata (training summary, model name).
        overwrite: replace existing files; if False an existing file raises.

    Returns:
        The path of the ``.json`` sidecar (pass it to :func:`load_learned_masks`).

    Raises:
        InvalidArgumentError: wrong shape for this model, or the file exists and
            ``overwrite`` is False.
    """
    arr = np.asarray(mx.array(masks).astype(mx.float32))
    hidden = model_dims(model)[0]
    if arr.ndim != 2 or arr.shape[1] != hidden:
        raise InvalidArgumentError(
            f"mask vectors must have shape (slots, {hidden}) for this model, got {arr.shape}"
        )
    fp = model_fingerprint(model)
    p = Path(path) if path is not None else user_masks_dir()
    if p.suffix not in (".safetensors", ".json"):
        p = p / f"{fp}.safetensors"
    p = p.with_suffix(".safetensors")
    meta_path = _sidecar(p)
    if not overwrite and (p.exists() or meta_path.exists()):
        raise InvalidArgumentError(f"{p} exists; pass --overwrite or another --out")
    p.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "format": "mlx-mtp-learned-masks",
        "version": FORMAT_VERSION,
        "fingerprint": fp,
        "signature": model_signature(model),
        "slots": int(arr.shape[0]),
        "hidden_size": int(arr.shape[1]),
        "weights": p.name,
        **(info or {}),
    }
    fd, tmp = tempfile.mkstemp(prefix=".tmp-masks-", suffix=".safetensors", dir=p.parent)
    os.close(fd)
    mx.save_safetensors(tmp, {"masks": mx.array(arr)}, metadata={"fingerprint": fp})
    fd, tmp_meta = tempfile.mkstemp(prefix=".tmp-masks-", suffix=".json", dir=p.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
    for t in (tmp, tmp_meta):
        os.chmod(t, 0o644)  # mkstemp files are private; these are plain data files
    os.replace(tmp, p)
    os.replace(tmp_meta, meta_path)
    return meta_path


def _candidates(fp: str, path: str | Path | None) -> list[Path]:
    if path is not None:
        p = Path(path)
        if p.is_dir():
            return [p / f"{fp}.json"]
        return [p.with_suffix(".json")]
    return [user_masks_dir() / f"{fp}.json", ASSETS_DIR / f"{fp}.json"]


def _by_signature(model: nn.Module, folders: list[Path]) -> Path | None:
    """The first sidecar in ``folders`` whose stored fingerprint/signature
    matches ``model`` (:func:`~mlx_mtp.fingerprint.same_model`): masks trained
    on the same weights at another precision (bf16 masks, 4-bit model)."""
    for folder in folders:
        if not folder.is_dir():
            continue
        for meta_path in sorted(folder.glob("*.json")):
            try:
                meta = json.loads(meta_path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if isinstance(meta, dict) and same_model(
                model, meta.get("fingerprint"), meta.get("signature")
            ):
                return meta_path
    return None


def load_learned_masks(model: nn.Module, path: str | Path | None = None) -> mx.array:
    """The learned mask vectors for ``model``, shape (slots, hidden_size), float32.

    Args:
        model: the model to decode with (its fingerprint selects the file).
        path: optional explicit file or folder; default search: the user cache
            (``cache_home()/masks``), then the masks shipped with the package.

    Raises:
        LearnedMasksNotFoundError: no file for this model (the message names the
            training command).
        CheckpointMismatchError: the file was trained for another model (other
            fingerprint or hidden size).
        MTPError: the file is unreadable.
    """
    fp = model_fingerprint(model)
    hidden = model_dims(model)[0]
    tried = _candidates(fp, path)
    meta_path = next((p for p in tried if p.exists()), None)
    if meta_path is None and (path is None or Path(path).is_dir()):
        meta_path = _by_signature(model, list(dict.fromkeys(p.parent for p in tried)))
    if meta_path is None:
        raise LearnedMasksNotFoundError(
            f"No learned mask embeddings for this model (fingerprint {fp}); looked in "
            f"{', '.join(str(p) for p in tried)}. Train them with `mlx-mtp train masks "
            "--model MODEL --data prompts.jsonl` (a few minutes), or use --opt mask_init=mean."
        )
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        weights = meta_path.parent / meta.get("weights", meta_path.with_suffix(".safetensors").name)
        arr = mx.load(str(weights))["masks"]
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise MTPError(f"cannot read learned masks {meta_path}: {e}") from e
    if not same_model(model, meta.get("fingerprint"), meta.get("signature")):
        raise CheckpointMismatchError(
            f"learned masks {meta_path} were trained for model fingerprint "
            f"{meta.get('fingerprint')!r} ({meta.get('model', 'unknown model')}), not for this "
            f"model ({fp}). Train masks for this model with `mlx-mtp train masks`."
        )
    if arr.ndim != 2 or arr.shape[1] != hidden:
        raise CheckpointMismatchError(
            f"learned masks {meta_path} have shape {tuple(arr.shape)}; this model needs "
            f"(slots, {hidden})."
        )
    return arr
