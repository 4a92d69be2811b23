"""Import a GGUF file (llama, qwen2, qwen3, gemma3) into an MLX model folder.

The output folder is what ``mlx_lm.load`` opens: ``model.safetensors``,
``config.json``, ``tokenizer.json``, ``tokenizer_config.json`` (with the chat
template, if the file has one) and ``generation_config.json``.

Architectures (``general.architecture``):

- ``llama`` (Llama 1-3, SmolLM, Mistral-style). llama.cpp's converter permutes
  the Q and K rows of these models into the interleaved ("traditional") RoPE
  layout, so the config records ``rope_traditional: true`` instead of permuting
  them back. Llama-3 RoPE scaling (the ``rope_freqs`` tensor) becomes mlx-lm's
  ``rope_scaling = {"rope_type": "llama3", ...}``; ``{arch}.rope.scaling.type =
  linear`` becomes ``{"type": "linear", "factor": f}``.
- ``qwen2`` (Qwen2/2.5: biases on q/k/v) and ``qwen3`` (``attn_q_norm`` /
  ``attn_k_norm``). llama.cpp does not permute these (it runs them with NEOX
  RoPE), so ``rope_traditional: false``.
- ``gemma3`` (Gemma 3 text models: mlx-lm's ``gemma3_text``): QK norms, four
  norms per block, five sliding-window layers (``{arch}.attention.sliding_window``,
  local RoPE base 10000) per global one, as llama.cpp runs them. llama.cpp's
  converter stores Gemma's zero-centred norm weights as ``w + 1``; the importer
  subtracts the 1 again (mlx-lm's Gemma norms scale by ``1 + w``). The query
  scale is ``head_dim ** -0.5`` except for the 62-layer 27B model, whose
  ``query_pre_attn_scalar`` is ``hidden / heads`` (llama.cpp's rule).

Tied (no ``output.weight``) and untied output heads are both imported.

Tensor types: when every tensor is one ``mx.load`` reads (F32, F16, Q4_0, Q4_1,
Q8_0), the file is loaded by MLX itself and quantized tensors stay quantized in
MLX's affine layout (group size 32). Any other ggml type (K-quants Q2_K..Q6_K,
Q5_0/Q5_1, IQ types, BF16, ...) makes the importer read every tensor with the
``gguf`` package and dequantize it with ``gguf.quants.dequantize`` (llama.cpp's
reference dequantizer ported to numpy); the weights are then stored as
``dtype`` (float16 by default) or, with ``quantize=4|8``, re-quantized with
``mx.quantize`` (affine, group size 64).

Tokenizers: ``tokenizer.ggml.model = gpt2`` (byte-level BPE, which must carry
``tokenizer.ggml.merges``) is written here from the vocabulary and merges;
``llama`` (SentencePiece: Llama-2, Mistral, Gemma) is built by transformers'
GGUF tokenizer builders from the same metadata (vocabulary, scores, token
types; merges recovered from the vocabulary, Gemma's respelled spaces) and
saved as a fast tokenizer, with the file's BOS/EOS settings. Anything else is
refused with :class:`GGUFImportError` before a single byte is written.

The conversion is atomic (:func:`mlx_mtp.artifacts.atomic_folder`): it writes
into a temporary sibling folder and moves it into place only once every file
is complete, so an interrupted or failed conversion (a full disk: ``OSError``)
never leaves a folder that later loads as a model.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_mtp.artifacts import atomic_folder
from mlx_mtp.errors import MTPError

#: GGML tensor types that ``mx.load`` reads (quantized ones map to MLX affine
#: quantization with group size 32).
NATIVE_TENSOR_TYPES = {"F32", "F16", "Q4_0", "Q4_1", "Q8_0"}
# Every other type is dequantized with ``gguf.quants.dequantize``; the exact
# set is whatever that version of the ``gguf`` package implements
# (:func:`_dequantizable`).
SUPPORTED_ARCHITECTURES = {"llama", "qwen2", "qwen3", "gemma3"}
#: Bits accepted by ``quantize`` (re-quantization with ``mx.quantize``).
QUANTIZE_BITS = (4, 8)
QUANTIZE_GROUP_SIZE = 64

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
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",  # qwen3
}
#: Gemma 3 blocks: a norm before and after attention and the MLP each
_GEMMA3_LAYER_MAP = {
    **{k: v for k, v in _LAYER_MAP.items() if k != "ffn_norm"},
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
#: Per-layer tensor names (GGUF -> mlx-lm) each architecture may hold (others
#: are refused).
_ARCH_PARTS = {
    "llama": {k: v for k, v in _LAYER_MAP.items() if not k.endswith(("q_norm", "k_norm"))},
    "qwen2": {k: v for k, v in _LAYER_MAP.items() if not k.endswith(("q_norm", "k_norm"))},
    "qwen3": dict(_LAYER_MAP),
    "gemma3": _GEMMA3_LAYER_MAP,
}
_MODEL_TYPES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}
#: Architectures whose norm weights llama.cpp's converter stores as ``w + 1``
_NORM_PLUS_ONE = {"gemma3"}
#: Gemma 3 as llama.cpp runs it: RoPE base of the sliding-window layers and
#: the layer pattern (every 6th layer global), neither of which the file stores
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_SLIDING_PATTERN = 6
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


def _dequantizable() -> set[str]:
    """ggml type names ``gguf.quants.dequantize`` implements in this install."""
    import gguf.quants

    traits = getattr(gguf.quants, "_type_traits", {})
    return {"F32", "F16"} | {t.name for t in traits}


def inspect_gguf(path: str | Path) -> dict[str, Any]:
    """Read a GGUF header and check that it can be imported.

    Args:
        path: path to a ``.gguf`` file.

    Returns:
        ``{"architecture": str, "tensor_types": {name: type}, "reader": GGUFReader,
        "native": bool}``; ``native`` is true when ``mx.load`` reads every tensor.

    Raises:
        GGUFImportError: the file is missing, not a GGUF file, has another
            architecture, or holds a tensor type neither MLX nor the ``gguf``
            package can read.
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
    readable = _dequantizable() | NATIVE_TENSOR_TYPES
    bad = {n: t for n, t in types.items() if t not in readable}
    if bad:
        kinds = sorted(set(bad.values()))
        example = next(iter(bad))
        raise GGUFImportError(
            f"{path.name}: tensor type(s) {', '.join(kinds)} cannot be imported (e.g. "
            f"{example!r}); supported: {', '.join(sorted(readable))}. Re-quantize the GGUF "
            "to one of these or load the original Hugging Face model."
        )
    native = all(t in NATIVE_TENSOR_TYPES for t in types.values())
    return {"architecture": arch, "tensor_types": types, "reader": reader, "native": native}


