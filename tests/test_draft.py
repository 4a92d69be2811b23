"""Draft-model speculative decoding (``--method draft``, and the draft model as
a source of ``hybrid``): exact vs plain greedy decoding in float32 on pairs
made for the test (tiny random models with one tokenizer), the tokenizer check,
multi-turn cache reuse, and the real Qwen2.5-Coder pair (sampling through the
shared verification: tests/test_speculative.py)."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest
from conftest import decode
from tiny_models import make_tiny_model

from mlx_mtp.budget import CostCurve
from mlx_mtp.context import Context
from mlx_mtp.engine import Engine
from mlx_mtp.errors import InvalidArgumentError, UnsupportedModelError
from mlx_mtp.methods import make_method


class ByteTokenizer:
    """A tokenizer of the tiny models: one id per byte (mod ``vocab``)."""

    def __init__(self, vocab: int = 256, shift: int = 0, eos: tuple[int, ...] = ()):
        self.vocab = {str(i): i for i in range(vocab)}
        self.shift, self.eos_token_ids = shift, list(eos)

    def encode(self, text: str) -> list[int]:
        return [(b + self.shift) % len(self.vocab) for b in text.encode("utf-8")]


def _loaded(model, name, tok=None):
    return types.SimpleNamespace(
        model=model, tokenizer=tok or ByteTokenizer(), name=name, dtype="float32", path=Path(".")
    )


@pytest.fixture(scope="module")
def pair():
    """(target, a draft close to it, an unrelated draft): tiny llama models of
    one byte tokenizer. The close draft is the target with slightly perturbed
    weights, so most (not all) of its drafts are accepted."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    target = make_tiny_model("llama", seed=11)
    close = make_tiny_model("llama", seed=11)
    mx.random.seed(3)
    noisy = [(k, v + 0.05 * mx.random.normal(v.shape)) for k, v in tree_flatten(close.parameters())]
    close.update(tree_unflatten(noisy))
    far = make_tiny_model("llama", seed=12, num_hidden_layers=1)
    return _loaded(target, "target"), _loaded(close, "close"), _loaded(far, "far")


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(rng.integers(4, 20))).tolist() for _ in range(n)]


def _run(target, name, prompts, n=40, curve=None, sampler=None, **opts):
    ctx = Context(Engine(target.model), target, curves=curve)
    m = make_method(name, **opts)
    m.prepare(ctx)
    outs, stats = [], []
    for p in prompts:
        out, st = decode(ctx, m, p, n, sampler=sampler)
        outs.append(out)
        stats.append(st)
    return outs, stats, m


@pytest.mark.parametrize(
    "opts",
    [
        {"shape": "chain", "num_draft_tokens": 2},
        {"shape": "chain", "num_draft_tokens": 4},
        {"shape": "tree", "num_draft_tokens": 3},
        {"shape": "tree", "width": 2},
        {},
    ],
    ids=["chain-k2", "chain-k4", "tree-k3", "tree-auto-w2", "defaults"],
)
def test_draft_equals_greedy_on_many_prompts(pair, opts):
    target, close, far = pair
    prompts = _prompts(8)
    ref, _, _ = _run(target, "ntp", prompts)
    flat = CostCurve.flat(16, 0.003)
    for draft in (close, far):
        outs, stats, _ = _run(target, "draft", prompts, curve=flat, draft_model=draft, **opts)
        assert outs == ref, (draft.name, opts)
    # the close draft really drafts and is accepted (no silent plain decoding)
    _, stats, _ = _run(target, "draft", prompts, curve=flat, draft_model=close, **opts)
    assert sum(s.accepted for s in stats) > 0.3 * sum(s.generated_tokens for s in stats)


def test_tree_accepts_alternatives_the_chain_misses(pair):
    """The tree verifies the draft's next most probable tokens too: with the
    same depth it commits at least as many tokens per target pass."""
    target, close, _ = pair
    prompts = _prompts(8, seed=1)
    flat = CostCurve.flat(16, 0.003)
    _, chain, _ = _run(
        target, "draft", prompts, curve=flat, draft_model=close, shape="chain", num_draft_tokens=3
    )
    _, tree, _ = _run(
        target,
        "draft",
        prompts,
        curve=flat,
        draft_model=close,
        shape="tree",
        num_draft_tokens=3,
        width=4,
    )
    tau = lambda sts: sum(s.generated_tokens for s in sts) / sum(s.forward_passes for s in sts)  # noqa: E731
    assert tau(tree) >= tau(chain) > 1.2


