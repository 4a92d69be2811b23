"""DeepSeek-V3 nextn layers (issue 23): the ``model.layers.{num_hidden_layers}.*``
tensors mlx-lm drops, loaded as this package's native MTP layer.

The model is a tiny random deepseek_v3 checkpoint in the released checkpoints'
Hugging Face layout (:func:`tiny_models.write_tiny_deepseek`: 61 backbone
layers, because mlx-lm's sanitize drops the nextn layer by the literal name
``model.layers.61``; MLA attention with ``kv_b_proj``, a MoE nextn block),
loaded through mlx-lm's own ``load_model``. Float32 throughout. One forward
of the 61-layer model is slow on a shared CPU, so token counts are small; the
slow variant decodes more prompts.
"""

from __future__ import annotations

import types
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import assert_one_pass_equals_steps, decode
from tiny_models import write_tiny_deepseek

from mlx_mtp import planner
from mlx_mtp.api import MTPModel
from mlx_mtp.budget import CostCurve
from mlx_mtp.context import Context
from mlx_mtp.engine import Engine
from mlx_mtp.errors import ModelLoadError
from mlx_mtp.families import check_cache_support
from mlx_mtp.methods import make_method
from mlx_mtp.native_mtp import NextNLayer, find_nextn_tensors, has_native_mtp, load_native_mtp


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    from mlx_lm.utils import load_model

    folder = tmp_path_factory.mktemp("deepseek_v3")
    write_tiny_deepseek(folder, seed=1)
    model, config = load_model(Path(folder))
    return model, types.SimpleNamespace(path=Path(folder), config=config)


def _engine(deepseek, curve=None):
    """A context: the tiny deepseek model's engine, its folder, the curve."""
    model, loaded = deepseek
    return Context(Engine(model), loaded, curves=curve)


def _method(ctx, name, **opts):
    m = make_method(name, **opts)
    check_cache_support(ctx.engine, m)
    m.prepare(ctx)
    return m


def _generate(engine, method, prompt, n):
    return decode(engine, method, prompt, n)


def _rms(x, w, eps=1e-6):  # DeepSeek norms are plain x * w
    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _reference_logits(raw, args, h, tok):
    """The nextn layer at one position with an empty cache, from the raw
    checkpoint tensors: MLA over one key is its value (softmax = 1), the
    value is kv_b_proj's v rows applied to the normed latent; MoE with a
    sigmoid router, top-k by score + correction bias, weights renormalised
    and scaled, plus the shared expert."""
    pfx = f"model.layers.{args.num_hidden_layers}."
    w = {k[len(pfx) :]: v for k, v in raw.items() if k.startswith(pfx)}
    e = raw["model.embed_tokens.weight"][tok][None]
    x = mx.concatenate([_rms(e, w["enorm.weight"]), _rms(h, w["hnorm.weight"])], axis=-1)
    x = x @ w["eh_proj.weight"].T
    y = _rms(x, w["input_layernorm.weight"])
    r, nh = args.kv_lora_rank, args.num_attention_heads
    nope, vd = args.qk_nope_head_dim, args.v_head_dim
    latent = _rms(
        (y @ w["self_attn.kv_a_proj_with_mqa.weight"].T)[:, :r],
        w["self_attn.kv_a_layernorm.weight"],
    )
    wv = w["self_attn.kv_b_proj.weight"].reshape(nh, nope + vd, r)[:, nope:, :]
    v = (wv @ latent[0]).reshape(1, nh * vd)
    x = x + v @ w["self_attn.o_proj.weight"].T
    z = _rms(x, w["post_attention_layernorm.weight"])

    def mlp(q):
        g, u = z @ w[q + "gate_proj.weight"].T, z @ w[q + "up_proj.weight"].T
        return (g * mx.sigmoid(g) * u) @ w[q + "down_proj.weight"].T

    s = np.array(mx.sigmoid(z @ w["mlp.gate.weight"].T)[0])
    top = np.argsort(-(s + np.array(w["mlp.gate.e_score_correction_bias"])))[
        : args.num_experts_per_tok
    ]
    wts = s[top] / s[top].sum() * args.routed_scaling_factor
    out = sum(float(c) * mlp(f"mlp.experts.{int(i)}.") for i, c in zip(top, wts))
    x = x + out + mlp("mlp.shared_experts.")
    return _rms(x, w["shared_head.norm.weight"]) @ w["shared_head.head.weight"].T


