"""PNG plots of a benchmark's results (matplotlib, no display needed).

- ``speedup_per_task.png``: grouped bars, one group per task plus "overall",
  one bar per method (the reference ``ntp`` is the dashed line at 1.0).
- ``tau_vs_bc.png``: tau against block complexity BC (tokens per forward),
  one marker per method setting, settings of the same method joined by a line
  (e.g. probe at BC 10 and 30).
- GSM8K mode: ``accuracy_vs_tau.png``: accuracy against tokens per forward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PLOT_FILES = ("speedup_per_task.png", "tau_vs_bc.png", "accuracy_vs_tau.png")


def write_plots(results: dict[str, Any], out: Path) -> list[Path]:
    """Write the plots that apply to ``results`` into ``out``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    methods = results["methods"]
    if results["settings"]["mode"] == "gsm8k":
        fig, ax = plt.subplots(figsize=(6, 4))
        for m in methods:
            o = m["overall"]
            ax.scatter(o["tau"], o.get("accuracy") or 0.0, s=50)
            ax.annotate(
                m["label"],
                (o["tau"], o.get("accuracy") or 0.0),
                fontsize=8,
                xytext=(4, 4),
                textcoords="offset points",
            )
        ax.set_xlabel("tokens per forward (tau)")
        ax.set_ylabel("GSM8K accuracy")
        ax.set_title(f"GSM8K: accuracy vs tokens per forward ({results['settings']['model']})")
        ax.grid(alpha=0.3)
        paths.append(_save(fig, out / "accuracy_vs_tau.png"))
        plt.close(fig)
        return paths

    groups = [*results["tasks"], "overall"]
    fig, ax = plt.subplots(figsize=(max(7, 1.3 * len(groups)), 4.2))
    width = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        vals = [
            (m["overall"] if g == "overall" else m["tasks"].get(g, {})).get("speedup") or 0.0
            for g in groups
        ]
        xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(groups))]
        ax.bar(xs, vals, width=width, label=m["label"])
    ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=20, ha="right")
    ax.set_ylabel(f"speedup vs {results['reference']} (decode tok/s ratio)")
    ax.set_title(f"Spec-Bench speedup per task ({results['settings']['model']})")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    paths.append(_save(fig, out / "speedup_per_task.png"))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    by_name: dict[str, list[tuple[int, float, str]]] = {}
    for m in methods:
        by_name.setdefault(m["name"], []).append(
            (m["block_complexity"], m["overall"]["tau"], m["label"])
        )
    for name, pts in by_name.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log")
    bcs = sorted({m["block_complexity"] for m in methods})
    ax.set_xticks(bcs)
    ax.set_xticklabels([str(b) for b in bcs])
    ax.minorticks_off()
    ax.set_xlabel("block complexity BC (tokens per forward pass, log scale)")
    ax.set_ylabel("tau (accepted tokens per forward)")
    ax.set_title(f"tau vs BC ({results['settings']['model']})")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out / "tau_vs_bc.png"))
    plt.close(fig)
    return paths


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path