def test_hybrid_takes_the_draft_model_as_a_source(pair):
    target, close, _ = pair
    prompts = _prompts(4, seed=2)
    ref, _, _ = _run(target, "ntp", prompts)
    for bc in ("12", "auto"):
        outs, stats, m = _run(
            target, "hybrid", prompts, curve=CostCurve.flat(16, 0.003), bc=bc, draft_model=close
        )
        assert outs == ref and "draft=close" in m.describe()
        assert sum(s.accepted for s in stats) > 0


def test_auto_stops_drafting_when_draft_passes_cost_too_much(pair):
    """On a CPU-like curve with a draft pass as dear as a target one, auto
    drafts little and runs plain steps; on a flat curve it drafts deep."""
    target, close, _ = pair
    prompts = _prompts(3, seed=3)
    ref, _, _ = _run(target, "ntp", prompts, n=32)
    steep = CostCurve.linear(1.0)
    outs, stats, m = _run(target, "draft", prompts, n=32, curve=steep, draft_model=close)
    m.source.draft_cost = 1.0
    assert outs == ref and sum(s.plain_steps for s in stats) > 0
    outs, stats, _ = _run(
        target, "draft", prompts, n=32, curve=CostCurve.flat(64, 0.0), draft_model=close
    )
    assert outs == ref and max(s.slots_per_forward for s in stats) > 3


def test_auto_opens_with_short_chains_and_drafts_deeper_as_drafts_gain(pair):
    """The draft model sizes its chain by the planner's ledger: a chain whose
    drafts, all rejected, would lose more than half the credit is not made.
    A generation opens with a one-token chain (a draft pass as dear as a
    target one: a second would risk more than half of one plain step) and
    chains grow once drafts have gained."""
    target, close, _ = pair
    prompts = _prompts(2, seed=5)
    ref, _, _ = _run(target, "ntp", prompts, n=40)
    ctx = Context(Engine(target.model), target, curves=CostCurve.flat(64, 0.0))
    m = make_method("draft", draft_model=close)
    m.prepare(ctx)
    for p in prompts:
        chains: list[int] = []
        inner = m.source._stepwise

        def stepwise(*args, inner=inner, chains=chains, **kwargs):
            rows = inner(*args, **kwargs)
            chains.append(len(rows))
            return rows

        m.source._stepwise = stepwise
        out, _ = decode(ctx, m, p, 40)
        m.source._stepwise = inner
        assert out == ref[prompts.index(p)]
        assert chains[0] == 1 and max(chains) >= 3, chains


def _count_calls(obj, name, log):
    """Wrap ``obj.name`` so that each call appends to ``log``."""
    inner = getattr(obj, name)

    def counted(*args, **kwargs):
        log.append(name)
        return inner(*args, **kwargs)

    setattr(obj, name, counted)


@pytest.mark.parametrize("k,n", [(2, 31), (4, 32)])
def test_fixed_chain_runs_k_draft_passes_and_one_sync_per_step(pair, k, n):
    """mlx-lm's draft loop: a step of a fixed chain runs k draft passes (the
    last draft of a step that accepted every draft goes into the next step's
    first pass, not a pass of its own) and reads them in one synchronisation,
    the passes queued one behind the other on the device."""
    target, _, _ = pair
    # the target drafting for itself: every draft is accepted
    same = _loaded(target.model, "same")
    ctx = Context(Engine(target.model), target, curves=CostCurve.flat(16, 0.003))
    m = make_method("draft", draft_model=same, shape="chain", num_draft_tokens=k)
    m.prepare(ctx)
    eng = m.source.engine
    calls: list[str] = []
    _count_calls(eng, "backbone", calls)
    _count_calls(eng.clock, "wait", calls)
    prompt = _prompts(1, seed=5)[0]
    ref, _ = decode(Context(Engine(target.model)), make_method("ntp"), prompt, n)
    out, stats = decode(ctx, m, prompt, n)
    assert out == ref
    # every draft accepted; the last step drafts only what can still be kept
    steps, last = stats.forward_passes, (n - 1) % (k + 1)
    assert stats.accept_lengths == [k + 1] * (steps - 1) + [last + 1]
    assert stats.accepted == stats.drafted == k * (steps - 1) + last
    # the prompt's prefill (one backbone call), then the drafts' passes; one
    # wait per step that drafts
    assert calls.count("backbone") == 1 + stats.drafted
    assert calls.count("wait") == steps - (last == 0)


