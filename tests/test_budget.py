"""The device-aware draft budget: the cost curve and the cut (mlx_mtp.budget),
its measurement, cache and online refinement (mlx_mtp.costs), the planner's
ledger (mlx_mtp.planner), and exactness of every method's ``auto`` default."""

from __future__ import annotations

import json
import warnings

import mlx.core as mx
import numpy as np
import pytest
from conftest import decode
from tiny_models import make_tiny_model

import mlx_mtp.budget as budget
import mlx_mtp.costs as costs
import mlx_mtp.planner as planner
from mlx_mtp.acceptance import DepthAcceptance, chain_values
from mlx_mtp.allocate import build_tree
from mlx_mtp.budget import CostCurve, CostCurves, best_prefix
from mlx_mtp.context import Context
from mlx_mtp.costs import LiveCurves, curve_key, curve_path, device_curves, measure_cost_curves
from mlx_mtp.engine import Engine
from mlx_mtp.errors import InvalidArgumentError
from mlx_mtp.methods import make_method
from mlx_mtp.methods.base import DraftMethod
from mlx_mtp.offers import chain_offer

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


class _Oracle(DraftMethod):
    """auto: a chain of four guesses after every root: wrong ones (never
    accepted) until the text reaches position ``right_from``, then the
    reference continuation; ``free`` offers are scored at plain steps. Logs
    ``(position, kind)`` of every step."""

    name, auto = "oracle-chain", True

    def __init__(self, ref: list[int], right_from: int | None = None, free: bool = False):
        self.ref, self.right_from, self.free = ref, right_from, free
        self.log: list[tuple[int, str]] = []

    def begin(self, ctx, prompt, sampler):
        self.seq = list(prompt)

    def propose(self, ctx, root):
        n = len(self.seq)
        right = self.right_from is not None and n >= self.right_from
        guess = self.ref[n : n + 4] if right else [(root + 1) % 256] * 4
        return chain_offer(root, guess, "oracle", ctx.acceptance, free=self.free)

    def observe(self, ctx, draft, result):
        self.log.append((len(self.seq), "plain" if draft is None else "draft"))
        self.seq += result.tokens


@pytest.fixture
def ledgers(monkeypatch):
    """Every planner that finishes a generation, in order."""
    seen = []
    real = planner.Planner.finish

    def finish(self):
        seen.append(self)
        real(self)

    monkeypatch.setattr(planner.Planner, "finish", finish)
    return seen


def _tiny_ref(prompt: list[int], n: int):
    model = make_tiny_model("llama", seed=0)
    return model, prompt + decode(Engine(model), make_method("ntp"), prompt, n)[0]


@pytest.mark.parametrize("free", [False, True], ids=["probes", "shadows"])
def test_drafting_loses_at_most_epsilon_of_a_generation_plus_a_step(ledgers, free):
    """Drafts that are never accepted, on a CPU-like curve, priced by the
    curve: the generation's loss against plain steps stays within
    ``EPSILON`` of its time plus one plain step and one draft step. An offer
    that costs device work is probed now and then, paid from that credit; a
    free one is scored at plain steps instead and never probed."""
    prompt = [3, 5, 7, 9, 11, 13]
    model, ref = _tiny_ref(prompt, 300)
    method = _Oracle(ref, free=free)
    out, stats = decode(Context(Engine(model), curves=CPU_CURVE), method, prompt, 300)
    assert out == ref[len(prompt) :] and stats.accepted == 0
    p = ledgers[-1]
    worst_draft = CPU_CURVE(5) - 1.0  # a draft step of four rejected tokens
    assert 0 < p.ledger.loss <= planner.EPSILON * p.ledger.time + 1.0 + worst_draft
    drafts = sum(kind == "draft" for _, kind in method.log)
    if free:
        assert stats.reprobes == 0 and drafts <= 2, method.log[:10]
    else:
        # the prior's drafts, then probes spread over the generation as its
        # credit grows
        assert stats.reprobes >= 3 and drafts <= stats.reprobes + 2
        first = [pos for pos, kind in method.log if kind == "draft"]
        assert first[-1] - first[0] > 150


