"""Lookahead decoding (LADE): pool and trie, the lookahead-branch attention
pattern, and greedy exactness against ntp on tiny random models (the real
models: tests/test_lossless.py; the slow sweep here: SmolLM2 30 x 64)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from tiny_models import make_tiny_model

from mlx_mtp.context import Context
from mlx_mtp.decoding import generate_steps
from mlx_mtp.engine import Engine
from mlx_mtp.errors import InvalidArgumentError
from mlx_mtp.methods import make_method
from mlx_mtp.methods.lookahead import Lookahead, lookahead_parents
from mlx_mtp.methods.ntp import NTP
from mlx_mtp.sources.pool import NGramPool, build_trie


def _generate(engine: Engine, method, prompt: list[int], n: int) -> tuple[list[int], object]:
    method.prepare(Context(engine))
    engine.reset()
    out, stats = [], None
    for step in generate_steps(engine, method, list(prompt), max_tokens=n):
        out.extend(step.tokens)
        stats = step.stats
    return out, stats


def test_options_and_block_complexity():
    m = make_method("lookahead")
    assert (m.level, m.window, m.guess) == (5, 7, 7)
    assert m.block_complexity == 1 + 4 * (7 + 7)
    assert Lookahead(level="3", window="4", guess="2").block_complexity == 1 + 2 * 6
    for bad in ({"level": 1}, {"window": 0}, {"guess": 0}, {"level": "x"}, {"foo": 1}):
        with pytest.raises((InvalidArgumentError, TypeError)):
            Lookahead(**bad)


def test_ngram_pool_keeps_most_recent_per_key():
    pool = NGramPool(per_key=2)
    pool.add(5, (1, 2))
    pool.add(5, (3, 4))
    pool.add(5, (1, 2))  # refreshed: now most recent
    pool.add(5, (6, 7))  # (3, 4) drops out
    assert pool.get(5, 10) == [(6, 7), (1, 2)]
    assert pool.get(5, 1) == [(6, 7)]
    assert pool.get(9, 3) == [] and len(pool) == 2


def test_build_trie_shares_prefixes():
    toks, par = build_trie([(1, 2, 3), (1, 2, 4), (5, 6, 7)])
    assert toks == [1, 2, 3, 4, 5, 6, 7]
    assert par == [-1, 0, 1, 1, -1, 4, 5]
    assert build_trie([]) == ([], [])


def test_lookahead_parents_layout():
    # 2 levels x 3 columns after root + 2 verification slots (offset 3)
    par = lookahead_parents(2, 3, 3).tolist()
    assert par == [0, 3, 4, 3, 4, 5]


def test_lookahead_branch_is_lade_attention():
    """Logits at level l, column j equal a plain causal pass over the path
    root, level0[0..j], level1[j], ..., level_l[j] (LADE Fig. 2b)."""
    model = make_tiny_model("llama", seed=3)
    engine = Engine(model)
    Lookahead().prepare(Context(engine))
    prompt = [5, 17, 42, 9, 100, 7]
    levels, window = 3, 4
    rng = np.random.default_rng(0)
    grid = rng.integers(0, 256, size=(levels, window))
    root = 11
    engine.sync(prompt)
    start = engine.offset
    parents = np.concatenate([[-1], lookahead_parents(levels, window, 1)])
    slots = [root, *grid.reshape(-1).tolist()]
    logits, _ = engine.forward_tree(engine.embed_tokens(slots), parents, slots)
    logits = np.array(logits.astype(mx.float32))
    engine.keep(start, [])
    ref_engine = Engine(model)
    for lv in range(levels):
        for j in range(window):
            path = [root, *grid[0, : j + 1].tolist(), *grid[1 : lv + 1, j].tolist()]
            ref_engine.reset()
            ref, _ = ref_engine.forward_chain(prompt + path)
            got = logits[1 + lv * window + j]
            np.testing.assert_allclose(got, np.array(ref[-1]), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_exact_vs_ntp_tiny(family):
    # untied embeddings: a tied tiny model mostly copies its input token, which
    # leaves the n-gram pool useless for verification
    model = make_tiny_model(family, seed=1, tie_word_embeddings=False)
    engine = Engine(model)
    accepted = 0
    for i, settings in enumerate([{}, {"level": 3, "window": 4, "guess": 3}, {"level": 2}]):
        prompt = [int(x) for x in np.random.default_rng(i).integers(0, 256, size=12)]
        ref, _ = _generate(engine, NTP(), prompt, 48)
        got, stats = _generate(engine, Lookahead(**settings), prompt, 48)
        assert got == ref, (family, settings)
        accepted += stats.accepted
        assert stats.forward_passes <= len(got)
    assert accepted > 0  # drafts were actually accepted (not plain decoding in disguise)


def _exact_on_smollm(smollm, prompts, n, reference, settings=None):
    engine = Engine(smollm.model)
    tokens = forwards = accepted = 0
    for i, prompt in enumerate(prompts):
        ref = reference(prompt, n)
        got, stats = _generate(engine, Lookahead(**(settings or {})), prompt, n)
        assert got == ref, f"prompt {i}: first mismatch at {_first_diff(ref, got)}"
        tokens += stats.generated_tokens
        forwards += stats.forward_passes
        accepted += stats.accepted
    return tokens / forwards, accepted


def _first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.slow
@pytest.mark.parametrize("settings", [{}, {"level": 3, "window": 4, "guess": 3}])
def test_exact_vs_ntp_smollm_64_tokens(smollm, short_spec_prompts, greedy_reference, settings):
    tau, accepted = _exact_on_smollm(
        smollm, short_spec_prompts[:30], 64, greedy_reference, settings
    )
    assert accepted > 0 and tau > 1.0
