"""Closing figures for ``--method confadapt`` on the embedded SmolLM2 (issue 6).

For GSM8K test questions and the 48 Spec-Bench prompts
(``mlx_mtp.data.spec_bench_sample(8)``), per prompt and interleaved in one
process: plain greedy ``ntp`` of the un-adapted model (the reference output
and the speed baseline), then ConfAdapt with the shipped adapter at each tau.

Reported per prompt set and tau:
- Eff. k: generated tokens / forward passes (the paper's "acceleration").
- speedup: aggregate decode tokens/s over ntp's (same prompts, same process).
- token match: share of the reference's token positions reproduced exactly.
- ROUGE-L: LCS-based F1 between the output and the reference tokens.
- repetition: share of 4-grams that already occurred earlier in the output.
- GSM8K accuracy: the last number in the output equals the one after ``####``.

Usage (about an hour on two shared CPU cores at the defaults)::

    python examples/confadapt_eval.py --gsm8k 100 --spec 8 --max-tokens 192 \
        --taus 0.9,0.6 --out confadapt_eval.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

from tqdm import tqdm

import mlx_mtp  # noqa: F401  (first: preloads OpenBLAS before mlx on Linux, docs/design.md §9)

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def lcs_length(a: list[int], b: list[int]) -> int:
    """Length of the longest common subsequence (O(len(a) * len(b)) DP)."""
    if not a or not b:
        return 0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b, 1):
            cur.append(prev[j - 1] + 1 if x == y else max(prev[j], cur[j - 1]))
        prev = cur
    return prev[-1]


def rouge_l(candidate: list[int], reference: list[int]) -> float:
    """ROUGE-L F1 (Lin 2004): LCS-based precision and recall, harmonic mean."""
    lcs = lcs_length(candidate, reference)
    if lcs == 0:
        return 0.0
    p, r = lcs / len(candidate), lcs / len(reference)
    return 2 * p * r / (p + r)


def token_match(candidate: list[int], reference: list[int]) -> float:
    """Share of the reference's positions where the candidate has the same token."""
    if not reference:
        return 1.0 if not candidate else 0.0
    return sum(a == b for a, b in zip(candidate, reference)) / len(reference)


def repetition(tokens: list[int], n: int = 4) -> tuple[int, int]:
    """(repeated, total) n-grams: an n-gram is repeated if it occurred earlier."""
    seen, rep = set(), 0
    total = max(len(tokens) - n + 1, 0)
    for i in range(total):
        g = tuple(tokens[i : i + n])
        rep += g in seen
        seen.add(g)
    return rep, total


def last_number(text: str) -> str | None:
    nums = _NUMBER.findall(text.replace("$", ""))
    return nums[-1].replace(",", "").rstrip(".") if nums else None


def same_number(a: str | None, b: str) -> bool:
    try:
        return a is not None and abs(float(a) - float(b.replace(",", ""))) < 1e-6
    except ValueError:
        return False