@pytest.mark.parametrize("free", [False, True], ids=["probes", "shadows"])
def test_right_drafts_run_on_a_flat_curve_never_on_a_steep_one(free):
    """Drafts that are always right: every step drafts on a memory-bound
    device; where every slot costs a whole forward not even a certain draft
    pays, and no step drafts (no probe either)."""
    prompt = [3, 5, 7, 9, 11, 13]
    model, ref = _tiny_ref(prompt, 60)
    for curve, drafting in ((GPU_CURVE, True), (STEEP_CURVE, False)):
        method = _Oracle(ref, right_from=0, free=free)
        out, stats = decode(Context(Engine(model), curves=curve), method, prompt, 60)
        assert out == ref[len(prompt) :]
        if drafting:
            assert stats.plain_steps <= 1 and stats.tau > 3.5
        else:
            assert stats.drafted == 0 and stats.reprobes == 0


def test_drafting_comes_back_within_a_few_tokens_of_a_copy():
    """Wrong drafts for 80 tokens, then the text turns predictable (the
    drafts are right from there): shadow scoring at plain steps raises the
    estimates, and a draft step comes within a few tokens, with no probe."""
    prompt = [3, 5, 7, 9, 11, 13]
    model, ref = _tiny_ref(prompt, 160)
    turn = len(prompt) + 80
    method = _Oracle(ref, right_from=turn, free=True)
    out, stats = decode(Context(Engine(model), curves=CPU_CURVE), method, prompt, 160)
    assert out == ref[len(prompt) :] and stats.reprobes == 0
    before = [pos for pos, kind in method.log if kind == "draft" and pos < turn]
    after = [pos for pos, kind in method.log if kind == "draft" and pos >= turn]
    assert len(before) <= 2 and after and after[0] - turn <= 5, method.log
    assert stats.tau > 1.5


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
    (the planner's cut: a node adds its probability and 2 slots, the root and
    its mask 2 slots), a one-token step when nothing pays. A step commits
    2 tokens when the truth is among the tree's nodes, else 1, and takes
    ``curve(slots)`` time. Returns (tau, tokens per unit of time, mean BC)."""
    tokens = time = slots_sum = 0.0
    for node_p, truth in steps:
        if nodes is None:
            n, rate = best_prefix(curve, node_p, 2, base_slots=2)
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
    $MLX_MTP_HOME, with no curves kept in the process."""
    monkeypatch.setenv("MLX_MTP_HOME", str(tmp_path))
    monkeypatch.delenv("MLX_MTP_COST_CURVE", raising=False)  # conftest pins one
    costs.forget_device_curves()
    calls = []
    real = costs.measure_cost_curve

    def measure(engine, sizes=(1, 2, 4), repeats=1, progress=False):
        calls.append(engine)
        return real(engine, sizes, repeats)

    monkeypatch.setattr(costs, "measure_cost_curve", measure)
    yield calls
    costs.forget_device_curves()


def _engine(model):
    eng = Engine(model)
    eng.sync(list(range(3, 15)))
    return eng


def test_curve_cache_reused_per_model_device_dtype(counted, tmp_path):
    model = make_tiny_model("llama", seed=4)
    eng = _engine(model)
    first = device_curves(eng)
    assert len(counted) == 1  # a short warm-up at the current context
    assert eng.offset == 12 and eng.forward_passes == 0  # the cache is as it was
    assert device_curves(_engine(model)) is first  # one per model in the process
    path = curve_path(curve_key(eng), tmp_path)
    data = json.loads(path.read_text())
    assert data["key"]["dtype"] == "float32" and data["format"] == costs.CURVE_FORMAT
    assert [c["context"] for c in data["curves"]] == [12]
    assert data["curves"][0]["sizes"] == [1, 2, 4] and data["curves"][0]["seconds"] > 0
    costs.forget_device_curves()  # a new process: read back, not measured
    again = device_curves(_engine(model))
    assert again.at(12).costs == pytest.approx(first.at(12).costs, abs=1e-4)
    assert len(counted) == 1
    # another dtype, another model: measured again, not read
    model16 = make_tiny_model("llama", seed=4)
    model16.set_dtype(mx.float16)
    device_curves(_engine(model16))
    device_curves(_engine(make_tiny_model("llama", seed=5)))
    assert len(counted) == 3
    assert len(list(path.parent.glob("*.json"))) == 3
    assert not list(path.parent.glob(".tmp-*"))  # atomic writes leave nothing behind
    # a file of the older one-curve layout is measured again, not misread
    path.write_text(json.dumps({"format": 1, "key": data["key"], "curve": data["curves"][0]}))
    costs.forget_device_curves()
    device_curves(_engine(model))
    assert len(counted) == 4 and json.loads(path.read_text())["format"] == costs.CURVE_FORMAT


