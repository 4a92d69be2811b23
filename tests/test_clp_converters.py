"""``mlx-mtp convert clp-heads``: own format, Medusa heads, MiMo native MTP layer,
on synthetic checkpoints laid out like the hub ones."""

from __future__ import annotations

import json
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx_mtp.converters.clp_import import HeadConversionError, convert, detect
from tiny_models import make_tiny_model

from mlx_mtp.clp_format import CLPHeads, base_config, load_heads, save_heads
from mlx_mtp.errors import CheckpointMismatchError
from mlx_mtp.families import model_parts

D, V = 64, 256


def _loaded(model):
    return SimpleNamespace(model=model, name="tiny")


def _np(a):
    return np.array(a.astype(mx.float32), dtype=np.float64)


def _silu(x):
    return x / (1 + np.exp(-x))


def _rms(x, w, eps=1e-5):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _close(a, b, rel=2e-2):  # float16 on disk
    a, b = np.asarray(a), np.asarray(b)
    assert np.abs(a - b).max() <= rel * np.abs(b).max(), np.abs(a - b).max()


# ----------------------------------------------------------------- own format
def test_own_format_copied_checked_and_never_overwritten(tmp_path):
    model = make_tiny_model("llama", seed=0)
    cfg = base_config(model, "tiny", 2, "resblock", bottleneck=8)
    src = save_heads(CLPHeads(cfg), tmp_path / "src")
    assert detect(src) == "clp"
    msg = convert(src, tmp_path / "dst", _loaded(model))
    assert "copied" in msg
    assert (tmp_path / "dst" / "heads.safetensors").read_bytes() == (
        src / "heads.safetensors"
    ).read_bytes()
    with pytest.raises(FileExistsError):
        convert(src, tmp_path / "dst", _loaded(model))
    with pytest.raises(CheckpointMismatchError):
        convert(src, tmp_path / "dst2", _loaded(make_tiny_model("llama", seed=5)))
    assert not (tmp_path / "dst2").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".dst2")]  # no half folder
    with pytest.raises(HeadConversionError):
        convert(tmp_path, tmp_path / "dst3", _loaded(model))


# --------------------------------------------------------------------- medusa
def _medusa_repo(tmp_path, heads=3, layers=1, d=D, v=V, seed=0):
    rng = np.random.default_rng(seed)
    w = {}
    for i in range(heads):
        for j in range(layers):
            w[f"{i}.{j}.linear.weight"] = rng.normal(0, 0.2, (d, d)).astype(np.float16)
            w[f"{i}.{j}.linear.bias"] = rng.normal(0, 0.2, (d,)).astype(np.float16)
        w[f"{i}.{layers}.weight"] = rng.normal(0, 0.2, (v, d)).astype(np.float16)
    repo = tmp_path / "medusa-repo"
    repo.mkdir()
    mx.save_safetensors(
        str(repo / "medusa_lm_head.safetensors"), {k: mx.array(a) for k, a in w.items()}
    )
    (repo / "config.json").write_text(
        json.dumps({"medusa_num_heads": heads, "medusa_num_layers": layers,
                    "base_model_name_or_path": "tiny"})
    )  # fmt: skip
    return repo, w


def test_medusa_heads_map_to_clp_heads(tmp_path):
    model = make_tiny_model("llama", seed=0)
    repo, w = _medusa_repo(tmp_path, heads=3, layers=2)
    assert detect(repo) == "medusa"
    msg = convert(repo, tmp_path / "out", _loaded(model))
    assert "3 head(s) x 2 ResBlock" in msg
    heads = load_heads(tmp_path / "out", model)
    assert heads.k == 3 and heads.config["architecture"] == "medusa"
    h = np.random.default_rng(1).normal(size=(2, D)).astype(np.float32)
    got = np.array(heads.head_logits(mx.array(h), mx.zeros((2, D)), None))
    for i in range(3):  # Medusa head i: ResBlocks then its own LM head
        x = h.astype(np.float64)
        for j in range(2):
            x = x + _silu(x @ w[f"{i}.{j}.linear.weight"].T.astype(np.float64)
                          + w[f"{i}.{j}.linear.bias"])  # fmt: skip
        _close(got[i], x @ w[f"{i}.2.weight"].T.astype(np.float64))
    # untrained span predictor keeps all k tokens
    span = mx.argmax(heads.predictor(mx.array(h)), axis=-1)
    assert np.array(span).tolist() == [3, 3]


