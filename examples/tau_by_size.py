"""Acceptance length (tau) of the training-free methods against model size:
a markdown table and one plot from ``mlx-mtp bench`` folders, one per model.

Each folder is a bench run with the same methods on the same prompts, e.g.
(float32, greedy; ``MLX_MTP_COST_CURVE`` pins the budget so the run does not
depend on this machine's speed, though the fixed settings below never read it):

    M='ntp,pld:max_draft=10,probe:bc=30,recycle:bc=30,hybrid:bc=30,hybrid:bc=30,recycle=1'
    for m in smollm2-135m gemma3-270m qwen2.5-coder-0.5b; do
      OPENBLAS_NUM_THREADS=1 mlx-mtp bench --model $m --limit 2 --max-tokens 64 \\
        --out docs/results/tau-by-size/$m --methods "$M"
    done
    python examples/tau_by_size.py docs/results/tau-by-size/* \\
      --plot docs/results/tau-by-size/tau.png

tau is the figure that carries over from this CPU to any device (the cost of
a slot differs, the tokens a pass keeps do not). A method a folder did not
run is left empty; each row gives the prompts x tokens of its run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

#: parameters of the real models of the test suite (embeddings included)
PARAMS = {
    "smollm2-135m": 135e6,
    "gemma3-270m": 268e6,
    "qwen2.5-coder-0.5b": 494e6,
    "qwen2.5-coder-1.5b": 1.54e9,
}


def load(folder: Path) -> tuple[str, dict[str, float], str]:
    """(model alias, tau per method label, the run's prompts x tokens)."""
    r = json.loads((folder / "results.json").read_text())
    s = r["settings"]
    model = Path(str(s["model"])).name
    taus = {m["label"]: m["overall"]["tau"] for m in r["methods"]}
    n = r["methods"][0]["overall"].get("n", "?")
    return model, taus, f"{n} x {s['max_tokens']}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--plot", type=Path, help="write the plot (PNG) here")
    args = ap.parse_args()
    runs = sorted((load(f) for f in args.folders), key=lambda r: PARAMS.get(r[0], 0.0))
    methods = [m for m in runs[0][1] if m != "ntp"]
    print("| model | prompts x tokens | " + " | ".join(f"`{m}`" for m in methods) + " |")
    print("|---|---:|" + "---:|" * len(methods))
    for model, taus, size in runs:
        cells = " | ".join(f"{taus[m]:.2f}" if m in taus else "" for m in methods)
        print(f"| {model} | {size} | {cells} |")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 4))
        xs = [PARAMS.get(model, float("nan")) for model, _, _ in runs]
        for m in methods:
            ax.plot(xs, [t.get(m, float("nan")) for _, t, _ in runs], marker="o", label=m)
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(xs, [model for model, _, _ in runs], rotation=15, fontsize=8)
        ax.set_ylabel("tau (tokens per forward pass)")
        ax.set_title("Acceptance length against model size (greedy, float32)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