def _llama3_rope_scaling(
    factors: np.ndarray, base: float, dims: int, old_ctx: int
) -> dict[str, Any] | None:
    """mlx-lm's ``llama3`` rope_scaling that reproduces llama.cpp's ``rope_freqs``.

    llama.cpp's converter stores, per frequency ``i`` of a head of ``dims``, the
    factor its RoPE divides the angle by (Llama 3.1, ``rope_type: llama3``): 1
    for short wavelengths, ``factor`` for long ones and a smooth blend between.
    The file does not keep ``low_freq_factor``/``high_freq_factor``; only
    their ratio to ``original_max_position_embeddings`` matters, so with
    ``old_ctx`` fixed they are solved from the blended entries, and the result
    is checked by recomputing every factor.

    Returns:
        The ``rope_scaling`` dict, or None when every factor is 1.

    Raises:
        GGUFImportError: the factors do not follow the Llama-3 formula.
    """
    r = np.asarray(factors, np.float64).reshape(-1)
    if r.size != dims // 2:
        raise GGUFImportError(
            f"rope_freqs has {r.size} entries but the head has {dims // 2} frequencies."
        )
    if np.allclose(r, 1.0, rtol=0, atol=1e-6):
        return None
    factor = float(r.max())
    wl = 2 * np.pi * base ** (np.arange(0, dims, 2) / dims)
    tol = 1e-4 * factor
    is_hi, is_lo = np.abs(r - 1) < tol, np.abs(r - factor) < tol
    mid = ~(is_hi | is_lo)
    s = (1 / r - 1 / factor) / (1 - 1 / factor)  # smooth factor of the blended ones
    x = old_ctx / wl  # smooth = (x - low) / (high - low)
    if mid.sum() >= 2:
        slope, icpt = np.polyfit(x[mid], s[mid], 1)
        high_minus_low = 1 / slope
        low = -icpt * high_minus_low
        high = low + high_minus_low
    else:
        # too few blended entries to solve: put the thresholds between the
        # neighbouring wavelengths so that each entry falls on its side
        x_hi = x[is_hi].min() if is_hi.any() else x.max() * 2
        x_lo = x[is_lo].max() if is_lo.any() else x.min() / 2
        if mid.sum() == 1:
            xm, sm = float(x[mid][0]), float(s[mid][0])
            high = float(np.sqrt(xm * x_hi))
            low = (xm - sm * high) / (1 - sm)
        else:
            high = low = float(np.sqrt(x_hi * x_lo))
            high, low = high * (1 + 1e-6), low * (1 - 1e-6)
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": float(low),
        "high_freq_factor": float(high),
        "original_max_position_embeddings": int(old_ctx),
    }
    # recompute mlx-lm's formula (rope_utils.Llama3RoPE) and compare
    lo_wl, hi_wl = old_ctx / low, old_ctx / high
    smooth = (old_ctx / wl - low) / (high - low)
    got = np.where(wl > lo_wl, factor, 1.0)
    medium = (wl > hi_wl) & (wl < lo_wl)
    got = np.where(medium, 1 / ((1 - smooth) / factor + smooth), got)
    if not np.allclose(got, r, rtol=1e-4, atol=0):
        raise GGUFImportError(
            "rope_freqs does not follow the Llama-3 RoPE scaling formula (max relative "
            f"error {float(np.max(np.abs(got / r - 1))):.2e}); load the Hugging Face repo "
            "of this model instead."
        )
    return scaling


