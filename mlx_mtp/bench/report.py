"""Aggregate per-generation records into ``results.json`` and ``report.md``.

The schema of ``results.json`` is documented in docs/benchmarks.md
(section "results.json"); :data:`SCHEMA` names its version.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from . import metrics
from .config import BenchConfig
from .peer import PEER_DRAFT_NAME, PEER_NAME
from .plots import NO_PLOTS, plots_available, write_plots

SCHEMA = "mlx-mtp-bench/1"
#: the schema of a ``--profiles`` sweep's top-level ``results.json``
SWEEP_SCHEMA = "mlx-mtp-bench-sweep/1"

#: the per-method figures a sweep keeps per profile (from each run's overall Summary)
SWEEP_FIELDS = (
    "speedup",
    "tau",
    "decode_tps",
    "slots_per_forward",
    "plain_step_share",
    "host_ms_per_step",
    "n",
    "generated_tokens",
)
#: slot counts whose relative cost the sweep's report lists per profile
SWEEP_SLOTS = (2, 4, 8, 16, 32, 64)

#: per-generation fields copied into results.json (tokens and text stay in records.jsonl)
PROMPT_FIELDS = (
    "qid",
    "task",
    "category",
    "turn",
    "repeat",
    "method",
    "runner",
    "prompt_tokens",
    "generated_tokens",
    "forward_passes",
    "drafted",
    "accepted",
    "decode_time",
    "forward_time",
    "idle_time",
    "slots",
    "decode_tps",
    "tau",
    "peak_memory_gb",
    "repetition_rate",
    "finish_reason",
    "correct",
    "pred",
    "gold",
)


def build_results(
    config: BenchConfig,
    methods: dict[str, Any],
    records: list[dict[str, Any]],
    groups: list[str],
    environment: dict[str, Any],
) -> dict[str, Any]:
    """The results dict (schema: docs/benchmarks.md).

    Args:
        config: the run's settings.
        methods: label -> Method instance (for name, BC, lossless, describe).
        records: per-generation records from ``records.jsonl``.
        groups: task/category order for tables and plots.
        environment: platform description.
    """
    ref_label = config.methods[0].label
    by_method: dict[str, list[dict]] = {label: [] for label in methods}
    for r in records:
        if r["method"] in by_method:
            by_method[r["method"]].append(r)
    ref = {metrics.record_key(r): r for r in by_method[ref_label]}
    # the mlx_lm row (mlx-lm's own loop), when benchmarked: every speedup also against it
    peer_label = next((s.label for s in config.methods if s.name == PEER_NAME), None)
    peer = {metrics.record_key(r): r for r in by_method[peer_label]} if peer_label else None
    # and against the fastest mlx_lm_draft row (mlx-lm's draft-model speculation)
    drafts = [s.label for s in config.methods if s.name == PEER_DRAFT_NAME and by_method[s.label]]
    best_draft = max(
        drafts, key=lambda lb: metrics.summarize(by_method[lb], ref)["speedup"] or 0, default=None
    )
    peer_draft = {metrics.record_key(r): r for r in by_method[best_draft]} if best_draft else None
    exact_check = config.temp == 0

    prompts_out = []
    method_out = []
    for spec in config.methods:
        label, m = spec.label, methods[spec.label]
        recs = by_method[label]
        mismatches, checked = [], 0
        agreed = compared = 0  # reference tokens reproduced before the first mismatch
        for r in recs:
            row = {k: r[k] for k in PROMPT_FIELDS if k in r}
            a = ref.get(metrics.record_key(r))
            row["speedup"] = None
            if a is not None and a["decode_time"] > 0 and r["decode_time"] > 0:
                sp = metrics.aggregate_speedup(
                    [(a["generated_tokens"], a["decode_time"])],
                    [(r["generated_tokens"], r["decode_time"])],
                )
                row["speedup"] = None if math.isnan(sp) else sp
            row["exact"] = None
            if m.lossless and exact_check and a is not None and label != ref_label:
                checked += 1
                fm = metrics.first_mismatch(a["tokens"], r["tokens"])
                row["exact"] = fm is None
                row["agreement"] = metrics.prefix_agreement(a["tokens"], r["tokens"])
                agreed += len(a["tokens"]) if fm is None else min(fm, len(a["tokens"]))
                compared += len(a["tokens"])
                if fm is not None:
                    row["first_mismatch"] = fm
                    mismatches.append(
                        {
                            "qid": r["qid"],
                            "turn": r["turn"],
                            "repeat": r["repeat"],
                            "task": r["task"],
                            "first_mismatch": fm,
                        }
                    )
            if peer is not None:
                row["speedup_vs_mlx_lm"] = metrics.summarize([r], peer)["speedup"]
            prompts_out.append(row)
        tasks = {
            g: metrics.summarize([r for r in recs if r["task"] == g], ref)
            for g in groups
            if any(r["task"] == g for r in recs)
        }
        overall = metrics.summarize(recs, ref)
        if peer_draft is not None:
            overall["speedup_vs_mlx_lm_draft"] = metrics.summarize(recs, peer_draft)["speedup"]
        if peer is not None:
            overall["speedup_vs_mlx_lm"] = metrics.summarize(recs, peer)["speedup"]
            for g, t in tasks.items():
                t["speedup_vs_mlx_lm"] = metrics.summarize(
                    [r for r in recs if r["task"] == g], peer
                )["speedup"]
        exactness = None
        if m.lossless and exact_check and label != ref_label:
            exactness = {
                "checked": checked,
                "exact": checked - len(mismatches),
                "agreement": agreed / compared if compared else None,
                "mismatches": mismatches,
            }
        method_out.append(
            {
                "label": label,
                "name": spec.name,
                "options": spec.options,
                "describe": m.describe(),
                "lossless": bool(m.lossless),
                "block_complexity": int(m.block_complexity),
                "runner": _runner(recs),
                "overall": overall,
                "tasks": tasks,
                "exactness": exactness,
            }
        )
    return {
        "schema": SCHEMA,
        "settings": config.settings(),
        "environment": environment,
        "reference": ref_label,
        "tasks": [g for g in groups if any(r["task"] == g for r in records)],
        "progress": {"generations": len(records), "planned": len(records)},
        "definitions": {
            "tau": "generated tokens / target forward passes (bonus included), summed over "
            "prompts before dividing",
            "speedup": "aggregate decode tokens/s of the method / aggregate decode tokens/s "
            "of the reference over the same (prompt, turn, repeat) entries",
            "repetition_rate": f"share of {metrics.REPETITION_N}-grams of an output already "
            "seen earlier in the same output, counts pooled over prompts",
            "speedup_vs_mlx_lm": "as speedup, against the mlx_lm row (mlx-lm's own "
            "stream_generate on the same model and prompts); present when it was benchmarked",
            "speedup_vs_mlx_lm_draft": "as speedup, against the fastest mlx_lm_draft row "
            "(mlx-lm's draft-model speculation); present when one was benchmarked",
            "exact": "lossless method's tokens equal the reference's (temp 0 only)",
            "agreement": "share of the reference's tokens a lossless method reproduces "
            "before its first differing token, pooled over prompts (temp 0 only); 1.0 in "
            "float32, below it where bf16/quantized kernels break near-ties differently",
            "accuracy": "GSM8K: last number of the output equals the number after ####",
        },
        "methods": method_out,
        "prompts": prompts_out,
    }


def _runner(records: list[dict[str, Any]]) -> str | None:
    """The runner of a method's generations (:mod:`mlx_mtp.runners`): one
    name, or the names joined by ``+`` where they differed (None: no records,
    or records written without one)."""
    names = sorted({r["runner"] for r in records if r.get("runner")})
    return "+".join(names) if names else None


def _fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:{spec}}{suffix}"


def render_markdown(results: dict[str, Any]) -> str:
    """The Spec-Bench style report: per-task speedup and tau, then details."""
    s, env = results["settings"], results["environment"]
    tasks = results["tasks"]
    lines = [
        f"# mlx-mtp bench: {s['model']} ({s['mode']})",
        "",
        f"- settings: max_tokens {s['max_tokens']}, limit {s['limit'] or 'all'} per category, "
        f"turns {s['turns']}, temp {s['temp']}, seed {s['seed']}, repeats {s['repeats']}, "
        f"dtype {s['dtype'] or 'default'}",
        f"- environment: {env.get('platform')}, mlx {env.get('mlx')}, mlx-lm "
        f"{env.get('mlx_lm')}, device {env.get('device')}, BLAS {env.get('blas')}, "
        f"{env.get('date')}"
        + (
            f"; times on the virtual clock of a simulated device ({env['simulated_device']}: "
            "forward passes at the simulated device's time, host work as measured)"
            if env.get("simulated_device")
            else ""
        )
        + ("; host term off (MLX_MTP_HOST_TERM=0)" if env.get("host_term") is False else ""),
        f"- reference: `{results['reference']}`; speedup = aggregate decode tokens/s "
        "ratio vs the reference over the same prompts (methods interleaved "
        + (
            "step by step: each method's decoding steps timed alone, device synchronised "
            "between them"
            if s.get("interleave")
            else "prompt by prompt"
        )
        + ", same process, after a warm-up); tau = tokens per forward pass (bonus included).",
        "",
    ]
    prog = results.get("progress") or {}
    if prog.get("generations", 0) < prog.get("planned", 0):
        lines[-1:-1] = [
            f"- **partial run**: {prog['generations']} of {prog['planned']} generations "
            "finished (rerun the same command to resume); tables cover the finished ones, "
            "speedups only prompts that ntp also finished."
        ]
    if s["mode"] == "gsm8k":
        lines += [
            "| Method | BC | Accuracy | tau (tokens/forward) | tok/s | Speedup | Rep. rate |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for m in results["methods"]:
            o = m["overall"]
            lines.append(
                f"| {m['label']} | {m['block_complexity']} | {_fmt(o.get('accuracy'), '.1%')} "
                f"| {_fmt(o['tau'])} | {_fmt(o['decode_tps'], '.1f')} "
                f"| {_fmt(o['speedup'], '.2f', 'x')} | {_fmt(o['repetition_rate'], '.3f')} |"
            )
        return "\n".join(lines) + "\n"

    head = " | ".join(tasks)
    peer = any("speedup_vs_mlx_lm" in m["overall"] for m in results["methods"])
    pdraft = any("speedup_vs_mlx_lm_draft" in m["overall"] for m in results["methods"])
    lines += [
        "## Speedup per task (Spec-Bench style)",
        "",
        f"| Method | BC | {head} | Overall |"
        + (" Overall vs mlx_lm |" if peer else "")
        + (" Overall vs mlx_lm_draft |" if pdraft else "")
        + " Mean accepted tokens (tau) |",
        "|---|---:|"
        + "---:|" * len(tasks)
        + "---:|"
        + ("---:|" if peer else "")
        + ("---:|" if pdraft else "")
        + "---:|",
    ]
    for m in results["methods"]:
        cells = [_fmt(m["tasks"].get(t, {}).get("speedup"), ".2f", "x") for t in tasks]
        o = m["overall"]
        vs_peer = f" {_fmt(o.get('speedup_vs_mlx_lm'), '.2f', 'x')} |" if peer else ""
        if pdraft:
            vs_peer += f" {_fmt(o.get('speedup_vs_mlx_lm_draft'), '.2f', 'x')} |"
        lines.append(
            f"| {m['label']} | {m['block_complexity']} | {' | '.join(cells)} "
            f"| {_fmt(o['speedup'], '.2f', 'x')} |{vs_peer} {_fmt(o['tau'])} |"
        )
    if peer:
        lines += [
            "",
            "Per-task speedups are vs `ntp`; `Overall vs mlx_lm` is vs mlx-lm's own "
            "`stream_generate` loop (the `mlx_lm` row) on the same model and prompts.",
        ]
    if pdraft:
        lines += [
            "",
            "`Overall vs mlx_lm_draft` is vs the fastest `mlx_lm_draft` row: mlx-lm's own "
            "draft-model speculation (`stream_generate(..., draft_model=...)`).",
        ]
    lines += [
        "",
        "## Mean accepted tokens per forward (tau) per task",
        "",
        f"| Method | {head} | Overall |",
        "|---|" + "---:|" * len(tasks) + "---:|",
    ]
    for m in results["methods"]:
        cells = [_fmt(m["tasks"].get(t, {}).get("tau")) for t in tasks]
        lines.append(f"| {m['label']} | {' | '.join(cells)} | {_fmt(m['overall']['tau'])} |")
    lines += [
        "",
        "## Details (overall)",
        "",
        "| Method | settings | prompts | tokens | forwards/token | slots/forward | plain steps "
        "| decode tok/s | peak mem GB | host ms/step | idle ms/step | rep. rate (4-gram) "
        "| drafted / accepted | exact vs ntp |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for m in results["methods"]:
        o, ex = m["overall"], m["exactness"]
        if ex is None:
            exact = "reference" if m["label"] == results["reference"] else "n/a"
        else:
            exact = f"{ex['exact']}/{ex['checked']}"
            if ex.get("agreement") is not None:
                exact += f", agreement {ex['agreement']:.1%}"
            if ex["mismatches"]:
                first = ex["mismatches"][0]
                exact += (
                    f" (first: {first['qid']} turn {first['turn']} @ {first['first_mismatch']})"
                )
        lines.append(
            f"| {m['label']} | {m['describe']} | {o['n']} | {o['generated_tokens']} "
            f"| {_fmt(o['forwards_per_token'], '.3f')} | {_fmt(o['slots_per_forward'], '.1f')} "
            f"| {_fmt(o.get('plain_step_share'), '.0%')} | {_fmt(o['decode_tps'], '.1f')} "
            f"| {_fmt(o['peak_memory_gb'])} | {_fmt(o['host_ms_per_step'], '.2f')} "
            f"| {_fmt(o.get('idle_ms_per_step'), '.2f')} "
            f"| {_fmt(o['repetition_rate'], '.3f')} "
            f"| {o['drafted']} / {o['accepted']} | {exact} |"
        )
    mism = [
        (m["label"], x)
        for m in results["methods"]
        if m["exactness"]
        for x in m["exactness"]["mismatches"]
    ]
    if mism:
        lines += ["", "## Exactness mismatches (lossless methods vs ntp, temp 0)", ""]
        # no --dtype: the platform default (float32 on Linux, as stored elsewhere)
        linux = "linux" in str(env.get("platform", "")).lower()
        dtype = s.get("dtype") or ("float32" if linux else "auto (as stored)")
        if dtype != "float32":
            lines += [
                f"Computed in {dtype}: greedy exactness is a float32 property. In bf16 "
                "and with quantized weights, a batched verification pass and one-token "
                "decoding run different kernels and round differently, so near-ties can "
                "flip (mlx-lm issues #1423, #1470); `agreement` is the share of ntp's tokens "
                "reproduced before the first difference.",
                "",
            ]
        for label, x in mism:
            lines.append(
                f"- `{label}`: question {x['qid']} ({x['task']}) turn {x['turn']} repeat "
                f"{x['repeat']}: first differing token at index {x['first_mismatch']}"
            )
    return "\n".join(lines) + "\n"


def write_outputs(results: dict[str, Any], out: Path, plots: bool = True) -> None:
    """Write ``results.json``, ``report.md`` and (optionally) the PNG plots;
    without matplotlib (the ``bench`` extra) the plots are left out and the
    ``mlx_mtp`` logger says so (:data:`~mlx_mtp.bench.plots.NO_PLOTS`)."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    tmp.replace(out / "results.json")
    (out / "report.md").write_text(render_markdown(results), encoding="utf-8")
    if plots and not plots_available():
        logging.getLogger("mlx_mtp").warning(NO_PLOTS)
    elif plots:
        write_plots(results, out)


