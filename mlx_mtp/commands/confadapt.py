"""``mlx-mtp convert mtp-checkpoint`` and ``mlx-mtp train mtp`` (docs/methods.md, confadapt)."""

from __future__ import annotations

import math
from pathlib import Path

import typer

from ..artifacts import artifact_dir, check_destination, check_writable
from ..data import (
    eval_prompts,
    read_prompts,
    resolve_data,  # JSONL file or a named data set
)
from ..errors import InvalidArgumentError
from ..loading import default_dtype, load_model, resolve_model
from ..memory import FULL_TRAINING_COPIES, check_weights_fit
from ..validation import float_range
from . import BASE_DTYPE_HELP, group


def run_train_mtp(
    model: str,
    data: str,
    out: Path | None = None,
    lora: bool = True,
    steps: int | None = None,
    lr: float | None = None,
    seed: int = 0,
    resume: bool = True,
    dtype: str | None = None,
    prompt_format: str = "chat",
    stop_after: int | None = None,
    overwrite: bool = False,
    check: bool = True,
    **config: int | float | str,
) -> Path:
    """Adapt ``model`` for confadapt by self-distillation and write the result.

    An existing ``out`` is replaced only with ``overwrite``, or where
    ``resume`` continues the run that wrote it (its checkpoint lies beside
    it); both are checked before anything is loaded. With ``check`` the
    held-out check (:func:`mlx_mtp.training.mtp_check.trainer_check`: six
    Spec-Bench prompts, never trained on) is printed at the end.

    Returns:
        The output folder: an adapter (``--lora``, found automatically by the
        base model's fingerprint when it lies in ``$MLX_MTP_HOME/confadapt/``)
        or a full model folder with ``mtp_config.json``.
    """
    from ..fingerprint import model_fingerprint
    from ..training.mtp import TrainConfig, Trainer, checkpoint_dir

    if lr is not None and not math.isfinite(lr):
        raise InvalidArgumentError(f"--lr {lr} is not a finite number")
    prompts = read_prompts(resolve_data(data), exclude=eval_prompts())
    cfg = TrainConfig(lora=lora, lr=lr, seed=seed, **config)
    if steps is not None:
        cfg.steps = steps
    if out is not None:  # checked before anything is loaded or trained
        check_writable(out.parent)
        ours = resume and (checkpoint_dir(out) / "state.json").is_file()
        check_destination(out, overwrite, ours=ours)
    if not lora:  # before the model loads: training holds its weights 1 + 4 times
        check_weights_fit(
            resolve_model(model),
            dtype or default_dtype(),
            model,
            copies=1 + FULL_TRAINING_COPIES,
            what="full fine-tuning (the model, a copy, its gradients and AdamW's two moments)",
            todo="--lora (an adapter over the frozen weights) or a smaller model",
        )
    lm = load_model(model, dtype=dtype)
    if out is None:
        fp = model_fingerprint(lm.model)
        name = "" if model.count("/") else f"{model}-"
        out = artifact_dir("confadapt" if lora else "models") / f"{name}mtp-{fp}"
        check_writable(out.parent, "MLX_MTP_HOME (or --out)")
    trainer = Trainer(lm, prompts, out, cfg, prompt_format=prompt_format)
    path = trainer.run(resume=resume, stop_after=stop_after)
    if check:
        from ..training.mtp_check import check_lines, trainer_check

        result = trainer_check(trainer)
        for line in check_lines(result, "6 Spec-Bench prompts, never trained on"):
            typer.echo(line, err=True)
    return path