def test_nextn_layer_survives_loading_and_matches_a_reference(deepseek):
    from mlx.utils import tree_flatten

    model, loaded = deepseek
    args = model.args
    assert not any(".61." in k for k, _ in tree_flatten(model.parameters()))  # mlx-lm drops it
    found = find_nextn_tensors(loaded.path, args.num_hidden_layers)
    assert "eh_proj.weight" in found and "self_attn.kv_b_proj.weight" in found
    assert has_native_mtp(loaded.path, model)
    layer = load_native_mtp(loaded.path, model, loaded.config)
    assert isinstance(layer, NextNLayer) and type(layer.layers[0].mlp).__name__ == "DeepseekV3MoE"
    raw = mx.load(str(loaded.path / "model.safetensors"))
    engine = Engine(model)
    mx.random.seed(3)
    for tok in (0, 17, 255):
        h = mx.random.normal((1, args.hidden_size))
        e = engine.embed_tokens([tok])[None]
        got = engine.lm_head(layer(h[None], e, layer.make_cache()))[0]
        ref = _reference_logits(raw, args, h, tok)
        np.testing.assert_allclose(np.array(got), np.array(ref), rtol=1e-4, atol=1e-4)
    # several positions in one pass == one at a time through the layer's (MLA) cache
    hs = mx.random.normal((1, 5, args.hidden_size))
    es = engine.embed_tokens([3, 9, 27, 81, 243])[None]
    assert_one_pass_equals_steps(layer, hs, es, atol=1e-4)


def test_checkpoint_without_nextn_tensors_is_refused(deepseek, tmp_path):
    model, loaded = deepseek
    raw = mx.load(str(loaded.path / "model.safetensors"))
    mx.save_safetensors(
        str(tmp_path / "model.safetensors"), {k: v for k, v in raw.items() if ".61." not in k}
    )
    assert not has_native_mtp(tmp_path, model)
    with pytest.raises(ModelLoadError, match="no nextn tensors"):
        load_native_mtp(tmp_path, model, {})


def _mtp_sweep(deepseek, prompts, n):
    engine = _engine(deepseek)
    ntp = _method(engine, "ntp")
    mtp = _method(engine, "mtp", depth=2)
    hyb = _method(engine, "hybrid", bc=6, shape="chain")
    assert "mtp<=3" in hyb.describe() and hyb.masks == 0  # deepseek takes no input embeddings
    for prompt in prompts:
        ref, _ = _generate(engine, ntp, prompt, n)
        out, stats = _generate(engine, mtp, prompt, n)
        assert out == ref and stats.drafted > 0
        out, stats = _generate(engine, hyb, prompt, n)
        assert out == ref and stats.drafted > 0
    assert engine.budget.acceptance.source("mtp").tried[1] > 0


def test_mtp_and_hybrid_with_nextn_equal_ntp(deepseek):
    _mtp_sweep(deepseek, [[5, 77, 140, 3, 9]], 8)


@pytest.mark.slow
def test_mtp_and_hybrid_with_nextn_equal_ntp_sweep(deepseek):
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 256, int(rng.integers(4, 16))).tolist() for _ in range(6)]
    _mtp_sweep(deepseek, prompts, 24)


