"""Seeded sampling whose randomness depends only on (seed, position).

A speculative method draws the target token at every verified row of a
forward pass. With one global random stream (``mx.random.categorical``), the
draws then depend on how many rows each pass verified: a tree sized by timing
(``bc=auto``) gives different text for the same seed on every run, and ranks
of a sharded model that drafted differently would disagree.

:class:`PositionalSampler` removes that dependence. The draw for the token at
sequence position ``p`` uses the Gumbel-max trick with noise from a key that is
a function of ``(seed, p)`` only::

    token = argmax(filtered_logprobs / temp + Gumbel(key(seed, p)))

which is an exact draw from ``softmax(filtered_logprobs / temp)`` (the same
distribution as mlx-lm's ``categorical_sampling``). The filters are mlx-lm's
own (``apply_top_p``, ``apply_top_k``, ``apply_min_p``). So a seeded generation
is the same whatever tree the method drafted, and the same as plain decoding
(``ntp``) with that seed, up to float32 rounding of the logits between a
batched and a one-token forward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser (Steele et al. 2014), elementwise on uint64."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def position_keys(seed: int, positions: Sequence[int] | np.ndarray) -> mx.array:
    """MLX random keys, one per position, each a function of (seed, position).

    Args:
        seed: integer in [0, 2**64).
        positions: (R,) non-negative sequence positions.

    Returns:
        (R, 2) uint32 keys for ``mx.random`` functions.
    """
    pos = np.asarray(positions, dtype=np.uint64).reshape(-1)
    mixed = _splitmix64(np.uint64(seed) ^ _splitmix64(pos))
    hi = (mixed >> np.uint64(32)).astype(np.uint32)
    lo = (mixed & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    return mx.array(np.stack([hi, lo], axis=1))


_gumbel_rows = mx.vmap(lambda key, like: mx.random.gumbel(like.shape, key=key), in_axes=(0, 0))


class PositionalSampler:
    """Temperature / top-p / top-k / min-p sampling keyed by (seed, position).

    Args:
        temp: temperature (> 0).
        top_p: nucleus threshold in [0, 1]; 0 or 1 disables it.
        top_k: keep the k most probable tokens; 0 disables it (as does a k at
            least the vocabulary size).
        min_p: min-p threshold in [0, 1]; 0 disables it.
        seed: base seed in [0, 2**64).

    Call it as ``sampler(logprobs, positions)`` with ``logprobs`` (R, V)
    float32 log-probabilities and ``positions`` (R,) the sequence position of
    the token drawn from each row (the row's own position + 1). Returns (R,)
    uint32 token ids (lazy).
    """

    def __init__(
        self, temp: float, top_p: float = 0.0, top_k: int = 0, min_p: float = 0.0, seed: int = 0
    ):
        if not temp > 0:
            raise ValueError(f"PositionalSampler needs temp > 0, got {temp}")
        self.temp, self.top_k, self.min_p = float(temp), int(top_k), min_p
        # below these, float32 underflows (1/temp -> inf, top_p * mass -> 0) and
        # every token would be masked; the limits already mean "the top token"
        self.inv_temp = min(1.0 / self.temp, 1e4)
        self.top_p = max(top_p, 1e-6) if top_p > 0 else 0.0
        self.seed = int(seed)

    def filter(self, logprobs: mx.array) -> mx.array:
        """mlx-lm's filters in mlx-lm's order: top-p, min-p, top-k."""
        if 0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p > 0:
            logprobs = apply_min_p(logprobs, self.min_p)
        if 0 < self.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, self.top_k)
        return logprobs

    def __call__(self, logprobs: mx.array, positions: Sequence[int] | np.ndarray) -> mx.array:
        pos = np.asarray(positions).reshape(-1)
        if pos.shape[0] != logprobs.shape[0]:
            raise ValueError(f"{logprobs.shape[0]} rows but {pos.shape[0]} positions")
        noise = _gumbel_rows(position_keys(self.seed, pos), logprobs)
        return mx.argmax(self.filter(logprobs) * self.inv_temp + noise, axis=-1)


Sampler = Callable[..., mx.array]


def draw(sampler: Sampler, logprobs: mx.array, positions: Sequence[int] | np.ndarray) -> mx.array:
    """One draw per row of ``logprobs`` (R, V): a :class:`PositionalSampler` is
    given the positions; any other sampler (e.g. mlx-lm's ``make_sampler``)
    uses MLX's global random state."""
    if isinstance(sampler, PositionalSampler):
        return sampler(logprobs, positions)
    return sampler(logprobs)


def random_seed() -> int:
    """A base seed drawn from MLX's global random state (so ``mx.random.seed``
    still makes unseeded generations reproducible)."""
    return int(mx.random.randint(0, 2**31 - 1, ()).item())
