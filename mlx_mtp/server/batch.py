"""Continuous batching of the worker's ``ntp`` requests and greedy drafting ones.

With ``--max-batch N`` above 1, the worker runs every active request of one
kind in one batched forward pass per step. ``ntp`` requests run with mlx-lm's
``BatchGenerator`` (``BatchKVCache``); greedy ``pld``, ``recycle``,
``probe``, ``hybrid`` and ``draft`` requests run in a
:class:`~mlx_mtp.batching.DraftBatch`, where each row's draft (prompt
lookup; with recycle the table's tree; with probe the tree its mask slots
grew; with hybrid both lookup and masks; with clp the chain its CLP heads
wrote; with draft the draft model's chain) is verified in the batch's pass
(a request joins after its prompt is prefilled alone, one chunk of its
share of the server's prefill step after each of the batch's passes, so
the other rows go on decoding meanwhile). An ``ntp`` request joins after
its prompt is prefilled (with up to 7 others, each in chunks of its share
of the server's prefill step, so that no pass is larger than the time
bound allows; a
prefix it shares with the newest finished ``ntp`` request starts from that
request's KV cache) and leaves at EOS, ``max_tokens``, a
stop string, cancellation or disconnect, between steps. Each request keeps
its own detokenizer, stop strings and sampler (:class:`~mlx_mtp.api.RowSampler`:
its own seed and positions), so its answer is the one it gets alone, up to
the rounding of a batched pass (see :func:`mlx_mtp.api.batch_generate`).
Requests of the other kind, or with another method, wait until the batch
has drained (then a ``pld`` batch starts, or the request runs alone).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..api import RowSampler
from ..decoding import GenerationStats
from ..engine import common_prefix
from ..errors import MTPError
from ..sampling import PositionalSampler, random_seed
from .events import Cancelled, Delta, Done, Event, Failed, Started, Taken
from .protocol import GenRequest, OpenAIError, StopCutter, usage
from .replies import mtp_stats, openai_error


@dataclass
class Row:
    """One request in the batch.

    Attributes:
        job: the worker's :class:`~.worker.Job`.
        uid: its id in mlx-lm's ``BatchGenerator``.
        prompt: its prompt's token ids (an ``ntp`` row: its finished cache
            is kept for the next prompt that shares a prefix).
        detok: its own streaming detokenizer.
        cutter: its stop strings.
        cached: prompt tokens whose KV cache came from an earlier request.
        tokens: the tokens generated so far.
        started / first: ``time.perf_counter()`` when it joined and when its
            first token came.
    """

    job: Any
    uid: int
    prompt: list[int]
    detok: Any
    cutter: StopCutter
    cached: int = 0
    tokens: list[int] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    first: float | None = None

    @property
    def prompt_tokens(self) -> int:
        """The prompt's length."""
        return len(self.prompt)