def test_medusa_refusals(tmp_path):
    model = make_tiny_model("llama", seed=0)
    repo, _ = _medusa_repo(tmp_path, d=32)
    with pytest.raises(CheckpointMismatchError, match="hidden size 32"):
        convert(repo, tmp_path / "out", _loaded(model))
    (repo / "medusa_lm_head.safetensors").unlink()
    (repo / "medusa_lm_head.pt").write_bytes(b"pickle")
    with pytest.raises(HeadConversionError, match="pickle"):
        convert(repo, tmp_path / "out", _loaded(model))


# ----------------------------------------------------------------------- mimo
MTP_TENSORS = {
    "hidden_layernorm.weight": (D,),
    "token_layernorm.weight": (D,),
    "input_proj.weight": (D, 2 * D),
    "input_layernorm.weight": (D,),
    "self_attn.q_proj.weight": (D, D),
    "self_attn.q_proj.bias": (D,),
    "self_attn.k_proj.weight": (32, D),
    "self_attn.k_proj.bias": (32,),
    "self_attn.v_proj.weight": (32, D),
    "self_attn.v_proj.bias": (32,),
    "self_attn.o_proj.weight": (D, D),
    "post_attention_layernorm.weight": (D,),
    "mlp.gate_proj.weight": (128, D),
    "mlp.up_proj.weight": (128, D),
    "mlp.down_proj.weight": (D, 128),
    "final_layernorm.weight": (D,),
}


