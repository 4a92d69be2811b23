"""Native MTP layers (mtp.* of Qwen3.5 / Qwen3-Next checkpoints) and chain
speculation on hybrid recurrent models (issue 23).

The models are tiny random qwen3_next (MoE) and qwen3_5 (dense, VL layout)
checkpoints written in the public checkpoints' Hugging Face layout with an
``mtp.*`` layer (:func:`tiny_models.write_tiny_hybrid`), loaded through
mlx-lm's own ``load_model`` (whose sanitize drops ``mtp.*``) and this package's
loader. Float32 throughout.
"""

from __future__ import annotations

import types
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import assert_one_pass_equals_steps, decode
from tiny_models import HYBRID_FAMILIES, write_tiny_hybrid

from mlx_mtp.context import Context
from mlx_mtp.engine import Engine
from mlx_mtp.errors import ModelLoadError, UnsupportedModelError
from mlx_mtp.families import check_cache_support
from mlx_mtp.methods import make_method
from mlx_mtp.methods.base import DraftMethod
from mlx_mtp.native_mtp import find_mtp_tensors, load_native_mtp
from mlx_mtp.offers import chain_offer

N_TOKENS = 48


@pytest.fixture(scope="module", params=HYBRID_FAMILIES)
def hybrid(request, tmp_path_factory):
    """(family, model, loaded-like namespace with path and config)."""
    from mlx_lm.utils import load_model

    folder = tmp_path_factory.mktemp(request.param)
    write_tiny_hybrid(folder, request.param, seed=1)
    model, config = load_model(Path(folder))
    return request.param, model, types.SimpleNamespace(path=Path(folder), config=config)


def _engine(hybrid):
    """A context: the tiny hybrid model's engine and its checkpoint folder."""
    _, model, loaded = hybrid
    return Context(Engine(model), loaded)


def _generate(ctx, method, prompt, n=N_TOKENS, sampler=None):
    return decode(ctx, method, prompt, n, sampler=sampler)


def _method(ctx, name, **opts):
    ctx = ctx if isinstance(ctx, Context) else Context(ctx)
    m = make_method(name, **opts) if isinstance(name, str) else name
    check_cache_support(ctx.engine, m)
    m.prepare(ctx)
    return m


def _prompts(n, seed=0, vocab=256):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(4, 24))).tolist() for _ in range(n)]


