"""tau, time per token and communication per token of the methods on a model
sharded over N ranks (mlx.distributed), or in one process.

Run it alone for the one-rank figure, and under a launcher for N ranks; only
rank 0 prints and writes. Each method decodes the same prompts (greedy);
ntp first, interleaved prompt by prompt.

    OPENBLAS_NUM_THREADS=1 python examples/dist_bench.py --out /tmp/d1.json
    mlx.launch -n 3 -- python examples/dist_bench.py --out /tmp/d3.json

Communication is counted from the sharded model's structure: tensor parallel
does one ``all_sum`` per sharded-to-all linear (attention output and MLP
down projection: 2 per layer) each forward pass; pipeline parallel one
send/recv per stage boundary plus one ``all_gather`` each forward pass. Per
generated token that is ``collectives_per_forward * forwards / tokens``: a
multi-token method pays it once per forward, not once per token.
"""

# ruff: noqa: I001  (mlx_mtp is imported before mlx: it preloads OpenBLAS)
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx_mtp  # first: preloads OpenBLAS before mlx on Linux

import mlx.nn as nn  # noqa: E402

from mlx_mtp import distributed  # noqa: E402
from mlx_mtp.data import spec_bench_sample


def collectives_per_forward(model: nn.Module) -> int:
    """Collective operations one forward pass of ``model`` makes (0 alone)."""
    how = distributed.sharding(model)
    if how == "tensor":
        cls = (nn.layers.distributed.ShardedToAllLinear,)
        q = getattr(nn.layers.distributed, "QuantizedShardedToAllLinear", None)
        cls += (q,) if q else ()
        return sum(isinstance(m, cls) for _, m in model.named_modules())
    if how == "pipeline":
        return distributed.size()  # N-1 send/recv boundaries + 1 all_gather
    return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", default="ntp;probe:bc=30;hybrid:bc=30;pld")
    ap.add_argument("--per-task", type=int, default=1)
    ap.add_argument("--limit", type=int, default=None, help="Use only the first N prompts.")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--pipeline", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    prompts = [q["turns"][0] for q in spec_bench_sample(args.per_task)][: args.limit]
    models = {}
    loaded = None
    for spec in args.methods.split(";"):
        name, _, rest = spec.partition(":")
        opts = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
        if loaded is None:
            m = mlx_mtp.load(args.model, name, dtype="float32", pipeline=args.pipeline, **opts)
            loaded = m.loaded
        else:
            m = mlx_mtp.MTPModel(loaded, mlx_mtp.methods.make_method(name, **opts))
        models[spec] = m
    for m in models.values():  # warm-up
        m.generate("Say hello.", max_tokens=8)
        m.engine.reset()
    comm = collectives_per_forward(loaded.model)
    totals = {s: {"tokens": 0, "forwards": 0, "decode_s": 0.0} for s in models}
    texts: dict[str, list[list[int]]] = {s: [] for s in models}
    t_start = time.perf_counter()
    for p in prompts:
        for spec, m in models.items():
            m.engine.reset()
            r = m.generate(p, max_tokens=args.max_tokens, temp=0.0)
            t = totals[spec]
            t["tokens"] += r.stats.generated_tokens
            t["forwards"] += r.stats.forward_passes
            t["decode_s"] += r.stats.decode_time
            texts[spec].append(r.tokens)
    rows = []
    ref = texts[next(iter(models))]
    for spec, t in totals.items():
        rows.append(
            {
                "method": spec,
                "tau": t["tokens"] / t["forwards"],
                "ms_per_token": 1000 * t["decode_s"] / t["tokens"],
                "forwards_per_token": t["forwards"] / t["tokens"],
                "collectives_per_token": comm * t["forwards"] / t["tokens"],
                "tokens": t["tokens"],
                "same_tokens_as_first": texts[spec] == ref,
            }
        )
    result = {
        "model": args.model,
        "dtype": "float32",
        "ranks": distributed.size(),
        "sharding": distributed.sharding(loaded.model) or "none",
        "collectives_per_forward": comm,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "wall_s": time.perf_counter() - t_start,
        "rows": rows,
        "tokens": texts,
    }
    if distributed.is_main():
        print(
            f"{args.model} float32, {result['ranks']} rank(s), sharding {result['sharding']}, "
            f"{comm} collectives per forward, {len(prompts)} prompts x {args.max_tokens} tokens"
        )
        print("| method | tau | ms/token | forwards/token | collectives/token | = first |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['method']} | {r['tau']:.2f} | {r['ms_per_token']:.1f} | "
                f"{r['forwards_per_token']:.3f} | {r['collectives_per_token']:.1f} | "
                f"{r['same_tokens_as_first']} |"
            )
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
