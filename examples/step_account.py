"""Where the time of a decoding step goes, per method, from a bench folder.

Reads ``records.jsonl`` of an ``mlx-mtp bench --out DIR`` run and prints,
per method over all its generations, milliseconds per step split into the
device's forward passes (``forward_time``), the time the device sat idle
waiting for the host (``idle_time``: the host work on the critical path,
counted on a simulated device only) and the rest (decode time the two do not
cover: 0 on a simulated device, where the clock is the device's), beside tau
and the speedup over ``ntp`` on the same prompts:

    python examples/step_account.py docs/results/simulated-smollm2-12ms/pipeline-1

A method decodes faster than ``ntp`` when tau tokens per step outweigh its
step's time over a plain step's: ``speedup = tau * ntp_ms / ms``.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="an mlx-mtp bench --out folder")
    args = ap.parse_args()
    path = args.folder / "records.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path}: no such file; give the folder of an mlx-mtp bench --out run")
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by: dict[str, list[dict]] = defaultdict(list)
    for r in recs:
        by[r["method"]].append(r)
    if "ntp" not in by:
        raise SystemExit(f"{path}: no ntp rows to compare with; run the bench with ntp")
    base = {(r["qid"], r["turn"], r.get("repeat", 0)): r for r in by["ntp"]}
    print(
        f"{'method':22s} {'tau':>5s} {'slots/step':>10s} {'ms/step':>8s} {'device':>7s} "
        f"{'idle':>6s} {'rest':>6s} {'ms/token':>8s} {'speedup':>7s}"
    )
    for method, rs in by.items():
        rs = [r for r in rs if (r["qid"], r["turn"], r.get("repeat", 0)) in base]
        steps = sum(r["steps"] for r in rs)
        toks = sum(r["generated_tokens"] for r in rs)
        t = sum(r["decode_time"] for r in rs)
        dev = sum(r["forward_time"] for r in rs)
        idle = sum(r.get("idle_time") or 0.0 for r in rs)
        nt = [base[(r["qid"], r["turn"], r.get("repeat", 0))] for r in rs]
        speed = (toks / t) / (
            sum(n["generated_tokens"] for n in nt) / sum(n["decode_time"] for n in nt)
        )
        ms = 1e3 / steps
        print(
            f"{method:22s} {toks / sum(r['forward_passes'] for r in rs):5.2f} "
            f"{sum(r['slots'] for r in rs) / steps:10.1f} {t * ms:8.2f} {dev * ms:7.2f} "
            f"{idle * ms:6.2f} {(t - dev - idle) * ms:6.2f} {1e3 * t / toks:8.2f} {speed:6.2f}x"
        )


if __name__ == "__main__":
    main()
