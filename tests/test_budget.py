"""The device-aware draft budget (mlx_mtp.budget): cost curve, its cache, the
policy, and exactness of every method's ``auto`` default."""

from __future__ import annotations

import json
import warnings

import mlx.core as mx
import numpy as np
import pytest

import mlx_mtp.budget as budget
from mlx_mtp.budget import (
    Budget,
    CostCurve,
    CostCurves,
    DepthAcceptance,
    best_prefix,
    chain_values,
    cost_curve,
    cost_curves,
    curve_key,
    curve_path,
    tree_size,
)
from mlx_mtp.engine import Engine
from mlx_mtp.errors import InvalidArgumentError
from mlx_mtp.methods import make_method
from mlx_mtp.testing import make_tiny_model
from mlx_mtp.tree import build_tree

#: this CPU, SmolLM2-135M float32 (issue 22, engine tree forward, medians)
CPU_CURVE = CostCurve([1, 2, 4, 8, 16, 32], [1.0, 1.24, 1.42, 1.66, 1.88, 2.97])
#: a simulated memory-bound device: flat up to 16 slots, slowly rising after
GPU_CURVE = CostCurve.flat(knee=16, slope=0.003)
#: every slot costs a whole forward: no draft ever pays (plain mode)
STEEP_CURVE = CostCurve.linear(1.0)


# --------------------------------------------------------------------- curve
def test_curve_interpolates_extrapolates_and_never_decreases():
    c = CostCurve([1, 2, 4, 8], [1.0, 1.2, 1.1, 2.0])  # 4 measured below 2: noise
    assert c(1) == c(0) == 1.0
    assert c(2) == pytest.approx(1.2) and c(4) == pytest.approx(1.2)  # flattened
    assert c(6) == pytest.approx(1.6)
    assert c(12) == pytest.approx(2.0 + 0.2 * 4)  # last slope goes on
    assert GPU_CURVE(16) == 1.0 and GPU_CURVE(30) == pytest.approx(1.042)
    with pytest.raises(ValueError):
        CostCurve([2, 4], [1.0, 1.5])


def test_best_prefix_and_plain_decision():
    # a free device takes every item with value; a CPU-like curve stops early
    vals = [0.6, 0.3, 0.1, 0.02]
    assert best_prefix(CostCurve.linear(0.0), vals, 1)[0] == 4
    n, rate = best_prefix(CPU_CURVE, vals, 1)
    assert n == 2 and rate == pytest.approx(1.9 / CPU_CURVE(3))
    # nothing pays: rate of a one-token step
    assert best_prefix(CPU_CURVE, [0.1, 0.05], 1) == (0, 1.0)
    # CPU curve: one cheap-looking item loses, many together win (no greedy stop)
    n, _ = best_prefix(CPU_CURVE, [0.2] * 15, 1)
    assert n > 1
    assert chain_values([0.5, 0.5, 1.0]) == [0.5, 0.25, 0.25]


def test_depth_acceptance_follows_the_text():
    a = DepthAcceptance(prior=0.5, weight=2.0, decay=0.8)
    assert a.q(1) == 0.5
    for _ in range(20):
        a.record(drafted=4, accepted=0)
    assert a.q(1) < 0.01 and a.q(2) == 0.5  # depth 2 never tried
    # the prior fades with the observations: a depth that always fails drops
    # below the cost of a second slot on any device (here c(2) = 1.08)
    assert best_prefix(CostCurve([1, 2], [1.0, 1.08]), chain_values(a.qs(4)), 1)[0] == 0
    for _ in range(5):  # a repetitive stretch: whole chains accepted
        a.record(drafted=4, accepted=4)
    assert a.q(1) > 0.55 and a.q(4) > 0.7
    a.reset()
    assert a.q(1) == 0.5


