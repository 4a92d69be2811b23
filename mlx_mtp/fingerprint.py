"""A short, stable fingerprint of a model's weights, and a tolerant signature.

Extra weights trained for one base model (CLP heads, learned mask vectors, MTP
adapters) store the fingerprint of that model and are refused for any other.

The fingerprint (a hash) survives casting to float32/bfloat16/float16 and
8-bit quantization, but not 4-bit or lower: quantization noise moves the
argmax of some embedding rows (measured on SmolLM2-135M and
Qwen2.5-Coder-0.5B: 4-bit with group 32 or 64 changes the hash of both). So
every artifact also stores a :func:`model_signature`, a few hundred numbers
compared with a tolerance (:func:`same_model`): heads trained on the bf16
model are accepted for its 4-bit quantization, and another model is refused.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

#: rows of the input embedding sampled by the fingerprint and the signature
ROWS = 64
#: random +-1 projections per sampled row in the signature
PROJECTIONS = 8
#: smallest cosine similarity of two signatures of one model. Measured cosine
#: between the float32 model and its quantization (group 64): 8-bit 1.000,
#: 4-bit 0.993-0.994, 3-bit 0.970-0.981, 2-bit 0.858-0.901 (SmolLM2-135M,
#: Qwen2.5-Coder-0.5B); neighbouring rows of one model (a shifted vocabulary)
#: 0.24-0.41.
MIN_COSINE = 0.9


def token_embedding(model: nn.Module) -> nn.Module:
    """The model's token embedding, whatever its family calls it: the one
    :func:`~mlx_mtp.families.model_parts` finds, else the first embedding
    module of the model (families whose decoder wraps it). An embedding
    wrapped with an MTP mask row
    (:class:`~mlx_mtp.confadapt_format.MaskedEmbedding`) gives its base, so
    a model with an on-device adapter has its base model's fingerprint.

    Raises:
        UnsupportedModelError: the model has no embedding module.
    """
    from .errors import UnsupportedModelError
    from .families import model_parts

    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    if emb is not None:  # the usual place (also of a model made of namespaces)
        return getattr(emb, "base", emb) if hasattr(emb, "mask_token_id") else emb
    try:
        return model_parts(model)[2]
    except UnsupportedModelError:
        for _, m in model.named_modules():
            if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding)):
                return m
        raise


def _sample(model: nn.Module, rows: int = ROWS) -> tuple[mx.array, tuple[int, int]]:
    """``rows`` evenly spaced rows of the input embedding (float32; a quantized
    embedding's rows are dequantized after gathering, never the whole table)
    and the embedding's logical shape."""
    from .dims import dense_weight, packed_width_factor

    emb = token_embedding(model)
    vocab = int(emb.weight.shape[0])
    idx = mx.array(np.linspace(0, vocab - 1, rows).astype(np.int32))
    if packed_width_factor(emb) != 1:
        biases = getattr(emb, "biases", None)
        part = SimpleNamespace(
            weight=emb.weight[idx],
            scales=emb.scales[idx],
            biases=None if biases is None else biases[idx],
            group_size=emb.group_size,
            bits=emb.bits,
            mode=getattr(emb, "mode", "affine"),
        )
        sample = dense_weight(part)
    else:
        sample = emb.weight[idx]
    return sample.astype(mx.float32), (vocab, int(sample.shape[1]))


def _layers(model: nn.Module) -> int:
    """The model's number of decoder layers (all of them on a pipeline-sharded
    rank, which holds only its own)."""
    layers = len(model.layers)
    if getattr(getattr(model, "model", None), "pipeline_size", 1) > 1:
        layers = int(getattr(model.args, "num_hidden_layers", layers))
    return layers


def model_fingerprint(model: nn.Module, rows: int = ROWS) -> str:
    """Hex digest (16 chars) of a model's shape and its input embedding.

    Hashes the number of layers, the embedding shape, and the position of the
    largest and smallest value in ``rows`` evenly spaced embedding rows. Those
    positions survive casting to float32/bfloat16/float16, 8-bit quantization
    and dequantization, so one base model gets one fingerprint in those forms,
    while another model (or a fine-tune that moved the embeddings) gets a
    different one. 4-bit and lower quantization can change it: compare with
    :func:`same_model`, which falls back to the signature.

    Raises:
        UnsupportedModelError: the model keeps no token embedding under the
            names mlx-lm uses (:func:`~mlx_mtp.families.model_parts`).
    """
    sample, shape = _sample(model, rows)
    arg = np.concatenate([np.array(mx.argmax(sample, axis=1)), np.array(mx.argmin(sample, axis=1))])
    h = hashlib.sha256()
    h.update(f"{_layers(model)}:{shape}".encode())
    h.update(arg.astype(np.int64).tobytes())
    return h.hexdigest()[:16]


def model_signature(model: nn.Module) -> dict[str, Any]:
    """A quantization-tolerant signature of a model (JSON-serialisable).

    ``{"layers": int, "shape": [vocab, hidden], "projections": [ROWS *
    PROJECTIONS floats]}``: the :data:`ROWS` evenly spaced rows of the input
    embedding (dequantized, float32), each projected onto :data:`PROJECTIONS`
    fixed pseudo-random +-1 directions (seed 0), 5 significant digits.

    Raises:
        UnsupportedModelError: the model keeps no token embedding under the
            names mlx-lm uses (:func:`~mlx_mtp.families.model_parts`).
    """
    sample, shape = _sample(model)
    proj = np.random.default_rng(0).choice([-1.0, 1.0], size=(shape[1], PROJECTIONS))
    values = np.array(sample, dtype=np.float64) @ proj
    return {
        "layers": _layers(model),
        "shape": list(shape),
        "projections": [float(f"{v:.5g}") for v in values.ravel()],
    }


def signature_cosine(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Cosine similarity of two signatures' projections; -1.0 when the layer
    count or embedding shape differ (or a signature is malformed)."""
    try:
        if a["layers"] != b["layers"] or list(a["shape"]) != list(b["shape"]):
            return -1.0
        x = np.asarray(a["projections"], dtype=np.float64)
        y = np.asarray(b["projections"], dtype=np.float64)
        if x.shape != y.shape or not x.size:
            return -1.0
        return float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y) + 1e-30))
    except (KeyError, TypeError, ValueError):
        return -1.0


def same_model(
    model: nn.Module, fingerprint: str | None, signature: dict[str, Any] | None = None
) -> bool:
    """Whether an artifact stamped with ``fingerprint`` (and, for artifacts
    written since signatures exist, ``signature``) was made for ``model``.

    True when the fingerprints are equal, or when the signatures' cosine
    similarity is at least :data:`MIN_COSINE` (the same weights at another
    precision, e.g. heads trained on bf16 used with the 4-bit model).
    """
    if fingerprint is not None and fingerprint == model_fingerprint(model):
        return True
    if not isinstance(signature, dict):
        return False
    return signature_cosine(signature, model_signature(model)) >= MIN_COSINE
