"""``mlx-mtp bench``: compare methods on Spec-Bench or GSM8K (see :mod:`mlx_mtp.bench`)."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from .. import distributed
from ..cli_options import RUNNER
from ..errors import InvalidArgumentError
from ..validation import typer_range


def register(app: typer.Typer) -> None:
    """Add the ``bench`` command to the CLI."""

    @app.command()
    def bench(
        model: str = typer.Option("smollm2-135m", "--model", "-m", help="Model spec."),
        methods: str = typer.Option(
            "ntp,pld,lookahead,probe",
            "--methods",
            help="Comma-separated methods with optional settings, e.g. "
            "'ntp,pld,lookahead,probe:bc=10,probe:bc=30,masks=2' (ntp is always added).",
        ),
        mode: str = typer.Option("specbench", "--mode", help="specbench or gsm8k."),
        questions: str | None = typer.Option(
            None, "--questions", help="Spec-Bench style jsonl (default: the packaged copy)."
        ),
        gsm8k: str | None = typer.Option(
            None,
            "--gsm8k",
            help="GSM8K jsonl (default: gsm8k/test.jsonl under $MLX_MTP_DATA; not shipped).",
        ),
        categories: str | None = typer.Option(
            None, "--categories", help="Comma-separated tasks or categories (default: all six)."
        ),
        limit: str | None = typer.Option(
            None,
            "--limit",
            help=f"Prompts per category, or 'all'. Default: a sample sized for a laptop, the "
            f"first {SAMPLE_PER_CATEGORY} per category ({SAMPLE_GSM8K} questions with "
            "--mode gsm8k); 'all' runs all of them (Spec-Bench: 480 prompts per method).",
        ),
        max_tokens: int = typer.Option(
            256, "--max-tokens", "-n", **typer_range("max_tokens"), help="New tokens per answer."
        ),
        turns: int = typer.Option(
            1, "--turns", min=1, max=2, help="1, or 2 for MT-bench second turns."
        ),
        temp: float = typer.Option(
            0.0, "--temp", **typer_range("temp"), help="Sampling temperature (0 = greedy)."
        ),
        seed: int = typer.Option(0, "--seed", **typer_range("seed"), help="Base random seed."),
        repeats: int = typer.Option(1, "--repeats", min=1, help="Runs per prompt and method."),
        dtype: str | None = typer.Option(None, "--dtype", help="float32, bfloat16, float16, auto."),
        interleave: bool = typer.Option(
            False,
            "--interleave",
            help="Run all methods of a prompt at once, one decoding step of each in turn: "
            "speed ratios that a drifting machine speed does not blur (peak memory is then "
            "that of all methods together).",
        ),
        draft_model: str | None = typer.Option(
            None,
            "--draft-model",
            help="Draft model of the draft and mlx_lm_draft rows (alias, folder, GGUF, repo id).",
        ),
        profiles: str | None = typer.Option(
            None,
            "--profiles",
            help="Comma-separated simulated device profiles (bf16-flat, m4pro-4bit, "
            "m4pro-8bit, m3ultra-4bit; docs/profiles.md): one run per profile, the model "
            "loaded once, each in --out/NAME, and a report of every method's speedup per "
            "profile in --out.",
        ),
        ms_per_token: float | None = typer.Option(
            None,
            "--ms-per-token",
            help="With --profiles: the simulated one-token forward pass in ms (default 12).",
        ),
        out: str = typer.Option("bench-out", "--out", "-o", help="Output folder."),
        overwrite: bool = typer.Option(
            False,
            "--overwrite",
            help="Discard an earlier run with other settings in --out, or write into an "
            "--out folder that holds other files.",
        ),
        no_plots: bool = typer.Option(False, "--no-plots", help="Skip the PNG plots."),
        report_only: bool = typer.Option(
            False,
            "--report-only",
            help="Generate nothing: rebuild results.json, report.md and plots from the "
            "records already in --out (same settings).",
        ),
        pipeline_parallel: bool = typer.Option(
            False,
            "--pipeline-parallel",
            help="Under mlx.launch: shard by layers instead of by heads.",
        ),
        pipeline: bool = typer.Option(False, "--pipeline", hidden=True),
        runner: str = RUNNER,
    ):
        """Run methods side by side (interleaved, one process) and write results.json,
        report.md and plots into --out. An interrupted run resumes where it stopped."""
        from ..bench.config import BenchConfig, parse_methods
        from ..bench.plots import NO_PLOTS, plots_available
        from ..bench.runner import run_bench, run_sweep
        from ..errors import InvalidArgumentError

        if profiles is None and ms_per_token is not None:
            raise InvalidArgumentError("--ms-per-token sets the device of --profiles; add it.")
        if profiles is not None and os.environ.get("MLX_MTP_SIMULATE_DEVICE"):
            raise InvalidArgumentError(
                "--profiles runs on its own simulated devices: unset MLX_MTP_SIMULATE_DEVICE, "
                "or drop --profiles."
            )

        per_category, sampled = resolve_limit(limit, mode)
        cfg = BenchConfig(
            model=model,
            methods=parse_methods(methods),
            mode=mode,
            questions=str(Path(questions).resolve()) if questions else None,
            gsm8k=str(Path(gsm8k).resolve()) if gsm8k else None,
            categories=[c.strip() for c in categories.split(",") if c.strip()]
            if categories
            else None,
            limit=per_category,
            max_tokens=max_tokens,
            turns=turns,
            temp=temp,
            seed=seed,
            repeats=repeats,
            dtype=dtype,
            interleave=interleave,
            draft_model=draft_model,
            runner=runner,
            out=out,
        )
        if sampled and not report_only and distributed.is_main():
            typer.echo(
                f"bench: a sample, the first {per_category} "
                + ("GSM8K questions" if mode == "gsm8k" else "prompts per category")
                + f" x {max_tokens} tokens per method (--limit all runs every prompt)",
                err=True,
            )
        plots = not no_plots and plots_available()
        if not no_plots and not plots:
            typer.echo(NO_PLOTS, err=True)
        try:
            if profiles is not None:
                run_sweep(
                    cfg,
                    [p.strip() for p in profiles.split(",") if p.strip()],
                    12.0 if ms_per_token is None else ms_per_token,
                    overwrite=overwrite,
                    plots=plots,
                    generate=not report_only,
                )
            else:
                run_bench(
                    cfg,
                    overwrite=overwrite,
                    plots=plots,
                    generate=not report_only,
                    pipeline=pipeline_parallel or pipeline,
                )
        except KeyboardInterrupt:
            if distributed.is_main():
                typer.echo(interrupted_report(Path(out)), err=True)
            raise
        if not distributed.is_main():  # rank 0 wrote the outputs
            return
        report = Path(out) / "report.md"
        typer.echo(report.read_text())
        wrote = f"wrote {Path(out) / 'results.json'}, {report}" + (" and plots" if plots else "")
        typer.echo(wrote, err=True)


#: prompts per category that ``bench`` runs without ``--limit`` (6 Spec-Bench
#: tasks: 18 prompts per method, minutes on a laptop with a small model)
SAMPLE_PER_CATEGORY = 3
#: GSM8K questions that ``bench --mode gsm8k`` runs without ``--limit``
SAMPLE_GSM8K = 18


def resolve_limit(limit: str | None, mode: str) -> tuple[int | None, bool]:
    """``--limit`` as the bench's prompts per category (None: all) and
    whether it is the default sample.

    Raises:
        InvalidArgumentError: not a positive integer or ``all``.
    """
    if limit is None:
        return (SAMPLE_GSM8K if mode == "gsm8k" else SAMPLE_PER_CATEGORY), True
    if limit.strip().lower() == "all":
        return None, False
    try:
        n = int(limit)
    except ValueError:
        n = 0
    if n < 1:
        raise InvalidArgumentError(f"--limit must be an integer > 0 or 'all', got {limit!r}")
    return n, False


def interrupted_report(out: Path) -> str:
    """What an interrupted ``bench`` finished: the generations saved in
    ``out/records.jsonl`` (a ``--profiles`` sweep: in its profiles'
    subfolders) per method, and how to go on."""
    from ..bench.runner import RECORDS, _read_records

    paths = [out / RECORDS] if (out / RECORDS).exists() else sorted(out.glob(f"*/{RECORDS}"))
    records = [r for path in paths for r in _read_records(path)[0]]
    by_method: dict[str, int] = {}
    for r in records:
        by_method[r["method"]] = by_method.get(r["method"], 0) + 1
    done = ", ".join(f"{k} {v}" for k, v in by_method.items()) or "none"
    return (
        f"interrupted: {len(records)} generation(s) finished and saved in "
        f"{', '.join(map(str, paths)) or out / RECORDS} "
        f"(per method: {done}). Run the same command again to resume where it stopped, or "
        "add --report-only for a report of what finished."
    )
