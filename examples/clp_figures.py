"""Figures of the clp method (docs/methods.md, clp; measuring: docs/design.md §9).

On the Spec-Bench evaluation prompts (``spec_bench_sample(per_task)``, 48 at
the default 8 per task) x ``max_tokens``, greedy, float32, in one process with
the methods interleaved prompt by prompt:

* head top-1 accuracy per offset (head j vs the greedy token n+1+j, teacher
  forced on the ntp output);
* for ``clp`` paper and verified mode, with the linear span predictor and with
  the ~1M-parameter gate baseline: tau, wall-clock speedup over ``ntp``,
  repetition rate (share of repeated 4-grams within an output) next to ntp's
  own, and for paper mode the share of outputs identical to greedy.

    python examples/clp_figures.py [--per-task 8] [--max-tokens 128] [--out clp.json]
        [--settings ntp,clp-verified,clp-paper,gate-verified,gate-paper] [--heads FOLDER]
        [--model smollm2-135m] [--data PROMPTS.jsonl --limit N]

``--data`` takes the prompts from a jsonl file (e.g. GSM8K's test split)
instead of Spec-Bench: its first ``--limit`` questions.

With ``--from-bench DIR`` (a finished or partial ``mlx-mtp bench`` output that
ran ``clp`` settings) nothing is decoded again: head top-1 accuracy is measured
on that run's ``ntp`` outputs (one teacher-forced forward per prompt), and the
speed, tau and repetition figures are in that run's ``report.md``.
"""

from __future__ import annotations

import argparse
import json
import time

import mlx_mtp  # noqa: F401  (first: loads OpenBLAS ahead of mlx on Linux)

# isort: split
import mlx.core as mx
import numpy as np
from tqdm import tqdm

from mlx_mtp.confadapt_format import tokenizer_eos_ids
from mlx_mtp.context import Context
from mlx_mtp.data import read_prompts, render_prompt, spec_bench_sample
from mlx_mtp.decoding import generate_steps
from mlx_mtp.engine import Engine
from mlx_mtp.loading import load_model
from mlx_mtp.methods import make_method

try:
    from mlx_mtp.bench.metrics import repetition_rate
except ImportError:  # pragma: no cover

    def repetition_rate(tokens, n=4):
        grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
        return (len(grams) - len(set(grams))) / len(grams) if grams else 0.0


SETTINGS = {
    "ntp": ("ntp", {}),
    "clp-verified": ("clp", {"mode": "verified"}),
    "clp-paper": ("clp", {"mode": "paper"}),
    "gate-verified": ("clp", {"mode": "verified", "predictor": "gate"}),
    "gate-paper": ("clp", {"mode": "paper", "predictor": "gate"}),
}


def head_accuracy(engine: Engine, heads, prompt: list[int], out: list[int]) -> np.ndarray:
    """(k, 2) counts [correct, total] of head j on the greedy output ``out``
    (teacher forced: h_n and the greedy token n+1 in, token n+1+j expected)."""
    seq = prompt + out
    P = len(prompt)
    if len(out) < 2:
        return np.zeros((heads.k, 2))
    engine.sync(prompt[:-1])  # reuses the cached prompt
    _, h = engine.forward_chain(seq[P - 1 : -1], hidden=True)  # h[i] at position P-1+i
    pos = np.arange(P - 1, len(seq) - 2)  # positions whose token n+2 exists
    hl = heads.head_logits(
        h[: len(pos)], engine.embed_tokens([seq[p + 1] for p in pos]), engine.lm_head
    )
    pred = np.array(mx.argmax(hl, axis=-1))
    counts = np.zeros((heads.k, 2))
    for j in range(heads.k):
        ok = np.array([(p + 2 + j) < len(seq) for p in pos])
        tgt = np.array([seq[p + 2 + j] if o else -1 for p, o in zip(pos, ok)])
        counts[j] = [((pred[j] == tgt) & ok).sum(), ok.sum()]
    return counts


