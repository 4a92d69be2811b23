"""``mlx-mtp doctor``: what this machine gives mlx-mtp, and whether the draft-tree
forward pass computes what plain decoding computes on it.

It prints, one labelled line each (docs/mac.md explains every line): the
platform, MLX and its device, the BLAS the CPU backend uses, whether float32
matmuls may run in TF32, the memory limits, the model, its forward cost curve
measured at every size up to 64 slots, and a numerical self-check: the logits
of one tree forward pass (:meth:`Engine.forward_tree
<mlx_mtp.engine.Engine.forward_tree>`: per-slot RoPE positions, a tree mask
through the cache views) against mlx-lm's own one-token decoding of every
root-to-slot path, at the tree sizes in :data:`CHECK_SIZES`
(:mod:`mlx_mtp.selfcheck`, the check the tests run on every tree family). On
a hybrid recurrent model the pass is a chain and a rollback check follows
(keep a prefix of a chain pass, :mod:`mlx_mtp.recurrent`, then decode on). A
failed check ends the command with exit status 1.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import typer

from ..loading import EMBEDDED_MODEL

if TYPE_CHECKING:
    from ..engine import Engine
    from ..loading import LoadedModel
    from ..selfcheck import Check

#: tree sizes (slots) of the self-check: around the quantized-matmul kernel
#: switch (vector to matrix kernel at 6-33 rows) and the 32-row tiles
CHECK_SIZES = (1, 5, 8, 9, 16, 33, 64)
#: largest relative logit difference accepted in float32 with full-precision
#: matmuls, and in bfloat16 / float16 / quantized weights / TF32
TOLERANCE_FLOAT32 = 1e-4
TOLERANCE_LOW_PRECISION = 1e-2
#: tokens in the cache before the timed and checked passes
CONTEXT_TOKENS = 32
#: cost-curve values printed per line
CURVE_ROW = 8
#: a step between neighbouring sizes above this relative rise is listed
CURVE_JUMP = 0.10
#: width of the line labels, and of the labels of indented lines under them
LABEL = 11
SUB_LABEL = 10


# ---------------------------------------------------------------- machine
def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def tf32_state() -> tuple[bool, str]:
    """Whether MLX may run float32 matmuls in TF32 in this process, and a
    sentence saying why (``MLX_ENABLE_TF32``, read when MLX starts; MLX's
    default is 1; it acts on hardware with TF32 units: M5-class Apple GPUs,
    CUDA; never on the CPU backend)."""
    import mlx.core as mx

    value = os.environ.get("MLX_ENABLE_TF32")
    allowed = value is None or value.strip() != "0"
    gpu = mx.default_device().type == mx.gpu
    head = (
        "MLX_ENABLE_TF32 unset (MLX's default: 1)" if value is None else f"MLX_ENABLE_TF32={value}"
    )
    if not allowed:
        return False, f"{head}: float32 matmuls in full float32"
    if not gpu:
        return False, f"{head}: no effect on the CPU backend (full float32)"
    return True, (
        f"{head}: float32 matmuls of several rows may run in TF32 on GPUs that have it "
        "(M5-class); MLX_ENABLE_TF32=0 keeps full float32 (for exact float32 comparisons)"
    )


def machine_lines() -> list[tuple[str, str]]:
    """(label, text) lines on the platform, MLX, BLAS, TF32 and memory."""
    import mlx.core as mx

    from .. import __version__
    from .._blas import blas_status, openblas_path
    from ..costs import device_name
    from ..memory import SLOT_MEMORY_SHARE, memory_limit

    lines = []
    system = platform.platform()
    if sys.platform == "darwin":
        system = f"macOS {platform.mac_ver()[0]} ({platform.machine()})"
    lines.append(("platform", f"{system}, Python {platform.python_version()}"))
    dev = mx.default_device()
    lines.append(
        (
            "mlx",
            f"mlx {mx.__version__}, mlx-lm {_version('mlx-lm')}, mlx-mtp {__version__}; "
            f"device {'gpu' if dev.type == mx.gpu else 'cpu'} ({device_name()})",
        )
    )
    try:
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
    except Exception:  # an MLX without device_info
        info = {}
    if dev.type == mx.gpu and info:
        gb = 1 << 30
        lines.append(
            (
                "gpu",
                f"{info.get('device_name', '?')} ({info.get('architecture', '?')}), memory "
                f"{info.get('memory_size', 0) / gb:.1f} GiB, recommended working set "
                f"{info.get('max_recommended_working_set_size', 0) / gb:.1f} GiB, largest "
                f"buffer {info.get('max_buffer_length', 0) / gb:.1f} GiB",
            )
        )
    blas = blas_status()
    if blas == "openblas":
        where = openblas_path() or os.environ.get("LD_PRELOAD", "")
        threads = os.environ.get("OPENBLAS_NUM_THREADS", "unset")
        blas = f"openblas ({where}), OPENBLAS_NUM_THREADS {threads}"
    elif blas == "reference":
        blas = (
            "reference BLAS (slow: install libopenblas0-pthread, or import mlx_mtp before mlx; "
            "see mlx_mtp/_blas.py)"
        )
    elif blas == "metal":
        blas = "Metal kernels on the GPU (Accelerate on the CPU)"
    lines.append(("blas", blas))
    lines.append(("tf32", tf32_state()[1]))
    limit, source = memory_limit()
    lines.append(
        (
            "memory",
            f"limit {limit / 1e9:.1f} GB ({source}); one forward pass may use "
            f"{SLOT_MEMORY_SHARE:.0%} of it; MLX active {mx.get_active_memory() / 1e9:.2f} GB, "
            f"peak {mx.get_peak_memory() / 1e9:.2f} GB",
        )
    )
    return lines


# ------------------------------------------------------------------ model
def _quantized(model: Any) -> bool:
    from ..costs import quantization

    return quantization(model) != "none"


def model_lines(lm: LoadedModel, engine: Engine) -> list[tuple[str, str]]:
    """(label, text) lines on the model: architecture, sizes, dtype, cache."""
    import mlx.core as mx

    from ..memory import weight_bytes
    from ..native_mtp import compute_dtype, text_args

    model = lm.model
    args = text_args(model)
    mtype = getattr(model, "model_type", getattr(args, "model_type", type(model).__name__))
    heads = getattr(args, "num_attention_heads", "?")
    kv = getattr(args, "num_key_value_heads", heads)
    hidden = getattr(args, "hidden_size", "?")
    head_dim = getattr(args, "head_dim", None) or (
        hidden // heads if isinstance(hidden, int) and isinstance(heads, int) else "?"
    )
    dtype = str(compute_dtype(model)).replace("mlx.core.", "")
    q = lm.config.get("quantization") if _quantized(model) else None
    weights = f"{dtype}" + (
        f", {q.get('bits', '?')}-bit weights (group {q.get('group_size', '?')})"
        if isinstance(q, dict)
        else (", quantized weights" if _quantized(model) else "")
    )
    kinds = sorted({type(c).__name__ for c in engine.cache})
    recurrent = (
        "; recurrent layers (rollback check below)"
        if engine.rollback is not None
        else ("; recurrent layers without rollback" if "ArraysCache" in kinds else "")
    )
    gb = weight_bytes(model) / 1e9
    share = ""
    try:
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        ws = int(info.get("max_recommended_working_set_size", 0))
        if ws > 0:
            share = f" ({gb * 1e9 / ws:.0%} of the GPU working set)"
    except Exception:  # no Metal device
        pass
    return [
        ("model", f"{lm.name} ({lm.path})"),
        (
            "",
            f"{mtype}, {getattr(args, 'num_hidden_layers', '?')} layers, hidden {hidden}, "
            f"{heads} heads / {kv} KV heads of dim {head_dim}, vocab "
            f"{getattr(args, 'vocab_size', '?')}",
        ),
        (
            "",
            f"computes in {weights}; weights {gb:.2f} GB{share}; cache {', '.join(kinds)}"
            f"{recurrent}",
        ),
        (
            "",
            f"largest forward pass that fits in memory: {engine.max_slots(CONTEXT_TOKENS)} "
            f"slots after {CONTEXT_TOKENS} tokens (the --bc ceiling)",
        ),
    ]


# ------------------------------------------------------------- cost curve
def curve_lines(engine: Engine, max_size: int, repeats: int, progress: bool) -> list[str]:
    """The engine's forward cost curve at every size 1..``max_size``
    (:func:`mlx_mtp.costs.measure_cost_curve`, ``repeats`` timed rounds),
    :data:`CURVE_ROW` values a line, then the rises between neighbours above
    :data:`CURVE_JUMP` (kernel switches, tile boundaries)."""
    from ..costs import curve_key, measure_cost_curve

    curve = measure_cost_curve(
        engine, sizes=range(1, max_size + 1), repeats=repeats, progress=progress
    )
    sizes = list(curve.sizes)
    costs = [curve(s) for s in sizes]
    ms = (curve.seconds or 0.0) * 1000
    out = [
        f"{'cost curve':{LABEL}s}time of an n-slot forward / one slot (one slot {ms:.1f} ms), "
        f"{curve.context} tokens of context, median of {repeats} "
        f"round{'s' if repeats > 1 else ''}, never decreasing (as the planner reads it)",
    ]
    for i in range(0, len(sizes), CURVE_ROW):
        row = sizes[i : i + CURVE_ROW]
        label = f"n {row[0]}-{row[-1]}" if len(row) > 1 else f"n {row[0]}"
        out.append(_sub(label, " ".join(f"{c:4.2f}" for c in costs[i : i + CURVE_ROW])))
    jumps = [
        f"{a}->{b} +{cb / ca - 1:.0%}"
        for a, b, ca, cb in zip(sizes, sizes[1:], costs, costs[1:])
        if b == a + 1 and cb > ca * (1 + CURVE_JUMP)
    ]
    missing = sorted(set(range(1, max_size + 1)) - set(sizes))
    out.append(_sub("steps", ", ".join(jumps) or f"none over {CURVE_JUMP:.0%} between neighbours"))
    if missing:
        out.append(_sub("left out", f"{len(missing)} sizes (memory or cache limits)"))
    key = curve_key(engine)
    out.append(_sub("cache key", ", ".join(f"{k}={v}" for k, v in key.items())))
    return out


def _sub(label: str, text: str) -> str:
    """An indented line under a section: ``  label     text``."""
    return f"  {label:{SUB_LABEL}s} {text}"


# ------------------------------------------------------------- self-check
def tolerance(model: Any) -> tuple[float, str]:
    """The self-check's tolerance for ``model`` on this device, and why:
    :data:`TOLERANCE_FLOAT32` for float32 weights with full float32 matmuls,
    else :data:`TOLERANCE_LOW_PRECISION` (bfloat16 / float16, quantized
    weights, or TF32 allowed on a GPU)."""
    import mlx.core as mx

    from ..native_mtp import compute_dtype

    dtype = compute_dtype(model)
    name = str(dtype).replace("mlx.core.", "")
    if _quantized(model):
        return TOLERANCE_LOW_PRECISION, f"quantized weights ({name} scales)"
    if dtype != mx.float32:
        return TOLERANCE_LOW_PRECISION, name
    if tf32_state()[0]:
        return TOLERANCE_LOW_PRECISION, "float32 with TF32 allowed"
    return TOLERANCE_FLOAT32, "float32, TF32 off"


def self_check(
    engine: Engine,
    context: list[int],
    sizes: Sequence[int] = CHECK_SIZES,
    seed: int = 0,
    echo: Callable[[str], None] = print,
) -> list[Check]:
    """Compare the engine's multi-slot forward pass with one-token decoding at
    every size in ``sizes`` (see the module doc; the check itself is
    :mod:`mlx_mtp.selfcheck`, which the tests run on every tree family),
    printing a line per check. The slots' tokens are seeded random ids (the
    comparison holds for any).

    Args:
        engine: an engine whose cache holds exactly ``context``; it holds it
            again on return.
        context: the cached token ids.
        sizes: slots of the checked passes.

    Returns:
        The checks (tree or chain at each size; on a recurrent model a
        rollback check after each).
    """
    import numpy as np

    from ..errors import UnsupportedModelError
    from ..families import check_tree_support
    from ..selfcheck import OneTokenDecoding, check_keep, check_pass, random_tree

    model = engine.model
    tol, why = tolerance(model)
    vocab = int(engine.embed.weight.shape[0]) if engine.embed is not None else 256
    rng = np.random.default_rng(seed)
    recurrent = engine.rollback is not None
    mode, note = "tree", ""
    if recurrent:
        mode = "chain"
        note = "recurrent layers: chain-shaped passes (a tree cannot run through them)"
    else:
        try:
            check_tree_support(model, "doctor")
        except UnsupportedModelError:
            mtype = getattr(model, "model_type", type(model).__name__)
            mode = "chain"
            note = (
                f"model type {mtype!r} has no draft-tree forward here (tree-drafting methods "
                "refuse it): the causal chain forward is checked instead"
            )
    echo(
        f"{'self-check':{LABEL}s}{mode} forward vs one-token decoding, {why}: rel err "
        f"<= {tol:.0e} (max |diff| / max |logit|, every slot, whole vocabulary)"
    )
    if note:
        echo(f"  {note}")
    reference = OneTokenDecoding(model, context)
    chain = mode == "chain"
    checks: list[Check] = []
    for n in sizes:
        tokens = rng.integers(0, vocab, n).tolist()
        parents = list(range(-1, n - 1)) if chain else random_tree(n, seed + n)
        checks.append(check_pass(engine, reference, parents, tokens, tol, chain))
        echo(checks[-1].line())
        if recurrent:
            # keep the first half of a chain pass (the state rolled back by
            # replay), then decode the next token
            keep = n // 2
            checks.append(
                check_keep(
                    engine, reference, parents, tokens, keep - 1, tokens[keep], tol, chain,
                    "rollback",
                )
            )  # fmt: skip
            echo(checks[-1].line())
            engine.reset()  # a one-token pass on recurrent layers cannot be trimmed
            engine.sync(context)
    return checks


# ------------------------------------------------------------------ all
def run_doctor(
    lm: LoadedModel,
    *,
    max_size: int = 64,
    repeats: int = 3,
    sizes: Sequence[int] = CHECK_SIZES,
    echo: Callable[[str], None] = print,
    progress: bool = False,
) -> bool:
    """Print the doctor's report for the loaded model ``lm`` (see the module
    doc) through ``echo``, one line per call.

    Args:
        lm: the loaded model (:func:`mlx_mtp.loading.load_model`).
        max_size: largest forward pass (slots) of the cost curve.
        repeats: timed rounds per size of the cost curve (after one warm-up).
        sizes: tree sizes of the self-check.
        progress: a progress bar (stderr) while the cost curve is measured.

    Returns:
        True when every self-check passed.
    """
    import numpy as np

    from ..engine import Engine

    engine = Engine(lm.model)
    for label, text in [*machine_lines(), *model_lines(lm, engine)]:
        echo(f"{label:{LABEL}s}{text}")
    vocab = int(engine.embed.weight.shape[0]) if engine.embed is not None else 256
    context = np.random.default_rng(1).integers(0, vocab, CONTEXT_TOKENS).tolist()
    engine.sync(context)
    if engine.backbone is not None:
        for line in curve_lines(engine, max_size, repeats, progress):
            echo(line)
    else:
        echo(f"{'cost curve':{LABEL}s}not measured: the model has no llama-style layout")
    checks = self_check(engine, context, sizes, echo=echo)
    failed = [c for c in checks if not c.ok]
    echo(
        f"{'result':{LABEL}s}"
        + (
            f"all {len(checks)} checks passed"
            if not failed
            else f"{len(failed)} of {len(checks)} checks FAILED: multi-token forward passes "
            "disagree with one-token decoding on this device; please report this output"
        )
    )
    return not failed


def register(app: typer.Typer) -> None:
    """Add the ``doctor`` command."""

    @app.command()
    def doctor(
        model: str = typer.Option(
            EMBEDDED_MODEL, "--model", "-m", help="Alias, folder, .gguf or HF repo id."
        ),
        dtype: str | None = typer.Option(
            None, "--dtype", help="float32, bfloat16, float16 or auto (as stored)."
        ),
        max_size: int = typer.Option(
            64, "--max-size", min=1, max=1024, help="Largest forward pass (slots) of the curve."
        ),
        repeats: int = typer.Option(3, "--repeats", min=1, max=50, help="Timed rounds per size."),
    ):
        """Print this machine's MLX set-up, the model's cost curve and a numerical
        self-check of the draft-tree forward pass (the first thing to run on a Mac)."""
        from ..loading import load_model

        typer.echo(f"loading {model} ...", err=True)
        lm = load_model(model, dtype=dtype)
        if not run_doctor(lm, max_size=max_size, repeats=repeats, echo=typer.echo, progress=True):
            sys.exit(1)
