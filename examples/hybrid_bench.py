"""Interleaved tau / decode-speed measurement of hybrid, probe and baselines.

Like ``mlx-mtp bench`` but every method of a prompt decodes from the same
engine, so a prompt is prefilled once (the cache is trimmed back to the prompt
between methods); useful on a loaded CPU where prefill dominates. Methods run
interleaved prompt by prompt (ntp first); decode tokens/s excludes prefill.
Resumable: records go to ``OUT/records.jsonl``; a rerun skips what is there.
Each method's output is compared token by token with ntp (greedy exactness).

    python examples/hybrid_bench.py --per-task 8 --max-tokens 128 --out /tmp/b \\
        --methods "pld;lookahead;probe:bc=10;probe:bc=30;probe:bc=30,mask_init=learned;\\
hybrid:bc=10;hybrid:bc=30"
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm  # noqa: E402

import mlx_mtp  # noqa: F401  (first: preloads OpenBLAS before mlx on Linux)
from mlx_mtp.data import TASKS, spec_bench_sample  # noqa: E402
from mlx_mtp.decoding import generate_steps  # noqa: E402
from mlx_mtp.engine import Engine  # noqa: E402
from mlx_mtp.loading import load_model  # noqa: E402
from mlx_mtp.methods import make_method  # noqa: E402


def parse(spec: str) -> tuple[str, dict[str, str]]:
    name, _, rest = spec.partition(":")
    opts = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    return name, opts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", required=True, help="';'-separated, e.g. 'pld;hybrid:bc=30'")
    ap.add_argument("--per-task", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rec_path = out / "records.jsonl"
    done = set()
    if rec_path.exists():
        for line in rec_path.read_text().splitlines():
            r = json.loads(line)
            done.add((r["qid"], r["method"]))
    lm = load_model(args.model, dtype="float32")
    tok = lm.tokenizer
    eos = set(tok.eos_token_ids)
    specs = ["ntp"] + [s for s in args.methods.split(";") if s and s != "ntp"]
    methods = {s: make_method(*parse(s)[:1], **parse(s)[1]) for s in specs}
    qs = spec_bench_sample(args.per_task)
    by_task = defaultdict(list)
    for q in qs:
        by_task[q["task"]].append(q)
    order = [by_task[t][i] for i in range(args.per_task) for t in TASKS if i < len(by_task[t])]
    # warm-up: one short generation per method
    warm = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    for m in methods.values():
        e = Engine(lm.model)
        m.prepare(e)
        for _ in generate_steps(e, m, warm, max_tokens=8, eos_ids=eos):
            pass
    with open(rec_path, "a") as f:
        for q in tqdm(order, desc="prompts"):
            todo = [s for s in specs if (q["question_id"], s) not in done]
            if not todo:
                continue
            ids = tok.apply_chat_template(
                [{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True
            )
            engine = Engine(lm.model)
            ref = None
            for s in specs:  # ntp first (rerun if needed for the exactness check)
                if s not in todo and s != "ntp":
                    continue
                m = methods[s]
                m.prepare(engine)
                toks, last = [], None
                t0 = time.perf_counter()
                for st in generate_steps(engine, m, ids, max_tokens=args.max_tokens, eos_ids=eos):
                    toks.extend(st.tokens)
                    last = st
                wall = time.perf_counter() - t0
                if s == "ntp":
                    ref = toks
                if s not in todo:
                    continue
                r = {
                    "qid": q["question_id"],
                    "task": q["task"],
                    "method": s,
                    "describe": m.describe(),
                    "tokens": len(toks),
                    "forwards": last.stats.forward_passes,
                    "tau": last.stats.tau,
                    "decode_time": last.stats.decode_time,
                    "decode_tps": last.stats.decode_tps,
                    "wall": wall,
                    "exact": toks == ref,
                }
                f.write(json.dumps(r) + "\n")
                f.flush()
    summarize(rec_path, specs, out)


def summarize(rec_path: Path, specs: list[str], out: Path) -> None:
    recs = [json.loads(x) for x in rec_path.read_text().splitlines()]
    agg: dict = defaultdict(lambda: defaultdict(lambda: [0, 0, 0.0, 0]))
    for r in recs:
        for key in (r["task"], "overall"):
            a = agg[r["method"]][key]
            a[0] += r["tokens"]
            a[1] += r["forwards"]
            a[2] += r["decode_time"]
            a[3] += int(not r["exact"])
    cols = [*TASKS, "overall"]
    lines = ["| method | " + " | ".join(cols) + " | not exact |", "|---" * (len(cols) + 2) + "|"]
    for s in sorted(agg, key=lambda s: specs.index(s) if s in specs else 99):
        cells = []
        for c in cols:
            a, b = agg[s].get(c), agg["ntp"].get(c)
            if not a or not b or not a[1]:
                cells.append("-")
                continue
            tau = a[0] / a[1]
            speed = (a[0] / a[2]) / (b[0] / b[2])
            cells.append(f"{tau:.2f} / {speed:.2f}x")
        lines.append(f"| {s} | " + " | ".join(cells) + f" | {agg[s]['overall'][3]} |")
    text = "tau / decode speedup vs ntp (token-weighted)\n\n" + "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
