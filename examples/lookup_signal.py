"""How well the n-gram length of a prompt-lookup match predicts its drafts.

Decodes Spec-Bench prompts with ``pld`` on pipelined steps under a steep cost
curve (every step plain: nothing drafted, every lookup scored as
verification would have scored it, :class:`mlx_mtp.sources.lookup.LookupDrafter`)
and prints, per signal class (the n-gram length matched: 0 none, 1..3), how
many lookups were scored and the acceptance of depths 1-4 (depth d given
depths 1..d-1 accepted).

    OPENBLAS_NUM_THREADS=1 python examples/lookup_signal.py --prompts 4
    OPENBLAS_NUM_THREADS=1 python examples/lookup_signal.py --prompts 4 --fresh

Without ``--fresh`` the class is the match at the root before (what a
pipelined step's width is chosen from); with it, the match at the step's own
root (steps launched after the one before was read).
"""

from __future__ import annotations

import argparse
import os

import mlx_mtp  # noqa: F401  (first: OpenBLAS before mlx on Linux)
from mlx_mtp import pipeline
from mlx_mtp.acceptance import AcceptanceModel
from mlx_mtp.budget import CostCurve
from mlx_mtp.context import Context
from mlx_mtp.data import TASKS, load_questions
from mlx_mtp.decoding import generate_steps
from mlx_mtp.engine import Engine
from mlx_mtp.loading import load_model
from mlx_mtp.methods import make_method


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per task (under 700 tokens)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--fresh", action="store_true", help="the match at the step's own root")
    args = ap.parse_args()
    os.environ["MLX_MTP_PIPELINE"] = "sync" if args.fresh else "1"
    lm = load_model(args.model, dtype="float32")
    tok = lm.tokenizer
    qs = load_questions()
    prompts = []
    for t in TASKS:
        ids = [
            tok.apply_chat_template(
                [{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True
            )
            for q in qs
            if q["task"] == t
        ]
        prompts += [p for p in ids if len(p) < 700][: args.prompts]
    ctx = Context(Engine(lm.model), curves=CostCurve.linear(1.0))  # no draft ever pays
    method = make_method("pld")
    # plain counts: no prior, no forgetting, nothing weighed down between prompts
    method.PIPELINE_ACCEPTANCE = AcceptanceModel(weight=0.0, decay=1.0, max_depth=24)
    pipeline.CARRY_WEIGHT = 1.0
    method.prepare(ctx)
    for p in prompts:
        for _ in generate_steps(ctx, method, p, max_tokens=args.max_tokens):
            pass
    acc = next(v for k, v in ctx.learned.items() if k.startswith("pipeline:"))
    where = "its own root" if args.fresh else "the root before"
    print(
        f"{args.model} float32, {len(prompts)} Spec-Bench prompts x {args.max_tokens} tokens, "
        f"class: the n-gram length matched at {where}"
    )
    for name, d in sorted(acc.depths.items()):
        qs_ = [d.acc[i] / d.tried[i] if d.tried[i] else float("nan") for i in range(1, 5)]
        print(
            f"{name}: {int(d.tried[1])} lookups, depth 1-4 accepted "
            + " ".join(f"{q:.2f}" for q in qs_)
        )


if __name__ == "__main__":
    main()