def _rope_scaling(
    reader: Any, arch: str, rope_freqs: np.ndarray | None, dims: int, base: float, name: str
) -> dict[str, Any] | None:
    """mlx-lm ``rope_scaling`` from the GGUF's RoPE metadata (None: unscaled).

    Raises:
        GGUFImportError: a scaling type mlx-lm cannot reproduce (e.g. yarn), or
            both ``rope_freqs`` and a metadata scaling type.
    """
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if factor is None:  # older files: rope.scale_linear
        factor = _field(reader, f"{arch}.rope.scale_linear")
        if factor is not None and kind is None:
            kind = "linear"
    old_ctx = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if rope_freqs is not None:
        if kind not in (None, "none"):
            raise GGUFImportError(
                f"{name}: both a rope_freqs tensor and rope.scaling.type={kind!r}; the "
                "importer cannot tell which one llama.cpp would apply."
            )
        return _llama3_rope_scaling(rope_freqs, base, dims, int(old_ctx or 8192))
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return {"type": "linear", "factor": float(factor)}
    raise GGUFImportError(
        f"{name}: RoPE scaling type {kind!r} (factor {factor}) is not supported by the "
        "GGUF importer (supported: linear, Llama-3 rope_freqs); load the model's Hugging "
        "Face repo instead."
    )