def prompt_sets(n_gsm8k: int, per_task: int) -> dict[str, list[dict]]:
    from mlx_mtp.commands.confadapt import resolve_data
    from mlx_mtp.data import spec_bench_sample

    test = resolve_data("gsm8k-train").with_name("test.jsonl")
    gsm = [json.loads(x) for x in test.read_text().splitlines()[:n_gsm8k]]
    sets = {
        "gsm8k": [
            {"text": q["question"], "answer": q["answer"].split("####")[-1].strip()} for q in gsm
        ]
    }
    if per_task:
        sets["spec_bench"] = [{"text": q["turns"][0]} for q in spec_bench_sample(per_task)]
    return sets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--gsm8k", type=int, default=100, help="GSM8K test questions (first N)")
    ap.add_argument("--spec", type=int, default=8, help="Spec-Bench prompts per task (6 tasks)")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--taus", default="0.9,0.6")
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--adapter", default=None, help="adapter folder (default: found)")
    ap.add_argument("--out", type=Path, default=Path("confadapt_eval.json"))
    ap.add_argument("--sets", default="gsm8k,spec_bench", help="which prompt sets, in order")
    args = ap.parse_args()

    from mlx_mtp.api import MTPModel
    from mlx_mtp.loading import load_model
    from mlx_mtp.methods import make_method

    taus = [float(t) for t in args.taus.split(",")]
    base = load_model(args.model)
    runners = {"ntp": MTPModel(base, make_method("ntp"))}
    for tau in taus:
        opts = {"k": args.k, "tau": tau}
        if args.adapter:
            opts["adapter"] = args.adapter
        runners[f"tau={tau:g}"] = MTPModel(base, make_method("confadapt", **opts))
    report: dict = {"model": args.model, "max_tokens": args.max_tokens, "k": args.k, "sets": {}}
    sets = prompt_sets(args.gsm8k, args.spec)
    unknown = [n for n in args.sets.split(",") if n not in ("gsm8k", "spec_bench")]
    if unknown:
        ap.error(f"--sets: unknown set(s) {unknown}; choose from gsm8k, spec_bench")
    for name in args.sets.split(","):
        prompts = sets.get(name)
        if not prompts:
            continue
        rows = {key: [] for key in runners}
        for p in tqdm(prompts, desc=name):
            ref = None
            for key, m in runners.items():  # interleaved per prompt
                t0 = time.perf_counter()
                r = m.generate(p["text"], max_tokens=args.max_tokens)
                wall = time.perf_counter() - t0
                if key == "ntp":
                    ref = r.tokens
                rep = repetition(r.tokens)
                row = {
                    "tokens": r.stats.generated_tokens,
                    "forwards": r.stats.forward_passes,
                    "decode_s": r.stats.decode_time,
                    "wall_s": wall,
                    "match": token_match(r.tokens, ref),
                    "rouge_l": rouge_l(r.tokens, ref),
                    "rep": rep,
                }
                if "answer" in p:
                    row["correct"] = same_number(last_number(r.text), p["answer"])
                rows[key].append(row)
            # written after every prompt, so an interrupted run keeps what it measured
            report["sets"][name] = {"summary": summarize(rows), "rows": rows}
            tmp = args.out.with_name(args.out.name + ".tmp")
            tmp.write_text(json.dumps(report, indent=1))
            os.replace(tmp, args.out)
        print(f"\n== {name} ({len(prompts)} prompts, max {args.max_tokens} tokens)")
        for key, s in report["sets"][name]["summary"].items():
            acc = f" acc {s['accuracy']:.1%}" if "accuracy" in s else ""
            print(
                f"{key:8s} Eff.k {s['eff_k']:.2f} speedup {s['speedup']:.2f}x "
                f"({s['decode_tps']:.1f} tok/s) match {s['token_match']:.3f} "
                f"ROUGE-L {s['rouge_l']:.3f} rep {s['repetition']:.3f}{acc}"
            )


def summarize(rows: dict[str, list[dict]]) -> dict[str, dict]:
    """Per decoding: Eff. k, tokens/s, speedup over ntp, match, ROUGE-L,
    repetition and (GSM8K) accuracy over the prompts measured so far."""
    summary = {}
    ntp_tps = sum(x["tokens"] for x in rows["ntp"]) / sum(x["decode_s"] for x in rows["ntp"])
    for key, rs in rows.items():
        toks = sum(x["tokens"] for x in rs)
        tps = toks / sum(x["decode_s"] for x in rs)
        rep, tot = (sum(x["rep"][i] for x in rs) for i in (0, 1))
        summary[key] = {
            "prompts": len(rs),
            "eff_k": toks / sum(x["forwards"] for x in rs),
            "decode_tps": tps,
            "speedup": tps / ntp_tps,
            "token_match": sum(x["match"] for x in rs) / len(rs),
            "rouge_l": sum(x["rouge_l"] for x in rs) / len(rs),
            "repetition": rep / tot if tot else 0.0,
            "mean_tokens": toks / len(rs),
        }
        if "correct" in rs[0]:
            summary[key]["accuracy"] = sum(x["correct"] for x in rs) / len(rs)
    return summary


if __name__ == "__main__":
    main()
