"""GGUF importer round trips for llama (incl. Llama-3 RoPE scaling), qwen2,
qwen3 and gemma3 with ggml types MLX cannot load (Q4_K, Q6_K, Q5_0) next to
F16/Q8_0, and SentencePiece vocabularies (Gemma, Llama-2 / Mistral style).

Each small GGUF is written with the ``gguf`` package the way llama.cpp's
``convert_hf_to_gguf.py`` writes it: from weights in Hugging Face layout, with
the Q/K rows of llama permuted (``LlamaModel.permute``) and those of qwen2/qwen3
left as they are. The reference is mlx-lm's own model for that architecture
built directly from the Hugging Face layout of the same (quantized, then
dequantized) weights, so a wrong RoPE layout, a lost bias or norm, a wrong
scaling or a transposed tensor shows up as a logits mismatch.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import assert_refused
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, RopeScalingType
from gguf.quants import dequantize, quantize
from mlx.utils import tree_flatten
from mlx_mtp.converters.gguf import COMPLETE_MARKER, GGUFImportError, convert_gguf

from mlx_mtp.loading import load_model

# K-quants need rows of 256 values, so the model is a little wider than
# test_gguf.py's: hidden 256, 4 heads of 64, 2 KV heads.
HIDDEN, LAYERS, HEADS, KV_HEADS, FF, VOCAB = 256, 2, 4, 2, 512, 128
HEAD_DIM = HIDDEN // HEADS
LLAMA3 = {  # Llama 3.1's rope_scaling
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
TOKENS = [int(t) for t in np.random.default_rng(7).integers(4, VOCAB, 48)]


def _vocab() -> tuple[list[str], list[str], list[int]]:
    base = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "Ġ"]
    base += [chr(c) for c in range(33, 127)]
    merges = ["h e", "l l", "he ll", "Ġ w", "o r"]
    tokens = base + [m.replace(" ", "") for m in merges]
    tokens += [f"<pad{i}>" for i in range(len(tokens), VOCAB)]
    types = [3, 3, 3] + [1] * (len(base) + len(merges) - 3) + [4] * (VOCAB - len(base) - 5)
    return tokens, merges, types


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py ``LlamaModel.permute`` (HF -> GGUF rows)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _kquant_blocks(qt: Q, rows: int, cols: int, rng) -> np.ndarray:
    """Random but well-formed Q4_K/Q6_K super-blocks (the ``gguf`` package has
    no quantizer for K-quants): random quants and sub-block scales, small f16
    super-block scales so the values stay near +-0.3."""
    nb = cols // 256
    if qt == Q.Q4_K:  # d f16, dmin f16, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
        blocks = rng.integers(0, 256, (rows, nb, 144), dtype=np.uint8)
        blocks[..., 0:2] = np.frombuffer(np.float16(0.0006).tobytes(), np.uint8)
        blocks[..., 2:4] = np.frombuffer(np.float16(0.0003).tobytes(), np.uint8)
    elif qt == Q.Q6_K:  # ql 128, qh 64, 16 int8 scales, d f16
        blocks = rng.integers(0, 256, (rows, nb, 210), dtype=np.uint8)
        blocks[..., 208:210] = np.frombuffer(np.float16(0.00008).tobytes(), np.uint8)
    else:
        raise AssertionError(qt)
    return blocks.reshape(rows, -1)


def _add_sentencepiece(w: GGUFWriter) -> None:
    """A SentencePiece (llama) vocabulary: pieces, scores, types, and BOS 2,
    EOS 1, UNK 3."""
    tokens, scores, types = _sentencepiece_vocab()
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)


def _add_tensor(w: GGUFWriter, name: str, arr: np.ndarray, qt, rng) -> np.ndarray:
    """Write ``arr`` as tensor ``name`` of type ``qt`` (K-quants: random valid
    blocks of its shape instead); returns what a reader dequantizes."""
    if qt == Q.F32:
        w.add_tensor(name, arr)
        return arr
    if qt == Q.F16:
        w.add_tensor(name, arr.astype(np.float16))
        return arr.astype(np.float16).astype(np.float32)
    if qt in (Q.Q4_K, Q.Q6_K):
        raw = _kquant_blocks(qt, arr.shape[0], arr.shape[1], rng)
    else:
        raw = quantize(arr, qt)
    w.add_tensor(name, raw, raw_dtype=qt)
    return dequantize(raw, qt).reshape(arr.shape)


def _block_tensors(i: int, q: int, kv: int) -> tuple[str, str, dict]:
    """The HF and GGUF name prefixes of decoder block ``i`` and its attention
    and MLP weights, GGUF name -> (HF name, shape), for ``q`` query and ``kv``
    key/value features."""
    p, g = f"model.layers.{i}.", f"blk.{i}."
    return (
        p,
        g,
        {
            g + "attn_q.weight": (p + "self_attn.q_proj.weight", (q, HIDDEN)),
            g + "attn_k.weight": (p + "self_attn.k_proj.weight", (kv, HIDDEN)),
            g + "attn_v.weight": (p + "self_attn.v_proj.weight", (kv, HIDDEN)),
            g + "attn_output.weight": (p + "self_attn.o_proj.weight", (HIDDEN, q)),
            g + "ffn_gate.weight": (p + "mlp.gate_proj.weight", (FF, HIDDEN)),
            g + "ffn_up.weight": (p + "mlp.up_proj.weight", (FF, HIDDEN)),
            g + "ffn_down.weight": (p + "mlp.down_proj.weight", (HIDDEN, FF)),
        },
    )


def write_gguf(
    path: Path,
    arch: str,
    qtypes: dict[str, Q],
    *,
    tied: bool = True,
    seed: int = 0,
    merges: bool = True,
    linear_scaling: float | None = None,
    yarn: bool = False,
    llama3: dict | None = None,
    rope_base: float = 10000.0,
    sentencepiece: bool = False,
) -> dict[str, np.ndarray]:
    """Write a 2-layer GGUF of ``arch``; return the Hugging Face layout float32
    weights (mlx-lm names) that the file holds after (de)quantization.
    ``sentencepiece``: a Llama-2 / Mistral style SentencePiece vocabulary
    (``tokenizer.ggml.model = llama``) instead of byte-level BPE."""
    rng = np.random.default_rng(seed)
    tokens, merge_list, types = _vocab()
    w = GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(4096)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(rope_base)
    w.add_rope_dimension_count(HEAD_DIM)
    if arch == "qwen3":
        w.add_key_length(HEAD_DIM)
        w.add_value_length(HEAD_DIM)
    if linear_scaling is not None:
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(linear_scaling)
    if yarn:
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
    w.add_vocab_size(VOCAB)
    if sentencepiece:
        _add_sentencepiece(w)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "smollm")
        w.add_token_list(tokens)
        if merges:
            w.add_token_merges(merge_list)
        w.add_token_types(types)
        w.add_bos_token_id(0)
        w.add_eos_token_id(2)
        w.add_chat_template(
            "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
        )

    shapes: dict[str, tuple[str, tuple[int, ...]]] = {
        "token_embd.weight": ("model.embed_tokens.weight", (VOCAB, HIDDEN)),
        "output_norm.weight": ("model.norm.weight", (HIDDEN,)),
    }
    if not tied:
        shapes["output.weight"] = ("lm_head.weight", (VOCAB, HIDDEN))
    kv = HEAD_DIM * KV_HEADS
    for i in range(LAYERS):
        p, g, block = _block_tensors(i, HIDDEN, kv)
        shapes.update(block)
        shapes[g + "attn_norm.weight"] = (p + "input_layernorm.weight", (HIDDEN,))
        shapes[g + "ffn_norm.weight"] = (p + "post_attention_layernorm.weight", (HIDDEN,))
        if arch == "qwen2":
            shapes[g + "attn_q.bias"] = (p + "self_attn.q_proj.bias", (HIDDEN,))
            shapes[g + "attn_k.bias"] = (p + "self_attn.k_proj.bias", (kv,))
            shapes[g + "attn_v.bias"] = (p + "self_attn.v_proj.bias", (kv,))
        if arch == "qwen3":
            shapes[g + "attn_q_norm.weight"] = (p + "self_attn.q_norm.weight", (HEAD_DIM,))
            shapes[g + "attn_k_norm.weight"] = (p + "self_attn.k_norm.weight", (HEAD_DIM,))

    hf: dict[str, np.ndarray] = {}
    for gname, (name, shape) in shapes.items():
        if gname.endswith("norm.weight"):
            arr = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            arr = (0.3 * rng.standard_normal(shape)).astype(np.float32)
        # llama.cpp permutes Q/K rows of llama only
        n_perm = None
        if arch == "llama" and ".attn_q." in gname:
            n_perm = HEADS
        elif arch == "llama" and ".attn_k." in gname:
            n_perm = KV_HEADS
        g_arr = _permute(arr, n_perm) if n_perm else arr
        qt = qtypes.get(gname.split(".")[-2], Q.F32) if len(shape) == 2 else Q.F32
        back = _add_tensor(w, gname, g_arr, qt, rng)
        hf[name] = _unpermute(back, n_perm) if n_perm else back.astype(np.float32)
    if llama3 is not None:
        w.add_tensor("rope_freqs.weight", _llama3_factors(llama3, rope_base))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def _llama3_factors(cfg: dict, base: float) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel (rope_type llama3): the
    per-frequency divisor written as ``rope_freqs``."""
    freqs = 1.0 / (base ** (np.arange(0, HEAD_DIM, 2, dtype=np.float32) / HEAD_DIM))
    factor, low, high = cfg["factor"], cfg["low_freq_factor"], cfg["high_freq_factor"]
    old = cfg["original_max_position_embeddings"]
    low_wl, high_wl = old / low, old / high
    out = []
    for f in freqs:
        wl = 2 * np.pi / f
        if wl < high_wl:
            out.append(1)
        elif wl > low_wl:
            out.append(factor)
        else:
            smooth = (old / wl - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def reference_logits(
    arch: str,
    hf: dict[str, np.ndarray],
    tied: bool,
    rope_scaling: dict | None = None,
    rope_base: float = 10000.0,
) -> mx.array:
    """mlx-lm's ``arch`` model built directly from Hugging Face layout weights."""
    import importlib

    mod = importlib.import_module(f"mlx_lm.models.{arch}")
    args = mod.ModelArgs.from_dict(
        {
            "model_type": arch,
            "hidden_size": HIDDEN,
            "num_hidden_layers": LAYERS,
            "intermediate_size": FF,
            "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "rms_norm_eps": 1e-6,
            "vocab_size": VOCAB,
            "rope_theta": rope_base,
            "rope_traditional": False,  # the Hugging Face layout
            "rope_scaling": rope_scaling,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": tied,
        }
    )
    model = mod.Model(args)
    model.load_weights([(k, mx.array(v)) for k, v in hf.items()], strict=True)
    return model(mx.array(TOKENS)[None])[0]


def _rel_err(got: mx.array, ref: mx.array) -> float:
    return float(mx.abs(got - ref).max() / mx.abs(ref).max())


def _imported_logits(out: Path) -> mx.array:
    lm = load_model(str(out), dtype="float32")
    return lm.model(mx.array(TOKENS)[None])[0]


MIXED = {"attn_q": Q.Q4_K, "attn_k": Q.Q5_0, "attn_v": Q.Q8_0, "attn_output": Q.F16}
MIXED2 = {"ffn_down": Q.Q6_K, "ffn_gate": Q.Q4_K, "ffn_up": Q.Q5_0, "token_embd": Q.Q8_0}


@pytest.mark.parametrize(
    "arch,qtypes,tied",
    [
        ("llama", {**MIXED, **MIXED2}, True),
        ("llama", {"attn_q": Q.Q6_K, "attn_k": Q.Q4_K, "output": Q.Q5_0}, False),
        ("qwen2", {**MIXED, **MIXED2, "output": Q.Q6_K}, False),
        ("qwen2", {"attn_q": Q.Q5_0, "attn_k": Q.Q6_K, "ffn_down": Q.F16}, True),
        ("qwen3", {**MIXED, **MIXED2}, True),
        ("qwen3", {"attn_k": Q.Q4_K, "attn_q": Q.Q8_0, "output": Q.Q4_K}, False),
    ],
    ids=["llama-tied", "llama-untied", "qwen2-untied", "qwen2-tied", "qwen3-tied", "qwen3-untied"],
)
def test_round_trip_matches_mlx_lm_model_of_same_weights(tmp_path, arch, qtypes, tied):
    gguf_path = tmp_path / "m.gguf"
    hf = write_gguf(gguf_path, arch, qtypes, tied=tied)
    out = convert_gguf(gguf_path, tmp_path / "model", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == arch
    assert config["tie_word_embeddings"] is tied
    assert config["rope_traditional"] is (arch == "llama")
    ref = reference_logits(arch, hf, tied)
    got = _imported_logits(out)
    assert _rel_err(got, ref) < 1e-4, _rel_err(got, ref)
    # the other RoPE layout would give other logits: the check above has teeth
    if arch == "llama":
        config["rope_traditional"] = False
        (out / "config.json").write_text(json.dumps(config))
        assert _rel_err(_imported_logits(out), ref) > 1e-2


def test_float16_storage_and_requantization(tmp_path):
    gguf_path = tmp_path / "m.gguf"
    hf = write_gguf(gguf_path, "qwen2", {**MIXED, **MIXED2}, tied=True)
    # default storage: float16 (the reference holds the same float16 values)
    out = convert_gguf(gguf_path, tmp_path / "f16")
    st = mx.load(str(out / "model.safetensors"))
    assert st["model.layers.0.self_attn.q_proj.weight"].dtype == mx.float16
    hf16 = {k: v.astype(np.float16).astype(np.float32) for k, v in hf.items()}
    ref16 = reference_logits("qwen2", hf16, True)
    assert _rel_err(_imported_logits(out), ref16) < 1e-4
    # --quantize 8: MLX affine 8-bit (group 64); each weight within one step of
    # its group's range (the random test model is too chaotic for a logits bound)
    out8 = convert_gguf(gguf_path, tmp_path / "q8", quantize=8)
    cfg = json.loads((out8 / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 64, "bits": 8}
    st = mx.load(str(out8 / "model.safetensors"))
    assert st["model.layers.0.mlp.down_proj.weight"].dtype == mx.uint32
    assert "model.layers.0.input_layernorm.scales" not in st
    params = dict(tree_flatten(load_model(str(out8), dtype="float32").model.parameters()))
    for name, want in hf16.items():
        got = np.array(params[name])
        if name.endswith("norm.weight") or name.endswith(".bias"):
            assert np.array_equal(got, want), name
            continue
        groups = want.reshape(want.shape[0], -1, 64)
        step = (groups.max(-1) - groups.min(-1)) / 255
        err = np.abs(got - want).reshape(groups.shape).max(-1)
        assert (err <= step).all(), name  # MLX rounds scale/bias to float16
        assert not np.array_equal(got, want), name
    with pytest.raises(GGUFImportError, match="quantize must be 4 or 8"):
        convert_gguf(gguf_path, tmp_path / "q3", quantize=3)


def test_llama_linear_rope_scaling_is_mapped(tmp_path):
    gguf_path = tmp_path / "lin.gguf"
    hf = write_gguf(gguf_path, "llama", {"attn_q": Q.F16}, linear_scaling=4.0)
    out = convert_gguf(gguf_path, tmp_path / "model")
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"] == {"type": "linear", "factor": 4.0}
    got = _imported_logits(out)
    ref = reference_logits("llama", hf, True, {"type": "linear", "factor": 4.0})
    assert _rel_err(got, ref) < 1e-4
    # the unscaled model differs: dropping the scaling would be caught
    assert _rel_err(got, reference_logits("llama", hf, True)) > 1e-3


def test_llama3_rope_freqs_is_mapped(tmp_path):
    gguf_path = tmp_path / "l3.gguf"
    base = 500000.0
    hf = write_gguf(gguf_path, "llama", {"attn_k": Q.Q8_0}, llama3=LLAMA3, rope_base=base)
    out = convert_gguf(gguf_path, tmp_path / "model")
    config = json.loads((out / "config.json").read_text())
    rs = config["rope_scaling"]
    assert rs["rope_type"] == "llama3" and rs["factor"] == pytest.approx(8.0)
    assert rs["low_freq_factor"] == pytest.approx(1.0, rel=1e-3)
    assert rs["high_freq_factor"] == pytest.approx(4.0, rel=1e-3)
    assert "rope_freqs" not in json.dumps(list(mx.load(str(out / "model.safetensors"))))
    got = _imported_logits(out)
    ref = reference_logits("llama", hf, True, LLAMA3, rope_base=base)
    assert _rel_err(got, ref) < 1e-4
    assert _rel_err(got, reference_logits("llama", hf, True, rope_base=base)) > 1e-4


def test_yarn_scaling_and_missing_merges_are_refused(tmp_path):
    gguf_path = tmp_path / "y.gguf"
    write_gguf(gguf_path, "qwen2", {}, yarn=True)
    with pytest.raises(GGUFImportError, match="'yarn'"):
        convert_gguf(gguf_path, tmp_path / "out")
    gguf_path = tmp_path / "nomerges.gguf"
    write_gguf(gguf_path, "qwen2", {"attn_q": Q.Q4_K}, merges=False)
    assert_refused(gguf_path, tmp_path / "out", "tokenizer.ggml.merges")


def test_unknown_arch_is_refused(tmp_path):
    gguf_path = tmp_path / "g.gguf"
    w = GGUFWriter(str(gguf_path), "gemma2")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFImportError, match="'gemma2' is not supported"):
        convert_gguf(gguf_path, tmp_path / "out")


def test_qwen2_import_writes_complete_marker_and_tokenizer(tmp_path):
    gguf_path = tmp_path / "m.gguf"
    write_gguf(gguf_path, "qwen2", {"ffn_down": Q.Q6_K})
    out = convert_gguf(gguf_path, tmp_path / "model")
    assert json.loads((out / COMPLETE_MARKER).read_text())["dtype"] == "float16"
    tok = load_model(str(out), dtype="float32").tokenizer
    assert tok.eos_token_ids == {2}
    ids = tok.encode("hello world", add_special_tokens=False)
    assert tok._tokenizer.convert_ids_to_tokens(ids)[:1] == ["hell"]
    assert tok.decode(ids) == "hello world"


@pytest.mark.parametrize(
    "dims,base", [(4, 1e8), (16, 5e5), (64, 5e5), (128, 5e5)], ids=["0-blended", "1", "3", "6"]
)
def test_llama3_scaling_fit_for_any_number_of_blended_frequencies(dims, base):
    """Head sizes with 0, 1 or many frequencies in the blended band: the fitted
    rope_scaling reproduces every rope_freqs factor (checked inside), and a
    table that does not follow the Llama-3 formula is refused."""
    from mlx_mtp.converters.gguf import _llama3_rope_scaling

    cfg = LLAMA3
    freqs = 1.0 / base ** (np.arange(0, dims, 2) / dims)
    wl = 2 * np.pi / freqs
    old, lo, hi, f = 8192, 1.0, 4.0, 8.0
    smooth = (old / wl - lo) / (hi - lo)
    r = np.where(wl < old / hi, 1.0, np.where(wl > old / lo, f, 1 / ((1 - smooth) / f + smooth)))
    scaling = _llama3_rope_scaling(r.astype(np.float32), base, dims, 8192)
    assert scaling["rope_type"] == cfg["rope_type"] and scaling["factor"] == pytest.approx(8.0)
    assert _llama3_rope_scaling(np.ones(dims // 2, np.float32), base, dims, 8192) is None
    bad = r[::-1].copy()  # short wavelengths scaled, long ones not: not Llama-3's formula
    with pytest.raises(GGUFImportError, match="Llama-3 RoPE scaling formula"):
        _llama3_rope_scaling(bad.astype(np.float32), base, dims, 8192)


# ------------------------------------------------- gemma3 and SentencePiece
G_LAYERS, G_WINDOW = 6, 8  # Gemma 3's pattern: five sliding-window layers, then a global one


def _sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece vocabulary of VOCAB pieces as llama.cpp writes it:
    special pieces, word pieces with scores (earlier is better), two byte
    pieces (all 256 would not fit), unused pieces."""
    special = ["<pad>", "<eos>", "<bos>", "<unk>"]
    pieces = ["▁", *"helowrd", "▁h", "▁w", "he", "ll", "or", "▁he", "llo", "▁hello", "▁wor"]
    pieces += ["▁world", "ld", "hello", "<0x0A>", "<0x20>"]
    tokens = special + pieces + [f"<unused{i}>" for i in range(VOCAB - len(special) - len(pieces))]
    scores = [0.0] * len(special) + [-float(i) for i in range(len(tokens) - len(special))]
    types = [3, 3, 3, 2] + [1] * len(pieces) + [4] * (len(tokens) - len(special) - len(pieces))
    types[tokens.index("<0x0A>")] = types[tokens.index("<0x20>")] = 6  # BYTE
    return tokens, scores, types


def write_gemma3_gguf(path: Path, qtypes: dict[str, Q], seed: int = 0) -> dict[str, np.ndarray]:
    """A 6-layer gemma3 GGUF as llama.cpp's converter writes one (norm weights
    stored as ``w + 1``, no output head, SentencePiece vocabulary); returns the
    Hugging Face layout float32 weights it holds."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "gemma3")
    w.add_block_count(G_LAYERS)
    w.add_context_length(4096)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_sliding_window(G_WINDOW)
    _add_sentencepiece(w)
    w.add_tokenizer_pre("default")
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    shapes = {
        "token_embd.weight": ("model.embed_tokens.weight", (VOCAB, HIDDEN)),
        "output_norm.weight": ("model.norm.weight", (HIDDEN,)),
    }
    q, kv = HEAD_DIM * HEADS, HEAD_DIM * KV_HEADS
    for i in range(G_LAYERS):
        p, g, block = _block_tensors(i, q, kv)
        shapes.update(block)
        shapes.update(
            {
                g + "attn_q_norm.weight": (p + "self_attn.q_norm.weight", (HEAD_DIM,)),
                g + "attn_k_norm.weight": (p + "self_attn.k_norm.weight", (HEAD_DIM,)),
                g + "attn_norm.weight": (p + "input_layernorm.weight", (HIDDEN,)),
                g + "post_attention_norm.weight": (
                    p + "post_attention_layernorm.weight",
                    (HIDDEN,),
                ),
                g + "ffn_norm.weight": (p + "pre_feedforward_layernorm.weight", (HIDDEN,)),
                g + "post_ffw_norm.weight": (p + "post_feedforward_layernorm.weight", (HIDDEN,)),
            }
        )
    hf: dict[str, np.ndarray] = {}
    for gname, (name, shape) in shapes.items():
        if gname.endswith("norm.weight"):  # Gemma's zero-centred norm, stored as w + 1
            arr = (0.3 * rng.standard_normal(shape)).astype(np.float32)
            w.add_tensor(gname, arr + 1.0)
            hf[name] = (arr + 1.0) - 1.0
            continue
        arr = (0.3 * rng.standard_normal(shape)).astype(np.float32)
        qt = qtypes.get(gname.split(".")[-2], Q.F32)
        hf[name] = _add_tensor(w, gname, arr, qt, rng).astype(np.float32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def test_gemma3_round_trip_matches_mlx_lm_model_of_same_weights(tmp_path):
    """gemma3: config (window, pattern, query scale, local RoPE base), the four
    norms per block with llama.cpp's +1 removed, QK norms, tied head; logits
    over 48 tokens (past the 8-token window) equal mlx-lm's gemma3_text built
    from the Hugging Face layout of the same weights."""
    from mlx_lm.models import gemma3_text

    gguf_path = tmp_path / "g.gguf"
    hf = write_gemma3_gguf(gguf_path, {**MIXED, **MIXED2})
    out = convert_gguf(gguf_path, tmp_path / "model", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["tie_word_embeddings"] is True
    assert config["sliding_window"] == G_WINDOW and config["sliding_window_pattern"] == 6
    assert config["query_pre_attn_scalar"] == HEAD_DIM
    assert config["rope_local_base_freq"] == 10000.0 and config["rope_theta"] == 1e6
    args = gemma3_text.ModelArgs.from_dict({**config, "model_type": "gemma3_text"})
    ref_model = gemma3_text.Model(args)
    ref_model.load_weights(
        [(k, mx.array(v)) for k, v in ref_model.sanitize(dict(hf)).items()], strict=True
    )
    ref = ref_model(mx.array(TOKENS)[None])[0]
    got = _imported_logits(out)
    assert _rel_err(got, ref) < 1e-4, _rel_err(got, ref)
    # keeping llama.cpp's +1 on the norms would give other logits
    shifted = {k: (v + 1.0 if k.endswith("norm.weight") else v) for k, v in hf.items()}
    ref_model.load_weights([(k, mx.array(v)) for k, v in shifted.items()], strict=True)
    assert _rel_err(ref_model(mx.array(TOKENS)[None])[0], got) > 1e-2


def test_sentencepiece_tokenizer_is_built_from_the_vocabulary(tmp_path):
    """A SentencePiece (``tokenizer.ggml.model = llama``) vocabulary becomes a
    fast tokenizer through transformers' GGUF builders: merges recovered from
    the vocabulary, BOS added as the file says, byte pieces, round trips."""
    gguf_path = tmp_path / "g.gguf"
    write_gemma3_gguf(gguf_path, {})
    out = convert_gguf(gguf_path, tmp_path / "model")
    tok = load_model(str(out), dtype="float32").tokenizer
    assert tok.eos_token_ids == {1}
    ids = tok.encode("hello world")
    assert ids[0] == 2  # BOS: tokenizer.ggml.add_bos_token
    pieces = tok._tokenizer.convert_ids_to_tokens(ids[1:])
    assert pieces == ["hello", "▁world"], pieces
    assert tok.decode(ids[1:]) == "hello world"
    text = "hello\nworld"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["add_bos_token"] is True and "chat_template" not in cfg


def test_llama2_style_sentencepiece_tokenizer(tmp_path):
    """A llama GGUF with a Llama-2 / Mistral style SentencePiece vocabulary (no
    add_space_prefix key: the first word gets its ``▁``, BOS by default)."""
    gguf_path = tmp_path / "l.gguf"
    write_gguf(gguf_path, "llama", {"attn_q": Q.Q8_0}, sentencepiece=True)
    out = convert_gguf(gguf_path, tmp_path / "model")
    tok = load_model(str(out), dtype="float32").tokenizer
    ids = tok.encode("hello world")
    assert ids[0] == 2
    assert tok._tokenizer.convert_ids_to_tokens(ids[1:]) == ["▁hello", "▁world"]
    assert tok.decode(ids, skip_special_tokens=True) == "hello world"
    assert tok.eos_token_ids == {1}
