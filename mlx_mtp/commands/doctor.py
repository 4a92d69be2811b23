"""``mlx-mtp doctor``: what this machine gives mlx-mtp, and whether the draft-tree
forward pass computes what plain decoding computes on it.

It prints, one labelled line each (docs/mac.md explains every line): the
platform, MLX and its device, the BLAS the CPU backend uses, whether float32
matmuls may run in TF32, the memory limits, the model, its forward cost curve
measured at every size up to 64 slots (saved as the curve ``auto`` plans with
on this device, :func:`mlx_mtp.costs.save_curve`), and a numerical self-check: the logits
of one tree forward pass (:meth:`Engine.forward_tree
<mlx_mtp.engine.Engine.forward_tree>`: per-slot RoPE positions, a tree mask
through the cache views) against mlx-lm's own one-token decoding of every
root-to-slot path, at the tree sizes in :data:`CHECK_SIZES`
(:mod:`mlx_mtp.selfcheck`, the check the tests run on every tree family). On
a hybrid recurrent model the pass is a chain and a rollback check follows
(keep a prefix of a chain pass, :mod:`mlx_mtp.recurrent`, then decode on).
Then the pipelined path, the draft steps a GPU runs by default
(:func:`pipeline_check`): its passes at a cache length held on the device on a
tiny model of the same family, and a few tokens of the model decoded with
pipelined steps against plain decoding. A failed check ends the command with
exit status 1.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
#: tokens of the model decoded with pipelined steps and with plain decoding
PIPELINE_TOKENS = 16
#: methods whose pipelined steps are decoded: a chain (pld) and trees that
#: move their accepted rows and carry mask slots (hybrid: pld, recycle, probe)
PIPELINE_METHODS = ("pld", "hybrid")
#: the least share of plain decoding's tokens the pipelined steps must
#: reproduce outside float32, where a near-tie may break either way
MIN_AGREEMENT = 0.5
#: the prompt of the decoded comparison: repetitive text, so drafts are accepted
PIPELINE_PROMPT = (
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
    "def mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n"
)
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
    out.append(_sub("saved", _save(key, curve, max_size)))
    return out


def _save(key: dict[str, str], curve: Any, max_size: int) -> str:
    """Save the measured curve as this device's for the model (``auto`` plans
    with it from then on, refining it as it runs), where it reaches every
    size ``auto`` plans with; the line that says what happened."""
    from ..costs import CURVE_SIZES, save_curve

    if max_size < max(CURVE_SIZES):
        return (
            f"no: --max-size {max_size} is below the {max(CURVE_SIZES)} slots `auto` plans "
            "with (the cached curve is left as it was)"
        )
    try:
        return f"{save_curve(key, curve)} (`auto` plans with it on this device)"
    except OSError as e:
        return f"no: {e} (set MLX_MTP_HOME to a writable folder)"


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


# ------------------------------------------------------------ pipelined
@dataclass
class Agreement:
    """Pipelined steps of ``method`` against plain decoding of the same
    model and prompt: ``agreement`` is the share of plain decoding's
    ``tokens`` reproduced before the first difference (``mismatch``, None if
    none); ``exact`` asks for all of them (float32), else at least
    :data:`MIN_AGREEMENT`."""

    method: str
    tokens: int
    agreement: float
    mismatch: int | None
    drafted: int
    accepted: int
    exact: bool

    @property
    def ok(self) -> bool:
        """Whether the agreement passes."""
        return self.mismatch is None if self.exact else self.agreement >= MIN_AGREEMENT

    def line(self) -> str:
        """The report line of this comparison."""
        where = "identical" if self.mismatch is None else f"first difference at {self.mismatch}"
        return (
            f"  {self.method:9s}{self.tokens} tokens  agreement {self.agreement:.0%} ({where})  "
            f"drafted {self.drafted}, accepted {self.accepted}  {'ok' if self.ok else 'FAILED'}"
        )


def _pipeline_prompt(lm: LoadedModel, vocab: int) -> list[int]:
    import numpy as np

    if lm.tokenizer is not None:
        ids = list(lm.tokenizer.encode(PIPELINE_PROMPT))
        if len(ids) > 1:
            return [int(t) for t in ids]
    part = np.random.default_rng(3).integers(1, vocab, 12).tolist()
    return part * 3


def pipeline_check(
    lm: LoadedModel,
    tokens: int = PIPELINE_TOKENS,
    methods: Sequence[str] = PIPELINE_METHODS,
    echo: Callable[[str], None] = print,
) -> list[Any]:
    """The pipelined path (:mod:`mlx_mtp.pipeline`, the default draft steps
    on a GPU) on this device, printing a line per check:

    - its passes at a lazy cache length on a tiny random float32 model of
      the model's family (:func:`mlx_mtp.tiny.tiny_model_like`), against the
      engine's passes at a known length and a fresh cache
      (:func:`mlx_mtp.selfcheck.check_lazy_passes`);
    - ``tokens`` tokens of the model itself with pipelined steps of each of
      ``methods`` (``runner="pipelined"``, a memory-bound cost curve so that
      they draft) against plain decoding (ntp): identical in float32 with
      full float32 matmuls, else an agreement of at least
      :data:`MIN_AGREEMENT`.

    Nothing is checked where the model's steps never run pipelined (a cache
    that is not plain, a family without a verified tree pass): the line
    says so.

    Returns:
        The checks (:class:`~mlx_mtp.selfcheck.Check` and :class:`Agreement`).
    """
    import numpy as np

    from ..budget import CostCurve
    from ..context import Context
    from ..decoding import generate_steps
    from ..engine import Engine
    from ..methods import make_method
    from ..selfcheck import check_lazy_passes
    from ..tiny import tiny_model_like

    engine = Engine(lm.model)
    if not engine.lazy_ready():
        echo(
            f"{'pipelined':{LABEL}s}not used for this model (its cache is not plain KV "
            "caches or its family has no verified tree pass): draft steps run through the "
            "planner, checked above"
        )
        return []
    tol, why = tolerance(lm.model)
    tiny_tol = TOLERANCE_LOW_PRECISION if tf32_state()[0] else TOLERANCE_FLOAT32
    echo(
        f"{'pipelined':{LABEL}s}passes at a cache length held on the device (slice_update at "
        "an array offset, the mask built on the device, per-token RoPE offsets, rows moved on "
        f"the device) vs passes at a known length, tiny float32 model of this family: rel err "
        f"<= {tiny_tol:.0e}"
    )
    checks: list[Any] = []
    try:
        tiny = tiny_model_like(lm.config)
    except ValueError as e:
        echo(f"  tiny model not built ({e}); the decoded comparison below still runs")
    else:
        context = np.random.default_rng(1).integers(1, 256, CONTEXT_TOKENS).tolist()
        try:
            lazy = check_lazy_passes(tiny, context, tiny_tol)
        except ValueError as e:
            echo(f"  tiny model not checked ({e}); the decoded comparison below still runs")
        else:
            for c in lazy:
                echo(c.line())
            checks += lazy
    if tokens <= 0:
        return checks
    exact = why == "float32, TF32 off"
    echo(
        f"{'decoded':{LABEL}s}{tokens} tokens of this model, pipelined steps vs plain decoding "
        f"(ntp), {why}: "
        + ("identical" if exact else f"agreement >= {MIN_AGREEMENT:.0%} (near-ties may break)")
    )
    vocab = int(engine.embed.weight.shape[0]) if engine.embed is not None else 256
    prompt = _pipeline_prompt(lm, vocab)
    reference = [
        t
        for s in generate_steps(Engine(lm.model), make_method("ntp"), prompt, max_tokens=tokens)
        for t in s.tokens
    ]
    from ..bench.metrics import first_mismatch, prefix_agreement

    for name in methods:
        ctx = Context(Engine(lm.model), curves=CostCurve.flat())
        method = make_method(name)
        method.prepare(ctx)
        got, drafted, accepted = [], 0, 0
        for step in generate_steps(ctx, method, prompt, max_tokens=tokens, runner="pipelined"):
            got += step.tokens
            drafted, accepted = step.stats.drafted, step.stats.accepted
        checks.append(
            Agreement(
                name,
                len(reference),
                prefix_agreement(reference, got),
                first_mismatch(reference, got),
                drafted,
                accepted,
                exact,
            )
        )
        echo(checks[-1].line())
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
    pipeline_tokens: int = PIPELINE_TOKENS,
) -> bool:
    """Print the doctor's report for the loaded model ``lm`` (see the module
    doc) through ``echo``, one line per call.

    Args:
        lm: the loaded model (:func:`mlx_mtp.loading.load_model`).
        max_size: largest forward pass (slots) of the cost curve.
        repeats: timed rounds per size of the cost curve (after one warm-up).
        sizes: tree sizes of the self-check.
        progress: a progress bar (stderr) while the cost curve is measured.
        pipeline_tokens: tokens decoded with pipelined steps and plainly
            (:func:`pipeline_check`); 0 checks the pipelined passes on the
            tiny model only.

    Returns:
        True when every check passed.
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
    checks: list[Any] = list(self_check(engine, context, sizes, echo=echo))
    checks += pipeline_check(lm, pipeline_tokens, echo=echo)
    failed = [c for c in checks if not c.ok]
    echo(
        f"{'result':{LABEL}s}"
        + (
            f"all {len(checks)} checks passed"
            if not failed
            else f"{len(failed)} of {len(checks)} checks FAILED: multi-token forward passes "
            "disagree with one-token decoding, or pipelined steps with plain decoding, on this "
            "device; please report this output"
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
        pipeline_tokens: int = typer.Option(
            PIPELINE_TOKENS,
            "--pipeline-tokens",
            min=0,
            max=4096,
            help="Tokens decoded with pipelined steps against plain decoding (0: none).",
        ),
    ):
        """Print this machine's MLX set-up, the model's cost curve and numerical
        self-checks of the draft-tree forward pass and of the pipelined steps
        (the first thing to run on a Mac)."""
        from ..loading import load_model

        typer.echo(f"loading {model} ...", err=True)
        lm = load_model(model, dtype=dtype)
        ok = run_doctor(
            lm,
            max_size=max_size,
            repeats=repeats,
            echo=typer.echo,
            progress=True,
            pipeline_tokens=pipeline_tokens,
        )
        if not ok:
            sys.exit(1)