def build_sweep(
    config: BenchConfig, ms_per_token: float, runs: list[tuple[str, str, dict[str, Any]]]
) -> dict[str, Any]:
    """The results dict of a ``--profiles`` sweep (schema: docs/benchmarks.md).

    Args:
        config: the run's settings (without a device).
        ms_per_token: the simulated one-token pass, in milliseconds.
        runs: ``(profile name, its cost curve as slots:cost text, the
            results dict of its run)`` per profile, in table order.
    """
    from ..budget import parse_curve

    settings = config.settings()
    settings.pop("device", None)
    settings.update(profiles=[name for name, _, _ in runs], ms_per_token=ms_per_token)
    methods: dict[str, dict[str, Any]] = {}
    for name, _, res in runs:
        for m in res["methods"]:
            row = methods.setdefault(
                m["label"], {"label": m["label"], "name": m["name"], "by_profile": {}}
            )
            row["by_profile"][name] = {k: m["overall"].get(k) for k in SWEEP_FIELDS}
    generations = sum(res["progress"]["generations"] for _, _, res in runs)
    planned = sum(res["progress"]["planned"] for _, _, res in runs)
    return {
        "schema": SWEEP_SCHEMA,
        "settings": settings,
        "environment": {
            k: v for k, v in runs[0][2]["environment"].items() if k != "simulated_device"
        },
        "reference": runs[0][2]["reference"],
        "profiles": [
            {
                "name": name,
                "device": res["environment"].get("simulated_device"),
                "curve": curve,
                "costs": {str(n): round(parse_curve(curve)(n), 3) for n in SWEEP_SLOTS},
                "out": name,
            }
            for name, curve, res in runs
        ],
        "progress": {"generations": generations, "planned": planned},
        "definitions": {
            "speedup": runs[0][2]["definitions"]["speedup"] + ", on that profile's device",
            "tau": runs[0][2]["definitions"]["tau"],
            "costs": "the profile's relative cost of a forward pass of that many slots "
            "(1.0 = one slot)",
        },
        "methods": list(methods.values()),
    }


