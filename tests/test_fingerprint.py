"""Model identity across precisions: the fingerprint hash and the tolerant
signature (issue 18: artifacts trained on float/bf16 weights must be found for
the 4-bit model people run on a Mac, and refused for any other model)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from tiny_models import make_tiny_model

from mlx_mtp.fingerprint import (
    MIN_COSINE,
    model_fingerprint,
    model_signature,
    same_model,
    signature_cosine,
)


def _quantized(family="llama", seed=0, bits=4, **kw):
    m = make_tiny_model(family, seed=seed, **kw)
    nn.quantize(m, group_size=32, bits=bits)
    return m


def test_signature_tolerates_precision_and_refuses_other_models():
    f32 = make_tiny_model("llama", seed=0)
    sig = model_signature(f32)
    assert len(sig["projections"]) == 64 * 8 and sig["shape"] == [256, 64]
    bf16 = make_tiny_model("llama", seed=0)
    bf16.set_dtype(mx.bfloat16)
    q4 = _quantized(seed=0)
    assert model_fingerprint(bf16) == model_fingerprint(f32)
    assert model_fingerprint(q4) != model_fingerprint(f32)  # the hash alone would refuse it
    assert signature_cosine(sig, model_signature(q4)) > 0.98
    assert same_model(q4, model_fingerprint(f32), sig)
    assert not same_model(q4, model_fingerprint(f32), None)  # old artifacts: hash only
    other = make_tiny_model("llama", seed=7)
    assert signature_cosine(sig, model_signature(other)) < 0.3 < MIN_COSINE
    assert not same_model(other, model_fingerprint(f32), sig)
    deeper = make_tiny_model("llama", seed=0, num_hidden_layers=3)
    assert signature_cosine(sig, model_signature(deeper)) == -1.0
    for bad in ({}, {"layers": 2, "shape": [256, 64], "projections": "x"}, {"layers": 2}):
        assert signature_cosine(bad, sig) == -1.0
        assert not same_model(other, "0" * 16, bad)


def test_signature_never_dequantizes_the_whole_table():
    """Only the sampled rows are dequantized: equal to the full dequantization."""
    from mlx_mtp.fingerprint import _sample

    q4 = _quantized(seed=0, vocab_size=4096)
    emb = q4.model.embed_tokens
    full = mx.dequantize(emb.weight, emb.scales, emb.biases, group_size=32, bits=4)
    rows, shape = _sample(q4)
    assert shape == (4096, 64)
    idx = mx.array([round(i * 4095 / 63) for i in range(64)])
    assert mx.array_equal(rows, full[idx].astype(mx.float32))


@pytest.fixture(scope="module")
def smollm_4bit():
    """The embedded SmolLM2 quantized with MLX to 4 bits, group 64 (the
    mlx-community layout); its fingerprint differs from the float32 model's."""
    from mlx_mtp.loading import load_model

    m = load_model("smollm2-135m", dtype="float32").model
    nn.quantize(m, group_size=64, bits=4)
    return m


def test_shipped_artifacts_found_for_the_4bit_model(smollm, smollm_4bit):
    from mlx_mtp.clp_format import ASSETS, find_heads, load_heads
    from mlx_mtp.learned_masks import load_learned_masks
    from mlx_mtp.methods.confadapt import SHIPPED_ADAPTERS, find_mtp_source

    assert model_fingerprint(smollm_4bit) != model_fingerprint(smollm.model)
    folder = find_heads(smollm_4bit, search=[ASSETS])
    assert folder is not None and folder.name == "smollm2-135m"
    assert load_heads(folder, smollm_4bit).k >= 1
    masks = load_learned_masks(smollm_4bit)
    assert masks.shape[1] == 576
    meta, adapter = find_mtp_source(smollm_4bit, adapter=SHIPPED_ADAPTERS / "smollm2-135m-gsm8k")
    assert adapter is not None and meta.mask_token_id >= 0