def test_corrupt_curve_cache_is_ignored_with_a_warning(counted, tmp_path):
    model = make_tiny_model("llama", seed=4)
    device_curves(_engine(model))
    path = curve_path(curve_key(_engine(model)), tmp_path)
    path.write_text('{"format": 3, "key": ')  # half a file
    costs.forget_device_curves()
    with pytest.warns(UserWarning, match="corrupt cost-curve cache"):
        curve = device_curves(_engine(model)).at(12)
    assert len(counted) == 2 and curve(1) == 1.0
    assert json.loads(path.read_text())["curves"][0]["sizes"] == [1, 2, 4]  # rewritten
    costs.forget_device_curves()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        device_curves(_engine(model))  # a good file again: no warning, no measuring
    assert len(counted) == 2


def test_long_context_curve_leaves_the_cache_as_it_was(monkeypatch):
    """The full measurement's second curve is timed 1024 tokens further on;
    the cache, its tokens, the statistics and the next logits are those of
    before."""
    model = make_tiny_model("llama", seed=6)
    eng, ref = _engine(model), _engine(model)
    curves = measure_cost_curves(eng, repeats=1)
    assert [c.context for c in curves.curves] == [12, 12 + costs.LONG_CONTEXT_EXTRA]
    assert eng.offset == 12 and eng.cached == ref.cached and eng.forward_passes == 0
    assert eng.last_prefill == ref.last_prefill
    a, _ = eng.forward_chain([7, 8])
    b, _ = ref.forward_chain([7, 8])
    assert mx.allclose(a, b, atol=1e-5)
    # a sliding-window cache cannot drop 1024 tokens: one curve only
    win = Engine(model, max_kv_size=64)
    win.sync(list(range(3, 15)))
    assert len(measure_cost_curves(win, repeats=1).curves) == 1


def test_live_curve_learns_from_the_passes_a_generation_runs(tmp_path, monkeypatch):
    """One-slot passes set the one-slot time; an n-slot pass moves the
    correction at the sizes around n towards measured / predicted; a pinned
    curve never moves; what was learned is saved and read back."""
    base = CostCurves([CostCurve([1, 8, 16], [1.0, 1.5, 2.0], context=0, seconds=0.1)])
    key = {"model": "m", "device": "d", "dtype": "float32"}
    live = LiveCurves(base, key)
    assert live.at(0)(8) == pytest.approx(1.5) and live.t1 == 0.1
    for _ in range(40):  # the device got slower at 8 slots: 0.3 s, i.e. c(8) = 3
        live.observe(8, 0.3, context=0)
    assert live.at(0)(8) == pytest.approx(3.0, rel=0.01)
    assert live.at(0)(16) >= live.at(0)(8)  # never falls with more slots
    for _ in range(40):  # and at one slot: 0.15 s per token, so c(8) = 2 again
        live.observe(1, 0.15, context=0)
    assert live.t1 == pytest.approx(0.15, rel=0.01)
    k8, k16 = live.k[1], live.k[2]
    live.observe(12, 0.6, context=0)  # between two sizes: both move
    assert live.k[1] > k8 and live.k[2] > k16
    monkeypatch.setenv("MLX_MTP_HOME", str(tmp_path))
    live.save()
    saved = costs.load_curve(key)
    assert saved.at(0).costs == pytest.approx(live.at(0).costs, abs=1e-3)
    assert saved.at(0).seconds == pytest.approx(live.t1)
    pinned = LiveCurves(base, learn=False)
    pinned.observe(8, 10.0, context=0)
    assert pinned.at(0)(8) == pytest.approx(1.5)


