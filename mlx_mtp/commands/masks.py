"""``mlx-mtp train masks``: learn mask embeddings for ``probe`` / ``hybrid``."""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import typer

from ..artifacts import check_destination, check_writable
from ..data import eval_prompts, read_prompts, render_prompt
from ..errors import InvalidArgumentError
from ..loading import load_model
from ..validation import float_range
from . import BASE_DTYPE, group


def run_train_masks(
    model: str,
    data: list[Path],
    slots: int = 2,
    steps: int = 300,
    max_tokens: int = 96,
    limit: int | None = None,
    val_fraction: float = 0.1,
    lr: float = 3e-3,
    anchors: int = 48,
    seed: int = 0,
    out: Path | None = None,
    dtype: str | None = None,
    progress: bool = True,
    batch_size: int = 16,
    continuations: Path | None = None,
    overwrite: bool = False,
) -> dict:
    """Generate greedy continuations, train, evaluate before/after, save.

    ``continuations``: a jsonl file that keeps the generated continuations; a
    later run with the same model, prompts, ``max_tokens`` and ``batch_size``
    reuses it instead of decoding again (a continuations file written for other
    settings is replaced). It is extended after every batch, so an interrupted
    run resumes where it stopped.

    ``out``: a ``.safetensors`` file (its ``.json`` sidecar goes beside it) or
    a folder (the file is named by the model's fingerprint); an existing file
    there is replaced only with ``overwrite``. The default, the cache's
    ``masks`` folder, holds this command's own files and is written over.

    Returns:
        A summary dict: path of the saved file, hit rates and losses on the
        held-out prompts before (mean-prompt-embedding mask) and after training.

    Raises:
        InvalidArgumentError: bad data file or options, or an ``out`` that
            cannot be written or exists without ``overwrite`` (checked before
            the model loads; a folder's file, named by the model, as it loads).
    """
    from ..confadapt_format import tokenizer_eos_ids
    from ..fingerprint import model_fingerprint
    from ..learned_masks import SUFFIXES, masks_folder, save_learned_masks
    from ..training.continuations import Continuations
    from ..training.masks import eval_masks, mean_prompt_vectors, train_masks

    if not 1 <= slots <= 3:
        raise InvalidArgumentError(f"--slots must be 1, 2 or 3, got {slots}")
    if steps < 1:
        raise InvalidArgumentError(f"--steps must be >= 1, got {steps}")
    if batch_size < 1:
        raise InvalidArgumentError(f"--batch-size must be >= 1, got {batch_size}")
    for flag, value in (("--val-fraction", val_fraction), ("--lr", lr)):
        if not math.isfinite(value):
            raise InvalidArgumentError(f"{flag} {value} is not a finite number")
    if not 0.0 < val_fraction < 1.0:
        raise InvalidArgumentError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    if lr < 0:
        raise InvalidArgumentError(f"--lr must be >= 0, got {lr}")
    prompts = read_prompts(data, exclude=eval_prompts())  # the 48 bench prompts stay unseen
    random.Random(seed).shuffle(prompts)
    if limit is not None:
        prompts = prompts[:limit]
    n_val = max(1, int(round(len(prompts) * val_fraction)))
    if len(prompts) - n_val < 1:
        raise InvalidArgumentError("need at least 2 prompts (one to train on, one held out)")
    where = "--out" if out else "MLX_MTP_HOME (or --out)"
    check_writable(masks_folder(out), where)  # before anything is loaded or trained
    if out is not None and Path(out).suffix in SUFFIXES:
        _check_masks_file(Path(out), overwrite)
    lm = load_model(model, dtype=dtype)
    if out is not None and Path(out).suffix not in SUFFIXES:  # a folder
        _check_masks_file(Path(out) / f"{model_fingerprint(lm.model)}.safetensors", overwrite)
    t0 = time.perf_counter()
    meta = {
        "model_fingerprint": model_fingerprint(lm.model),
        "dtype": lm.dtype,  # continuations of the 4-bit and the float model differ
        "batch_size": batch_size,  # batched float32 greedy may differ at near-ties
    }
    ids = [render_prompt(lm.tokenizer, [{"role": "user", "content": t}]) for t in prompts]
    seqs = Continuations(
        lm.model,
        ids,
        max_tokens,
        set(tokenizer_eos_ids(lm.tokenizer)),
        batch_size=batch_size,
        path=continuations,
        meta=meta,
        progress=progress,
    ).all()
    val, train = seqs[:n_val], seqs[n_val:]
    gen_s = time.perf_counter() - t0

    def own_mean(s):
        return mean_prompt_vectors(lm.model, [s], slots)

    before = eval_masks(lm.model, val, own_mean, slots)
    t0 = time.perf_counter()
    res = train_masks(lm.model, train, slots, steps, lr, anchors, seed, progress=progress)
    train_s = time.perf_counter() - t0
    after = eval_masks(lm.model, val, res.vectors, slots)
    info = {
        "model": lm.name,
        "trained_on": [str(d) for d in data],
        "train_prompts": len(train),
        "heldout_prompts": len(val),
        "max_tokens": max_tokens,
        "batch_size": batch_size,
        "steps": steps,
        "lr": lr,
        "anchors_per_step": anchors,
        "seed": seed,
        "heldout_before_mean_mask": before,
        "heldout_after": after,
        "generation_seconds": round(gen_s, 1),
        "training_seconds": round(train_s, 1),
    }
    path = save_learned_masks(res.vectors, lm.model, out, info)
    return {"path": str(path), **info}


