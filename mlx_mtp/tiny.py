"""A tiny random model of a given model's family, for checks whose outcome
depends on the family's code (its attention, RoPE, cache calls) and not on
its weights: ``mlx-mtp doctor`` runs the pipelined forward pass on one in
float32, where a correct pass matches the engine's other passes exactly.

The family's ``config.json`` is kept (model type, RoPE settings, norms,
biases, layer pattern fields) and its sizes are shrunk: the entries of
:data:`TINY_SIZES` replace those the config has, in the config and in a
nested ``text_config``; quantization is dropped.
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
import mlx.nn as nn

#: the sizes of a tiny model; each replaces the config's entry where it has one
TINY_SIZES: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "num_hidden_layers": 2,
    "max_position_embeddings": 4096,
}
#: config entries dropped (weights are random and in float32)
DROPPED = ("quantization", "quantization_config")


def tiny_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with the sizes of :data:`TINY_SIZES` where it has those
    entries (and in its ``text_config``), without quantization."""
    out = copy.deepcopy(config)
    for key in DROPPED:
        out.pop(key, None)

    def shrink(cfg: dict[str, Any], original: dict[str, Any]) -> None:
        for key, value in TINY_SIZES.items():
            if key in cfg:
                cfg[key] = value
        # a model with as many KV heads as query heads stays so
        heads = original.get("num_attention_heads")
        if "num_key_value_heads" in cfg and original.get("num_key_value_heads") == heads:
            cfg["num_key_value_heads"] = cfg.get("num_attention_heads", heads)

    shrink(out, config)
    if isinstance(out.get("text_config"), dict):
        shrink(out["text_config"], config["text_config"])
    return out


def config_get(config: dict[str, Any], key: str) -> Any:
    """``config[key]``, or its ``text_config``'s."""
    if key in config:
        return config[key]
    text = config.get("text_config")
    return text.get(key) if isinstance(text, dict) else None


def tiny_model_like(config: dict[str, Any], seed: int = 0) -> nn.Module:
    """A randomly initialised float32 mlx-lm model of ``config``'s family at
    the sizes of :func:`tiny_config`; token embeddings are scaled (x 8) so
    that greedy decoding is not a flat tie. Where the shrunk layer count does
    not fit the family's layer pattern, the config's own count is kept.

    Raises:
        ValueError: no tiny model of this config could be built (the error
            of the last try says why).
    """
    from mlx_lm.utils import _get_classes

    from .errors import UnsupportedModelError
    from .families import model_parts

    small = tiny_config(config)
    tries = [small]
    layers = config_get(config, "num_hidden_layers")
    if layers is not None and layers != TINY_SIZES["num_hidden_layers"]:
        keep = copy.deepcopy(small)
        for cfg in (keep, keep.get("text_config")):
            if isinstance(cfg, dict) and "num_hidden_layers" in cfg:
                cfg["num_hidden_layers"] = layers
        tries.append(keep)
    error: Exception | None = None
    for cfg in tries:
        try:
            model_class, args_class = _get_classes(cfg)
            mx.random.seed(seed)
            model = model_class(args_class.from_dict(cfg))
            model.set_dtype(mx.float32)
            try:
                emb = model_parts(model)[2]
                emb.weight = emb.weight * 8
            except UnsupportedModelError:
                pass
            mx.eval(model.parameters())
            return model
        except Exception as e:  # a config this family's code cannot take
            error = e
    raise ValueError(f"no tiny model of this family: {type(error).__name__}: {error}")