def test_draft_at_a_queued_root_feeds_the_root_once(pair):
    """After a pipelined plain step the target's cache holds the root's queued
    pass already: the draft model feeds the root once, after the committed
    tokens before it (else its drafts follow a doubled root)."""
    target, close, _ = pair
    ctx = Context(Engine(target.model), target, curves=CostCurve.flat(16, 0.003))
    m = make_method("draft", draft_model=close, shape="chain", num_draft_tokens=3)
    m.prepare(ctx)
    prompt = _prompts(1, seed=6)[0]
    ctx.engine.sync(prompt)  # the root (prompt's last token) is in the cache: queued
    root = prompt[-1]
    ctx.plain = types.SimpleNamespace(holds=lambda engine, r: r == root)
    ctx.budget = types.SimpleNamespace(
        acceptance=types.SimpleNamespace(q=lambda source, d: 1.0), t1=None
    )
    m.source.begin(prompt[:-1] + [root])
    chains = m.source.candidates(ctx, root, 3, auto=False)
    fresh = Context(Engine(close.model), close)
    ref, _ = decode(fresh, make_method("ntp"), prompt, 3)
    assert chains[0][1] == ref
    assert m.source.engine.cached == [*prompt, *ref[:2]]


def test_a_simulated_device_runs_the_draft_model_in_its_weight_bytes(pair, simulate):
    """On a simulated device (``MLX_MTP_SIMULATE_DEVICE``) a draft pass takes
    the simulated target pass's time scaled by the two models' weight bytes
    (a memory-bound pass reads every weight once), and the target's virtual
    clock counts those passes at that time, not at this machine's compute."""
    from mlx_mtp.bench.simulate import SimulatedClock
    from mlx_mtp.memory import weight_bytes

    simulate("ms_per_token=40,curve=1:1,64:1")
    target, _, far = pair
    ratio = weight_bytes(far.model) / weight_bytes(target.model)
    assert 0.2 < ratio < 0.8  # the one-layer draft model
    ctx = Context(Engine(target.model), target, curves=CostCurve.flat(16, 0.003))
    assert isinstance(ctx.engine.clock, SimulatedClock)
    m = make_method("draft", draft_model=far, shape="chain", num_draft_tokens=2)
    m.prepare(ctx)
    out, stats = decode(ctx, m, _prompts(1, seed=7)[0], 30)
    steps = stats.forward_passes
    drafts = stats.drafted  # one draft pass per drafted token
    device = 0.040 * (steps + ratio * drafts)
    # host work (this machine's Python around the passes) comes on top
    assert device <= stats.decode_time < device + 0.02 * steps


def test_the_last_token_is_one_plain_step_not_a_spell_of_plain_mode(pair):
    """A step with one token left drafts nothing (no draft could be kept) and
    is not counted as plain mode."""
    target, close, _ = pair
    ctx = Context(Engine(target.model), target, curves=CostCurve.flat(16, 0.003))
    m = make_method("draft", draft_model=close)
    m.prepare(ctx)
    prompt = _prompts(1, seed=8)[0]
    ref, _ = decode(Context(Engine(target.model)), make_method("ntp"), prompt, 1)
    out, stats = decode(ctx, m, prompt, 1)
    assert out == ref
    assert stats.drafted == 0 and stats.plain_steps == 0 and stats.plain_spells == 0


def test_mismatched_tokenizer_and_missing_draft_are_refused(pair):
    target, close, _ = pair
    shifted = _loaded(close.model, "shifted", ByteTokenizer(shift=1))
    ctx = Context(Engine(target.model), target)
    with pytest.raises(UnsupportedModelError, match="tokenizer encodes"):
        make_method("draft", draft_model=shifted).prepare(ctx)
    other_eos = _loaded(close.model, "eos", ByteTokenizer(eos=(7,)))
    with pytest.raises(UnsupportedModelError, match="end-of-sequence"):
        make_method("draft", draft_model=other_eos).prepare(ctx)
    with pytest.raises(InvalidArgumentError, match="--draft-model"):
        make_method("draft")
    with pytest.raises(InvalidArgumentError, match="width"):
        make_method("draft", draft_model=close, width=0)
    with pytest.raises(InvalidArgumentError, match="shape=chain"):
        make_method("draft", draft_model=close, shape="chain", width=3)


