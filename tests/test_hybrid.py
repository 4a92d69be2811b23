"""hybrid: candidate merging and budget allocation (hand-made inputs), options,
exactness on tiny models, and where the next step's probe candidates come
from on the real model (its exactness there: tests/test_lossless.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_mtp.acceptance import Acceptance
from mlx_mtp.allocate import (
    Allocation,
    Allocator,
    CandidateChildren,
    Child,
    allocate,
    combine,
    merge_chains,
)
from mlx_mtp.context import Context
from mlx_mtp.errors import InvalidArgumentError
from mlx_mtp.methods.hybrid import Hybrid


# ------------------------------------------------------------------ merging
def test_combine_is_noisy_or():
    assert combine({"a": 0.5, "b": 0.5}) == pytest.approx(0.75)
    assert combine({"a": 0.0}) == 0.0
    assert combine({}) == 0.0


def test_merge_chains_shares_prefixes_and_merges_sources():
    trie = merge_chains(
        [
            ("pld", [5, 6, 7], [0.6, 0.7, 0.8]),
            ("pld_alt", [5, 6, 9], [0.3, 0.4, 0.5]),
            ("pld", [5, 8], [0.2, 0.9]),  # same source again: max, not noisy-or
            ("pool", [4], [0.5]),
        ]
    )
    root = trie[()]
    assert set(root) == {5, 4}
    # 5 proposed by pld (max 0.6) and pld_alt (0.3): 1 - 0.4 * 0.7
    assert root[5].q == pytest.approx(1 - 0.4 * 0.7)
    assert {s[0] for s in root[5].sources} == {"pld", "pld_alt"}
    assert root[4].q == pytest.approx(0.5)
    # below 5: 6 (both) and 8 (pld only)
    below5 = trie[(5,)]
    assert set(below5) == {6, 8}
    assert below5[6].q == pytest.approx(1 - 0.3 * 0.6)
    assert below5[8].q == pytest.approx(0.9)
    # the chains diverge after 5, 6
    assert set(trie[(5, 6)]) == {7, 9}
    assert trie[(5, 6)][7].sources == [("pld", 3, 1.0)]  # (source, depth, raw score)


def test_merged_children_adds_probe_levels_prunes_parent_token():
    trie = merge_chains([("pld", [5, 6], [0.5, 0.5])])
    levels = [
        (np.array([5, 3, 1]), np.array([0.4, 0.3, 0.1])),
        (np.array([6, 5, 2]), np.array([0.5, 0.2, 0.1])),
    ]
    children = CandidateChildren(trie, levels, [1.0, 0.5])
    kids = children((), 1)
    by = {c.token: c for c in kids}
    assert 1 not in by  # the root's own token is pruned (ESP)
    assert by[5].q == pytest.approx(1 - 0.5 * 0.6)  # pld + probe merged
    assert [s[0] for s in by[5].sources] == ["pld", "probe"]
    assert by[3].q == pytest.approx(0.3)
    assert [c.token for c in kids] == sorted(by, key=lambda t: -by[t].q)
    # depth 2 under node 5: scale 0.5 applies; token 5 pruned under parent 5
    kids2 = {c.token: c for c in children((5,), 5)}
    assert set(kids2) == {6, 2}
    assert kids2[6].q == pytest.approx(1 - 0.5 * (1 - 0.25))
    # no probe level at depth 3
    assert CandidateChildren(trie, levels)((5, 6), 6) == []


# --------------------------------------------------------------- allocation
def _fixed_children(table):
    def children(path, tok):  # most probable first, as allocate() expects
        kids = [Child(t, q, [("x", len(path) + 1, q)]) for t, q in table.get(path, [])]
        return sorted(kids, key=lambda c: -c.q)

    return children


def _reference_allocate(children, budget, masks, gain):
    # allocate() by exhaustive search: every step takes the available item of the
    # highest value per slot (ties: the node offered first, then the child listed
    # first; a node's mask set after its children) until the budget is spent
    taken, probs, tokens, paths, offered = [], [1.0], [1], [()], []
    left = budget - 1

    def offer(slot):  # slots are offered in the order they are taken
        kids = children(paths[slot], tokens[slot])
        n = slot
        for r, c in enumerate(kids):
            offered.append(((n, r), probs[slot] * c.q, 1, ("node", slot, c)))
        if masks and gain > 0:
            v = probs[slot] * max(0.0, 1.0 - sum(c.q for c in kids)) * gain
            if v > 0:
                offered.append(((n, len(kids)), v, masks, ("masks", slot)))

    offer(0)
    while offered and left > 0:
        best = max(offered, key=lambda it: (it[1] / it[2], [-x for x in it[0]]))
        offered.remove(best)
        _, v, cost, item = best
        if item[0] == "masks":
            if cost <= left:
                taken.append((True, v, cost, item[1]))
                left -= cost
            continue
        if v <= 0:
            continue
        taken.append((False, v, 1, item[2].token))
        probs.append(v)
        tokens.append(item[2].token)
        paths.append(paths[item[1]] + (item[2].token,))
        left -= 1
        offer(len(tokens) - 1)
    return taken


def test_allocate_best_first_parents_first_within_budget():
    table = {
        (): [(10, 0.9), (20, 0.3)],
        (10,): [(11, 0.9), (12, 0.05)],
        (10, 11): [(13, 0.5)],
        (20,): [(21, 0.99)],
    }
    a = allocate(_fixed_children(table), root_token=1, budget=5, masks=0, mask_gain=0.0)
    # path probs: 10 .9, 11 .81, 13 .405, 20 .3, 21 .297, 12 .045
    assert a.tokens == [10, 11, 13, 20]
    assert a.probs == pytest.approx([0.9, 0.81, 0.405, 0.3])
    assert a.parents == [-1, 0, 1, -1]
    assert a.slots(0) == 5
    for i, p in enumerate(a.parents):
        assert p < i
    # a bigger budget takes everything, still parents first
    a = allocate(_fixed_children(table), 1, budget=100, masks=0, mask_gain=0.0)
    assert sorted(a.tokens) == [10, 11, 12, 13, 20, 21]
    assert a.slots(0) == 7


def _random_tree(rng, fanout=4, depth=6):
    table, frontier, tok = {}, [()], 100
    while frontier:
        path = frontier.pop()
        if len(path) >= depth:
            continue
        kids = []
        for _ in range(int(rng.integers(0, fanout + 1))):
            # some exact ties (0.5, 1.0) between siblings and across nodes
            q = rng.choice([rng.uniform(0, 1), rng.uniform(0, 0.05), 0.5, 1.0])
            kids.append((tok, float(q)))
            frontier.append(path + (tok,))
            tok += 1
        table[path] = kids
    return table


@pytest.mark.parametrize("seed", range(40))
def test_allocation_bound_keeps_best_prefix_of_the_full_allocation(seed):
    """bc=auto's early stop (PrefixBound) allocates fewer items but cuts at the
    same prefix as best_prefix over a full allocation: CPU-like, flat (GPU-like)
    and linear curves, masks on and off, calibration above and below 1."""
    from mlx_mtp.budget import CostCurve, best_prefix
    from mlx_mtp.offers import Offer

    rng = np.random.default_rng(seed)
    table = _random_tree(rng)
    curve = [
        CostCurve([1, 2, 4, 8, 16, 32, 64], [1.0, 1.24, 1.42, 1.66, 1.88, 2.97, 5.0]),
        CostCurve.flat(16, 0.01),
        CostCurve.linear(float(rng.uniform(0.01, 0.3))),
        CostCurve([1, 2, 3, 24, 64], [1.0, 1.3, 1.3, 1.3, 3.0]),  # flat stretch after a rise
    ][seed % 4]
    masks = int(rng.integers(0, 3))
    gain = float(rng.uniform(0, 2.5)) if masks else 0.0
    cal = float(rng.uniform(0.3, 1.5))
    budget = int(rng.choice([10, 30, 64]))
    children = _fixed_children(table)

    def cut(a):
        vals = [v if m else v * cal for m, v, _ in a.order]
        return best_prefix(curve, vals, [sl for _, _, sl in a.order])

    full = allocate(children, 1, budget, masks, gain)
    ref = _reference_allocate(children, budget, masks, gain)
    assert [(m, sl) for m, _, sl, _ in ref] == [(m, sl) for m, _, sl in full.order]
    assert [v for _, v, _, _ in ref] == pytest.approx([v for _, v, _ in full.order])
    assert [t for m, _, _, t in ref if not m] == full.tokens
    allocator = Allocator(children, 1, budget, masks, gain)
    offer = Offer(allocator, None, max_slots=budget, remaining=allocator.remaining)
    _, n, rate = offer.cut(curve, cal)  # what the planner cuts
    short = allocator.alloc
    assert short.order == full.order[: len(short.order)]  # the same items, fewer
    assert len(short.order) >= min(2, len(full.order))
    n_full, r_full = cut(full)
    n_short, r_short = cut(short)
    assert (n_short, r_short) == (n_full, r_full)
    assert (n, rate) == (n_full, r_full)


def test_allocation_bound_stops_early_on_a_rising_curve():
    from mlx_mtp.budget import CostCurve
    from mlx_mtp.offers import Offer

    # a 63-node chain of q = 0.6 on this CPU's curve: only the first few pay
    table = {tuple(range(100, 100 + d)): [(100 + d, 0.6)] for d in range(63)}

    def taken(curve):
        allocator = Allocator(_fixed_children(table), 1, 64, 0, 0.0)
        offer = Offer(allocator, None, max_slots=64, remaining=allocator.remaining)
        items, n, _ = offer.cut(curve, 1.0)
        return len(items), n

    items, n = taken(CostCurve([1, 2, 4, 8, 16, 32, 64], [1.0, 1.24, 1.42, 1.66, 1.88, 2.97, 5.0]))
    assert 1 <= n <= 5 and items < 10
    # on a flat (memory-bound) curve the same chain is taken much further
    assert taken(CostCurve.flat(16, 0.01))[0] >= 15


def test_allocate_attaches_masks_where_the_path_likely_ends():
    # one strong chain: the deepest node is the likely end of the accepted path
    table = {(): [(10, 0.9)], (10,): [(11, 0.9)], (10, 11): [(12, 0.1)]}
    a = allocate(_fixed_children(table), 1, budget=9, masks=2, mask_gain=1.0)
    assert a.slots(2) <= 9
    # value/slot: root 0.1*1/2, node 10 .9*.1/2, node 11 .81*.9/2 = .36 -> masks at 11 first
    assert a.mask_anchors[0] == 2  # slot of node 11
    assert 0 in a.mask_anchors or 1 in a.mask_anchors
    # masks never exceed the budget: budget 4 = root + 3 nodes leaves no room for masks
    a = allocate(_fixed_children(table), 1, budget=4, masks=2, mask_gain=0.01)
    assert a.tokens == [10, 11, 12] and a.mask_anchors == []
    # no candidates at all: the root gets its masks
    a = allocate(_fixed_children({}), 1, budget=10, masks=1, mask_gain=0.5)
    assert a.tokens == [] and a.mask_anchors == [0] and a.slots(1) == 2
    # masks disabled
    a = allocate(_fixed_children(table), 1, budget=10, masks=0, mask_gain=1.0)
    assert a.mask_anchors == [] and isinstance(a, Allocation)


def test_chain_depth_floor_and_per_depth_estimates(monkeypatch):
    from mlx_mtp.methods import hybrid
    from mlx_mtp.methods.hybrid import MAX_STAT_DEPTH, _worth

    # 0.5 ** 9 = 0.00195 >= 1e-3 > 0.5 ** 10: at a floor of 1e-3 nine nodes are offered
    monkeypatch.setattr(hybrid, "CHAIN_FLOOR", 1e-3)
    assert _worth([0.5] * 40) == 9
    assert _worth([0.99] * 40) == 40 and _worth([]) == 0 and _worth([1e-4, 1.0]) == 0
    st = Acceptance(Hybrid.ACCEPTANCE)
    st.record([("pld", MAX_STAT_DEPTH, 1.0)], True)
    qs = st.qs("pld", MAX_STAT_DEPTH + 3)
    assert qs == [st.q("pld", d) for d in range(1, MAX_STAT_DEPTH + 4)]
    assert qs[-1] == qs[MAX_STAT_DEPTH - 1] > qs[0] and st.qs("pool", 0) == []


def test_acceptance_stats_learn_online():
    s = Acceptance(Hybrid.ACCEPTANCE)
    q0 = s.q("pld", 1)
    for _ in range(20):
        s.record([("pld", 1, 1.0)], accepted=True)
    assert s.q("pld", 1) > q0 + 0.3
    for _ in range(20):
        s.record([("pool", 2, 1.0)], accepted=False)
    assert s.q("pool", 2) < 0.1
    # probe calibration: accepted / sum of mask probabilities
    assert s.q("probe", 1) == pytest.approx(1.0)
    for _ in range(40):
        s.record([("probe", 1, 0.1)], accepted=True)
    assert s.q("probe", 1) > 5
    g0 = s.gain("probe")
    for _ in range(10):
        s.record_gain("probe", 0)
    assert s.gain("probe") < g0
    # bc=auto's check of the sum: accepted per predicted token, recent steps first
    assert s.factor == pytest.approx(1.0)
    for _ in range(30):
        s.calibration.record(0.4, 0)  # hopeful estimates, nothing accepted
    assert s.factor < 0.3
    for _ in range(30):
        s.calibration.record(0.4, 1)  # the text turned repetitive: more than predicted
    assert s.factor == pytest.approx(1.5)  # capped


def test_options():
    h = Hybrid(bc="30", masks="2")
    assert h.block_complexity == 30 and h.masks == 2
    assert "bc=30" in h.describe()
    with pytest.raises(InvalidArgumentError):
        Hybrid(bc=1)
    with pytest.raises(InvalidArgumentError):
        Hybrid(tree="6,3")
    with pytest.raises(InvalidArgumentError):
        Hybrid(masks=4)
    with pytest.raises(InvalidArgumentError):
        Hybrid(mask_init="random")
    assert Hybrid(masks=0).masks == 0
    with pytest.raises(InvalidArgumentError, match="clp=1"):
        Hybrid(clp_heads="somewhere")
    h = Hybrid(clp=1)
    assert "clp" in h.describe() and not h.planner_steps and Hybrid().planner_steps


def test_hybrid_with_clp_heads_runs_pipelined_only(smollm_case, monkeypatch):
    """``clp=1`` adds the shipped CLP heads' chain to the pipelined tree:
    exact, the heads' drafts accepted among the parts'; the planner's steps
    have no CLP source, so asking for them is an error, not a silent tree
    without the heads."""
    from conftest import decode

    from mlx_mtp.engine import Engine
    from mlx_mtp.methods.clp import HeadsDrafter

    heads_accepted = 0
    learn = HeadsDrafter.learn

    def counted(self, acceptance, history, steps):  # the heads' own nodes in each tree
        nonlocal heads_accepted
        heads_accepted += sum(s.accepted for s in steps if s.width > 0)
        return learn(self, acceptance, history, steps)

    monkeypatch.setattr(HeadsDrafter, "learn", counted)
    case = smollm_case
    method = Hybrid(clp=1)
    for prompt, n in case.prompts:
        ctx = Context(Engine(case.loaded.model), case.loaded)
        method.prepare(ctx)
        out, stats = decode(ctx, method, prompt, n, eos_ids=set())
        assert out == case.greedy(prompt, n)
        assert stats.runner == "pipelined"
    assert heads_accepted > 0
    ctx = Context(Engine(case.loaded.model), case.loaded)
    method.prepare(ctx)
    prompt, n = case.prompts[0]
    with pytest.raises(InvalidArgumentError, match="pipelined steps only"):
        decode(ctx, method, prompt, n, runner="synchronous")
    with pytest.raises(InvalidArgumentError, match="clp=1 runs on pipelined steps"):
        Hybrid(clp=1, shape="chain").prepare(Context(Engine(case.loaded.model), case.loaded))


# ---------------------------------------------------------------- exactness
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_hybrid_tiny_model_exact_and_drafting(family):
    """Plumbing on a random model: same tokens as ntp, and real drafting."""
    from tiny_models import make_tiny_model

    from mlx_mtp.decoding import generate_steps
    from mlx_mtp.engine import Engine
    from mlx_mtp.methods import make_method

    m = make_tiny_model(family, seed=0)
    prompt = [int(x) for x in np.random.RandomState(1).randint(0, 256, 10)] * 3
    outs = []
    for name, kw in [("ntp", {}), ("hybrid", {"bc": 10}), ("hybrid", {"bc": 30, "masks": 2})]:
        e = Engine(m)
        meth = make_method(name, **kw)
        meth.prepare(Context(e))
        toks = []
        for s in generate_steps(e, meth, prompt, max_tokens=40):
            toks.extend(s.tokens)
        outs.append(toks)
        assert e.offset == len(prompt) + len(toks) - 1  # cache invariant
        if name == "hybrid":
            assert s.stats.accepted > 0 and s.stats.forward_passes < 40
    assert outs[1] == outs[0] and outs[2] == outs[0]


def _greedy_runs(smollm, prompts, max_tokens, methods):
    """Token lists of each method (and ntp first) per prompt, sharing one engine
    per prompt so the prompt is prefilled once."""
    from mlx_mtp.decoding import generate_steps
    from mlx_mtp.engine import Engine
    from mlx_mtp.methods import make_method

    eos = set(smollm.tokenizer.eos_token_ids)
    made = {name: make_method(name.split(":")[0], **opts) for name, opts in methods}
    out = {name: [] for name, _ in methods}
    stats = {name: [] for name, _ in methods}
    for p in prompts:
        engine = Engine(smollm.model)
        for name, m in made.items():
            m.prepare(Context(engine))
            toks, last = [], None
            for step in generate_steps(engine, m, p, max_tokens=max_tokens, eos_ids=eos):
                toks.extend(step.tokens)
                last = step
            out[name].append(toks)
            stats[name].append(last.stats)
    return out, stats


def _check_exact(smollm, prompts, max_tokens):
    methods = [
        ("ntp", {}),
        ("hybrid:10", {"bc": 10}),
        ("hybrid:30:k2:learned", {"bc": 30, "masks": 2, "mask_init": "learned"}),
        ("probe:30:learned", {"bc": 30, "mask_init": "learned"}),
    ]
    out, stats = _greedy_runs(smollm, prompts, max_tokens, methods)
    for name, _ in methods[1:]:
        bad = [i for i, (a, b) in enumerate(zip(out["ntp"], out[name])) if a != b]
        assert not bad, f"{name} differs from greedy on prompts {bad}"
        # the tree really drafts and accepts (no silent fallback to plain decoding)
        assert sum(s.drafted for s in stats[name]) > 0
        assert sum(s.accepted for s in stats[name]) > 0
        fwd = sum(s.forward_passes for s in stats[name])
        assert fwd < sum(s.forward_passes for s in stats["ntp"])


@pytest.mark.slow
def test_hybrid_exact_float32_long(smollm, spec_prompts):
    _check_exact(smollm, spec_prompts[:30], 64)


def test_hybrid_next_candidates_from_first_mask_set_and_hidden_rows(smollm_case):
    """The next step's probe candidates are the top-k of the deepest accepted
    node's mask rows, whichever way they are computed: the first mask set's
    top-k built during the pass, or another set's hidden rows through the LM
    head after it (the pass computes logits only for token slots and the
    first mask set)."""
    from mlx_mtp.decoding import generate_steps
    from mlx_mtp.methods import make_method

    meth = make_method("hybrid", bc=30, masks=2)
    seen = {"first": 0, "other": 0}
    observe = meth.observe

    def checked(ctx, draft, verified):
        observe(ctx, draft, verified)
        if draft is None:
            return
        engine = ctx.engine
        r0 = draft.info[0].get(verified.deepest)
        if r0 is None:
            return
        assert draft.logit_rows == draft.n_verify + 2  # token slots + the first mask set
        seen["first" if r0 == draft.n_verify else "other"] += 1
        full = engine.lm_head(verified.hidden[r0 : r0 + 2]).astype(mx.float32)
        logp = full - mx.logsumexp(full, axis=-1, keepdims=True)
        for (toks, ps), row in zip(meth.dists, np.array(logp)):
            want = np.argsort(-row, kind="stable")[: len(toks)]
            assert set(toks.tolist()) == set(want.tolist())
            np.testing.assert_allclose(ps, np.exp(row[toks]), rtol=1e-4, atol=1e-6)

    meth.observe = checked
    for (prompt, n), e in list(zip(smollm_case.prompts, smollm_case.engines))[:2]:
        meth.prepare(Context(e))
        for _ in generate_steps(e, meth, prompt, max_tokens=n):
            pass
    assert seen["first"] > 0 and seen["other"] > 0, seen
