"""Pipelined draft steps (mlx_mtp.pipeline): the next pass launched before the
host reads the one in flight, drafts chosen on the device, exact greedy output."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import PIPELINED_SETTINGS, memoised_greedy, setting_ids
from tiny_models import make_tiny_model

from mlx_mtp.budget import CostCurve
from mlx_mtp.context import Context
from mlx_mtp.decoding import generate_steps
from mlx_mtp.engine import Engine, ancestors
from mlx_mtp.methods import make_method
from mlx_mtp.pipeline import CompositeDrafter, DeviceDrafter, StepRecord, Template, device_walk
from mlx_mtp.sources.lookup import (
    SuffixIndex,
    device_lookup,
    lookup_candidates,
    lookup_match,
    match_length,
)
from mlx_mtp.verify import walk_tree


@pytest.fixture(autouse=True)
def pipelined(monkeypatch):
    """Pipelined steps on this CPU too (by default only where passes overlap
    the host: a GPU, a simulated device)."""
    monkeypatch.setenv("MLX_MTP_PIPELINE", "1")


FLAT = CostCurve.flat()  # a memory-bound device: wide drafts pay
STEEP = CostCurve.linear(1.0)  # every slot a whole forward: nothing pays


def _decode(ctx, method, prompt, n, eos=frozenset()):
    out, stats = [], None
    for step in generate_steps(ctx, method, prompt, max_tokens=n, eos_ids=eos):
        out.extend(step.tokens)
        stats = step.stats
    return out, stats


# ----------------------------------------------------------- pure pieces
def test_device_lookup_is_the_host_lookup():
    """The lazy prompt lookup proposes what the host's proposes (then fillers)."""
    rng = np.random.default_rng(0)
    for trial in range(200):
        T = int(rng.integers(1, 60))
        ctx = rng.integers(0, int(rng.integers(2, 9)), size=T)  # small vocab: many matches
        window, width = int(rng.integers(1, 5)), int(rng.integers(1, 12))
        C = T + int(rng.integers(0, 20))
        buf = np.concatenate([ctx, rng.integers(0, 9, size=C - T)]).astype(np.int32)
        got = np.array(device_lookup(mx.array(buf), mx.array(T), window, width)).tolist()
        cands = lookup_candidates(ctx, window, width)
        want = cands[0] if cands else []
        assert got[: len(want)] == want, (trial, ctx.tolist(), window)
        assert got[len(want) :] == [0] * (width - len(want))
        assert (match_length(ctx, window) > 0) == bool(want)


def test_suffix_index_answers_as_the_lookup_on_every_prefix():
    """The incremental n-gram index the pipelined lookup learns with gives
    :func:`lookup_match`'s continuation and n-gram length at every prefix of
    random token lists (a small vocabulary: many matches), indexed a few
    tokens at a time."""
    rng = np.random.default_rng(4)
    for trial in range(60):
        T, window = int(rng.integers(1, 120)), int(rng.integers(1, 5))
        most = int(rng.integers(1, 9))
        toks = rng.integers(0, int(rng.integers(2, 12)), size=T).tolist()
        index, at = SuffixIndex(window), 0
        while at < T:
            at = min(T, at + int(rng.integers(1, 6)))
            index.extend(toks[:at])
        for r in range(T):
            want = lookup_match(np.array(toks[: r + 1]), window, most)
            assert index.match(r, most) == want, (trial, r, toks[: r + 1], window)


