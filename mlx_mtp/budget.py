"""A device-aware draft budget: the forward cost curve and the policy that uses it.

Speculative methods pay for their drafts in forward time: a pass over ``n``
slots (tokens and mask vectors) costs ``c(n)`` one-token forwards. On a
memory-bound GPU ``c`` is nearly flat up to a knee (a 30-slot tree costs little
more than one token); on a CPU it rises from the second slot (this machine,
SmolLM2-135M float32: ``c(2) = 1.24``, ``c(16) = 1.88``). The same draft size
can therefore be a win on one device and a loss on another (DESIGN §6, class
11). Read top to bottom:

1. :class:`CostCurve`: ``c(n)`` at a few measured sizes, linear in between and
   beyond the last one. :func:`measure_cost_curve` times the engine's own tree
   forward pass at chosen sizes, interleaved (size 1, 2, 4, ... then again),
   and takes medians, so a load change on the machine hits every size alike.
2. :func:`cost_curves`: measured once per (model fingerprint, device, dtype)
   at two context lengths, the current one and 1024 tokens more
   (:class:`CostCurves`: every draft slot attends over the whole cache, so a
   slot costs more on a long prompt), kept on the engine and cached as JSON
   in ``$MLX_MTP_HOME/cost_curves`` so the next run starts calibrated. A
   corrupt file is ignored with a warning; a file of another model, device
   or dtype is never read. Each draft step plans with the curve at the
   cache's current length (:meth:`Budget.at`).
3. The policy (not from a paper; the classic speculative-decoding objective of
   Leviathan et al. 2023, §3.4, expected tokens per unit of time, with a
   measured cost instead of a constant ratio): a draft whose items (nodes,
   mask sets, chain tokens) are offered best first, each with its expected
   accepted tokens, is cut at the prefix that maximises
   ``(1 + expected accepted) / c(slots)`` (:func:`best_prefix`). If no prefix
   beats a one-token step (rate 1), the step drafts nothing.
4. :class:`Budget`: after a step that drafts nothing the method stays in
   *plain mode*, pipelined one-token steps exactly as ``ntp`` runs them
   (:class:`PlainSteps`), for an interval sized so that the next *re-probe*
   (a cheap draft step that refreshes the acceptance estimates) costs at most
   ``REPROBE_OVERHEAD`` of the time (e.g. every 33 steps for a 3-slot
   re-probe at ``c(3) = 1.33``). A re-probe whose whole draft is accepted
   resets the acceptance estimates to their prior, so a repetitive stretch
   is still caught.
5. :class:`DepthAcceptance`: per-depth conditional acceptance rates of a chain
   source, Beta-smoothed and decayed so that recent steps dominate.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import platform
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
from mlx_lm.utils import does_model_support_input_embeddings
from tqdm import tqdm

from . import distributed
from .cache_view import install_positional_rope
from .errors import InvalidArgumentError, UnsupportedModelError
from .fingerprint import model_fingerprint
from .loading import cache_home

if TYPE_CHECKING:
    from .engine import Engine
    from .methods.base import StepOutput
    from .verify import Sampler

#: forward sizes (slots) the curve is measured at
CURVE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
#: timing rounds per size (after one warm-up round); the median is kept
CURVE_REPEATS = 3
#: version of the cache file layout (2: one curve per measured context length)
CURVE_FORMAT = 2
#: tokens added to the cache for the second, long-context curve
LONG_CONTEXT_EXTRA = 1024
#: how far beyond the longest measured context a curve is extrapolated, in
#: multiples of the measured span (longer contexts use the limit)
MAX_EXTRAPOLATION = 4.0
#: share of decode time the periodic re-probes may cost
REPROBE_OVERHEAD = 0.01
#: bounds of the plain-mode interval (steps)
MIN_PLAIN_STEPS, MAX_PLAIN_STEPS = 4, 64


class CostCurve:
    """Relative cost ``c(n)`` of a forward pass of ``n`` slots (1.0 = one token).

    Args:
        sizes: increasing slot counts, the first one 1.
        costs: the relative cost at each size (``costs[0]`` is 1.0); a
            decreasing measurement (timing noise) is flattened so that ``c``
            never decreases.
        context: tokens in the cache when it was measured (None: not known,
            or the same at every context).

    ``c(n)`` is linear between measured sizes and extends the last segment's
    slope beyond the largest one; ``c(n) = 1`` for ``n <= 1``.

    Raises:
        ValueError: sizes not increasing from 1, or lengths differ.
    """

    def __init__(self, sizes: Sequence[int], costs: Sequence[float], context: int | None = None):
        sizes = [int(s) for s in sizes]
        costs = [float(c) for c in costs]
        if len(sizes) != len(costs) or not sizes or sizes[0] != 1:
            raise ValueError("a cost curve needs sizes starting at 1 and one cost per size")
        if any(b <= a for a, b in zip(sizes, sizes[1:])):
            raise ValueError(f"cost curve sizes must increase, got {sizes}")
        mono = [1.0]
        for c in costs[1:]:
            mono.append(max(mono[-1], c if math.isfinite(c) else mono[-1]))
        self.sizes, self.costs, self.context = sizes, mono, context
        self._least: dict[int, list[float]] = {}

    @classmethod
    def flat(cls, knee: int = 16, slope: float = 0.01, upto: int = 256) -> CostCurve:
        """A memory-bound device: ``c(n) = 1`` up to ``knee`` slots, then rising
        by ``slope`` per slot (a simulated GPU, for tests and planning)."""
        sizes = [1, knee, upto]
        return cls(sizes, [1.0, 1.0, 1.0 + slope * (upto - knee)])

    @classmethod
    def linear(cls, slot_cost: float, upto: int = 256) -> CostCurve:
        """``c(n) = 1 + slot_cost * (n - 1)``: one marginal cost per slot, the
        model behind :meth:`Engine.slot_cost`."""
        return cls([1, upto], [1.0, 1.0 + slot_cost * (upto - 1)])

    def __call__(self, n: float) -> float:
        if n <= 1:
            return 1.0
        s, c = self.sizes, self.costs
        if len(s) == 1:
            return 1.0
        i = bisect.bisect_left(s, n)  # on the list: called per draft item, every step
        if i >= len(s):
            i = len(s) - 1
        a, b = i - 1, i
        return c[a] + (c[b] - c[a]) * (n - s[a]) / (s[b] - s[a])

    def least_slopes(self, max_slots: int) -> list[float]:
        """``m[s]``, the least average slope ``(c(t) - c(s)) / (t - s)`` over
        ``s < t <= max_slots``, for ``s = 1 .. max_slots`` (index by slots;
        0 at ``max_slots``), computed once per curve and size."""
        hit = self._least.get(max_slots)
        if hit is None:
            n = np.arange(1, max_slots + 1)
            c = np.array([self(int(x)) for x in n])
            dc = c[None, :] - c[:, None]
            dn = (n[None, :] - n[:, None]).astype(float)
            with np.errstate(divide="ignore", invalid="ignore"):
                avg = np.where(dn > 0, dc / np.where(dn > 0, dn, 1.0), np.inf)
            least = np.maximum(avg.min(axis=1), 0.0)
            hit = self._least[max_slots] = [0.0, *least.tolist()]
        return hit

    def slot_cost(self, n: int = 32) -> float:
        """Mean marginal cost of a slot up to ``n``: ``(c(n) - 1) / (n - 1)``."""
        return (self(n) - 1.0) / (n - 1) if n > 1 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "context": self.context,
            "sizes": self.sizes,
            "costs": [round(c, 4) for c in self.costs],
        }

    def __repr__(self) -> str:
        pts = ", ".join(f"{s}:{c:.2f}" for s, c in zip(self.sizes, self.costs))
        return f"CostCurve({pts})"


class CostCurves:
    """The forward cost curve as a function of the context length.

    Every slot of a draft attends over the whole cache, so the marginal cost
    of a slot grows with the context while a one-token step's grows less
    (this machine, SmolLM2-135M float32, one core: ``c(16) = 1.61`` at 64
    tokens of context, ``1.93`` at 1,536; ``c(32)`` 2.36 and 3.27). A budget
    planned with a short-context curve overspends on long prompts (RAG).

    Args:
        curves: curves measured at different ``context`` lengths (a curve
            without a context counts as context 0). One curve: the same cost
            at every context.

    :meth:`at` interpolates the costs linearly in the context length between
    the two nearest measured curves (at the first curve's sizes), is constant
    below the shortest, extrapolates linearly beyond the longest up to
    ``MAX_EXTRAPOLATION`` times the measured span, and never lets ``c(n)``
    exceed ``n`` there. Results are kept per 64-token bucket.

    Raises:
        ValueError: no curve.
    """

    BUCKET = 64

    def __init__(self, curves: Sequence[CostCurve]):
        if not curves:
            raise ValueError("CostCurves needs at least one curve")
        self.curves = sorted(curves, key=lambda c: c.context or 0)
        self._at: dict[int, CostCurve] = {}

    def at(self, context: int) -> CostCurve:
        """The curve for a cache of ``context`` tokens."""
        if len(self.curves) == 1:
            return self.curves[0]
        bucket = max(int(context), 0) // self.BUCKET
        hit = self._at.get(bucket)
        if hit is None:
            hit = self._at[bucket] = self._interpolate(bucket * self.BUCKET)
        return hit

    def _interpolate(self, context: int) -> CostCurve:
        cs = self.curves
        ctx = [c.context or 0 for c in cs]
        if context <= ctx[0]:
            return cs[0]
        i = min(int(np.searchsorted(ctx, context)), len(cs) - 1)
        lo, hi = cs[i - 1], cs[i]
        span = max(ctx[i] - ctx[i - 1], 1)
        w = min((context - ctx[i - 1]) / span, MAX_EXTRAPOLATION)
        costs = [lo(n) + w * (hi(n) - lo(n)) for n in lo.sizes]
        if w > 1.0:  # extrapolated: never above n one-token passes
            costs = [min(c, float(n)) for c, n in zip(costs, lo.sizes)]
        return CostCurve(lo.sizes, costs, context=context)

    def to_list(self) -> list[dict[str, Any]]:
        return [c.to_dict() for c in self.curves]

    def __repr__(self) -> str:
        return "CostCurves(" + "; ".join(f"{c.context}: {c!r}" for c in self.curves) + ")"


def as_curves(curve: CostCurve | CostCurves) -> CostCurves:
    """A :class:`CostCurves` (a single curve: the same at every context)."""
    return curve if isinstance(curve, CostCurves) else CostCurves([curve])


# ------------------------------------------------------------------ measuring
def measure_cost_curve(
    engine: Engine,
    sizes: Sequence[int] = CURVE_SIZES,
    repeats: int = CURVE_REPEATS,
    progress: bool = False,
) -> CostCurve:
    """Time the engine's tree forward pass (a chain of ``n`` slots, logits for
    every slot, as a chain-verifying method runs it) at each size in
    ``sizes``, interleaved over ``repeats`` rounds after one warm-up round,
    and return the medians relative to one slot.

    Runs on the current cache, which is left exactly as it was; the timing
    passes are not counted in the engine's forward statistics. On a hybrid
    recurrent model the passes are causal chains (what its verify passes are)
    and the recurrent state is rolled back after each (:mod:`mlx_mtp.recurrent`). Sizes the
    cache cannot drop afterwards (a nearly full sliding window) or that do not
    fit in memory are left out.

    Returns:
        The :class:`CostCurve` (at least the size 1).

    Raises:
        UnsupportedModelError: the model has no llama-style layout.
    """
    if engine.backbone is None:
        raise UnsupportedModelError("a cost curve needs a model with the llama-style layout")
    engine._settle()
    cap = engine.max_slots(engine.offset)
    # hybrid recurrent models: causal chains, dropped again through the rollback
    recurrent = engine.rollback is not None
    sizes = [
        s
        for s in sorted({1, *map(int, sizes)})
        if s <= cap and engine.trimmable(s, chain=recurrent)
    ]
    if 1 not in sizes:
        return CostCurve([1], [1.0])
    saved = (engine.forward_passes, engine.forward_slots, engine.forward_seconds)
    tok = engine.cached[-1] if engine.cached else 0
    start = engine.offset

    tree = False
    # a recurrent model's verify passes are chains; so are those of a model that
    # takes no input embeddings (deepseek_v3: chain methods only)
    if not recurrent and does_model_support_input_embeddings(engine.model):
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

    times: dict[int, list[float]] = {s: [] for s in sizes}
    rounds = range(repeats + 1)
    if progress:
        rounds = tqdm(
            rounds,
            desc=f"timing forward passes at {start} tokens of context (once per model, device)",
            unit="round",
            leave=False,
        )
    try:
        for r in rounds:
            for s in sizes:
                dt = timed(s)
                if r > 0:  # round 0 warms up every size
                    times[s].append(dt)
    finally:
        engine.forward_passes, engine.forward_slots, engine.forward_seconds = saved
        if engine.offset > start:
            engine.trim_to(start)
    t1 = float(np.median(times[1]))
    return CostCurve(sizes, [float(np.median(times[s])) / t1 for s in sizes], context=start)


def measure_cost_curves(engine: Engine, progress: bool = False) -> CostCurves:
    """The cost curve at the current context and at ``LONG_CONTEXT_EXTRA``
    more tokens (:class:`CostCurves`), both with :func:`measure_cost_curve`.

    For the second curve the cache is extended by a run of copies of its last
    token (attention costs the same whatever the tokens) and trimmed back
    afterwards: the cache, its tokens and the engine's statistics are left
    as they were. Only the first curve is measured where the cache cannot
    take and drop that many tokens (a sliding window, a hybrid recurrent
    model, a model without input embeddings, too little memory).
    """
    short = measure_cost_curve(engine, progress=progress)
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
    saved = (engine.forward_passes, engine.forward_slots, engine.forward_seconds)
    last_prefill = getattr(engine, "last_prefill", None)
    try:
        engine.sync([*engine.cached, *([tok] * extra)])
        long = measure_cost_curve(engine, sizes=short.sizes, progress=progress)
    finally:
        engine.trim_to(start)
        engine.forward_passes, engine.forward_slots, engine.forward_seconds = saved
        if last_prefill is not None:
            engine.last_prefill = last_prefill
    return CostCurves([short, long])


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


def curve_key(engine: Engine) -> dict[str, str]:
    """What a cached curve must match: the model's architecture and fingerprint
    (two architectures can share a fingerprint: tiny test models built from one
    seed), the device and the dtype the model computes in."""
    dtype = str(engine.embed_tokens([0]).dtype).replace("mlx.core.", "")
    arch = getattr(getattr(engine.model, "args", None), "model_type", None)
    model = model_fingerprint(engine.model)
    return {"model": f"{arch}-{model}" if arch else model, "device": device_name(), "dtype": dtype}


def curve_path(key: dict[str, str], home: Path | None = None) -> Path:
    """``$MLX_MTP_HOME/cost_curves/<model>-<dtype>-<hash of device>.json``."""
    dev = hashlib.sha256(key["device"].encode()).hexdigest()[:10]
    return (home or cache_home()) / "cost_curves" / f"{key['model']}-{key['dtype']}-{dev}.json"


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
            [CostCurve(c["sizes"], c["costs"], context=c["context"]) for c in data["curves"]]
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
    """Write the curve(s) atomically (a temporary file in the same folder, then
    ``os.replace``): a reader never sees half a file."""
    path = curve_path(key, home)
    path.parent.mkdir(parents=True, exist_ok=True)
    curves = as_curves(curve).to_list()
    data = {"format": CURVE_FORMAT, "key": key, "curves": curves, "measured": time.time()}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def parse_curve(spec: str) -> CostCurve:
    """``"1:1,16:1,64:1.2"`` (slots:relative cost pairs) -> :class:`CostCurve`.

    Raises:
        InvalidArgumentError: not such a list, or sizes not increasing from 1.
    """
    try:
        pairs = [p.split(":") for p in spec.replace(" ", "").split(",") if p]
        return CostCurve([int(n) for n, _ in pairs], [float(c) for _, c in pairs])
    except ValueError as e:
        raise InvalidArgumentError(
            f"MLX_MTP_COST_CURVE={spec!r} is not a cost curve: give slots:cost pairs with "
            f"increasing slots from 1, e.g. '1:1,16:1,64:1.2' ({e})."
        ) from None


def cost_curves(engine: Engine, measure: bool = True) -> CostCurves:
    """The engine's forward cost curves by context length: set on the engine
    (``engine.curve``, a :class:`CostCurve` or :class:`CostCurves`, which a
    caller may also set to simulate a device), else given by
    ``$MLX_MTP_COST_CURVE`` (:func:`parse_curve`, one curve for every
    context; to pin a device's curve, or simulate another device), else read
    from the cache for this (model, device, dtype), else measured with
    :func:`measure_cost_curves` and cached.

    ``MLX_MTP_REMEASURE_COST=1`` ignores the cached file (measures again).
    On a model sharded over several ranks every rank gets rank 0's curves
    (:func:`mlx_mtp.distributed.agree`). With ``measure=False`` and nothing
    cached: ``CostCurve.linear(1.0)`` (a slot costs a whole forward).

    Raises:
        InvalidArgumentError: a malformed ``MLX_MTP_COST_CURVE``.
    """
    curve = getattr(engine, "curve", None)
    if curve is not None:
        return as_curves(curve)
    if os.environ.get("MLX_MTP_COST_CURVE"):
        engine.curve = parse_curve(os.environ["MLX_MTP_COST_CURVE"])
        return as_curves(engine.curve)

    key = curve_key(engine)
    curves = None
    if os.environ.get("MLX_MTP_REMEASURE_COST") != "1":
        curves = load_curve(key)
    # sharded over several ranks (mlx.launch): rank 0's cached curves, or curves
    # that every rank measures together (the timing passes are collective) and
    # takes from rank 0, so that all ranks build the same drafts
    curves = distributed.agree(curves)
    if curves is None:
        if not measure:
            return as_curves(CostCurve.linear(1.0))
        # the first auto run on a device: seconds on Metal, a minute or two on a CPU
        curves = distributed.agree(measure_cost_curves(engine, progress=distributed.is_main()))
        try:
            if distributed.is_main():
                save_curve(key, curves)
        except OSError as e:
            warnings.warn(
                f"could not cache the cost curve ({e}); it is kept for this run only.",
                stacklevel=2,
            )
    engine.curve = curves
    return curves


def cost_curve(engine: Engine, measure: bool = True) -> CostCurve:
    """The engine's forward cost curve at its current context length
    (:func:`cost_curves` ``.at(engine.offset)``; same sources and errors)."""
    return cost_curves(engine, measure).at(engine.offset)


# --------------------------------------------------------------------- policy
def best_prefix(
    curve: CostCurve,
    values: Sequence[float],
    slots: Sequence[int] | int,
    base_slots: int = 1,
    base_value: float = 0.0,
    item_cost: float = 0.0,
) -> tuple[int, float]:
    """The prefix of a best-first list of draft items that maximises expected
    tokens per unit of forward time.

    Args:
        curve: the device's forward cost.
        values: expected accepted tokens each item adds (nodes: their path
            acceptance probability; mask sets: their expected future tokens).
        slots: slots each item takes (one int for all, or one per item).
        base_slots: slots present anyway (the root, and the root's masks).
        base_value: expected accepted tokens of the base slots.
        item_cost: time each item costs besides its slots, in one-token
            forwards (a draft model's pass per drafted token: ``mtp``'s
            layer and LM head); 0 for drafts that cost nothing to make.

    Returns:
        ``(n, rate)``: items to keep (0 = none) and the rate
        ``(1 + base_value + sum(values[:n])) / (c(base_slots + slots[:n]) + n * item_cost)``.
    """
    p = PrefixBound(curve, None, base_slots, base_value, item_cost)
    for i, v in enumerate(values):
        p.add(v, slots if isinstance(slots, int) else slots[i])
    return p.best_n, p.best


def tree_size(
    curve: CostCurve, node_probs: Sequence[float], masks: int, scale: float = 1.0
) -> tuple[int, float]:
    """How many nodes of a best-first ESP draft tree to keep (``probe``'s
    ``bc=auto``): each node adds ``scale * P(node)`` expected accepted tokens
    (its path probability, calibrated by accepted / expected) and ``masks + 1``
    slots; the root and its masks take ``masks + 1`` slots anyway.

    Returns:
        ``(nodes, rate)`` as :func:`best_prefix`.
    """
    values = [p * scale for p in node_probs]
    return best_prefix(curve, values, masks + 1, base_slots=masks + 1)


class PrefixBound:
    """:func:`best_prefix` run online, with an early stop: while a best-first
    allocation takes items one by one, whether any longer prefix could still
    beat the best one so far.

    Not from a paper. The allocation's remaining items are worth at most ``u``
    expected tokens per slot (the caller's bound), and ``c`` rises at least as
    fast as ``m(s)``, its least average slope from ``s`` slots on (over whole
    slots up to ``max_slots``). Adding ``d`` slots to a prefix of value ``A``
    (1 + expected tokens) at ``s`` slots therefore yields at most
    ``(A + u d) / (c(s) + m(s) d)``, which is monotone in ``d``: it cannot
    beat the best rate when both ends (``d = 0`` and ``d = max_slots - s``)
    do not. Stopping there leaves :func:`best_prefix` of the items taken with
    the same answer as of all items (ties included).

    Args:
        curve: the device's forward cost.
        max_slots: the most slots a prefix may take (BC); needed only by
            :meth:`exhausted`.
        base_slots, base_value, item_cost: as :func:`best_prefix`.

    Attributes:
        best_n, best: the best prefix of the items added so far and its rate
            (what :func:`best_prefix` of them returns).
    """

    def __init__(
        self,
        curve: CostCurve,
        max_slots: int | None,
        base_slots: int = 1,
        base_value: float = 0.0,
        item_cost: float = 0.0,
    ):
        self.curve, self.max_slots, self.item_cost = curve, max_slots, item_cost
        self.total, self.used, self.items = 1.0 + base_value, base_slots, 0
        self.best_cost = curve(self.used)
        self.best_n, self.best = 0, self.total / self.best_cost

    def add(self, value: float, slots: int) -> None:
        """Take the next item: ``value`` expected tokens over ``slots`` slots."""
        v = max(float(value), 0.0)
        self.total += v
        self.used += slots
        self.items += 1
        cost = self.curve(self.used) + self.item_cost * self.items
        r = self.total / cost
        # a free item of any value is taken (1 + 1e-19 rounds to 1 in a ratio)
        if r > self.best or (v > 0.0 and cost <= self.best_cost):
            self.best_n, self.best, self.best_cost = self.items, r, cost

    def exhausted(self, per_slot: float) -> bool:
        """Whether items worth at most ``per_slot`` expected tokens per slot can
        no longer give a better prefix (or no slot is left)."""
        s, top = self.used, self.max_slots
        if top is None:
            raise ValueError("PrefixBound.exhausted needs max_slots")
        if s >= top:
            return True
        u, a, c, m = max(per_slot, 0.0), self.total, self.curve(s), self.curve.least_slopes(top)[s]
        if u == 0.0 or u * c < m * a * (1.0 - 1e-9):  # the bound falls with every slot
            return True
        d = top - s  # a margin for rounding: stop only when clearly done
        return (a + u * d) / (c + m * d) < self.best * (1.0 - 1e-9)


def chain_values(q: Sequence[float]) -> list[float]:
    """Expected-accept value of each chain position: ``prod(q[:d+1])``, the
    chance that the first d+1 drafts are all accepted."""
    out, p = [], 1.0
    for x in q:
        p *= float(x)
        out.append(p)
    return out


class DepthAcceptance:
    """Conditional acceptance rate per draft depth, Beta-smoothed and decayed.

    ``q(d)``: chance the depth-d draft is accepted given depth d-1 was, from
    ``(decayed accepted + w * prior) / (decayed tried + w)``; every
    observation multiplies earlier counts at that depth by ``decay``, so the
    estimate follows the text (a repetitive stretch raises it within a few
    steps). The prior's weight ``w`` decays with the observations too
    (``weight * decay^k`` after k of them): a prior that kept its weight
    against decayed counts capped at ``1 / (1 - decay)`` would hold ``q``
    above ``prior * weight / (weight + 1 / (1 - decay))`` (1/7 with the
    defaults) however often drafts fail, and on a device where a second slot
    costs less than that (``c(2) = 1.08``: Qwen2.5-0.5B on this CPU) a
    one-token draft would always look worth it.

    Args:
        prior: prior rate (before any observation).
        weight: prior weight in pseudo-observations.
        decay: per-observation forgetting factor in (0, 1].
        max_depth: deeper depths share the last bucket.
    """

    def __init__(
        self, prior: float = 0.5, weight: float = 2.0, decay: float = 0.8, max_depth: int = 16
    ):
        self.prior, self.weight, self.decay, self.max_depth = prior, weight, decay, max_depth
        self.acc = np.zeros(max_depth + 1)
        self.tried = np.zeros(max_depth + 1)
        self.prior_weight = np.full(max_depth + 1, float(weight))

    def q(self, depth: int) -> float:
        d = min(depth, self.max_depth)
        w = self.prior_weight[d]
        return float((self.acc[d] + w * self.prior) / (self.tried[d] + w))

    def qs(self, n: int) -> list[float]:
        """``[q(1), ..., q(n)]``."""
        return [self.q(d) for d in range(1, n + 1)]

    def reset(self) -> None:
        """Forget every observation (a re-probe whose whole draft was accepted:
        the text has changed, the old rates no longer apply)."""
        self.acc[:] = 0.0
        self.tried[:] = 0.0
        self.prior_weight[:] = self.weight

    def record(self, drafted: int, accepted: int) -> None:
        """One verified chain: depths 1..accepted accepted, depth accepted+1
        rejected (if it was drafted); deeper ones were not tried."""
        for d in range(1, min(drafted, accepted + 1) + 1):
            b = min(d, self.max_depth)
            self.acc[b] = self.acc[b] * self.decay + (1.0 if d <= accepted else 0.0)
            self.tried[b] = self.tried[b] * self.decay + 1.0
            self.prior_weight[b] *= self.decay


@dataclass
class Budget:
    """Per-generation draft budget of one method (see the module docstring).

    Attributes:
        curve: the device's forward cost curve.
        plain_left: one-token steps left before the next re-probe (0: the
            method drafts as its policy says).
    """

    curve: CostCurve
    plain_left: int = 0
    plain_steps: int = 0
    reprobes: int = 0
    #: the curves by context length (None: ``curve`` at every context)
    curves: CostCurves | None = None

    def at(self, context: int) -> None:
        """Plan the next step for a cache of ``context`` tokens: ``curve``
        becomes the curve at that length (:meth:`CostCurves.at`)."""
        if self.curves is not None:
            self.curve = self.curves.at(context)

    def rate_of_plain(self) -> float:
        """Tokens per unit time of a one-token step (the unit)."""
        return 1.0

    def pays(self, rate: float) -> bool:
        """Whether a draft step of expected ``rate`` beats a one-token step."""
        return rate > self.rate_of_plain()

    def cheap(self, slots: int) -> bool:
        """Whether a step of ``slots`` slots costs a one-token step's time up to
        ``REPROBE_OVERHEAD`` (a memory-bound device): probing every step then
        costs no more than a periodic re-probe, so no plain mode is needed."""
        return self.curve(slots) <= 1.0 + REPROBE_OVERHEAD

    def interval(self, reprobe_slots: int, *more_steps: int) -> int:
        """Plain steps between re-probes of ``reprobe_slots`` slots (and, for a
        re-probe of several steps, ``more_steps`` slots after it): their extra
        cost ``sum(c(s) - 1)`` spread over the interval is ``REPROBE_OVERHEAD``."""
        extra = sum(max(self.curve(s) - 1.0, 0.0) for s in (reprobe_slots, *more_steps))
        n = math.ceil(extra / REPROBE_OVERHEAD - 1e-9) if extra > 0 else MIN_PLAIN_STEPS
        return int(min(max(n, MIN_PLAIN_STEPS), MAX_PLAIN_STEPS))

    def go_plain(self, reprobe_slots: int, *more_steps: int) -> None:
        """Enter plain mode (a step found nothing worth drafting); the
        arguments as :meth:`interval`."""
        self.plain_left = self.interval(reprobe_slots, *more_steps)

    @property
    def plain(self) -> bool:
        """Whether the next step is a one-token step."""
        return self.plain_left > 0

    def tick(self) -> bool:
        """Count one plain step; True when it was the last before a re-probe."""
        self.plain_left = max(self.plain_left - 1, 0)
        self.plain_steps += 1
        if self.plain_left == 0:
            self.reprobes += 1
            return True
        return False


class PlainSteps:
    """One-token steps for a method in plain mode, run exactly as ``ntp`` runs
    them (greedy: the next forward queued before the current token is read).

    ``step(engine, root, queue_next)`` commits one token; with ``queue_next``
    the forward of that token is started at once (plain mode goes on).
    :meth:`unqueue` must be called before a draft step: it drops a queued
    forward whose token the method will feed itself (rare: only when plain
    mode ends early).
    """

    def __init__(self, sampler: Sampler | None):
        from .methods.ntp import NTP

        self.ntp = NTP()
        self.ntp.sampler = sampler
        self.ntp._next = None

    def step(self, engine: Engine, root: int, queue_next: bool) -> StepOutput:
        self.ntp.pipeline = queue_next
        return self.ntp.step(engine, root)

    def unqueue(self, engine: Engine, root: int) -> None:
        nxt, self.ntp._next = self.ntp._next, None
        if nxt is not None and engine.offset == nxt[1] and engine.cached[-1] == root:
            engine._settle()
            engine.trim_to(engine.offset - 1)