# ------------------------------------------------------------ the layer
def _rms(x, w, eps):  # Qwen3-Next / 3.5 checkpoints store zero-centred norm weights
    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def _reference_logits(raw, model, h, tok, args):
    """The MTP layer at one position with an empty cache, from the raw
    checkpoint tensors (attention over one key: softmax = 1)."""
    eps, nh, hd = args.rms_norm_eps, args.num_attention_heads, args.head_dim
    nkv = args.num_key_value_heads
    w = {k[4:]: v for k, v in raw.items() if k.startswith("mtp.")}
    e = model.model.embed_tokens(mx.array([tok]))
    x = mx.concatenate(
        [
            _rms(e, w["pre_fc_norm_embedding.weight"], eps),
            _rms(h, w["pre_fc_norm_hidden.weight"], eps),
        ],
        axis=-1,
    )
    x = x @ w["fc.weight"].T
    p = "layers.0."
    y = _rms(x, w[p + "input_layernorm.weight"], eps)
    gate = (y @ w[p + "self_attn.q_proj.weight"].T).reshape(1, nh, 2 * hd)[..., hd:].reshape(1, -1)
    v = (y @ w[p + "self_attn.v_proj.weight"].T).reshape(1, nkv, hd)
    v = mx.repeat(v, nh // nkv, axis=1).reshape(1, -1)
    x = x + (v * mx.sigmoid(gate)) @ w[p + "self_attn.o_proj.weight"].T
    z = _rms(x, w[p + "post_attention_layernorm.weight"], eps)

    def mlp(q, z):
        g, u = z @ w[q + "gate_proj.weight"].T, z @ w[q + "up_proj.weight"].T
        return (g * mx.sigmoid(g) * u) @ w[q + "down_proj.weight"].T

    if p + "mlp.gate.weight" in w:  # MoE: softmax router, top-k renormalised, shared expert
        probs = mx.softmax(z @ w[p + "mlp.gate.weight"].T, axis=-1)[0]
        top = np.argsort(-np.array(probs))[: args.num_experts_per_tok]
        wt = np.array(probs)[top] / np.array(probs)[top].sum()
        out = sum(float(c) * mlp(f"{p}mlp.experts.{int(e)}.", z) for e, c in zip(top, wt))
        shared = mlp(p + "mlp.shared_expert.", z)
        out = out + mx.sigmoid(z @ w[p + "mlp.shared_expert_gate.weight"].T) * shared
    else:
        out = mlp(p + "mlp.", z)
    x = x + out
    return _rms(x, w["norm.weight"], eps) @ raw["lm_head.weight"].T


def test_mtp_weights_survive_loading_and_match_a_reference(hybrid):
    from mlx.utils import tree_flatten

    family, model, loaded = hybrid
    assert not any("mtp" in k for k, _ in tree_flatten(model.parameters()))  # mlx-lm drops them
    found = find_mtp_tensors(loaded.path)
    assert "fc.weight" in found and "layers.0.self_attn.q_proj.weight" in found
    layer = load_native_mtp(loaded.path, model, loaded.config)
    raw = mx.load(str(loaded.path / "model.safetensors"))
    from mlx_mtp.native_mtp import text_args

    args = text_args(model)
    engine = Engine(model)
    mx.random.seed(3)
    for tok in (0, 17, 255):
        h = mx.random.normal((1, args.hidden_size))
        got = engine.lm_head(layer(h[None], engine.embed_tokens([tok])[None], layer.make_cache()))[
            0
        ]
        ref = _reference_logits(raw, model, h, tok, args)
        np.testing.assert_allclose(np.array(got), np.array(ref), rtol=1e-4, atol=1e-4)
    # several positions in one pass == one at a time through the layer's KV cache
    hs = mx.random.normal((1, 5, args.hidden_size))
    es = engine.embed_tokens([3, 9, 27, 81, 243])[None]
    assert_one_pass_equals_steps(layer, hs, es, atol=1e-5)


def test_convert_clp_heads_writes_the_layer_and_mtp_loads_it(hybrid, tmp_path):
    from mlx_mtp.converters.clp_import import convert

    from mlx_mtp.clp_format import find_heads, load_heads

    family, model, loaded = hybrid
    src = types.SimpleNamespace(model=model, name=f"tiny-{family}")
    summary = convert(loaded.path, tmp_path / "heads", src)
    assert "native-mtp-layer" in summary
    direct = load_native_mtp(loaded.path, model, loaded.config)
    folder = load_native_mtp(tmp_path / "heads", model)
    engine = Engine(model)
    h = mx.random.normal((1, 3, direct.fc.weight.shape[0]))
    e = engine.embed_tokens([1, 2, 3])[None]
    a = direct(h, e, direct.make_cache())
    b = folder(h, e, folder.make_cache())
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)
    # the CLP method neither picks it up nor loads it as CLP heads
    assert find_heads(model, [tmp_path]) is None
    with pytest.raises(ModelLoadError, match="--method mtp"):
        load_heads(tmp_path / "heads", model)
    # --method mtp with heads=FOLDER decodes exactly
    eng = _engine(hybrid)
    m = _method(eng, "mtp", depth=2, heads=str(tmp_path / "heads"))
    ntp = _method(eng, "ntp")
    p = [9, 8, 7, 6]
    assert _generate(eng, m, p, 16)[0] == _generate(eng, ntp, p, 16)[0]


