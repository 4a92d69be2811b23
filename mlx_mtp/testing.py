"""Small random models for tests where only shapes and plumbing matter."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.deepseek_v3 import DeepseekV3DecoderLayer
from mlx_lm.utils import _get_classes

from .decoding import generate_steps
from .native_mtp import NativeMTPLayer

#: mlx-lm model families with a tiny config each
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "rope_traditional": False},
    "mistral": {"model_type": "mistral"},
    "qwen2": {"model_type": "qwen2", "tie_word_embeddings": False},
    "qwen3": {"model_type": "qwen3", "head_dim": 16, "tie_word_embeddings": True},
}


def tiny_config(family: str = "llama", **overrides: Any) -> dict[str, Any]:
    """The ``config.json`` dict of a tiny mlx-lm model of ``family`` (one of
    :data:`TINY_CONFIGS`): hidden 64, 2 layers, 4 heads / 2 KV heads, vocab
    256, then the family's entries, then ``overrides``."""
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
    return config


def make_tiny_model(family: str = "llama", seed: int = 0, **overrides: Any) -> nn.Module:
    """A randomly initialised mlx-lm model (float32) of ``family`` built from
    :func:`tiny_config` (``overrides`` go there).

    Logits are scaled up (embedding init x 8) so greedy decoding is not a flat
    tie.
    """
    config = tiny_config(family, **overrides)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    emb = model.model.embed_tokens
    emb.weight = emb.weight * 8
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


#: tiny hybrid (gated delta-net + attention) configs, as in the public checkpoints'
#: config.json (Qwen3-Next: flat; Qwen3.5: nested text_config)
_HYBRID_TEXT: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 2,
    "rms_norm_eps": 1e-6,
    "vocab_size": 256,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
_NEXT_MOE: dict[str, Any] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "shared_expert_intermediate_size": 48,
    "mlp_only_layers": [],
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
}
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5")


def hybrid_config(family: str) -> dict[str, Any]:
    """config.json of a tiny hybrid model of ``family`` (``qwen3_next``: MoE MLPs,
    flat; ``qwen3_5``: dense, text settings under ``text_config``)."""
    if family == "qwen3_next":
        return {"model_type": "qwen3_next", **_HYBRID_TEXT, **_NEXT_MOE}
    if family == "qwen3_5":
        text = {
            "model_type": "qwen3_5_text",
            **_HYBRID_TEXT,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        }
        return {"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": False}
    raise ValueError(f"no tiny hybrid config for {family!r}")


_HF_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)
_MTP_NORMS = (*_HF_NORMS, "pre_fc_norm_hidden.weight", "pre_fc_norm_embedding.weight")


def _to_hf(name: str, w: mx.array, norms: tuple[str, ...], experts: int) -> dict[str, mx.array]:
    # inverse of mlx-lm's sanitize: zero-centred norms, conv1d (C, 1, K), one
    # tensor per expert
    if name.endswith(norms) or name == "norm.weight":
        return {name: w - 1.0}
    if "conv1d.weight" in name:
        return {name: w.moveaxis(2, 1)}
    if ".switch_mlp." in name and experts:
        pre, post = name.split(".switch_mlp.")
        return {f"{pre}.experts.{e}.{post}": w[e] for e in range(experts)}
    return {name: w}


