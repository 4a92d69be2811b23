"""Model dimensions and dense weights that hold for quantized models too.

A quantized layer (``nn.QuantizedEmbedding``, ``nn.QuantizedLinear``) stores
``32 / bits`` values per uint32 column, so ``layer.weight.shape[-1]`` is the
packed width, not the hidden size (docs/design.md §10). Read dimensions here.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .errors import UnsupportedModelError


def text_args(model: nn.Module) -> Any:
    """The text model's args (``TextModelArgs`` of a Qwen3.5 VL wrapper)."""
    lm = model.get("language_model") if isinstance(model, dict) else None
    return getattr(lm, "args", None) or model.args


def packed_width_factor(layer: nn.Module) -> int:
    """How many logical input columns one stored column of ``layer.weight`` holds:
    ``32 // bits`` for a quantized layer (``QuantizedEmbedding``/``QuantizedLinear``
    pack ``32 / bits`` values into one uint32), else 1."""
    bits = getattr(layer, "bits", None)
    if bits is not None and hasattr(layer, "scales"):
        return 32 // int(bits)
    return 1


def dense_weight(layer: nn.Module) -> mx.array:
    """The full-width weight of an embedding or linear layer: dequantized (in the
    scales' dtype) for a quantized layer, the weight itself otherwise. Shape
    (rows, logical columns)."""
    if packed_width_factor(layer) != 1:
        kw = {"mode": layer.mode} if getattr(layer, "mode", "affine") != "affine" else {}
        return mx.dequantize(
            layer.weight,
            layer.scales,
            getattr(layer, "biases", None),
            group_size=layer.group_size,
            bits=layer.bits,
            **kw,
        )
    return layer.weight


def model_dims(model: nn.Module) -> tuple[int, int]:
    """``(hidden_size, vocab_size)`` of an mlx-lm causal LM, whatever its weights' dtype.

    Read from the model's args (``args.hidden_size``, ``args.vocab_size``);
    where an architecture's args lack them, from the input embedding with a
    quantized layer's packing undone. Never from ``embed_tokens.weight.shape``
    alone: a ``QuantizedEmbedding``'s weight has the packed width (SmolLM2 with
    an 8-bit embedding: 144 stored columns for hidden size 576; docs/design.md §10).

    Raises:
        UnsupportedModelError: no args and no ``model.embed_tokens`` to read.
    """
    args = getattr(model, "args", None)
    hidden = getattr(args, "hidden_size", None)
    vocab = getattr(args, "vocab_size", None)
    if hidden is None or vocab is None:
        emb = getattr(getattr(model, "model", None), "embed_tokens", None)
        if emb is None:
            raise UnsupportedModelError(
                f"cannot tell the hidden size of model type "
                f"{getattr(model, 'model_type', type(model).__name__)!r}: its args have no "
                "hidden_size and it has no model.embed_tokens."
            )
        rows, cols = emb.weight.shape[0], emb.weight.shape[-1]
        hidden = hidden if hidden is not None else cols * packed_width_factor(emb)
        vocab = vocab if vocab is not None else rows
    return int(hidden), int(vocab)
