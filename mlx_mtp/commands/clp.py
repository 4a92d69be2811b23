"""``mlx-mtp train clp`` and ``mlx-mtp convert clp-heads`` (CLP heads, docs/methods.md)."""

from __future__ import annotations

from pathlib import Path

import typer

from ..artifacts import artifact_dir, check_destination, check_writable
from ..loading import load_model
from ..validation import float_range
from . import BASE_DTYPE, group


def register(app: typer.Typer) -> None:
    """Add ``train clp`` and ``convert clp-heads``."""

    @group("train").command("clp")
    def train_clp_cmd(
        model: str = typer.Option("smollm2-135m", "--model", "-m", help="Base model (frozen)."),
        data: list[str] = typer.Option(
            [],
            "--data",
            help="Prompt jsonl (turns/prompt/question field), repeatable; 'spec-bench' = the "
            "packaged Spec-Bench. The 48 evaluation prompts are always left out. Targets: "
            "the backbone's greedy continuations of the prompts (with --corpus, trained "
            "together with the corpus' targets).",
        ),
        corpus: list[str] = typer.Option(
            [],
            "--corpus",
            help="Text jsonl (text, question+answer, messages or a prompt field), repeatable: "
            "teacher-forced targets, the backbone's predictions over the text in one prefill "
            "per window (far cheaper than --data). Give --data, --corpus or both.",
        ),
        eval_data: list[str] = typer.Option(
            [],
            "--eval",
            help="With --corpus: held-out jsonl scored every --eval-every steps (repeatable; "
            "default: the packaged Spec-Bench prompts).",
        ),
        windows: int | None = typer.Option(
            None, "--windows", min=1, help="With --corpus: at most this many 512-token windows."
        ),
        target_minutes: float | None = typer.Option(
            None,
            "--target-minutes",
            **float_range(0.0),
            help="With --corpus: compute targets for at most this many minutes, then train on "
            "those (a rerun continues them).",
        ),
        eval_every: int = typer.Option(
            200, "--eval-every", min=1, help="With --corpus: steps between held-out scores."
        ),
        out: Path | None = typer.Option(
            None, "--out", help="Heads folder (default: $MLX_MTP_HOME/clp/<model>-<fingerprint>)."
        ),
        k: int = typer.Option(
            2, "--k", min=1, max=8, help="Horizon: heads for tokens n+2 .. n+1+k."
        ),
        bottleneck: int = typer.Option(
            256, "--bottleneck", min=1, help="Width of each head's block."
        ),
        depth: int = typer.Option(
            1,
            "--depth",
            min=1,
            max=8,
            help="Residual blocks per head (the first sees the next token's embedding).",
        ),
        limit: int | None = typer.Option(
            None, "--limit", min=1, help="At most this many prompts per --data file."
        ),
        max_new_tokens: int = typer.Option(
            64, "--max-new-tokens", min=1, help="Greedy tokens/prompt."
        ),
        max_prompt_tokens: int = typer.Option(
            256, "--max-prompt-tokens", min=1, help="Keep the last N tokens of longer prompts."
        ),
        gen_batch: int = typer.Option(
            32, "--gen-batch", min=1, help="Prompts per generation batch."
        ),
        gen_minutes: float | None = typer.Option(
            None,
            "--gen-minutes",
            **float_range(0.0),
            help="Stop generating continuations after this many minutes and train on those "
            "made so far (a later --resume run generates the rest).",
        ),
        epochs: int = typer.Option(3, "--epochs", min=1, help="Head training epochs."),
        batch_size: int = typer.Option(128, "--batch-size", min=1, help="Positions per head step."),
        lr: float = typer.Option(
            1e-3, "--lr", **float_range(0.0), help="Head learning rate (AdamW, cosine)."
        ),
        gate: bool = typer.Option(True, "--gate/--no-gate", help="Also train the ~1M gate."),
        seed: int = typer.Option(0, "--seed", min=0, max=2**63 - 1, help="Random seed."),
        resume: bool = typer.Option(False, "--resume", help="Continue from checkpoints."),
        overwrite: bool = typer.Option(
            False, "--overwrite", help="Replace an existing --out this run did not make."
        ),
        dtype: str | None = BASE_DTYPE,
    ):
        """Train CLP heads + span predictor on the backbone's own greedy continuations."""
        from ..data import read_prompts
        from ..errors import InvalidArgumentError
        from ..fingerprint import model_fingerprint
        from ..training.clp import TrainConfig, checkpoint_dir, train_clp

        if not data and not corpus:
            raise InvalidArgumentError(
                "train clp: give --data (prompts; greedy continuations), --corpus (text; "
                "teacher-forced targets) or both."
            )
        # the data and the output folder are checked before the model loads
        if data:
            read_prompts(list(data))
        for f in [*corpus, *eval_data]:
            if not Path(f).expanduser().is_file() and f != "spec-bench":
                raise InvalidArgumentError(f"--corpus/--eval {f}: no such file (expected JSONL)")
        if out is not None:
            check_writable(out.parent)
            check_destination(out, overwrite, ours=resume and checkpoint_dir(out).is_dir())
        loaded = load_model(model, dtype=dtype)
        if out is None:
            name = Path(model).name if "/" in model else model
            out = artifact_dir("clp") / f"{name}-{model_fingerprint(loaded.model)}"
            check_writable(out.parent, "MLX_MTP_HOME (or --out)")
        cfg = TrainConfig(
            k=k,
            bottleneck=bottleneck,
            depth=depth,
            max_new_tokens=max_new_tokens,
            max_prompt_tokens=max_prompt_tokens,
            limit=limit,
            gen_batch=gen_batch,
            gen_minutes=gen_minutes,
            epochs=epochs,
            batch_size=batch_size,
            lr=lr,
            gate=gate,
            seed=seed,
            data=list(data),
            corpus=list(corpus),
            windows=windows,
            eval_every=eval_every,
        )
        hidden = loaded.model.args.hidden_size
        typer.echo(
            f"span predictor: nn.Linear({hidden}, {k + 1}) = {hidden * (k + 1) + k + 1:,} "
            "parameters",
            err=True,
        )
        log = lambda s: typer.echo(s, err=True)  # noqa: E731
        if corpus:
            from ..training.clp import train_clp_corpus

            train_clp_corpus(
                loaded, out, cfg, eval_data or ["spec-bench"], target_minutes, resume, log
            )
        else:
            train_clp(loaded, out, cfg, resume=resume, log=log)
        typer.echo(f"heads written to {out}")

    @group("convert").command("clp-heads")
    def convert_clp_heads_cmd(
        src: str = typer.Argument(
            ...,
            help="Heads folder/repo (this package's format), a Medusa repo/folder, or a "
            "MiMo checkpoint folder with model.mtp_layers.*, or a Qwen3.5/Qwen3-Next "
            "checkpoint folder with mtp.*",
        ),
        dst: Path = typer.Argument(..., help="Output heads folder."),
        model: str = typer.Option(
            "smollm2-135m", "--model", "-m", help="Base model the heads belong to."
        ),
        source: str = typer.Option(
            "auto",
            "--from",
            help="auto, clp, medusa, mimo-mtp, qwen3-mtp or deepseek-nextn (how to read SRC).",
        ),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing DST."),
        dtype: str | None = BASE_DTYPE,
    ):
        """Import CLP heads (own format, Medusa heads, MiMo native MTP layer)."""
        from ..converters.clp_import import check_source, convert

        # the source and the destination are checked before the base model loads
        check_writable(dst.parent, "DST")
        check_destination(dst, overwrite, "DST")
        folder, kind = check_source(src, dst, source, overwrite)
        loaded = load_model(model, dtype=dtype)
        summary = convert(folder, dst, loaded, source=kind, overwrite=overwrite)
        typer.echo(summary)
