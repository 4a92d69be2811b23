"""The model, its KV cache, and the forward passes every method is built from.

:class:`Engine` owns one KV cache per conversation and keeps ``engine.cached``,
the exact token ids whose keys and values the cache holds. Lossless methods
reach it through :func:`mlx_mtp.speculative.speculative_step`, which calls
:meth:`Engine.forward_chain` (plain causal block) or :meth:`Engine.forward_tree`
(a draft tree with per-token positions and a tree mask) and :meth:`Engine.keep`
(keep the accepted path, drop the rest); lossy methods call the forward passes
and :meth:`Engine.trim_to` themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import (
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)
from mlx_lm.utils import does_model_support_input_embeddings

from . import memory
from .cache_view import (
    DEFAULT_ROOM,
    LazyView,
    SlidingKVCache,
    TreeCacheView,
    install_positional_rope,
)
from .errors import CacheNotTrimmableError, InvalidArgumentError, UnsupportedModelError
from .families import TREE, family_support, model_parts
from .logprobs import LogprobRecorder
from .recurrent import RecurrentRollback, has_recurrent, is_recurrent
from .timing import make_clock

#: prompt tokens per prefill forward pass: mlx-lm's ``prefill_step_size``
#: (2048) on a GPU; 512 on MLX's CPU backend, where chunks of 2048 tokens
#: prefilled a 1500-token prompt 18-30% slower than chunks of 512 (SmolLM2-135M
#: and Qwen2.5-Coder-0.5B float32, docs/benchmarks.md, "Prefill chunks on a CPU")
PREFILL_STEP = 2048 if mx.default_device().type == mx.DeviceType.gpu else 512


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    common = 0
    for x, y in zip(a, b):
        if x != y:
            break
        common += 1
    return common


class Engine:
    """A model with one KV cache and the list of tokens that cache holds.

    Sliding-window layers (mlx-lm's ``RotatingKVCache``: Gemma 3's local
    layers, ``--max-kv-size``) get a :class:`~mlx_mtp.cache_view.SlidingKVCache`
    of the same window with room for ``slots`` more tokens, so that the tokens
    of any forward pass of up to ``slots`` can be dropped again.

    Args:
        model: an mlx-lm model.
        max_kv_size: if set, the layers that would keep every token (plain
            ``KVCache``) keep the first 4 and the last ``max_kv_size - 4``
            instead (mlx-lm's ``RotatingKVCache(max_kv_size, keep=4)`` window).
        slots: the most tokens one droppable forward pass adds (the method's
            block complexity); sliding-window caches keep room for them, and
            grow if a larger pass comes. None: ``DEFAULT_ROOM`` (64).
        kv_bits: if set (4 or 8), the layers that would keep every token
            (plain ``KVCache``) keep them quantized instead, from the first
            token (mlx-lm's ``QuantizedKVCache(kv_group_size, kv_bits)``);
            sliding-window layers stay as they are.
        kv_group_size: elements per quantization group (of a head's dimension).
    """

    def __init__(
        self,
        model: nn.Module,
        max_kv_size: int | None = None,
        slots: int | None = None,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
    ):
        if kv_bits is not None and max_kv_size is not None:
            raise InvalidArgumentError(
                "kv_bits and max_kv_size cannot be combined: a sliding window is not "
                "quantized (use one of --kv-bits and --max-kv-size)."
            )
        self.max_kv_size = max_kv_size
        self.kv_bits = kv_bits
        self.kv_group_size = kv_group_size
        #: room of the sliding-window caches (tokens beyond the window)
        self.slots = max(2, int(slots)) if slots is not None else DEFAULT_ROOM
        self.use_model(model)
        #: forward passes, their slots and device seconds (:mod:`mlx_mtp.timing`)
        self.clock = make_clock()
        #: tokens the last :meth:`sync` processed (its hidden states are the
        #: model's last forward outputs: the native MTP layer reads them)
        self.last_prefill = 0
        #: (N,) sequence position of each slot of the last forward pass; the
        #: token drawn from slot i's logits sits at ``slot_positions[i] + 1``
        self.slot_positions = np.zeros(0, dtype=np.int64)
        #: where set (:func:`mlx_mtp.decoding.generate_steps` with
        #: ``logprobs``), one-token and verified steps record each committed
        #: token's log-probability in it (:mod:`mlx_mtp.logprobs`)
        self.logprobs: LogprobRecorder | None = None
        # the last tree pass over plain KV caches: (start, slots, views holding the
        # slots' keys/values), for keep() to move accepted rows without a sync
        self._tree_rows: tuple[int, int, list[TreeCacheView]] | None = None
        #: held around each prefill chunk of :meth:`sync` and, by
        #: :func:`~mlx_mtp.decoding.generate_steps`, around each decoding
        #: step: the model's lock (:func:`mlx_mtp.threads.model_lock`) where
        #: several threads share the model (an :class:`~mlx_mtp.api.MTPModel`
        #: sets it), else nothing
        self.turn: AbstractContextManager[Any] = nullcontext()

    def use_model(self, model: nn.Module) -> None:
        """Decode with ``model`` from now on, with an empty cache built the
        engine's way (``max_kv_size`` applies as for the first model).

        For a model that wraps or copies the current one with the same
        tokenizer, such as an on-device MTP adapter applied
        (:func:`mlx_mtp.confadapt_format.apply_adapter`); the counters of
        forward passes and time carry on.
        """
        self.model = model
        self._tree_rows = None
        try:
            self.backbone, self.lm_head, self.embed = model_parts(model)
        except UnsupportedModelError:  # plain decoding still works through model()
            self.backbone = self.lm_head = self.embed = None
        self.cache = self._new_cache()
        self.cached: list[int] = []
        #: snapshot/replay of recurrent layers (hybrid models), None for pure
        #: attention models or recurrent layers of an unknown kind
        self.rollback: RecurrentRollback | None = None
        if has_recurrent(self.cache):
            try:
                self.rollback = RecurrentRollback(model, self.cache)
            except UnsupportedModelError:
                self.rollback = None

    # ------------------------------------------------------------- counters
    @property
    def forward_passes(self) -> int:
        """Model forward passes since creation (prefill chunks excluded)."""
        return self.clock.passes

    @property
    def forward_slots(self) -> int:
        """Input slots (tokens and masks) over those forward passes."""
        return self.clock.slots

    @property
    def forward_seconds(self) -> float:
        """Seconds of device work in those passes (see :mod:`mlx_mtp.timing`)."""
        return self.clock.seconds

    @contextmanager
    def scratch(self) -> Iterator[None]:
        """Run passes that leave no trace (a cost measurement): on exit the
        cache is trimmed back to what it held, and the counters and
        ``last_prefill`` are as they were."""
        self.settle()
        start, prefill = self.offset, self.last_prefill
        try:
            with self.clock.untimed():
                yield
        finally:
            if self.offset > start:
                self.trim_to(start)
            self.last_prefill = prefill

    # ----------------------------------------------------------------- cache
    @property
    def offset(self) -> int:
        """Number of tokens in the KV cache."""
        return len(self.cached)

    def reset(self) -> None:
        """Drop the whole cache."""
        self._tree_rows = None
        self.cache = self._new_cache()
        self.cached = []
        if self.rollback is not None:
            self.rollback.disarm()

    def _new_cache(self) -> list[Any]:
        # mlx-lm ignores max_kv_size for models with their own make_cache
        # (llama, qwen, ...): it is applied here, to the layers without a window
        cache = make_prompt_cache(self.model)
        out = []
        for c in cache:
            if type(c) is RotatingKVCache:  # a sliding-window layer (or mlx-lm's
                # max_kv_size cache): the same window, with room to drop a pass
                c = SlidingKVCache(c.max_size - c.keep, keep=c.keep, room=self.slots)
            elif type(c) is KVCache and self.max_kv_size is not None:
                c = SlidingKVCache(self.max_kv_size - 4, keep=4, room=self.slots)
            elif type(c) is KVCache and self.kv_bits is not None:
                c = QuantizedKVCache(group_size=self.kv_group_size, bits=self.kv_bits)
            out.append(c)
        return out

    def materialize(self) -> None:
        """Evaluate every array the cache holds, so that no lazy work is left
        in it: MLX runs a thread's work on that thread's own streams, and a
        binding used next on another thread could not evaluate work left
        pending by this one."""
        arrays: list[mx.array] = []
        todo = list(self.cache)
        while todo:
            c = todo.pop()
            if isinstance(c, CacheList):
                todo.extend(c.caches)
                continue
            leaves = tree_flatten(list(vars(c).values()))
            arrays += [v for _, v in leaves if isinstance(v, mx.array)]
        mx.eval(arrays)

    def trimmable(self, n_extra: int = 0, chain: bool = False) -> bool:
        """Whether every layer cache can later drop up to ``n_extra`` new tokens
        (``chain``: of one causal chain pass, which recurrent layers can drop
        through :class:`~mlx_mtp.recurrent.RecurrentRollback`). A sliding
        window can drop a pass of up to ``slots + 1`` tokens (and makes room
        for larger ones before a droppable pass, see :meth:`check_droppable`)."""
        for c in self.cache:
            if is_recurrent(c) and chain and self.rollback is not None:
                continue
            if isinstance(c, SlidingKVCache):
                if not c.droppable(n_extra):
                    return False
            elif isinstance(c, RotatingKVCache):
                if c.offset + n_extra >= c.max_size:
                    return False
            elif not (hasattr(c, "trim") and c.is_trimmable()):
                return False
        return True

    def check_droppable(self, n: int) -> None:
        """Refuse, before a forward pass of ``n`` tokens of which some are
        dropped again afterwards (a lossy method's mask tokens), a cache that
        could not drop them. Lossless methods never call this: the shared
        :func:`~mlx_mtp.speculative.speculative_step` does the same check.

        Raises:
            CacheNotTrimmableError: a full sliding window or recurrent layers.
        """
        self._require_trimmable(n)

    def _require_trimmable(self, n_extra: int, chain: bool = False) -> None:
        if n_extra > self.slots + 1 and any(isinstance(c, SlidingKVCache) for c in self.cache):
            # a pass larger than the room the windows were built with: widen them
            # (moves the rows once) rather than refuse
            self.slots = n_extra - 1
            for c in self.cache:
                if isinstance(c, SlidingKVCache):
                    c.reserve(self.slots)
        if not self.trimmable(n_extra, chain):
            kinds = sorted({type(c).__name__ for c in self.cache})
            raise CacheNotTrimmableError(
                f"The KV cache ({', '.join(kinds)}) cannot drop rejected draft tokens: a "
                f"layer keeps recurrent state or a window that cannot drop them (cache holds "
                f"{self.offset} tokens, this step adds {n_extra}). Speculative decoding stops "
                "here instead of corrupting the output; use --method ntp."
            )

    def trim_to(self, n: int) -> None:
        """Keep the first ``n`` cached tokens.

        Raises:
            CacheNotTrimmableError: a layer cache cannot be trimmed, or trimmed
                fewer tokens than asked.
        """
        self._tree_rows = None  # rows of a tree pass are only moved before any trim
        drop = self.offset - n
        if drop < 0:
            raise ValueError(f"cannot trim {self.offset} cached tokens to {n}")
        if drop == 0:
            return
        rb = self.rollback
        rewind = (
            rb is not None
            and rb.armed
            and rb.start <= n
            and self.offset <= rb.start + rb.length
            and any(is_recurrent(c) for c in self.cache)
        )
        for c in self.cache:
            if rewind and is_recurrent(c):
                continue
            if not (hasattr(c, "trim") and c.is_trimmable()) or (
                isinstance(c, SlidingKVCache) and not c.can_trim(drop)
            ):
                raise CacheNotTrimmableError(
                    f"{type(c).__name__} cannot drop {drop} tokens (recurrent state, or a "
                    "sliding window that overwrote a row the next token needs)."
                )
        for c in self.cache:
            if rewind and is_recurrent(c):
                continue
            got = c.trim(drop)
            if got != drop:
                raise CacheNotTrimmableError(f"{type(c).__name__} trimmed {got} of {drop} tokens")
        if rewind:
            rb.rewind(self.cache, n - rb.start)
        del self.cached[n:]

    def sync(
        self,
        tokens: list[int],
        chunk: int = PREFILL_STEP,
        should_stop: Callable[[], bool] | None = None,
    ) -> int:
        """Make the cache hold exactly ``tokens``, reusing the longest common prefix.

        The rest is processed ``chunk`` tokens per forward pass (mlx-lm's
        prefill step on a GPU, :data:`PREFILL_STEP`), each chunk evaluated and MLX's buffer cache
        cleared after it, as mlx-lm's ``generate_step`` does.

        Args:
            tokens: the token ids the cache must hold.
            chunk: prompt tokens per forward pass (>= 1).
            should_stop: asked before each chunk; True stops there, leaving
                the cache holding a prefix of ``tokens`` (``offset`` tells
                how much).

        Returns:
            The number of tokens processed (prefill length).
        """
        self.settle()
        self._tree_rows = None
        common = self.common_prefix(tokens)
        if common < self.offset:
            try:
                self.trim_to(common)
            except CacheNotTrimmableError:
                self.reset()
                common = 0
        rest = tokens[common:]
        self.last_prefill = len(rest)
        if self.rollback is not None:
            self.rollback.disarm()  # raw prefill passes below are not verify passes
        chunk = max(int(chunk), 1)
        for i in range(0, len(rest), chunk):
            if should_stop is not None and should_stop():
                self.last_prefill = i
                return i
            piece = rest[i : i + chunk]
            with self.turn:
                (self.backbone or self.model)(mx.array(piece)[None], cache=self.cache)
                mx.eval([c.state for c in self.cache])
                self.cached.extend(piece)
                mx.clear_cache()
        return len(rest)

    def common_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the cache holds already."""
        return common_prefix(self.cached, tokens)

    def catch_up(self, tokens: list[int], most: int) -> list[int]:
        """Bring the cache within ``most`` tokens of holding ``tokens``: keep
        the longest common prefix, prefill (:meth:`sync`) all but the last
        ``most`` of the rest, and return those (at most ``most``) for the
        caller's next pass to feed in front of its own tokens, which saves a
        pass of their own (a draft model after its drafts were all accepted:
        the last one was never fed).

        Args:
            tokens: the token ids the cache should hold.
            most: the most tokens left for the caller (>= 0).

        Returns:
            ``tokens[offset:]`` after the call.
        """
        keep = max(self.common_prefix(tokens), len(tokens) - max(int(most), 0))
        self.sync(tokens[:keep])
        return list(tokens[self.offset :])

    # ------------------------------------------------------------- memory
    def max_slots(self, context: int = 0) -> int:
        """The largest forward pass (slots) that fits in memory after
        ``context`` cached tokens (:func:`mlx_mtp.memory.max_slots`)."""
        return memory.max_slots(self.model, context)

    def check_slots(self, n: int, context: int | None = None, what: str = "") -> None:
        """Refuse a forward pass of ``n`` slots that would not fit in memory
        (:func:`mlx_mtp.memory.check_slots`; default context: the cache's length).

        Raises:
            InvalidArgumentError: naming the estimate, the limit and the
                largest block complexity that fits.
        """
        memory.check_slots(self.model, n, self.offset if context is None else context, what)

    # --------------------------------------------------------------- forward
    def forward_chain(
        self,
        tokens: list[int],
        hidden: bool = False,
        wait: bool = True,
        droppable: bool = False,
        last: int | None = None,
    ) -> tuple[mx.array, mx.array | None]:
        """Causal forward of ``tokens`` after the cache; they are appended to it.

        Args:
            tokens: L token ids.
            hidden: also return the hidden states.
            wait: False starts the pass (``mx.async_eval``) and returns at once,
                as in :meth:`forward_tree`: the caller builds the graph that
                reads the logits (argmax, sampling) and evaluates it with
                :meth:`timed_eval`, one synchronisation per step instead of two.
            droppable: some of these tokens are dropped again after the pass
                (rejected drafts, mask tokens): refuse before the pass if the
                cache could not drop them; on a hybrid recurrent model the
                pass is then recorded for the rollback even for one token.
            last: compute logits for the last ``last`` tokens only (the LM
                head is a large share of a small model's pass; a draft model
                reads only its last token's).

        Returns:
            logits (L or ``last``, V) float32-or-model-dtype, and the hidden
            states (L, D) if ``hidden``.

        Raises:
            CacheNotTrimmableError: ``droppable`` and the cache cannot drop
                ``len(tokens)`` tokens (a full sliding window, recurrent layers).
        """
        self.settle()
        self._tree_rows = None
        if droppable:
            self._require_trimmable(len(tokens), chain=True)
        if len(tokens) > 1:
            self.check_slots(len(tokens))
        t0 = self.clock.now()
        if self.rollback is not None:  # hybrid model: a multi-token pass may be rolled back
            if len(tokens) > 1 or droppable:
                self.rollback.arm(self.cache, self.offset, len(tokens))
            else:
                self.rollback.disarm()
        self.slot_positions = np.arange(self.offset, self.offset + len(tokens))
        self.cached.extend(tokens)
        logits, h = self._chain(mx.array(tokens), last=last)
        self.clock.finish(t0, [logits] if h is None else [logits, h], wait, len(tokens))
        return logits, (h if hidden else None)

    def _chain(
        self, ids: mx.array, count: bool = True, last: int | None = None
    ) -> tuple[mx.array, mx.array | None]:
        # the lazy graph of a causal forward of ids (L,) after the cache; logits
        # of the last ``last`` rows only when set
        if count:
            self.count_forward(ids.shape[0])
        if self.backbone is None:
            logits = self.model(ids[None], cache=self.cache)[0]
            return (logits if last is None else logits[-last:]), None
        h = self.backbone(ids[None], cache=self.cache)[0]
        return self.lm_head(h if last is None else h[-last:]), h

    def queue_behind(self, token: mx.array) -> mx.array:
        """Build the one-token forward of ``token``, a lazy (1,) id read from
        the pass in flight (its argmax), to run behind that pass: a draft
        model's chain of passes with one synchronisation for all of them, as
        mlx-lm's draft loop queues them. The caller starts the pass and what
        it reads from it with :meth:`DeviceClock.extend
        <mlx_mtp.timing.DeviceClock.extend>` and, once the ids are read,
        records them with :meth:`resolve_queued` (``cached`` holds a ``-1``
        for each until then). Not for models with recurrent layers (their
        rollback is armed per pass: :meth:`forward_chain`).

        Returns:
            The lazy logits (1, V).
        """
        if self.rollback is not None:
            raise UnsupportedModelError("queue_behind: recurrent layers need forward_chain")
        self._tree_rows = None
        self.slot_positions = np.array([self.offset], dtype=np.int64)
        self.cached.append(-1)
        return self._chain(token.reshape(1).astype(mx.int32))[0]

    def resolve_queued(self, tokens: Sequence[int]) -> None:
        """Record the ids of the tokens queued last by :meth:`queue_behind`
        (or :meth:`queue_token`), in order.

        Raises:
            ValueError: the cache does not end with that many queued tokens.
        """
        n = len(tokens)
        if n == 0:
            return
        if len(self.cached) < n or any(t != -1 for t in self.cached[-n:]):
            raise ValueError(f"resolve_queued: the cache does not end with {n} queued tokens")
        self.cached[-n:] = [int(t) for t in tokens]

    def queue_token(self, token: mx.array) -> mx.array:
        """Build the one-token forward of ``token``, whose id may not be known yet.

        For pipelined plain decoding (mlx-lm's ``generate_step``): the next
        forward is queued on the device before the host reads the current
        token. ``engine.cached`` gets a placeholder ``-1`` for it, which the
        caller must replace with :meth:`resolve_last` once the id is read.

        Args:
            token: a (1,) integer array, usually still lazy (an argmax).

        The pass is not counted in ``forward_passes``/``forward_slots`` until
        the caller uses its result (:meth:`count_forward`): the last one
        queued in a generation is discarded.

        Returns:
            The lazy logits (1, V); the caller evaluates them (``mx.async_eval``).
        """
        self.settle()
        self._tree_rows = None
        self.cached.append(-1)
        return self._chain(token.reshape(1).astype(mx.int32), count=False)[0]

    def count_forward(self, slots: int = 1) -> None:
        """Count one forward pass of ``slots`` input slots (done by the callers of
        the forward methods; by hand for a pass queued with :meth:`queue_token`)."""
        self.clock.count(slots)

    def resolve_last(self, token: int) -> None:
        """Record the id of the token queued last by :meth:`queue_token`."""
        if not self.cached or self.cached[-1] != -1:
            raise ValueError("resolve_last: no queued token to resolve")
        self.cached[-1] = int(token)

    def timed_eval(self, *arrays: mx.array) -> None:
        """Evaluate device work done outside the forward pass (the LM head on a
        few hidden rows, MTP heads, vocabulary-wide argmax / top-k / sampling)
        and count its time as device time (:meth:`DeviceClock.wait
        <mlx_mtp.timing.DeviceClock.wait>`), so that ``host_ms_per_step``
        measures only host-side work. After a pass started with ``wait=False``
        the time counted runs from that pass's start: host work done meanwhile
        overlapped the device's forward and cost no wall time of its own."""
        self.clock.wait(*arrays)

    def settle(self) -> None:
        """Finish a forward pass started with ``wait=False``, if any."""
        self.clock.settle()

    def embed_tokens(self, tokens: list[int] | np.ndarray) -> mx.array:
        """Input embeddings (L, D) of token ids."""
        return self.embed(mx.array(np.asarray(tokens, dtype=np.int32)))

    def forward_tree(
        self,
        embeddings: mx.array,
        parents: np.ndarray,
        slot_tokens: list[int],
        hidden: bool = False,
        logit_rows: int | None = None,
        wait: bool = True,
    ) -> tuple[mx.array, mx.array | None]:
        """One forward pass over a tree of N slots placed after the cache.

        Slot i attends to the whole cache, to its ancestors and to itself; its
        RoPE position is ``cache length + depth(i)``. Slot 0 is the root
        (parent -1); every other slot's parent comes before it.

        Args:
            embeddings: (N, D) input embeddings of the slots (token embeddings
                or mask vectors).
            parents: (N,) int array, parent slot of each slot (-1 for the root).
            slot_tokens: N ids recorded in ``engine.cached`` for the slots
                (-1 for mask slots); only kept slots stay there after
                :meth:`keep`.
            hidden: also return the hidden states.
            logit_rows: compute logits only for the first ``logit_rows`` slots
                (the LM head is a large share of a small model's forward);
                the caller applies ``engine.lm_head`` to other hidden rows later.
            wait: False starts the pass (``mx.async_eval``) and returns at once,
                so that the caller can build the graphs that read its logits
                (argmax, top-k) while the device runs; the caller must then
                evaluate them with :meth:`timed_eval`, which waits for the pass
                and counts it as device time from its start.

        Returns:
            logits (N or logit_rows, V) and optionally hidden states (N, D).

        Raises:
            CacheNotTrimmableError: the cache could not drop the rejected slots.
        """
        self.settle()
        n = len(parents)
        self.check_slots(n)
        if self.rollback is not None:
            return self._forward_chain_tree(
                embeddings, parents, slot_tokens, hidden, logit_rows, wait
            )
        self._require_trimmable(n)
        anc, depth = ancestors(parents)  # tree relation and positions: host work
        L = self.offset
        self.slot_positions = L + depth.astype(np.int64)
        positions = mx.array((L + depth).astype(np.int32))
        masks: dict[Any, mx.array] = {}  # one mask per cache layout, built when asked
        views = [TreeCacheView(c, anc, depth, positions, masks) for c in self.cache]
        t0 = self.clock.now()
        h = self.backbone(_slot_ids(slot_tokens), cache=views, input_embeddings=embeddings[None])[0]
        plain = all(type(c) in (KVCache, SlidingKVCache) for c in self.cache)
        self._tree_rows = (L, n, views) if plain else None
        self.cached.extend(slot_tokens)
        self.count_forward(n)
        return self._tree_outputs(h, t0, hidden, logit_rows, wait, n)

    def _tree_outputs(
        self, h: mx.array, t0: float, hidden: bool, logit_rows: int | None, wait: bool, n: int
    ) -> tuple[mx.array, mx.array | None]:
        """Logits of a tree pass's hidden states ``h`` (N, D) of ``n`` slots,
        evaluated now (``wait``) or started for :meth:`settle`; ``t0`` is the
        pass's start."""
        logits = self.lm_head(h if logit_rows is None else h[:logit_rows])
        self.clock.finish(t0, [logits, h], wait, n)
        return logits, (h if hidden else None)

    def _forward_chain_tree(
        self,
        embeddings: mx.array,
        parents: np.ndarray,
        slot_tokens: list[int],
        hidden: bool,
        logit_rows: int | None,
        wait: bool,
    ) -> tuple[mx.array, mx.array | None]:
        # forward_tree on a hybrid (recurrent) model: only a chain-shaped tree can
        # run through recurrent layers; it is a plain causal pass (positions
        # offset + depth = offset + i), rolled back by the RecurrentRollback
        n = len(parents)
        if not np.array_equal(np.asarray(parents), np.arange(-1, n - 1)):
            mtype = getattr(self.model, "model_type", type(self.model).__name__)
            raise UnsupportedModelError(
                f"model type {mtype!r} has recurrent layers (gated delta-net / conv state), "
                "which read tokens in sequence: a branching draft tree cannot run through "
                "them. Use a chain-drafting method (--method mtp or pld), or --method ntp."
            )
        self._require_trimmable(n, chain=True)
        if not does_model_support_input_embeddings(self.model):
            mtype = getattr(self.model, "model_type", type(self.model).__name__)
            raise UnsupportedModelError(
                f"model type {mtype!r} does not accept input embeddings; use a token-drafting "
                "method (--method mtp or pld)."
            )
        self._tree_rows = None
        t0 = self.clock.now()
        self.rollback.arm(self.cache, self.offset, n)
        self.slot_positions = np.arange(self.offset, self.offset + n)
        ids = _slot_ids(slot_tokens)
        h = self.backbone(ids, cache=self.cache, input_embeddings=embeddings[None])[0]
        self.cached.extend(slot_tokens)
        self.count_forward(n)
        return self._tree_outputs(h, t0, hidden, logit_rows, wait, n)

    # ------------------------------------------------------- lazy-offset passes
    def lazy_ready(self) -> bool:
        """Whether passes at a lazy cache length (:meth:`forward_at`) can run
        here: a model type whose tree pass is verified (positions and mask
        taken from the cache view; its RoPE is wrapped for per-token
        positions here), every layer keeping a plain ``KVCache`` (no window,
        no quantization, no recurrent state), and a backbone and head."""
        if self.backbone is None or not all(type(c) is KVCache for c in self.cache):
            return False
        if family_support(getattr(self.model, "model_type", ""))[0] != TREE:
            return False
        install_positional_rope(self.model)
        return True

    def forward_at(
        self,
        tokens: mx.array,
        at: mx.array,
        rows: int,
        anc: mx.array | None = None,
        depth: np.ndarray | None = None,
        embeddings: mx.array | None = None,
        hidden: bool = False,
    ) -> tuple[Any, ...]:
        """The lazy graph of one forward pass of N slots written at cache row
        ``at``, a scalar int32 array the host need not know (a pipelined
        step: :mod:`mlx_mtp.pipeline`). Nothing is evaluated, counted or
        recorded in ``cached``; the layer caches' ``offset`` is left as it
        was (the caller sets it, :meth:`settle_at`).

        Slot i sits at position ``at + depth[i]`` and attends to the cached
        rows before ``at`` and to the slots ``anc[i]`` marks (its ancestors
        and itself); a chain (``anc`` None) is a plain causal block.

        Args:
            tokens: (N,) int32 token ids (lazy or not).
            at: scalar int32: the cache length before the pass.
            rows: an upper bound on ``at + N`` known to the host: the key rows
                attended (the buffers grow to hold them).
            anc: (N, N) bool, slot j is slot i or one of its ancestors; None
                for a chain.
            depth: (N,) depth of each slot (the root 0); None for a chain.
            embeddings: (N, D) input embeddings (mask vectors), or None.
            hidden: also return the final-norm hidden states (N, D).

        Returns:
            ``(logits (N, V), views)``, with ``hidden`` ``(logits, views, h)``:
            the views keep each layer's new keys and values (``view.new``) for
            :meth:`move_rows_at`.
        """
        n = tokens.shape[0]
        at = at.astype(mx.int32).reshape(())
        dep = mx.arange(n, dtype=mx.int32) if depth is None else mx.array(depth, dtype=mx.int32)
        positions = at + dep
        # one RoPE offset per token, as a tree pass's (the model's RoPE modules
        # wrapped by install_positional_rope apply them)
        offsets = positions - mx.arange(n, dtype=mx.int32)
        j = mx.arange(rows, dtype=mx.int32)
        rel = j - at
        inside = (rel >= 0) & (rel < n)
        if anc is None:
            key_pos = j
            base = j[None, :] <= positions[:, None]
        else:
            slot = mx.clip(rel, 0, n - 1)
            key_pos = mx.where(inside, at + mx.take(dep, slot), j)
            base = (j < at)[None, :] | (mx.take(anc, slot, axis=1) & inside[None, :])
        masks: dict[Any, mx.array] = {}

        def mask(window: int | None) -> mx.array:
            if window not in masks:
                m = base
                if window is not None:
                    m = m & (key_pos[None, :] > positions[:, None] - int(window))
                masks[window] = m
            return masks[window]

        views = [LazyView(c, at, offsets, mask, rows) for c in self.cache]
        ids = mx.maximum(tokens.astype(mx.int32), 0)[None]  # mask slots (-1) as 0
        emb = None if embeddings is None else embeddings[None]
        h = self.backbone(ids, cache=views, input_embeddings=emb)[0]
        if hidden:
            return self.lm_head(h), views, h
        return self.lm_head(h), views

    def move_rows_at(self, views: list[Any], slots: mx.array, at: mx.array) -> None:
        """After :meth:`forward_at`, write the pass's slots ``slots`` (lazy
        (K,) int32) at cache rows ``at, at+1, ...`` (lazy): the accepted path of
        a tree, taken from the pass's own keys and values (the cache buffer
        is then the update's only input, updated in place)."""
        for c, v in zip(self.cache, views):
            k, val = (mx.take(a, slots, axis=2) for a in v.new)
            c.keys = mx.slice_update(c.keys, k, at, axes=(2,))
            c.values = mx.slice_update(c.values, val, at, axes=(2,))

    def settle_at(self, tokens: Sequence[int]) -> None:
        """End a run of lazy-offset passes: the cache holds exactly ``tokens``
        (the committed ones; rows past them are stale and overwritten later),
        as every other call of the engine expects."""
        self._tree_rows = None
        self.cached = [int(t) for t in tokens]
        for c in self.cache:
            c.offset = len(self.cached)

    def keep(self, start: int, slots: list[int]) -> None:
        """After a tree forward that began at cache offset ``start``, keep only the
        given slots (in order) at contiguous positions ``start, start+1, ...``.

        Right after :meth:`forward_tree` over plain ``KVCache`` layers the kept
        slots' keys/values are taken from the pass itself (the cache views keep
        them) and written lazily, with no synchronisation: the host goes on
        while the device moves them as part of the next pass. Other caches
        (quantized, rotating) gather the rows first (:func:`_move_cache_rows`).

        Raises:
            CacheNotTrimmableError: the cache could not be trimmed exactly.
        """
        self.settle()
        n_new = self.offset - start
        slots = list(slots)
        rows, self._tree_rows = self._tree_rows, None
        if slots != list(range(len(slots))):
            if rows is not None and rows[:2] == (start, n_new):
                # plain KV caches after a tree pass: write the accepted slots' own
                # keys/values (kept by the views) at start, start+1, ...; lazy, no
                # sync, and the cache array is the update's only input, so the next
                # pass's evaluation updates it in place (docs/design.md §10)
                idx, at = mx.array(slots), mx.array([start])
                for c, v in zip(self.cache, rows[2]):
                    k, val = (mx.take(a, idx, axis=2) for a in v.new)
                    if isinstance(c, SlidingKVCache):
                        c.write(start, k, val)
                    else:
                        c.keys = mx.slice_update(c.keys, k, at, axes=(2,))
                        c.values = mx.slice_update(c.values, val, at, axes=(2,))
                self.cached[start : start + len(slots)] = [self.cached[start + s] for s in slots]
                if n_new > len(slots):
                    self.trim_to(start + len(slots))
                return
            if self.rollback is not None:
                raise UnsupportedModelError(
                    "recurrent layers can keep only a prefix of a chain pass, not slots "
                    f"{slots[:8]}; use a chain-drafting method (mtp, pld) on this model."
                )
            _move_cache_rows(self.cache, start, [start + s for s in slots])
            kept = [self.cached[start + s] for s in slots]
            self.cached[start : start + len(slots)] = kept
        if n_new > len(slots):
            self.trim_to(start + len(slots))


def _move_rows(
    idx: mx.array, at: mx.array, *arrays: mx.array, extra: Sequence[mx.array] = ()
) -> list[mx.array]:
    """Copy rows ``idx`` (axis -2) of every array to ``at, at+1, ...``, in place.

    The gathered rows are evaluated first, in one ``mx.eval`` for all arrays:
    ``slice_update(a, take(a, idx))`` in one graph keeps ``a`` alive as the
    ``take``'s input, so the update cannot reuse ``a``'s buffer and copies all
    of it (the whole KV cache of a layer, every step: 23-52 ms per layer at 8K
    tokens, hundreds at 32K on a CPU). With the rows already computed, the
    update's only input is ``a``, whose buffer it takes over (docs/design.md §10);
    ``examples/keep_bench.py`` measures both ways.
    """
    # mx.take + mx.slice_update build the graph ~4x faster on the host than
    # ``arr[..., a:b, :] = arr[..., idx, :]``
    rows = [mx.take(a, idx, axis=-2) for a in arrays]
    mx.eval(rows, *extra)  # ``extra``: other gathered rows, evaluated in the same sync
    return [mx.slice_update(a, r, at, axes=(a.ndim - 2,)) for a, r in zip(arrays, rows)]


def _move_cache_rows(cache: list[Any], start: int, rows: list[int]) -> None:
    """Move cache rows ``rows`` (absolute positions) to ``start, start+1, ...``
    in every layer, without copying the rest of the cache (see :func:`_move_rows`).

    Raises:
        CacheNotTrimmableError: a layer cache cannot be rearranged (checked for
            every layer before any is changed).
    """
    # a layer with several caches (CacheList: MLA latents + indexer keys) moves each
    cache = [s for c in cache for s in (c.caches if isinstance(c, CacheList) else [c])]
    for c in cache:
        if not isinstance(c, (KVCache, SlidingKVCache, QuantizedKVCache)):
            raise CacheNotTrimmableError(
                f"cannot rearrange a {type(c).__name__} after verification"
            )
    # a sliding window's rows: gathered with the other layers' (one sync), then
    # written to the rows of positions start, start+1, ... in its ring
    ring = [c for c in cache if isinstance(c, SlidingKVCache)]
    gathered = [
        mx.take(a, mx.array(c.rows(np.asarray(rows))), axis=2)
        for c in ring
        for a in (c.keys, c.values)
    ]
    # one list of every layer's arrays so that the gathered rows of all layers
    # are evaluated together (one sync per keep, not one per layer)
    arrays: list[mx.array] = []
    for c in cache:
        if isinstance(c, QuantizedKVCache):
            arrays += [*c.keys, *c.values]
        elif not isinstance(c, SlidingKVCache):
            arrays += [c.keys, c.values]
    moved = iter(_move_rows(mx.array(rows), mx.array([start]), *arrays, extra=gathered))
    got = iter(gathered)
    for c in ring:
        c.write(start, next(got), next(got))
    for c in cache:
        if isinstance(c, SlidingKVCache):
            continue
        if isinstance(c, QuantizedKVCache):
            nk, nv = len(c.keys), len(c.values)
            c.keys = type(c.keys)(next(moved) for _ in range(nk))
            c.values = type(c.values)(next(moved) for _ in range(nv))
        else:
            c.keys, c.values = next(moved), next(moved)


def _slot_ids(slot_tokens: list[int]) -> mx.array:
    """(1, N) int32 token ids of a pass's slots for the backbone, next to their
    embeddings (mask slots, -1, as 0): families that read token ids for more
    than the embedding get the real ids of the token slots."""
    return mx.array(np.maximum(np.asarray(slot_tokens, dtype=np.int64), 0).astype(np.int32))[None]


def ancestors(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ancestor-or-self matrix and depth of a tree given by parent indices.

    Args:
        parents: (N,) ints; parents[0] == -1 and parents[i] < i.

    Returns:
        ``anc`` (N, N) bool with anc[i, j] true iff j is i or an ancestor of i,
        and ``depth`` (N,) int32 with depth[root] == 0.
    """
    # host work on every forward: one Python int per row as a bit set, then a
    # single unpackbits (a numpy row operation per slot costs ~10x more)
    par = [int(p) for p in parents]
    n = len(par)
    rows, depth = [1], [0]
    for i in range(1, n):
        p = par[i]
        if not 0 <= p < i:
            raise ValueError(f"slot {i} has parent {p}; parents must come first")
        rows.append(rows[p] | (1 << i))
        depth.append(depth[p] + 1)
    width = (n + 7) // 8
    packed = np.frombuffer(b"".join(r.to_bytes(width, "little") for r in rows), np.uint8)
    anc = np.unpackbits(packed.reshape(n, width), axis=1, count=n, bitorder="little")
    return anc.astype(bool), np.array(depth, dtype=np.int32)