def _check_masks_file(path: Path, overwrite: bool) -> None:
    """Refuse to replace the mask file ``path`` or its ``.json`` sidecar
    unless ``overwrite`` (:func:`~mlx_mtp.artifacts.check_destination`)."""
    for f in (path.with_suffix(".safetensors"), path.with_suffix(".json")):
        check_destination(f, overwrite)


def register(app: typer.Typer) -> None:
    """Add ``train masks``."""

    @group("train").command("masks")
    def train_masks_cmd(
        model: str = typer.Option("smollm2-135m", "--model", "-m", help="Alias, folder or repo."),
        data: list[Path] = typer.Option(
            ..., "--data", help="jsonl of prompts (turns/question/prompt/text); repeatable."
        ),
        slots: int = typer.Option(2, "--slots", min=1, max=3, help="Mask slots to learn (1-3)."),
        steps: int = typer.Option(300, "--steps", min=1, help="Adam steps (one sequence each)."),
        max_tokens: int = typer.Option(96, "--max-tokens", min=1, help="Greedy tokens per prompt."),
        limit: int | None = typer.Option(None, "--limit", min=1, help="Use at most N prompts."),
        val_fraction: float = typer.Option(
            0.1, "--val-fraction", **float_range(0.0, 0.9, above=True), help="Held-out share."
        ),
        lr: float = typer.Option(3e-3, "--lr", **float_range(0.0), help="Adam learning rate."),
        anchors: int = typer.Option(48, "--anchors", min=1, help="Anchors (mask sets) per step."),
        seed: int = typer.Option(0, "--seed", min=0, max=2**63 - 1),
        out: Path | None = typer.Option(
            None, "--out", help="Output .safetensors (default: cache folder, found automatically)."
        ),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out."),
        dtype: str | None = BASE_DTYPE,
        batch_size: int = typer.Option(
            16,
            "--batch-size",
            min=1,
            help="Prompts decoded together for continuations.",
        ),
        continuations: Path | None = typer.Option(
            None,
            "--continuations",
            help="jsonl that keeps the generated continuations; reused by a later run "
            "with the same model, prompts, --max-tokens and --batch-size.",
        ),
    ):
        """Learn mask vectors (model frozen) so mask slot j predicts the token j+2
        positions ahead; use them with --opt mask_init=learned."""
        s = run_train_masks(
            model,
            data,
            slots,
            steps,
            max_tokens,
            limit,
            val_fraction,
            lr,
            anchors,
            seed,
            out,
            dtype,
            batch_size=batch_size,
            continuations=continuations,
            overwrite=overwrite,
        )
        b, a = s["heldout_before_mean_mask"], s["heldout_after"]
        for j in range(slots):
            d = j + 2
            typer.echo(
                f"held-out t+{d}: top-1 {b[f'top1_t+{d}']:.1%} -> {a[f'top1_t+{d}']:.1%}, "
                f"top-5 {b[f'top5_t+{d}']:.1%} -> {a[f'top5_t+{d}']:.1%}"
            )
        typer.echo(f"held-out loss {b['loss']:.3f} -> {a['loss']:.3f}")
        typer.echo(f"saved {s['path']}")
        typer.echo(json.dumps({k: v for k, v in s.items() if k != "path"}), err=True)
