"""PNG plots of a benchmark's results (matplotlib, no display needed; the
optional ``bench`` extra: ``pip install 'mlx-mtp[bench]'``).

- ``speedup_per_task.png``: grouped bars, one group per task plus "overall",
  one bar per method (the reference ``ntp`` is the dashed line at 1.0).
- ``tau_vs_bc.png``: tau (left) and speedup (right) against the draft-tree
  size actually sent, slots per forward pass (measured; the BC where records
  lack it), one marker per setting labelled with its BC, settings that differ
  only in BC joined by a line (e.g. probe at BC 10, 30 and auto).
- GSM8K mode: ``accuracy_vs_tau.png``: accuracy against tokens per forward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PLOT_FILES = ("speedup_per_task.png", "tau_vs_bc.png", "accuracy_vs_tau.png")
#: what the bench says when it cannot draw the plots
NO_PLOTS = (
    "plots not written: matplotlib is not installed; "
    "pip install 'mlx-mtp[bench]' for them (or pass --no-plots)"
)


def plots_available() -> bool:
    """Whether matplotlib (the ``bench`` extra) can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


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
    colors = _colors(len(methods))
    fig, ax = plt.subplots(figsize=(max(9, 1.5 * len(groups) + 3), 4.5))
    width = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        vals = [
            (m["overall"] if g == "overall" else m["tasks"].get(g, {})).get("speedup") or 0.0
            for g in groups
        ]
        xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(groups))]
        ax.bar(xs, vals, width=width, label=m["label"], color=colors[i])
    ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=20, ha="right")
    ax.set_ylabel(f"speedup vs {results['reference']} (decode tok/s ratio)")
    ax.set_title(f"Spec-Bench speedup per task ({results['settings']['model']})")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", alpha=0.3)
    paths.append(_save(fig, out / "speedup_per_task.png"))
    plt.close(fig)

    series: dict[str, list[tuple[float, float, float, str]]] = {}
    for m in methods:
        o = m["overall"]
        x = o.get("slots_per_forward") or m["block_complexity"]
        rest = ",".join(f"{k}={v}" for k, v in m.get("options", {}).items() if k != "bc")
        key = m["name"] + (f" ({rest})" if rest else "")
        bc = str(m.get("options", {}).get("bc", m["block_complexity"]))
        series.setdefault(key, []).append((x, o["tau"], o.get("speedup") or 0.0, bc))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = _colors(len(series))
    for (key, pts), color in zip(series.items(), colors):
        pts.sort()
        for ax, col in ((axes[0], 1), (axes[1], 2)):
            ax.plot([p[0] for p in pts], [p[col] for p in pts], marker="o", color=color, label=key)
            for p in pts:
                ax.annotate(p[3], (p[0], p[col]), fontsize=7, xytext=(3, 3), color=color,
                            textcoords="offset points")  # fmt: skip
    for ax, ylabel in ((axes[0], "tau (tokens per forward)"), (axes[1], "speedup vs ntp")):
        ax.set_xscale("log")
        ax.set_xlabel("slots per forward pass (mean draft-tree size sent; labels: BC)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[1].axhline(1.0, color="black", linestyle="--", linewidth=0.8)
    axes[0].set_title(f"tau vs tree size ({results['settings']['model']})")
    axes[1].set_title("wall-clock speedup vs tree size (this device)")
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    paths.append(_save(fig, out / "tau_vs_bc.png"))
    plt.close(fig)
    return paths


def _colors(n: int) -> list[Any]:
    """``n`` distinguishable colors (tab10, then tab20, then a continuous map)."""
    import matplotlib

    name = "tab10" if n <= 10 else "tab20" if n <= 20 else "turbo"
    cmap = matplotlib.colormaps[name]
    return [cmap(i) if n <= 20 else cmap(i / max(n - 1, 1)) for i in range(n)]


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path