def test_cost_curve_of_a_model_without_input_embeddings(deepseek):
    """deepseek_v3 takes no input embeddings: its curve is timed with chain
    passes (what mtp and pld verify with), and the cache is left as it was."""
    from mlx_mtp.costs import measure_cost_curve

    engine = _engine(deepseek).engine
    engine.sync([5, 77, 140])
    curve = measure_cost_curve(engine, sizes=(1, 2, 4), repeats=1)
    assert curve.sizes == [1, 2, 4] and engine.cached == [5, 77, 140]


def _record_solo_drafts(monkeypatch) -> dict:
    """``{drafter.tag: {offset: drafts}}``: every chain the solo nextn
    drafters draft from now on, by the tag set on their drafter and the
    cache offset they drafted at."""
    from mlx_mtp.sources.native import NativeDrafter

    seen: dict = {}
    real = NativeDrafter.draft

    def record(self, engine, depth):
        out = real(self, engine, depth)
        seen.setdefault(self.tag, {})[engine.offset] = out
        return out

    monkeypatch.setattr(NativeDrafter, "draft", record)
    return seen


def test_plain_steps_keep_feeding_the_nextn_layer(deepseek, monkeypatch):
    """depth=auto in plain mode (pipelined one-token steps on this attention
    model) still feeds the layer every committed position: the probes'
    drafts equal those of a fixed depth-2 run at the same positions."""
    seen = _record_solo_drafts(monkeypatch)
    monkeypatch.setattr(planner, "EPSILON", 0.25)  # several probes in 14 tokens
    prompt = [5, 77, 140, 3, 9]
    # probes between plain steps (c(3) = 1.03): drafts of 0.7 forwards each pay
    # only where nearly certain
    engine = _engine(deepseek, CostCurve([1, 3, 64], [1.0, 1.03, 2.0]))
    auto = _method(engine, "mtp", draft_cost=0.7)
    auto.drafter.tag = "auto"
    out, stats = _generate(engine, auto, prompt, 14)
    assert stats.plain_steps >= 8 and stats.reprobes >= 2
    engine = _engine(deepseek)  # a fresh cache: the fixed run prefills the prompt too
    fixed = _method(engine, "mtp", depth=2)
    fixed.drafter.tag = "fixed"
    ref, _ = _generate(engine, fixed, prompt, 14)
    assert out == ref
    common = sorted(set(seen["auto"]) & set(seen["fixed"]))
    late = [p for p in common if p > len(prompt) + 4]  # after plain steps
    assert late, (seen["auto"].keys(), seen["fixed"].keys())
    for p in common:
        assert seen["auto"][p][:1] == seen["fixed"][p][:1], p


def test_convert_clp_heads_writes_the_nextn_layer_and_mtp_loads_it(deepseek, tmp_path):
    """convert clp-heads finds the nextn layer (as it finds Qwen's mtp.*): the
    heads folder gives the layer's outputs and mtp decodes exactly with it."""
    from mlx_mtp.converters.clp_import import convert, detect

    model, loaded = deepseek
    assert detect(loaded.path) == "deepseek-nextn"
    src = types.SimpleNamespace(model=model, name="tiny-deepseek")
    summary = convert(loaded.path, tmp_path / "heads", src)
    assert "nextn layer" in summary and "native-mtp-layer" in summary
    direct = load_native_mtp(loaded.path, model, loaded.config)
    folder = load_native_mtp(tmp_path / "heads", model)
    engine = Engine(model)
    mx.random.seed(5)
    h = mx.random.normal((1, 3, model.args.hidden_size))
    e = engine.embed_tokens([1, 2, 3])[None]
    a = direct(h, e, direct.make_cache())
    b = folder(h, e, folder.make_cache())
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)
    eng = _engine(deepseek)
    ntp, m = _method(eng, "ntp"), _method(eng, "mtp", depth=2, heads=str(tmp_path / "heads"))
    p = [5, 77, 140, 3]
    out, stats = _generate(eng, m, p, 6)
    assert out == _generate(eng, ntp, p, 6)[0] and stats.drafted > 0