def test_device_walk_is_the_host_walk():
    """The device walk commits what verify.walk_tree commits, on random trees
    with distinct sibling tokens."""
    rng = np.random.default_rng(1)
    for trial in range(200):
        n = int(rng.integers(1, 24))
        parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
        tokens = np.zeros(n, dtype=np.int64)
        for i in range(1, n):  # siblings distinct: one matching child at most
            used = {int(tokens[j]) for j in range(1, i) if parents[j] == parents[i]}
            tokens[i] = rng.choice([t for t in range(12) if t not in used])
        targets = rng.integers(0, 12, size=n)
        tpl = Template.of(parents)
        a, path, committed = device_walk(
            mx.array(tokens.astype(np.int32)), mx.array(targets.astype(np.int32)), tpl
        )
        want_path, bonus = walk_tree(np.array(parents), tokens, dict(enumerate(targets.tolist())))
        a = int(a)
        assert a == len(want_path), trial
        assert np.array(path)[1 : a + 1].tolist() == want_path
        want = [int(tokens[s]) for s in want_path] + [int(bonus)]
        assert np.array(committed)[: a + 1].tolist() == want


def test_a_pass_at_a_lazy_length_equals_the_engines_passes_on_every_family():
    """On every tree family whose cache is plain (the others run the
    planner's steps), the logits of a chain and of a tree written at a lazy
    cache length equal forward_chain's / forward_tree's (tiny models: head
    dim 64, grouped KV heads); after settle_at the cache decodes on as if
    nothing else ran."""
    from tiny_models import FAMILY_CONFIGS, TINY_CONFIGS

    from mlx_mtp.families import TREE_FAMILIES

    ran, bad = [], []
    for family in sorted(TREE_FAMILIES & (set(FAMILY_CONFIGS) | set(TINY_CONFIGS))):
        model = make_tiny_model(family, seed=2)
        eng = Engine(model)
        if not eng.lazy_ready():
            continue
        prompt = [int(t) for t in np.random.default_rng(2).integers(1, 200, size=21)]
        eng.sync(prompt)
        L = eng.offset
        for parents in (np.arange(-1, 5), np.array([-1, 0, 0, 1, 2, 1])):
            toks = [5, 77, 120, 8, 99, 31][: len(parents)]
            anc = depth = None
            if len(toks) == 5:
                ref, _ = eng.forward_chain(toks)
            else:
                ref, _ = eng.forward_tree(eng.embed_tokens(toks), parents, toks)
                a, depth = ancestors(parents)
                anc = mx.array(a)
            eng.trim_to(L)
            got, _ = eng.forward_at(mx.array(toks), mx.array(L), L + len(toks) + 7, anc, depth)
            eng.settle_at(prompt)
            err = (mx.abs(got - ref).max() / (mx.abs(ref).max() + 1e-9)).item()
            if err > 1e-4:
                bad.append((family, len(toks), err))
        a, _ = eng.forward_chain([42])
        fresh = Engine(model)
        fresh.sync(prompt)
        b, _ = fresh.forward_chain([42])
        if not mx.allclose(a, b, atol=1e-5).item():
            bad.append((family, "after settle_at"))
        ran.append(family)
    assert not bad, bad
    assert {"llama", "qwen2", "qwen3", "phi3", "cohere"} <= set(ran), ran


class _Fixed(DeviceDrafter):
    """A chain drafter whose nodes are valued ``values`` whatever happens."""

    def __init__(self, name: str, values: list[float]):
        super().__init__()
        self.name, self.fixed = name, values

    def values(self, acceptance, most, signal):
        return self.fixed[:most]


