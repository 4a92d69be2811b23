"""Import a llama-architecture GGUF file into an MLX model folder.

The output folder is what ``mlx_lm.load`` opens: ``model.safetensors`` (quantized
tensors stay quantized in MLX's affine layout, float tensors stay float),
``config.json``, ``tokenizer.json`` (byte-level BPE built from the GGUF vocab and
merges), ``tokenizer_config.json`` (with the chat template) and
``generation_config.json``.

Supported: ``general.architecture == "llama"`` (Llama, SmolLM, Mistral-style
GGUFs), tensor types F32, F16, Q4_0, Q4_1 and Q8_0, tokenizer model ``gpt2``
(byte-level BPE). Anything else is refused with :class:`GGUFImportError` before a
single byte is written.

GGUF stores the Q and K projections in the interleaved ("traditional") RoPE
layout, so the config records ``rope_traditional: true`` instead of permuting
the weights back.

The conversion is atomic: it writes into a temporary sibling folder and renames
it into place only once every file is complete, so an interrupted conversion
never leaves a folder that later loads as a model.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_mtp.errors import MTPError

#: GGML tensor types that ``mx.load`` reads (quantized ones map to MLX affine
#: quantization with group size 32).
SUPPORTED_TENSOR_TYPES = {"F32", "F16", "Q4_0", "Q4_1", "Q8_0"}
SUPPORTED_ARCHITECTURES = {"llama"}

#: Marker written last; a folder without it is not a finished conversion.
COMPLETE_MARKER = ".mlx-mtp-complete"

_LAYER_MAP = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_MAP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# Pre-tokenizer regexes by ``tokenizer.ggml.pre`` (the split llama.cpp applies
# before byte-level BPE).
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS = {
    "default": ("gpt2", False),
    "gpt2": ("gpt2", False),
    "smollm": ("gpt2", True),  # digits split one by one, then the GPT-2 split
    "starcoder": ("gpt2", True),
    "llama-bpe": ("llama3", False),
    "llama3": ("llama3", False),
    "qwen2": ("qwen2", False),
}


class GGUFImportError(MTPError, ValueError):
    """A GGUF file this importer cannot turn into an MLX model folder."""


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def inspect_gguf(path: str | Path) -> dict[str, Any]:
    """Read a GGUF header and check that it can be imported.

    Args:
        path: path to a ``.gguf`` file.

    Returns:
        ``{"architecture": str, "tensor_types": {name: type}, "metadata": reader}``.

    Raises:
        GGUFImportError: the file is missing, not a GGUF file, has another
            architecture, or holds tensor types MLX cannot load (e.g. Q6_K).
    """
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise GGUFImportError(f"GGUF file not found: {path}")
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # the gguf reader raises ValueError/struct errors
        raise GGUFImportError(f"{path} is not a readable GGUF file ({e}).") from e
    arch = _field(reader, "general.architecture", "")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFImportError(
            f"{path.name}: GGUF architecture {arch!r} is not supported by the importer "
            f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}). Load the model "
            "from its Hugging Face repo or an MLX folder instead."
        )
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    bad = {n: t for n, t in types.items() if t not in SUPPORTED_TENSOR_TYPES}
    if bad:
        kinds = sorted(set(bad.values()))
        example = next(iter(bad))
        raise GGUFImportError(
            f"{path.name}: tensor type(s) {', '.join(kinds)} cannot be imported (e.g. "
            f"{example!r}); supported: {', '.join(sorted(SUPPORTED_TENSOR_TYPES))}. "
            "Re-quantize the GGUF to Q4_0/Q8_0 or load the original Hugging Face model."
        )
    if "rope_freqs.weight" in types:
        raise GGUFImportError(
            f"{path.name}: Llama-3 style RoPE scaling (rope_freqs) is not supported by the "
            "GGUF importer; load the Hugging Face repo of this model instead."
        )
    return {"architecture": arch, "tensor_types": types, "reader": reader}


def _config(reader: Any, arch: str, quantized: bool, has_output: bool) -> dict[str, Any]:
    def meta(key: str, default: Any = None) -> Any:
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise GGUFImportError(f"GGUF metadata key '{arch}.{key}' is missing.")
        return value

    n_heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(meta("block_count")),
        "intermediate_size": int(meta("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", n_heads)),
        "head_dim": int(meta("rope.dimension_count", hidden // n_heads)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon")),
        "vocab_size": int(meta("vocab_size", len(tokens) if tokens else 0)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "rope_traditional": True,
        "max_position_embeddings": int(meta("context_length", 2048)),
        "tie_word_embeddings": not has_output,
    }
    if quantized:
        # Per-layer bits and group size are inferred by mlx-lm from the shapes.
        config["quantization"] = {"group_size": 32, "bits": 4}
    return config


def _tokenizer_files(reader: Any, name: str) -> dict[str, Any]:
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFImportError(
            f"{name}: tokenizer model {model!r} is not supported (only byte-level BPE, "
            "'gpt2'). Load the model's Hugging Face repo instead."
        )
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise GGUFImportError(
            f"{name}: pre-tokenizer {pre!r} is unknown to the importer "
            f"(known: {', '.join(sorted(_PRE_TOKENIZERS))})."
        )
    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
    merges: list[str] = list(_field(reader, "tokenizer.ggml.merges", []))
    types = _field(reader, "tokenizer.ggml.token_type")
    types = list(types) if types is not None else [1] * len(tokens)

    split, digits = _PRE_TOKENIZERS[pre]
    pattern = {"gpt2": _GPT2_PATTERN, "llama3": _LLAMA3_PATTERN, "qwen2": _QWEN2_PATTERN}[split]
    pretok: list[dict[str, Any]] = []
    if digits:
        pretok.append({"type": "Digits", "individual_digits": True})
    pretok.append(
        {
            "type": "Split",
            "pattern": {"Regex": pattern},
            "behavior": "Isolated",
            "invert": False,
        }
    )
    pretok.append(
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    )
    control = [i for i, t in enumerate(types) if int(t) in (3, 4)]  # CONTROL, USER_DEFINED
    added = [
        {
            "id": i,
            "content": tokens[i],
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": int(types[i]) == 3,
        }
        for i in control
    ]
    tokenizer_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": pretok},
        "post_processor": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": False,
        },
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": True,
            "use_regex": False,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": merges,
        },
    }

    def token_at(key: str) -> str | None:
        idx = _field(reader, key)
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    eos_id = _field(reader, "tokenizer.ggml.eos_token_id")
    bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "bos_token": token_at("tokenizer.ggml.bos_token_id"),
        "eos_token": token_at("tokenizer.ggml.eos_token_id"),
        "unk_token": token_at("tokenizer.ggml.unknown_token_id"),
        "pad_token": token_at("tokenizer.ggml.padding_token_id"),
    }
    template = _field(reader, "tokenizer.chat_template")
    if template:
        tok_config["chat_template"] = template
    gen_config = {}
    if eos_id is not None:
        gen_config["eos_token_id"] = int(eos_id)
    if bos_id is not None:
        gen_config["bos_token_id"] = int(bos_id)
    return {
        "tokenizer.json": tokenizer_json,
        "tokenizer_config.json": tok_config,
        "generation_config.json": gen_config,
    }


def _map_name(name: str) -> str | None:
    m = re.fullmatch(r"blk\.(\d+)\.([a-z_]+)\.(weight|scales|biases|bias)", name)
    if m:
        layer, part, kind = m.groups()
        if part not in _LAYER_MAP:
            return None
        return f"model.layers.{layer}.{_LAYER_MAP[part]}.{kind}"
    m = re.fullmatch(r"([a-z_]+)\.(weight|scales|biases|bias)", name)
    if m and m.group(1) in _TOP_MAP:
        return f"{_TOP_MAP[m.group(1)]}.{m.group(2)}"
    return None


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Convert a llama-architecture GGUF file into an MLX model folder.

    Args:
        gguf_path: the ``.gguf`` file.
        out_dir: the folder to create. It must not exist unless ``overwrite``.
        overwrite: replace an existing ``out_dir`` (only after the new folder is
            complete; the old one is kept if conversion fails).

    Returns:
        The path of the finished folder.

    Raises:
        GGUFImportError: unsupported architecture, tensor type or tokenizer, or
            an unmappable tensor name.
        FileExistsError: ``out_dir`` exists and ``overwrite`` is false.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    info = inspect_gguf(gguf_path)
    reader = info["reader"]
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} already exists; pass overwrite=True to replace it.")

    weights: dict[str, mx.array] = {}
    raw = mx.load(str(gguf_path))
    for name, value in raw.items():
        mapped = _map_name(name)
        if mapped is None:
            raise GGUFImportError(
                f"{gguf_path.name}: tensor {name!r} has no counterpart in the llama model."
            )
        weights[mapped] = value
    quantized = any(k.endswith(".scales") for k in weights)
    config = _config(reader, info["architecture"], quantized, "lm_head.weight" in weights)
    tok_files = _tokenizer_files(reader, gguf_path.name)
    if tok_files["generation_config.json"].get("eos_token_id") is not None:
        config["eos_token_id"] = tok_files["generation_config.json"]["eos_token_id"]

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        files = {"config.json": config, **tok_files}
        for fname, content in files.items():
            with open(tmp / fname, "w", encoding="utf-8") as f:
                json.dump(content, f, ensure_ascii=False, indent=1)
        (tmp / COMPLETE_MARKER).write_text(json.dumps({"source": str(gguf_path)}))
        if out_dir.exists():
            backup = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.replace(out_dir, backup)
            os.replace(tmp, out_dir)
            shutil.rmtree(backup, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
