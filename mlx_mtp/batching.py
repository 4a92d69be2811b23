"""Speculation inside a batch: several requests' drafts verified in one
forward pass.

Each row of the batch is one request. At every step each row drafts a chain
of tokens from its own context by prompt lookup (Saxena, 2023) and, where
the lookup finds nothing and the batch keeps one, from a table of the
model's own predictions (token recycling, Luo et al., 2024: the best id the
model ranked after each token the last time it was an input slot, written
from every slot of every pass), the chains are padded to the batch's width,
and one forward pass of ``rows x width`` tokens verifies all of them
(Leviathan et al., 2023, §2, greedy): a row keeps its draft's longest prefix
that equals the model's own argmax and the model's next token (the bonus
token). Rows accept different numbers of tokens, so the
KV cache cannot simply be trimmed: :class:`BatchLayout` keeps, for every
row, which cache slots hold a kept token. A rejected slot stays where it is
and is masked out of attention from then on; each row's rotary position is
the count of its kept tokens, so a row sees exactly the keys and positions
it would see alone. When the rejected slots grow to the kept ones, the cache
is compacted (each row's kept slots gathered to the right).

mlx-lm's model classes run unchanged: every layer gets a
:class:`BatchLayerCache` whose ``offset`` is the per-row position array and
whose ``make_mask`` returns the per-row mask.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from .errors import UnsupportedModelError
from .families import model_parts
from .sources.lookup import lookup_match
from .sources.recycle import DEEP_PRIORS, RANK_PRIORS, RecycleTable
from .verify import top_tokens

#: cache slots are allocated in blocks of this many (as mlx-lm's KVCache)
SLOT_BLOCK = 256


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

    @property
    def rows(self) -> int:
        return len(self.positions)

    @property
    def offset(self) -> mx.array:
        """(rows,) int32: each row's position of the first token of the pass."""
        if self._offset is None:
            self._offset = mx.array(self.positions.astype(np.int32))
        return self._offset

    def mask(self, n: int) -> mx.array:
        """(rows, 1, n, size + n) bool attention mask of a pass of ``n``
        tokens per row: the row's kept slots, then causal over the pass."""
        rows, size = self.rows, self.size
        m = np.empty((rows, n, size + n), bool)
        m[:, :, :size] = self.valid[:, None, :size]
        m[:, :, size:] = np.tril(np.ones((n, n), bool))
        return mx.array(m[:, None])

    def _reserve(self, size: int) -> None:
        if size > self.valid.shape[1]:
            grown = -(-size // SLOT_BLOCK) * SLOT_BLOCK
            self.valid = np.pad(self.valid, ((0, 0), (0, grown - self.valid.shape[1])))

    def commit(self, kept: np.ndarray, width: int) -> None:
        """After a pass of ``width`` tokens per row: row ``r`` keeps its
        first ``kept[r]`` slots of the pass (>= 1); the rest are masked out."""
        self._reserve(self.size + width)
        self.valid[:, self.size : self.size + width] = np.arange(width)[None] < kept[:, None]
        self.positions = self.positions + kept
        self.size += width
        self._offset = None

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
        return self.layout.offset

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
        return self.layout.mask(n)

    def is_trimmable(self) -> bool:
        return False

    @property
    def state(self) -> tuple[Any, Any]:
        return self.keys, self.values


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


class DraftBatch:
    """Continuous batching with drafts verified in the batch's forward pass
    (greedy): prompt lookup, and with a ``table`` token recycling.

    A request joins with :meth:`add` (its prompt prefilled alone, in chunks
    of ``prefill_step``, as a solo generation does) and leaves at EOS, its
    limit, or :meth:`remove`. Each :meth:`step` runs one forward pass of every
    row: its newest token and its draft, up to ``max_draft`` tokens of the
    continuation of its context's last n-gram (n <= ``window``) seen earlier;
    where there is none and ``table`` is given, the chain of best ids the
    table holds after the row's newest token (each pass then also writes the
    top ``table.k`` ids after each of its slots into the table, the kept
    slots last).

    The draft width of the pass is chosen to maximise tokens per second: the
    expected accepted tokens of each width (each row's chain, first token
    valued by its matched n-gram length, later ones by the measured rate of a
    right token after a right one) over the measured time of a pass of that
    many slots (rows x width, measured here, on this machine; an unmeasured
    size is guessed to cost the square root of its share of slots, and is
    tried once where that guess wins).

    Args:
        model: an mlx-lm model with a full KV cache in every layer.
        eos: end-of-sequence token ids.
        window: longest n-gram the lookup matches.
        max_draft: most draft tokens per row and step (0: plain batched
            decoding).
        prefill_step: prompt tokens per prefill pass.
        max_slots: most tokens in one decoding pass (rows x width; a pass of
            one token per row is always allowed).
        table: token recycling's table (:class:`~mlx_mtp.sources.recycle.RecycleTable`,
            shared with later batches of the same model), or None: prompt
            lookup only.

    Raises:
        UnsupportedModelError: see :func:`check_batchable`.
    """

    def __init__(
        self,
        model: Any,
        eos: set[int],
        *,
        window: int = 3,
        max_draft: int = 4,
        prefill_step: int = 2048,
        max_slots: int = 1024,
        table: RecycleTable | None = None,
    ):
        check_batchable(model)
        self.model = model
        self.backbone, self.head, _ = model_parts(model)
        self.eos = set(eos)
        self.window = window
        self.max_draft = max_draft
        self.prefill_step = prefill_step
        self.max_slots = max_slots
        self.layout = BatchLayout()
        self.caches = [BatchLayerCache(self.layout) for _ in make_prompt_cache(model)]
        self.rows: list[BatchRow] = []
        #: rows that finished (EOS or their limit), by uid
        self.finished: dict[int, BatchRow] = {}
        self._uid = 0
        # first draft token right, by matched n-gram length (1..window): [right, tried]
        priors = [0.23, 0.43, 0.69] + [0.69] * max(0, window - 3)
        self.first = np.array([[p, 1.0] for p in priors[:window]])
        # a draft token right after a right one: [right, tried]
        self.next = np.array([0.8, 1.0])
        self.table = table
        # the same two for the table's chains
        self.table_first = np.array([RANK_PRIORS[0], 1.0])
        self.table_next = np.array([DEEP_PRIORS[0], 1.0])
        # seconds per pass by slots (rows x width): exponential averages
        self.seconds: dict[int, float] = {}
        #: the cache is compacted when its slots exceed this many times the
        #: longest row's kept tokens
        self.compact_at = 2.0

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, tokens: list[int], limit: int) -> tuple[int, StepTokens]:
        """Prefill a prompt alone and add it to the batch.

        Args:
            tokens: the prompt's token ids.
            limit: most new tokens (>= 1).

        Returns:
            Its uid and its first token (``finish_reason`` set if it is
            already done: EOS, or a limit of 1; it is then not in the batch).
        """
        cache = make_prompt_cache(self.model)
        prompt = mx.array(tokens)[None]
        for s in range(0, len(tokens), self.prefill_step):
            logits = self.model(prompt[:, s : s + self.prefill_step], cache=cache)
            if s + self.prefill_step < len(tokens):
                mx.eval([c.state for c in cache])
        first = int(mx.argmax(logits[0, -1]).item())
        self._uid += 1
        uid = self._uid
        if first in self.eos or limit <= 1:
            return uid, StepTokens(uid, [first], "stop" if first in self.eos else "length")
        context = np.zeros(max(64, 2 * (len(tokens) + limit)), np.int32)
        row = BatchRow(uid, context, 0, len(tokens), limit - 1, first, [first])
        row.append([*tokens, first])
        self._join(cache, len(tokens))
        self.rows.append(row)
        return uid, StepTokens(uid, [first], None)

    def _join(self, cache: list[KVCache], n: int) -> None:
        lay = self.layout
        pad = max(0, n - lay.size)
        if pad:  # the batch's slots shift right to make room
            lay._reserve(lay.size + pad)
            lay.valid = np.concatenate(
                [np.zeros((lay.rows, pad), bool), lay.valid[:, : lay.valid.shape[1] - pad]], axis=1
            )
        size = lay.size + pad
        for bc, c in zip(self.caches, cache):
            k, v = c.keys[..., :n, :], c.values[..., :n, :]
            row_k = mx.pad(k, [(0, 0), (0, 0), (size - n, 0), (0, 0)])
            row_v = mx.pad(v, [(0, 0), (0, 0), (size - n, 0), (0, 0)])
            if bc.keys is None:
                bc.keys, bc.values = row_k, row_v
            else:
                old_k, old_v = bc.keys[..., : lay.size, :], bc.values[..., : lay.size, :]
                if pad:
                    old_k = mx.pad(old_k, [(0, 0), (0, 0), (pad, 0), (0, 0)])
                    old_v = mx.pad(old_v, [(0, 0), (0, 0), (pad, 0), (0, 0)])
                bc.keys = mx.concatenate([old_k, row_k])
                bc.values = mx.concatenate([old_v, row_v])
        mx.eval([(bc.keys, bc.values) for bc in self.caches])
        valid = np.zeros((1, lay.valid.shape[1]), bool)
        valid[0, size - n : size] = True
        lay.valid = np.concatenate([lay.valid, valid])
        lay.positions = np.append(lay.positions, n)
        lay.size = size
        lay._offset = None

    def take_row(self, uid: int) -> BatchRow | None:
        """A request's row with its counts (None: unknown uid), forgotten
        once it has finished."""
        if uid in self.finished:
            return self.finished.pop(uid)
        return next((r for r in self.rows if r.uid == uid), None)

    def remove(self, uid: int) -> None:
        """Drop a request from the batch (no effect if it is not there)."""
        keep = [i for i, r in enumerate(self.rows) if r.uid != uid]
        if len(keep) == len(self.rows):
            return
        self._keep(keep)

    def _keep(self, keep: list[int]) -> None:
        lay = self.layout
        self.rows = [self.rows[i] for i in keep]
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
            bc.keys = bc.keys[idx][..., lead:, :]
            bc.values = bc.values[idx][..., lead:, :]
        if lead:
            lay.valid = np.pad(lay.valid[:, lead:], ((0, 0), (0, lead)))
            lay.size -= lead

    def _compact(self) -> None:
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
            bc.keys = mx.take_along_axis(bc.keys[..., : lay.size, :], gather, axis=2)
            bc.values = mx.take_along_axis(bc.values[..., : lay.size, :], gather, axis=2)
        mx.eval([(bc.keys, bc.values) for bc in self.caches])
        lay.valid, lay.size = valid, size

    def _drafts(self) -> list[tuple[list[int], int]]:
        out = []
        for row in self.rows:
            room = min(self.max_draft, row.limit - 1)
            if room <= 0:
                out.append(([], 0))
                continue
            d, n = lookup_match(row.context[: row.length], self.window, room)
            if not d and self.table is not None:
                d = self._table_chain(row.last, room)
            out.append((d, n))
        return out

    def _table_chain(self, token: int, room: int) -> list[int]:
        """Up to ``room`` tokens after ``token``, each the table's best id
        after the one before (stops at an unknown row)."""
        table, chain = self.table.table, []
        while table is not None and len(chain) < room and 0 <= token < len(table):
            token = int(table[token, 0])
            if token < 0:
                break
            chain.append(token)
        return chain

    def _rates(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``[right, tried]`` counts of a chain's first token and of a
        token after a right one: a lookup's of an ``n``-gram match, or the
        table's (n = 0)."""
        return (self.first[n - 1], self.next) if n else (self.table_first, self.table_next)

    def _expected(self, drafts: list[tuple[list[int], int]], depth: int) -> float:
        """Expected accepted draft tokens of the batch with chains cut at ``depth``."""
        total = 0.0
        for d, n in drafts:
            k = min(depth, len(d))
            if k:
                first, after = self._rates(n)
                p, q = first[0] / first[1], after[0] / after[1]
                total += p * (1 - q**k) / (1 - q) if q < 1 else p * k
        return total

    def _cost(self, slots: int) -> float:
        if slots in self.seconds:
            return self.seconds[slots]
        rows = self.layout.rows
        one = self.seconds.get(rows, float(rows))
        return one * (slots / rows) ** 0.5  # unmeasured: a guess, replaced once it runs

    def _width(self, drafts: list[tuple[list[int], int]]) -> int:
        rows = len(drafts)
        longest = min(max(len(d) for d, _ in drafts), self.max_slots // rows - 1)
        best, best_rate = 0, rows / self._cost(rows)
        for depth in range(1, longest + 1):
            rate = (rows + self._expected(drafts, depth)) / self._cost(rows * (depth + 1))
            if rate > best_rate:
                best, best_rate = depth, rate
        return best

    def _learn(
        self, inputs: np.ndarray, kept: np.ndarray, at: np.ndarray, top: np.ndarray, vocab: int
    ) -> None:
        """Write the table's rows of a pass's token slots: ``at`` the flat
        slots with logits, ``top`` (len(at), k) their best ids; each row's
        kept slots (its first ``kept[r]``) last, so that they win a repeat."""
        if not self.table.rows:
            self.table.rows = vocab
        width = inputs.shape[1]
        keep = (np.arange(width)[None, :] < kept[:, None]).ravel()[at]
        order = np.concatenate([np.flatnonzero(~keep), np.flatnonzero(keep)])
        self.table.write(inputs.ravel()[at][order].astype(np.int64), top[order])

    def step(self) -> list[StepTokens]:
        """One forward pass of every row; each row's new tokens.

        A row that finishes (EOS, its limit) leaves the batch.
        """
        if not self.rows:
            return []
        lay = self.layout
        if lay.size > 64 and lay.size > self.compact_at * int(lay.positions.max()):
            self._compact()
        drafts = self._drafts() if self.max_draft else [([], 0)] * len(self.rows)
        depth = self._width(drafts) if any(d for d, _ in drafts) else 0
        width = depth + 1
        inputs = np.empty((len(self.rows), width), np.int32)
        real = np.zeros((len(self.rows), width), bool)
        for r, (row, (d, _)) in enumerate(zip(self.rows, drafts)):
            d = d[:depth]
            inputs[r, 0] = row.last
            inputs[r, 1 : 1 + len(d)] = d
            inputs[r, 1 + len(d) :] = row.last
            real[r, : 1 + len(d)] = True
        t0 = time.perf_counter()
        h = self.backbone(mx.array(inputs), cache=self.caches)
        # the LM head only where a row has a token (padding has no logits to check)
        at = np.flatnonzero(real.ravel())
        if len(at) == real.size:
            logits = self.head(h).reshape(real.size, -1)
        else:
            logits = self.head(h.reshape(-1, h.shape[-1])[mx.array(at)])
        ids = mx.argmax(logits, axis=-1)
        top = top_tokens(logits, self.table.k) if self.table is not None else None
        mx.eval(ids, *([] if top is None else [top]))
        pred = np.zeros(real.size, np.int64)
        pred[at] = np.array(ids)
        pred = pred.reshape(real.shape)
        seconds = time.perf_counter() - t0
        slots = inputs.size
        old = self.seconds.get(slots)
        self.seconds[slots] = seconds if old is None else 0.8 * old + 0.2 * seconds
        kept = np.empty(len(self.rows), np.int64)
        out, done = [], []
        for r, (row, (d, n)) in enumerate(zip(self.rows, drafts)):
            d = d[:depth]
            a = 0
            while a < len(d) and d[a] == pred[r, a]:
                a += 1
            if d:
                first, after = self._rates(n)
                first += (a > 0, 1)
                if a:
                    after += (a - 1, a - 1 + (a < len(d)))
            row.drafted += len(d)
            row.accepted += a
            row.passes += 1
            row.slots += width
            row.max_slots = max(row.max_slots, width)
            new = [*d[:a], int(pred[r, a])]
            kept[r] = 1 + a
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
            self._learn(inputs, kept, at, np.array(top), logits.shape[-1])
        lay.commit(kept, width)
        lay.size -= lay.common_tail()
        if done:
            self._keep([r for r in range(len(self.rows)) if r not in done])
        return out
