"""Named simulated devices: the whole-forward cost curves of Apple GPUs.

A profile is the relative cost ``c(n)`` of a forward pass of ``n`` slots (1.0
= one slot) on one kind of Mac and weight format, for the simulated device of
:mod:`mlx_mtp.bench.simulate` (``MLX_MTP_SIMULATE_DEVICE="profile=m4pro-4bit,
ms_per_token=12"``, ``mlx-mtp bench --profiles``). The quantized profiles are
derived by :func:`forward_curve` from published per-matmul timings
(:data:`M4PRO_4BIT`, :data:`M3ULTRA_4BIT`) over the weights of a typical 4B
model (:data:`QWEN3_4B`); docs/profiles.md has the derivation and the table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import InvalidArgumentError

#: slot counts at which a derived profile is tabulated: every count up to 12
#: (the speculation range, and MLX's qmv -> qmm switches at 10, 12 and 18
#: rows), both sides of the other kernel steps (18, 33), and 64
SLOTS = (*range(1, 13), 16, 17, 18, 24, 32, 33, 48, 64)


@dataclass(frozen=True)
class ModelShape:
    """The matmul shapes of a dense transformer (a tied or separate LM head:
    either way the head's weights are read once per pass).

    Attributes:
        name: what it is, for the docs.
        hidden: the residual width.
        intermediate: the MLP's width (gate, up and down projections).
        layers: transformer layers.
        heads, kv_heads, head_dim: attention heads, key/value heads, and
            their width.
        vocab: the LM head's rows.
        context: tokens in the KV cache that a pass reads (the flat part).
    """

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context: int = 1024

    def weights(self) -> dict[str, int]:
        """Weights (parameters) of each matmul kind over the whole pass:
        ``attention`` (q, k, v, o projections), ``mlp`` (gate, up, down),
        ``lm_head``."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "attention": self.layers * self.hidden * (2 * q + 2 * kv),
            "mlp": self.layers * 3 * self.hidden * self.intermediate,
            "lm_head": self.hidden * self.vocab,
        }

    def cache_bytes(self) -> int:
        """Bytes of the bf16 KV cache at :attr:`context` tokens: what the
        attention reads per pass, the same for any slot count."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.context * 2


#: Qwen3-4B (Qwen/Qwen3-4B config.json: hidden 2560, intermediate 9728, 36
#: layers, 32 heads, 8 KV heads of 128, vocabulary 151,936), 1,024 tokens of
#: context
QWEN3_4B = ModelShape("Qwen3-4B", 2560, 9728, 36, 32, 8, 128, 151936)


def quantized_bytes_per_weight(bits: int, group_size: int = 64) -> float:
    """Bytes per weight of MLX's affine quantization: ``bits / 8`` plus a
    bf16 scale and bias (4 bytes) per group of ``group_size`` weights."""
    return bits / 8 + 4 / group_size


@dataclass(frozen=True)
class ChipData:
    """Published timings of MLX's quantized matmul on one chip, each relative
    to the same matmul with one row, and the kernel dispatch around them.

    Attributes:
        name: the chip, mlx version and format, for the docs.
        points: matmul kind (``attention``, ``mlp``, ``lm_head``) -> a list of
            ``(share, {rows: relative cost})``: measured shapes standing for
            that kind, weighted by ``share`` of its weights.
        qmv_limit: matmul kind -> the row count from which MLX runs ``qmm``
            instead of ``qmv``/``qmv_wide`` (``get_qmv_batch_limit`` in
            mlx/backend/metal/quantized.cpp for that kind's shapes in
            :data:`QWEN3_4B`).
        tile: the relative cost of one ``qmm`` tile of 32 rows (a pass of
            ``n >= qmv_limit`` rows costs ``tile * ceil(n / 32)``).
        sources: where the figures come from.
    """

    name: str
    points: dict[str, list[tuple[float, dict[int, float]]]]
    qmv_limit: dict[str, int]
    tile: float
    sources: tuple[str, ...]


#: M4 Pro (``applegpu_g16s``), mlx 0.32.0, 4-bit affine, bf16 activations.
#: ml-explore/mlx#3839 (group size 64): 4096x4096 for the attention
#: projections; the MLP's fused gate+up 4096x24576 (2/3 of its weights) and
#: down 12288x4096 (1/3), at 2, 3, 4, 6 and 8 rows (its 4096x6144 "qkv-like"
#: row, 1.48x at 3 rows and 1.14x at 4, is left out as noise).
#: ml-explore/mlx#3852 (group size 128): the LM head 5120x248320 at 2, 3, 4,
#: 5 and 8 rows; and 5120x17408, 4.5x at both 10 and 32 rows: one qmm tile.
#: qmv limits: 12 for shapes within 4096x4096, else 10 (gen >= 15, not 'd').
M4PRO_4BIT = ChipData(
    name="M4 Pro, mlx 0.32.0, 4-bit",
    points={
        "attention": [(1.0, {2: 1.20, 3: 1.35, 4: 1.57, 6: 1.99, 8: 2.01})],
        "mlp": [
            (2 / 3, {2: 1.03, 3: 1.22, 4: 1.47, 6: 2.07, 8: 2.69}),
            (1 / 3, {2: 1.18, 3: 1.40, 4: 1.52, 6: 2.05, 8: 2.46}),
        ],
        "lm_head": [(1.0, {2: 1.01, 3: 1.14, 4: 1.47, 5: 1.85, 8: 3.03})],
    },
    qmv_limit={"attention": 12, "mlp": 10, "lm_head": 10},
    tile=4.5,
    sources=("ml-explore/mlx#3839", "ml-explore/mlx#3852"),
)

#: M3 Ultra (a 'd' chip), mlx 0.31.2 and 0.32.0 alike, 4-bit affine group
#: size 64, (M, 5120) @ (17408, 5120)^T (ml-explore/mlx#4265): 1.83x, 3.26x,
#: 5.28x, 6.12x at 2, 4, 7, 8 rows (qmv), 6.32x at 16 (one qmm tile). The one
#: shape stands for every kind. qmv limits: 18 within 4096x4096, else 12.
M3ULTRA_4BIT = ChipData(
    name="M3 Ultra, mlx 0.32.0, 4-bit",
    points={
        kind: [(1.0, {2: 1.83, 4: 3.26, 7: 5.28, 8: 6.12})]
        for kind in ("attention", "mlp", "lm_head")
    },
    qmv_limit={"attention": 18, "mlp": 12, "lm_head": 12},
    tile=6.32,
    sources=("ml-explore/mlx#4265",),
)


def matmul_cost(points: dict[int, float], rows: int, qmv_limit: int, tile: float) -> float:
    """Relative cost of a quantized matmul of ``rows`` rows (1.0 = one row).

    Below ``qmv_limit`` rows MLX runs ``qmv`` (or ``qmv_wide``): the cost is
    linear between the published ``points`` (``{rows: relative cost}``, 1 row
    = 1.0), and beyond the last one it goes on at the last segment's slope (a
    wider qmv takes more passes over its rows). From ``qmv_limit`` rows MLX
    runs ``qmm`` in tiles of 32 rows: ``tile * ceil(rows / 32)`` (33 rows
    cost about twice 32).
    """
    if rows <= 1:
        return 1.0
    if rows >= qmv_limit:
        return tile * math.ceil(rows / 32)
    xs = [1, *sorted(points)]
    ys = [1.0, *(points[x] for x in xs[1:])]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if rows <= x1:
            return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)
    slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
    return ys[-1] + slope * (rows - xs[-1])


def forward_curve(
    chip: ChipData,
    model: ModelShape = QWEN3_4B,
    bits: int = 4,
    group_size: int = 64,
    slots: Sequence[int] = SLOTS,
    monotone: bool = True,
) -> list[tuple[int, float]]:
    """The whole-forward cost curve of ``model`` on ``chip``: ``(slots,
    relative cost)`` pairs, 1.0 at one slot.

    A pass of ``n`` slots reads every weight once and the KV cache once. Each
    matmul kind (attention projections, MLP, LM head) costs its share of the
    one-slot pass's bytes times :func:`matmul_cost` at ``n`` rows (its
    measured shapes averaged by their weight shares); the attention over the
    cache, the norms and the rest cost their share, flat in ``n``.

    At ``bits`` other than 4 the one-row matmul reads ``r`` times the 4-bit
    bytes (:func:`quantized_bytes_per_weight`), while the published timings
    of more rows are compute (dequantization and multiply-adds), the same
    absolute time at any width: at 3 to 10 rows of 5120x17408 the 2-bit and
    4-bit matmuls take the same milliseconds (ml-explore/mlx#3852). A matmul
    then costs ``max(1, c4(n) / r)``: between flat and the 4-bit curve.

    Where MLX's switch from ``qmv`` to one ``qmm`` tile makes more rows
    cheaper than fewer (the M3 Ultra at 12 and 18 rows), ``monotone`` keeps
    the cost of the fewer rows from there on, as
    :class:`~mlx_mtp.budget.CostCurve` does with any curve: a pass is never
    priced below a smaller one.

    Sources: ml-explore/mlx#3839, #3852, #4265 (the figures in
    :data:`M4PRO_4BIT` and :data:`M3ULTRA_4BIT`).
    """
    per_weight = quantized_bytes_per_weight(bits, group_size)
    ratio = per_weight / quantized_bytes_per_weight(4, group_size)
    weights = model.weights()
    total = sum(weights.values()) * per_weight + model.cache_bytes()
    out: list[tuple[int, float]] = []
    for n in slots:
        cost = model.cache_bytes() / total
        for kind, count in weights.items():
            c4 = sum(
                share * matmul_cost(pts, n, chip.qmv_limit[kind], chip.tile)
                for share, pts in chip.points[kind]
            )
            cost += count * per_weight / total * max(1.0, c4 / ratio)
        if monotone and out:
            cost = max(cost, out[-1][1])
        out.append((int(n), round(cost, 3)))
    return out


def _curve_text(points: Sequence[tuple[int, float]]) -> str:
    return ",".join(f"{n}:{c:g}" for n, c in points)


#: name -> the cost curve as ``MLX_MTP_SIMULATE_DEVICE`` writes it
#: (``slots:cost,...``). ``bf16-flat``: a memory-bound device (bf16 weights,
#: flat from 2 rows on an M3 Ultra, ml-explore/mlx#4265); the others derived
#: by :func:`forward_curve`.
PROFILES: dict[str, str] = {
    "bf16-flat": "1:1,16:1.05,64:1.3",
    "m4pro-4bit": _curve_text(forward_curve(M4PRO_4BIT)),
    "m4pro-8bit": _curve_text(forward_curve(M4PRO_4BIT, bits=8)),
    "m3ultra-4bit": _curve_text(forward_curve(M3ULTRA_4BIT)),
}


def profile_curve(name: str) -> str:
    """The cost curve of profile ``name`` (``slots:cost,...``).

    Raises:
        InvalidArgumentError: an unknown name, in one line that lists the
            known ones.
    """
    try:
        return PROFILES[name]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown device profile {name!r}; known: {', '.join(PROFILES)}."
        ) from None
