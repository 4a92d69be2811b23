"""One table from several ``mlx-mtp bench`` folders of the same methods (a
bench split by ``--categories`` over several processes): per method, token
equality with ``ntp``, tau, slots per forward pass, decode speed against
``ntp`` per task and overall, prefill + decode against ``ntp``, and against
the fastest ``mlx_lm_draft`` row. Each ratio divides rows measured side by
side in one folder's run; overall figures are total tokens over total time.

    python examples/bench_table.py docs/results/draft-pair-cpu-12x64/*/
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(folders: list[str]) -> None:
    recs = [json.loads(line) for d in folders for line in (Path(d) / "records.jsonl").open()]
    methods = list(dict.fromkeys(r["method"] for r in recs))
    by = {(r["qid"], r["method"]): r for r in recs}
    qids = list(dict.fromkeys(r["qid"] for r in recs))
    task = {r["qid"]: r["task"] for r in recs}
    tasks = list(dict.fromkeys(task[q] for q in qids))

    def tps(m: str, qs: list[str], prefill: bool = False) -> float:
        toks = sum(by[q, m]["generated_tokens"] for q in qs)
        secs = sum(by[q, m]["decode_time"] + prefill * by[q, m]["prefill_time"] for q in qs)
        return toks / secs

    def of(t: str) -> list[str]:
        return [q for q in qids if task[q] == t]

    peers = [m for m in methods if m.startswith("mlx_lm_draft")]
    best = max(peers, key=lambda m: tps(m, qids)) if peers else None
    head = ["method", "exact", "tau", "slots/fwd", *tasks, "overall", "prefill+decode"]
    if best:
        head += [f"vs {best}", "(prefill+decode)"]
    print("| " + " | ".join(head) + " |")
    print("|---|---|" + "---:|" * (len(head) - 2))
    for m in methods:
        exact = sum(by[q, m]["tokens"] == by[q, "ntp"]["tokens"] for q in qids)
        fwd = sum(by[q, m]["forward_passes"] for q in qids)
        gen = sum(by[q, m]["generated_tokens"] for q in qids)
        slots = sum(by[q, m]["slots"] for q in qids)
        row = [m, f"{exact}/{len(qids)}", f"{gen / fwd:.2f}", f"{slots / fwd:.1f}"]
        row += [f"{tps(m, of(t)) / tps('ntp', of(t)):.2f}x" for t in tasks]
        row += [f"{tps(m, qids) / tps('ntp', qids):.2f}x"]
        row += [f"{tps(m, qids, True) / tps('ntp', qids, True):.2f}x"]
        if best:
            row += [f"{tps(m, qids) / tps(best, qids):.2f}x"]
            row += [f"{tps(m, qids, True) / tps(best, qids, True):.2f}x"]
        print("| " + " | ".join(row) + " |")
    print(f"\nntp: {tps('ntp', qids):.3f} tok/s decode")


if __name__ == "__main__":
    main(sys.argv[1:])
