"""probe and pld: tree construction, ancestors, the tree walk, prompt lookup,
options, bc=auto's tree size, exactness on tiny models, the statistics, cache
handling and the failure classes of docs/design.md §11. Exactness on the
real models is tests/test_lossless.py (the slow sweeps here: 30 Spec-Bench
prompts x 64 tokens per setting); the tree forward pass of every family
tests/test_families.py; sampling tests/test_speculative.py."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import run_method
from tiny_models import make_tiny_model

from mlx_mtp.allocate import build_tree
from mlx_mtp.budget import CostCurve
from mlx_mtp.context import Context
from mlx_mtp.engine import Engine, ancestors
from mlx_mtp.errors import InvalidArgumentError, UnsupportedModelError
from mlx_mtp.families import check_tree_support
from mlx_mtp.methods import make_method
from mlx_mtp.methods.ntp import NTP
from mlx_mtp.sources.lookup import lookup_candidates
from mlx_mtp.sources.masks import top_candidates
from mlx_mtp.tree import block_complexity, heavy_path_order, reorder_tree
from mlx_mtp.verify import walk_tree

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
SETTINGS = [(10, 1), (10, 2), (30, 1), (30, 2), (60, 1), (60, 2)]


# ------------------------------------------------------------- pure functions
def test_mask_candidates_are_the_softmax_top_m_best_first():
    """The mask levels' candidates (through the shared two-stage top-k): the
    m most probable ids of each row, best first, with their softmax
    probabilities."""
    rng = np.random.default_rng(3)
    rows = rng.normal(size=(3, 49152)).astype(np.float32)
    for m in (1, 10, 64):
        top, top_p = top_candidates(mx.array(rows), m)
        want = np.argsort(-rows, axis=-1)[:, :m]
        p = np.exp(rows - rows.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        assert (np.array(top) == want).all(), m
        np.testing.assert_allclose(np.array(top_p), np.take_along_axis(p, want, -1), rtol=1e-4)


def test_build_tree_best_first_with_pruning_and_budget():
    d1 = (np.array([5, 7, 9]), np.array([0.6, 0.3, 0.1]))
    d2 = (np.array([7, 8]), np.array([0.5, 0.4]))
    toks, par, probs = build_tree([d1, d2], budget=4, root_token=9)
    # best-first: 5 (0.6), 7 (0.3) or 5->7 (0.3), 5->8 (0.24) ; root token 9 is pruned
    assert toks[0] == 5 and par[0] == -1
    assert len(toks) == 4
    assert all(p < i for i, p in enumerate(par))
    assert probs == sorted(probs, reverse=True)
    assert 9 not in [t for t, p in zip(toks, par) if p == -1]
    # a child repeating its parent's token is pruned (7 under 7)
    for t, p in zip(toks, par):
        if p >= 0:
            assert t != toks[p]
    # templates cap nodes per depth
    toks, par, _ = build_tree([d1, d2], budget=10, root_token=0, per_depth=[2, 1])
    depth = [0 if p < 0 else 1 for p in par]
    assert depth.count(0) == 2 and depth.count(1) == 1
    assert block_complexity(1, 14) == 30 and block_complexity(2, 9) == 30


def test_heavy_path_order_puts_the_most_probable_path_first():
    """Best-first trees (build_tree's order) laid out depth-first, best child
    first: the greedy-best path is a prefix (keep then only trims), parents
    still come first, and the tree is the same set of root-to-node paths."""
    d1 = (np.array([5, 7, 9]), np.array([0.5, 0.3, 0.2]))
    d2 = (np.array([6, 8, 1]), np.array([0.6, 0.3, 0.1]))
    d3 = (np.array([2, 3]), np.array([0.9, 0.1]))
    toks, par, probs = build_tree([d1, d2, d3], budget=12, root_token=0)
    order = heavy_path_order(par, probs)
    assert sorted(order) == list(range(len(toks)))
    npar = reorder_tree(order, par)
    ntoks = [toks[i] for i in order]
    assert all(p < i for i, p in enumerate(npar))
    # the first three nodes are the best child of the root, of it, of that: 5 -> 6 -> 2
    assert ntoks[:3] == [5, 6, 2] and npar[:3] == [-1, 0, 1]

    def paths(t, p):
        out = set()
        for i in range(len(t)):
            path, j = [], i
            while j >= 0:
                path.append(t[j])
                j = p[j]
            out.add(tuple(path[::-1]))
        return out

    assert paths(ntoks, npar) == paths(toks, par)
    # the most probable child always follows its parent directly
    for i in range(len(npar)):
        kids = [j for j, q in enumerate(npar) if q == i]
        if kids:
            assert kids[0] == i + 1
            assert probs[order[i + 1]] == max(probs[order[j]] for j in kids)
    assert heavy_path_order([], []) == []


@pytest.mark.parametrize("n", [1, 2, 8, 9, 30, 64, 65, 130])
def test_ancestors_matches_naive_walk(n):
    """Ancestor-or-self matrix and depths equal a walk up the parent links, for
    random trees across the byte boundaries of the bit-set packing."""
    rng = np.random.default_rng(n)
    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])
    anc, depth = ancestors(parents)
    assert anc.dtype == bool and anc.shape == (n, n) and depth.dtype == np.int32
    for i in range(n):
        chain, j = {i}, i
        while parents[j] >= 0:
            j = int(parents[j])
            chain.add(j)
        assert set(np.flatnonzero(anc[i]).tolist()) == chain
        assert depth[i] == len(chain) - 1
    with pytest.raises(ValueError, match="parents must come first"):
        ancestors(np.array([-1, 2, 0]))


def test_walk_tree_accepts_longest_matching_path():
    # root(0) -> a(1:tok 5) -> b(2:tok 6); root -> c(3:tok 7); mask slot 4
    parents = np.array([-1, 0, 1, 0, 0])
    tokens = np.array([1, 5, 6, 7, -1])
    path, bonus = walk_tree(parents, tokens, {0: 5, 1: 6, 2: 42, 3: 0})
    assert path == [1, 2] and bonus == 42
    path, bonus = walk_tree(parents, tokens, {0: 7, 1: 6, 2: 0, 3: 11})
    assert path == [3] and bonus == 11
    path, bonus = walk_tree(parents, tokens, {0: 99, 1: 0, 2: 0, 3: 0})
    assert path == [] and bonus == 99


def test_lookup_candidates():
    ctx = np.array([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 2, 3])
    assert lookup_candidates(ctx, 3, 3) == [[4, 7, 2]]  # most recent match of (2, 3)
    assert lookup_candidates(ctx, 3, 3, limit=2) == [[4, 7, 2], [4, 5, 9]]
    assert lookup_candidates(np.array([1, 2, 3]), 3, 5) == []
    assert lookup_candidates(np.array([7]), 3, 5) == []


def _lookup_by_brute_force(context, window, max_draft, limit):
    """Every earlier n-gram compared with the suffix, longest n first."""
    T = len(context)
    for n in range(min(window, T - 1), 0, -1):
        suffix = list(context[T - n :])
        # windows ending before the suffix's last token, most recent first
        starts = [s for s in range(T - 1 - n, -1, -1) if list(context[s : s + n]) == suffix]
        follows = [list(context[s + n : s + n + max_draft]) for s in starts]
        unique = [f for i, f in enumerate(follows) if f not in follows[:i]]
        if unique:
            return unique[:limit]
    return []


def test_lookup_candidates_match_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(300):
        T = int(rng.integers(1, 60))
        ctx = rng.integers(0, int(rng.integers(2, 8)), T)  # small vocabularies: many matches
        window, max_draft, limit = (int(x) for x in rng.integers(1, 5, 3))
        want = _lookup_by_brute_force(ctx.tolist(), window, max_draft, limit)
        assert lookup_candidates(ctx, window, max_draft, limit) == want, (ctx, window, limit)


def test_bad_options():
    with pytest.raises(InvalidArgumentError, match="bc"):
        make_method("probe", bc=2)
    with pytest.raises(InvalidArgumentError, match="masks"):
        make_method("probe", masks=0)
    with pytest.raises(InvalidArgumentError, match="depth 2"):
        make_method("probe", tree="4,2", masks=1)
    assert make_method("probe", tree="14").block_complexity == 30
    assert make_method("probe", bc=30, masks=2).block_complexity == 30
    with pytest.raises(InvalidArgumentError, match="integer or 'auto'"):
        make_method("probe", bc="big")
    with pytest.raises(InvalidArgumentError, match="bc=auto"):
        make_method("probe", bc="auto", tree="14")
    auto = make_method("probe", bc="auto", max_bc=40, masks=1)
    assert auto.block_complexity == 40 and "bc=auto<=40" in auto.describe()


# ------------------------------------------------------------------ bc=auto
@pytest.mark.parametrize("name", ["probe", "hybrid"])
@pytest.mark.parametrize("cost", [0.0, 0.05, 5.0])
def test_bc_auto_is_exact_and_sizes_the_tree_by_cost(name, cost):
    model = make_tiny_model("qwen3", seed=2)
    prompt = [9, 8, 7, 9, 8, 7, 9, 8, 7, 1, 2, 3, 1, 2]
    ref = run_method(Engine(model), NTP(), prompt, 40)
    ctx = Context(Engine(model), curves=CostCurve.linear(cost))  # slots cost this much
    from mlx_mtp.decoding import generate_steps

    method = make_method(name, bc="auto", max_bc=24)
    method.prepare(ctx)
    out, stats = [], None
    for step in generate_steps(ctx, method, prompt, max_tokens=40):
        out.extend(step.tokens)
        stats = step.stats
    assert out == ref
    assert stats.slots_per_forward <= 24
    if cost == 0.0:  # free slots: the tree fills the cap
        assert stats.slots_per_forward > 12
    if cost == 5.0:  # a slot costs five forwards: nothing is drafted
        assert stats.drafted == 0


# -------------------------------------------------------- tree forward pass
def test_forward_tree_without_waiting_gives_the_same_logits_and_counts_device_time():
    model = make_tiny_model("llama", seed=1)
    check_tree_support(model, "probe")
    parents, tokens = np.array([-1, 0, 0, 1]), [11, 12, 13, 14]
    ref_eng, eng = Engine(model), Engine(model)
    for e in (ref_eng, eng):
        e.sync([3, 17, 42, 8])
    # the same LM-head rows as below: a 2-row and a 4-row matmul may round differently
    ref, _ = ref_eng.forward_tree(ref_eng.embed_tokens(tokens), parents, tokens, False, 2)
    logits, h = eng.forward_tree(eng.embed_tokens(tokens), parents, tokens, True, 2, wait=False)
    assert eng.forward_seconds == 0.0  # not waited for yet
    top = mx.argmax(logits, axis=-1)  # built while the pass runs
    eng.timed_eval(top)
    assert eng.forward_seconds > 0.0 and eng.clock.pending is None
    assert logits.shape[0] == 2 and h.shape[0] == 4
    assert mx.array_equal(logits, ref[:2]).item()
    # a pass never waited for is settled by the next cache operation
    eng.forward_tree(eng.embed_tokens([5]), np.array([-1]), [5], wait=False)
    before = eng.forward_seconds
    eng.keep(eng.offset - 1, [0])
    assert eng.clock.pending is None and eng.forward_seconds > before


def test_mask_update_in_closed_form_equals_one_update_per_token():
    model = make_tiny_model("llama", seed=1)
    eng = Engine(model)
    probe = make_method("probe", bc=10, masks=2)
    probe.prepare(Context(eng))
    for n in (1, 2, 5):
        probe.begin(Context(eng), [3, 17, 42, 8], None)
        m = probe.mask_embedding
        committed = [7, 9, 11, 13, 15][:n]
        probe.vectors.update(eng, committed)
        e = eng.embed_tokens(committed)
        for i in range(n):  # ESP §3.1: m <- m + lam (e - m), once per committed token
            m = m + 0.1 * (e[i] - m)
        assert probe.mask_embedding.shape == m.shape
        assert mx.allclose(probe.mask_embedding, m, atol=1e-6).item(), n


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_on_tiny_models(family):
    model = make_tiny_model(family, seed=2)
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3], [9, 8, 7, 9, 8, 7, 9], list(range(10, 40))]
    eng = Engine(model)
    for p in prompts:
        ref = run_method(eng, NTP(), p, 40)
        for bc, k in [(10, 1), (30, 2)]:
            assert run_method(eng, make_method("probe", bc=bc, masks=k), p, 40) == ref
        assert run_method(eng, make_method("pld"), p, 40) == ref


def test_unsupported_model_is_refused():
    model = make_tiny_model("llama")
    model.model_type = "mamba"
    with pytest.raises(UnsupportedModelError, match="mamba"):
        check_tree_support(model, "probe")


# ---------------------------------------------------------- real model (SmolLM2)
@pytest.mark.slow
@pytest.mark.parametrize("bc,masks", SETTINGS)
def test_probe_exact_full_sweep(smollm, short_spec_prompts, greedy_reference, bc, masks):
    eng = Engine(smollm.model)
    for i, p in enumerate(short_spec_prompts[:30]):
        got = run_method(eng, make_method("probe", bc=bc, masks=masks), p, 64)
        assert got == greedy_reference(p, 64), f"prompt {i}"


@pytest.mark.slow
def test_pld_exact_full_sweep(smollm, short_spec_prompts, greedy_reference):
    eng = Engine(smollm.model)
    for i, p in enumerate(short_spec_prompts[:30]):
        assert run_method(eng, make_method("pld"), p, 64) == greedy_reference(p, 64), i


def test_stats_prove_drafting_happened(smollm):
    from mlx_mtp.api import MTPModel

    m = MTPModel(smollm, make_method("probe", bc=30))
    r = m.generate("Count from 1 to 30, separated by commas.", max_tokens=48)
    s = r.stats
    assert s.drafted > 0 and s.accepted > 0
    assert s.forward_passes < s.generated_tokens  # tau > 1
    assert s.tau == pytest.approx(s.generated_tokens / s.forward_passes)
    assert s.block_complexity == 30


def test_max_tokens_never_exceeded_when_block_accepted(smollm):
    # a repetitive prompt where pld accepts long blocks
    from mlx_mtp.api import MTPModel

    m = MTPModel(smollm, make_method("pld"))
    text = "Repeat exactly: " + "alpha beta gamma delta " * 6
    for n in (1, 2, 5, 13):
        r = m.generate(text, max_tokens=n)
        assert len(r.tokens) <= n
        assert r.stats.generated_tokens == len(r.tokens)
        assert len(m.engine.cached) == len(m.encode(text)) + len(r.tokens) - 1


def test_eos_inside_accepted_block_ends_output(smollm, short_spec_prompts, greedy_reference):
    p = short_spec_prompts[2]
    ref = greedy_reference(p, 30)
    eos = {ref[12]}
    stop = ref.index(ref[12])
    eng = Engine(smollm.model)
    for method in (make_method("pld"), make_method("probe", bc=30, masks=2)):
        out = run_method(eng, method, p, 30, eos=eos)
        assert out == ref[: stop + 1]
        assert eng.cached == list(p) + out[:-1]


def test_a_sliding_window_cache_stays_exact_after_it_wraps():
    """Failure classes 1 and 2: a sliding-window cache (--max-kv-size 48) past
    its end still drops rejected drafts (its ring keeps room for the block),
    and probe's output equals plain decoding's with the same window."""
    model = make_tiny_model("llama", seed=3)
    prompt = list(range(1, 20))
    ref = run_method(Engine(model, max_kv_size=48), NTP(), prompt, 60)
    method = make_method("probe", bc=10)
    eng = Engine(model, max_kv_size=48, slots=method.block_complexity)
    assert run_method(eng, method, prompt, 60) == ref
    assert eng.offset == len(prompt) - 1 + 60 > 48


def test_quantized_kv_cache_keeps_exact_path():
    """Failure class 9: after verification a quantized KV cache keeps the
    accepted rows (same tokens as ntp with the same quantized cache)."""
    from mlx_lm.models.cache import QuantizedKVCache

    model = make_tiny_model(
        "llama", seed=4, hidden_size=128, num_attention_heads=2, num_key_value_heads=1
    )
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]

    def run(method):
        eng = Engine(model)
        eng.cache = [QuantizedKVCache(group_size=32, bits=8) for _ in eng.cache]
        return run_method(eng, method, prompt, 30)

    assert run(make_method("probe", bc=10)) == run(NTP())
