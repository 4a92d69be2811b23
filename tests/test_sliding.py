"""Sliding-window caches that never refuse (mlx_mtp.cache_view.SlidingKVCache).

A sliding-window layer (Gemma 3's local layers, ``--max-kv-size``) keeps its
window in a ring with room for the method's largest forward pass, so rejected
drafts are dropped even after the window has wrapped. Checked here on tiny
random models (plumbing): one-token decoding equals mlx-lm's own
``RotatingKVCache``; rows moved by ``keep`` in a wrapped ring; trims and the
ring's growth; every lossless method past the window in tests/test_families.py
and on the real Gemma 3 in tests/test_gemma.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import run_method
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache
from tiny_models import make_tiny_model

from mlx_mtp.cache_view import SlidingKVCache
from mlx_mtp.engine import Engine
from mlx_mtp.errors import CacheNotTrimmableError
from mlx_mtp.families import check_tree_support
from mlx_mtp.methods.ntp import NTP

WINDOW = 16


@pytest.fixture(scope="module")
def gemma_tiny():
    """Tiny Gemma 3 (five 16-token sliding layers, then a global one)."""
    return make_tiny_model("gemma3_text", seed=1)


def _mlx_lm_greedy(model, prompt: list[int], n: int, cache: list) -> list[int]:
    """mlx-lm's own decoding: the prompt in one pass, then one token at a time."""
    logits = model(mx.array(prompt)[None], cache=cache)
    out = []
    for _ in range(n):
        tok = int(mx.argmax(logits[0, -1]).item())
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)
    return out


def test_one_token_decoding_equals_mlx_lm_rotating_cache(gemma_tiny):
    """ntp through the engine (sliding layers in a ring of 16 + 64 rows,
    prompt in 8-token prefill chunks) gives mlx-lm's tokens with its own
    RotatingKVCache(16): each query sees the same 16 positions."""
    prompt = [int(t) for t in np.random.default_rng(0).integers(1, 256, 40)]
    cache = make_prompt_cache(gemma_tiny)
    assert any(isinstance(c, RotatingKVCache) for c in cache)
    ref = _mlx_lm_greedy(gemma_tiny, prompt, 48, cache)
    eng = Engine(gemma_tiny)
    kinds = [type(c).__name__ for c in eng.cache]
    assert kinds == ["SlidingKVCache"] * 5 + ["KVCache"]
    eng.sync(prompt[:-1], chunk=8)
    assert run_method(eng, NTP(), prompt, 48) == ref


def test_max_kv_size_keeps_mlx_lm_meaning():
    """--max-kv-size 16 in one-token decoding: the first 4 tokens and the last
    12 (mlx-lm's RotatingKVCache(16, keep=4)), far past the window."""
    model = make_tiny_model("llama", seed=2)
    prompt = [5, 9, 13, 2, 77, 31]
    cache = [RotatingKVCache(max_size=16, keep=4) for _ in model.layers]
    ref = _mlx_lm_greedy(model, prompt, 40, cache)
    eng = Engine(model, max_kv_size=16)
    c = eng.cache[0]
    assert isinstance(c, SlidingKVCache) and (c.keep, c.window) == (4, 12)
    assert run_method(eng, NTP(), prompt, 40) == ref


def _chain_logits(model, tokens: list[int], **engine_args) -> mx.array:
    eng = Engine(model, **engine_args)
    eng.sync(tokens[:-1])
    logits, _ = eng.forward_chain(tokens[-1:])
    return logits


def test_keep_in_a_wrapped_ring_moves_the_accepted_rows(gemma_tiny):
    """A tree pass 70 tokens in (the 16 + 8-row ring has wrapped twice),
    keeping a branch that is not a prefix of the slots: the cache then holds
    the accepted path, and the next token's logits are those of decoding it
    in sequence (float32, 1e-5)."""
    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(1, 256, 70)]
    parents = np.array([-1, 0, 1, 2, 0, 4, 5, 6])
    toks = [int(t) for t in rng.integers(1, 256, len(parents))]
    keep = [0, 4, 5, 6]
    check_tree_support(gemma_tiny, "probe")  # per-token RoPE positions
    for lazy in (True, False):  # the lazy path of plain rings / the gathered one
        eng = Engine(gemma_tiny, slots=8)
        eng.sync(prompt)
        eng.forward_tree(eng.embed_tokens(toks), parents, toks)
        if not lazy:
            eng._tree_rows = None
        eng.keep(len(prompt), keep)
        path = [toks[i] for i in keep]
        assert eng.cached == prompt + path
        got, _ = eng.forward_chain([9])
        ref = _chain_logits(gemma_tiny, prompt + path + [9])
        np.testing.assert_allclose(np.array(got), np.array(ref), rtol=1e-5, atol=1e-5)


def test_a_pass_larger_than_the_room_widens_the_ring(gemma_tiny):
    """A droppable pass of 20 tokens on a ring built for 4: the ring grows
    (moving its rows) instead of refusing, and dropping the pass restores
    the cache exactly."""
    prompt = [int(t) for t in np.random.default_rng(4).integers(1, 256, 50)]
    eng = Engine(gemma_tiny, slots=4)
    eng.sync(prompt)
    eng.forward_chain(list(range(1, 21)), droppable=True)
    assert eng.slots == 19 and eng.cache[0].room == 19
    eng.trim_to(len(prompt))
    got, _ = eng.forward_chain([7])
    ref = _chain_logits(gemma_tiny, prompt + [7])
    np.testing.assert_allclose(np.array(got), np.array(ref), rtol=1e-5, atol=1e-5)


def test_a_trim_past_the_room_is_refused_whole(gemma_tiny):
    """Dropping more than the ring can give back (a 40-token prefill chunk in
    a 16 + 8 ring) is refused before any layer is trimmed."""
    eng = Engine(gemma_tiny, slots=8)
    eng.sync(list(range(1, 41)))
    eng.sync(list(range(1, 41)) + list(range(50, 90)))
    before = [c.offset for c in eng.cache]
    with pytest.raises(CacheNotTrimmableError, match="cannot drop 40 tokens"):
        eng.trim_to(40)
    assert [c.offset for c in eng.cache] == before and eng.offset == 80


def test_ring_positions_and_mask():
    """Unit: rows of positions, the window of each query, a trim marking
    rows empty, prefill chunks longer than the ring keeping the latest."""
    c = SlidingKVCache(window=4, keep=1, room=2)  # 1 + 6 rows
    assert c.capacity == 7 and c.rows(np.arange(10)).tolist() == [0, 1, 2, 3, 4, 5, 6, 1, 2, 3]
    k = mx.arange(10, dtype=mx.float32).reshape(1, 1, 10, 1)
    c.update_and_fetch(k, k)  # longer than room + 1: attends over all, keeps 0 and 4..9
    assert c.offset == 10 and sorted(c.pos.tolist()) == [0, 4, 5, 6, 7, 8, 9]
    pos = c.positions_after(2)
    vis = c.visible(pos, np.array([10, 11]), None)
    seen = [sorted(pos[v].tolist()) for v in vis]
    assert seen == [[0, 7, 8, 9, 10], [0, 8, 9, 10, 11]]
    c.update_and_fetch(k[..., :2, :], k[..., :2, :])
    assert c.can_trim(2) and c.trim(2) == 2 and c.offset == 10
    assert (c.pos >= 10).sum() == 0
    assert not c.can_trim(4)  # the next token (6) would need 3, which the prefill dropped