def test_checkpoint_without_mtp_tensors_is_refused(hybrid, tmp_path):
    _, model, loaded = hybrid
    raw = mx.load(str(loaded.path / "model.safetensors"))
    mx.save_safetensors(
        str(tmp_path / "model.safetensors"), {k: v for k, v in raw.items() if "mtp." not in k}
    )
    with pytest.raises(ModelLoadError, match="no mtp"):
        load_native_mtp(tmp_path, model, {})
    ctx = Context(Engine(model), types.SimpleNamespace(path=tmp_path, config={}))
    with pytest.raises(ModelLoadError, match="no mtp"):
        _method(ctx, "mtp")


# ------------------------------------------------------ chain speculation
class OracleChain(DraftMethod):
    """Drafts the true greedy continuation with one corrupted token at a random
    depth on most steps: accepted lengths 0..k, so partial accepts (and the
    recurrent-state restore) happen at every depth."""

    name = "oracle"
    chain_shaped = True

    def __init__(self, reference: list[int], k: int = 4, seed: int = 0):
        self.reference, self.k = reference, k
        self.rng = np.random.default_rng(seed)

    def propose(self, ctx, root):
        p = ctx.engine.offset  # root sits at position p
        d = list(self.reference[p + 1 : p + 1 + self.k])
        if d and self.rng.random() < 0.75:
            j = int(self.rng.integers(0, len(d)))
            d[j] = (d[j] + 1) % 256
        return chain_offer(root, d, "oracle", ctx.acceptance)


def _exact_sweep(hybrid, prompts, pre_norm=False):
    engine = _engine(hybrid)
    ntp = _method(engine, "ntp")
    methods = {"mtp": _method(engine, "mtp", depth=3), "pld": _method(engine, "pld")}
    if hybrid[0] == "qwen3_5":  # mlx-lm's qwen3_next takes no input embeddings (mask slots)
        methods["chain-probe"] = _method(engine, "probe", shape="chain", masks=2)
    if pre_norm:
        methods["mtp1"] = _method(engine, "mtp", depth=1, hidden_state="pre-norm")
    rewinds = partial = 0
    for i, prompt in enumerate(prompts):
        ref, _ = _generate(engine, ntp, prompt)
        for name, m in methods.items():
            out, _ = _generate(engine, m, prompt)
            assert out == ref, (name, i)
        oracle = _method(engine, OracleChain(prompt + ref, seed=i))
        before = engine.engine.rollback.rewinds
        out, stats = _generate(engine, oracle, prompt)
        assert out == ref, ("oracle", i)
        rewinds += engine.engine.rollback.rewinds - before
        partial += sum(1 for n in stats.accept_lengths if 1 < n < oracle.k + 1)
    return rewinds, partial


def test_chain_methods_equal_ntp_on_hybrid_models(hybrid):
    rewinds, partial = _exact_sweep(hybrid, _prompts(2, seed=11))
    assert rewinds > 10 and partial > 5  # the restore ran, after partial accepts


@pytest.mark.slow
def test_chain_methods_equal_ntp_on_hybrid_models_full_sweep(hybrid):
    _exact_sweep(hybrid, _prompts(30, seed=12), pre_norm=True)


def test_multi_turn_reuses_the_cache_on_hybrid_models(hybrid):
    engine = _engine(hybrid)
    mtp = _method(engine, "mtp", depth=2, hidden_state="pre-norm")
    first = _prompts(1, seed=5)[0]
    out1, _ = _generate(engine, mtp, first, 12)
    out2, _ = _generate(engine, mtp, first + out1 + [7, 8], 12)
    ref_engine = _engine(hybrid)
    ntp = _method(ref_engine, "ntp")
    assert out2 == _generate(ref_engine, ntp, first + out1 + [7, 8], 12)[0]


