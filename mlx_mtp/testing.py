"""Small random models for tests where only shapes and plumbing matter."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

#: mlx-lm model families with a tiny config each
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "rope_traditional": False},
    "mistral": {"model_type": "mistral"},
    "qwen2": {"model_type": "qwen2", "tie_word_embeddings": False},
    "qwen3": {"model_type": "qwen3", "head_dim": 16, "tie_word_embeddings": True},
}


def make_tiny_model(family: str = "llama", seed: int = 0, **overrides: Any) -> nn.Module:
    """A randomly initialised mlx-lm model (float32) of ``family``.

    Defaults: hidden 64, 2 layers, 4 heads / 2 KV heads, vocab 256. Logits are
    scaled up (embedding init x 8) so greedy decoding is not a flat tie.
    """
    from mlx_lm.utils import _get_classes

    config: dict[str, Any] = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": 256,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "max_position_embeddings": 4096,
    }
    config.update(TINY_CONFIGS[family])
    config.update(overrides)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    emb = model.model.embed_tokens
    emb.weight = emb.weight * 8
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model
