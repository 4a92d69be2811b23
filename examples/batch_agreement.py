"""Batched plain decoding against solo decoding: agreement and throughput.

Answers the first ``--prompts`` Spec-Bench prompts (round-robin over the six
tasks, prompts under 700 tokens) with ``--max-tokens`` new tokens, greedy,
once one at a time through the Python API (``MTPModel.generate``, method
``ntp``) and once batched (``LoadedModel.batch_generate``, at most
``--max-batch`` rows per forward pass), and prints how many answers are
identical token for token (and where the others first differ) and the
aggregate tokens per second of each (the solo run's also without its
prefills, which on a CPU can take most of the time). ``--methods ntp,pld``
runs each batched method (``pld``, ``recycle``, ``draft`` with
``--draft-model``: drafts verified inside the batch), ``--rounds`` times,
alternating.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python examples/batch_agreement.py \\
        --prompts 8 --max-tokens 64 --max-batch 8 [--below 700] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

from mlx_mtp.api import MTPModel
from mlx_mtp.data import TASKS, load_questions
from mlx_mtp.loading import load_model
from mlx_mtp.methods import make_method


def spec_prompts(
    tokenizer, n: int, below: int = 700, tasks: tuple[str, ...] = TASKS
) -> list[list[int]]:
    """The first ``n`` Spec-Bench prompts under ``below`` tokens, round-robin
    over ``tasks``, as chat-formatted token ids."""
    qs = load_questions()
    by_task = {t: [q for q in qs if q["task"] == t] for t in tasks}
    out = []
    for i in range(80):
        for t in tasks:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": by_task[t][i]["turns"][0]}],
                add_generation_prompt=True,
            )
            if len(ids) < below:
                out.append(list(ids))
            if len(out) == n:
                return out
    return out


def main() -> None:
    """Run the comparison and print (and optionally save) the figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--below", type=int, default=700, help="prompts under this many tokens")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--methods", default="ntp",
                    help="batched methods, comma-separated (ntp, pld, recycle, draft)")  # fmt: skip
    ap.add_argument("--draft-model", default=None, help="the draft model of method draft")
    ap.add_argument("--rounds", type=int, default=1,
                    help="batched runs of each method, alternating")  # fmt: skip
    ap.add_argument("--tasks", default=",".join(TASKS), help="Spec-Bench tasks to draw from")
    args = ap.parse_args()

    lm = load_model(args.model, args.dtype)
    prompts = spec_prompts(lm.tokenizer, args.prompts, args.below, tuple(args.tasks.split(",")))
    methods = args.methods.split(",")
    solo_model = MTPModel(lm, make_method("ntp"))
    solo_model.generate(prompts[0], max_tokens=4)  # warm-up
    lm.batch_generate(prompts[:2], max_tokens=4)

    t0 = time.perf_counter()
    solo = [solo_model.generate(p, max_tokens=args.max_tokens) for p in prompts]
    solo_s = time.perf_counter() - t0
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    for _ in range(args.rounds):
        for m in methods:
            t0 = time.perf_counter()
            extra = {"draft_model": args.draft_model} if m == "draft" else {}
            batched = lm.batch_generate(
                prompts, max_tokens=args.max_tokens, max_batch=args.max_batch, method=m, **extra
            )
            batch_s = time.perf_counter() - t0
            differ = []
            for i, (a, b) in enumerate(zip(solo, batched)):
                if a.tokens != b.tokens:
                    at = next(
                        (k for k, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), None
                    )
                    differ.append({"prompt": i, "first_difference": at})
            steps = sum(r.stats.steps for r in batched)
            runs[m].append(
                {
                    "identical": len(prompts) - len(differ),
                    "differ": differ,
                    "batch_s": round(batch_s, 2),
                    "batch_tok_s": round(sum(len(r.tokens) for r in batched) / batch_s, 2),
                    "tau": round(1 + sum(r.stats.accepted for r in batched) / max(1, steps), 2),
                }
            )
    tokens = sum(len(r.tokens) for r in solo)
    figures = {
        "model": args.model,
        "dtype": args.dtype,
        "machine": f"{platform.system()} {platform.machine()}",
        "prompts": len(prompts),
        "prompt_tokens": [len(p) for p in prompts],
        "max_tokens": args.max_tokens,
        "max_batch": args.max_batch,
        "tasks": args.tasks,
        "new_tokens": tokens,
        "solo_s": round(solo_s, 2),
        "solo_tok_s": round(tokens / solo_s, 2),
        "solo_prefill_s": round(sum(r.stats.prefill_time for r in solo), 2),
        "solo_decode_tok_s": round(tokens / sum(r.stats.decode_time for r in solo), 2),
        "batched": runs,
    }
    print(json.dumps(figures, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
