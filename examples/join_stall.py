"""How long the rows of a drafting batch wait while a long prompt joins.

Two short Spec-Bench prompts decode in a ``pld`` batch
(:class:`~mlx_mtp.batching.DraftBatch`); after ``--warm`` steps a long
prompt (``--long`` tokens of Spec-Bench summarization and RAG prompts, one
after another) joins, either prefilled whole
at once (``DraftBatch.add``) or one chunk of ``--chunk`` tokens after each
step (``begin`` / ``advance``, as ``mlx-mtp serve --max-batch`` joins it).
Prints, for each way and round, the longest wait between two token
deliveries of the decoding rows, the long prompt's time to its first
token, and the whole run's time; every answer is checked against solo
greedy decoding.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python examples/join_stall.py \\
        [--model smollm2-135m] [--long 1500] [--chunk 512] [--rounds 2]
"""

from __future__ import annotations

import argparse
import time

from batch_agreement import spec_prompts

from mlx_mtp.api import MTPModel
from mlx_mtp.batching import DraftBatch
from mlx_mtp.loading import load_model
from mlx_mtp.methods import make_method


def run(lm, ntp, short, long, limits, chunked, chunk, warm):
    """One batch: the figures and each prompt's tokens."""
    batch = DraftBatch.for_method(lm.model, ntp.eos_ids, "pld")
    out = {}
    for p, n in zip(short, limits):
        uid, got = batch.add(p, n)
        out[uid] = list(got.tokens)
    t0 = last = time.perf_counter()
    longest, steps, long_uid, first = 0.0, 0, None, None
    while len(batch) or batch.joining or long_uid is None:
        if steps == warm and long_uid is None:
            if chunked:
                long_uid = batch.begin(long, limits[0])
                out[long_uid] = []
            else:
                long_uid, got = batch.add(long, limits[0])
                out[long_uid] = list(got.tokens)
                first = time.perf_counter()
        got = batch.step()
        joined = batch.advance(chunk) if chunked else None
        now = time.perf_counter()
        if any(g.uid != long_uid for g in got):
            longest, last = max(longest, now - last), now
        for g in [*got, *([joined] if joined is not None else [])]:
            out[g.uid].extend(g.tokens)
        if joined is not None:
            first = now
        steps += 1
    return {"longest_wait_s": longest, "long_first_token_s": first - t0,
            "total_s": time.perf_counter() - t0}, [out[u] for u in sorted(out)]  # fmt: skip


def main() -> None:
    """Print the figures of each way, alternating, ``--rounds`` times."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--long", type=int, default=1500, help="tokens of the joining prompt")
    ap.add_argument("--chunk", type=int, default=512, help="prefill tokens per step")
    ap.add_argument("--warm", type=int, default=4, help="steps before the long prompt joins")
    ap.add_argument("--tokens", type=int, default=48, help="new tokens per prompt")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    lm = load_model(args.model, "float32")
    ntp = MTPModel(lm, make_method("ntp"))
    short = [list(p) for p in spec_prompts(lm.tokenizer, 2, 700, ("qa", "mt_bench"))]
    # the long prompt: summarization and RAG prompts one after another, cut to --long
    texts = spec_prompts(lm.tokenizer, 12, 2000, ("summarization", "rag"))
    text = [t for p in texts for t in p]
    long = (text * (args.long // len(text) + 1))[: args.long]
    limits = [args.tokens] * 2
    want = [ntp.generate(p, max_tokens=n, temp=0.0).tokens for p, n in zip(short, limits)]
    want.append(ntp.generate(long, max_tokens=args.tokens, temp=0.0).tokens)
    print(f"{args.model} float32, pld batch, 2 rows decoding, a {len(long)}-token prompt joins")
    for r in range(args.rounds):
        for chunked in (False, True):
            figs, got = run(lm, ntp, short, long, limits, chunked, args.chunk, args.warm)
            way = f"in {args.chunk}-token chunks" if chunked else "whole, at once"
            equal = sum(g == w for g, w in zip(got, want))
            print(f"round {r + 1}, {way:>20}: longest wait {figs['longest_wait_s']:.2f} s, "
                  f"its first token {figs['long_first_token_s']:.2f} s, "
                  f"all {figs['total_s']:.2f} s, answers equal to solo: {equal}/3")  # fmt: skip


if __name__ == "__main__":
    main()
