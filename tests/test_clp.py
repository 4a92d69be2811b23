"""CLP heads, span predictor, decoding modes (docs/methods.md, clp)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from tiny_models import make_tiny_model

from mlx_mtp.clp_format import (
    ASSETS,
    CLPHeads,
    GatePredictor,
    SpanPredictor,
    base_config,
    count_params,
    find_heads,
    gate_hidden_for,
    load_heads,
    read_heads,
    save_heads,
    span_labels,
)
from mlx_mtp.context import Context
from mlx_mtp.decoding import generate_steps
from mlx_mtp.engine import Engine
from mlx_mtp.errors import (
    CheckpointMismatchError,
    InvalidArgumentError,
    ModelLoadError,
    ModelNotFoundError,
)
from mlx_mtp.methods import make_method

SHIPPED = ASSETS / "smollm2-135m"


def _tiny_heads(model, tmp_path, seed=0, name="heads", gate=True):
    cfg = base_config(model, "tiny", 2, "resblock", bottleneck=16, gate_hidden=32 if gate else None)
    mx.random.seed(seed)
    heads = CLPHeads(cfg)
    # non-zero residual branch so the heads differ from the backbone's LM head
    for h in heads.heads:
        h.w2.weight = mx.random.normal(h.w2.weight.shape) * 0.5
    mx.eval(heads.parameters())
    return heads, save_heads(heads, tmp_path / name)


def _decode(engine, method, prompt, n):
    out = []
    for step in generate_steps(engine, method, prompt, max_tokens=n):
        out.extend(step.tokens)
    return out, step.stats


# ------------------------------------------------------------------ pure parts
def test_span_labels_longest_run_of_correct_heads():
    heads = np.array([[5, 6], [5, 9], [1, 6], [5, 6]])
    true = np.array([[5, 6], [5, 6], [5, 6], [5, 6]])
    valid = np.array([[1, 1], [1, 1], [1, 1], [1, 0]], dtype=bool)
    # all right -> 2; first right -> 1; first wrong (second right) -> 0; missing target -> 1
    assert span_labels(heads, true, valid).tolist() == [2, 1, 0, 1]
    assert span_labels(heads, true).tolist() == [2, 1, 0, 2]


def test_span_predictor_is_one_linear_layer_of_1731_params():
    p = SpanPredictor(576, 2)
    assert count_params(p) == 1731 == 576 * 3 + 3
    assert count_params(SpanPredictor(1536, 2)) == 4611  # the paper's 4.6K (Qwen2.5-1.5B)
    gate = GatePredictor(576, 2, gate_hidden_for(576, 2))
    assert 0.95e6 < count_params(gate) < 1.05e6


# ------------------------------------------------------------ format + refusal
def test_heads_roundtrip_and_mismatched_model_refused(tmp_path):
    model = make_tiny_model("llama", seed=0)
    heads, folder = _tiny_heads(model, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["format_version"] == 1 and cfg["k"] == 2 and cfg["hidden_size"] == 64
    back = load_heads(folder, model)
    h = mx.random.normal((3, 64))
    e = model.model.embed_tokens(mx.array([1, 2, 3]))
    lm = model.model.embed_tokens.as_linear
    a, b = heads.head_logits(h, e, lm), back.head_logits(h, e, lm)
    assert a.shape == (2, 3, 256)
    assert mx.allclose(a, b, atol=5e-2 * float(mx.abs(a).max())).item()  # float16 on disk

    other = make_tiny_model("llama", seed=1)  # same shapes, other weights
    with pytest.raises(CheckpointMismatchError, match="fingerprint"):
        load_heads(folder, other)
    wider = make_tiny_model("llama", seed=0, hidden_size=96)
    with pytest.raises(CheckpointMismatchError, match="hidden size"):
        load_heads(folder, wider)


def test_deeper_heads_start_as_the_identity_and_round_trip(tmp_path):
    """``depth`` 3: each head has two blocks after the first (``blocks.{i}``),
    starts as the identity on h (drafting what the LM head reads from it),
    and loads back with the same outputs; a folder whose config loses the
    depth is refused, naming the weights it does not expect."""
    model = make_tiny_model("llama")
    cfg = base_config(model, "tiny", 2, "resblock", bottleneck=16, depth=3)
    heads = CLPHeads(cfg)
    mx.eval(heads.parameters())
    d = cfg["hidden_size"]
    h, e = mx.random.normal((5, d)), mx.random.normal((5, d))
    assert mx.array_equal(heads.head_states(h, e), mx.stack([h, h]))
    for head in heads.heads:
        for b in head.blocks:
            b.w2.weight = mx.random.normal(b.w2.weight.shape) * 0.5
    folder = save_heads(heads, tmp_path / "deep")
    got, weights = read_heads(folder)
    assert got["depth"] == 3 and "heads.1.blocks.1.w2.weight" in weights
    back = CLPHeads(got)
    back.load_weights(list(weights.items()))
    assert mx.allclose(back.head_states(h, e), heads.head_states(h, e), atol=1e-2)
    del got["depth"]
    (folder / "config.json").write_text(json.dumps(got))
    with pytest.raises(ModelLoadError, match="unexpected"):
        read_heads(folder)


def test_corrupt_heads_folder_refused(tmp_path):
    model = make_tiny_model("llama")
    _, folder = _tiny_heads(model, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["bottleneck"] = 8  # weights no longer fit the config
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="shape"):
        read_heads(folder)
    with pytest.raises(ModelLoadError, match="not a CLP heads folder"):
        read_heads(tmp_path)


def test_method_options_and_missing_heads(tmp_path):
    with pytest.raises(InvalidArgumentError):
        make_method("clp", mode="fast")
    with pytest.raises(InvalidArgumentError):
        make_method("clp", predictor="mlp")
    with pytest.raises(InvalidArgumentError):
        make_method("clp", k="zero")
    assert make_method("clp", mode="paper").lossless is False
    assert make_method("clp").lossless is True
    model = make_tiny_model("llama", seed=3)
    assert find_heads(model, [tmp_path]) is None
    with pytest.raises(ModelNotFoundError, match="train clp"):
        make_method("clp").prepare(Context(Engine(model)))
    _, folder = _tiny_heads(model, tmp_path)
    with pytest.raises(InvalidArgumentError, match="--k 3"):
        make_method("clp", k=3, heads=str(folder)).prepare(Context(Engine(model)))


# ------------------------------------------------------------------- decoding
@pytest.mark.parametrize("predictor", ["linear", "all", "gate"])
def test_verified_mode_exact_on_tiny_model(tmp_path, predictor):
    model = make_tiny_model("llama", seed=0)
    _, folder = _tiny_heads(model, tmp_path)
    rng = np.random.default_rng(0)
    for _ in range(3):
        prompt = rng.integers(0, 256, 12).tolist()
        ref, _ = _decode(Engine(model), make_method("ntp"), prompt, 24)
        m = make_method("clp", heads=str(folder), predictor=predictor)
        eng = Engine(model)
        m.prepare(Context(eng))
        got, stats = _decode(eng, m, prompt, 24)
        assert got == ref
        if predictor == "all":
            assert stats.drafted > 0  # drafts really go through verification


@pytest.mark.parametrize("device", ["steep", "flat"])
def test_auto_plain_mode_on_a_steep_curve_drafts_on_a_flat_one(tmp_path, monkeypatch, device):
    """k=auto: where every slot costs a whole forward not even a certain
    draft pays, so clp runs one-token steps without the heads and never
    probes; on a memory-bound device it drafts every step. Exact vs ntp
    either way."""
    from mlx_mtp.budget import CostCurve

    model = make_tiny_model("llama", seed=0)
    _, folder = _tiny_heads(model, tmp_path)
    prompt = list(range(10, 22))
    ref, _ = _decode(Engine(model), make_method("ntp"), prompt, 40)
    m = make_method("clp", heads=str(folder), predictor="all")
    curve = CostCurve.linear(1.0) if device == "steep" else CostCurve.flat(16, 0.003)
    ctx = Context(Engine(model), curves=curve)
    m.prepare(ctx)
    heads_runs = []  # steps that ran a pass through the shared stage (the heads ride on it)
    real = m._heads
    monkeypatch.setattr(m, "_heads", lambda *a: heads_runs.append(1) or real(*a))
    got, stats = _decode(ctx, m, prompt, 40)
    assert got == ref
    if device == "steep":
        assert stats.plain_steps > 0 and stats.reprobes == 0
        assert not heads_runs and stats.drafted == 0  # no heads in plain mode
    else:
        assert stats.plain_steps == 0 and len(heads_runs) == stats.steps
        assert stats.drafted >= 2 * (stats.steps - 1)  # both heads' drafts every step


def test_paper_mode_commits_backbone_token_first_and_keeps_cache_consistent(tmp_path):
    model = make_tiny_model("llama", seed=0)
    _, folder = _tiny_heads(model, tmp_path)
    prompt = list(range(10, 22))
    ref, _ = _decode(Engine(model), make_method("ntp"), prompt, 16)
    m = make_method("clp", heads=str(folder), mode="paper", predictor="all")
    eng = Engine(model)
    m.prepare(Context(eng))
    got, stats = _decode(eng, m, prompt, 16)
    assert len(got) == 16 and got[0] == ref[0]  # the backbone always writes n+1
    assert stats.tau > 1.5  # predictor=all keeps both head tokens
    full = prompt + got
    assert eng.cached == full[: len(eng.cached)]  # cache lags, never diverges
    # each step = [backbone token, head tokens...]: the backbone's tokens follow
    # greedy given the committed prefix
    e2 = Engine(model)
    e2.sync(full[: len(prompt) + 2])
    logits, _ = e2.forward_chain([full[len(prompt) + 2]])
    assert int(mx.argmax(logits[-1])) == got[3]


@pytest.mark.slow
def test_verified_exact_vs_ntp_smollm_30x64(smollm, spec_prompts):
    _exact_vs_ntp(smollm, spec_prompts[:30], 64)


def _exact_vs_ntp(smollm, prompts, n):
    method = make_method("clp")  # shipped heads, found by fingerprint
    eng = Engine(smollm.model)  # one engine: the clp run reuses the ntp run's prompt cache
    method.prepare(Context(eng))
    assert method.heads_folder == SHIPPED
    accepted = 0
    eos = {smollm.tokenizer.eos_token_id}
    for i, p in enumerate(prompts):
        ref = []
        for s in generate_steps(eng, make_method("ntp"), p, max_tokens=n, eos_ids=eos):
            ref.extend(s.tokens)
        got = []
        for s in generate_steps(eng, method, p, max_tokens=n, eos_ids=eos):
            got.extend(s.tokens)
        assert got == ref, f"prompt {i}: verified CLP differs from greedy"
        accepted += s.stats.accepted
    assert accepted > 0  # the shipped heads draft tokens the backbone accepts


def test_shipped_heads_paper_mode(smollm, spec_prompts):
    method = make_method("clp", mode="paper")
    eng = Engine(smollm.model)
    method.prepare(Context(eng))
    assert method.heads_folder == SHIPPED  # found by the model's fingerprint
    assert method.predictor_params() == 1731
    got = []
    for s in generate_steps(eng, method, spec_prompts[0], max_tokens=24):
        got.extend(s.tokens)
    assert len(got) == 24
    assert s.stats.forward_passes <= 24


def test_shipped_heads_refused_for_other_model():
    with pytest.raises(CheckpointMismatchError):
        load_heads(SHIPPED, make_tiny_model("llama", hidden_size=576, vocab_size=49152))


class StandInTokenizer:
    """A chat tokenizer for the tiny trainer tests: a fixed prefix, then one
    id per character; 255 ends a sequence."""

    eos_token_id = 255
    chat_template = "a stand-in"

    def apply_chat_template(self, msgs, add_generation_prompt=True, **kw):
        return [1, 2, 3] + [ord(c) % 250 for c in msgs[0]["content"]]


@pytest.mark.parametrize("quantized", [False, True])
def test_train_clp_tiny_end_to_end(tmp_path, monkeypatch, quantized):
    """Self-distillation on a tiny model: data, heads, predictor, resume; also
    on stored 4-bit weights (issue 18)."""
    import mlx.nn as nn

    from mlx_mtp.data import read_prompts
    from mlx_mtp.training.clp import TrainConfig, train_clp

    data = tmp_path / "p.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"q{i}"}) for i in range(6)))
    model = make_tiny_model("llama", seed=0)
    if quantized:
        nn.quantize(model, group_size=32, bits=4)

    loaded = SimpleNamespace(model=model, tokenizer=StandInTokenizer(), name="tiny")
    cfg = TrainConfig(
        k=2, bottleneck=8, max_new_tokens=10, gen_batch=4, epochs=2, batch_size=16,
        predictor_epochs=2, checkpoint_every=2, data=[str(data)],
    )  # fmt: skip
    out = tmp_path / "heads"
    res = train_clp(loaded, out, cfg, log=lambda s: None)
    assert res["predictor_params"] == 64 * 3 + 3 and len(res["val_head_top1"]) == 2
    heads = load_heads(out, model)
    assert heads.k == 2 and hasattr(heads, "gate")
    assert (tmp_path / ".heads.train" / "continuations.jsonl").is_file()
    res2 = train_clp(loaded, out, cfg, resume=True, log=lambda s: None)  # reuses data + ckpt
    assert res2["train_positions"] == res["train_positions"]
    assert len(read_prompts([data])) == 6
    with pytest.raises(InvalidArgumentError):
        read_prompts([tmp_path / "missing.jsonl"])


def test_train_clp_within_a_generation_budget_then_resumed(tmp_path, monkeypatch):
    """``--gen-minutes``: generation stops starting batches once the budget is
    spent and the heads train on the continuations made so far; a later
    ``--resume`` run generates the rest and trains on all of them. A budget
    that made none is a one-line error."""
    import itertools

    from mlx_mtp.training import continuations
    from mlx_mtp.training.clp import TrainConfig, train_clp

    data = tmp_path / "p.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"q{i}" * (i + 1)}) for i in range(8)))
    model = make_tiny_model("llama", seed=0)

    loaded = SimpleNamespace(model=model, tokenizer=StandInTokenizer(), name="tiny")
    cfg = TrainConfig(
        k=2, bottleneck=8, max_new_tokens=10, gen_batch=2, epochs=1, batch_size=16,
        predictor_epochs=1, data=[str(data)], gen_minutes=1.0,
    )  # fmt: skip
    out, logged = tmp_path / "heads", []
    # the clock: the start, the first batch's check, then past the minute
    clock = itertools.chain([0.0, 0.0, 30.0], itertools.repeat(61.0))
    monkeypatch.setattr(continuations.time, "monotonic", lambda: next(clock))
    part = train_clp(loaded, out, cfg, log=logged.append)
    assert any("training on 4 of 8 prompts" in line for line in logged), logged
    monkeypatch.undo()
    cfg.gen_minutes = None
    whole = train_clp(loaded, out, cfg, resume=True, log=lambda s: None)
    assert whole["train_positions"] > part["train_positions"] > 0
    cfg.gen_minutes = 0.0
    with pytest.raises(InvalidArgumentError, match="--gen-minutes"):
        train_clp(loaded, tmp_path / "other", cfg, log=lambda s: None)


def test_pipelined_heads_learned_per_span_and_valued_by_the_latest(
    smollm, spec_prompts, greedy_reference
):
    """On pipelined steps the span predictor gates the shipped heads through
    the width policy (CLP §3.2): every head draft is learned under the span
    the predictor gave it, the next step is valued with the latest span read,
    a span of 2 is worth more than a span of 0 before anything is learned,
    and the output stays plain greedy decoding's."""
    from conftest import decode

    from mlx_mtp.acceptance import Acceptance
    from mlx_mtp.methods.clp import HeadsDrafter, span_source

    method = make_method("clp")
    ctx = Context(Engine(smollm.model), smollm)
    method.prepare(ctx)
    signals = []
    learn = HeadsDrafter.learn

    def logged(self, acceptance, history, steps):
        signals.append(learn(self, acceptance, history, steps))
        return signals[-1]

    prompt = spec_prompts[4]  # math_reasoning: spans of 0 and 2 in 32 tokens
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(HeadsDrafter, "learn", logged)
        out, stats = decode(ctx, method, prompt, 32, eos_ids=set(), runner="pipelined")
    assert out == greedy_reference(prompt, 32) and stats.runner == "pipelined"
    learned = ctx.learned[f"pipeline:{method.settings_key()}"]
    tried = {name: float(d.tried.sum()) for name, d in learned.depths.items()}
    assert tried.get("clp", 0.0) == 0.0  # every draft has the span it was made with
    assert sum(tried.get(span_source(s), 0.0) for s in range(3)) > 5
    assert {s for s in signals if s is not None} >= {0, 2}
    fresh = Acceptance(method.pipeline_acceptance())
    drafter = HeadsDrafter(method)
    assert drafter.values(fresh, 2, 2)[0] > drafter.values(fresh, 2, 0)[0]
