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
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .artifacts import (
    ASSETS,
    artifact_dir,
    atomic_write,
    atomic_write_text,
    find_artifact,
    search_dirs,
)
from .dims import model_dims
from .errors import CheckpointMismatchError, InvalidArgumentError, MTPError
from .fingerprint import model_fingerprint, model_signature, same_model

#: version of the file format written by :func:`save_learned_masks`
FORMAT_VERSION = 1
#: shipped learned masks (keyed by model fingerprint)
ASSETS_DIR = ASSETS / "masks"
#: what names a file (a path with another suffix, or none, is a folder)
SUFFIXES = (".safetensors", ".json")


class LearnedMasksNotFoundError(MTPError):
    """No learned mask file exists for this model."""


def masks_folder(path: str | Path | None = None) -> Path:
    """The folder :func:`save_learned_masks` writes into for ``path``: a
    ``.safetensors``/``.json`` file's folder, or ``path`` itself (default
    ``cache_home()/masks``)."""
    p = Path(path) if path is not None else artifact_dir("masks")
    return p.parent if p.suffix in SUFFIXES else p


def save_learned_masks(
    masks: mx.array | np.ndarray,
    model: nn.Module,
    path: str | Path | None = None,
    info: dict[str, Any] | None = None,
    overwrite: bool = True,
) -> Path:
    """Write learned mask vectors for ``model`` (atomically, the weights first,
    then the sidecar: :func:`~mlx_mtp.artifacts.atomic_write`).

    Args:
        masks: (slots, hidden_size) mask vectors, any float dtype (stored float32).
        model: the model they were trained for (its fingerprint is stored).
        path: target ``.safetensors`` file (the ``.json`` sidecar goes beside it),
            or a folder (file named ``<fingerprint>.safetensors``); default
            ``cache_home()/masks``.
        info: extra JSON-serialisable metadata (training summary, model name).
        overwrite: replace existing files; if False an existing file raises.

    Returns:
        The path of the ``.json`` sidecar (pass it to :func:`load_learned_masks`).

    Raises:
        InvalidArgumentError: wrong shape for this model, or the file exists and
            ``overwrite`` is False.
        OSError: the file cannot be written (nothing changed).
    """
    arr = np.asarray(mx.array(masks).astype(mx.float32))
    hidden = model_dims(model)[0]
    if arr.ndim != 2 or arr.shape[1] != hidden:
        raise InvalidArgumentError(
            f"mask vectors must have shape (slots, {hidden}) for this model, got {arr.shape}"
        )
    fp = model_fingerprint(model)
    p = Path(path) if path is not None else artifact_dir("masks")
    p = p.with_suffix(".safetensors") if p.suffix in SUFFIXES else p / f"{fp}.safetensors"
    meta_path = p.with_suffix(".json")
    if not overwrite and (p.exists() or meta_path.exists()):
        raise InvalidArgumentError(f"{p} exists; pass --overwrite or another --out")
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
    weights = {"masks": mx.array(arr)}
    atomic_write(p, lambda t: mx.save_safetensors(str(t), weights, metadata={"fingerprint": fp}))
    return atomic_write_text(meta_path, json.dumps(meta, indent=2))


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
    if path is not None and not Path(path).is_dir():  # a file: that one only
        roots, tried = [], [Path(path).with_suffix(".json")]
    else:  # <fingerprint>.json, else masks of the same weights at another precision
        roots = [Path(path)] if path is not None else search_dirs("masks")
        tried = [r / f"{fp}.json" for r in roots]
    hit = next((t for t in tried if t.exists()), None)
    meta_path = hit or find_artifact(model, roots, "*.json")
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