def test_a_composite_weighs_each_part_by_what_its_nodes_delivered():
    """Two parts of one tree: A's nodes are valued above B's but never
    accepted, B's are valued low and always accepted. At first the merge
    gives A every slot; after a few steps scored against the committed
    tokens, B's nodes come first, and B, which delivers more than its values
    promise, is scaled up."""
    a, b = _Fixed("a", [0.6, 0.5, 0.4, 0.35]), _Fixed("b", [0.3, 0.25, 0.2, 0.15])
    comp = CompositeDrafter([a, b])
    comp._predicted = []

    def order(width: int) -> list[int]:
        comp.values(None, 4, None)
        return comp._order[:width]

    assert order(4) == [0, 0, 0, 0]  # A takes every slot on its own values
    for step in range(8):
        comp.values(None, 4, None)
        tpl = comp.template(4)
        subs, starts = comp._subs[id(tpl)]
        slots = [7]  # the root, then each part's chain of tokens 1, 2, ... (A: 11, 12, ...)
        for i, sub in enumerate(subs):
            slots += [(11 if i == 0 else 1) + j for j in range(sub.n - 1)]
        committed = [1, 2, 3]  # B's chain, as deep as it went (and the bonus token)
        b_nodes = subs[1].n - 1
        tokens = [*committed[: min(b_nodes, 2)], 99]
        rec = StepRecord(step, tpl.n - 1, len(tokens) - 1, tokens, tpl, [], {"tokens": slots})
        comp.learn(None, [], [rec])
    assert order(2)[0] == 1, order(4)  # B now comes first
    fa, fb = (c.factor for c in comp.calibrations)
    assert fa < 0.35 < 1.0 <= fb


# ------------------------------------------------------------ real models
METHODS = PIPELINED_SETTINGS