class BatchRunner:
    """The worker's batch of ``ntp`` or of greedy drafting requests of one
    kind (used from the worker thread only).

    Args:
        model: the worker's default :class:`~mlx_mtp.api.MTPModel` (``ntp``):
            its prompt encoding, context check and end-of-sequence tokens.
        max_batch: most requests decoded in one forward pass.
        prefill_step: prompt tokens per prefill pass.
        sampling: the server's sampling defaults (the API's keywords).
        max_tokens: new tokens when a request does not say.
        emit / finish: the worker's ``_emit(job, event)`` and ``_finish(job)``.
        kind: ``"ntp"`` or a drafting kind (``DraftBatch.METHODS``).
        max_slots: with a drafting kind, most tokens in one decoding
            pass (the server's slots bound: rows x draft width).
        table: with ``recycle``, the table to draft from and fill (the
            worker's :class:`~mlx_mtp.sources.recycle.RecycleTable`, kept
            from one batch to the next).
        draft_model: with ``draft``, the server's draft model (an mlx-lm
            model of the target's tokenizer, checked by the worker).
        heads: with ``clp``, the model's CLP heads
            (:class:`~mlx_mtp.clp_format.CLPHeads`, loaded by the worker).
        native: with ``mtp``, the checkpoint's MTP layer (loaded by the
            worker).
    """

    def __init__(
        self,
        model: Any,
        max_batch: int,
        prefill_step: int,
        sampling: dict[str, Any],
        max_tokens: int,
        emit: Any,
        finish: Any,
        kind: str = "ntp",
        max_slots: int = 1024,
        table: Any = None,
        draft_model: Any = None,
        heads: Any = None,
        native: Any = None,
    ):
        from mlx_lm.generate import BatchGenerator

        from ..batching import DraftBatch

        self.kind = kind
        self.model = model
        self.max_batch = max_batch
        self.sampling = sampling
        self.max_tokens = max_tokens
        self.emit = emit
        self.finish = finish
        self.eos = model.eos_ids
        # up to 8 prompts are prefilled together, each in chunks of its share
        # of the prefill step: a prefill pass holds at most prefill_step tokens
        # (the time bound), and short prompts join in one pass
        together = min(max_batch, 8)
        #: prompt tokens a joining prompt of a drafting batch is prefilled
        #: by per step (its share of the prefill step, as in the ntp batch)
        self.join_step = max(16, prefill_step // together)
        self.drafts: DraftBatch | None = None
        self.gen: Any = None
        if kind in DraftBatch.METHODS:
            self.drafts = DraftBatch.for_method(
                model.model,
                self.eos,
                kind,
                table=table,
                draft_model=draft_model,
                heads=heads,
                native=native,
                prefill_step=prefill_step,
                max_slots=max_slots,
            )
        else:
            self.gen = BatchGenerator(
                model.model,
                stop_tokens=[[t] for t in sorted(self.eos)],
                completion_batch_size=max_batch,
                prefill_batch_size=together,
                prefill_step_size=max(16, prefill_step // together),
            )
        self.rows: dict[int, Row] = {}
        #: the tokens and KV cache (mlx-lm ``KVCache`` per layer) of the
        #: newest finished ``ntp`` request: a joining prompt that shares a
        #: prefix of them starts from that prefix's cache
        self.last: tuple[list[int], list[Any]] | None = None

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def room(self) -> int:
        """Requests that may still join."""
        return self.max_batch - len(self.rows)

    def add(self, job: Any, sampling: dict[str, Any]) -> None:
        """Take a job off the queue into the batch (its prompt is prefilled
        over the next steps): ``Taken``, then ``Cancelled`` if its client
        left while it waited, or ``Failed`` for a prompt the API refuses.

        Args:
            sampling: the request's own sampling settings (over the server's).
        """
        req: GenRequest = job.request
        job.started = time.perf_counter()
        self.emit(job, Taken())
        if job.cancel.is_set():
            job.status = "cancelled"
            self.emit(job, Cancelled())
            self.finish(job)
            return
        given = {**self.sampling, **sampling}
        try:
            tokens = self.model.encode(req.prompt, req.kind == "chat", tools=req.tools)
            asked = self.max_tokens if req.max_tokens is None else req.max_tokens
            limit = self.model.check_context(len(tokens), asked, req.max_tokens is None)
        except MTPError as e:  # the API's refusal: a 400 naming the problem
            job.status = "failed"
            self.emit(job, Failed(openai_error(e, req)))
            self.finish(job)
            return
        if self.drafts is not None:  # prefilled a chunk per step; its first token comes then
            uid = self.drafts.begin(tokens, limit)
            job.status = "running"
            detok = self.model.tokenizer.detokenizer
            detok.reset()
            self.rows[uid] = Row(job, uid, tokens, detok, StopCutter(req.stop))
            return
        samplers = None
        if given["temp"] > 0:
            seed = given["seed"] if given["seed"] is not None else random_seed()
            row_sampler = PositionalSampler(
                given["temp"], given["top_p"], given["top_k"], given["min_p"], seed
            )
            samplers = [RowSampler(row_sampler, len(tokens))]
        cached, cache = self._reuse(tokens)
        (uid,) = self.gen.insert(
            [tokens[cached:]],
            [limit],
            caches=[cache],
            all_tokens=[tokens[:cached]],
            samplers=samplers,
        )
        job.status = "running"
        detok = self.model.tokenizer.detokenizer  # a copy of its own
        detok.reset()
        self.rows[uid] = Row(job, uid, tokens, detok, StopCutter(req.stop), cached)

    #: fewest shared prompt tokens worth starting from an earlier cache
    MIN_REUSE = 8

    def _reuse(self, tokens: list[int]) -> tuple[int, list[Any] | None]:
        """How many leading ``tokens`` the newest finished request's cache
        holds (at least :attr:`MIN_REUSE`, and never the last token, which
        the first decoding pass feeds), and a cache of just those tokens
        (a copy: one ``KVCache`` per layer); ``(0, None)`` when none is
        shared. As ``mlx_lm.server`` and a solo generation reuse a prefix:
        a system prompt or a chat's history is prefilled once."""
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache

        if self.last is None:
            return 0, None
        held, layers = self.last
        n = common_prefix(held, tokens[:-1])
        if n < self.MIN_REUSE:
            return 0, None
        cache = []
        for layer in layers:
            c = KVCache()
            c.keys = mx.contiguous(layer.keys[..., :n, :])
            c.values = mx.contiguous(layer.values[..., :n, :])
            c.offset = n
            cache.append(c)
        return n, cache

    def _keep_cache(self, row: Row, cache: list[Any] | None) -> None:
        """Keep a finished ``ntp`` row's cache (its prompt and answer but
        the last token) for the next joining prompt (:meth:`_reuse`); only
        plain full caches, whose length matches the row's tokens."""
        from mlx_lm.models.cache import KVCache

        if not cache or any(type(c) is not KVCache or c.keys is None for c in cache):
            return
        held = [*row.prompt, *row.tokens][: cache[0].offset]
        if len(held) == cache[0].offset and all(c.offset == len(held) for c in cache):
            self.last = (held, cache)

    def step(self) -> None:
        """Drop the cancelled rows, run one step (a decoding pass of every
        row that has its prompt in, and one prefill chunk of a joining one)
        and tell each request what it got."""
        gone = [uid for uid, row in self.rows.items() if row.job.cancel.is_set()]
        if gone:
            for uid in gone:
                self._end(self.rows.pop(uid), "cancelled")
            self._remove(gone)
        if not self.rows:
            return
        if self.drafts is not None:
            got_all = self.drafts.step()
            joined = self.drafts.advance(self.join_step)
            for got in [*got_all, *([joined] if joined is not None else [])]:
                row = self.rows.get(got.uid)
                if row is not None:
                    self._take(row, got.tokens, got.finish_reason)
            return
        _, responses = self.gen.next()
        for r in responses:
            row = self.rows.get(r.uid)
            if row is not None:
                self._take(row, [int(r.token)], r.finish_reason)
                if r.finish_reason is not None:
                    self._keep_cache(row, getattr(r, "prompt_cache", None))

    def _remove(self, uids: list[int]) -> None:
        if self.drafts is not None:
            for uid in uids:
                self.drafts.remove(uid)
        else:
            self.gen.remove(uids)

    def _take(self, row: Row, tokens: list[int], finish: str | None) -> None:
        """Tell a row's request its new tokens (the last one may end it:
        ``finish``) and end it at a stop string (leaving the batch) or
        ``finish``."""
        now = time.perf_counter()
        if row.first is None:
            row.first = now
            self.emit(row.job, Started())
        text = ""
        for i, token in enumerate(tokens):
            row.tokens.append(token)
            if token not in self.eos:
                row.detok.add_token(token)
            if finish is not None and i == len(tokens) - 1:
                row.detok.finalize()
            text += row.cutter.feed(row.detok.last_segment)
            if row.cutter.stopped:
                break
        row.job.generated_tokens = len(row.tokens)
        if finish is not None and not row.cutter.stopped:
            text += row.cutter.flush()
        if text:
            self.emit(row.job, Delta(text))
        if row.cutter.stopped:
            self._end(self.rows.pop(row.uid), "stop")
            if finish is None:  # still in the generator's batch
                self._remove([row.uid])
        elif finish is not None:
            self._end(self.rows.pop(row.uid), finish)

    def fail_all(self, error: OpenAIError) -> None:
        """End every row with ``error`` (after an MLX failure: the
        generator's state is not trusted, the worker makes a new one)."""
        for row in self.rows.values():
            row.job.status = "failed"
            self.emit(row.job, Failed(error))
            self.finish(row.job)
        self.rows.clear()
        self._close()

    def close(self) -> None:
        """Drop every row (cancelled) and the generator's state."""
        for uid in list(self.rows):
            self._end(self.rows.pop(uid), "cancelled")
        self._close()

    def _close(self) -> None:
        if self.gen is not None:
            self.gen.close()
        self.drafts = None

    def _end(self, row: Row, finish: str) -> None:
        job = row.job
        job.status = "cancelled" if finish == "cancelled" else "done"
        now = time.perf_counter()
        first = row.first if row.first is not None else now
        n = len(row.tokens)
        st = GenerationStats(
            method="ntp(batch)",
            runner="batched",
            prompt_tokens=row.prompt_tokens,
            prefill_tokens=row.prompt_tokens - row.cached,
            prefill_time=first - row.started,
            generated_tokens=n,
            decode_time=now - first,
            forward_passes=n,
            steps=n,
            slots=n,
            max_slots=1,
        )
        drafted = self.drafts.take_row(row.uid) if self.drafts is not None else None
        if drafted is not None:
            st.method = f"{self.kind}(batch)"
            st.forward_passes = st.steps = 1 + drafted.passes
            st.drafted, st.accepted = drafted.drafted, drafted.accepted
            st.slots, st.max_slots = drafted.slots, drafted.max_slots
        event: Event = Done(
            finish, usage(row.prompt_tokens, n, row.cached), mtp_stats(st, row.cached, job)
        )
        self.emit(job, event)
        self.finish(job)
