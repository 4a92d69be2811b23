"""A short, stable fingerprint of a model's weights.

Extra weights trained for one base model (CLP heads, learned mask vectors, MTP
adapters) store the fingerprint of that model and are refused for any other.
"""

from __future__ import annotations

import hashlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np


def model_fingerprint(model: nn.Module, rows: int = 64) -> str:
    """Hex digest (16 chars) of a model's shape and its input embedding.

    Hashes the number of layers, the embedding shape, and the position of the
    largest and smallest value in ``rows`` evenly spaced embedding rows. Those
    positions survive casting to float32/bfloat16/float16 and dequantization,
    so one base model gets one fingerprint however it is loaded, while another
    model (or a fine-tune that moved the embeddings) gets a different one.

    Raises:
        AttributeError: the model has no ``model.embed_tokens``.
    """
    from .dims import dense_weight

    w = dense_weight(model.model.embed_tokens)  # a QuantizedEmbedding dequantized
    vocab = w.shape[0]
    idx = mx.array(np.linspace(0, vocab - 1, rows).astype(np.int32))
    sample = w[idx].astype(mx.float32)
    arg = np.concatenate([np.array(mx.argmax(sample, axis=1)), np.array(mx.argmin(sample, axis=1))])
    h = hashlib.sha256()
    layers = len(model.layers)
    if getattr(model.model, "pipeline_size", 1) > 1:  # pipeline-sharded: this rank's layers
        layers = int(getattr(model.args, "num_hidden_layers", layers))
    h.update(f"{layers}:{tuple(w.shape)}".encode())
    h.update(arg.astype(np.int64).tobytes())
    return h.hexdigest()[:16]