def _random_model(folder: Any, config: dict[str, Any], seed: int) -> tuple[Path, nn.Module]:
    """``(folder as a created Path, mlx-lm model of config with weights drawn
    under mx.random.seed(seed))``: the start of the tiny checkpoint writers."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    return folder, model_class(args_class.from_dict(config))


def decode(
    engine: Any, method: Any, prompt: list[int], max_tokens: int, **kwargs: Any
) -> tuple[list[int], Any]:
    """``(tokens, stats)`` of one answer: every token of
    :func:`mlx_mtp.decoding.generate_steps` (same arguments) and its final
    statistics (``DecodeStats``, None when nothing was generated)."""
    out: list[int] = []
    stats = None
    for s in generate_steps(engine, method, prompt, max_tokens=max_tokens, **kwargs):
        out += s.tokens
        stats = s.stats
    return out, stats


def assert_one_pass_equals_steps(
    layer: Any, hidden: mx.array, embeds: mx.array, atol: float
) -> None:
    """Check that an MTP layer (``layer(h, e, cache)``, :mod:`mlx_mtp.native_mtp`)
    gives the same output for ``hidden`` (1, n, D) and ``embeds`` (1, n, D) in
    one pass as fed one position at a time through its own cache (float32,
    rtol 1e-4).

    Raises:
        AssertionError: where they differ.
    """
    whole = layer(hidden, embeds, layer.make_cache())
    cache = layer.make_cache()
    n = hidden.shape[1]
    steps = mx.concatenate(
        [layer(hidden[:, i : i + 1], embeds[:, i : i + 1], cache) for i in range(n)], 1
    )
    np.testing.assert_allclose(np.array(whole), np.array(steps), rtol=1e-4, atol=atol)


def write_tiny_hybrid(folder: Any, family: str = "qwen3_next", seed: int = 0) -> dict[str, Any]:
    """Write a tiny random hybrid checkpoint, in the Hugging Face layout of the
    public Qwen3-Next / Qwen3.5 checkpoints, with a native MTP layer under
    ``mtp.*`` (zero-centred norms, per-expert tensors, conv1d as (C, 1, K)).

    Load it with ``mlx_lm.utils.load_model(folder)`` (mlx-lm's own sanitize
    runs, and drops ``mtp.*``); norms are randomised (1 + 0.2 N(0, 1)) so that
    a missing or doubled ``+1`` shows, embeddings are scaled x8 so greedy
    decoding is not a flat tie.

    Returns:
        The config written to ``config.json``.
    """
    config = hybrid_config(family)
    folder, model = _random_model(folder, config, seed)
    moe = family == "qwen3_next"
    layer = NativeMTPLayer(model, moe)
    experts = _NEXT_MOE["num_experts"] if moe else 0
    weights: dict[str, mx.array] = {}
    for part, prefix in ((model, ""), (layer, "mtp.")):
        for name, w in tree_flatten(part.parameters()):
            if name.endswith("norm.weight") and w.ndim == 1:
                w = 1.0 + 0.2 * mx.random.normal(w.shape)
            if name.endswith("embed_tokens.weight"):
                w = w * 8
            if prefix == "" and family == "qwen3_5":
                name = name.replace("language_model.model.", "model.language_model.")
                name = name.replace("language_model.lm_head.", "lm_head.")
            norms = _MTP_NORMS if prefix else _HF_NORMS
            for n, v in _to_hf(name, w, norms, experts).items():
                weights[prefix + n] = v.astype(mx.float32)
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return config


#: a tiny DeepSeek-V3: 61 backbone layers as the released checkpoints (mlx-lm's
#: sanitize drops the nextn layer by the literal name ``model.layers.61``), all
#: dense (first_k_dense_replace = 61), so the nextn layer (index 61) is the one
#: MoE block, as in DeepSeek-V3 (MLA attention, sigmoid router, shared expert)
DEEPSEEK_TINY = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 61,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
    "qk_nope_head_dim": 8,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 2,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 61,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
}


def write_tiny_deepseek(folder: Any, seed: int = 0) -> dict[str, Any]:
    """Write a tiny random DeepSeek-V3 checkpoint in the Hugging Face layout
    of the released ones, nextn layer included: ``model.layers.61.{enorm,
    hnorm, eh_proj, shared_head.norm, shared_head.head, embed_tokens}`` and a
    full decoder block (MLA with ``kv_b_proj``, per-expert MoE tensors,
    ``mlp.gate.e_score_correction_bias``, shared experts). Load it with
    ``mlx_lm.utils.load_model`` (whose sanitize drops layer 61). Norms are
    randomised (1 + 0.2 N(0, 1)), embeddings scaled x8, router weights and
    biases random so routing is not a tie.

    Returns:
        The config written to ``config.json``.
    """
    config = dict(DEEPSEEK_TINY)
    folder, model = _random_model(folder, config, seed)
    args = model.args
    n = args.num_hidden_layers
    heads, nope, vdim = args.num_attention_heads, args.qk_nope_head_dim, args.v_head_dim
    d = args.hidden_size
    nextn = {
        "enorm.weight": mx.ones((d,)),
        "hnorm.weight": mx.ones((d,)),
        "eh_proj.weight": mx.random.uniform(-1, 1, (d, 2 * d)) / (2 * d) ** 0.5,
        "shared_head.norm.weight": mx.ones((d,)),
    }
    block = DeepseekV3DecoderLayer(args, n)
    parts = [(name, w) for name, w in tree_flatten(model.parameters())]
    parts += [(f"model.layers.{n}.{k}", v) for k, v in tree_flatten(block.parameters())]
    parts += [(f"model.layers.{n}.{k}", v) for k, v in nextn.items()]
    weights: dict[str, mx.array] = {}
    for name, w in parts:
        if name.endswith(("norm.weight", "layernorm.weight")) and w.ndim == 1:
            w = 1.0 + 0.2 * mx.random.normal(w.shape)
        if name.endswith("embed_tokens.weight"):
            w = w * 8
        if name.endswith("mlp.gate.weight"):
            w = mx.random.normal(w.shape)
        if name.endswith("e_score_correction_bias"):
            w = 0.1 * mx.random.normal(w.shape)
        if ".self_attn.embed_q." in name:
            continue  # written once, as kv_b_proj, with unembed_out below
        if ".self_attn.unembed_out." in name:
            pre = name.split(".self_attn.")[0] + ".self_attn."
            r = args.kv_lora_rank
            kv_b = mx.random.uniform(-1, 1, (heads * (nope + vdim), r)) / r**0.5
            weights[pre + "kv_b_proj.weight"] = kv_b
            continue
        if ".switch_mlp." in name:
            pre, post = name.split(".switch_mlp.")
            for e in range(args.n_routed_experts):
                weights[f"{pre}.experts.{e}.{post}"] = w[e]
            continue
        weights[name] = w
    weights[f"model.layers.{n}.shared_head.head.weight"] = weights["lm_head.weight"]
    weights[f"model.layers.{n}.embed_tokens.weight"] = weights["model.embed_tokens.weight"]
    weights = {k: v.astype(mx.float32) for k, v in weights.items()}
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return config
