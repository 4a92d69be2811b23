"""Tree attention over unmodified mlx-lm models, and sliding windows that can
drop rejected drafts (docs/design.md §4).

mlx-lm's attention layers build their mask with ``cache.make_mask(N, ...)``
(through ``create_attention_mask``; sliding-window layers pass
``window_size``) and apply RoPE with ``offset=cache.offset``.
:class:`TreeCacheView` wraps one layer's real KV cache and answers those two
questions for a draft tree: a mask over the keys the real cache returns (the
tree's ancestor relation for this pass's slots, the cached tokens for the
rest, each limited to the layer's window), and one RoPE position per token,
while ``update_and_fetch`` goes to the real cache. :class:`PositionalRoPE`
wraps each RoPE module so that an array offset (one position per token) is
applied token by token: the L tokens are laid out as L batch rows, since
``mx.fast.rope`` takes one offset per row. No model file is forked.

:class:`SlidingKVCache` replaces mlx-lm's ``RotatingKVCache`` (sliding-window
layers, ``--max-kv-size``): the same window, in a ring with room for the
largest forward pass beyond it, so that the rows of a rejected draft can be
dropped even after the window has wrapped.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import ConcatenateKVCache, KVCache, QuantizedKVCache

#: room (slots beyond the window) of a :class:`SlidingKVCache` made for an
#: engine that was not told its method's block complexity
DEFAULT_ROOM = 64


class SlidingKVCache:
    """A sliding-window KV cache with room to drop up to ``room + 1`` new tokens.

    A query at position ``q`` attends to the first ``keep`` positions and to
    the ``window`` positions ``(q - window, q]``: what mlx-lm's
    ``RotatingKVCache(max_size=keep + window, keep=keep)`` gives in one-token
    decoding, for every pass here (prefill chunks, chains, trees). Rows
    ``0 .. keep-1`` hold the first positions; position ``p >= keep`` lives in
    row ``keep + (p - keep) % (window + room)`` of a ring of ``window + room``
    rows. Since the ring is ``room`` rows longer than the window, a forward
    pass of up to ``room + 1`` tokens overwrites only rows that no later query
    can see, so its tokens can be dropped again (:meth:`trim`) whatever the
    cache length: rejected drafts never make the cache refuse. Keys are
    returned in ring order with a mask built from the position each row holds
    (``self.pos``), so attention sees exactly the window.

    A pass of more than ``room + 1`` tokens (a long prompt's prefill chunk)
    attends over the ring and its own keys concatenated, and keeps its last
    ``window + room`` tokens; it cannot be dropped.

    Args:
        window: positions each query sees besides the ``keep`` first (>= 1).
        keep: first positions every query sees (mlx-lm's attention sink; 0
            for sliding-window layers, 4 for ``--max-kv-size``).
        room: ring rows beyond the window: the block complexity (slots per
            forward pass) of the method that decodes with this cache.

    Memory: ``keep + window + room`` rows of keys and values per layer, i.e.
    ``2 x KV heads x head dim x bytes per value`` bytes per row.
    """

    step = 256

    def __init__(self, window: int, keep: int = 0, room: int = DEFAULT_ROOM):
        if window < 1 or keep < 0 or room < 1:
            raise ValueError(f"SlidingKVCache(window={window}, keep={keep}, room={room})")
        self.window, self.keep, self.room = int(window), int(keep), int(room)
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        #: tokens seen (the RoPE offset of the next token)
        self.offset = 0
        #: (rows,) int64: position held by each allocated row, -1 for none
        self.pos = np.zeros(0, dtype=np.int64)

    # ------------------------------------------------------------- layout
    @property
    def ring(self) -> int:
        """Rows of the ring (``window + room``)."""
        return self.window + self.room

    @property
    def capacity(self) -> int:
        """The most rows this cache allocates (``keep + window + room``)."""
        return self.keep + self.ring

    def rows(self, positions: np.ndarray) -> np.ndarray:
        """Row of each position (int64 array in, same shape out)."""
        p = np.asarray(positions, dtype=np.int64)
        return np.where(p < self.keep, p, self.keep + (p - self.keep) % self.ring)

    def _fits(self, n: int) -> bool:
        # a pass of n tokens written in place leaves every row its own queries
        # (and the next token's) need: it overwrites positions up to
        # offset + n - 1 - ring, all older than offset - window + 1
        return n <= self.room + 1 or self.offset + n <= self.capacity

    def droppable(self, n: int) -> bool:
        """Whether a pass of ``n`` tokens could be dropped again afterwards."""
        return self._fits(n)

    def positions_after(self, n: int) -> np.ndarray:
        """Positions of the key rows :meth:`update_and_fetch` returns for ``n``
        new tokens (-1: a row that holds nothing), without changing the cache."""
        L = self.offset
        new = np.arange(L, L + n, dtype=np.int64)
        if not self._fits(n):
            return np.concatenate([self.pos, new])
        pos = np.full(self._allocated(int(self.rows(new).max()) + 1), -1, dtype=np.int64)
        pos[: len(self.pos)] = self.pos
        pos[self.rows(new)] = new
        return pos

    def visible(self, pos: np.ndarray, query: np.ndarray, window: int | None) -> np.ndarray:
        """(Q, R) bool: which key rows (positions ``pos``, R) each query position
        (Q) may see through causality and the window (``window`` capped at
        this cache's own)."""
        w = self.window if window is None else min(int(window), self.window)
        k, q = pos[None, :], np.asarray(query, dtype=np.int64)[:, None]
        return (k >= 0) & (k <= q) & ((k < self.keep) | (k > q - w))

    # ------------------------------------------------------------ storing
    def _allocated(self, rows: int) -> int:
        # rows allocated once ``rows`` are needed: grown in steps of 256, as
        # mlx-lm's caches, up to the capacity
        have = len(self.pos)
        if rows <= have:
            return have
        return min(self.capacity, ((rows + self.step - 1) // self.step) * self.step)

    def _allocate(self, rows: int, like: mx.array, like_v: mx.array) -> None:
        have = len(self.pos)
        size = self._allocated(rows)
        if size == have:
            return
        self.keys, self.values = _grown(self.keys, self.values, size - have, like, like_v)
        pos = np.full(size, -1, dtype=np.int64)
        pos[: len(self.pos)] = self.pos
        self.pos = pos

    def write(self, start: int, keys: mx.array, values: mx.array) -> None:
        """Store keys/values (B, H, n, D) of positions ``start .. start+n-1``
        in their rows (at most ``ring`` of them, and they must be the latest
        positions written; the rows' positions are recorded)."""
        n = keys.shape[2]
        new = np.arange(start, start + n, dtype=np.int64)
        rows = self.rows(new)
        self._allocate(int(rows.max()) + 1, keys, values)
        # contiguous runs of rows: at most the keep part and two ring parts
        cuts = [0, *(np.flatnonzero(np.diff(rows) != 1) + 1).tolist(), n]
        for i, j in zip(cuts[:-1], cuts[1:]):
            r = int(rows[i])
            self.keys[..., r : r + j - i, :] = keys[..., i:j, :]
            self.values[..., r : r + j - i, :] = values[..., i:j, :]
        self.pos[rows] = new

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``n`` tokens' keys/values (B, H, n, D); return every key and
        value row the queries of this pass attend over (masked by
        :meth:`make_mask` / the tree view through :meth:`positions_after`)."""
        n = keys.shape[2]
        L = self.offset
        if self._fits(n):
            self.write(L, keys, values)
            self.offset = L + n
            return self.keys, self.values
        # a long pass: attend over the old rows and all new keys, keep the latest
        old_k = self.keys if self.keys is not None else keys[..., :0, :]
        old_v = self.values if self.values is not None else values[..., :0, :]
        out = (mx.concatenate([old_k, keys], axis=2), mx.concatenate([old_v, values], axis=2))
        first = [] if L >= self.keep else [(L, min(n, self.keep - L))]
        last = max(L + n - self.ring, L + (first[0][1] if first else 0))
        for s, m in [*first, (last, L + n - last)]:
            if m > 0:
                self.write(s, keys[..., s - L : s - L + m, :], values[..., s - L : s - L + m, :])
        self.pos[(self.pos >= 0) & (self.pos < L + n - self.ring) & (self.pos >= self.keep)] = -1
        self.offset = L + n
        return out

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array | str | None:
        """The causal sliding-window mask of ``N`` new tokens (``(N, rows)``
        bool over :meth:`update_and_fetch`'s rows; None or ``"causal"`` where
        that is the same)."""
        pos = self.positions_after(N)
        vis = self.visible(pos, np.arange(self.offset, self.offset + N), window_size)
        if not return_array and bool(vis.all()):
            return None if N == 1 else vis_or_causal(vis, pos, self.offset)
        return mx.array(vis)

    # ----------------------------------------------------------- trimming
    def is_trimmable(self) -> bool:
        return True

    def can_trim(self, n: int) -> bool:
        """Whether the last ``n`` tokens can be dropped: every row the next
        token would see still holds its position (false after tokens of more
        than ``room + 1`` in total were written since those positions)."""
        end = self.offset - min(self.offset, n)
        need = np.arange(max(self.keep, end - self.window + 1), end, dtype=np.int64)
        return not len(need) or bool(np.array_equal(self.pos[self.rows(need)], need))

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens; returns how many were dropped: ``n``, or
        0 where :meth:`can_trim` is false."""
        n = min(self.offset, n)
        if not self.can_trim(n):
            return 0
        end = self.offset - n
        self.pos[self.pos >= end] = -1
        self.offset = end
        return n

    def reserve(self, room: int) -> None:
        """Make the ring ``window + room`` rows long (never shorter), moving the
        rows that later queries can still see."""
        if room <= self.room:
            return
        if self.keys is None:
            self.room = room
            return
        have = np.flatnonzero(self.pos >= 0)
        order = have[np.argsort(self.pos[have])]
        positions = self.pos[order]
        idx = mx.array(order)
        k, v = mx.take(self.keys, idx, axis=2), mx.take(self.values, idx, axis=2)
        self.keys = self.values = None
        self.pos = np.zeros(0, dtype=np.int64)
        self.room = room
        cuts = [0, *(np.flatnonzero(np.diff(positions) != 1) + 1).tolist(), len(positions)]
        for i, j in zip(cuts[:-1], cuts[1:]):  # runs of consecutive positions
            self.write(int(positions[i]), k[..., i:j, :], v[..., i:j, :])

    # --------------------------------------------------- mlx-lm interface
    @property
    def state(self) -> tuple[mx.array, ...]:
        return () if self.keys is None else (self.keys, self.values)

    def size(self) -> int:
        return int((self.pos >= 0).sum())

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def vis_or_causal(vis: np.ndarray, pos: np.ndarray, offset: int) -> mx.array | str:
    """``"causal"`` when an all-visible pass over rows in position order is the
    plain causal mask of its last rows, else the array ``vis``."""
    n = vis.shape[0]
    if np.array_equal(pos, np.arange(offset + n)):
        return "causal"
    return mx.array(vis)


def key_positions(cache: Any, n: int) -> np.ndarray:
    """Positions of the key rows a layer cache's ``update_and_fetch`` returns
    after ``n`` new tokens (-1: no token).

    Raises:
        TypeError: a cache kind whose rows are not known here.
    """
    if isinstance(cache, SlidingKVCache):
        return cache.positions_after(n)
    if isinstance(cache, (KVCache, QuantizedKVCache, ConcatenateKVCache)):
        return np.arange(cache.offset + n, dtype=np.int64)
    raise TypeError(f"no tree attention over a {type(cache).__name__}")


def tree_mask(
    cache: Any, anc: np.ndarray, depth: np.ndarray, window: int | None = None
) -> np.ndarray:
    """(N, rows) bool attention mask of a tree pass of N slots over ``cache``.

    Slot i (RoPE position ``offset + depth[i]``) sees its ancestors and itself
    among the pass's slots (``anc[i, j]``) and every cached token, both within
    ``window`` positions of its own (``q - window < p <= q``; a
    :class:`SlidingKVCache` adds its own window and ``keep`` first positions).
    Rows holding no token are masked.
    """
    n = len(depth)
    L = cache.offset
    pos = key_positions(cache, n)
    q = L + depth.astype(np.int64)
    if isinstance(cache, SlidingKVCache):
        mask = cache.visible(pos, q, window)
        w = cache.window if window is None else min(int(window), cache.window)
    else:
        k = pos[None, :]
        mask = np.broadcast_to((k >= 0) & (k < L), (n, len(pos))).copy()
        if window is not None:
            mask &= k > q[:, None] - int(window)
        w = window
    new = np.flatnonzero((pos >= L) & (pos < L + n))
    slot = pos[new] - L
    sub = anc[:, slot]
    if w is not None:
        sub = sub & (depth[:, None] - depth[None, slot] < w)
    mask[:, new] = sub
    return mask


class TreeCacheView:
    """A view over one layer's KV cache for a single tree forward pass.

    Args:
        cache: the layer's real cache (``KVCache``, ``QuantizedKVCache`` or
            :class:`SlidingKVCache`).
        anc: (N, N) bool: slot j is slot i or one of its ancestors.
        depth: (N,) int: depth of each slot below the root (0).
        positions: (N,) int32 mx array: RoPE position of each slot
            (``cache.offset + depth``).
        masks: memo shared by the views of one pass: one mask per cache layout
            and window, since the model asks one layer and applies the mask to
            every layer of that kind.
    """

    def __init__(
        self,
        cache: Any,
        anc: np.ndarray,
        depth: np.ndarray,
        positions: mx.array,
        masks: dict[Any, mx.array] | None = None,
    ):
        self._cache = cache
        self._anc = anc
        self._depth = depth
        self._positions = positions
        self._masks = {} if masks is None else masks
        #: (keys, values) of this pass's slots, (1, KV heads, N, head dim) each,
        #: as written to the cache (after RoPE); set by :meth:`update_and_fetch`
        self.new: tuple[mx.array, mx.array] | None = None

    @property
    def offset(self) -> mx.array:
        # per-token offsets o_i = position_i - i: position formulas of the form
        # ``offset + arange(L)`` give each slot its own position, and
        # :class:`PositionalRoPE` rotates slot i by o_i + i
        return self._positions - mx.arange(self._positions.shape[0], dtype=self._positions.dtype)

    def __getitem__(self, i: int) -> TreeCacheView:
        # a layer with several caches (mlx-lm's CacheList: MLA + indexer keys)
        return TreeCacheView(self._cache[i], self._anc, self._depth, self._positions, self._masks)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if N != len(self._depth):
            raise ValueError(f"tree mask has {len(self._depth)} rows, forward has {N} tokens")
        c = self._cache
        layout = [getattr(c, a, None) for a in ("window", "keep", "room")]
        key = (type(c), *layout, len(getattr(c, "pos", ())), window_size)
        if key not in self._masks:
            self._masks[key] = mx.array(tree_mask(c, self._anc, self._depth, window_size))
        return self._masks[key]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        keys, values = finite(keys), finite(values)
        self.new = (keys, values)
        return self._cache.update_and_fetch(keys, values)

    def __getattr__(self, name: str) -> Any:  # bits, group_size, ... of the real cache
        return getattr(self._cache, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # a layer that sets cache attributes (``cache.keys = mx.depends(...)``)
        # sets them on the real cache
        if name.startswith("_") or name == "new":
            object.__setattr__(self, name, value)
        else:
            setattr(self._cache, name, value)


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
        # per-token offsets, as :attr:`TreeCacheView.offset`
        self.offset = positions - mx.arange(positions.shape[0], dtype=positions.dtype)
        self.prefix = prefix

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return self._mask

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self.prefix is None:
            return keys, values
        pk, pv = self.prefix
        return mx.concatenate([pk, keys], axis=2), mx.concatenate([pv, values], axis=2)


class PositionalRoPE(nn.Module):
    """Wraps an mlx-lm RoPE module so that an (L,) array offset ``o`` gives
    token i the RoPE position ``o[i] + i`` (the per-token offsets of
    :attr:`TreeCacheView.offset`; shape (B=1, H, L, D) in and out), and a
    (B, L) one gives token i of row b the position ``o[b, i] + i`` (a
    batch's draft trees, :mod:`mlx_mtp.batching`). Integer and (B,) offsets
    go to the wrapped module unchanged."""

    def __init__(self, rope: nn.Module):
        super().__init__()
        self.inner = rope

    def __call__(self, x: mx.array, offset: Any = 0, **kwargs: Any) -> mx.array:
        per_token = isinstance(offset, mx.array) and (
            offset.ndim == 2 or (offset.ndim == 1 and x.shape[0] == 1)
        )
        if not per_token:
            return self.inner(x, offset=offset, **kwargs)
        # the B x L tokens as B * L rope rows of one token, each at its position
        B, H, L, D = x.shape
        pos = (offset.reshape(B, -1) + mx.arange(L, dtype=offset.dtype)).reshape(B * L)
        flat = x.transpose(0, 2, 1, 3).reshape(B * L, H, 1, D)
        y = self.inner(flat, offset=pos, **kwargs)
        return y.reshape(B, L, H, D).transpose(0, 2, 1, 3)


def is_rope(module: Any) -> bool:
    """Whether a module applies rotary position embeddings: ``nn.RoPE``, or a
    module whose class name says RoPE / rotary and whose ``__call__`` takes an
    ``offset`` (mlx-lm's ``rope_utils`` classes and the model files' own)."""
    if isinstance(module, PositionalRoPE) or not isinstance(module, nn.Module):
        return False
    if isinstance(module, nn.RoPE):
        return True
    name = type(module).__name__.lower()
    if "rope" not in name and "rotary" not in name:
        return False
    try:
        return "offset" in inspect.signature(module.__call__).parameters
    except (TypeError, ValueError):
        return False


def install_positional_rope(model: nn.Module) -> int:
    """Wrap every RoPE module of ``model`` (:func:`is_rope`, wherever it sits:
    ``self_attn.rope``, ``attention.rotary_emb``, a model-level table) with
    :class:`PositionalRoPE`. Idempotent, and one thread at a time (threads
    binding methods to one loaded model install it together).

    Returns:
        The number of RoPE modules now wrapped (0 for a model without RoPE,
        e.g. learned absolute positions).
    """

    def walk(parent: Any) -> int:
        found = 0
        items = (
            parent.children().items()
            if isinstance(parent, nn.Module)
            else enumerate(parent)
            if isinstance(parent, list)
            else parent.items()
        )
        for key, child in list(items):
            if isinstance(child, PositionalRoPE):
                found += 1
            elif is_rope(child):
                parent[key] = PositionalRoPE(child)
                found += 1
            elif isinstance(child, (nn.Module, list, dict)):
                found += walk(child)
        return found

    with _INSTALL:
        return walk(model)


#: one :func:`install_positional_rope` at a time in a process
_INSTALL = threading.Lock()


class LazyView:
    """A view over one layer's plain ``KVCache`` for a forward pass whose cache
    length is a lazy array (a pipelined step, :mod:`mlx_mtp.pipeline`: the
    length after the step before is not read by the host yet).

    The pass's keys and values are written at row ``at`` of the cache's
    buffers (``mx.slice_update`` at an array offset, so that the graph never
    holds the length as a Python int); attention runs over the first ``rows``
    rows (a bound the host knows) with the pass's mask, which hides the rows
    past the cached tokens. RoPE positions come per token, as in
    :class:`TreeCacheView` (:class:`PositionalRoPE`).

    Args:
        cache: the layer's real ``KVCache``; its ``offset`` (a Python int) is
            not read or changed here: the caller sets it once the length is
            known.
        at: scalar int32 array, the cache row of the pass's first slot.
        offsets: (N,) int32 per-token RoPE offsets (``position_i - i``).
        mask: ``mask(window_size)`` -> (N, rows) bool attention mask.
        rows: key rows attended (at least ``at + N``).
    """

    def __init__(self, cache: Any, at: mx.array, offsets: mx.array, mask: Any, rows: int):
        object.__setattr__(self, "_cache", cache)
        self._at, self._offsets, self._mask, self._rows = at, offsets, mask, rows
        #: (keys, values) of this pass's slots, (1, KV heads, N, head dim) each
        self.new: tuple[mx.array, mx.array] | None = None

    @property
    def offset(self) -> mx.array:
        return self._offsets

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return self._mask(window_size)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        c = self._cache
        keys, values = finite(keys), finite(values)
        reserve(c, self._rows, keys, values)
        c.keys = mx.slice_update(c.keys, keys, self._at, axes=(2,))
        c.values = mx.slice_update(c.values, values, self._at, axes=(2,))
        self.new = (keys, values)
        rows = self._rows
        return c.keys[..., :rows, :], c.values[..., :rows, :]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or name == "new":
            object.__setattr__(self, name, value)
        else:
            setattr(self._cache, name, value)


def finite(x: mx.array) -> mx.array:
    """``x`` with every NaN or infinity replaced by 0 (lazy, same shape and
    dtype). A tree pass writes the keys and values of all its slots, mask
    slots and rejected drafts included, and attention multiplies a masked
    row's value by a weight of 0: a non-finite value there would make every
    query's output NaN (0 x NaN), in this pass and in any later pass that
    reads the stale row past the cache's length. Written rows are finite."""
    return mx.where(mx.isfinite(x), x, mx.zeros((), x.dtype))


def reserve(cache: Any, rows: int, keys: mx.array, values: mx.array) -> None:
    """Grow a plain ``KVCache``'s buffers to at least ``rows`` rows (in steps of
    its ``step``, 256, as mlx-lm grows them), shaped like ``keys``/``values``
    (B, KV heads, n, head dim); the rows already there are kept."""
    have = 0 if cache.keys is None else cache.keys.shape[2]
    if have >= rows:
        return
    step = getattr(cache, "step", 256)
    size = -(-rows // step) * step
    cache.keys, cache.values = _grown(cache.keys, cache.values, size - have, keys, values)


def _grown(
    keys: mx.array | None, values: mx.array | None, extra: int, like_k: mx.array, like_v: mx.array
) -> tuple[mx.array, mx.array]:
    """``keys``/``values`` (B, H, rows, D; None: no rows yet) with ``extra``
    zero rows appended, shaped and typed like ``like_k``/``like_v``."""
    B, H, _, Dk = like_k.shape
    grow_k = mx.zeros((B, H, extra, Dk), like_k.dtype)
    grow_v = mx.zeros((B, H, extra, like_v.shape[3]), like_v.dtype)
    if keys is None:
        return grow_k, grow_v
    return mx.concatenate([keys, grow_k], axis=2), mx.concatenate([values, grow_v], axis=2)
