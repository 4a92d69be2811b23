"""Tree attention over unmodified mlx-lm models (docs/design.md §4).

mlx-lm's attention layers build their mask with ``cache.make_mask(...)`` and
apply RoPE with ``offset=cache.offset``. :class:`TreeCacheView` wraps one
layer's real KV cache and answers those two questions with a draft tree's
attention mask and per-token positions, while ``update_and_fetch`` goes to the
real cache. :class:`PositionalRoPE` wraps an attention's ``rope`` so that an
array offset (one position per token) is applied token by token: the L tokens
are laid out as L batch rows, since ``mx.fast.rope`` takes one offset per row.
No model file is forked.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn


class TreeCacheView:
    """A view over one layer's KV cache for a single tree forward pass.

    Args:
        cache: the layer's real cache (``KVCache``, ``QuantizedKVCache`` or an
            unwrapped ``RotatingKVCache``).
        mask: bool array of shape (N, cached + N): query i may attend key j.
        positions: int32 array of shape (N,): RoPE position of each input token.
    """

    def __init__(self, cache: Any, mask: mx.array, positions: mx.array):
        self._cache = cache
        self._mask = mask
        self._positions = positions
        #: (keys, values) of this pass's slots, (1, KV heads, N, head dim) each,
        #: as written to the cache (after RoPE); set by :meth:`update_and_fetch`
        self.new: tuple[mx.array, mx.array] | None = None

    @property
    def offset(self) -> mx.array:
        return self._positions

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if N != self._mask.shape[0]:
            raise ValueError(f"tree mask has {self._mask.shape[0]} rows, forward has {N} tokens")
        return self._mask

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.new = (keys, values)
        return self._cache.update_and_fetch(keys, values)

    def __getattr__(self, name: str) -> Any:  # bits, group_size, ... of the real cache
        return getattr(self._cache, name)


class FixedCache:
    """A stand-in for one layer's KV cache in a training forward pass (no real
    cache behind it): answers ``make_mask`` with a fixed attention mask and
    ``offset`` with per-token RoPE positions, like :class:`TreeCacheView`.
    Keys and values pass through, after the ``prefix`` ones if given
    (evaluated keys/values of earlier tokens, no gradient through them);
    nothing is stored. The one cache stand-in of the trainers.

    Args:
        mask: bool (N, P + N): query i may attend key j (P prefix keys first).
        positions: int32 (N,): RoPE position of each input token.
        prefix: optional (keys, values), each (1, KV heads, P, head dim).
    """

    def __init__(
        self, mask: mx.array, positions: mx.array, prefix: tuple[mx.array, mx.array] | None = None
    ):
        self._mask = mask
        self.offset = positions
        self.prefix = prefix

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return self._mask

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self.prefix is None:
            return keys, values
        pk, pv = self.prefix
        return mx.concatenate([pk, keys], axis=2), mx.concatenate([pv, values], axis=2)


class PositionalRoPE(nn.Module):
    """Wraps an mlx-lm RoPE module so that an (L,) array offset means one RoPE
    position per token (shape (B=1, H, L, D) in and out). Integer offsets go to
    the wrapped module unchanged."""

    def __init__(self, rope: nn.Module):
        super().__init__()
        self.inner = rope

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        if isinstance(offset, mx.array) and offset.ndim == 1 and x.shape[0] == 1:
            y = self.inner(x.transpose(2, 1, 0, 3), offset=offset)
            return y.transpose(2, 1, 0, 3)
        return self.inner(x, offset=offset)


def install_positional_rope(model: nn.Module) -> None:
    """Wrap every attention layer's ``rope`` with :class:`PositionalRoPE` (idempotent).

    Raises:
        AttributeError: a layer has no ``self_attn.rope`` (caller turns this into
            an UnsupportedModelError).
    """
    for layer in model.layers:
        attn = layer.self_attn
        if not isinstance(attn.rope, PositionalRoPE):
            attn.rope = PositionalRoPE(attn.rope)
