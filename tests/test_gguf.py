"""GGUF importer: a small GGUF written here, the real embedded file, refusals,
and atomic conversion."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import assert_refused
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize
from mlx_mtp.converters.gguf import COMPLETE_MARKER, GGUFImportError, convert_gguf

from mlx_mtp.errors import ModelLoadError, ModelNotFoundError
from mlx_mtp.loading import load_model

HIDDEN, LAYERS, HEADS, KV_HEADS, FF = 64, 2, 4, 2, 128
BYTES = [chr(c) for c in range(33, 127)]  # printable ASCII as byte-level tokens


def _vocab() -> tuple[list[str], list[str], list[int]]:
    base = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "Ġ", *BYTES]
    merges = ["h e", "l l", "he ll", "Ġ w", "o r"]
    tokens = base + [m.replace(" ", "") for m in merges]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    # pad to a multiple of 32 so the embedding can be quantized
    while len(tokens) % 32:
        tokens.append(f"<pad{len(tokens)}>")
        types.append(4)
    return tokens, merges, types


def write_tiny_gguf(path: Path, qtypes: dict[str, Q], seed: int = 0) -> dict[str, np.ndarray]:
    """Write a 2-layer llama GGUF; return the float weights (HF names) the file
    holds after quantization."""
    rng = np.random.default_rng(seed)
    tokens, merges, types = _vocab()
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    )
    shapes = {
        "token_embd": (len(tokens), HIDDEN),
        "output_norm": (HIDDEN,),
    }
    for i in range(LAYERS):
        shapes.update(
            {
                f"blk.{i}.attn_q": (HIDDEN, HIDDEN),
                f"blk.{i}.attn_k": (HIDDEN * KV_HEADS // HEADS, HIDDEN),
                f"blk.{i}.attn_v": (HIDDEN * KV_HEADS // HEADS, HIDDEN),
                f"blk.{i}.attn_output": (HIDDEN, HIDDEN),
                f"blk.{i}.ffn_gate": (FF, HIDDEN),
                f"blk.{i}.ffn_up": (FF, HIDDEN),
                f"blk.{i}.ffn_down": (HIDDEN, FF),
                f"blk.{i}.attn_norm": (HIDDEN,),
                f"blk.{i}.ffn_norm": (HIDDEN,),
            }
        )
    from mlx_mtp.converters.gguf import _map_name

    floats = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            arr = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            arr = (0.3 * rng.standard_normal(shape)).astype(np.float32)
        qt = qtypes.get(name.split(".")[-1], Q.F32) if len(shape) > 1 else Q.F32
        if qt in (Q.F32, Q.F16):
            data = arr.astype(np.float16 if qt == Q.F16 else np.float32)
            w.add_tensor(f"{name}.weight", data)
            back = data.astype(np.float32)
        elif qt == Q.Q8_1:  # raw bytes of a type nothing here can read; refused before use
            w.add_tensor(
                f"{name}.weight", np.zeros((shape[0], 40 * shape[1] // 32), np.uint8), raw_dtype=qt
            )
            back = arr
        else:
            qd = quantize(arr, qt)
            w.add_tensor(f"{name}.weight", qd, raw_dtype=qt)
            back = dequantize(qd, qt).reshape(shape).astype(np.float32)
        floats[_map_name(f"{name}.weight")] = back
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return floats


def _reference_logits(floats: dict[str, np.ndarray], tokens: list[int]) -> mx.array:
    from mlx_lm.models.llama import Model, ModelArgs

    args = ModelArgs(
        model_type="llama",
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        intermediate_size=FF,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        rms_norm_eps=1e-5,
        vocab_size=floats["model.embed_tokens.weight"].shape[0],
        rope_traditional=True,
        tie_word_embeddings=True,
    )
    model = Model(args)
    model.load_weights([(k, mx.array(v)) for k, v in floats.items()])
    return model(mx.array(tokens)[None])[0]


@pytest.mark.parametrize(
    "qtypes",
    [
        {},  # all F32
        {"attn_q": Q.F16, "ffn_up": Q.F16},
        {"token_embd": Q.Q8_0, "attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "ffn_down": Q.Q8_0},
    ],
    ids=["f32", "f16", "quantized"],
)
def test_tiny_gguf_converts_and_matches_float_reference(tmp_path, qtypes):
    gguf_path = tmp_path / "tiny.gguf"
    floats = write_tiny_gguf(gguf_path, qtypes)
    out = convert_gguf(gguf_path, tmp_path / "model")
    assert (out / COMPLETE_MARKER).exists()
    config = json.loads((out / "config.json").read_text())
    assert config["rope_traditional"] is True
    assert config["num_key_value_heads"] == KV_HEADS
    assert config["tie_word_embeddings"] is True
    lm = load_model(str(out), dtype="float32")
    tokens = [5, 9, 17, 33, 60, 7]
    got = lm.model(mx.array(tokens)[None])[0]
    ref = _reference_logits(floats, tokens)
    assert mx.allclose(got, ref, atol=2e-3, rtol=1e-3).item(), float(mx.abs(got - ref).max())
    # tokenizer: special tokens and byte-level BPE merges
    tok = lm.tokenizer
    assert tok.eos_token_ids == {2}
    ids = tok.encode("hello world", add_special_tokens=False)
    assert tok.decode(ids) == "hello world"
    assert tokens_of(tok, "hell") == ["hell"]


def tokens_of(tok, text: str) -> list[str]:
    return tok._tokenizer.convert_ids_to_tokens(tok.encode(text, add_special_tokens=False))


def test_unsupported_tensor_type_is_refused_before_writing(tmp_path):
    gguf_path = tmp_path / "k.gguf"
    write_tiny_gguf(gguf_path, {"ffn_down": Q.Q8_1}, seed=1)  # no dequantizer for Q8_1
    assert_refused(gguf_path, tmp_path / "out", "Q8_1")


def test_not_a_gguf_and_missing_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(GGUFImportError, match="not a readable GGUF"):
        convert_gguf(bad, tmp_path / "o")
    with pytest.raises(GGUFImportError, match="not found"):
        convert_gguf(tmp_path / "none.gguf", tmp_path / "o")


def test_existing_output_is_not_overwritten(tmp_path):
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path, {})
    out = tmp_path / "model"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        convert_gguf(gguf_path, out)
    assert (out / "keep.txt").read_text() == "mine"


def test_interrupted_conversion_leaves_nothing_loadable(tmp_path, monkeypatch):
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path, {})
    out = tmp_path / "model"

    def boom(*a, **k):
        raise KeyboardInterrupt

    import mlx_mtp.converters.gguf as conv

    monkeypatch.setattr(conv.mx, "save_safetensors", boom)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(gguf_path, out)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [gguf_path]
    monkeypatch.undo()
    # a later run converts cleanly
    assert (convert_gguf(gguf_path, out) / COMPLETE_MARKER).exists()


def test_real_embedded_model_config_and_tokenizer(smollm):
    cfg = smollm.config
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576
    assert cfg["num_attention_heads"] == 9 and cfg["num_key_value_heads"] == 3
    assert cfg["vocab_size"] == 49152 and cfg["rope_traditional"] is True
    tok = smollm.tokenizer
    assert tok.eos_token_ids == {2}
    text = "Hello world 12345, don't stop!"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    # SmolLM splits digits one by one
    assert len(tokens_of(tok, "12345")) == 5
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>assistant\n")


def test_gguf_path_spec_and_corrupt_folder(tmp_path, smollm):
    import shutil

    # a .gguf path converts into the cache folder and loads
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path, {})
    lm = load_model(str(gguf_path), dtype="float32")
    assert lm.config["num_hidden_layers"] == LAYERS
    # a corrupt safetensors gives a clear error and leaves the source intact
    broken = tmp_path / "broken"
    shutil.copytree(smollm.path, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(ModelLoadError, match="corrupt or incomplete"):
        load_model(str(broken))
    assert (smollm.path / "model.safetensors").stat().st_size == len(data)
    with pytest.raises(ModelNotFoundError, match="No such model"):
        load_model(str(tmp_path / "missing"))
    with pytest.raises(ModelNotFoundError, match="Known aliases"):
        load_model("no-such-alias")