SWEEP = [
    *METHODS,
    ("pld", {"max_draft": 4}),
    ("recycle", {"bc": 10}),
    ("probe", {"bc": 10}),
    ("hybrid", {"bc": 10}),
    ("hybrid", {"bc": 30}),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,opts", SWEEP, ids=setting_ids(SWEEP))
def test_pipelined_methods_are_exact_on_many_prompts(
    smollm, short_spec_prompts, greedy_reference, name, opts
):
    """Every pipelined method equals plain greedy decoding in float32 on 24
    prompts x 64 tokens (``-m slow``; tests/test_lossless.py runs each
    setting on three prompts in CI)."""
    ctx = Context(Engine(smollm.model), curves=FLAT)
    m = make_method(name, **opts)
    m.prepare(ctx)
    for i, p in enumerate(short_spec_prompts[:24]):
        out, _ = _decode(ctx, m, p, 64)
        assert out == greedy_reference(p, 64), (name, opts, i)


def test_auto_drafts_on_a_copy_and_not_where_slots_are_dear(smollm, spec_prompts):
    """At auto, a summarization prompt (whose answer copies its source)
    drafts on a flat curve, from estimates learned at every step, plain ones
    included; on a steep curve (every slot a whole forward) every step is
    plain. Both exact."""
    summaries = spec_prompts[2::6]  # round-robin over the tasks: summarization
    prompt = min(summaries, key=len)
    ref = memoised_greedy(Engine(smollm.model))(prompt, 64)
    runs = {}
    for name, curve in (("flat", FLAT), ("steep", STEEP)):
        ctx = Context(Engine(smollm.model), curves=curve)
        m = make_method("pld")
        m.prepare(ctx)
        out, runs[name] = _decode(ctx, m, prompt, 64)
        assert out == ref, name
    assert runs["flat"].tau > 1.3 and runs["flat"].accepted > 10
    assert runs["steep"].drafted == 0 and runs["steep"].plain_steps == runs["steep"].steps


def test_pipeline_ends_clean_for_the_next_turn(smollm, short_spec_prompts):
    """A generation cut by max_tokens and by an EOS inside an accepted block
    leaves the cache holding exactly the prompt and the tokens but the last,
    with a step still in flight dropped: the next turn equals a cold start."""
    p = short_spec_prompts[4]
    ref = memoised_greedy(Engine(smollm.model))
    eng = Engine(smollm.model)
    ctx = Context(eng, curves=FLAT)
    m = make_method("pld", max_draft=8)
    m.prepare(ctx)
    out, _ = _decode(ctx, m, p, 17)
    assert out == ref(p, 17) and len(out) == 17
    assert eng.cached == p + out[:-1]
    assert all(c.offset == len(eng.cached) for c in eng.cache)
    eos = out[9]
    out2, _ = _decode(ctx, m, p, 40, eos=frozenset({eos}))
    assert out2 == ref(p, 40)[: out.index(eos) + 1]
    turn2 = p + out2 + p[-5:]
    got, _ = _decode(ctx, m, turn2, 20)
    assert got == ref(turn2, 20)


# ------------------------------------------------- the policy, simulated device
def _policy_run(smollm, simulate, spec, name, prompt, n=48):
    simulate(spec)
    ctx = Context(Engine(smollm.model))
    m = make_method(name)
    m.prepare(ctx)
    _decode(ctx, m, prompt[:-8], 16)  # the first passes of each shape take longer
    out, stats = _decode(ctx, m, prompt, n)
    assert out == memoised_greedy(Engine(smollm.model))(prompt, n), (spec, name)
    return stats


def test_pipelined_policy_prices_mask_slots_and_host_time(
    smollm, simulate, spec_prompts, monkeypatch
):
    """On the simulated device: on a steep curve (m4pro-4bit) probe's plain
    steps carry no mask slots but for a refresh now and then (about one slot
    a pass, not two); where a draft step's host work exceeds the device's
    pass by far (30 ms more than a plain step's, against 4 ms a token), pld
    and probe run plain steps (nearly) always; on a memory-bound curve
    (bf16-flat) both draft. All exact."""
    import time

    from mlx_mtp.sources.lookup import LookupDrafter
    from mlx_mtp.sources.masks import MaskLayer

    prompt = min(spec_prompts[2::6], key=len)  # summarization: much to copy
    steep = _policy_run(smollm, simulate, "profile=m4pro-4bit,ms_per_token=12", "probe", prompt)
    assert steep.slots / steep.forward_passes < 1.6, (steep.slots, steep.forward_passes)
    for name in ("pld", "probe"):
        flat = _policy_run(smollm, simulate, "profile=bf16-flat,ms_per_token=12", name, prompt)
        assert flat.drafted > 0 and flat.accepted > 0, name
        assert flat.plain_steps < flat.steps, name
    draft, after = LookupDrafter.draft, MaskLayer.after

    def slow_draft(self, *a, **k):
        time.sleep(0.03)
        return draft(self, *a, **k)

    def slow_after(self, engine, step, committed, masked=True):
        if masked:
            time.sleep(0.03)
        return after(self, engine, step, committed, masked)

    monkeypatch.setattr(LookupDrafter, "draft", slow_draft)
    monkeypatch.setattr(MaskLayer, "after", slow_after)
    for name in ("pld", "probe"):
        slow = _policy_run(smollm, simulate, "profile=bf16-flat,ms_per_token=4", name, prompt)
        assert slow.plain_steps >= 0.8 * slow.steps, (name, slow.plain_steps, slow.steps)


def test_the_ledger_bounds_what_wrong_estimates_lose(smollm, simulate, spec_prompts, monkeypatch):
    """Where the estimates are wrong (prompt lookup's continuations claimed
    nearly sure, on a writing prompt where they are not, on a steep curve
    where a rejected chain costs passes), the pipelined steps' ledger stops
    drafting once it lost its credit (each draft's worst case cut to the
    credit left): what drafting lost stays within ``EPSILON`` of the time
    plus one plain step, the probes' share and the step already launched,
    and most steps are plain. Exact."""
    from mlx_mtp.ledger import EPSILON
    from mlx_mtp.pipeline import WidthPolicy
    from mlx_mtp.sources.lookup import LookupDrafter

    policies, init = [], WidthPolicy.__init__

    def kept(self, *a, **k):
        policies.append(self)
        init(self, *a, **k)

    monkeypatch.setattr(WidthPolicy, "__init__", kept)
    monkeypatch.setattr(LookupDrafter, "values", lambda self, acc, most, sig: [0.95] * most)
    prompt = spec_prompts[0]  # writing: little to copy
    stats = _policy_run(smollm, simulate, "profile=m4pro-4bit,ms_per_token=12", "pld", prompt)
    policy = policies[-1]
    ledger, plain = policy.ledger, policy.plain_seconds
    assert stats.drafted > 0  # the estimates did send drafts
    assert stats.plain_steps >= 0.7 * stats.steps, (stats.plain_steps, stats.steps)
    lost = ledger.spent - ledger.tokens * plain
    # the credit, the probes' share, and the step launched before the read
    # that used the credit up
    assert lost <= 2 * EPSILON * ledger.time + 3 * plain, (lost, ledger.time, plain)


#: recycle resumes as a part of hybrid (alone, its values do not change in
#: a spell); the draft model (the target's size: it never pays) is made to
#: draft two tokens every fourth step
SPELLS = ["pld", "probe", "hybrid", "draft"]


@pytest.mark.parametrize("name", SPELLS)
def test_spells_of_plain_steps_keep_every_drafter_exact(
    smollm, near_draft, simulate, spec_prompts, monkeypatch, name
):
    """Where the host times say so (forced here: spells always pay, host
    time free), the policy's plain steps run as spells of one-token steps as
    ``ntp`` runs them, and the pipeline starts again where a draft (or a
    mask refresh) is chosen, each drafter resuming its state: the lookup's
    signal, recycle's device table, the mask vectors (the candidates of
    before the spell dropped), a draft model's cache catching up with the
    spell's tokens. Exact, with spells begun and the pipeline started again
    after them, on the simulated device."""
    import itertools

    from mlx_mtp import pipeline
    from mlx_mtp.pipeline import HostTimes, Pipeline, WidthPolicy

    start, starts = Pipeline._start, []
    monkeypatch.setattr(Pipeline, "_start", lambda self, r: (starts.append(r), start(self, r)))
    monkeypatch.setattr(HostTimes, "spells_pay", lambda self, t1: True)
    monkeypatch.setattr(HostTimes, "costs", lambda self, t1: (0.0, 0.0))
    monkeypatch.setattr(HostTimes, "switch_cost", lambda self, t1: 0.0)
    # the drafts' losses do not end the drafting here (the ledger's test is
    # above), and mask refreshes come as often as a 2% share allows
    monkeypatch.setattr(WidthPolicy, "credit", property(lambda self: float("inf")))
    monkeypatch.setattr(pipeline, "EPSILON", 0.02)
    if name == "draft":
        choose, calls = WidthPolicy.choose, itertools.count(1)

        def every_fourth(self, drafter, signal, ctx):
            choose(self, drafter, signal, ctx)
            return (2, False) if next(calls) % 4 == 0 else (0, False)

        monkeypatch.setattr(WidthPolicy, "choose", every_fourth)
    simulate("profile=m4pro-4bit,ms_per_token=12")
    prompt = min(spec_prompts[2::6], key=len)  # summarization: much to copy
    ctx = Context(Engine(smollm.model), loaded=smollm)
    m = make_method(name, **({"draft_model": near_draft} if name == "draft" else {}))
    m.prepare(ctx)
    out, stats = _decode(ctx, m, prompt, 48)
    assert out == memoised_greedy(Engine(smollm.model))(prompt, 48), name
    assert stats.runner == "pipelined" and stats.plain_spells > 0, stats.summary()
    assert len(starts) >= 2 and stats.accepted > 0, (starts, stats.summary())


def test_a_spell_asks_the_policy_within_its_share_of_the_time(
    smollm, simulate, spec_prompts, monkeypatch
):
    """A spell's steps are plain decoding's; the drafter's learning and the
    policy's choice after each are host work on the critical path, which
    ``ntp`` does not have. With an ask that takes 2 ms (half a 4 ms step;
    ``hybrid``'s took about 1 ms), the policy is asked again only once the
    spell ran the ask's time over ``ledger.EPSILON``: far fewer asks than steps.
    Exact."""
    import time

    from mlx_mtp.ledger import EPSILON
    from mlx_mtp.pipeline import HostTimes, WidthPolicy

    monkeypatch.setattr(HostTimes, "spells_pay", lambda self, t1: True)
    asks = []

    def slow_plain(self, drafter, signal, ctx):
        asks.append(ctx.engine.offset)
        time.sleep(0.002)
        return 0, False

    monkeypatch.setattr(WidthPolicy, "choose", slow_plain)
    simulate("profile=bf16-flat,ms_per_token=4")
    prompt = spec_prompts[0]
    ctx = Context(Engine(smollm.model))
    m = make_method("pld")
    m.prepare(ctx)
    out, stats = _decode(ctx, m, prompt, 48)
    assert out == memoised_greedy(Engine(smollm.model))(prompt, 48)
    assert stats.plain_spells > 0 and stats.plain_steps >= 40, stats.summary()
    # 2 ms over a 1% share: one ask in about 200 ms of spell, 40 steps of 5 ms
    assert len(asks) <= stats.steps / 8, (len(asks), stats.steps, EPSILON)


def test_pipelined_steps_refine_the_live_cost_curve(
    smollm, short_spec_prompts, simulate, monkeypatch
):
    """Pipelined steps whose reads waited for the device report their passes
    to the live curves (slots, seconds, context), as the planner's steps do,
    and the curves are saved when the generation ends: on a simulated device
    of 40 ms a token, curves that start from 10 ms learn the device's one-token
    time."""
    from mlx_mtp.budget import CostCurves
    from mlx_mtp.costs import LiveCurves

    simulate("ms_per_token=40,curve=1:1,16:1.05,64:1.3")
    base = CostCurve(FLAT.sizes, FLAT.costs, seconds=0.01)
    live = LiveCurves(CostCurves([base]), key=None, learn=True)
    seen, saved = [], []
    observe = live.observe
    monkeypatch.setattr(live, "observe", lambda *a: (seen.append(a), observe(*a)))
    monkeypatch.setattr(live, "save", lambda: saved.append(True))
    ctx = Context(Engine(smollm.model), curves=live)
    m = make_method("pld")
    m.prepare(ctx)
    p = short_spec_prompts[0]
    out, _ = _decode(ctx, m, p, 24)
    assert out == memoised_greedy(Engine(smollm.model))(p, 24)
    assert seen and saved
    assert all(s >= 1 and sec > 0 and c >= len(p) - 1 for s, sec, c in seen)
    assert 0.03 < live.t1 < 0.05, live.t1


def test_a_draft_model_steps_with_its_chain_where_a_tree_depth_is_dear():
    """At ``auto`` the policy weighs a draft model's tree (4 candidates a
    depth) against its chain alone: on a flat curve it takes the tree, on the
    M4 Pro 4-bit profile (4 more slots cost 0.73 passes, 1 more 0.10) the
    chain, and each step's acceptance is learned in the layout it was sent
    in. A real pair drafting on that profile: ``bench`` in docs/profiles.md."""
    import types

    from mlx_mtp.acceptance import Acceptance
    from mlx_mtp.bench.profiles import profile_curve
    from mlx_mtp.budget import CostCurves, parse_curve
    from mlx_mtp.costs import LiveCurves
    from mlx_mtp.methods.draft import DraftModelMethod
    from mlx_mtp.pipeline import WidthPolicy
    from mlx_mtp.sources.draft import DraftModelDrafter

    source = types.SimpleNamespace(draft_cost=0.3)
    ctx = types.SimpleNamespace(engine=types.SimpleNamespace(offset=100))
    flat = CostCurve([1, 16, 64], [1.0, 1.05, 1.3], seconds=0.012)
    steep = parse_curve(profile_curve("m4pro-4bit"))
    steep = CostCurve(steep.sizes, steep.costs, seconds=0.012)
    for curve, want in ((flat, 4), (steep, 1)):
        drafter = DraftModelDrafter(source, 4)
        acceptance = Acceptance(DraftModelMethod.PIPELINE_ACCEPTANCE)
        policy = WidthPolicy(4, True, acceptance, LiveCurves(CostCurves([curve]), learn=False))
        width, masked = policy.choose(drafter, None, ctx)
        assert width >= 1 and not masked and drafter.width == want, (curve.costs, width)
        tpl = drafter.template(width)
        assert int((tpl.parents == 0).sum()) == want
        # the step comes back with its first depth's chain token accepted
        drafter.learn(acceptance, [], [StepRecord(0, width, 1, [7, 8], tpl, [0, 1])])
        assert acceptance.source("draft").tried[1] > 0


def test_a_draft_model_probes_with_its_cheapest_layout():
    """Where no layout of a draft model drafts (its estimates low, as after
    a prompt it could not predict), its probe is one depth of the chain
    (one slot), not of the tree (four): on the M4 Pro 4-bit profile the
    chain's depth costs 0.42 passes over a plain step and comes after about
    42 plain steps at EPSILON, where the tree's (1.3 passes) took more than
    a 64-token reply and a draft model never drafted again after a prompt
    it missed (Qwen2.5-Coder-1.5B/0.5B, docs/profiles.md)."""
    import types

    from mlx_mtp.acceptance import Acceptance, AcceptanceModel
    from mlx_mtp.bench.profiles import profile_curve
    from mlx_mtp.budget import CostCurves, parse_curve
    from mlx_mtp.costs import LiveCurves
    from mlx_mtp.pipeline import WidthPolicy
    from mlx_mtp.sources.draft import DraftModelDrafter

    source = types.SimpleNamespace(draft_cost=0.32)
    ctx = types.SimpleNamespace(engine=types.SimpleNamespace(offset=100))
    steep = parse_curve(profile_curve("m4pro-4bit"))
    steep = CostCurve(steep.sizes, steep.costs, seconds=0.012)
    drafter = DraftModelDrafter(source, 4)
    acceptance = Acceptance(AcceptanceModel(priors={"draft": 0.05, "draft_alt": 0.02}))
    policy = WidthPolicy(4, True, acceptance, LiveCurves(CostCurves([steep]), learn=False))
    width = steps = 0
    while not width and steps < 63:
        steps += 1
        width, _ = policy.choose(drafter, None, ctx)
    assert width == 1 and drafter.width == 1, (width, drafter.width)
    assert 30 <= steps <= 50, steps


def test_a_draft_model_starts_each_generation_from_its_priors():
    """Estimates carry to the method's next generation on a context (at
    half weight) for drafters that learn at every step (prompt lookup, the
    masks, the table); a draft model, which learns only from its drafts,
    starts each generation from its priors: after a prompt it could not
    predict, its probes alone would have to win back the next one."""
    import types

    from mlx_mtp.acceptance import Acceptance, AcceptanceModel
    from mlx_mtp.pipeline import pipeline_for

    model = AcceptanceModel(priors={"draft": 0.7})
    method = types.SimpleNamespace(
        settings_key=lambda: "m", pipeline_acceptance=lambda: model, max_width=4, auto=True
    )
    for learns_free in (True, False):
        ctx = types.SimpleNamespace(learned={}, engine=None)
        drafter = types.SimpleNamespace(learns_free=learns_free)
        first = pipeline_for(ctx, method, drafter, None, True).policy.acceptance
        assert isinstance(first, Acceptance)
        for _ in range(8):
            first.source("draft").add(1, False)  # every draft rejected
        low = first.source("draft").qs(1)[0]
        second = pipeline_for(ctx, method, drafter, None, True).policy.acceptance
        if learns_free:
            assert second is first and second.source("draft").qs(1)[0] < 0.5
        else:
            assert second is not first and second.source("draft").qs(1)[0] > low


def test_host_times_decide_spells_and_price_leaving_one():
    """The host times of each step class decide whether plain steps run as
    spells (a pipelined plain step idles the device longer than a spell's by
    more than 5% of a pass) and what leaving a spell costs (the two switches'
    idle time past four spell steps'); in a spell the policy drafts only a
    step that saves more than that, and a lookup drafter's long match
    still does. Pure: a flat curve, t1 = 4 ms."""
    import types

    from mlx_mtp.acceptance import Acceptance, AcceptanceModel
    from mlx_mtp.budget import CostCurves
    from mlx_mtp.costs import LiveCurves
    from mlx_mtp.pipeline import SWITCH_PRIOR, HostTimes, WidthPolicy
    from mlx_mtp.sources.lookup import LookupDrafter

    t1 = 0.004
    host = HostTimes()
    assert not host.spells_pay(t1) and host.switch_cost(t1) == SWITCH_PRIOR
    for _ in range(3):
        host.record("plain", 0.003)
    assert host.spells_pay(t1) and host.costs(t1)[0] == 0.0  # a spell not measured: free
    for _ in range(3):
        host.record("spell", 0.0029)
    assert not host.spells_pay(t1)  # 0.1 ms is 2.5% of a pass
    for _ in range(7):
        host.record("spell", 0.0005)
        host.record("switch", 0.005)
        host.record("draft", 0.0005)  # drafting costs the host no more than a spell
    assert host.spells_pay(t1) and host.costs(t1)[0] == pytest.approx(0.5 / 4)
    assert host.switch_cost(t1) == pytest.approx(2 * (5 - 1) / 4)  # 2 passes

    flat = CostCurve([1, 16, 64], [1.0, 1.05, 1.3], seconds=t1)
    ctx = types.SimpleNamespace(engine=types.SimpleNamespace(offset=100))
    chosen = {}
    for m, length in ((1, 2), (3, 12)):  # a weak match, a long one
        drafter = LookupDrafter(3, 24)
        drafter.fresh = True
        acceptance = Acceptance(AcceptanceModel(priors={"pld/1": 0.15, "pld/3": 0.9}))
        policy = WidthPolicy(24, True, acceptance, LiveCurves(CostCurves([flat]), learn=False))
        policy.host = host
        for switch in (0.0, host.switch_cost(t1)):
            policy.switch = switch
            chosen[m, switch > 0] = policy.choose(drafter, (m, length), ctx)[0]
    assert chosen[1, False] > 0 and chosen[1, True] == 0, chosen
    assert chosen[3, False] > 0 and chosen[3, True] > 0, chosen


def test_rank_tree_takes_the_most_valuable_rank_paths():
    """The lazy best-first tree of rank paths (recycle's and the mask
    candidates' shape on the pipelined step) takes exactly the values an
    eager expansion (every child pushed) takes, each node worth its parent's
    value times its rank's estimate at its depth, parents first, with and
    without a deepest depth; random estimates, not sorted by rank."""
    import heapq
    import random

    from mlx_mtp.tree import rank_tree

    def eager(est, most, deepest):
        values, heap = [], [(-q, 1, r) for r, q in enumerate(est(1))]
        heapq.heapify(heap)
        while heap and len(values) < most:
            v, d, r = heapq.heappop(heap)
            values.append(-v)
            if deepest is None or d < deepest:
                for r2, q in enumerate(est(d + 1)):
                    heapq.heappush(heap, (v * q, d + 1, r2))
        return values

    rng = random.Random(0)
    for trial in range(300):
        k = rng.randint(1, 8)
        by_depth = [[rng.random() for _ in range(k)] for _ in range(6)]
        est = lambda d, b=by_depth: b[min(d, 6) - 1]  # noqa: E731
        most, deepest = rng.randint(0, 64), rng.choice([None, 1, 2, 3])
        parents, ranks, values = rank_tree(est, most, deepest)
        assert values == pytest.approx(eager(est, most, deepest)), trial
        worth, depth = [1.0, *values], [0] * len(parents)
        for s in range(1, len(parents)):
            assert parents[s] < s
            depth[s] = depth[parents[s]] + 1
            assert deepest is None or depth[s] <= deepest
            assert worth[s] == pytest.approx(worth[parents[s]] * est(depth[s])[ranks[s]])