def _config(
    reader: Any,
    arch: str,
    has_output: bool,
) -> dict[str, Any]:
    def meta(key: str, default: Any = None) -> Any:
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise GGUFImportError(f"GGUF metadata key '{arch}.{key}' is missing.")
        return value

    n_heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    n_tokens = _array_len(reader, "tokenizer.ggml.tokens")
    model_type, hf_arch = _MODEL_TYPES[arch]
    head_dim = int(meta("attention.key_length", meta("rope.dimension_count", hidden // n_heads)))
    config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [hf_arch],
        "hidden_size": hidden,
        "num_hidden_layers": int(meta("block_count")),
        "intermediate_size": int(meta("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon")),
        "vocab_size": int(meta("vocab_size", n_tokens)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        # llama.cpp permutes Q/K of llama-style models only (see module doc)
        "rope_traditional": arch == "llama",
        "max_position_embeddings": int(meta("context_length", 2048)),
        "tie_word_embeddings": not has_output,
    }
    if arch == "qwen2" and head_dim != hidden // n_heads:
        raise GGUFImportError(
            f"qwen2 GGUF with head_dim {head_dim} != hidden/heads {hidden // n_heads}; "
            "mlx-lm's qwen2 model cannot hold it."
        )
    if arch == "gemma3":
        del config["rope_traditional"]  # NEOX RoPE, mlx-lm's gemma3_text default
        layers = config["num_hidden_layers"]
        config.update(
            {
                "sliding_window": int(meta("attention.sliding_window")),
                "sliding_window_pattern": int(
                    _field(reader, f"{arch}.attention.sliding_window_pattern")
                    or GEMMA3_SLIDING_PATTERN
                ),
                "rope_local_base_freq": float(
                    _field(reader, f"{arch}.rope.freq_base_swa") or GEMMA3_LOCAL_ROPE_BASE
                ),
                # llama.cpp: 1/sqrt(hidden/heads) for the 62-layer 27B, else 1/sqrt(head_dim)
                "query_pre_attn_scalar": hidden // n_heads if layers == 62 else head_dim,
            }
        )
    return config


def _array(reader: Any, key: str) -> list[Any] | None:
    """An array field's values as a list (strings decoded), read straight from
    the field's parts: ``contents()`` takes seconds on a 262K-token vocabulary."""
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None:
        return None
    if field.types[-1] == GGUFValueType.STRING:
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    if not field.data:
        return []
    return np.concatenate([field.parts[i] for i in field.data]).tolist()


def _array_len(reader: Any, key: str) -> int:
    field = reader.fields.get(key)
    return 0 if field is None else len(field.data)


def _tokenizer_files(reader: Any, name: str, arch: str) -> dict[str, Any]:
    """``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json``
    of the file's tokenizer (contents as JSON values).

    Raises:
        GGUFImportError: a tokenizer model other than ``gpt2`` / ``llama``, an
            unknown pre-tokenizer, byte-level BPE without merges, or a
            SentencePiece vocabulary transformers cannot build.
    """
    model = _field(reader, "tokenizer.ggml.model")
    if model == "llama":
        files = _sentencepiece_files(reader, name, arch)
    elif model == "gpt2":
        files = _bpe_files(reader, name)
    else:
        raise GGUFImportError(
            f"{name}: tokenizer model {model!r} is not supported (byte-level BPE 'gpt2' and "
            "SentencePiece 'llama' are). Load the model's Hugging Face repo instead."
        )
    template = _field(reader, "tokenizer.chat_template")
    if template:
        files["tokenizer_config.json"]["chat_template"] = template
    gen_config = {}
    for key in ("eos", "bos"):
        idx = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if idx is not None:
            gen_config[f"{key}_token_id"] = int(idx)
    files["generation_config.json"] = gen_config
    return files


def _sentencepiece_files(reader: Any, name: str, arch: str) -> dict[str, Any]:
    """A SentencePiece vocabulary (Llama-2, Mistral, Gemma) turned into a fast
    tokenizer by transformers' GGUF tokenizer builders, saved and read back."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            add_gguf_special_tokens,
            select_tokenizer_builder,
            set_split_regex,
        )
    except ImportError as e:
        raise GGUFImportError(
            f"{name}: a SentencePiece tokenizer needs transformers' GGUF tokenizer builders "
            f"({e}); install transformers >= 5 (mlx-lm's dependency)."
        ) from e
    tokens = _array(reader, "tokenizer.ggml.tokens") or []
    td: dict[str, Any] = {"tokenizer_type": "llama", "tokens": tokens}
    for key, to in (
        ("pre", "pre_tokenizer_type"),
        ("add_space_prefix", "add_prefix_space"),
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("unknown_token_id", "unk_token_id"),
        ("padding_token_id", "pad_token_id"),
    ):
        value = _field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            td[to] = value
    for key, to in (("scores", "scores"), ("token_type", "token_type"), ("merges", "merges")):
        value = _array(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            td[to] = value
    if "scores" not in td and "merges" not in td:
        raise GGUFImportError(
            f"{name}: SentencePiece vocabulary without scores or merges; its merges cannot "
            "be recovered. Load the model's Hugging Face repo instead."
        )
    try:
        tok = select_tokenizer_builder(arch, "llama")(td)
        tok = add_gguf_special_tokens(tok, td)
        tok = set_split_regex(tok, td)
    except Exception as e:  # the builders raise ValueError/KeyError on odd vocabularies
        raise GGUFImportError(
            f"{name}: transformers could not build its SentencePiece tokenizer "
            f"({type(e).__name__}: {e}). Load the model's Hugging Face repo instead."
        ) from e
    for attr, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        idx = _field(reader, f"tokenizer.ggml.{key}")
        if idx is not None and 0 <= int(idx) < len(tokens):
            setattr(tok, attr, tokens[int(idx)])
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise
    tok.add_bos_token = bool(_field(reader, "tokenizer.ggml.add_bos_token", True))
    tok.add_eos_token = bool(_field(reader, "tokenizer.ggml.add_eos_token", False))
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        files = {
            f: json.loads((Path(tmp) / f).read_text(encoding="utf-8"))
            for f in ("tokenizer.json", "tokenizer_config.json")
        }
    files["tokenizer_config.json"].update(
        {"add_bos_token": tok.add_bos_token, "add_eos_token": tok.add_eos_token}
    )
    return files


def _bpe_files(reader: Any, name: str) -> dict[str, Any]:
    """A byte-level BPE vocabulary (``gpt2``) as a ``tokenizer.json`` written here."""
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise GGUFImportError(
            f"{name}: pre-tokenizer {pre!r} is unknown to the importer "
            f"(known: {', '.join(sorted(_PRE_TOKENIZERS))})."
        )
    tokens: list[str] = _array(reader, "tokenizer.ggml.tokens") or []
    merges: list[str] = _array(reader, "tokenizer.ggml.merges") or []
    if not merges:
        # llama.cpp's loader refuses this too: without merges byte-level BPE
        # splits every word into single bytes
        raise GGUFImportError(
            f"{name}: byte-level BPE tokenizer without 'tokenizer.ggml.merges'; the text "
            "would be split into single bytes. Re-create the GGUF with its merges (llama.cpp's "
            "convert_hf_to_gguf.py writes them) or load the Hugging Face repo instead."
        )
    types = _array(reader, "tokenizer.ggml.token_type")
    types = types if types is not None else [1] * len(tokens)

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
        # Qwen2's tokenizer normalizes to NFC before splitting
        "normalizer": {"type": "NFC"} if split == "qwen2" else None,
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
    return {"tokenizer.json": tokenizer_json, "tokenizer_config.json": tok_config}


def _map_name(name: str, arch: str = "llama") -> str | None:
    m = re.fullmatch(r"blk\.(\d+)\.([a-z_]+)\.(weight|scales|biases|bias)", name)
    if m:
        layer, part, kind = m.groups()
        if part not in _ARCH_PARTS[arch]:
            return None
        return f"model.layers.{layer}.{_ARCH_PARTS[arch][part]}.{kind}"
    m = re.fullmatch(r"([a-z_]+)\.(weight|scales|biases|bias)", name)
    if m and m.group(1) in _TOP_MAP:
        return f"{_TOP_MAP[m.group(1)]}.{m.group(2)}"
    return None


def _is_quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Linear and embedding weights (2-D ``.weight``, not norms) whose input
    dimension splits into quantization groups."""
    return (
        name.endswith(".weight")
        and len(shape) == 2
        and "norm" not in name
        and shape[1] % QUANTIZE_GROUP_SIZE == 0
    )


def _read_weights(
    info: dict[str, Any], gguf_path: Path, dtype: str, quantize: int | None
) -> tuple[dict[str, mx.array], np.ndarray | None, dict[str, Any] | None]:
    """All tensors under mlx-lm names: (weights, rope_freqs or None, quantization).

    Native files without ``quantize`` go through ``mx.load`` (quantized tensors
    stay quantized); otherwise every tensor is read with the ``gguf`` package,
    dequantized to float32 and stored as ``dtype`` or re-quantized to
    ``quantize`` bits. A tqdm bar counts tensors.
    """
    from gguf.quants import dequantize
    from tqdm import tqdm

    arch, reader = info["architecture"], info["reader"]
    weights: dict[str, mx.array] = {}
    rope_freqs = None

    def mapped_name(name: str) -> str:
        mapped = _map_name(name, arch)
        if mapped is None:
            raise GGUFImportError(
                f"{gguf_path.name}: tensor {name!r} has no counterpart in the {arch} model."
            )
        return mapped

    if info["native"] and quantize is None:
        raw = mx.load(str(gguf_path))
        for name, value in tqdm(raw.items(), desc="import gguf", unit="tensor"):
            if name == "rope_freqs.weight":
                rope_freqs = np.array(value.astype(mx.float32))
                continue
            mapped = mapped_name(name)
            if arch in _NORM_PLUS_ONE and mapped.endswith("norm.weight"):
                value = (value.astype(mx.float32) - 1.0).astype(value.dtype)
            weights[mapped] = value
        quantized = any(k.endswith(".scales") for k in weights)
        # Per-layer bits are inferred by mlx-lm from the shapes.
        return weights, rope_freqs, ({"group_size": 32, "bits": 4} if quantized else None)

    store = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}[dtype]
    for t in tqdm(reader.tensors, desc="import gguf", unit="tensor"):
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        values = dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)
        if t.name == "rope_freqs.weight":
            rope_freqs = values.astype(np.float32)
            continue
        name = mapped_name(t.name)
        if arch in _NORM_PLUS_ONE and name.endswith("norm.weight"):
            values = values.astype(np.float32) - 1.0  # llama.cpp stored w + 1
        w = mx.array(values.astype(np.float32, copy=False))
        if quantize is not None and _is_quantizable(name, shape):
            stem = name[: -len(".weight")]
            q, scales, biases = mx.quantize(
                w.astype(store), group_size=QUANTIZE_GROUP_SIZE, bits=quantize
            )
            added = {name: q, f"{stem}.scales": scales, f"{stem}.biases": biases}
        else:
            added = {name: w.astype(store)}
        mx.eval(*added.values())  # one tensor at a time keeps peak memory low
        weights.update(added)
    if quantize is None:
        return weights, rope_freqs, None
    return weights, rope_freqs, {"group_size": QUANTIZE_GROUP_SIZE, "bits": quantize}


def convert_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    *,
    overwrite: bool = False,
    dtype: str = "float16",
    quantize: int | None = None,
) -> Path:
    """Convert a llama/qwen2/qwen3/gemma3 GGUF file into an MLX model folder.

    Args:
        gguf_path: the ``.gguf`` file.
        out_dir: the folder to create. It must not exist unless ``overwrite``.
        overwrite: replace an existing ``out_dir`` (only after the new folder is
            complete; the old one is kept if conversion fails).
        dtype: ``float16`` (default), ``bfloat16`` or ``float32``: how tensors
            MLX cannot load natively are stored once dequantized (unused for
            files ``mx.load`` reads whole, whose tensors are kept as they are).
        quantize: None (keep), 4 or 8: re-quantize every linear/embedding
            weight with ``mx.quantize`` (affine, group size 64) after
            dequantizing it; norms and biases stay ``dtype``.

    Returns:
        The path of the finished folder.

    Raises:
        GGUFImportError: unsupported architecture, tensor type, RoPE scaling or
            tokenizer (including byte-level BPE without merges), an unmappable
            tensor name, or a bad ``dtype``/``quantize``.
        FileExistsError: ``out_dir`` exists and ``overwrite`` is false.
        OSError: the folder cannot be written (a full disk; nothing is left).
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype not in ("float16", "bfloat16", "float32"):
        raise GGUFImportError(f"dtype must be float16, bfloat16 or float32, not {dtype!r}.")
    if quantize is not None and quantize not in QUANTIZE_BITS:
        raise GGUFImportError(f"quantize must be 4 or 8 (bits), not {quantize!r}.")
    info = inspect_gguf(gguf_path)
    reader, arch = info["reader"], info["architecture"]
    if out_dir.exists() and not overwrite:
        raise FileExistsError(
            f"{out_dir} already exists; pass --overwrite (overwrite=True in Python) to replace it."
        )
    # everything that can be refused is checked before the weights are read
    tok_files = _tokenizer_files(reader, gguf_path.name, arch)
    weights, rope_freqs, quantization = _read_weights(info, gguf_path, dtype, quantize)
    config = _config(reader, arch, "lm_head.weight" in weights)
    scaling = _rope_scaling(
        reader, arch, rope_freqs, config["head_dim"], config["rope_theta"], gguf_path.name
    )
    if scaling is not None:
        config["rope_scaling"] = scaling
    if quantization is not None:
        config["quantization"] = quantization
    if tok_files["generation_config.json"].get("eos_token_id") is not None:
        config["eos_token_id"] = tok_files["generation_config.json"]["eos_token_id"]

    with atomic_folder(out_dir) as tmp:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        files = {"config.json": config, **tok_files}
        for fname, content in files.items():
            with open(tmp / fname, "w", encoding="utf-8") as f:
                json.dump(content, f, ensure_ascii=False, indent=1)
        marker = {"source": str(gguf_path), "dtype": dtype, "quantize": quantize}
        (tmp / COMPLETE_MARKER).write_text(json.dumps(marker))
    return out_dir