def _chi_square(hybrid, n, temp=0.25):
    """Chi-square: the 2nd generated token at T=temp (drawn after the MTP layer's
    draft was verified) against its exact marginal under the backbone."""
    from mlx_mtp.sampling import PositionalSampler

    _, model, _ = hybrid
    engine = _engine(hybrid)
    mtp = _method(engine, "mtp", depth=2)
    prompt = [5, 77, 140, 3, 9]
    # exact: p(t2) = sum_t1 p(t1) p(t2 | t1), t1 over the whole vocabulary
    p1 = mx.softmax(model(mx.array([prompt]))[0, -1] / temp, axis=-1)
    batch = mx.array([prompt + [t] for t in range(256)])
    p2 = mx.softmax(model(batch)[:, -1] / temp, axis=-1)
    exact = np.array(p1 @ p2, dtype=np.float64)
    counts = np.zeros(256)
    for seed in range(n):
        out, _ = _generate(engine, mtp, prompt, 2, sampler=PositionalSampler(temp, seed=seed))
        counts[out[1]] += 1
    assert mtp.depth_drafted[0] > 0
    big = exact * n >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(exact[big], exact[~big].sum()) * n
    assert big.sum() >= 2
    chi2, dof = float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1
    assert chi2 < dof + 3.1 * (2 * dof) ** 0.5 + 7  # ~ p > 0.001 (normal approximation)


@pytest.mark.slow
def test_mtp_sampling_keeps_the_target_distribution_slow(hybrid):
    """The MTP layer's chains at T=0.25 (the CI suite proves sampling once, for
    every method, through the shared verification on a hybrid model's chains:
    tests/test_speculative.py)."""
    _chi_square(hybrid, 600)


def test_branching_tree_on_a_hybrid_model_is_refused(hybrid):
    engine = _engine(hybrid).engine
    with pytest.raises(UnsupportedModelError, match="recurrent"):
        check_cache_support(engine, make_method("probe"))
    engine.sync([1, 2, 3])
    emb = engine.embed_tokens([3, 4, 5])
    with pytest.raises(UnsupportedModelError, match="branching draft tree"):
        engine.forward_tree(emb, np.array([-1, 0, 0]), [3, 4, 5])
    if hybrid[0] == "qwen3_next":  # mlx-lm's qwen3_next takes no input embeddings
        with pytest.raises(UnsupportedModelError, match="input embeddings"):
            engine.forward_tree(emb, np.array([-1, 0, 1]), [3, 4, 5])
        return
    # a chain-shaped tree runs, and a prefix of it can be kept
    logits, _ = engine.forward_tree(emb, np.array([-1, 0, 1]), [3, 4, 5])
    engine.keep(3, [0])
    assert engine.offset == 4 and logits.shape[0] == 3


def test_quantized_mtp_tensors_load_quantized_or_dequantized(tmp_path):
    """An MLX-quantized qwen3_5 checkpoint that kept its mtp.* tensors: the
    layer is quantized like the backbone, or dequantized when the backbone is."""
    import json

    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import dequantize_model, load_model

    src = tmp_path / "hf"
    config = write_tiny_hybrid(src, "qwen3_5", seed=2)
    model, _ = load_model(src)
    layer = load_native_mtp(src, model, config)
    q = {"group_size": 32, "bits": 4}
    nn.quantize(model, **q)
    nn.quantize(layer, **q)
    weights = dict(tree_flatten(model.parameters()))
    weights.update({f"mtp.{k}": v for k, v in tree_flatten(layer.parameters())})
    out = tmp_path / "q4"
    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps({**config, "quantization": q}))

    qmodel, qconfig = load_model(out)  # mlx-lm quantizes the backbone, drops mtp.*
    qlayer = load_native_mtp(out, qmodel, qconfig)
    assert isinstance(qlayer.fc, nn.QuantizedLinear)
    dmodel = dequantize_model(load_model(out)[0])
    dlayer = load_native_mtp(out, dmodel, qconfig)
    assert type(dlayer.fc) is nn.Linear
    h = mx.random.normal((1, 2, 64))
    e = Engine(dmodel).embed_tokens([4, 5])[None]
    a = qlayer(h, e, qlayer.make_cache())
    b = dlayer(h, e, dlayer.make_cache())
    c = layer(h, e, layer.make_cache())  # the in-memory quantized original
    np.testing.assert_allclose(np.array(a), np.array(c), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(b), np.array(c), rtol=1e-3, atol=1e-3)