@pytest.mark.parametrize("depths,catch_up", [([3], 64), ([0, 0, 0, 0, 3], 4)])
def test_mtp_batch_drafts_as_the_solo_layer_does_and_equals_solo_greedy(
    deepseek, monkeypatch, depths, catch_up
):
    """The nextn layer inside a batch (``DraftBatch.for_method("mtp")``):
    every row's pairs of committed positions go through the layer's own
    batched cache (prompts joining as others leave, rows accepting
    different numbers of drafts; with steps that draft nothing, pairs pile
    up and are fed without a draft past ``catch_up``), and each draft
    equals the one the solo ``mtp`` method (depth 3) drafts at the same
    position; every answer equals plain greedy decoding."""
    import itertools

    from mlx_mtp import batching
    from mlx_mtp.batching import BatchNative, DraftBatch

    monkeypatch.setattr(batching, "CATCH_UP", catch_up)

    model, loaded = deepseek
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 256, int(rng.integers(2, 12))).tolist() for _ in range(5)]
    # one-token prompts: no pair for the layer before their first token (the
    # first to join, and one joining a cache that holds pairs)
    prompts.insert(0, [42])
    prompts.insert(2, [7])
    limits = [9, 16, 9, 9, 16, 12, 16]
    solo = _record_solo_drafts(monkeypatch)
    refs = []
    for i, p in enumerate(prompts):
        ctx = _engine(deepseek)
        refs.append(_generate(ctx.engine, _method(ctx, "ntp"), p, limits[i])[0])
        ctx = _engine(deepseek)  # a fresh cache: the layer sees the whole prompt
        mtp = _method(ctx, "mtp", depth=3)
        mtp.drafter.tag = i
        assert _generate(ctx.engine, mtp, p, limits[i])[0] == refs[i]

    layer = load_native_mtp(loaded.path, model, loaded.config)
    batch = DraftBatch.for_method(model, set(), "mtp", native=layer, max_draft=3)
    turn = itertools.cycle(depths)
    batch._depth = lambda: next(turn)
    seen: dict[int, dict[int, list[int]]] = {}
    draft = BatchNative.draft

    def batched(self, depth):
        out = draft(self, depth)
        for row, pos, chain in zip(batch.rows, batch.kv.layout.positions, out.tolist()):
            seen.setdefault(row.uid, {})[int(pos)] = chain
        return out

    monkeypatch.setattr(BatchNative, "draft", batched)
    out, index, waiting = {}, {}, list(range(len(prompts)))
    while waiting or len(batch):
        while waiting and len(batch) < 3:
            i = waiting.pop(0)
            uid, got = batch.add(prompts[i], limits[i])
            index[uid], out[i] = i, list(got.tokens)
        for got in batch.step():
            out[index[got.uid]].extend(got.tokens)
    compared = 0
    for uid, i in index.items():
        assert out[i] == refs[i]
        for pos, chain in seen.get(uid, {}).items():
            if pos in solo[i]:
                n = min(len(chain), len(solo[i][pos]))
                assert chain[:n] == solo[i][pos][:n], (i, pos)
                compared += 1
    assert compared >= (15 if depths == [3] else 4)


