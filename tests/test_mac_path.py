"""What a new Mac user meets first (issue 36), checked on this machine: the
wired memory limit entered before the prefill, and the native MTP layer in the
backbone's compute dtype.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mlx_mtp import decoding
from mlx_mtp.context import Context
from mlx_mtp.engine import Engine
from mlx_mtp.methods.ntp import NTP
from mlx_mtp.testing import decode, make_tiny_model, write_tiny_hybrid

REPO_ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------- wired memory
def test_wired_limit_is_entered_before_the_prefill_and_left_after_a_failed_one(monkeypatch):
    """mlx-lm wires the model's memory before the prompt's prefill; so does
    the decoding loop, and it restores the limit when the prefill fails."""
    events: list[str] = []

    @contextlib.contextmanager
    def recording_wired_limit(model, streams=None):
        events.append("wire")
        try:
            yield
        finally:
            events.append("unwire")

    monkeypatch.setattr(decoding, "wired_limit", recording_wired_limit)
    engine = Engine(make_tiny_model("llama"))
    real_sync = engine.sync

    def sync(tokens, *args, **kwargs):
        events.append("prefill")
        return real_sync(tokens, *args, **kwargs)

    engine.sync = sync
    method = NTP()
    method.prepare(Context(engine))
    out, _ = decode(engine, method, [1, 2, 3, 4, 5], 3)
    assert len(out) == 3
    assert events == ["wire", "prefill", "unwire"]

    def failing_sync(tokens, *args, **kwargs):
        events.append("prefill")
        raise RuntimeError("prefill failed")

    events.clear()
    engine.sync = failing_sync
    with pytest.raises(RuntimeError, match="prefill failed"):
        decode(engine, method, [1, 2, 3], 2)
    assert events == ["wire", "prefill", "unwire"]


# ------------------------------------------------------- native MTP dtype
def _quantize_backbone(model: nn.Module, dtype: mx.Dtype) -> None:
    """``model`` in ``dtype`` with every layer whose input width allows it
    quantized to 4 bits (group 32), as an mlx-community checkpoint."""
    model.set_dtype(dtype)
    nn.quantize(
        model,
        group_size=32,
        bits=4,
        class_predicate=lambda p, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0,
    )
    mx.eval(model.parameters())


def test_native_mtp_layer_computes_in_the_quantized_backbones_dtype(tmp_path):
    """On a bfloat16 4-bit backbone the MTP layer is bfloat16 (not a float32
    copy: half the memory, no upcast of every draft) and agrees with the
    float32 layer to bfloat16 precision; a float32 backbone keeps float32."""
    from mlx_lm.utils import load_model

    from mlx_mtp.native_mtp import compute_dtype, load_native_mtp

    config = write_tiny_hybrid(tmp_path, "qwen3_5", seed=4)
    model32, _ = load_model(tmp_path)
    layer32 = load_native_mtp(tmp_path, model32, config)
    assert compute_dtype(model32) == mx.float32
    assert layer32.fc.weight.dtype == mx.float32

    qmodel, _ = load_model(tmp_path)
    _quantize_backbone(qmodel, mx.bfloat16)
    assert not mx.issubdtype(qmodel.model.embed_tokens.weight.dtype, mx.floating)
    assert compute_dtype(qmodel) == mx.bfloat16
    layer = load_native_mtp(tmp_path, qmodel, config)
    dtypes = {v.dtype for _, v in tree_flatten(layer.parameters())}
    assert dtypes == {mx.bfloat16}, dtypes

    mx.random.seed(0)
    h = mx.random.normal((1, 3, 64))
    e = Engine(model32).embed_tokens([4, 5, 6])[None]
    got = layer(h.astype(mx.bfloat16), e.astype(mx.bfloat16), layer.make_cache())
    ref = layer32(h, e, layer32.make_cache())
    assert got.dtype == mx.bfloat16
    err = float(mx.max(mx.abs(got.astype(mx.float32) - ref))) / float(mx.max(mx.abs(ref)))
    assert err < 3e-2, err
