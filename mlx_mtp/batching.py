"""Speculation inside a batch: several requests' drafts verified in one
forward pass.

Each row of the batch is one request. At every step each row drafts from its
own context: a chain by prompt lookup (Saxena, 2023) and, where the batch
keeps one, a tree from a table of the model's own predictions (token
recycling, Luo et al., 2024: the best ids the model ranked after each token
the last time it was an input slot, written from every slot of every pass),
read after the row's newest token and after every node taken. Each row's
draft is cut to the batch's width (padded where it is shorter), and one
forward pass of ``rows x width`` tokens verifies all of them (Leviathan et
al., 2023, §2, greedy; trees as in SpecInfer, Miao et al., 2024): a row
keeps the longest path of its draft that follows the model's own argmax and
the model's next token after it (the bonus token). A pass of chains is
causal; a pass where a row's draft branches gives each row its own ancestor
mask and each slot its rotary position (the row's position plus the slot's
depth). Rows accept different numbers of tokens, so the KV cache cannot
simply be trimmed: :class:`BatchLayout` keeps, for every row, which cache
slots hold a kept token. A rejected slot stays where it is and is masked
out of attention from then on; each row's rotary position is the count of
its kept tokens, so a row sees exactly the keys and positions it would see
alone. When the rejected slots grow to the kept ones, the cache is
compacted (each row's kept slots gathered to the right).

mlx-lm's model classes run unchanged: every layer gets a
:class:`BatchLayerCache` whose ``offset`` is the per-row position array (per
row and slot for a pass of trees, through
:class:`~mlx_mtp.cache_view.PositionalRoPE`) and whose ``make_mask`` returns
the per-row mask.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.utils import does_model_support_input_embeddings

from .cache_view import install_positional_rope
from .engine import PREFILL_STEP
from .errors import InvalidArgumentError, UnsupportedModelError
from .families import check_tree_support, model_parts
from .ledger import EPSILON
from .memory import weight_bytes
from .native_mtp import draft_cost_of
from .sources.lookup import lookup_match
from .sources.masks import PROBE_RANK_PRIORS
from .sources.pool import JACOBI_EXTRA, NGramPool, ranked_trie
from .sources.recycle import DEEP_PRIORS, RANK_PRIORS, RecycleTable
from .timing import DeviceClock, make_clock
from .verify import top_tokens, walk_tree

#: cache slots are allocated in blocks of this many (as mlx-lm's KVCache)
SLOT_BLOCK = 256
#: most tokens per row of a draft model's pass that catches up on tokens it
#: has not seen (steps that drafted nothing); for an MTP layer, the pending
#: pairs of a row past which they are fed without a draft
CATCH_UP = 64


class BatchLayout:
    """Which cache slots of each row hold a kept token: shared by every
    layer's :class:`BatchLayerCache` of one batch.

    Attributes:
        valid: (rows, capacity) bool; slot ``s < size`` of row ``r`` holds one
            of the row's tokens (False: left padding or a rejected draft).
        size: slots written, the same for every row.
        positions: (rows,) int64, each row's kept tokens in the cache (the
            position of its next token).
    """

    def __init__(self) -> None:
        self.valid = np.zeros((0, SLOT_BLOCK), bool)
        self.size = 0
        self.positions = np.zeros(0, np.int64)
        self._offset: mx.array | None = None
        #: (rows, n) int32 per-token RoPE offsets (``position - slot``) of a
        #: pass of draft trees while it is built; None for a causal pass
        self.tree_offsets: mx.array | None = None
        #: (rows, n, n) bool ancestor matrices of that pass (None: causal)
        self.anc: np.ndarray | None = None

    @property
    def rows(self) -> int:
        return len(self.positions)

    @property
    def offset(self) -> mx.array:
        """(rows,) int32: each row's position of the first token of the pass."""
        if self._offset is None:
            self._offset = mx.array(self.positions.astype(np.int32))
        return self._offset

    def mask(self, n: int, anc: np.ndarray | None = None) -> mx.array:
        """(rows, 1, n, size + n) bool attention mask of a pass of ``n``
        tokens per row: the row's kept slots, then causal over the pass, or
        ``anc`` (rows, n, n) (slot j is slot i or one of its ancestors) for a
        pass of draft trees."""
        rows, size = self.rows, self.size
        m = np.empty((rows, n, size + n), bool)
        m[:, :, :size] = self.valid[:, None, :size]
        m[:, :, size:] = np.tril(np.ones((n, n), bool)) if anc is None else anc
        return mx.array(m[:, None])

    def _reserve(self, size: int) -> None:
        if size > self.valid.shape[1]:
            grown = -(-size // SLOT_BLOCK) * SLOT_BLOCK
            self.valid = np.pad(self.valid, ((0, 0), (0, grown - self.valid.shape[1])))

    def commit(self, keep: np.ndarray) -> None:
        """After a pass of ``width`` tokens per row: row ``r`` keeps the slots
        where ``keep[r]`` ((rows, width) bool; its first slot and its accepted
        path) is True; the rest are masked out."""
        width = keep.shape[1]
        self._reserve(self.size + width)
        self.valid[:, self.size : self.size + width] = keep
        self.positions = self.positions + keep.sum(axis=1)
        self.size += width
        self._offset = None
        self.tree_offsets = self.anc = None

    def common_tail(self) -> int:
        """Trailing slots no row keeps (they can be overwritten)."""
        if not self.rows:
            return self.size
        used = self.valid[:, : self.size].any(axis=0)
        last = np.flatnonzero(used)
        return self.size - (int(last[-1]) + 1 if len(last) else 0)


class BatchLayerCache:
    """One layer's KV cache of a drafting batch (mlx-lm's cache interface:
    ``offset``, ``update_and_fetch``, ``make_mask``).

    Keys and values are (rows, kv_heads, capacity, head_dim) in the model's
    dtype; the slots a pass writes start at the layout's ``size``.
    """

    def __init__(self, layout: BatchLayout):
        self.layout = layout
        self.keys: mx.array | None = None
        self.values: mx.array | None = None

    @property
    def offset(self) -> mx.array:
        lay = self.layout
        return lay.offset if lay.tree_offsets is None else lay.tree_offsets

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        start = self.layout.size
        end = start + keys.shape[2]
        if self.keys is None or end > self.keys.shape[2]:
            self._grow(end, keys, values)
        self.keys[..., start:end, :] = keys
        self.values[..., start:end, :] = values
        return self.keys[..., :end, :], self.values[..., :end, :]

    def _grow(self, size: int, keys: mx.array, values: mx.array) -> None:
        cap = -(-size // SLOT_BLOCK) * SLOT_BLOCK
        b, h, _, dk = keys.shape
        new_k = mx.zeros((b, h, cap, dk), keys.dtype)
        new_v = mx.zeros((b, h, cap, values.shape[3]), values.dtype)
        if self.keys is not None:
            n = self.layout.size
            new_k[..., :n, :] = self.keys[..., :n, :]
            new_v[..., :n, :] = self.values[..., :n, :]
        self.keys, self.values = new_k, new_v

    def make_mask(self, n: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        return self.layout.mask(n, self.layout.anc)

    def is_trimmable(self) -> bool:
        return False

    @property
    def state(self) -> tuple[Any, Any]:
        return self.keys, self.values


class BatchCache:
    """One model's KV cache over a batch's rows: a :class:`BatchLayout` and
    a :class:`BatchLayerCache` per layer (a :class:`DraftBatch` keeps one for
    the target and one for a draft model)."""

    def __init__(self, model: Any):
        self.layout = BatchLayout()
        self.caches = [BatchLayerCache(self.layout) for _ in make_prompt_cache(model)]

    def join(self, cache: list[KVCache], n: int) -> None:
        """Add a row whose ``n`` tokens (0 or more) a solo prefill left in
        ``cache`` (mlx-lm's per-layer caches), right-aligned with the
        others."""
        lay = self.layout
        pad = max(0, n - lay.size)
        if pad:  # the batch's slots shift right to make room
            lay._reserve(lay.size + pad)
            lay.valid = np.concatenate(
                [np.zeros((lay.rows, pad), bool), lay.valid[:, : lay.valid.shape[1] - pad]], axis=1
            )
        size = lay.size + pad
        for bc, c in zip(self.caches, cache):
            if n == 0:  # nothing cached yet: a row of padding
                if bc.keys is not None:
                    blank = mx.zeros_like(bc.keys[:1, :, :size])
                    bc.keys = mx.concatenate([bc.keys[..., :size, :], blank])
                    blank = mx.zeros_like(bc.values[:1, :, :size])
                    bc.values = mx.concatenate([bc.values[..., :size, :], blank])
                continue
            k, v = c.keys[..., :n, :], c.values[..., :n, :]
            row_k = mx.pad(k, [(0, 0), (0, 0), (size - n, 0), (0, 0)])
            row_v = mx.pad(v, [(0, 0), (0, 0), (size - n, 0), (0, 0)])
            if bc.keys is None and lay.rows:  # the rows before joined with nothing
                bc.keys = mx.zeros((lay.rows, *row_k.shape[1:]), row_k.dtype)
                bc.values = mx.zeros((lay.rows, *row_v.shape[1:]), row_v.dtype)
            if bc.keys is None:
                bc.keys, bc.values = row_k, row_v
            else:
                old_k, old_v = bc.keys[..., : lay.size, :], bc.values[..., : lay.size, :]
                if pad:
                    old_k = mx.pad(old_k, [(0, 0), (0, 0), (pad, 0), (0, 0)])
                    old_v = mx.pad(old_v, [(0, 0), (0, 0), (pad, 0), (0, 0)])
                bc.keys = mx.concatenate([old_k, row_k])
                bc.values = mx.concatenate([old_v, row_v])
        mx.eval([(bc.keys, bc.values) for bc in self.caches if bc.keys is not None])
        valid = np.zeros((1, lay.valid.shape[1]), bool)
        valid[0, size - n : size] = True
        lay.valid = np.concatenate([lay.valid, valid])
        lay.positions = np.append(lay.positions, n)
        lay.size = size
        lay._offset = None

    def keep(self, keep: list[int]) -> None:
        """Keep only the rows ``keep`` (indices, in order)."""
        lay = self.layout
        if not keep:
            self.layout = BatchLayout()
            for bc in self.caches:
                bc.layout, bc.keys, bc.values = self.layout, None, None
            return
        idx = mx.array(keep)
        lay.valid = lay.valid[keep]
        lay.positions = lay.positions[keep]
        lay._offset = None
        used = np.flatnonzero(lay.valid[:, : lay.size].any(axis=0))
        lead = int(used[0]) if len(used) else lay.size
        for bc in self.caches:
            if bc.keys is not None:
                bc.keys = bc.keys[idx][..., lead:, :]
                bc.values = bc.values[idx][..., lead:, :]
        if lead:
            lay.valid = np.pad(lay.valid[:, lead:], ((0, 0), (0, lead)))
            lay.size -= lead

    def due(self, at: float) -> bool:
        """Whether the slots exceed ``at`` times the longest row's kept tokens."""
        lay = self.layout
        return lay.size > 64 and lay.size > at * int(lay.positions.max())

    def compact(self) -> None:
        """Gather each row's kept slots to the right (one copy of the cache)."""
        lay = self.layout
        kept = lay.valid[:, : lay.size]
        counts = kept.sum(axis=1)
        size = int(counts.max())
        index = np.zeros((lay.rows, size), np.int32)
        valid = np.zeros((lay.rows, max(size, SLOT_BLOCK)), bool)
        for r in range(lay.rows):
            slots = np.flatnonzero(kept[r])
            index[r, size - len(slots) :] = slots
            valid[r, size - len(slots) : size] = True
        gather = mx.array(index)[:, None, :, None]
        for bc in self.caches:
            if bc.keys is not None:
                bc.keys = mx.take_along_axis(bc.keys[..., : lay.size, :], gather, axis=2)
                bc.values = mx.take_along_axis(bc.values[..., : lay.size, :], gather, axis=2)
        mx.eval([(bc.keys, bc.values) for bc in self.caches if bc.keys is not None])
        lay.valid, lay.size = valid, size


@dataclass
class BatchRow:
    """One request in a :class:`DraftBatch`.

    Attributes:
        uid: its id in the batch.
        context: prompt and generated tokens (int32), the lookup's source.
        length: tokens of ``context`` in use.
        prompt_tokens: the prompt's length.
        limit: new tokens it may still generate (the first included).
        last: its newest token, not yet in the cache (it opens the next pass).
        generated: tokens generated so far.
        drafted / accepted: draft tokens it proposed and had accepted.
        passes: forward passes it was in, after its prefill.
        slots / max_slots: its slots over those passes (its first token's
            counted as one) and the widest pass.
    """

    uid: int
    context: np.ndarray
    length: int
    prompt_tokens: int
    limit: int
    last: int
    generated: list[int] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    passes: int = 0
    slots: int = 1
    max_slots: int = 1

    def append(self, tokens: list[int]) -> None:
        end = self.length + len(tokens)
        if end > len(self.context):
            grown = np.zeros(max(end, 2 * len(self.context)), np.int32)
            grown[: self.length] = self.context[: self.length]
            self.context = grown
        self.context[self.length : end] = tokens
        self.length = end


@dataclass
class StepTokens:
    """What one request got from a step.

    Attributes:
        uid: the request.
        tokens: its new tokens, in order (1 to draft + 1).
        finish_reason: ``"stop"`` (an end-of-sequence token, the last of
            ``tokens``), ``"length"`` (its limit) or None.
    """

    uid: int
    tokens: list[int]
    finish_reason: str | None


@dataclass
class RowDraft:
    """One row's draft tree for a pass, best first (any prefix is a tree).

    Attributes:
        tokens: the draft nodes' token ids; node i is slot i + 1 of the pass
            (slot 0: the row's newest token, the root).
        parents: each node's parent slot (0: the root; before the node).
        values: each node's chance of being accepted (estimated).
        kinds: what proposed each node: ``("lookup", i)``, token i of the
            lookup's chain; ``("table", r)``, the table's rank-r candidate;
            ``("mask", r)``, a mask's rank-r candidate; ``("head", i)`` and
            ``("draft", i)``, token i of the heads' or a draft model's chain.
        ngram: the length of the lookup's matched n-gram (0: no match).
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    kinds: list[tuple[str, int]] = field(default_factory=list)
    ngram: int = 0


def check_batchable(model: Any) -> None:
    """Refuse a model whose layers do not all keep a full KV cache (sliding
    windows, state-space layers): their caches cannot mask rejected slots.

    Raises:
        UnsupportedModelError: naming the cache type.
    """
    kinds = {type(c).__name__ for c in make_prompt_cache(model)}
    if kinds != {"KVCache"}:
        raise UnsupportedModelError(
            f"drafting inside a batch needs a full KV cache in every layer; this model uses "
            f"{', '.join(sorted(kinds))}. Decode it one request at a time, or batched with "
            "method ntp."
        )


def check_mask_support(model: Any) -> None:
    """Refuse a model that cannot take mask slots in a batch: its family
    runs no draft tree, or it takes no input embeddings.

    Raises:
        UnsupportedModelError: naming what it lacks.
    """
    check_tree_support(model, "probe")
    if not does_model_support_input_embeddings(model):
        mtype = getattr(model, "model_type", type(model).__name__)
        raise UnsupportedModelError(
            f"probe's mask slots need a model that takes input embeddings; mlx-lm's "
            f"{mtype} does not. Use method pld or recycle for a drafting batch."
        )


class Prefill:
    """A prompt through a model alone, in chunks: each :meth:`advance` runs
    the backbone over the next ``step`` tokens into the prompt's mlx-lm
    caches; once every token is in, :attr:`logits` are those (V,) after the
    last token (the LM head on its hidden state only: over every prompt
    token it would be a fifth of SmolLM2's prefill and most of Gemma 3
    270M's, a vocabulary of 262k rows, for logits nobody reads) and, with
    ``hidden``, :attr:`hidden` the final-norm hidden states (n, D) after
    every token.

    Args:
        model: an mlx-lm model.
        tokens: the prompt's token ids (at least one).
        hidden: keep every token's hidden state (an MTP layer reads them).
    """

    def __init__(self, model: Any, tokens: list[int], hidden: bool = False):
        self.backbone, self.head, _ = model_parts(model)
        self.tokens = tokens
        self.cache = make_prompt_cache(model)
        self.keep_hidden = hidden
        #: prompt tokens in the cache so far
        self.done = 0
        self._states: list[mx.array] = []
        self.logits: mx.array | None = None
        self.hidden: mx.array | None = None

    @property
    def finished(self) -> bool:
        """Whether every prompt token is in the cache."""
        return self.done >= len(self.tokens)

    def advance(self, step: int) -> bool:
        """Run the next ``step`` prompt tokens (their cache evaluated; the
        last chunk's logits left lazy); whether the prompt is now in."""
        chunk = mx.array(self.tokens[self.done : self.done + step])[None]
        self._states.append(self.backbone(chunk, cache=self.cache)[0])
        self.done += chunk.shape[1]
        if not self.finished:
            mx.eval([c.state for c in self.cache], self._states if self.keep_hidden else [])
            if not self.keep_hidden:
                self._states.clear()
            return False
        self.logits = self.head(self._states[-1][None, -1:])[0, -1]
        if self.keep_hidden:
            self.hidden = mx.concatenate(self._states)
        self._states = []
        return True

    def run(self, step: int) -> Prefill:
        """Every remaining chunk of ``step`` tokens, at once; itself."""
        while not self.advance(step):
            pass
        return self


def _left_aligned(tokens: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """``(inputs, real)``: each row's tokens at the start of a (rows, width)
    int32 pass, padded after them (with id 0: padding is never kept and its
    logits are not read), and a (rows, width) bool of the slots that hold
    one of the row's tokens."""
    width = max(map(len, tokens))
    inputs = np.zeros((len(tokens), width), np.int32)
    real = np.zeros((len(tokens), width), bool)
    for r, toks in enumerate(tokens):
        inputs[r, : len(toks)] = toks
        real[r, : len(toks)] = True
    return inputs, real


class BatchDrafter:
    """A draft model's greedy chains for every row of a :class:`DraftBatch`
    (speculative decoding with a draft model, Leviathan et al., 2023;
    mlx-lm's ``--draft-model`` loop, here over a batch).

    The draft model keeps its own batched cache (:class:`BatchCache`, rows
    in the batch's order). Each row also keeps the committed tokens the
    draft model has not seen yet (its pending tokens: the root, and after a
    step that accepted every draft the last draft too, or the tokens of
    steps that sent none). :meth:`draft` feeds every row's pending tokens in
    one pass and then its newest draft, ``depth`` passes in all, queued one
    behind the other and read in one synchronisation; :meth:`settle` masks
    the drafts the target rejected out of the draft cache.

    Args:
        model: the draft model (an mlx-lm model of the target's tokenizer,
            a full KV cache in every layer).
        prefill_step: prompt tokens per prefill pass.

    Raises:
        UnsupportedModelError: see :func:`check_batchable`.
    """

    def __init__(self, model: Any, prefill_step: int = PREFILL_STEP):
        check_batchable(model)
        self.model = model
        self.backbone, self.head, _ = model_parts(model)
        self.prefill_step = prefill_step
        self.kv = BatchCache(model)
        #: the device clock (the batch's: :class:`DraftBatch` sets it) and
        #: this model's pass time in the target's one-token passes
        self.clock: DeviceClock = make_clock()
        self.share = 1.0
        #: per row: committed tokens not in the draft cache yet
        self.pending: list[list[int]] = []
        #: seconds per draft pass by rows: an exponential average
        self.seconds: dict[int, float] = {}
        self._share: float | None = None

    def weight_share(self, target: Any) -> float:
        """The draft model's parameter bytes over the target's."""
        if self._share is None:
            self._share = weight_bytes(self.model) / max(weight_bytes(target), 1)
        return self._share

    def add(self, tokens: list[int], first: int) -> None:
        """A row joins: its prompt prefilled alone; ``first`` is pending."""
        self.kv.join(Prefill(self.model, tokens).run(self.prefill_step).cache, len(tokens))
        self.pending.append([first])

    def keep(self, keep: list[int]) -> None:
        """Keep only the rows ``keep`` (indices, in order)."""
        self.pending = [self.pending[i] for i in keep]
        self.kv.keep(keep)

    def draft(self, depth: int) -> np.ndarray:
        """(rows, depth) int64: each row's greedy chain of ``depth`` tokens
        after its pending ones."""
        if self.kv.due(2.0):
            self.kv.compact()
        self._catch_up()
        lay = self.kv.layout
        rows = lay.rows
        inputs, keep = _left_aligned(self.pending)
        t0 = self.clock.now()
        h = self.backbone(mx.array(inputs), cache=self.kv.caches)
        lay.commit(keep)
        last = mx.array(keep.sum(axis=1) - 1)
        h = mx.take_along_axis(h, last[:, None, None], axis=1)  # (rows, 1, D)
        tokens = [mx.argmax(self.head(h)[:, -1], axis=-1)]
        for _ in range(depth - 1):
            h = self.backbone(tokens[-1][:, None], cache=self.kv.caches)
            lay.commit(np.ones((rows, 1), bool))
            tokens.append(mx.argmax(self.head(h)[:, -1], axis=-1))
        out = mx.stack(tokens, axis=1)
        _run(self.clock, [out], rows, depth * self.share)
        _average(self.seconds, rows, (self.clock.now() - t0) / depth)
        return np.array(out).astype(np.int64)

    def _catch_up(self) -> None:
        """Feed the pending tokens of steps that drafted nothing, all but each
        row's newest two, in passes of at most ``CATCH_UP`` tokens per row (so
        that the drafting passes stay narrow and their measured time is
        theirs)."""
        while max(map(len, self.pending)) > 2:
            lay = self.kv.layout
            feed = [
                toks[: min(len(toks) - 2, CATCH_UP)] if len(toks) > 2 else []
                for toks in self.pending
            ]
            inputs, keep = _left_aligned(feed)
            self.backbone(mx.array(inputs), cache=self.kv.caches)
            kv = [a for c in self.kv.caches for a in (c.keys, c.values)]
            _run(self.clock, kv, inputs.size, self.share)
            lay.commit(keep)
            lay.size -= lay.common_tail()
            self.pending = [toks[len(f) :] for toks, f in zip(self.pending, feed)]

    def settle(self, depth: int, accepted: np.ndarray, new: list[list[int]]) -> None:
        """After the target's pass: row ``r`` accepted its first
        ``accepted[r]`` drafts of :meth:`draft`'s ``depth`` (0 when it
        drafted none) and committed ``new[r]``. The draft cache holds the
        first ``depth - 1`` drafts; those past a row's accepted ones are
        masked out, and its committed tokens not in the cache are pending."""
        lay = self.kv.layout
        held = depth - 1 if depth else 0
        for r in range(lay.rows):
            a = min(int(accepted[r]), held)
            if held > a:
                lay.valid[r, lay.size - held + a : lay.size] = False
                lay.positions[r] -= held - a
            seen = a if depth else 0
            self.pending[r] = ([] if depth else self.pending[r]) + new[r][seen:]
        lay._offset = None
        lay.size -= lay.common_tail()


class BatchNative:
    """A checkpoint's own MTP layer drafting greedy chains for every row of
    a :class:`DraftBatch` (``mtp``; DeepSeek-V3 §2.2's ``nextn`` layer,
    :mod:`mlx_mtp.native_mtp`: the other families with an MTP layer have
    state-space layers, which no drafting batch runs). It takes the place
    of a :class:`BatchDrafter` (its :meth:`add` and :meth:`settle` also
    take the target's hidden states).

    The layer keeps its own batched KV cache over the pairs ``(h_i,
    t_{i+1})`` of each row's committed positions (the target's final-norm
    hidden state at i, the token committed after it). The pairs of the
    positions a step committed wait (pending) until the next draft, which
    feeds every row's pending pairs in one pass: the layer's output at each
    row's last pair, through the target's LM head, is draft 1; depths 2..k
    re-feed the layer its own output with the token it drafted, and those
    speculative entries leave the layer's cache after the draft.

    Args:
        layer: the loaded MTP layer (:func:`~mlx_mtp.native_mtp.load_native_mtp`).
        model: the target model it belongs to.
        prefill_step: prompt pairs per pass when a row joins.

    Raises:
        UnsupportedModelError: see :func:`check_batchable` (the target).
    """

    def __init__(self, layer: Any, model: Any, prefill_step: int = PREFILL_STEP):
        check_batchable(model)
        install_positional_rope(layer)
        self.layer = layer
        self.prefill_step = prefill_step
        _, self.head, self.embed = model_parts(model)
        self.kv = BatchCache(layer)
        self.clock: DeviceClock = make_clock()
        self.share = draft_cost_of(layer, model)
        #: per row: (hidden states (P, D), the P tokens committed after them)
        self.pending: list[list[tuple[mx.array, list[int]]]] = []
        #: seconds per draft pass by rows: an exponential average
        self.seconds: dict[int, float] = {}

    def weight_share(self, target: Any) -> float:
        """One draft's time in the target's one-token passes (the layer's
        and the LM head's weight bytes over the target's)."""
        return self.share

    def add(self, tokens: list[int], first: int, hidden: mx.array) -> None:
        """A row joins: the pairs of its prompt (``hidden`` (n, D), the
        target's states after each prompt token) fed alone, in passes of
        ``prefill_step`` pairs; the pair of its last prompt token and
        ``first`` pending."""
        n, step = len(tokens), self.prefill_step
        cache = self.layer.make_cache()
        for s in range(0, n - 1, step):
            e = self.embed(mx.array(tokens[1 + s : 1 + s + step]))
            self.layer(hidden[None, s : min(s + step, n - 1)], e[None], cache)
            mx.eval([c.state for c in cache])
        self.kv.join(cache, n - 1)
        self.pending.append([(hidden[n - 1 :], [first])])

    def keep(self, keep: list[int]) -> None:
        """Keep only the rows ``keep`` (indices, in order)."""
        self.pending = [self.pending[i] for i in keep]
        self.kv.keep(keep)

    def _feed(self, pairs: list[list[tuple[mx.array, list[int]]]]) -> mx.array:
        """Every row's ``pairs`` through the layer in one pass (padded after
        them; a row may have none): (rows, D) the output at each row's last
        pair (lazy)."""
        if self.kv.due(2.0):
            self.kv.compact()
        toks = [[t for _, ts in p for t in ts] for p in pairs]
        inputs, keep = _left_aligned(toks)
        width = inputs.shape[1]
        some = next(h for p in pairs for h, _ in p)
        rows = [
            mx.concatenate([h for h, _ in p]) if p else mx.zeros((0, some.shape[-1]), some.dtype)
            for p in pairs
        ]
        h = mx.stack([mx.pad(x, [(0, width - x.shape[0]), (0, 0)]) for x in rows])
        out = self.layer(h, self.embed(mx.array(inputs)), self.kv.caches)
        self.kv.layout.commit(keep)
        last = mx.array(np.maximum(keep.sum(axis=1) - 1, 0))
        return mx.take_along_axis(out, last[:, None, None], axis=1)[:, 0]

    def draft(self, depth: int) -> np.ndarray:
        """(rows, depth) int64: each row's chain of ``depth`` tokens after
        its newest one (``depth`` >= 1; every row has a pending pair)."""
        rows = len(self.pending)
        t0 = self.clock.now()
        last = self._feed(self.pending)
        self.pending = [[] for _ in range(rows)]
        tokens = [mx.argmax(self.head(last), axis=-1)]
        lay = self.kv.layout
        for _ in range(depth - 1):
            last = self.layer(last[:, None], self.embed(tokens[-1])[:, None], self.kv.caches)[:, 0]
            lay.commit(np.ones((rows, 1), bool))
            tokens.append(mx.argmax(self.head(last), axis=-1))
        out = mx.stack(tokens, axis=1)
        _run(self.clock, [out], rows, depth * self.share)
        if depth > 1:  # the speculative entries leave the layer's cache
            lay.valid[:, lay.size - depth + 1 : lay.size] = False
            lay.positions = lay.positions - (depth - 1)
            lay.size -= depth - 1
            lay._offset = None
        _average(self.seconds, rows, (self.clock.now() - t0) / depth)
        return np.array(out).astype(np.int64)

    def settle(
        self,
        depth: int,
        accepted: np.ndarray,
        new: list[list[int]],
        hidden: list[mx.array] | None = None,
    ) -> None:
        """After the target's pass: row ``r`` committed ``new[r]`` after the
        slots whose hidden states are ``hidden[r]`` (its root and accepted
        slots, in order); those pairs are pending. Once a row's pairs pile
        up past ``CATCH_UP`` (steps that drafted nothing), every row's
        pairs but its newest are fed without a draft (the newest stays for
        the next draft to start from)."""
        for r, (toks, h) in enumerate(zip(new, hidden or [])):
            self.pending[r].append((h, toks))
        if max(sum(len(t) for _, t in p) for p in self.pending) <= CATCH_UP:
            return
        older, newest = [], []
        for p in self.pending:
            h, toks = p[-1]
            older.append([*p[:-1], *([(h[:-1], toks[:-1])] if len(toks) > 1 else [])])
            newest.append([(h[-1:], toks[-1:])])
        out = self._feed(older)
        self.pending = newest
        kv = [a for c in self.kv.caches for a in (c.keys, c.values)]
        _run(self.clock, [out, *kv], len(newest), self.share)


class _AfterPass:
    """Seconds of a source's device work after each pass (reading mask
    candidates, running heads), by rows: exponential averages."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}

    def cost(self, rows: int) -> float:
        """Seconds for ``rows`` rows (the nearest measured row count's; 0
        before any)."""
        if not self.seconds:
            return 0.0
        return self.seconds[min(self.seconds, key=lambda n: abs(n - rows))]

    def _note(self, rows: int, seconds: float) -> None:
        _average(self.seconds, rows, seconds)


class BatchMasks(_AfterPass):
    """ESP's mask slots for the rows of a :class:`DraftBatch` (Goel et al.,
    arXiv 2603.17942, §3.1-3.2).

    Each row keeps ``k`` mask vectors in the input-embedding space: the mean
    embedding of its prompt, moved towards each token it commits
    (``m <- m + lam (e - m)``). A masked pass puts the ``k`` masks after
    every token slot of every row; after verification the masks after each
    row's deepest accepted slot give its next tree's candidates
    (:attr:`cands`): the ``top`` best ids of mask ``d`` for depth ``d``, hung
    under every node of depth ``d - 1`` (:meth:`DraftBatch._tree`).

    Args:
        embed: the model's token embedding (ids -> (..., D), before any
            scale the backbone applies).
        k: masks after a token slot (1..3).
        top: candidates kept per depth.
        lam: the vectors' update step.
    """

    def __init__(self, embed: Any, k: int = 1, top: int = 4, lam: float = 0.1):
        super().__init__()
        self.embed, self.k, self.top, self.lam = embed, k, top, lam
        #: (rows, k, D) every row's mask vectors (lazy), None before a row
        self.vec: mx.array | None = None
        #: per row: (k, top) candidate ids from its last masked pass, or None
        self.cands: list[np.ndarray | None] = []
        # the rank-r candidate of mask d right, given its parent was: [right, tried]
        self.rates = np.array(
            [
                [[f * PROBE_RANK_PRIORS[min(r, 7)], 1.0] for r in range(top)]
                for f in (1.0, 0.6, 0.4)[:k]
            ]
        )

    def add(self, prompt: list[int]) -> None:
        """A row joins: its vectors from its prompt's mean embedding."""
        mean = mx.mean(self.embed(mx.array(prompt)), axis=0)
        row = mx.broadcast_to(mean, (1, self.k, mean.shape[0]))
        self.vec = row if self.vec is None else mx.concatenate([self.vec, row])
        self.cands.append(None)

    def keep(self, keep: list[int]) -> None:
        """Keep only the rows ``keep`` (indices, in order)."""
        self.vec = self.vec[mx.array(keep, dtype=mx.int32)] if keep else None
        self.cands = [self.cands[i] for i in keep]

    def inputs(self, tokens: mx.array) -> mx.array:
        """(rows, n (1 + k), D) input embeddings of a masked pass: the token
        slots ``tokens`` (rows, n), then each row's k masks after each of
        them (mask j after slot i at ``n + i k + j``)."""
        n = tokens.shape[1]
        masks = mx.tile(self.vec, (1, n, 1))
        emb = self.embed(tokens)
        return mx.concatenate([emb, masks.astype(emb.dtype)], axis=1)

    def read(self, head: Any, h: mx.array, at: np.ndarray, clock: DeviceClock, cost: float) -> None:
        """The next candidates: ``at`` (rows, k) flat slots of ``h`` (rows x
        width, D) holding the masks after each row's deepest accepted slot
        (``cost``: the LM head's time in one-token passes)."""
        t0 = clock.now()
        logits = head(h[mx.array(at.ravel())])
        top = top_tokens(logits, self.top)
        _run(clock, [top, self.vec], at.size, cost)
        self.cands = list(np.array(top).reshape(len(at), self.k, -1))
        self._note(len(at), clock.now() - t0)

    def update(self, new: list[list[int]]) -> None:
        """Each row committed its ``new`` tokens: its vectors move towards
        each, ``m <- m + lam (e - m)`` in order (in closed form, all rows in
        one graph)."""
        n, lam = max(map(len, new)), self.lam
        toks = np.zeros((len(new), n), np.int32)
        w = np.zeros((len(new), 1, n), np.float32)
        decay = np.empty((len(new), 1, 1), np.float32)
        for r, t in enumerate(new):
            toks[r, : len(t)] = t
            w[r, 0, : len(t)] = lam * (1 - lam) ** np.arange(len(t) - 1, -1, -1)
            decay[r] = (1 - lam) ** len(t)
        e = self.embed(mx.array(toks))  # (rows, n, D)
        dt = self.vec.dtype
        self.vec = mx.array(decay, dt) * self.vec + mx.array(w, dt) @ e

    def q(self) -> np.ndarray:
        """(k, top): the estimated rate of each depth and rank."""
        return self.rates[:, :, 0] / self.rates[:, :, 1]

    def typical(self, room: int) -> np.ndarray:
        """Cumulative expected accepted tokens of the best 0..``room`` nodes
        of a row's mask tree under the current rates (the same for any row
        with candidates): (room + 1,) float."""
        q = self.q()
        heap = [(-q[0, r], 0) for r in range(self.top)]
        heapq.heapify(heap)
        values = []
        while heap and len(values) < room:
            v, d = heapq.heappop(heap)
            values.append(-v)
            if d + 1 < min(self.k, room):
                for r in range(self.top):
                    heapq.heappush(heap, (v * q[d + 1, r], d + 1))
        values += [0.0] * (room - len(values))  # a tree can hold no more nodes
        return np.cumsum([0.0, *values])


class BatchHeads(_AfterPass):
    """CLP's MTP heads for the rows of a :class:`DraftBatch` (Xie & Zhou,
    arXiv 2606.10935, "backbone as architect"): after a pass, head ``j`` at
    each row's deepest accepted slot (its final-norm hidden state ``h`` and
    the input embedding of its bonus token) writes the token ``j + 1``
    places after the bonus, and the span predictor on ``h`` says how many of
    the ``k`` to keep: the row's draft chain for the next step.

    Args:
        heads: a :class:`~mlx_mtp.clp_format.CLPHeads` loaded for the model.
        embed: the model's token embedding.
    """

    def __init__(self, heads: Any, embed: Any):
        super().__init__()
        self.heads, self.embed, self.k = heads, embed, heads.k
        #: per row: its chain for the next step, or None (no heads ran)
        self.chains: list[list[int] | None] = []
        # head j's token right, given the one before it was: [right, tried]
        self.rates = np.array([[0.5 * 0.8**j, 1.0] for j in range(self.k)])
        #: mean length of the kept span (exponential average)
        self.span = float(self.k)

    def add(self) -> None:
        """A row joins (no chain before its first pass)."""
        self.chains.append(None)

    def keep(self, keep: list[int]) -> None:
        """Keep only the rows ``keep`` (indices, in order)."""
        self.chains = [self.chains[i] for i in keep]

    def typical(self, room: int) -> np.ndarray:
        """Cumulative expected accepted tokens of the first 0..``room``
        tokens of a row's chain: the measured rates along it, times the
        share of chains kept that long."""
        q = np.cumprod(self.rates[:, 0] / self.rates[:, 1])[:room]
        kept = np.clip(self.span - np.arange(len(q)), 0.0, 1.0)
        return np.cumsum([0.0, *(q * kept)])

    def drafts(self, rooms: list[int]) -> list[RowDraft]:
        """Each row's chain as its draft (cut to its room), each token valued
        by the measured rates along it."""
        q = np.cumprod(self.rates[:, 0] / self.rates[:, 1])
        out = []
        for chain, room in zip(self.chains, rooms):
            c = (chain or [])[: max(room, 0)]
            n = len(c)
            out.append(RowDraft(c, list(range(n)), q[:n].tolist(), [("head", i) for i in range(n)]))
        return out

    def read(
        self, head: Any, h: mx.array, bonus: list[int], clock: DeviceClock, cost: float
    ) -> None:
        """The next chains from ``h`` (rows, D), the hidden states at each
        row's deepest accepted slot, whose next tokens are ``bonus``
        (``cost``: the heads' time in one-token passes)."""
        t0 = clock.now()
        x = self.heads.head_logits(h, self.embed(mx.array(bonus)), head)  # (k, rows, V)
        toks = mx.argmax(x, axis=-1).T
        span = mx.minimum(mx.argmax(self.heads.predictor(h.astype(mx.float32)), axis=-1), self.k)
        _run(clock, [toks, span], len(bonus), cost)
        spans = np.array(span).tolist()
        self.chains = [t[:s] for t, s in zip(np.array(toks).tolist(), spans)]
        self.span = 0.9 * self.span + 0.1 * float(np.mean(spans))
        self._note(len(bonus), clock.now() - t0)


class BatchLookahead:
    """Lookahead decoding's Jacobi window and n-gram pool for every row of a
    :class:`DraftBatch` (Fu et al., ICML 2024, arXiv 2402.02057, §3).

    Each row keeps ``window`` Jacobi columns of up to ``level - 1`` tokens
    (column ``j`` starts as one token drawn from the row's prompt) and its
    own n-gram pool. A pass that carries the lookahead branch puts the first
    ``w`` columns of every row after its token slots, column by column:
    level 0 of column ``j`` below level 0 of column ``j - 1`` (the first
    below the root), level ``l`` below level ``l - 1`` of its column (the
    paper's Fig. 2b attention, a tree), so the slot at level ``l`` of column
    ``j`` sits ``j + l + 1`` places after the root. The model's argmax after
    a column's last token is one Jacobi update of it: a column not yet
    ``level - 1`` long grows by it; a full one gives the n-gram of its
    tokens and the update to the pool (keyed by its first token, the newest
    ``guess`` per key) and shifts by one. The pool's n-grams after a row's
    newest token are its next draft (:meth:`tree`), verified like any other.

    Args:
        level: N, the n-gram size (>= 2).
        window: W, the most Jacobi columns per row (>= 1).
        guess: G, the pool's n-grams per key, all offered to the draft.
        seed: seed of the prompt tokens that start each row's columns.
    """

    def __init__(self, level: int = 5, window: int = 7, guess: int = 7, seed: int = 0):
        self.level, self.window, self.guess, self.seed = level, window, guess, seed
        #: per row: its W columns (lists of up to N - 1 token ids)
        self.cols: list[list[list[int]]] = []
        self.pools: list[NGramPool] = []
        # a pool token right: under the root, and after a right one: [right, tried]
        self.first = np.array([0.3, 1.0])
        self.next = np.array([0.6, 1.0])

    def add(self, prompt: list[int]) -> None:
        """A row joins: its columns start from tokens drawn from its prompt."""
        rng = np.random.default_rng(self.seed)
        self.cols.append([[int(t)] for t in rng.choice(np.asarray(prompt), size=self.window)])
        self.pools.append(NGramPool(self.guess))

    def keep(self, keep: list[int]) -> None:
        """Keep only the rows ``keep`` (indices, in order)."""
        self.cols = [self.cols[i] for i in keep]
        self.pools = [self.pools[i] for i in keep]

    def slots(self, w: int) -> int:
        """The most slots the first ``w`` columns take in any row."""
        return max(sum(len(c) for c in cols[:w]) for cols in self.cols)

    def branch(self, r: int, w: int, offset: int) -> tuple[list[int], list[int], list[int]]:
        """Row ``r``'s first ``w`` columns from slot ``offset`` on:
        ``(tokens, parent slots, slot of each column's last token)``."""
        tokens: list[int] = []
        parents: list[int] = []
        last: list[int] = []
        above = 0  # the slot level 0 of the next column hangs below
        for col in self.cols[r][:w]:
            top = offset + len(tokens)
            for i, t in enumerate(col):
                parents.append(above if i == 0 else offset + len(tokens) - 1)
                tokens.append(t)
            above = top
            last.append(offset + len(tokens) - 1)
        return tokens, parents, last

    def update(self, r: int, outs: list[int]) -> None:
        """Row ``r``'s first ``len(outs)`` columns got their Jacobi updates
        ``outs``: grow, or harvest an n-gram and shift."""
        pool = self.pools[r]
        for col, o in zip(self.cols[r], outs):
            if len(col) < self.level - 1:
                col.append(o)
                continue
            pool.add(col[0], (*col[1:], o))
            col[:] = [*col[1:], o]

    def tree(self, r: int, root: int, room: int) -> RowDraft:
        """Row ``r``'s draft: the trie of its pool's n-grams after ``root``,
        best first, at most ``room`` nodes; a node of depth ``d`` first
        proposed by the rank-``i`` n-gram (newest first) is worth
        ``first next^(d - 1) / 2^i`` (the n-grams are alternatives), the
        rates measured."""
        cands = self.pools[r].get(root, self.guess) if room > 0 else []
        p, q = self.first[0] / self.first[1], self.next[0] / self.next[1]
        tokens, parents, ranks = ranked_trie(cands)
        depth: list[int] = []
        for parent in parents:
            depth.append(1 if parent < 0 else depth[parent] + 1)
        values = [p * q ** (d - 1) * 0.5**i for d, i in zip(depth, ranks)]
        # a parent is worth at least its child and comes first on a tie
        order = sorted(range(len(tokens)), key=lambda n: -values[n])[:room]
        slot = {n: s + 1 for s, n in enumerate(order)}
        tree = RowDraft()
        for n in order:
            tree.tokens.append(tokens[n])
            tree.parents.append(0 if parents[n] < 0 else slot[parents[n]])
            tree.values.append(values[n])
            tree.kinds.append(("pool", ranks[n]))
        return tree


class DraftBatch:
    """Continuous batching with drafts verified in the batch's forward pass
    (greedy): prompt lookup, with a ``table`` token recycling, with
    ``masks`` ESP's mask slots; or, instead of lookup, a ``drafter``'s
    chains (a draft model's or an MTP layer's), CLP ``heads``' chains or
    ``lookahead``'s n-gram pool.

    A request joins with :meth:`add` (its prompt prefilled alone, at once,
    in chunks of ``prefill_step``, as a solo generation does), or with
    :meth:`begin` and then one chunk per :meth:`advance` between steps (the
    server: the other rows go on decoding), and leaves at EOS, its limit, or
    :meth:`remove`. Each :meth:`step` runs one forward pass of every
    row: its newest token and its draft (:meth:`_tree`), up to ``max_draft``
    nodes: the continuation of its context's last n-gram (n <= ``window``)
    seen earlier, and where ``table`` is given the table's candidates after
    the root and after every node, best first by their chance of being
    accepted (each pass then also writes the top ``table.k`` ids after each
    of its slots into the table, the kept slots last).

    The draft width of the pass (nodes per row) is chosen to maximise tokens
    per second: the expected accepted tokens of each width (a lookup's first
    token valued by its matched n-gram length, a later one by the measured
    rate of a right token after a right one; a table candidate by the
    measured rate of its rank, under the root or deeper, times its parent's
    value) over the measured time of a step of that many slots (rows x
    width: the step's host work, its drafts and layout, and its pass;
    measured here, on this machine; an unmeasured size is guessed from the
    measured ones (:meth:`_cost`), and is tried once where that guess
    wins).

    Args:
        model: an mlx-lm model with a full KV cache in every layer.
        eos: end-of-sequence token ids.
        window: longest n-gram the lookup matches.
        max_draft: most draft nodes per row and step (0: plain batched
            decoding).
        prefill_step: prompt tokens per prefill pass.
        max_slots: most tokens in one decoding pass (rows x width; a pass of
            one token per row is always allowed).
        table: token recycling's table (:class:`~mlx_mtp.sources.recycle.RecycleTable`,
            shared with later batches of the same model), or None: prompt
            lookup only.
        drafter: a draft model's :class:`BatchDrafter`, or a checkpoint's
            MTP layer's :class:`BatchNative` (instead of lookup): each row
            drafts its chain, the depth chosen by :meth:`_depth`.
        lookahead: lookahead decoding's :class:`BatchLookahead` (instead of
            lookup): each row drafts from its n-gram pool, and passes carry
            its Jacobi columns while they add little (:meth:`_columns`).
        masks: mask slots after every token slot (ESP, k in 0..3; 0: none):
            each row's tree also holds the candidates its last masks gave
            (:class:`BatchMasks`); passes carry masks while that wins
            (:meth:`_mask_width`, :meth:`_runs`).
        lookup: whether rows draft by prompt lookup (False: probe's trees
            of mask candidates alone).
        heads: CLP heads (:class:`~mlx_mtp.clp_format.CLPHeads`; instead of
            lookup): each row drafts the chain its heads wrote
            (:class:`BatchHeads`, :meth:`_head_plan`).

    Raises:
        UnsupportedModelError: see :func:`check_batchable`; with a ``table``,
            a model whose family cannot run a draft tree
            (:func:`~mlx_mtp.families.check_tree_support`); with ``masks``,
            see :func:`check_mask_support`.
        InvalidArgumentError: a ``drafter``, ``heads`` or ``lookahead``
            with another source; ``masks`` outside 0..3.
    """

    def __init__(
        self,
        model: Any,
        eos: set[int],
        *,
        window: int = 3,
        max_draft: int = 4,
        prefill_step: int = PREFILL_STEP,
        max_slots: int = 1024,
        table: RecycleTable | None = None,
        drafter: BatchDrafter | BatchNative | None = None,
        masks: int = 0,
        lookup: bool = True,
        heads: Any = None,
        lookahead: BatchLookahead | None = None,
    ):
        check_batchable(model)
        alone = sum(x is not None for x in (drafter, heads, lookahead))
        if alone and (table is not None or masks > 0):
            raise InvalidArgumentError(
                "a batch with a draft model, heads or lookahead drafts from it alone"
            )
        if alone > 1:
            raise InvalidArgumentError(
                "a batch drafts from one of a draft model, heads and lookahead"
            )
        if isinstance(masks, bool) or not isinstance(masks, int) or not 0 <= masks <= 3:
            raise InvalidArgumentError(f"masks must be an integer in [0, 3], got {masks!r}")
        self.lookup = lookup
        self.drafter = drafter
        # a draft model's token right: the first, and one after a right one
        self.draft_first = np.array([0.6, 1.0])
        self.draft_next = np.array([0.7, 1.0])
        self.model = model
        self.backbone, self.head, embed = model_parts(model)
        self.eos = set(eos)
        self.window = window
        self.max_draft = max_draft
        self.prefill_step = prefill_step
        self.max_slots = max_slots
        self.kv = BatchCache(model)
        self.rows: list[BatchRow] = []
        #: prompts prefilled a chunk at a time before they join (:meth:`begin`):
        #: (uid, limit, prefill), oldest first
        self.joining: list[tuple[int, int, Prefill]] = []
        #: rows that finished (EOS or their limit), by uid
        self.finished: dict[int, BatchRow] = {}
        self._uid = 0
        # first draft token right, by matched n-gram length (1..window): [right, tried]
        priors = [0.23, 0.43, 0.69] + [0.69] * max(0, window - 3)
        self.first = np.array([[p, 1.0] for p in priors[:window]])
        # a draft token right after a right one: [right, tried]
        self.next = np.array([0.8, 1.0])
        self.table = table
        if table is not None:  # the table's trees need a position per slot
            check_tree_support(model, "recycle")
        k = table.k if table is not None else 0
        # a table candidate of rank r right, given its parent was: under the
        # root (``table_root[r]``) and deeper (``table_deep[r]``): [right, tried]
        self.table_root = np.array([[RANK_PRIORS[min(r, 7)], 1.0] for r in range(k)])
        self.table_deep = np.array([[DEEP_PRIORS[min(r, 7)], 1.0] for r in range(k)])
        #: the device clock (a simulated device's in a simulated benchmark)
        self.clock = make_clock()
        # the LM head's and the heads' time, in one-token passes (memory-bound:
        # their weight bytes over the model's)
        total = max(weight_bytes(model), 1)
        self._head_share = weight_bytes(embed) / total
        self.heads = BatchHeads(heads, embed) if heads is not None else None
        if heads is not None:
            self._heads_share = heads.k * self._head_share + weight_bytes(heads) / total
        if drafter is not None:
            drafter.clock = self.clock
            drafter.share = drafter.weight_share(model)
        self.look = lookahead
        if lookahead is not None:  # the Jacobi branch is a tree
            check_tree_support(model, "lookahead")
        self.masks: BatchMasks | None = None
        if masks > 0:
            check_mask_support(model)
            self.masks = BatchMasks(embed, masks)
        # seconds per step by slots (rows x width; its host work and its
        # pass): exponential averages
        self.seconds: dict[int, float] = {}
        #: slots of the last pass (rows x width)
        self.last_slots = 0
        #: seconds that passes with masks or heads may still lose, and that
        #: probes of them may spend (:meth:`_runs`)
        self._credit = self._probes = 0.0
        self._probing = False
        #: the cache is compacted when its slots exceed this many times the
        #: longest row's kept tokens
        self.compact_at = 2.0

    #: the methods a batch drafts for (:meth:`for_method`)
    METHODS = ("pld", "recycle", "draft", "probe", "hybrid", "clp", "lookahead", "mtp")

    @classmethod
    def for_method(
        cls,
        model: Any,
        eos: set[int],
        method: str,
        *,
        table: RecycleTable | None = None,
        draft_model: Any = None,
        heads: Any = None,
        native: Any = None,
        **kw: Any,
    ) -> DraftBatch:
        """The batch that drafts as ``method`` does: ``pld`` (lookup
        chains), ``recycle`` (and ``table``'s trees; a new table if None),
        ``draft`` (``draft_model``'s chains), ``probe`` (ESP mask slots),
        ``hybrid`` (lookup chains and mask slots), ``clp`` (``heads``'
        chains), ``lookahead`` (Jacobi columns and their n-gram pool: N =
        5, up to W = 7 columns, as many per pass as :meth:`_columns`
        chooses, G = 7) or ``mtp`` (``native``,
        the checkpoint's MTP layer, :class:`BatchNative`); ``kw`` as
        :class:`DraftBatch` takes them.

        Raises:
            InvalidArgumentError: another method, or ``draft`` / ``clp`` /
                ``mtp`` without their draft model / heads / MTP layer.
            UnsupportedModelError: as :class:`DraftBatch`.
        """
        if method not in cls.METHODS:
            raise InvalidArgumentError(
                f"a drafting batch runs {', '.join(cls.METHODS)}, not {method!r}"
            )
        needs = {"draft": ("draft model", draft_model), "clp": ("heads", heads),
                 "mtp": ("MTP layer", native)}  # fmt: skip
        if method in needs and needs[method][1] is None:
            raise InvalidArgumentError(f"a {method} batch needs its {needs[method][0]}")
        drafter = None
        if method == "draft":
            drafter = BatchDrafter(draft_model, kw.get("prefill_step", PREFILL_STEP))
        if method == "mtp" and kw.get("max_draft", 4):
            drafter = BatchNative(native, model, kw.get("prefill_step", PREFILL_STEP))
        if method == "recycle" and table is None:
            table = RecycleTable()
        return cls(
            model,
            eos,
            table=table if method == "recycle" else None,
            drafter=drafter,
            masks=1 if method in ("probe", "hybrid") else 0,
            lookup=method not in ("probe", "lookahead"),
            heads=heads if method == "clp" else None,
            lookahead=BatchLookahead() if method == "lookahead" else None,
            **kw,
        )

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, tokens: list[int], limit: int) -> tuple[int, StepTokens]:
        """Prefill a prompt alone, now, in chunks of ``prefill_step``, and
        add it to the batch.

        Args:
            tokens: the prompt's token ids.
            limit: most new tokens (>= 1).

        Returns:
            Its uid and its first token (``finish_reason`` set if it is
            already done: EOS, or a limit of 1; it is then not in the batch).
        """
        self._uid += 1
        p = Prefill(self.model, tokens, isinstance(self.drafter, BatchNative))
        return self._uid, self._join(self._uid, limit, p.run(self.prefill_step))

    def begin(self, tokens: list[int], limit: int) -> int:
        """Queue a prompt to join: :meth:`advance` prefills it a chunk at a
        time, between the batch's steps, so that the rows already decoding
        go on while it is prefilled (as mlx-lm's ``BatchGenerator`` does
        with a joining prompt). Prompts join in the order they began.

        Args:
            tokens: the prompt's token ids.
            limit: most new tokens (>= 1).

        Returns:
            Its uid (its first token comes from :meth:`advance`).
        """
        self._uid += 1
        native = isinstance(self.drafter, BatchNative)
        self.joining.append((self._uid, limit, Prefill(self.model, tokens, native)))
        return self._uid

    def advance(self, step: int | None = None) -> StepTokens | None:
        """Prefill the next chunk (``step`` tokens; default ``prefill_step``)
        of the oldest prompt that :meth:`begin` queued; when that was its
        last chunk, the prompt joins the batch and its first token is
        returned (as :meth:`add` returns it), else None."""
        if not self.joining:
            return None
        uid, limit, p = self.joining[0]
        if not p.advance(step or self.prefill_step):
            return None
        self.joining.pop(0)
        return self._join(uid, limit, p)

    def _join(self, uid: int, limit: int, p: Prefill) -> StepTokens:
        """A prefilled prompt joins as row ``uid``: its first token, and
        the drafters' state for it."""
        tokens = p.tokens
        first = int(mx.argmax(p.logits).item())
        if first in self.eos or limit <= 1:
            return StepTokens(uid, [first], "stop" if first in self.eos else "length")
        context = np.zeros(max(64, 2 * (len(tokens) + limit)), np.int32)
        row = BatchRow(uid, context, 0, len(tokens), limit - 1, first, [first])
        row.append([*tokens, first])
        self.kv.join(p.cache, len(tokens))
        if isinstance(self.drafter, BatchNative):
            self.drafter.add(tokens, first, p.hidden)
        elif self.drafter is not None:
            self.drafter.add(tokens, first)
        if self.masks is not None:
            self.masks.add([*tokens, first])
        if self.heads is not None:
            self.heads.add()
        if self.look is not None:
            self.look.add(tokens)
        self.rows.append(row)
        return StepTokens(uid, [first], None)

    def take_row(self, uid: int) -> BatchRow | None:
        """A request's row with its counts (None: unknown uid), forgotten
        once it has finished."""
        if uid in self.finished:
            return self.finished.pop(uid)
        return next((r for r in self.rows if r.uid == uid), None)

    def remove(self, uid: int) -> None:
        """Drop a request from the batch, or from the prompts waiting to
        join it (no effect if it is in neither)."""
        self.joining = [j for j in self.joining if j[0] != uid]
        keep = [i for i, r in enumerate(self.rows) if r.uid != uid]
        if len(keep) == len(self.rows):
            return
        self._keep(keep)

    def _keep(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]
        self.kv.keep(keep)
        if self.drafter is not None:
            self.drafter.keep(keep)
        if self.masks is not None:
            self.masks.keep(keep)
        if self.heads is not None:
            self.heads.keep(keep)
        if self.look is not None:
            self.look.keep(keep)

    def _compact(self) -> None:
        self.kv.compact()

    def _drafts(self, masks: bool = False) -> list[RowDraft]:
        """Each row's draft tree (:meth:`_tree`); ``masks``: with its mask
        candidates."""
        out = []
        for r, row in enumerate(self.rows):
            room = min(self.max_draft, row.limit - 1)
            d, n = (
                lookup_match(row.context[: row.length], self.window, room)
                if room > 0 and self.lookup
                else ([], 0)
            )
            cands = self.masks.cands[r] if masks else None
            out.append(self._tree(row.last, d, n, room, cands))
        return out

    def _tree(
        self, root: int, chain: list[int], n: int, room: int, cands: np.ndarray | None = None
    ) -> RowDraft:
        """A row's draft tree of at most ``room`` nodes, no deeper than
        ``room``, best first: the lookup's ``chain`` (matched on an
        ``n``-gram); with a table, the table's candidates after the root
        and after every node taken (the paper's adjacency table read as a
        tree, best-first by the product of per-rank acceptance along the
        path; Luo et al., 2024, §3.2); with mask candidates ``cands`` (k,
        top), those of mask d under every node of depth d - 1 (ESP §3.2).
        A node is worth the chance that it is accepted; parents come before
        their children."""
        tree = RowDraft()
        if room <= 0:
            return tree
        mq = self.masks.q() if cands is not None else None
        table = self.table.table if self.table is not None else None
        root_q = self.table_root[:, 0] / self.table_root[:, 1] if table is not None else None
        deep_q = self.table_deep[:, 0] / self.table_deep[:, 1] if table is not None else None
        q = self.next[0] / self.next[1]  # a lookup token right after a right one
        # (-value, order, parent slot, depth, token, kind): kind ("lookup", i)
        # is the chain's i-th token, ("table", r) a rank-r table candidate
        heap: list[tuple[float, int, int, int, int, tuple[str, int]]] = []
        order = 0
        if chain:
            right, tried = self.first[n - 1]
            heap.append((-right / tried, order, 0, 1, chain[0], ("lookup", 0)))
        if table is not None and 0 <= root < len(table):
            for r, t in enumerate(table[root].tolist()):
                if t >= 0:
                    order += 1
                    heapq.heappush(heap, (-root_q[r], order, 0, 1, t, ("table", r)))
        if cands is not None:
            for r, t in enumerate(cands[0].tolist()):
                order += 1
                heapq.heappush(heap, (-mq[0, r], order, 0, 1, t, ("mask", r)))
        slots: dict[tuple[int, int], int] = {}  # (parent, token) -> slot
        while heap and len(tree.tokens) < room:
            v, _, parent, depth, token, kind = heapq.heappop(heap)
            slot = slots.get((parent, token))
            if slot is None:  # a new node (else the chain goes on below the one there)
                tree.tokens.append(token)
                tree.parents.append(parent)
                tree.values.append(-v)
                tree.kinds.append(kind)
                slot = slots[(parent, token)] = len(tree.tokens)
            elif kind[0] != "lookup":
                continue
            if depth >= room:
                continue
            if kind[0] == "lookup" and kind[1] + 1 < len(chain):
                order += 1
                i = kind[1] + 1
                heapq.heappush(heap, (v * q, order, slot, depth + 1, chain[i], ("lookup", i)))
            if tree.kinds[slot - 1] != kind:
                continue  # a lookup chain going on below a node already there
            if table is not None and 0 <= token < len(table):
                for r, t in enumerate(table[token].tolist()):
                    if t >= 0:
                        order += 1
                        heapq.heappush(
                            heap, (v * deep_q[r], order, slot, depth + 1, t, ("table", r))
                        )
            if cands is not None and depth < len(cands):
                for r, t in enumerate(cands[depth].tolist()):
                    order += 1
                    heapq.heappush(heap, (v * mq[depth, r], order, slot, depth + 1, t, ("mask", r)))
        tree.ngram = n
        return tree

    def _learn_rates(self, tree: RowDraft, sent: int, on_path: set[int], first: int) -> None:
        """Count, for every sent node whose parent was accepted (or is the
        root), whether it was accepted, and for every node under the root
        that was not sent whether it is ``first``, the token the row
        committed after its root (what verification would have said, for
        free): the lookup's first token by n-gram length and a token after
        a right one, the table's by rank under the root and deeper, a mask
        candidate's by depth and rank, a head's by depth."""
        depth = [0]
        for i in range(len(tree.tokens)):
            parent = tree.parents[i]
            depth.append(depth[parent] + 1)
            if i >= sent and parent:
                continue
            if parent and parent not in on_path:
                continue
            ok = (i + 1) in on_path if i < sent else tree.tokens[i] == first
            kind, r = tree.kinds[i]
            if kind == "mask":
                self.masks.rates[depth[-1] - 1, r] += (ok, 1)
            elif kind == "head":
                self.heads.rates[r] += (ok, 1)
            elif kind == "pool":
                (self.look.first if parent == 0 else self.look.next)[:] += (ok, 1)
            elif kind == "lookup":
                (self.first[tree.ngram - 1] if parent == 0 else self.next)[:] += (ok, 1)
            elif kind == "draft":
                (self.draft_first if parent == 0 else self.draft_next)[:] += (ok, 1)
            else:
                (self.table_root if parent == 0 else self.table_deep)[r] += (ok, 1)

    def _chains(self, tokens: np.ndarray) -> list[RowDraft]:
        """Each row's draft-model chain (``tokens`` (rows, depth)) as its
        draft, cut to the tokens it may still generate, each node valued by
        the measured rates of a right first token and a right one after it."""
        p = self.draft_first[0] / self.draft_first[1]
        q = self.draft_next[0] / self.draft_next[1]
        out = []
        for row, chain in zip(self.rows, tokens.tolist()):
            n = max(0, min(len(chain), row.limit - 1))
            out.append(
                RowDraft(
                    chain[:n],
                    list(range(n)),
                    [p * q**i for i in range(n)],
                    [("draft", i) for i in range(n)],
                )
            )
        return out

    def _depth(self) -> int:
        """Draft-model passes for this step (0: none): the depth with the
        most expected tokens per second, each row's chain valued as
        :meth:`_chains` values it, over the target pass's measured time and
        the draft model's passes (measured; before that, guessed at the
        target's time of one slot per row times the draft model's share of
        the weights)."""
        rows = len(self.rows)
        p = self.draft_first[0] / self.draft_first[1]
        q = self.draft_next[0] / self.draft_next[1]
        rooms = [max(0, min(self.max_draft, r.limit - 1)) for r in self.rows]
        most = min(max(rooms), self.max_slots // rows - 1)
        each = self.drafter.seconds.get(rows)
        if each is None:
            each = self._cost(rows) * self.drafter.weight_share(self.model)
        best, best_rate = 0, rows / self._cost(rows)
        for k in range(1, most + 1):
            expected = sum(
                p * (1 - q ** min(k, m)) / (1 - q) if q < 1 else p * min(k, m) for m in rooms
            )
            rate = (rows + expected) / (self._cost(rows * (k + 1)) + k * each)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def _cost(self, slots: int) -> float:
        """Seconds of a pass of ``slots`` tokens: measured, or a guess
        (replaced once it runs): between two measured sizes on the line
        through them; above them on the line through the largest two (never
        falling); beside one measured size, its time times the square root
        of the ratio."""
        if slots in self.seconds:
            return self.seconds[slots]
        known = sorted(self.seconds)
        below = [s for s in known if s < slots]
        above = [s for s in known if s > slots]
        if below and (above or len(below) > 1):
            a, b = (below[-1], above[0]) if above else (below[-2], below[-1])
            ca, cb = self.seconds[a], self.seconds[b]
            slope = max(0.0, (cb - ca) / (b - a))
            return ca + slope * (slots - a)
        if below or above:
            s = below[-1] if below else above[0]
            return self.seconds[s] * (slots / s) ** 0.5
        return slots**0.5

    def _width(self, drafts: list[RowDraft], per: int = 1, extra: float = 0.0) -> tuple[int, float]:
        """``(nodes per row, tokens per second)`` of the pass with the most
        expected tokens per second (0 nodes: a plain batched step), each
        token slot taking ``per`` slots (itself and the masks after it), and
        ``extra`` seconds of other device work with it."""
        rows = len(drafts)
        longest = min(max(len(d.tokens) for d in drafts), self.max_slots // (rows * per) - 1)
        sums = [np.cumsum([0.0, *d.values]) for d in drafts]
        best, best_rate = 0, rows / (self._cost(rows * per) + extra)
        for k in range(1, longest + 1):
            expected = sum(c[min(k, len(c) - 1)] for c in sums)
            rate = (rows + expected) / (self._cost(rows * (k + 1) * per) + extra)
            if rate > best_rate:
                best, best_rate = k, rate
        return best, best_rate

    def _mask_width(self) -> tuple[list[RowDraft], int, bool]:
        """``(drafts, nodes per row, masked)`` with mask slots: masked while
        a pass with the masks after every token slot wins over one without
        in tokens per second, steadily (each row's tree valued at least as
        its tree without mask candidates and as a tree of mask candidates
        alone: the measured rates of each depth and rank; the pass times
        measured by size and the time of reading the masks' candidates
        added, free before it is measured), within the ledger (:meth:`_runs`);
        then the node count with the most expected tokens per second from
        this step's trees."""
        rows, per = len(self.rows), 1 + self.masks.k
        plain = self._drafts(masks=True)  # the last mask pass's candidates, if any
        k, rate = self._width(plain) if any(d.tokens for d in plain) else (0, 0.0)
        if rows * per > self.max_slots:
            return plain, k, False
        rate = rate or rows / self._cost(rows)
        extra = self.masks.cost(rows)
        rooms = [max(0, min(self.max_draft, r.limit - 1)) for r in self.rows]
        most = min(max(rooms), self.max_slots // (rows * per) - 1)
        typical = self.masks.typical(most)
        sums = [np.cumsum([0.0, *d.values]) for d in plain]
        steady = max(
            (
                rows
                + sum(max(c[min(j, len(c) - 1)], typical[min(j, m)]) for c, m in zip(sums, rooms))
            )
            / (self._cost(rows * (1 + j) * per) + extra)
            for j in range(most + 1)
        )
        probe = extra + self._cost(rows * per) - self._cost(rows)
        if not self._runs(steady > rate, probe):
            return plain, k, False
        return plain, self._width(plain, per, extra)[0], True

    def _runs(self, pays: bool, cost: float) -> bool:
        """Whether the masks, heads or Jacobi columns run this step. Where
        predicted to pay: while a ledger (the solo planner's) allows, every
        pass adding ``EPSILON`` of its time to a credit and every pass with
        them taking off what it lost against plain steps (its time less its
        tokens at a plain step's time per token; a gain adds), down to minus
        one plain step. Where not (a probe, so that their estimates are
        measured again): when a second credit, ``EPSILON`` of every pass's
        time, covers their estimated ``cost`` seconds (at least 5% of a
        plain pass), which it then pays (instead of the ledger)."""
        rows = len(self.rows)
        if pays and self._credit + self._cost(rows) > 0:
            return True
        cost = max(cost, 0.05 * self._cost(rows))  # never free (noisy pass times)
        if self._probes < cost:
            return False
        self._probes -= cost
        self._probing = True
        return True

    def _columns(self, nt: int) -> int:
        """Jacobi columns per row this pass carries after its ``nt`` token
        slots per row (0: none): the most, up to W, whose slots cost at most
        ``JACOBI_EXTRA`` more than the pass without them at the measured
        step times (solo lookahead's rule for its window, for the whole
        batch), within the ledger (:meth:`_runs`); where the ledger refuses
        them, as a probe now and then, and where no width fits the rule, one
        column as a probe (an unmeasured size is guessed, and the guess can
        be far off)."""
        rows = len(self.rows)
        base = self._cost(rows * nt)
        fits = [
            w
            for w in range(1, self.look.window + 1)
            if rows * (nt + self.look.slots(w)) <= self.max_slots
        ]
        cost = {w: self._cost(rows * (nt + self.look.slots(w))) - base for w in fits}
        best = max((w for w in fits if cost[w] <= JACOBI_EXTRA * base), default=0)
        w = best or min(fits, default=0)
        return w if w and self._runs(best > 0, cost[w]) else 0

    def _head_plan(self) -> tuple[list[RowDraft], int, bool]:
        """``(drafts, nodes per row, headed)`` with CLP heads: each row
        drafts the chain its heads wrote after the last pass (if they ran);
        the heads run after this pass while a pass with them wins over
        plain steps in tokens per second, steadily (each row's chain valued
        by the measured rates along it and the mean kept span, the heads'
        time measured; free before it is), within the ledger (:meth:`_runs`);
        then the node count with the most expected tokens per second."""
        rows = len(self.rows)
        rooms = [max(0, min(self.max_draft, r.limit - 1)) for r in self.rows]
        drafts = self.heads.drafts(rooms)
        extra = self.heads.cost(rows)
        most = min(max(rooms), self.max_slots // rows - 1, self.heads.k)
        if most < 1:  # no room for a draft token: plain passes
            return drafts, 0, False
        typical = self.heads.typical(most)
        steady = max(
            (rows + sum(typical[min(j, m)] for m in rooms)) / (self._cost(rows * (1 + j)) + extra)
            for j in range(most + 1)
        )
        headed = self._runs(steady > rows / self._cost(rows), extra)
        if not any(d.tokens for d in drafts):
            return drafts, 0, headed
        return drafts, self._width(drafts, extra=extra if headed else 0.0)[0], headed

    def _learn(
        self, inputs: np.ndarray, keep: np.ndarray, at: np.ndarray, top: np.ndarray, vocab: int
    ) -> None:
        """Write the table's rows of a pass's token slots: ``at`` the flat
        slots with logits, ``top`` (len(at), k) their best ids; each row's
        kept slots (``keep``, (rows, width) bool) last, so that they win a
        repeat."""
        if not self.table.rows:
            self.table.rows = vocab
        kept = keep.ravel()[at]
        order = np.concatenate([np.flatnonzero(~kept), np.flatnonzero(kept)])
        self.table.write(inputs.ravel()[at][order].astype(np.int64), top[order])

    def step(self) -> list[StepTokens]:
        """One forward pass of every row; each row's new tokens.

        A row that finishes (EOS, its limit) leaves the batch.
        """
        if not self.rows:
            return []
        if self.kv.due(self.compact_at):
            self._compact()
        # a step's time: its host work (drafts, layout) and its pass, not a
        # draft model's passes (timed apart)
        t0, aside = self.clock.now(), 0.0
        lay = self.kv.layout
        rows = len(self.rows)
        depth, k, masked, headed = 0, 0, False, False
        self._probing = False
        drafts = None
        if not self.max_draft:
            pass
        elif self.drafter is not None:
            depth = self._depth()
            t = self.clock.now()
            drafts = self._chains(self.drafter.draft(depth)) if depth else None
            aside = self.clock.now() - t
        elif self.masks is not None:
            drafts, k, masked = self._mask_width()
        elif self.heads is not None:
            drafts, k, headed = self._head_plan()
        elif self.look is not None:
            drafts = [
                self.look.tree(r, row.last, min(self.max_draft, row.limit - 1))
                for r, row in enumerate(self.rows)
            ]
        else:
            drafts = self._drafts()
        if drafts is None:
            drafts = [RowDraft() for _ in self.rows]
        if self.masks is None and self.heads is None and any(d.tokens for d in drafts):
            k = self._width(drafts)[0]
        # a row's slots: its root and k nodes, then (masked) the masks after
        # each, or (lookahead) its first ``cols`` Jacobi columns
        nt = k + 1
        per = self.masks.k if masked else 0
        cols = self._columns(nt) if self.look is not None and self.max_draft else 0
        width = nt * (1 + per) + (self.look.slots(cols) if cols else 0)
        inputs = np.empty((rows, width), np.int32)
        parents = np.full((rows, width), -1, np.int64)
        real = np.zeros((rows, width), bool)
        for r, (row, d) in enumerate(zip(self.rows, drafts)):
            n = min(k, len(d.tokens))
            inputs[r] = row.last  # padding repeats the root; it has no logits
            inputs[r, 1 : 1 + n] = d.tokens[:n]
            parents[r, 1 : 1 + n] = d.parents[:n]
            parents[r, 1 + n : nt] = np.arange(n, nt - 1)  # padding: a chain below
            real[r, : 1 + n] = True
        if masked:  # mask j after token slot i: slot nt + i per + j, below i
            first = nt + np.arange(nt) * per
            parents[:, first] = np.arange(nt)
            for j in range(1, per):
                parents[:, first + j] = first + j - 1
        jacobi = np.zeros((rows, width), bool)  # the slots whose argmax updates a column
        lasts = []
        for r in range(rows if cols else 0):
            toks, pars, last = self.look.branch(r, cols, nt)
            end = nt + len(toks)
            inputs[r, nt:end] = toks
            parents[r, nt:end] = pars
            parents[r, end:] = np.arange(end - 1, width - 1)  # padding: a chain below
            jacobi[r, last] = True
            lasts.append(last)
        chain = (parents[:, 1:] == np.arange(width - 1)).all()
        if not chain:  # a pass of trees: ancestor masks and a position per slot
            anc, depths = _ancestry(parents)
            lay.anc = anc
            lay.tree_offsets = mx.array(
                (lay.positions[:, None] + depths - np.arange(width)).astype(np.int32)
            )
        ids_in = mx.array(inputs)
        emb = self.masks.inputs(ids_in[:, :nt]) if masked else None
        h = self.backbone(ids_in, cache=self.kv.caches, input_embeddings=emb)
        # the LM head only where a row has a token (padding has no logits to check)
        at = np.flatnonzero((real | jacobi).ravel())
        if len(at) == real.size:
            logits = self.head(h).reshape(real.size, -1)
        else:
            logits = self.head(h.reshape(-1, h.shape[-1])[mx.array(at)])
        ids = mx.argmax(logits, axis=-1)
        top = top_tokens(logits, self.table.k) if self.table is not None else None
        outs = [ids, *([] if top is None else [top]), *([self.masks.vec] if self.masks else [])]
        _run(self.clock, outs, inputs.size)
        lay.anc = lay.tree_offsets = None
        pred = np.zeros(real.size, np.int64)
        pred[at] = np.array(ids)
        pred = pred.reshape(real.shape)
        for r, last in enumerate(lasts):
            self.look.update(r, pred[r, last].tolist())
        paths = [
            walk_tree(parents[r, : sent + 1], inputs[r, : sent + 1], pred[r])
            for r, sent in enumerate(real.sum(axis=1) - 1)
        ]
        seconds = self.clock.now() - t0 - aside
        self._credit += EPSILON * seconds
        self._probes += EPSILON * seconds
        slots = self.last_slots = inputs.size
        _average(self.seconds, slots, seconds)
        if masked:  # the masks after each row's deepest accepted slot: the next trees
            deepest = np.array([path[-1] if path else 0 for path, _ in paths])
            at_masks = np.arange(rows)[:, None] * width + (nt + deepest * per)[:, None]
            self.masks.read(
                self.head,
                h.reshape(-1, h.shape[-1]),
                at_masks + np.arange(per),
                self.clock,
                self._head_share,
            )
        elif self.masks is not None:  # no masks ran: no candidates follow the new roots
            self.masks.cands = [None] * rows
        if headed:  # the heads at each row's deepest accepted slot: the next chains
            deepest = np.array([path[-1] if path else 0 for path, _ in paths])
            at_last = mx.array(np.arange(rows) * width + deepest)
            self.heads.read(
                self.head,
                h.reshape(-1, h.shape[-1])[at_last],
                [int(b) for _, b in paths],
                self.clock,
                self._heads_share,
            )
        elif self.heads is not None:
            self.heads.chains = [None] * rows
        keep = np.zeros((rows, width), bool)
        out, done, news = [], [], []
        for r, (row, d) in enumerate(zip(self.rows, drafts)):
            sent = int(real[r].sum()) - 1
            path, bonus = paths[r]
            keep[r, [0, *path]] = True
            if d.tokens:
                first = int(inputs[r, path[0]]) if path else int(bonus)
                self._learn_rates(d, sent, set(path), first)
            row.drafted += sent
            row.accepted += len(path)
            row.passes += 1
            row.slots += width
            row.max_slots = max(row.max_slots, width)
            new = [int(inputs[r, s]) for s in path] + [int(bonus)]
            news.append(new)
            reason = None
            for i, t in enumerate(new):
                if t in self.eos:
                    new, reason = new[: i + 1], "stop"
                    break
            if reason is None and len(new) >= row.limit:
                new, reason = new[: row.limit], "length"
            row.limit -= len(new)
            row.generated.extend(new)
            row.append(new)
            row.last = new[-1]
            out.append(StepTokens(row.uid, new, reason))
            if reason is not None:
                done.append(r)
                self.finished[row.uid] = row
        if top is not None:
            self._learn(inputs, keep, at, np.array(top), logits.shape[-1])
        if isinstance(self.drafter, BatchNative):  # the pairs of the kept slots
            hidden = [h[r][mx.array([0, *path])] for r, (path, _) in enumerate(paths)]
            self.drafter.settle(depth, keep.sum(axis=1) - 1, news, hidden)
        elif self.drafter is not None:
            self.drafter.settle(depth, keep.sum(axis=1) - 1, news)
        if self.masks is not None:
            self.masks.update(news)
        if (masked or headed or cols) and not self._probing:  # the ledger: lost against plain steps
            plain_per_token = self._cost(rows) / rows
            lost = self.clock.now() - t0 - sum(len(o.tokens) for o in out) * plain_per_token
            self._credit -= lost
        lay.commit(keep)
        lay.size -= lay.common_tail()
        if done:
            self._keep([r for r in range(len(self.rows)) if r not in done])
        return out


def _average(seconds: dict[int, float], key: int, value: float) -> None:
    """Fold ``value`` into ``seconds[key]``, an exponential average (the
    first value as it is)."""
    old = seconds.get(key)
    seconds[key] = value if old is None else 0.8 * old + 0.2 * value


def _run(
    clock: DeviceClock, outputs: list[mx.array], slots: int, cost: float | None = None
) -> None:
    """Evaluate ``outputs``, a pass of ``slots`` slots (or other device
    work of ``cost`` one-token passes), on ``clock``'s device (a simulated
    device takes its own time for it)."""
    done = clock.launch(outputs, slots, cost)
    clock.block(lambda: mx.eval(*outputs), done)


def _ancestry(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(anc, depth)`` of a pass's trees: ``parents`` (rows, n) int (-1 for
    the root, slot 0; a parent before its child) -> ``anc`` (rows, n, n)
    bool, slot j is slot i or one of its ancestors, and ``depth`` (rows, n)
    int64, each slot's depth below the root."""
    rows, n = parents.shape
    anc = np.zeros((rows, n, n), bool)
    depth = np.zeros((rows, n), np.int64)
    idx = np.arange(rows)
    anc[:, 0, 0] = True
    for i in range(1, n):
        p = parents[:, i]
        anc[idx, i] = anc[idx, p]
        anc[:, i, i] = True
        depth[:, i] = depth[idx, p] + 1
    return anc, depth