def test_a_wide_pass_corrects_the_narrower_sizes_it_bounds():
    """A size priced high (a noisy warm-up timing) that the cut then avoids is
    still corrected: a pass of more slots that cost less bounds it, since
    ``c`` never falls with more slots; sizes priced below it are left."""
    base = CostCurves(
        [CostCurve([1, 2, 3, 4, 8], [1.0, 1.45, 1.45, 1.45, 1.6], context=0, seconds=1.0)]
    )
    live = LiveCurves(base)
    assert live.at(0)(2) == pytest.approx(1.45)
    for _ in range(30):  # passes of 4 slots take 1.1 one-slot times
        live.observe(1, 1.0, context=0)
        live.observe(4, 1.1, context=0)
    c = live.at(0)
    assert c(4) == pytest.approx(1.1, rel=0.02)
    assert c(2) <= 1.12 and c(3) <= 1.12
    assert c(8) == pytest.approx(1.6)  # larger sizes: no evidence either way
    cheap = LiveCurves(CostCurves([CostCurve([1, 2, 4], [1.0, 1.02, 1.3], seconds=1.0)]))
    for _ in range(10):
        cheap.observe(4, 1.3, context=0)
    assert cheap.at(0)(2) == pytest.approx(1.02)  # already below: unchanged


def test_monotone_fit_pools_an_outlier_instead_of_raising_every_larger_size():
    assert costs.monotone([1.0, 1.45, 1.1, 1.1, 1.5]) == pytest.approx(
        [1.0, 1.2167, 1.2167, 1.2167, 1.5], abs=1e-3
    )
    assert costs.monotone([1.0, 1.1, 1.3]) == [1.0, 1.1, 1.3]  # already increasing
    assert costs.monotone([1.0, 0.9, 0.95, 1.2]) == [1.0, 1.0, 1.0, 1.2]  # never below 1


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
    with pytest.raises(ValueError):
        CostCurves([])


def test_auto_plans_with_the_curve_of_the_current_context():
    """Free slots at a short context, a whole forward each at a long one:
    pld drafts every step on the short prompt and goes to one-token steps on
    the long one (same text at the end, so only the context differs)."""

    model = make_tiny_model("llama", seed=2)
    text = [5, 6, 7, 8, 9] * 4
    curves = CostCurves(
        [CostCurve([1, 64], [1.0, 1.0], context=0), CostCurve([1, 64], [1.0, 64.0], context=200)]
    )
    plain = {}
    for name, prompt in (("short", text), ("long", list(range(3, 303)) + text)):
        ctx = Context(Engine(model), curves=curves)
        method = make_method("pld")
        method.prepare(ctx)
        plain[name] = decode(ctx, method, prompt, 24)[1].plain_steps
    assert plain["short"] == 0 and plain["long"] > 0, plain


def test_curve_of_the_context_wins_then_the_pinned_one(counted, monkeypatch):

    model = make_tiny_model("qwen3", seed=1)
    ctx = Context(_engine(model), curves=GPU_CURVE)
    method = make_method("pld")
    method.prepare(ctx)
    decode(ctx, method, [5, 6, 7] * 5, 8)
    assert not counted  # the context's curve: nothing measured
    monkeypatch.setenv("MLX_MTP_COST_CURVE", "1:1,8:1.5")
    assert device_curves(_engine(model)).at(0)(8) == 1.5 and not counted  # pinned
    monkeypatch.setenv("MLX_MTP_COST_CURVE", "2:1,8:x")
    with pytest.raises(InvalidArgumentError, match="MLX_MTP_COST_CURVE"):
        device_curves(_engine(model))
    monkeypatch.delenv("MLX_MTP_COST_CURVE")
    eng, ref = _engine(model), _engine(model)
    device_curves(eng)
    assert len(counted) == 1
    a, _ = eng.forward_chain([7, 8])
    b, _ = ref.forward_chain([7, 8])
    assert mx.array_equal(a, b)