def test_public_api_finds_the_mtp_layer_in_the_model_folder(hybrid, smollm):
    """``MTPModel`` (what ``--model FOLDER --method mtp`` builds) reads mtp.* from
    the loaded model's own folder."""
    from mlx_mtp.api import MTPModel
    from mlx_mtp.loading import LoadedModel

    family, model, loaded = hybrid
    lm = LoadedModel(model, smollm.tokenizer, loaded.path, loaded.config, family, "float32")
    prompt = [11, 22, 33, 44, 55]
    got = MTPModel(lm, make_method("mtp", depth=2)).generate(prompt, max_tokens=12)
    ref = MTPModel(lm, make_method("ntp")).generate(prompt, max_tokens=12)
    assert got.tokens == ref.tokens and got.stats.drafted > 0


def test_chain_probe_on_an_attention_model_equals_ntp():
    from tiny_models import make_tiny_model

    engine = Engine(make_tiny_model("llama", seed=4))
    probe = _method(engine, "probe", shape="chain", masks=2)
    ntp = _method(engine, "ntp")
    assert probe.block_complexity == 5 and "chain" in probe.describe()
    for prompt in _prompts(2, seed=8):
        assert _generate(engine, probe, prompt, 24)[0] == _generate(engine, ntp, prompt, 24)[0]


# ------------------------------------------- depth=auto and chain-probe budget
def test_mtp_auto_depth_follows_the_cost_curve(hybrid):
    """Issue 22's auto for ``mtp`` and ``probe shape=chain``: a flat (memory-bound)
    curve drafts the deepest chains, a steep one runs plain one-token steps;
    exact vs ntp either way."""
    from mlx_mtp.budget import CostCurve

    prompt = _prompts(1, seed=21)[0]
    flat, steep = CostCurve.flat(knee=16, slope=0.003), CostCurve.linear(1.0)
    engine = _engine(hybrid)
    ntp = _method(engine, "ntp")
    ref, _ = _generate(engine, ntp, prompt, 24)
    engine.curves = flat
    deep = _method(engine, "mtp", max_depth=6, draft_cost=0)
    assert deep.auto and "auto<=6" in deep.describe()
    out, stats = _generate(engine, deep, prompt, 24)
    assert out == ref and stats.drafted > 0
    assert deep.lengths and all(n == 6 for n in deep.lengths)  # every step a 6-deep chain
    engine.curves = steep  # a draft slot costs a whole forward: nothing pays
    plain = _method(engine, "mtp")  # depth=auto is the default
    assert plain.auto and plain.draft_cost > 0
    out, stats = _generate(engine, plain, prompt, 24)
    assert out == ref and stats.drafted == 0 and stats.plain_steps >= 20
    if hybrid[0] == "qwen3_5":  # chain-shaped probe (qwen3_next takes no input embeddings)
        engine.curves = flat
        probe = _method(engine, "probe", shape="chain", masks=2)
        out, stats = _generate(engine, probe, prompt, 24)
        assert out == ref and stats.drafted > 0 and stats.plain_steps == 0
        engine.curves = steep
        probe = _method(engine, "probe", shape="chain", masks=2)
        out, stats = _generate(engine, probe, prompt, 24)
        assert out == ref and stats.drafted == 0 and stats.plain_steps >= 20


