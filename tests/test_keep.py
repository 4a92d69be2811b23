"""``Engine.keep``'s cache move: the same cache contents as the old one-graph
``slice_update(a, take(a, idx))`` for every cache kind it accepts, and no copy
of the whole cache buffer (docs/design.md §10; timing in examples/keep_bench.py)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from mlx_mtp.cache_view import SlidingKVCache, install_positional_rope
from mlx_mtp.engine import _move_cache_rows


def _old_move_cache_rows(cache, start, rows):
    idx, at = mx.array(rows), mx.array([start])

    def mv(a):
        return mx.slice_update(a, mx.take(a, idx, axis=-2), at, axes=(a.ndim - 2,))

    for c in cache:
        if isinstance(c, QuantizedKVCache):
            c.keys = tuple(mv(a) for a in c.keys)
            c.values = tuple(mv(a) for a in c.values)
        else:
            c.keys, c.values = mv(c.keys), mv(c.values)


def _filled(kind: str, layers: int, context: int, slots: int, dtype=mx.bfloat16):
    mx.random.seed(3)
    cache = []
    for _ in range(layers):
        c = {
            "kv": KVCache,
            # a sliding window that has not wrapped: rows are positions, as in
            # a KVCache (wrapped rings: tests/test_sliding.py)
            "sliding": lambda: SlidingKVCache(4092, keep=4, room=64),
            "quantized": lambda: QuantizedKVCache(group_size=32, bits=8),
        }[kind]()
        for n in (context, slots):  # the context (prefill), then a tree's slots
            k = mx.random.normal((1, 2, n, 64)).astype(dtype)
            v = mx.random.normal((1, 2, n, 64)).astype(dtype)
            c.update_and_fetch(k, v)
        cache.append(c)
    mx.eval([c.state for c in cache])
    return cache


def _flat(cache):
    """Every layer's cached keys and values (the first ``offset`` rows)."""
    out = []
    for c in cache:
        for part in (c.keys, c.values):
            for a in part if isinstance(part, (tuple, list)) else [part]:
                out.append(a[..., : c.offset, :])
    return out


@pytest.mark.parametrize("kind", ["kv", "sliding", "quantized"])
@pytest.mark.parametrize("keep", [[2, 5, 6], [1], [4, 7, 8, 9]])
def test_keep_move_gives_the_old_contents(kind, keep):
    context, slots = 300, 10
    new, old = _filled(kind, 3, context, slots), _filled(kind, 3, context, slots)
    _move_cache_rows(new, context, [context + s for s in keep])
    _old_move_cache_rows(old, context, [context + s for s in keep])
    for c in (*new, *old):
        c.trim(slots - len(keep))
    a, b = _flat(new), _flat(old)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert x.shape == y.shape and mx.array_equal(x, y).item()
    # the kept rows are the chosen slots, the context untouched
    if kind != "quantized":
        ref = _flat(_filled(kind, 1, context, slots))[0]
        got = a[0]
        want = mx.take(ref, mx.array([context + s for s in keep]), axis=-2)
        assert mx.array_equal(got[..., context:, :], want).item()
        assert mx.array_equal(got[..., :context, :], ref[..., :context, :]).item()


def test_keep_move_does_not_copy_the_cache():
    """Peak memory during the move stays far below one layer's buffer (the old
    way allocated a full copy of every moved array)."""
    context, slots = 4096, 10
    cache = _filled("kv", 2, context, slots)
    one_buffer = cache[0].keys.nbytes
    mx.eval(mx.zeros(1))
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    _move_cache_rows(cache, context, [context + 1, context + 3])
    mx.eval([(c.keys, c.values) for c in cache])
    grown = mx.get_peak_memory() - base
    assert grown < 0.1 * one_buffer, (grown, one_buffer)


def _tree_step(eng, start_tokens, keep):
    """Prefill ``start_tokens``, run a 10-slot tree pass (a chain root -> 1..4
    and a branch 5..9 under the root), keep ``[0, *keep]``."""
    import numpy as np

    eng.sync(start_tokens)
    parents = np.array([-1, 0, 1, 2, 3, 0, 5, 6, 7, 8])
    toks = [7, 11, 12, 13, 14, 21, 22, 23, 24, 25]
    eng.forward_tree(eng.embed_tokens(toks), parents, toks)
    start = len(start_tokens)
    eng.keep(start, [0, *keep])
    return [t for i, t in enumerate(toks) if i in (0, *keep)]


@pytest.mark.parametrize("keep", [[5, 6], [5, 6, 7, 8, 9], [1, 2], [5]])
def test_keep_after_a_tree_pass_moves_the_slots_own_rows_lazily(keep):
    """After a tree pass over plain KV caches, keep writes the accepted slots'
    keys/values from the pass itself, without a synchronisation: the same cache
    as the evaluated gather (``_move_cache_rows``) and the same next logits."""
    from tiny_models import make_tiny_model

    from mlx_mtp.engine import Engine

    model = make_tiny_model("llama", seed=1)
    install_positional_rope(model)  # per-token RoPE positions of a tree pass
    prompt = list(range(3, 40))
    lazy, moved = Engine(model), Engine(model)
    kept = _tree_step(lazy, prompt, keep)
    # the reference: the same step with the evaluated gather of the cache rows
    moved.sync(prompt)
    import numpy as np

    parents = np.array([-1, 0, 1, 2, 3, 0, 5, 6, 7, 8])
    toks = [7, 11, 12, 13, 14, 21, 22, 23, 24, 25]
    moved.forward_tree(moved.embed_tokens(toks), parents, toks)
    moved._tree_rows = None  # force the evaluated gather
    moved.keep(len(prompt), [0, *keep])
    assert lazy.cached == moved.cached == prompt + kept
    for a, b in zip(_flat(lazy.cache), _flat(moved.cache)):
        assert a.shape == b.shape and mx.array_equal(a, b).item()
    la, _ = lazy.forward_chain([30])
    lb, _ = moved.forward_chain([30])
    assert mx.array_equal(la, lb).item()
    # and what a plain causal pass over the kept tokens gives
    ref = Engine(model)
    ref.sync(prompt + kept)
    lr, _ = ref.forward_chain([30])
    assert mx.allclose(la, lr, atol=1e-4).item()


def test_lazy_keep_does_not_copy_the_cache():
    """The lazy move's update takes over the cache buffer: evaluating it grows
    peak memory by far less than one layer's buffer at 2K tokens."""
    from tiny_models import make_tiny_model

    from mlx_mtp.engine import Engine

    model = make_tiny_model("llama", seed=1)
    install_positional_rope(model)
    eng = Engine(model)
    _tree_step(eng, [i % 256 for i in range(2048)], [5, 6])
    one_buffer = eng.cache[0].keys.nbytes
    mx.eval(mx.zeros(1))
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval([(c.keys, c.values) for c in eng.cache])
    grown = mx.get_peak_memory() - base
    assert grown < 0.1 * one_buffer, (grown, one_buffer)