# ------------------------------------------------------- auto is exact (real)
#: methods whose auto switches between draft steps and plain mode; at their
#: defaults on a memory-bound device (large trees) every method is
#: tests/test_lossless.py (the suite's pinned curve)
AUTO_CASES = [("pld", CPU_CURVE), ("probe", CPU_CURVE), ("hybrid", CPU_CURVE), ("clp", STEEP_CURVE)]


@pytest.mark.parametrize("name,curve", AUTO_CASES, ids=[n for n, _ in AUTO_CASES])
def test_auto_defaults_are_exact_on_smollm(smollm, smollm_case, monkeypatch, name, curve):
    """Each method at its default (auto) reproduces plain greedy decoding in
    float32 on a CPU-like curve: pipelined one-token steps between draft
    steps and probes."""
    (prompt, n), engine = smollm_case.prompts[0], smollm_case.engines[0]
    ctx = Context(engine, smollm, curves=curve)
    method = make_method(name)
    method.prepare(ctx)
    out, stats = decode(ctx, method, prompt, n)
    assert out == smollm_case.greedy(prompt, n), (name, method.describe())
    # plain steps and drafts on the CPU curve; nothing pays on the steep one
    assert stats.plain_steps > 0
    assert stats.drafted > 0 if curve is CPU_CURVE else stats.drafted == 0


# ------------------------------------------------- keys, steps, the whole step
def test_curve_keys_name_quantization_dtype_and_mlx_version(monkeypatch):
    import mlx.nn as nn

    model = make_tiny_model("llama", seed=4)
    key = curve_key(Engine(model))
    assert key["quantization"] == "none" and key["mlx"] == mx.__version__
    bf16 = make_tiny_model("llama", seed=4)
    bf16.set_dtype(mx.bfloat16)
    q8 = make_tiny_model("llama", seed=4)
    nn.quantize(q8, group_size=32, bits=8)
    kb, kq = curve_key(Engine(bf16)), curve_key(Engine(q8))
    assert kb["dtype"] == "bfloat16" and kq["quantization"] == "affine-8b-g32"
    assert len({curve_path(k) for k in (key, kb, kq)}) == 3  # three files
    monkeypatch.setattr(mx, "__version__", "0.0.1")
    assert curve_path(curve_key(Engine(model))) != curve_path(key)  # another MLX: measured again


def test_measured_curve_never_prices_a_kernel_step_below_what_was_measured():
    """A device whose cost doubles past 32 rows (Metal's 32-row tiles): the
    curve measured at the default sizes prices every size from 33 on at least
    at the step, where linear interpolation over the old sizes (32, 48)
    priced 33-47 slots below it."""

    def true_cost(n):  # flat, then twice as dear from 33 rows on
        return 1.0 + 0.01 * n if n <= 32 else 2.0 + 0.01 * n

    sizes = list(costs.CURVE_SIZES)
    measured = CostCurve(sizes, [true_cost(s) / true_cost(1) for s in sizes], measured=True)
    for n in range(1, 65):
        assert measured(n) >= true_cost(n) / true_cost(1) - 1e-9, n
    old = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    linear = CostCurve(old, [true_cost(s) / true_cost(1) for s in old])
    assert linear(40) < true_cost(40) / true_cost(1) - 0.3  # what the old sampling did
    assert 33 in sizes and all(s in sizes for s in range(1, 17))


def test_host_work_counts_in_the_cut():
    """A draft step also pays the host work of drafting and verifying: a
    prefix worth 1.02x on forward time alone does not pay once a step costs
    0.2 forwards of host work more."""
    flat = CostCurve.flat(16, 0.003)
    vals = [0.02] * 4  # a weak draft: +2% tokens, nearly free slots
    n, rate = best_prefix(flat, vals, 1)
    assert n == 4 and rate > 1.0
    n, rate = best_prefix(flat, vals, 1, base_cost=0.2)
    assert rate < 1.0