def register(app: typer.Typer) -> None:
    @group("convert").command("mtp-checkpoint")
    def convert_mtp_checkpoint(
        src: str = typer.Argument(..., help="Hub repo id or checkpoint folder."),
        dst: Path = typer.Argument(..., help="Output MLX folder (must not exist)."),
        quantize: int | None = typer.Option(None, "--quantize", help="4 or 8 bits."),
        dtype: str | None = typer.Option(None, "--dtype", help="Cast float weights."),
        prompt_format: str | None = typer.Option(
            None, "--prompt-format", help="plain (BOS + input + blank line) or chat."
        ),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing DST."),
    ) -> None:
        """Convert a self-distilled MTP checkpoint (Kirchenbauer et al.) for --method confadapt."""
        from ..converters.confadapt_import import convert_mtp_checkpoint as convert

        check_writable(dst.parent, "DST")  # before the checkpoint is downloaded or read
        check_destination(dst, overwrite, "DST")
        out = convert(
            src,
            dst,
            quantize=quantize,
            dtype=dtype,
            prompt_format=prompt_format,
            overwrite=overwrite,
            progress=True,
        )
        typer.echo(f"Wrote {out}. Use: mlx-mtp generate --model {out} --method confadapt")

    @group("train").command("mtp")
    def train_mtp(
        model: str = typer.Option("smollm2-135m", "--model", help="Base model to adapt."),
        data: str = typer.Option(..., "--data", help="Prompts JSONL, or 'gsm8k-train'."),
        lora: bool = typer.Option(True, "--lora/--full", help="LoRA adapter or full fine-tune."),
        gated: bool = typer.Option(
            True,
            "--gated/--ungated",
            help="LoRA acts only at mask tokens (next-token prediction stays the base model's).",
        ),
        steps: int | None = typer.Option(
            None, "--steps", min=1, help="Optimizer steps (default 100)."
        ),
        stop_after: int | None = typer.Option(
            None, "--stop-after", min=1, help="Stop (and export) at this step of the schedule."
        ),
        lr: float | None = typer.Option(
            None, "--lr", **float_range(0.0), help="Peak lr (5e-4 LoRA, 1e-5 full)."
        ),
        rank: int = typer.Option(8, "--rank", min=1, help="LoRA rank."),
        regions: int = typer.Option(12, "--regions", min=1, help="Mask regions per sequence."),
        gen_tokens: int = typer.Option(
            64, "--gen-tokens", min=2, help="Teacher tokens per prompt."
        ),
        seed: int = typer.Option(0, "--seed", min=0, max=2**63 - 1),
        forcing: str = typer.Option(
            "teacher",
            "--forcing",
            help="teacher (targets = the teacher's greedy continuation; the default, which "
            "measured best) or student (the paper's objective: the teacher scores the "
            "student's own drafts; collapses on small models, docs/methods.md).",
        ),
        out: Path | None = typer.Option(None, "--out", help="Output folder."),
        resume: bool = typer.Option(True, "--resume/--no-resume", help="Continue a checkpoint."),
        overwrite: bool = typer.Option(
            False, "--overwrite", help="Replace an existing --out this run did not make."
        ),
        dtype: str | None = typer.Option(
            None,
            "--dtype",
            help=BASE_DTYPE_HELP
            + " A quantized model trains LoRA over its frozen weights (QLoRA).",
        ),
        prompt_format: str = typer.Option("chat", "--prompt-format", help="chat or plain."),
        check: bool = typer.Option(
            True,
            "--check/--no-check",
            help="At the end, score the adapter on 6 held-out Spec-Bench prompts.",
        ),
    ) -> None:
        """Adapt a model for --method confadapt by self-distillation (adds the mask token)."""
        from ..training.mtp import FORCINGS

        if forcing not in FORCINGS:
            raise InvalidArgumentError(f"--forcing must be one of {', '.join(FORCINGS)}: {forcing}")
        if prompt_format not in ("chat", "plain"):
            raise InvalidArgumentError(f"--prompt-format must be chat or plain: {prompt_format}")
        if rank < 1 or regions < 1 or gen_tokens < 2:
            raise InvalidArgumentError("--rank, --regions must be >= 1 and --gen-tokens >= 2.")
        path = run_train_mtp(
            model,
            data,
            out,
            lora,
            steps,
            lr,
            seed,
            resume,
            dtype,
            prompt_format,
            stop_after,
            overwrite,
            rank=rank,
            gated=gated,
            forcing=forcing,
            regions=regions,
            gen_tokens=gen_tokens,
            check=check,
        )
        if not lora:
            how = f" --model {path}"
        elif path.parent.resolve() == artifact_dir("confadapt").resolve():  # found by itself
            how = f" --model {model}"
        else:
            how = f" --model {model} --opt adapter={path}"
        typer.echo(f"Wrote {path}. Use: mlx-mtp generate{how} --method confadapt")