def render_sweep_markdown(sweep: dict[str, Any]) -> str:
    """The sweep's report: speedup and tau of every method per profile."""
    s, env = sweep["settings"], sweep["environment"]
    names = [p["name"] for p in sweep["profiles"]]
    head = " | ".join(names)
    rule = "|---|" + "---:|" * len(names)
    lines = [
        f"# mlx-mtp bench: {s['model']} ({s['mode']}) on {len(names)} simulated devices",
        "",
        f"- settings: max_tokens {s['max_tokens']}, limit {s['limit']} per category, "
        f"turns {s['turns']}, temp {s['temp']}, seed {s['seed']}, repeats {s['repeats']}, "
        f"dtype {s['dtype'] or 'default'}, methods interleaved "
        + ("step by step" if s.get("interleave") else "prompt by prompt"),
        f"- environment: {env.get('platform')}, mlx {env.get('mlx')}, device "
        f"{env.get('device')}, BLAS {env.get('blas')}, {env.get('date')}",
        f"- each profile is a whole run on its own simulated device (a one-token pass "
        f"{s['ms_per_token']:g} ms, a pass of n slots that times the profile's c(n); host "
        "work as measured), in the subfolder of its name (report.md, results.json, "
        "records); profiles in docs/profiles.md.",
        f"- reference: `{sweep['reference']}`; speedup = aggregate decode tokens/s ratio vs "
        "the reference on the same device and prompts; tau = tokens per forward pass.",
    ]
    prog = sweep["progress"]
    if prog["generations"] < prog["planned"]:
        lines.append(
            f"- **partial run**: {prog['generations']} of {prog['planned']} generations "
            "finished (rerun the same command to resume)."
        )
    lines += ["", "## Speedup vs the reference per profile", "", f"| Method | {head} |", rule]
    for m in sweep["methods"]:
        cells = [_fmt(m["by_profile"].get(n, {}).get("speedup"), ".2f", "x") for n in names]
        lines.append(f"| {m['label']} | {' | '.join(cells)} |")
    lines += ["", "## tau (tokens per forward) per profile", "", f"| Method | {head} |", rule]
    for m in sweep["methods"]:
        cells = [_fmt(m["by_profile"].get(n, {}).get("tau")) for n in names]
        lines.append(f"| {m['label']} | {' | '.join(cells)} |")
    lines += ["", "## Slots per forward per profile", "", f"| Method | {head} |", rule]
    for m in sweep["methods"]:
        cells = [_fmt(m["by_profile"].get(n, {}).get("slots_per_forward"), ".1f") for n in names]
        lines.append(f"| {m['label']} | {' | '.join(cells)} |")
    slots = list(sweep["profiles"][0]["costs"]) if sweep["profiles"] else []
    lines += [
        "",
        "## The profiles: relative cost c(n) of a pass of n slots",
        "",
        "| Profile | " + " | ".join(f"c({n})" for n in slots) + " | report |",
        "|---|" + "---:|" * len(slots) + "---|",
    ]
    for p in sweep["profiles"]:
        cells = [_fmt(p["costs"][n]) for n in slots]
        lines.append(
            f"| {p['name']} | {' | '.join(cells)} | [{p['out']}/report.md]({p['out']}/report.md) |"
        )
    return "\n".join(lines) + "\n"


def write_sweep(sweep: dict[str, Any], out: Path) -> None:
    """Write a sweep's ``results.json`` and ``report.md`` into ``out`` (the
    profiles' own outputs are in its subfolders)."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(sweep, indent=2) + "\n", encoding="utf-8")
    tmp.replace(out / "results.json")
    (out / "report.md").write_text(render_sweep_markdown(sweep), encoding="utf-8")