def _mimo_repo(tmp_path, model, seed=0):
    """A MiMo-7B-like folder: base weights in shard 1, model.mtp_layers.{0,1}.* in
    shard 2, an index, config with model_type mimo (4 heads / 2 KV heads, head 16)."""
    from mlx.utils import tree_flatten

    rng = np.random.default_rng(seed)
    repo = tmp_path / "mimo-repo"
    repo.mkdir()
    base = dict(tree_flatten(model.parameters()))
    mtp = {}
    for layer in (0, 1):
        for n, shape in MTP_TENSORS.items():
            a = rng.normal(0, 0.3, shape)
            if n.endswith("layernorm.weight"):
                a = 1 + 0.1 * a
            mtp[f"model.mtp_layers.{layer}.{n}"] = mx.array(a.astype(np.float32)).astype(
                mx.bfloat16
            )
    mx.save_safetensors(str(repo / "model-00001-of-00002.safetensors"), base)
    mx.save_safetensors(str(repo / "model-00002-of-00002.safetensors"), mtp)
    wm = {k: "model-00001-of-00002.safetensors" for k in base}
    wm.update({k: "model-00002-of-00002.safetensors" for k in mtp})
    (repo / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    a = model.args
    (repo / "config.json").write_text(json.dumps({
        "model_type": "mimo", "architectures": ["MiMoForCausalLM"], "hidden_size": D,
        "num_hidden_layers": a.num_hidden_layers, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": V, "rms_norm_eps": 1e-5,
        "num_nextn_predict_layers": 2,
    }))  # fmt: skip
    return repo, {k: _np(v) for k, v in mtp.items()}


def _mimo_reference(t, h, e, lm_w, eps=1e-5):
    """The MiMo MTP layer (HF MiMoMTPLayers) on one position, full attention math."""
    p = "model.mtp_layers.0."
    g = lambda n: t[p + n]  # noqa: E731
    hn, en = _rms(h, g("hidden_layernorm.weight"), eps), _rms(e, g("token_layernorm.weight"), eps)
    x = np.concatenate([hn, en]) @ g("input_proj.weight").T  # MiMo order: [hidden; embedding]
    y = _rms(x, g("input_layernorm.weight"), eps)
    q = (y @ g("self_attn.q_proj.weight").T + g("self_attn.q_proj.bias")).reshape(4, 16)
    k = (y @ g("self_attn.k_proj.weight").T + g("self_attn.k_proj.bias")).reshape(2, 16)
    v = (y @ g("self_attn.v_proj.weight").T + g("self_attn.v_proj.bias")).reshape(2, 16)
    heads = []
    for i in range(4):  # one key per head: softmax weight 1
        s = np.array([q[i] @ k[i // 2] / 4.0])
        w = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
        heads.append(w[0] * v[i // 2])
    x = x + np.concatenate(heads) @ g("self_attn.o_proj.weight").T
    y = _rms(x, g("post_attention_layernorm.weight"), eps)
    x = (
        x
        + (_silu(y @ g("mlp.gate_proj.weight").T) * (y @ g("mlp.up_proj.weight").T))
        @ g("mlp.down_proj.weight").T
    )
    return _rms(x, g("final_layernorm.weight"), eps) @ lm_w.T


def test_mimo_native_mtp_layer_maps_to_one_head(tmp_path):
    model = make_tiny_model("qwen2", seed=0)  # untied LM head, qkv bias like MiMo
    repo, t = _mimo_repo(tmp_path, model)
    assert detect(repo) == "mimo-mtp"
    msg = convert(repo, tmp_path / "out", _loaded(model))
    assert "dropped model.mtp_layers.1" in msg
    heads = load_heads(tmp_path / "out", model)
    assert heads.k == 1 and heads.config["architecture"] == "native-mtp"
    _, lm_head, embed = model_parts(model)
    rng = np.random.default_rng(2)
    h = rng.normal(size=(D,)).astype(np.float32)
    e = _np(embed(mx.array([7])))[0]
    got = np.array(heads.head_logits(mx.array(h)[None], mx.array(e)[None], lm_head))[0, 0]
    _close(got, _mimo_reference(t, h.astype(np.float64), e, _np(model.lm_head.weight)))


def test_mimo_for_another_model_refused(tmp_path):
    model = make_tiny_model("qwen2", seed=0)
    repo, _ = _mimo_repo(tmp_path, model)
    with pytest.raises(CheckpointMismatchError, match="embedding"):
        convert(repo, tmp_path / "out", _loaded(make_tiny_model("qwen2", seed=9)))
    with pytest.raises(CheckpointMismatchError):
        convert(repo, tmp_path / "out", _loaded(make_tiny_model("qwen2", hidden_size=32)))


def test_cli_commands_registered():
    from typer.testing import CliRunner

    from mlx_mtp.cli import app

    r = CliRunner().invoke(app, ["convert", "clp-heads", "--help"])
    assert r.exit_code == 0 and "medusa" in r.output.lower()
    r = CliRunner().invoke(app, ["train", "clp", "--help"])
    assert r.exit_code == 0 and "--data" in r.output


@pytest.mark.parametrize("source", ["medusa", "mimo-mtp"])
def test_conversion_onto_a_quantized_base(tmp_path, source):
    """convert clp-heads reads the stored 4-bit base model (issue 18: no float
    copy on a Mac); the heads load for the float and the quantized model alike
    (the fingerprint is dtype-independent)."""
    import mlx.nn as nn

    family = "llama" if source == "medusa" else "qwen2"
    model = make_tiny_model(family, seed=0)
    repo = _medusa_repo(tmp_path)[0] if source == "medusa" else _mimo_repo(tmp_path, model)[0]
    q = make_tiny_model(family, seed=0)
    nn.quantize(q, group_size=32, bits=4)
    convert(repo, tmp_path / "out", _loaded(q))
    heads = load_heads(tmp_path / "out", q)
    assert heads.config["architecture"] == ("medusa" if source == "medusa" else "native-mtp")
    assert load_heads(tmp_path / "out", model).k == heads.k
