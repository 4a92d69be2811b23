"""Decode tokens/s of the embedded SmolLM2 (float32, ntp) with and without the
OpenBLAS fix (docs/design.md §9), alternating the two settings in fresh processes.

    .venv/bin/python examples/blas_speed.py [--tokens 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys
import mlx_mtp
from mlx_mtp._blas import blas_status
m = mlx_mtp.load("smollm2-135m", "ntp", dtype="float32")
m.generate("Hello", max_tokens=4)  # warm-up
r = m.generate("Write a short story about a lighthouse keeper.", max_tokens=int(sys.argv[1]))
print(json.dumps({"blas": blas_status(), "decode_tps": r.stats.decode_tps,
                  "prefill_tps": r.stats.prefill_tps, "tokens": r.stats.generated_tokens}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    results: dict[str, list[dict]] = {"openblas": [], "reference": []}
    for _ in range(args.rounds):
        for fix in ("1", "0"):
            env = dict(os.environ)
            env.pop("LD_PRELOAD", None)
            if fix == "0":
                env["MLX_MTP_NO_BLAS_FIX"] = "1"
            else:
                env.pop("MLX_MTP_NO_BLAS_FIX", None)
            out = subprocess.run(
                [sys.executable, "-c", CHILD, str(args.tokens)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            r = json.loads(out.stdout.strip().splitlines()[-1])
            results[r["blas"]].append(r)
    for name, rs in results.items():
        if rs:
            d = sum(r["decode_tps"] for r in rs) / len(rs)
            p = sum(r["prefill_tps"] for r in rs) / len(rs)
            print(f"{name:10s} decode {d:6.1f} tok/s   prefill {p:7.1f} tok/s   ({len(rs)} runs)")
    if results["openblas"] and results["reference"]:
        ratio = (sum(r["decode_tps"] for r in results["openblas"]) / len(results["openblas"])) / (
            sum(r["decode_tps"] for r in results["reference"]) / len(results["reference"])
        )
        print(f"decode speed-up from OpenBLAS: {ratio:.2f}x")


if __name__ == "__main__":
    main()