def test_plain_mode_interval_pays_for_the_reprobe():
    b = Budget(CPU_CURVE)
    assert not b.pays(1.0) and b.pays(1.01)
    b.go_plain(reprobe_slots=3)  # c(3) = 1.33: re-probe every 33 steps -> 1% overhead
    assert b.plain and b.plain_left == 33
    assert [b.tick() for _ in range(33)][-2:] == [False, True]
    assert not b.plain and b.reprobes == 1
    # a two-step re-probe (probe: root masks, then one node) pays for both
    b.go_plain(2, 4)  # (c(2) - 1) + (c(4) - 1) = 0.66 -> capped at 64
    assert b.plain_left == budget.MAX_PLAIN_STEPS
    cheap = Budget(CostCurve([1, 2, 4], [1.0, 1.07, 1.27]))
    cheap.go_plain(2, 4)
    assert cheap.plain_left == 34 and cheap.interval(2) == 7
    flat = Budget(GPU_CURVE)
    flat.go_plain(3)
    assert flat.plain_left == budget.MIN_PLAIN_STEPS


# ---------------------------------------------- simulated memory-bound device
def _synthetic_steps(steps: int = 600, seed: int = 0):
    """Calibrated synthetic mask distributions for probe's one-level tree
    (masks=1): per step, the candidates' probabilities (Zipf-like, random
    sharpness, 30-95% of the mass in the top 64) best first, and the rank of
    the true next token, drawn from that same distribution (64 = not among
    them)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        a = rng.uniform(0.6, 2.0)
        p = 1.0 / np.arange(1, 65) ** a
        p *= rng.uniform(0.3, 0.95) / p.sum()
        truth = int(rng.choice(65, p=[*p, 1 - p.sum()]))
        _, _, node_p = build_tree([(np.arange(100, 164), p)], 31, root_token=0)
        out.append((node_p, truth))
    return out


def _simulate_probe(curve: CostCurve, nodes: int | None, steps) -> tuple[float, float, float]:
    """Probe on ``steps``: a fixed tree of ``nodes`` nodes, or (None) ``bc=auto``
    via :func:`tree_size`, a one-token step when nothing pays. A step commits
    2 tokens when the truth is among the tree's nodes, else 1, and takes
    ``curve(slots)`` time. Returns (tau, tokens per unit of time, mean BC)."""
    tokens = time = slots_sum = 0.0
    for node_p, truth in steps:
        if nodes is None:
            n, rate = tree_size(curve, node_p, masks=1)
            slots = 2 * (1 + n) if rate > 1.0 else 1
        else:
            n, slots = nodes, 2 * (1 + nodes)
        tokens += 1 + (truth < n and slots > 1)
        time += curve(slots)
        slots_sum += slots
    return tokens / len(steps), tokens / time, slots_sum / len(steps)


def test_simulated_memory_bound_device_auto_trees_near_bc30():
    steps = _synthetic_steps()
    fixed = {bc: _simulate_probe(GPU_CURVE, bc // 2 - 1, steps) for bc in (10, 30, 60)}
    best_bc = max(fixed, key=lambda bc: fixed[bc][1])  # best fixed by speed
    tau, speed, bc = _simulate_probe(GPU_CURVE, None, steps)
    assert 20 <= bc <= 44, bc  # near the papers' BC=30
    assert tau >= 0.95 * fixed[best_bc][0], (tau, fixed)
    assert speed >= 0.99 * fixed[best_bc][1], (speed, fixed)
    # on the CPU curve the same policy never loses to one-token steps and
    # beats every fixed size
    cpu_fixed = [_simulate_probe(CPU_CURVE, bc // 2 - 1, steps)[1] for bc in (10, 30, 60)]
    _, cpu_speed, _ = _simulate_probe(CPU_CURVE, None, steps)
    assert cpu_speed >= max(1.0, *cpu_fixed)


# ------------------------------------------------------------------- cache
@pytest.fixture
def counted(monkeypatch, tmp_path):
    """Count cost-curve measurements (small sizes: a tiny model) in a fresh
    $MLX_MTP_HOME."""
    monkeypatch.setenv("MLX_MTP_HOME", str(tmp_path))
    monkeypatch.delenv("MLX_MTP_COST_CURVE", raising=False)  # conftest pins one
    calls = []
    real = budget.measure_cost_curve

    def measure(engine, sizes=(1, 2, 4), repeats=1, progress=False):
        calls.append(engine)
        return real(engine, sizes, repeats)

    monkeypatch.setattr(budget, "measure_cost_curve", measure)
    return calls


def _engine(model):
    eng = Engine(model)
    eng.sync(list(range(3, 15)))
    return eng


def test_curve_cache_reused_per_model_device_dtype(counted, tmp_path):
    model = make_tiny_model("llama", seed=4)
    first = cost_curves(_engine(model))
    assert len(counted) == 2  # the current context and 1024 tokens more
    path = curve_path(curve_key(_engine(model)), tmp_path)
    data = json.loads(path.read_text())
    assert data["key"]["dtype"] == "float32" and data["format"] == 2
    assert [c["context"] for c in data["curves"]] == [12, 12 + budget.LONG_CONTEXT_EXTRA]
    assert all(c["sizes"] == [1, 2, 4] for c in data["curves"])
    eng = _engine(model)
    again = cost_curves(eng)  # read back
    for a, b in zip(again.curves, first.curves):
        assert a.costs == pytest.approx(b.costs, abs=1e-4) and a.context == b.context
    assert len(counted) == 2 and eng.offset == 12 and eng.forward_passes == 0
    # another dtype, another model: measured again, not read
    model16 = make_tiny_model("llama", seed=4)
    model16.set_dtype(mx.float16)
    cost_curve(_engine(model16))
    cost_curve(_engine(make_tiny_model("llama", seed=5)))
    assert len(counted) == 6
    assert len(list(path.parent.glob("*.json"))) == 3
    assert not list(path.parent.glob(".tmp-*"))  # atomic writes leave nothing behind
    # a file of the older one-curve layout is measured again, not misread
    path.write_text(json.dumps({"format": 1, "key": data["key"], "curve": data["curves"][0]}))
    cost_curve(_engine(model))
    assert len(counted) == 8 and json.loads(path.read_text())["format"] == 2


def test_corrupt_curve_cache_is_ignored_with_a_warning(counted, tmp_path):
    model = make_tiny_model("llama", seed=4)
    cost_curve(_engine(model))
    path = curve_path(curve_key(_engine(model)), tmp_path)
    path.write_text('{"format": 2, "key": ')  # half a file
    with pytest.warns(UserWarning, match="corrupt cost-curve cache"):
        curve = cost_curve(_engine(model))
    assert len(counted) == 4 and curve(1) == 1.0
    assert json.loads(path.read_text())["curves"][0]["sizes"] == [1, 2, 4]  # rewritten
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cost_curve(_engine(model))  # a good file again: no warning, no measuring
    assert len(counted) == 4


def test_long_context_curve_leaves_the_cache_as_it_was(counted, monkeypatch):
    """The second curve is timed 1024 tokens further on; the cache, its
    tokens, the statistics and the next logits are those of before."""
    model = make_tiny_model("llama", seed=6)
    eng, ref = _engine(model), _engine(model)
    curves = cost_curves(eng)
    assert [c.context for c in curves.curves] == [12, 12 + budget.LONG_CONTEXT_EXTRA]
    assert eng.offset == 12 and eng.cached == ref.cached and eng.forward_passes == 0
    a, _ = eng.forward_chain([7, 8])
    b, _ = ref.forward_chain([7, 8])
    assert mx.allclose(a, b, atol=1e-5)
    # a sliding-window cache cannot drop 1024 tokens: one curve only
    monkeypatch.setenv("MLX_MTP_REMEASURE_COST", "1")
    win = Engine(model, max_kv_size=64)
    win.sync(list(range(3, 15)))
    assert len(cost_curves(win).curves) == 1


def test_curves_follow_the_context_length():
    short = CostCurve([1, 16, 32], [1.0, 1.6, 2.4], context=128)
    long = CostCurve([1, 16, 32], [1.0, 2.0, 3.2], context=1152)
    cs = CostCurves([long, short])  # any order
    assert cs.at(0) is short and cs.at(130) is short
    assert cs.at(640)(16) == pytest.approx(1.8)  # halfway (64-token buckets)
    assert cs.at(1152)(32) == pytest.approx(3.2)
    assert cs.at(2176)(32) == pytest.approx(4.0)  # extrapolated: one more span
    # far beyond: at most MAX_EXTRAPOLATION spans, and never above n
    assert cs.at(10**6)(16) == pytest.approx(min(1.6 + budget.MAX_EXTRAPOLATION * 0.4, 16))
    assert cs.at(10**6)(32) <= 32 and cs.at(10**6)(2) <= 2.0
    assert CostCurves([GPU_CURVE]).at(5000) is GPU_CURVE  # one curve: every context
    b = Budget(short, curves=cs)
    b.at(1152)
    assert b.curve(32) == pytest.approx(3.2)
    with pytest.raises(ValueError):
        CostCurves([])


def test_auto_plans_with_the_curve_of_the_current_context():
    """Free slots at a short context, a whole forward each at a long one:
    pld drafts every step on the short prompt and goes to one-token steps on
    the long one (same text at the end, so only the context differs)."""
    from mlx_mtp.testing import decode

    model = make_tiny_model("llama", seed=2)
    text = [5, 6, 7, 8, 9] * 4
    curves = CostCurves(
        [CostCurve([1, 64], [1.0, 1.0], context=0), CostCurve([1, 64], [1.0, 64.0], context=200)]
    )
    plain = {}
    for name, prompt in (("short", text), ("long", list(range(3, 303)) + text)):
        eng = Engine(model)
        eng.curve = curves
        method = make_method("pld")
        method.prepare(eng)
        decode(eng, method, prompt, 24)
        plain[name] = method.budget.plain_steps
    assert plain["short"] == 0 and plain["long"] > 0, plain


def test_curve_set_on_the_engine_wins_and_measuring_leaves_the_cache(counted, monkeypatch):
    eng = _engine(make_tiny_model("qwen3", seed=1))
    eng.curve = GPU_CURVE
    assert cost_curve(eng) is GPU_CURVE and not counted
    monkeypatch.setenv("MLX_MTP_COST_CURVE", "1:1,8:1.5")
    eng.curve = None
    assert cost_curve(eng)(8) == 1.5 and not counted  # the pinned curve, not measured
    monkeypatch.setenv("MLX_MTP_COST_CURVE", "2:1,8:x")
    eng.curve = None
    with pytest.raises(InvalidArgumentError, match="MLX_MTP_COST_CURVE"):
        cost_curve(eng)
    monkeypatch.delenv("MLX_MTP_COST_CURVE")
    ref = _engine(make_tiny_model("qwen3", seed=1))
    eng.curve = None
    cost_curve(eng)
    a, _ = eng.forward_chain([7, 8])
    b, _ = ref.forward_chain([7, 8])
    assert mx.array_equal(a, b)


# ------------------------------------------------------- auto is exact (real)
AUTO_CASES = [
    ("pld", CPU_CURVE),
    ("probe", CPU_CURVE),
    ("hybrid", CPU_CURVE),
    ("probe", GPU_CURVE),
    ("hybrid", GPU_CURVE),
    ("lookahead", GPU_CURVE),
    ("clp", STEEP_CURVE),
    ("clp", GPU_CURVE),
]


@pytest.mark.parametrize(
    "name,curve", AUTO_CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(AUTO_CASES)]
)
def test_auto_defaults_are_exact_on_smollm(
    smollm, short_spec_prompts, greedy_reference, monkeypatch, name, curve
):
    """Each method at its default (auto) reproduces plain greedy decoding in
    float32, on a CPU-like curve (plain mode, re-probes every few steps,
    pipelined one-token steps between draft steps) and on a memory-bound one
    (large trees)."""
    from mlx_mtp.decoding import generate_steps

    monkeypatch.setattr(budget, "MAX_PLAIN_STEPS", 5)  # many plain <-> draft switches
    eng = Engine(smollm.model)
    eng.curve = curve
    method = make_method(name)
    method.prepare(eng)
    prompt = short_spec_prompts[0]
    out, drafted = [], 0
    for step in generate_steps(eng, method, prompt, max_tokens=32):
        out.extend(step.tokens)
        drafted = step.stats.drafted
    assert out == greedy_reference(prompt, 32), (name, method.describe())
    if curve is GPU_CURVE:
        assert drafted > 0  # the memory-bound device does draft
    else:
        assert method.budget.plain_steps > 0 and method.budget.reprobes > 0
