"""A batch of plain requests starting from a shared prefix's KV cache, against
prefilling every prompt whole.

Runs mlx-lm's ``BatchGenerator`` (as the server's plain batch does) on the
first ``--clients`` Spec-Bench questions under ``--below`` chat-prompt tokens,
``--max-tokens`` each, once with every prompt prefilled whole and once with
each row starting from a copy of the KV cache of the prompts' common prefix
(their chat template's first tokens), as ``mlx-mtp serve --max-batch`` does
for a prompt that shares a prefix with the newest finished request. Prints
the seconds to the first token and to the last, per round.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python examples/batch_prefix_reuse.py \\
        --clients 8 --max-tokens 64 --rounds 3
"""

from __future__ import annotations

import argparse
import time

from serve_batch import questions

from mlx_mtp.loading import load_model


def main() -> None:
    """Time both ways and print them."""
    import mlx.core as mx  # after mlx_mtp: the BLAS it loads
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--below", type=int, default=120)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    lm = load_model(args.model, "float32")
    chat = [
        [{"role": "user", "content": q}] for q in questions(lm.tokenizer, args.clients, args.below)
    ]
    ids = [lm.tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in chat]
    n = 0
    while all(len(i) > n + 1 and i[n] == ids[0][n] for i in ids):
        n += 1
    shared = make_prompt_cache(lm.model)
    lm.model(mx.array(ids[0][:n])[None], cache=shared)
    mx.eval([c.state for c in shared])

    def copy() -> list[KVCache]:
        out = []
        for c in shared:
            k = KVCache()
            k.keys, k.values = (
                mx.contiguous(c.keys[..., :n, :]),
                mx.contiguous(c.values[..., :n, :]),
            )
            k.offset = n
            out.append(k)
        return out

    def run(reuse: bool) -> tuple[float, float]:
        gen = BatchGenerator(lm.model, stop_tokens=[[-1]], completion_batch_size=len(ids),
                             prefill_batch_size=len(ids), prefill_step_size=256)  # fmt: skip
        t0 = time.perf_counter()
        if reuse:
            gen.insert([i[n:] for i in ids], [args.max_tokens] * len(ids),
                       caches=[copy() for _ in ids], all_tokens=[i[:n] for i in ids])  # fmt: skip
        else:
            gen.insert(ids, [args.max_tokens] * len(ids))
        first, done = None, 0
        while done < len(ids):
            _, got = gen.next()
            if got and first is None:
                first = time.perf_counter() - t0
            done += sum(r.finish_reason is not None for r in got)
        gen.close()
        return first or 0.0, time.perf_counter() - t0

    print(f"{args.model} float32, {len(ids)} prompts ({sum(map(len, ids))} tokens, "
          f"{n} shared each) x {args.max_tokens} new tokens")  # fmt: skip
    run(False)  # warm-up
    for r in range(args.rounds):
        for reuse in (False, True):
            first, last = run(reuse)
            label = "shared prefix cached" if reuse else "prompts whole"
            print(f"round {r + 1} {label:21} first token {first:5.2f} s  last {last:5.2f} s")


if __name__ == "__main__":
    main()
