"""Time ``Engine.keep``'s cache move at 512 / 8K / 32K tokens of context, the
old one-graph way (``slice_update(a, take(a, idx))``) against the current one
(gathered rows evaluated first, docs/design.md §10), side by side in one process.

Each step mimics a decoding step of a tree method: ``--slots`` new tree slots
are appended to every layer's ``KVCache`` (as a tree forward does), then
``--accept`` of them, not the first ones, are moved to the front of the new
region and the rest trimmed, and the cache is evaluated. The two ways run
alternately, on identical caches; the median step time is divided by the
number of layers. The last check compares the two caches' contents.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python examples/keep_bench.py \
        [--contexts 512,8192,32768] [--layers 4] [--repeats 7]

Cache layout: 8 KV heads x head dim 128, bfloat16 (a Llama-3-8B / Qwen3-4B-like
layer), batch 1.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

# isort: off
import mlx_mtp  # noqa: F401  (first: it loads OpenBLAS before mlx on Linux)

# isort: on
import mlx.core as mx
from mlx_lm.models.cache import KVCache
from tqdm import tqdm

from mlx_mtp.engine import _move_cache_rows

HEADS, HEAD_DIM, DTYPE = 8, 128, mx.bfloat16


def old_move_cache_rows(cache: list[KVCache], start: int, rows: list[int]) -> None:
    """The move before the fix: gather and update in one lazy graph per array,
    which keeps the array alive as the gather's input, so the update copies it."""
    idx, at = mx.array(rows), mx.array([start])
    for c in cache:
        c.keys, c.values = (
            mx.slice_update(a, mx.take(a, idx, axis=-2), at, axes=(a.ndim - 2,))
            for a in (c.keys, c.values)
        )


def make_cache(layers: int, context: int, seed: int = 0) -> list[KVCache]:
    """``layers`` KV caches holding ``context`` random tokens each (evaluated)."""
    mx.random.seed(seed)
    cache = []
    for _ in range(layers):
        c = KVCache()
        k = mx.random.normal((1, HEADS, context, HEAD_DIM)).astype(DTYPE)
        v = mx.random.normal((1, HEADS, context, HEAD_DIM)).astype(DTYPE)
        c.update_and_fetch(k, v)
        cache.append(c)
    mx.eval([(c.keys, c.values) for c in cache])
    return cache


def step(cache: list[KVCache], move, slots: int, keep: list[int]) -> float:
    """One tree step on ``cache``: append ``slots`` rows, keep ``keep``, trim.
    Returns the seconds spent on the keep (move + trim + evaluation)."""
    start = cache[0].offset
    new = [
        mx.random.normal((1, HEADS, slots, HEAD_DIM)).astype(DTYPE) for _ in range(2 * len(cache))
    ]
    for i, c in enumerate(cache):
        c.update_and_fetch(new[2 * i], new[2 * i + 1])
    mx.eval([(c.keys, c.values) for c in cache])
    del new
    t0 = time.perf_counter()
    move(cache, start, [start + s for s in keep])
    for c in cache:
        c.trim(slots - len(keep))
    mx.eval([(c.keys, c.values) for c in cache])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="512,8192,32768")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--slots", type=int, default=10, help="tree slots per step (BC)")
    ap.add_argument("--accept", type=int, default=3, help="slots kept per step")
    args = ap.parse_args()
    contexts = [int(x) for x in args.contexts.split(",")]
    keep = list(range(1, 2 * args.accept, 2))[: args.accept]  # not a prefix: rows must move
    print(
        f"keep benchmark: {platform.machine()} {platform.system()}, device "
        f"{mx.default_device()}, {args.layers} layers x {HEADS} KV heads x {HEAD_DIM}, "
        f"{DTYPE}, {args.slots} slots -> keep {keep}, median of {args.repeats}"
    )
    print("| context | old ms/layer | new ms/layer | old/new |")
    print("|---:|---:|---:|---:|")
    bar = tqdm(total=len(contexts) * args.repeats * 2, desc="keep", leave=False)
    for ctx in contexts:
        caches = {"old": make_cache(args.layers, ctx), "new": make_cache(args.layers, ctx)}
        moves = {"old": old_move_cache_rows, "new": _move_cache_rows}
        times: dict[str, list[float]] = {"old": [], "new": []}
        for r in range(args.repeats + 1):  # the first round is a warm-up
            for name in ("old", "new") if r % 2 else ("new", "old"):
                mx.random.seed(1000 + r)  # both ways get the same new rows
                dt = step(caches[name], moves[name], args.slots, keep)
                if r:
                    times[name].append(dt)
                    bar.update(1)
        same = all(
            mx.array_equal(a.state[i], b.state[i]).item()
            for a, b in zip(caches["old"], caches["new"])
            for i in (0, 1)
        )
        old, new = (1000 * statistics.median(times[k]) / args.layers for k in ("old", "new"))
        bar.write(
            f"| {ctx} | {old:.3f} | {new:.3f} | {old / new:.0f}x |"
            + ("" if same else " CONTENTS DIFFER")
        )
        del caches
    bar.close()


if __name__ == "__main__":
    main()