def test_draft_cache_stays_in_step_across_turns(pair):
    """A second turn reuses both caches by prefix and equals a fresh run."""
    target, close, _ = pair
    ctx = Context(Engine(target.model), target, curves=CostCurve.flat(16, 0.003))
    m = make_method("draft", draft_model=close)
    m.prepare(ctx)
    first = [5, 17, 99, 3, 42]
    out1, _ = decode(ctx, m, first, 20)
    turn2 = first + out1 + [7, 8, 9]
    out2, _ = decode(ctx, m, turn2, 20)
    assert m.source.engine.cached[: len(turn2) - 1] == turn2[:-1]
    ref, _ = decode(Context(Engine(target.model)), make_method("ntp"), turn2, 20)
    assert out2 == ref


# ------------------------------------------------------------ the real pair
#: Qwen2.5-Coder-1.5B-Instruct's greedy continuation (float32, this package's
#: ntp) of PAIR_PROMPT, recorded once: the imported model is checked against it
PAIR_PROMPT = "Write a Python function that returns the squares of a list of numbers."
PAIR_REFERENCE = [73594, 12669, 198, 750, 9334, 32964, 47207, 982, 262, 3190, 262, 1096]


def _real_pair_exact(qwen_large, qwen, prompts, settings, n=12):
    """Qwen2.5-Coder-0.5B drafting for Qwen2.5-Coder-1.5B (one tokenizer) with
    each of ``settings`` equals plain greedy decoding in float32 on
    ``prompts``, and the draft is accepted often (a real draft source)."""
    from conftest import memoised_greedy

    from mlx_mtp.data import render_prompt

    greedy = memoised_greedy(Engine(qwen_large.model))
    chat = [render_prompt(qwen_large.tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    refs = [greedy(ids, n) for ids in chat]
    assert (
        refs[0][:12] == PAIR_REFERENCE
    )  # the recorded greedy reference ("```python\ndef square_")
    for opts in settings:
        m = qwen_large.bind("draft", draft_model=qwen, **opts)
        acc = gen = 0
        for p, ref in zip(prompts, refs):
            r = m.generate(p, max_tokens=n)
            assert r.tokens == ref, (opts, p)
            acc, gen = acc + r.stats.accepted, gen + r.stats.generated_tokens
        assert acc > 0.3 * gen, opts  # most tokens come from the draft


def test_real_pair_draft_equals_greedy(qwen_large, qwen):
    """The real pair's one short check in CI (a 1.5B model in float32 runs at
    about 1-2 tokens/s here): the default tree at auto, one prompt x 12."""
    _real_pair_exact(qwen_large, qwen, [PAIR_PROMPT], [{}])


@pytest.mark.slow
def test_real_pair_draft_equals_greedy_sweep(qwen_large, qwen):
    """mlx-lm's chain and the tree, fixed and auto, on two prompts x 32."""
    prompts = [PAIR_PROMPT, "Explain what a hash map is in two sentences."]
    settings = [
        {"shape": "chain", "num_draft_tokens": 3},
        {"shape": "tree", "num_draft_tokens": 3},
        {},
    ]
    _real_pair_exact(qwen_large, qwen, prompts, settings, n=32)


def test_real_pair_tokenizers_agree_and_others_are_refused(qwen_large, qwen, smollm):
    from mlx_mtp.loading import check_tokenizers

    check_tokenizers(qwen_large.tokenizer, qwen.tokenizer, "1.5b", "0.5b")
    with pytest.raises(UnsupportedModelError, match="tokenizer"):
        qwen_large.bind("draft", draft_model=smollm)


def test_cli_draft_model_flags():
    """``generate --method draft --draft-model M --num-draft-tokens N`` prints the
    greedy answer (SmolLM2 drafting for itself: every draft token accepted);
    the flags are refused by a method that takes no draft model."""
    from typer.testing import CliRunner

    from mlx_mtp.cli import app

    runner = CliRunner()
    base = ["generate", "-p", "List three colours.", "-n", "16", "--dtype", "float32"]
    ntp = runner.invoke(app, [*base, "--method", "ntp"])
    assert ntp.exit_code == 0, ntp.output
    args = ["--method", "draft", "--draft-model", "smollm2-135m", "--num-draft-tokens", "3"]
    res = runner.invoke(app, [*base, *args])
    assert res.exit_code == 0, res.output
    assert res.stdout == ntp.stdout
    bad = runner.invoke(app, [*base, "--method", "pld", "--draft-model", "smollm2-135m"])
    assert isinstance(bad.exception, InvalidArgumentError)
    assert "draft_model" in str(bad.exception)


def test_hybrid_runs_a_draft_model_only_while_it_pays(monkeypatch):
    """hybrid at auto: a draft model's passes are spent before the planner
    cuts the offer, so one whose candidates earn less than its passes cost
    sits out (and retries now and then) while the other sources go on; one
    that earns drafts every step. Both exact."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    from mlx_mtp.sources.draft import DraftModel

    calls = []
    real = DraftModel.candidates

    def spy(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DraftModel, "candidates", spy)
    target = make_tiny_model("qwen2", seed=11)  # untied: no repeat-the-token drafts
    close = make_tiny_model("qwen2", seed=11)
    mx.random.seed(3)
    noisy = [(k, v + 0.05 * mx.random.normal(v.shape)) for k, v in tree_flatten(close.parameters())]
    close.update(tree_unflatten(noisy))
    far = make_tiny_model("qwen2", seed=12)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, 12).tolist() for _ in range(4)]
    t = _loaded(target, "target")
    ref = [decode(Engine(target), make_method("ntp"), p, 40)[0] for p in prompts]
    share = {}
    for draft in (_loaded(close, "close"), _loaded(far, "far")):
        calls.clear()
        ctx = Context(Engine(target), t, curves=CostCurve.flat(16, 0.003))
        m = make_method("hybrid", bc="auto", draft_model=draft, pool=0, matches=0)
        m.prepare(ctx)
        m.draft.draft_cost = 0.1  # a draft pass: a tenth of a target forward
        runs = [decode(ctx, m, p, 40) for p in prompts]
        assert [out for out, _ in runs] == ref, draft.name
        share[draft.name] = len(calls) / sum(s.steps - s.plain_steps for _, s in runs)
    assert share["close"] > 0.9 and share["far"] < 0.25, share


@pytest.mark.parametrize(
    "opts",
    [{"shape": "chain", "num_draft_tokens": 3}, {"num_draft_tokens": 2}],
    ids=["chain", "tree"],
)
def test_pipelined_draft_equals_greedy_on_the_tiny_pair(pair, opts):
    """The draft model's passes queued ahead of the target's on the lazy
    state, chain and tree: plain greedy decoding on several prompts, drafts
    accepted."""
    target, close, _ = pair
    prompts = _prompts(4)
    ref, _, _ = _run(target, "ntp", prompts)
    ctx = Context(Engine(target.model), target, curves=CostCurve.flat(16, 0.003))
    m = make_method("draft", draft_model=close, **opts)
    m.prepare(ctx)
    accepted = 0
    for p, r in zip(prompts, ref):
        out, stats = decode(ctx, m, p, 40, runner="pipelined")
        assert out == r and stats.runner == "pipelined", opts
        accepted += stats.accepted
    assert accepted > 0


def test_pipelined_draft_model_is_exact(qwen_large, qwen):
    """The same on the real pair (Qwen2.5-Coder-1.5B drafted by 0.5B: qwen2,
    q/k/v biases, untied head), a tree; a second turn reuses both caches."""
    from conftest import memoised_greedy

    from mlx_mtp.data import render_prompt

    # the real pair's CI prompt and length: its greedy reference is decoded once
    prompt = render_prompt(qwen_large.tokenizer, [{"role": "user", "content": PAIR_PROMPT}])
    ref = memoised_greedy(Engine(qwen_large.model))
    ctx = Context(Engine(qwen_large.model), loaded=qwen_large, curves=CostCurve.flat())
    m = make_method("draft", draft_model=qwen, num_draft_tokens=2)
    m.prepare(ctx)
    out, stats = decode(ctx, m, prompt, 12, runner="pipelined")
    assert out == ref(prompt, 12)
    assert stats.accepted > 0 and stats.runner == "pipelined"
    turn2 = prompt + out + prompt[-4:]
    out, _ = decode(ctx, m, turn2, 8, runner="pipelined")
    assert out == ref(turn2, 8)