def test_mtp_auto_policy_counts_the_draft_cost():
    """The MTP layer's own pass is part of a draft's price: a depth that pays
    when drafts are free stops paying when each costs 0.4 of a forward."""
    from mlx_mtp.acceptance import chain_values
    from mlx_mtp.budget import CostCurve, best_prefix

    gpu = CostCurve.flat(knee=16, slope=0.003)
    values = chain_values([0.8] * 8)
    assert best_prefix(gpu, values, 1)[0] == 8
    n, rate = best_prefix(gpu, values, 1, item_cost=0.1)
    assert 2 <= n < 8 and rate == pytest.approx((1 + sum(values[:n])) / (1 + 0.1 * n))
    assert best_prefix(gpu, chain_values([0.3] * 8), 1, item_cost=0.4)[0] == 0


# --------------------------------------------------- mtp inside hybrid
def test_hybrid_drafts_from_the_mtp_layer_as_a_chain_on_hybrid_models(hybrid, tmp_path):
    """``hybrid`` on a recurrent model runs chain-shaped (shape=auto), takes
    the native MTP layer as one more source, and stays exact vs ntp (fixed
    and auto budgets); a branching tree is refused, so are mask slots on a
    model without input embeddings and mtp=1 without MTP tensors."""
    from mlx_mtp.budget import CostCurve

    engine = _engine(hybrid)
    ntp = _method(engine, "ntp")
    for bc, curve in (("10", None), ("auto", CostCurve.flat(knee=16, slope=0.003))):
        engine.curves = curve
        m = _method(engine, "hybrid", bc=bc)
        assert "shape=chain" in m.describe() and "mtp<=3" in m.describe()
        for prompt in _prompts(1, seed=31):
            ref, _ = _generate(engine, ntp, prompt, 24)
            out, stats = _generate(engine, m, prompt, 24)
            assert out == ref, (bc, prompt)
            assert stats.drafted > 0
            # the MTP layer's drafts were verified
            assert engine.budget.acceptance.source("mtp").tried[1] > 0
    with pytest.raises(UnsupportedModelError, match="branching draft tree"):
        _method(engine, make_method("hybrid", shape="tree"))
    if hybrid[0] == "qwen3_next":  # takes no input embeddings: no mask slots
        assert _method(engine, "hybrid").masks == 0
        with pytest.raises(UnsupportedModelError, match="input embeddings"):
            _method(engine, "hybrid", masks=1)
    raw = mx.load(str(hybrid[2].path / "model.safetensors"))
    mx.save_safetensors(
        str(tmp_path / "model.safetensors"), {k: v for k, v in raw.items() if "mtp." not in k}
    )
    bare = Context(Engine(hybrid[1]), types.SimpleNamespace(path=tmp_path, config={}))
    assert "mtp" not in _method(bare, "hybrid", bc=10).describe()  # auto: no layer, no source
    with pytest.raises(ModelLoadError, match="no mtp"):
        _method(bare, "hybrid", mtp=1)


def test_cost_curve_is_measured_on_hybrid_models_and_leaves_the_state(hybrid):
    """The cost curve behind every ``auto`` is measured on a recurrent model
    too (chain passes rolled back), not collapsed to one size (a free device)."""
    from mlx_mtp.costs import measure_cost_curve

    engine = _engine(hybrid).engine
    prompt = _prompts(1, seed=51)[0]
    engine.sync(prompt)
    before = np.array(engine.forward_chain([7])[0])
    engine.reset()
    engine.sync(prompt)
    curve = measure_cost_curve(engine, sizes=(1, 2, 4, 8), repeats=1)
    assert curve.sizes == [1, 2, 4, 8]
    assert engine.offset == len(prompt) and engine.cached == prompt
    after = np.array(engine.forward_chain([7])[0])
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5)


def test_chain_probe_fixed_bc_must_match_its_shape():
    from mlx_mtp.errors import InvalidArgumentError

    assert not make_method("probe", shape="chain", masks=2, bc=5).auto
    with pytest.raises(InvalidArgumentError, match="block complexity 5"):
        make_method("probe", shape="chain", masks=2, bc=30)
