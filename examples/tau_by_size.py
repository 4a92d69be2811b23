"""Acceptance length (tau) of the training-free methods against model size:
a markdown table and one plot from ``mlx-mtp bench`` folders, one or more per model.

Each folder is one ``mlx-mtp bench --out`` run, e.g.
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
passes summed over the folders' records (``ntp``, in every run, is left
out). A prompt that two folders both ran for one method is refused (it would
count twice), and so are folders of one model with different settings
(tokens, temperature, dtype, turns). A method no folder ran is left empty; a
cell over fewer prompts than its row's count gives its own count in brackets.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mlx_mtp.bench.config import parse_methods
from mlx_mtp.bench.runner import read_records
from mlx_mtp.errors import InvalidArgumentError

#: parameters of the real models of the test suite (embeddings included)
PARAMS = {
    "smollm2-135m": 135e6,
    "gemma3-270m": 268e6,
    "qwen2.5-coder-0.5b": 494e6,
    "qwen2.5-coder-1.5b": 1.54e9,
}


#: the plain-decoding reference every bench run has (left out of the pooling)
REFERENCE = "ntp"
#: settings that must agree for runs of one model to be pooled
POOLED_SETTINGS = ("max_tokens", "temp", "dtype", "turns", "mode")


def load(folder: Path) -> tuple[str, dict, list[dict]]:
    """(model alias, settings, records) of one ``mlx-mtp bench --out`` folder.

    Raises:
        SystemExit: ``folder`` is not a bench folder.
    """
    results, records = folder / "results.json", folder / "records.jsonl"
    if not (results.is_file() and records.is_file()):
        raise SystemExit(
            f"{folder}: not a bench folder (no results.json and records.jsonl); "
            "give the folders that `mlx-mtp bench --out` wrote"
        )
    settings = json.loads(results.read_text())["settings"]
    return Path(str(settings["model"])).name, settings, read_records(folder)


def merge(folders: list[Path]) -> list[tuple[str, dict[str, float], dict[str, int], int]]:
    """One (model, tau per method label, prompts per method label, max
    tokens) row per model, smallest model first.

    Raises:
        SystemExit: two folders of one model differ in a setting of
            ``POOLED_SETTINGS``, or both hold one prompt for one method.
    """
    pooled: dict[str, dict[str, list[int]]] = {}
    settings: dict[str, tuple[Path, dict]] = {}
    seen: dict[tuple, Path] = {}
    for folder in folders:
        model, s, records = load(folder)
        first, ref = settings.setdefault(model, (folder, s))
        for key in POOLED_SETTINGS:
            if s.get(key) != ref.get(key):
                raise SystemExit(
                    f"{folder}: {key}={s.get(key)!r}, but {first} (also {model}) has "
                    f"{ref.get(key)!r}; pool only runs made with the same settings"
                )
        for r in records:
            if r["method"] == REFERENCE:  # in every run, and its tau is 1
                continue
            key = (model, r["method"], r["qid"], r["turn"], r["repeat"])
            if key in seen:
                raise SystemExit(
                    f"{folder}: {r['method']} on prompt {r['qid']} (turn {r['turn']}) is "
                    f"also in {seen[key]}; give each run's folder once"
                )
            seen[key] = folder
            acc = pooled.setdefault(model, {}).setdefault(r["method"], [0, 0, 0])
            acc[0] += 1
            acc[1] += int(r["generated_tokens"])
            acc[2] += int(r["forward_passes"])
    rows = []
    for model, methods in pooled.items():
        taus = {m: tok / max(passes, 1) for m, (_, tok, passes) in methods.items()}
        prompts = {m: n for m, (n, _, _) in methods.items()}
        rows.append((model, taus, prompts, int(settings[model][1]["max_tokens"])))
    return sorted(rows, key=lambda r: PARAMS.get(r[0], 0.0))


def split_labels(text: str) -> list[str]:
    """Method labels from a comma-separated list, read as ``mlx-mtp bench
    --methods`` reads it (``hybrid:bc=30,recycle=1`` is one label), without
    the ``ntp`` reference, which is not pooled."""
    try:
        specs = parse_methods(text)
    except InvalidArgumentError as e:
        raise SystemExit(str(e)) from None
    return [s.label for s in specs if s.label != REFERENCE]


def table(runs: list, methods: list[str]) -> list[str]:
    """The markdown table's lines: one row per model, one column per method."""
    lines = ["| model | prompts x tokens | " + " | ".join(f"`{m}`" for m in methods) + " |"]
    lines.append("|---|---:|" + "---:|" * len(methods))
    for model, taus, prompts, max_tokens in runs:
        n = max((prompts[m] for m in methods if m in prompts), default=0)
        cells = []
        for m in methods:
            if m not in taus:
                cells.append("")
            else:
                own = f" ({prompts[m]})" if prompts[m] != n else ""
                cells.append(f"{taus[m]:.2f}{own}")
        lines.append(f"| {model} | {n} x {max_tokens} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--plot", type=Path, help="write the plot (PNG) here")
    ap.add_argument(
        "--methods",
        help="method labels to show, comma-separated as for `mlx-mtp bench --methods` "
        "(default: the smallest model's)",
    )
    args = ap.parse_args()
    runs = merge(args.folders)
    if args.methods:
        methods = split_labels(args.methods)
        for m in methods:
            if not any(m in taus for _, taus, _, _ in runs):
                print(f"warning: no folder ran {m!r}", file=sys.stderr)
    else:  # the smallest model's methods
        methods = list(runs[0][1])
    print("\n".join(table(runs, methods)))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 4))
        xs = [PARAMS.get(run[0], float("nan")) for run in runs]
        for m in methods:
            ax.plot(xs, [run[1].get(m, float("nan")) for run in runs], marker="o", label=m)
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(xs, [run[0] for run in runs], rotation=15, fontsize=8)
        ax.set_ylabel("tau (tokens per forward pass)")
        ax.set_title("Acceptance length against model size (greedy, float32)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
