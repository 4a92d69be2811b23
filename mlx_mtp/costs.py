"""This device's forward cost curves: measured, cached, refined online.

:mod:`mlx_mtp.budget` plans with a relative cost curve ``c(n)``; this module
finds it for the model and device at hand. Read top to bottom:

1. :func:`measure_cost_curve` times the engine's own tree forward pass at
   chosen sizes, each against a one-slot pass just before it (so that a
   load change or one slow pass shifts no size), keeps medians and fits a
   non-decreasing curve to them; the cache, its tokens and
   the engine's statistics are left as they were
   (:meth:`Engine.scratch <mlx_mtp.engine.Engine.scratch>`).
   :func:`measure_cost_curves` also measures at 1024 more tokens of context.
2. :func:`device_curves`: the curves of this (model, device, dtype), shared by
   every engine of that model in the process: ``$MLX_MTP_COST_CURVE`` if set
   (pinned: a simulated device), else the cached file in
   ``$MLX_MTP_HOME/cost_curves`` (a corrupt file is ignored with a warning,
   a file of another model, device or dtype is never read), else a short
   warm-up (one timed round at every size, the current context only: a few
   seconds where the full measurement took a minute).
3. :class:`LiveCurves`: the curves refined from the passes generations
   actually run. Each draft step is a measurement at its slot count, each
   one-token step one at a single slot; a per-size correction factor
   follows the ratio of measured to predicted time (exponential averages),
   so the curve also follows the machine's load. What was learned is cached
   again when a generation ends.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
from mlx_lm.utils import does_model_support_input_embeddings
from tqdm import tqdm

from . import distributed
from .artifacts import artifact_dir, atomic_write_text
from .budget import CostCurve, CostCurves, as_curves, parse_curve
from .cache_view import install_positional_rope
from .errors import UnsupportedModelError
from .fingerprint import model_fingerprint, token_embedding

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("mlx_mtp")

#: forward sizes (slots) the curve is measured at: every size up to 16 (where
#: Metal's quantized matmul switches from its vector to its matrix kernel on
#: M1/M2), then both sides of its 32-row tiles (33 rows cost about twice 32)
CURVE_SIZES = (*range(1, 17), 24, 32, 33, 40, 48, 64)
#: timing rounds per size of a full measurement (after one warm-up round)
CURVE_REPEATS = 3
#: timing rounds of the warm-up of a first ``auto`` run
WARMUP_REPEATS = 1
#: version of the cache file layout (3: the one-slot time and the learned curve;
#: 4: keys with quantization and MLX version, dense sizes)
CURVE_FORMAT = 4
#: tokens added to the cache for the second, long-context curve
LONG_CONTEXT_EXTRA = 1024
#: weight of a new measurement in the online averages
LEARNING_RATE = 0.2


# ------------------------------------------------------------------ measuring
def measure_cost_curve(
    engine: Engine,
    sizes: Sequence[int] = CURVE_SIZES,
    repeats: int = CURVE_REPEATS,
    progress: bool = False,
) -> CostCurve:
    """Time the engine's tree forward pass (a chain of ``n`` slots, logits for
    every slot, as a chain-verifying method runs it) at each size in
    ``sizes``, over ``repeats`` rounds after one warm-up round, and return
    ``c(n)``: the median over rounds of the time of ``n`` slots relative to
    a one-slot pass timed just before it (a change of load between sizes,
    or one slow one-slot pass, shifts no size), made non-decreasing by
    :func:`monotone`; ``seconds`` is the median one-slot time.

    Runs on the current cache, which is left exactly as it was; the timing
    passes are not counted in the engine's forward statistics. On a hybrid
    recurrent model the passes are causal chains (what its verify passes
    are), rolled back after each (:mod:`mlx_mtp.recurrent`). Sizes the cache
    cannot drop afterwards (a nearly full sliding window) or that do not fit
    in memory are left out.

    Returns:
        The :class:`~mlx_mtp.budget.CostCurve` (at least the size 1).

    Raises:
        UnsupportedModelError: the model has no llama-style layout.
    """
    if engine.backbone is None:
        raise UnsupportedModelError("a cost curve needs a model with the llama-style layout")
    engine.settle()
    cap = engine.max_slots(engine.offset)
    # hybrid recurrent models: causal chains, dropped again through the rollback
    recurrent = engine.rollback is not None
    sizes = [
        s for s in sorted({1, *map(int, sizes)}) if s <= cap and engine.trimmable(s, recurrent)
    ]
    if 1 not in sizes:
        return CostCurve([1], [1.0])
    tok = engine.cached[-1] if engine.cached else 0
    start = engine.offset
    tree = False
    # a recurrent model's verify passes are chains; so are those of a model that
    # takes no input embeddings (deepseek_v3: chain methods only) and of one
    # whose gated MTP adapter reads the mask positions from token ids
    emb = getattr(getattr(engine.model, "model", None), "embed_tokens", None)
    gated = getattr(emb, "gate", None) is not None
    if not recurrent and not gated and does_model_support_input_embeddings(engine.model):
        try:
            install_positional_rope(engine.model)
            tree = True
        except AttributeError:  # no per-token RoPE: time the causal chain forward
            pass

    def timed(m: int) -> float:
        parents = np.arange(-1, m - 1, dtype=np.int64)
        emb = engine.embed_tokens([tok] * m)
        mx.eval(emb)
        t0 = time.perf_counter()
        if tree:
            engine.forward_tree(emb, parents, [tok] * m)
        else:
            engine.forward_chain([tok] * m, droppable=recurrent)
        dt = time.perf_counter() - t0
        engine.trim_to(start)
        return dt

    ones: list[float] = []
    ratios: dict[int, list[float]] = {s: [] for s in sizes[1:]}
    rounds: Any = range(repeats + 1)
    if progress:
        rounds = tqdm(
            rounds,
            desc=f"timing forward passes at {start} tokens of context (once per model, device)",
            unit="round",
            leave=False,
        )
    with engine.scratch():
        for r in rounds:
            if r == 0:  # round 0 warms up every size
                for s in sizes:
                    timed(s)
                continue
            for s in sizes[1:] or [1]:
                one = timed(1)  # each size is timed against a one-slot pass just before it
                ones.append(one)
                if s > 1:
                    ratios[s].append(timed(s) / one)
    t1 = float(np.median(ones))
    costs = monotone([1.0, *(float(np.median(ratios[s])) for s in sizes[1:])])
    return CostCurve(sizes, costs, context=start, seconds=t1, measured=True)


def monotone(costs: Sequence[float]) -> list[float]:
    """The non-decreasing sequence nearest to ``costs`` in least squares, at
    least 1 (pool-adjacent-violators, Ayer et al. 1955): one size timed high
    by noise is averaged with its neighbours instead of raising every larger
    size to its value (what flattening by a running maximum would do)."""
    blocks: list[list[float]] = []  # [sum, count] of each pooled run
    for c in costs:
        blocks.append([float(c), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    out: list[float] = []
    for total, count in blocks:
        out.extend([max(total / count, 1.0)] * int(count))
    return out


def measure_cost_curves(
    engine: Engine, repeats: int = CURVE_REPEATS, progress: bool = False
) -> CostCurves:
    """The cost curve at the current context and at ``LONG_CONTEXT_EXTRA``
    more tokens, both with :func:`measure_cost_curve`.

    For the second curve the cache is extended by a run of copies of its last
    token (attention costs the same whatever the tokens) and trimmed back
    afterwards. Only the first curve is measured where the cache cannot take
    and drop that many tokens (a sliding window, a hybrid recurrent model, a
    model without input embeddings, too little memory).
    """
    short = measure_cost_curve(engine, repeats=repeats, progress=progress)
    start = engine.offset
    extra = LONG_CONTEXT_EXTRA
    top = max(short.sizes)
    if (  # (measure_cost_curve has refused a model without the llama layout)
        engine.rollback is not None
        or not does_model_support_input_embeddings(engine.model)
        or not engine.trimmable(extra + top)
        or engine.max_slots(start + extra) < top
    ):
        return CostCurves([short])
    tok = engine.cached[-1] if engine.cached else 0
    with engine.scratch():
        engine.sync([*engine.cached, *([tok] * extra)])
        long = measure_cost_curve(engine, sizes=short.sizes, repeats=repeats, progress=progress)
    return CostCurves([short, long])


# ------------------------------------------------------------------ caching
def device_name() -> str:
    """The device MLX computes on, e.g. ``gpu:Apple M2 Pro`` or
    ``cpu:x86_64:AMD EPYC 7B13:2cpu:blas1`` (the CPU model, the cores, and
    ``OPENBLAS_NUM_THREADS`` where set, which all change the curve)."""
    dev = mx.default_device()
    kind = "gpu" if dev.type == mx.gpu else "cpu"
    name = ""
    try:
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        name = str(info.get("device_name", "") or info.get("architecture", ""))
    except Exception:  # no Metal/CUDA device: the CPU backend
        pass
    if kind == "cpu" or not name:
        cpu = platform.processor() or ""
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        name = f"{platform.machine()}:{cpu}:{os.cpu_count()}cpu"
        if os.environ.get("OPENBLAS_NUM_THREADS"):
            name += f":blas{os.environ['OPENBLAS_NUM_THREADS']}"
    return f"{kind}:{name}"


def quantization(model: Any) -> str:
    """The weight quantization of a model's layers, which chooses the
    device's matmul kernels: ``"none"``, or e.g. ``"affine-4b-g64"`` (mode,
    bits, group size; several joined by ``+`` when layers differ)."""
    kinds = set()
    for _, m in model.named_modules():
        if hasattr(m, "bits") and hasattr(m, "group_size"):
            mode = getattr(m, "mode", "affine")
            kinds.add(f"{mode}-{m.bits}b-g{m.group_size}")
    return "+".join(sorted(kinds)) or "none"


def curve_key(engine: Engine) -> dict[str, str]:
    """What a cached curve must match: the model's architecture and fingerprint
    (two architectures can share a fingerprint: tiny test models built from one
    seed), its weight quantization, the dtype it computes in, the device
    (with the BLAS threads on a CPU) and the MLX version (kernels change
    between releases)."""
    emb = token_embedding(engine.model)
    dtype = str(emb(mx.array([0])).dtype).replace("mlx.core.", "")
    arch = getattr(getattr(engine.model, "args", None), "model_type", None)
    model = model_fingerprint(engine.model)
    return {
        "model": f"{arch}-{model}" if arch else model,
        "quantization": quantization(engine.model),
        "device": device_name(),
        "dtype": dtype,
        "mlx": mx.__version__,
    }


def curve_path(key: dict[str, str], home: Path | None = None) -> Path:
    """``$MLX_MTP_HOME/cost_curves/<model>-<dtype>-<hash of the rest of the key>.json``."""
    rest = json.dumps({k: v for k, v in key.items() if k not in ("model", "dtype")}, sort_keys=True)
    h = hashlib.sha256(rest.encode()).hexdigest()[:10]
    return artifact_dir("cost_curves", home) / f"{key['model']}-{key['dtype']}-{h}.json"


def load_curve(key: dict[str, str], home: Path | None = None) -> CostCurves | None:
    """The cached curves for ``key``, or None: no file, another key or an
    older layout in it, or a corrupt file (ignored with a warning, and
    measured again)."""
    path = curve_path(key, home)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("format") != CURVE_FORMAT or data.get("key") != key:
            return None
        return CostCurves(
            [
                CostCurve(
                    c["sizes"],
                    c["costs"],
                    context=c["context"],
                    seconds=c.get("seconds"),
                    measured=True,
                )
                for c in data["curves"]
            ]
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        warnings.warn(
            f"ignoring the corrupt cost-curve cache {path} ({type(e).__name__}: {e}); the "
            "curve is measured again and the file rewritten.",
            stacklevel=2,
        )
        return None


def save_curve(
    key: dict[str, str], curve: CostCurve | CostCurves, home: Path | None = None
) -> Path:
    """Write the curve(s) atomically (:func:`~mlx_mtp.artifacts.atomic_write_text`):
    a reader never sees half a file."""
    path = curve_path(key, home)
    curves = as_curves(curve).to_list()
    data = {"format": CURVE_FORMAT, "key": key, "curves": curves, "measured": time.time()}
    atomic_write_text(path, json.dumps(data, indent=1))
    return path


# ------------------------------------------------------------------ online
class LiveCurves:
    """Cost curves refined from the generation's own forward passes.

    ``c(n)`` at context ``L`` is the base curves' ``c_L(n)`` times a
    correction ``k(n)``, linear between the base's sizes (``k(1) = 1``).
    :meth:`observe` takes a pass of ``n`` slots that took ``seconds``: one
    slot updates the one-slot time ``t1`` (an exponential average); more
    update ``k`` at the two sizes around ``n`` towards
    ``seconds / (t1 c_L(n))``, in proportion to the interpolation weights,
    and move every smaller size priced above ``seconds / t1`` towards it
    (``c`` never falls with more slots, so a wide pass bounds the narrower
    ones: a size the cut avoids because one timing priced it high is still
    corrected).

    Args:
        base: the measured or cached curves.
        key: the cache key to save to (None: not saved).
        learn: refine online (False: the base curves as they are).
    """

    def __init__(self, base: CostCurves, key: dict[str, str] | None = None, learn: bool = True):
        self.base, self.key, self.learn = base, key, learn
        first = base.curves[0]
        self.sizes = list(first.sizes)
        self.k = np.ones(len(self.sizes))
        self.t1 = first.seconds
        self.changed = False
        self._at: dict[int, tuple[int, CostCurve]] = {}
        self.version = 0

    def at(self, context: int) -> CostCurve:
        """The refined curve for a cache of ``context`` tokens."""
        bucket = max(int(context), 0) // CostCurves.BUCKET
        hit = self._at.get(bucket)
        if hit is None or hit[0] != self.version:
            base = self.base.at(context)
            costs = [base(s) * float(f) for s, f in zip(self.sizes, self.k)]
            curve = CostCurve(
                self.sizes, costs, context=base.context, seconds=self.t1, measured=base.measured
            )
            hit = self._at[bucket] = (self.version, curve)
        return hit[1]

    def observe(self, slots: int, seconds: float, context: int) -> None:
        """One forward pass of ``slots`` slots that took ``seconds`` after
        ``context`` cached tokens (a one-token step: its pipelined time)."""
        if not self.learn or seconds <= 0 or slots < 1:
            return
        lr = LEARNING_RATE
        if slots == 1:
            self.t1 = seconds if self.t1 is None else (1 - lr) * self.t1 + lr * seconds
            return
        if self.t1 is None or slots > self.sizes[-1]:
            return
        base = self.base.at(context)(slots)
        ratio = seconds / (self.t1 * base)
        i = int(np.searchsorted(self.sizes, slots))
        if self.sizes[i] == slots:
            w = {i: 1.0}
        else:
            a, b = self.sizes[i - 1], self.sizes[i]
            wb = (slots - a) / (b - a)
            w = {i - 1: 1.0 - wb, i: wb}
        k_now = sum(self.k[j] * wj for j, wj in w.items())
        err = ratio - k_now
        for j, wj in w.items():
            if j > 0:  # k(1) stays 1
                self.k[j] = max(self.k[j] + lr * wj * err, 1e-3)
        # c never falls with more slots, so this pass also bounds every smaller
        # size: one priced above it moves down towards it (a high warm-up
        # timing at a size the cut then avoids is corrected by wider passes)
        cost = seconds / self.t1
        at = self.base.at(context)
        for j in range(1, i if self.sizes[i] == slots else i - 1):
            b = at(self.sizes[j])
            if b * self.k[j] > cost:
                self.k[j] = max(self.k[j] + lr * (cost / b - self.k[j]), 1e-3)
        self.version += 1  # (CostCurve flattens a refined curve that would fall)
        self.changed = True

    def curves(self) -> CostCurves:
        """The learned curves (every base curve times the correction)."""
        out = []
        for c in self.base.curves:
            costs = [c(s) * float(f) for s, f in zip(self.sizes, self.k)]
            curve = CostCurve(
                self.sizes, costs, context=c.context, seconds=self.t1, measured=c.measured
            )
            out.append(curve)
        return CostCurves(out)

    def save(self) -> None:
        """Cache what was learned (nothing when nothing changed or no key). An
        unwritable cache (a read-only ``$MLX_MTP_HOME``) is said once, in one
        line on the ``mlx_mtp`` logger (stderr unless logging is set up); the
        curve stays in this process (:data:`_LIVE`)."""
        if not self.changed or self.key is None or not distributed.is_main():
            return
        self.changed = False
        try:
            save_curve(self.key, self.curves())
        except OSError as e:
            if not getattr(self, "_warned", False):
                self._warned = True
                log.warning(
                    "mlx-mtp: cannot cache the cost curve in %s (%s); it is kept for this "
                    "process only and timed again by the next one. Set MLX_MTP_HOME to a "
                    "writable folder to keep it, or pin one with MLX_MTP_COST_CURVE.",
                    curve_path(self.key).parent,
                    getattr(e, "strerror", None) or e,
                )


#: the curves of every (model, device, dtype) key met in this process
_LIVE: dict[str, LiveCurves] = {}
#: held while :func:`device_curves` reads or fills :data:`_LIVE`
_LIVE_LOCK = threading.RLock()


def device_curves(engine: Engine, measure: bool = True) -> LiveCurves:
    """This device's forward cost curves for the engine's model (see the
    module doc): the curve the engine's clock defines (a simulated device,
    :meth:`~mlx_mtp.timing.DeviceClock.known_curve`), else ``$MLX_MTP_COST_CURVE`` (pinned, not
    refined), else shared
    per (model, device, dtype) in this process, else the cached file, else a
    warm-up measurement (cached). ``MLX_MTP_REMEASURE_COST=1`` ignores the
    cached file. On a model sharded over several ranks every rank gets rank
    0's curves (:func:`mlx_mtp.distributed.agree`) and they are not refined
    (every rank must draft the same). With ``measure=False`` and nothing
    cached: ``CostCurve.linear(1.0)`` (a slot costs a whole forward).

    One thread at a time (:data:`_LIVE_LOCK`): a thread that finds no curve
    measures it alone, and the threads after it get the same one.

    Raises:
        InvalidArgumentError: a malformed ``MLX_MTP_COST_CURVE``.
    """
    with _LIVE_LOCK:
        return _device_curves(engine, measure)


def _device_curves(engine: Engine, measure: bool) -> LiveCurves:
    # device_curves under its lock
    known = engine.clock.known_curve()
    if known is not None:  # the planner runs on the simulated device's own curve
        return LiveCurves(CostCurves([known]), learn=False)
    spec = os.environ.get("MLX_MTP_COST_CURVE")
    if spec:
        return LiveCurves(CostCurves([parse_curve(spec)]), learn=False)
    key = curve_key(engine)
    name = json.dumps(key, sort_keys=True)
    live = _LIVE.get(name)
    if live is not None:
        return live
    curves = None
    if os.environ.get("MLX_MTP_REMEASURE_COST") != "1":
        curves = load_curve(key)
    # sharded over several ranks (mlx.launch): rank 0's cached curves, or curves
    # that every rank measures together (the timing passes are collective) and
    # takes from rank 0, so that all ranks build the same drafts
    curves = distributed.agree(curves)
    fresh = curves is None
    if fresh:
        if not measure:
            return LiveCurves(CostCurves([CostCurve.linear(1.0)]), learn=False)
        # the first auto run on a device: a second on Metal, a few on a CPU
        warm = measure_cost_curve(engine, repeats=WARMUP_REPEATS, progress=distributed.is_main())
        curves = distributed.agree(CostCurves([warm]))
    live = _LIVE[name] = LiveCurves(curves, key, learn=distributed.group() is None)
    if fresh:
        live.changed = True
        live.save()
    return live


def forget_device_curves() -> None:
    """Drop the curves kept in this process (the next :func:`device_curves`
    reads the cache or measures again)."""
    _LIVE.clear()
