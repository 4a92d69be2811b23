"""Small random models for tests where only shapes and plumbing matter: a
tiny config of every mlx-lm family (:data:`FAMILY_CONFIGS`), and writers of
tiny checkpoints in the Hugging Face layout of public ones (hybrid Qwen3-Next
/ Qwen3.5 with an ``mtp.*`` layer, DeepSeek-V3 with its nextn layer)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.deepseek_v3 import DeepseekV3DecoderLayer
from mlx_lm.utils import _get_classes

from mlx_mtp.native_mtp import NativeMTPLayer

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
    """A randomly initialised mlx-lm model (float32) of ``family``: built from
    :func:`tiny_config` for the families of :data:`TINY_CONFIGS`, else from
    :func:`family_config` (any mlx-lm model type of :data:`FAMILY_CONFIGS`);
    ``overrides`` go into the config.

    Logits are scaled up (token embedding x 8) so greedy decoding is not a
    flat tie.
    """
    from mlx_mtp.errors import UnsupportedModelError
    from mlx_mtp.families import model_parts

    if family in TINY_CONFIGS:
        config = tiny_config(family, **overrides)
    else:
        config = {**family_config(family), **overrides}
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    try:
        emb = model_parts(model)[2]
        emb.weight = emb.weight * 8
    except UnsupportedModelError:  # no token embedding to find (a chain-only family)
        pass
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


#: the attention shapes of the per-family tiny models: 4 query heads of 64
#: dimensions over 2 KV heads (grouped), hidden 256, two layers unless the
#: family's layer pattern needs more, a 16-token sliding window, small MoE
#: and MLA sizes; each entry applies where the family's config has the field
FAMILY_SHAPES: dict[str, Any] = {
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 256,
    "rms_norm_eps": 1e-5,
    "layer_norm_eps": 1e-5,
    "norm_eps": 1e-5,
    "layer_norm_epsilon": 1e-5,
    "norm_epsilon": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "sliding_window": 16,
    "attention_bias": False,
    "mlp_bias": False,
    "use_bias": False,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "n_routed_experts": 4,
    "moe_intermediate_size": 128,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "shared_expert_intermediate_size": 128,
    "norm_topk_prob": True,
    "first_k_dense_replace": 1,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 32,
    "qk_nope_head_dim": 32,
    "v_head_dim": 64,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "partial_rotary_factor": 1.0,
    # other spellings of the same sizes
    "n_embd": 256,
    "d_model": 256,
    "model_dim": 256,
    "hidden_dim": 256,
    "n_layer": 2,
    "n_layers": 2,
    "num_layers": 2,
    "num_transformer_layers": 2,
    "n_head": 4,
    "n_heads": 4,
    "num_heads": 4,
    "num_query_heads": 4,
    "n_kv_heads": 2,
    "num_kv_heads": 2,
    "n_positions": 4096,
    "n_ctx": 4096,
    "block_size": 4096,
    "n_inner": 512,
    "ffn_hidden_size": 512,
    "expert_ffn_hidden_size": 128,
    "num_local_experts": 4,
    "moe_num_experts": 4,
    "rotary_dim": 32,
    "num_vocab": 256,
    "num_attention_groups": 2,
    "ff_intermediate_size": 512,
    "kv_channels": 64,
    "hidden_size_per_head": 64,
    "moe_topk": 2,
    "swa_head_dim": 64,
    "swa_v_head_dim": 64,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "index_head_dim": 32,
    "index_n_heads": 2,
    "index_topk": 8,
    "sliding_window_size": 16,
    "window_size": 16,
    "attention_window_size": 16,
    "loop_window_size": 16,
    "vocab_size_per_layer_input": 256,
    "hidden_size_per_layer_input": 64,
    "global_head_dim": 64,
    "intermediate_size_mlp": 512,
}

_SLIDING = ["sliding_attention", "full_attention"]
_ROPE4 = {"rope_type": "default", "rope_theta": 10000.0}
_LLAMA4_SCALING = {
    "rope_theta": 10000.0,
    "llama_4_scaling_beta": 0.1,
    "original_max_position_embeddings": 4096,
    "rope_type": "default",
}
_KIMI_LINEAR = {
    "linear_attn_config": {
        "kda_layers": [1],
        "full_attn_layers": [2],
        "head_dim": 64,
        "num_heads": 4,
        "short_conv_kernel_size": 4,
    },
    "model_max_length": 4096,
}
_LFM2 = {
    "layer_types": ["conv", "full_attention"],
    "block_dim": 256,
    "block_multiple_of": 64,
    "block_ffn_dim_multiplier": 1.0,
    "block_auto_adjust_ff_dim": False,
    "conv_L_cache": 3,
}
_QWEN3_NEXT = {
    "num_hidden_layers": 4,
    "full_attention_interval": 2,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "partial_rotary_factor": 0.5,
}
_MAMBA2 = {"time_step_limit": (0.0, float("inf")), "n_groups": 1, "conv_kernel": 4}

#: per model type: what a tiny model of that family needs besides
#: FAMILY_SHAPES: its real layer pattern (Gemma 3's five sliding-window
#: layers per global one, NoPE layers, KV-sharing layers), its required
#: fields, and for vision-language wrappers the text model (``"text:"`` + its
#: model type, then that family's entries and the ones given)
FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "Klear": {},
    "afm7": {"num_layers": 3, "num_kv_reuse_layers": 1},
    "afmoe": {"layer_types": _SLIDING, "num_dense_layers": 1, "mup_enabled": False},
    "apertus": {},
    "baichuan_m1": {"sliding_window_layers": [0], "conv_window": 2},
    "bailing_hybrid": {},
    "bailing_moe": {},
    "bailing_moe_linear": {},
    "bailing_moe_v3": {},
    "bitnet": {},
    "cohere": {},
    "cohere2": {"num_hidden_layers": 4, "sliding_window_pattern": 4},
    "dbrx": {
        "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
        "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
    },
    "deepseek": {},
    "deepseek_v2": {
        "rope_scaling": {
            "type": "yarn",
            "factor": 1.0,
            "mscale_all_dim": 0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1,
        },
    },
    "deepseek_v3": {},
    "deepseek_v32": {},
    "deepseek_v41": {},
    "dots1": {},
    "ernie4_5": {"use_bias": False},
    "ernie4_5_moe": {"use_bias": False},
    "exaone": {},
    "exaone4": {"num_hidden_layers": 4, "sliding_window_pattern": "LLLG", "rope_scaling": None},
    "exaone_moe": {"layer_types": _SLIDING, "is_moe_layer": [False, True]},
    "falcon_h1": {},
    "gear": {"layer_types": ["conv_mixer", "full_attention"]},
    "gemma": {"head_dim": 256, "num_key_value_heads": 1},
    "gemma2": {"head_dim": 256, "num_key_value_heads": 2, "query_pre_attn_scalar": 256},
    "gemma3": {"text": "gemma3_text"},
    "gemma3_text": {
        "num_hidden_layers": 6,
        "sliding_window_pattern": 6,
        "head_dim": 256,
        "num_key_value_heads": 1,
        "query_pre_attn_scalar": 256,
    },
    "gemma3n": {
        "text_config": {
            "model_type": "gemma3n_text",
            "hidden_size": 256,
            "num_hidden_layers": 5,
            "intermediate_size": [512] * 5,
            "num_attention_heads": 4,
            "head_dim": 64,
            "rms_norm_eps": 1e-6,
            "vocab_size": 256,
            "num_key_value_heads": 2,
            "num_kv_shared_layers": 0,
            "vocab_size_per_layer_input": 256,
            "sliding_window": 16,
            "max_position_embeddings": 4096,
            "rope_local_base_freq": 10000.0,
            "rope_theta": 1000000.0,
            "final_logit_softcapping": 30.0,
            "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
            "activation_sparsity_pattern": [0.0] * 5,
            "hidden_size_per_layer_input": 64,
            "altup_num_inputs": 4,
            "altup_coef_clip": 120.0,
            "altup_correct_scale": True,
            "altup_active_idx": 0,
            "laurel_rank": 16,
        }
    },
    "gemma4": {"text": "gemma4_text"},
    "gemma4_text": {
        # Gemma 4's layout: four sliding layers per global one, the last layers
        # reading the keys and values of earlier ones
        "num_hidden_layers": 10,
        "num_kv_shared_layers": 4,
        "sliding_window_pattern": 5,
        "head_dim": 128,
        "global_head_dim": 256,
        "num_key_value_heads": 1,
    },
    "glm": {},
    "glm4": {"partial_rotary_factor": 0.5},
    "glm4_moe": {"use_qk_norm": True, "rope_scaling": None, "partial_rotary_factor": 0.5},
    "glm4_moe_lite": {},
    "glm_moe_dsa": {
        "rope_parameters": {"rope_theta": 10000.0, "type": "default"},
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "moe_layer_freq": 1,
        "num_key_value_heads": 4,
    },
    "gpt2": {},
    "gpt_bigcode": {},
    "gpt_neox": {"rotary_emb_base": 10000, "rotary_pct": 0.5},
    "gpt_oss": {"layer_types": _SLIDING},
    "gptj": {},
    "granite": {
        "logits_scaling": 2.0,
        "attention_multiplier": 0.125,
        "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5,
    },
    "granitemoe": {
        "logits_scaling": 2.0,
        "attention_multiplier": 0.125,
        "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5,
    },
    "granitemoehybrid": {
        "layer_types": ["mamba", "attention"],
        "embedding_multiplier": 1.0,
        "attention_multiplier": 0.125,
        "logits_scaling": 1.0,
        "residual_multiplier": 1.0,
        "mamba_n_heads": 8,
        "mamba_d_head": 32,
        "mamba_proj_bias": False,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_n_groups": 1,
        "mamba_conv_bias": True,
        "shared_intermediate_size": 128,
        "time_step_limit": (0.0, float("inf")),
    },
    "helium": {},
    "hunyuan": {
        "rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"},
        "num_shared_expert": 1,
        "use_mixed_mlp_moe": False,
        "use_qk_norm": True,
        "use_cla": False,
        "cla_share_factor": 1,
    },
    "hunyuan_v1_dense": {},
    "internlm2": {},
    "internlm3": {},
    "iquestloopcoder": {},
    "jamba": {
        "attn_layer_offset": 1,
        "attn_layer_period": 2,
        "expert_layer_offset": 1,
        "expert_layer_period": 2,
        "mamba_d_conv": 4,
        "mamba_d_state": 8,
        "mamba_expand": 2,
    },
    "kimi_k25": {"text": "deepseek_v3"},
    "kimi_k3": {"text": "kimi_linear", "num_experts_per_token": 2},
    "kimi_linear": _KIMI_LINEAR,
    "kimi_vl": {"text": "deepseek_v3"},
    "laguna": {},
    "lfm2": _LFM2,
    "lfm2-vl": {"text": "lfm2"},
    "lfm2_moe": {
        "layer_types": ["conv", "full_attention"],
        "num_dense_layers": 1,
        "conv_L_cache": 3,
        "use_expert_bias": True,
    },
    "lille-130m": {},
    "llama": {},
    "llama4": {
        "text": "llama4_text",
        "attention_chunk_size": 16,
        "interleave_moe_layer_step": 1,
        "rope_scaling": None,
        "num_experts_per_tok": 1,
        "attention_bias": False,
        "max_position_embeddings": 4096,
        "num_local_experts": 4,
    },
    "llama4_text": {
        # Llama 4's pattern: every 4th layer without RoPE
        "num_hidden_layers": 4,
        "no_rope_layers": [1, 1, 1, 0],
        "use_qk_norm": True,
        "interleave_moe_layer_step": 1,
        "attention_chunk_size": 16,
    },
    "longcat_flash": {
        "mla_scale_q_lora": True,
        "mla_scale_kv_lora": True,
        "attention_method": "MLA",
        "zero_expert_type": "identity",
        "zero_expert_num": 1,
    },
    "longcat_flash_ngram": {
        "mla_scale_q_lora": True,
        "mla_scale_kv_lora": True,
        "zero_expert_type": "identity",
        "zero_expert_num": 1,
    },
    "mamba": {"state_size": 16, "conv_kernel": 4, "use_conv_bias": True, "time_step_rank": 16},
    "mamba2": {**_MAMBA2, "time_step_rank": "auto", "state_size": 16, "num_heads": 8},
    "mellum": {
        "layer_types": _SLIDING,
        "rope_parameters": {"sliding_attention": _ROPE4, "full_attention": _ROPE4},
    },
    "mimo": {},
    "mimo_v2_flash": {
        "moe_layer_freq": [0, 1],
        "hybrid_layer_pattern": [1, 0],
        "add_swa_attention_sink_bias": True,
        "add_full_attention_sink_bias": False,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "swa_rope_theta": 10000.0,
        "layernorm_epsilon": 1e-5,
        "partial_rotary_factor": 0.5,
    },
    "minicpm": {"dim_model_base": 256, "scale_depth": 1.4, "scale_emb": 12},
    "minicpm3": {
        "rope_scaling": {
            "short_factor": 1.0,
            "long_factor": 1.0,
            "original_max_position_embeddings": 4096,
        },
        "dim_model_base": 256,
        "scale_depth": 1.4,
        "scale_emb": 12,
    },
    "minimax": {},
    "minimax_m3_vl": {"text": "minimax"},
    "ministral3": {"rope_parameters": _LLAMA4_SCALING, "layer_types": _SLIDING},
    "mistral3": {"text": "ministral3", "model_type": "ministral3"},
    "mistral4": {"rope_parameters": _LLAMA4_SCALING},
    "mixtral": {},
    "muse_glimmer": {},
    "muse_spark": {
        "text": "muse_glimmer",
        "post_norm_eps": 1e-5,
        "rope_parameters": _ROPE4,
        "layer_rope_theta": [10000.0, 10000.0],
        "layer_types": _SLIDING,
        "final_logit_softcapping": 30.0,
        "output_multiplier": 1.0,
        "moe_hidden_size": 128,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
    },
    "nanbeige": {},
    "nanochat": {},
    "nemotron": {"hidden_act": "relu2"},
    "nemotron-nas": {
        "block_configs": [{"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.0}}] * 2
    },
    "nemotron_h": {
        "hybrid_override_pattern": "M*",
        "num_hidden_layers": 2,
        "mamba_num_heads": 8,
        "mamba_head_dim": 32,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 1,
        "mamba_proj_bias": False,
        "use_conv_bias": True,
    },
    "olmo2": {},
    "olmo3": {"layer_types": _SLIDING},
    "olmo_hybrid": {
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "linear_allow_neg_eigval": False,
    },
    "olmoe": {},
    "openelm": {
        "num_query_heads": [4, 4],
        "num_kv_heads": [2, 2],
        "ffn_multipliers": [1.0, 1.0],
        "ffn_dim_divisor": 64,
    },
    "phi": {},
    "phi3": {"partial_rotary_factor": 0.75},
    "phi3small": {
        "dense_attention_every_n_layers": 2,
        "gegelu_limit": 20.0,
        "num_key_value_heads": 2,
    },
    "phimoe": {},
    "phixtral": {},
    "pixtral": {"text": "llama", "model_type": "mistral"},
    "plamo": {"n_shared_head": 2},
    "plamo2": {"mamba_d_state": 16, "mamba_num_heads": 8, "mamba_chunk_size": 16},
    "plamo3": {},
    "qwen": {},
    "qwen2": {},
    "qwen2_moe": {},
    "qwen2_vl": {"text": "qwen2"},
    "qwen3": {},
    "qwen3_5": {"text": "qwen3_next"},
    "qwen3_5_moe": {"text": "qwen3_next"},
    "qwen3_moe": {},
    "qwen3_next": _QWEN3_NEXT,
    "qwen3_vl": {"text": "qwen3"},
    "qwen3_vl_moe": {"text": "qwen3_moe"},
    "recurrent_gemma": {
        "block_types": ["recurrent", "attention"],
        "conv1d_width": 4,
        "logits_soft_cap": 30.0,
        "attention_window_size": 16,
    },
    "rwkv7": {
        "head_dim": 64,
        "a_low_rank_dim": 16,
        "v_low_rank_dim": 16,
        "gate_low_rank_dim": 16,
        "decay_low_rank_dim": 16,
    },
    "seed_oss": {},
    "smollm3": {"num_hidden_layers": 4, "no_rope_layer_interval": 4},
    "solar_open": {},
    "spark2_5": {
        "layer_types": _SLIDING,
        "rope_parameters": {"sliding_attention": _ROPE4, "full_attention": _ROPE4},
    },
    "stablelm": {"use_qkv_bias": False, "partial_rotary_factor": 0.5},
    "starcoder2": {},
    "step3p5": {
        "moe_num_experts": 4,
        "moe_top_k": 2,
        "moe_intermediate_size": 128,
        "share_expert_dim": 128,
    },
    "talkie": {},
    "telechat3": {},
    "youtu_llm": {},
}


def family_config(model_type: str) -> dict[str, Any]:
    """``config.json`` of a tiny random model of an mlx-lm model type (one of
    :data:`FAMILY_CONFIGS`): :data:`FAMILY_SHAPES` where the family's
    ``ModelArgs`` has the field, then the family's entries; required fields
    neither gives are False / 2 / 1.0 by type. A vision-language wrapper's
    ``text`` entry names the model type of its ``text_config``.

    Raises:
        KeyError: a model type without an entry.
    """
    import dataclasses
    import importlib

    from mlx_lm.utils import MODEL_REMAPPING

    entries = dict(FAMILY_CONFIGS[model_type])
    text = entries.pop("text", None)
    if text is not None:
        return {
            "model_type": model_type,
            "vocab_size": 256,
            "text_config": {**family_config(text), **entries},
        }
    module = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}")
    fields = {f.name: f for f in dataclasses.fields(module.ModelArgs)}
    config: dict[str, Any] = {"model_type": model_type}
    config.update({k: v for k, v in FAMILY_SHAPES.items() if k in fields})
    for name, f in fields.items():
        if name in config or name in entries:
            continue
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kind = str(f.type)
            filler = {"bool": False, "int": 2, "float": 1.0}
            config[name] = next((v for k, v in filler.items() if k in kind), None)
    config.update(entries)
    return config


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


def hybrid_config(family: str, **text_settings: Any) -> dict[str, Any]:
    """config.json of a tiny hybrid model of ``family`` (``qwen3_next``: MoE MLPs,
    flat; ``qwen3_5``: dense, text settings under ``text_config``);
    ``text_settings`` replace the text model's (``head_dim=64``)."""
    base = {**_HYBRID_TEXT, **text_settings}
    if family == "qwen3_next":
        return {"model_type": "qwen3_next", **base, **_NEXT_MOE}
    if family == "qwen3_5":
        text = {
            "model_type": "qwen3_5_text",
            **base,
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


def write_tiny_hybrid(
    folder: Any, family: str = "qwen3_next", seed: int = 0, **text_settings: Any
) -> dict[str, Any]:
    """Write a tiny random hybrid checkpoint, in the Hugging Face layout of the
    public Qwen3-Next / Qwen3.5 checkpoints, with a native MTP layer under
    ``mtp.*`` (zero-centred norms, per-expert tensors, conv1d as (C, 1, K)).

    Load it with ``mlx_lm.utils.load_model(folder)`` (mlx-lm's own sanitize
    runs, and drops ``mtp.*``); norms are randomised (1 + 0.2 N(0, 1)) so that
    a missing or doubled ``+1`` shows, embeddings are scaled x8 so greedy
    decoding is not a flat tie. ``text_settings`` replace the text model's
    settings (:func:`hybrid_config`).

    Returns:
        The config written to ``config.json``.
    """
    config = hybrid_config(family, **text_settings)
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