def test_batch_generate_mtp_and_its_refusals(deepseek, smollm, tmp_path, monkeypatch):
    """``batch_generate(method="mtp")`` on a nextn checkpoint loaded by
    folder (SmolLM2's tokenizer beside it): each answer is the solo greedy
    one; a model without a native MTP layer is refused with a message."""
    import shutil

    from mlx_mtp.errors import UnsupportedModelError
    from mlx_mtp.loading import load_model

    _, loaded = deepseek
    folder = tmp_path / "deepseek"
    shutil.copytree(loaded.path, folder)
    for f in Path(smollm.path).glob("*token*"):
        shutil.copy(f, folder / f.name)
    lm = load_model(str(folder), dtype="float32")
    prompts = [[5, 77, 140, 3, 9], [12, 8, 200], [7, 7, 7, 7, 30, 31]]
    got = lm.batch_generate(prompts, max_tokens=[10, 6, 10], max_batch=2, method="mtp")
    ntp = MTPModel(lm, make_method("ntp"))
    for p, n, g in zip(prompts, [10, 6, 10], got):
        assert g.tokens == ntp.generate(p, max_tokens=n, temp=0.0).tokens
        assert g.stats.method.startswith("mtp(batch")
    # a second batch, and the method bound solo, use the layer already loaded
    import mlx_mtp.native_mtp as native_mtp

    reads = []
    read = native_mtp.load_native_mtp
    monkeypatch.setattr(native_mtp, "load_native_mtp", lambda *a: reads.append(a) or read(*a))
    again = lm.batch_generate(prompts, max_tokens=[10, 6, 10], max_batch=2, method="mtp")
    assert [g.tokens for g in again] == [g.tokens for g in got]
    solo = lm.bind("mtp").generate(prompts[0], max_tokens=10, temp=0.0)
    assert solo.tokens == got[0].tokens and reads == []
    # SmolLM2's tokenizer gives ids past the tiny model's 256 rows for most text
    with pytest.raises(ModelLoadError, match=r"outside this model's vocabulary \[0, 256\)"):
        ntp.generate("hello there", max_tokens=2)
    with pytest.raises(UnsupportedModelError, match="native MTP layer"):
        smollm.batch_generate(["Hi"], max_tokens=2, method="mtp")


def test_mtp_batch_rows_joining_in_chunks_draft_as_whole_prompts_do(deepseek, monkeypatch):
    """Prompts prefilled three tokens per step between the batch's steps
    (``DraftBatch.begin``/``advance``, as the server joins them): the MTP
    layer gets every prompt token's hidden state across the chunks, so each
    row drafts the chains it drafts when its prompt is prefilled whole
    (``add``) at the same positions, and every answer equals plain greedy
    decoding."""
    from mlx_mtp.batching import BatchNative, DraftBatch

    model, loaded = deepseek
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, int(rng.integers(7, 14))).tolist() for _ in range(4)]
    limits = [12, 9, 14, 10]
    refs = [
        _generate(_engine(deepseek).engine, _method(_engine(deepseek), "ntp"), p, n)[0]
        for p, n in zip(prompts, limits)
    ]
    layer = load_native_mtp(loaded.path, model, loaded.config)
    draft = BatchNative.draft
    seen: dict[tuple[int, int], list[int]] = {}

    def run(chunked):
        batch = DraftBatch.for_method(model, set(), "mtp", native=layer, max_draft=3)
        batch._depth = lambda: 3
        out, uid_of, waiting = {}, {}, list(range(len(prompts)))

        def batched(self, depth):
            chains = draft(self, depth)
            for row, pos, chain in zip(batch.rows, batch.kv.layout.positions, chains.tolist()):
                key = (uid_of[row.uid], int(pos))
                assert seen.setdefault(key, chain) == chain, key
            return chains

        monkeypatch.setattr(BatchNative, "draft", batched)
        while waiting or len(batch) or batch.joining:
            while waiting and len(batch) + len(batch.joining) < 2:
                i = waiting.pop(0)
                if chunked:
                    uid_of[batch.begin(prompts[i], limits[i])], out[i] = i, []
                else:
                    uid, got = batch.add(prompts[i], limits[i])
                    uid_of[uid], out[i] = i, list(got.tokens)
            got = batch.step()
            joined = batch.advance(3)
            for g in [*got, *([joined] if joined is not None else [])]:
                out[uid_of[g.uid]].extend(g.tokens)
        return [out[i] for i in range(len(prompts))]

    assert run(chunked=False) == refs
    whole = len(seen)
    assert run(chunked=True) == refs
    assert whole >= 10 and len(seen) < 2 * whole  # the same positions drafted the same chains
