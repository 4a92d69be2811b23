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
    python examples/tau_by_size.py docs/results/tau-by-size/*/ \\
      --plot docs/results/tau-by-size/tau.png

tau is the figure that carries over from this CPU to any device (the cost of
a slot differs, the tokens a pass keeps do not). Several folders of one model
(a run split by task, or methods added in a later run on the same settings)
make one row: each method's tau is its generated tokens over its forward
passes summed over the folders. A method no folder ran is left empty; each
row gives the prompts x tokens of its methods.
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


def load(folder: Path) -> tuple[str, int, dict[str, tuple[int, int, int]]]:
    """(model alias, max tokens, {method label: (prompts, generated tokens,
    forward passes)}) of one bench folder."""
    path = folder / "results.json"
    if not path.is_file():
        raise SystemExit(
            f"{folder}: no results.json; give the folders that `mlx-mtp bench --out` wrote"
        )
    r = json.loads(path.read_text())
    s = r["settings"]
    counts = {}
    for m in r["methods"]:
        o = m["overall"]
        counts[m["label"]] = (int(o["n"]), int(o["generated_tokens"]), int(o["forward_passes"]))
    return Path(str(s["model"])).name, int(s["max_tokens"]), counts


def merge(folders: list[Path]) -> list[tuple[str, dict[str, float], str]]:
    """One (model, tau per method label, prompts x tokens) row per model,
    smallest model first.

    Raises:
        SystemExit: two folders of one model generated different numbers of
            tokens per prompt, so their tau cannot be pooled.
    """
    pooled: dict[str, dict[str, list[int]]] = {}
    lengths: dict[str, int] = {}
    for folder in folders:
        model, max_tokens, counts = load(folder)
        if lengths.setdefault(model, max_tokens) != max_tokens:
            raise SystemExit(
                f"{folder}: {max_tokens} tokens per prompt, but another folder of {model} "
                f"has {lengths[model]}; pool only runs with the same --max-tokens"
            )
        for label, c in counts.items():
            acc = pooled.setdefault(model, {}).setdefault(label, [0, 0, 0])
            for i, v in enumerate(c):
                acc[i] += v
    rows = []
    for model, methods in pooled.items():
        taus = {m: tok / max(passes, 1) for m, (_, tok, passes) in methods.items()}
        ns = sorted({n for m, (n, _, _) in methods.items() if m != "ntp"} or {methods["ntp"][0]})
        n = str(ns[0]) if len(ns) == 1 else f"{ns[0]}-{ns[-1]}"
        rows.append((model, taus, f"{n} x {lengths[model]}"))
    return sorted(rows, key=lambda r: PARAMS.get(r[0], 0.0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--plot", type=Path, help="write the plot (PNG) here")
    ap.add_argument(
        "--methods",
        help="comma-separated method labels to show (default: the smallest model's, ntp left out)",
    )
    args = ap.parse_args()
    runs = merge(args.folders)
    if args.methods:
        methods = args.methods.split(",")
    else:  # the smallest model's methods
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