def accuracy_from_bench(bench_dir: str, heads_folder: str | None, model: str) -> dict:
    """Head top-1 per offset on the ntp outputs recorded by ``mlx-mtp bench``."""
    from mlx_mtp.bench.runner import recorded_outputs

    lm = load_model(model, dtype="float32")
    rows = recorded_outputs(bench_dir, lm.tokenizer, "ntp")
    engine = Engine(lm.model)
    m = make_method("clp", **({"heads": heads_folder} if heads_folder else {}))
    m.prepare(Context(engine, lm))
    acc = np.zeros((m.heads.k, 2))
    for prompt, out, _ in tqdm(rows, desc="head accuracy"):
        acc += head_accuracy(engine, m.heads, prompt, out)
    return {
        "bench": bench_dir,
        "prompts": len(rows),
        "head_top1": [float(c / t) if t else 0.0 for c, t in acc],
        "positions": [int(t) for _, t in acc],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-task", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--heads", default=None, help="heads folder (default: shipped heads)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--from-bench", default=None, help="an mlx-mtp bench --out folder")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default=None, help="prompt jsonl instead of Spec-Bench")
    ap.add_argument("--limit", type=int, default=48, help="prompts of --data")
    args = ap.parse_args()
    if args.from_bench:
        table = accuracy_from_bench(args.from_bench, args.heads, args.model)
        print(json.dumps(table, indent=2))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(table, f, indent=2)
        return

    lm = load_model(args.model, dtype="float32")
    tok = lm.tokenizer
    if args.data:
        texts = read_prompts(args.data, limit=args.limit)
    else:
        texts = [q["turns"][0] for q in spec_bench_sample(args.per_task)]
    prompts = [render_prompt(tok, [{"role": "user", "content": t}]) for t in texts]
    eos = set(tokenizer_eos_ids(tok))
    names = args.settings.split(",")
    # shared: each prompt is prefilled once, then reused by prefix
    ctx = Context(Engine(lm.model), lm)
    runs = {}
    for name in names:
        mname, opts = SETTINGS[name]
        if mname == "clp" and args.heads:
            opts = {**opts, "heads": args.heads}
        m = make_method(mname, **opts)
        m.prepare(ctx)
        runs[name] = (m, ctx)
    rec = {n: {"tokens": 0, "time": 0.0, "forwards": 0, "rep": [], "same": 0} for n in names}
    outs: dict[str, list[list[int]]] = {n: [] for n in names}
    heads = runs[next(n for n in names if n != "ntp")][0].heads
    acc = np.zeros((heads.k, 2))
    for i, p in enumerate(tqdm(prompts, desc="prompts")):
        order = names if i % 2 == 0 else names[::-1]  # interleave, alternate order
        for name in order:
            m, e = runs[name]
            toks = []
            for s in generate_steps(e, m, p, max_tokens=args.max_tokens, eos_ids=eos):
                toks.extend(s.tokens)
            r = rec[name]
            r["tokens"] += s.stats.generated_tokens
            r["time"] += s.stats.decode_time
            r["forwards"] += s.stats.forward_passes
            r["rep"].append(repetition_rate(toks))
            outs[name].append(toks)
        if "ntp" in names:
            acc += head_accuracy(ctx.engine, heads, p, outs["ntp"][-1])
            for name in names:
                rec[name]["same"] += int(outs[name][-1] == outs["ntp"][-1])
    ntp_tps = rec["ntp"]["tokens"] / rec["ntp"]["time"] if "ntp" in rec else float("nan")
    table = {
        "model": args.model,
        "data": args.data or f"spec-bench, {args.per_task} per task",
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "head_top1": [float(c / t) if t else 0.0 for c, t in acc],
        "span_predictor_params": runs.get("clp-paper", runs[names[-1]])[0].predictor_params(),
        "settings": {},
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    for name in names:
        r = rec[name]
        tps = r["tokens"] / r["time"] if r["time"] else 0.0
        table["settings"][name] = {
            "tau": r["tokens"] / max(r["forwards"], 1),
            "decode_tps": tps,
            "speedup_vs_ntp": tps / ntp_tps,
            "repetition_rate": float(np.mean(r["rep"])),
            "identical_to_greedy": r["same"] / len(prompts),
        }
    print(json.dumps(table, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(table, f, indent=2)


if __name__ == "__main__":
    main()
