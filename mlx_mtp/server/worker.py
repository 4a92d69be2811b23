"""The generation worker: one thread that owns the model and runs requests in turn.

MLX models and their KV caches are not thread-safe, so a single thread loads
the model, binds one :class:`~mlx_mtp.api.MTPModel` per (method, options)
asked for (:meth:`LoadedModel.bind <mlx_mtp.loading.LoadedModel.bind>`, all
sharing the one loaded model; each has its own KV cache, reused across
requests by longest common prefix), runs every generation and frees
everything at the end (as ``mlx_lm.server`` does with its generation thread).
Prompt encoding and the vocabulary and context-length checks are the API's
(:meth:`MTPModel.stream_generate <mlx_mtp.api.MTPModel.stream_generate>`);
the bounds on what a request may ask are :class:`~.limits.Limits`. The HTTP
side only puts :class:`Job` objects on a bounded queue and receives
:mod:`~.events` through the job's ``emit`` callback. A job is cancelled
between forward passes (``should_stop``), and no pass takes longer than the
measured bound, so a cancelled request or a shutdown frees the worker within
``--max-forward-s``.
"""

from __future__ import annotations

import copy
import gc
import logging
import math
import queue
import threading
import time
import traceback
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from .. import distributed
from ..api import BATCH_METHODS
from ..decoding import check_logprobs
from ..engine import Engine
from ..errors import InvalidArgumentError, MTPError
from ..loading import draft_for, load_model, share_target
from ..methods import make_method, method_class, method_options
from ..runners import check_runner
from .events import Cancelled, Delta, Done, Event, Failed, Started, Taken
from .limits import Limits
from .protocol import GenRequest, OpenAIError, StopCutter, usage
from .replies import logprob_entries, mtp_stats, openai_error

log = logging.getLogger("mlx_mtp.server")

#: seconds rank 0 of a sharded model waits for a request before telling the
#: other ranks it is idle (each tells costs two small ``all_sum``)
IDLE_POLL = 1.0
#: requests decoded together when ``--max-batch`` is not given. Eight: on a
#: CPU the batched matrix products are compute-bound from about 8 rows (an
#: 8-row step costs about twice a one-row step, docs/server.md), the default
#: queue holds 8 more, up to 8 joining prompts are prefilled together, and 8
#: rows' KV caches stay small beside the weights; more rows mostly raise
#: every request's latency on such a machine.
DEFAULT_MAX_BATCH = 8


@dataclass(eq=False)  # a job is itself: compared and hashed by identity
class Job:
    """One generation request on its way through the worker.

    Attributes:
        request: the parsed request.
        emit: called from the worker thread with each :mod:`~.events` event
            (must not block).
        cancel: set by the HTTP side when the client has gone (or waited too
            long); the worker stops before the next forward pass (and skips a
            job still queued).
        enqueued / started / finished: ``time.perf_counter()`` seconds.
        status: ``queued``, ``running``, ``done``, ``cancelled`` or ``failed``.
        generated_tokens: tokens generated (also for a cancelled job).
        prepared: what :meth:`Worker.admit` made of the request's method:
            ``(cache key, method instance)``, or None (the default method, or
            not admitted here: the worker checks it then).
        shutdown: set (with ``cancel``) when the server shuts down, so the
            handler ends the answer properly instead of as for a client gone.
    """

    request: GenRequest
    emit: Callable[[Event], None]
    cancel: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.perf_counter)
    started: float | None = None
    finished: float | None = None
    status: str = "queued"
    generated_tokens: int = 0
    prepared: tuple[tuple, Any] | None = None
    shutdown: bool = False

    @property
    def queue_wait(self) -> float:
        """Seconds between submission and the worker taking the job."""
        return (self.started or time.perf_counter()) - self.enqueued


def method_key(method: str, options: dict[str, Any]) -> tuple:
    """Cache key of a (method, options) pair; option values compare as text."""
    return (method, tuple(sorted((str(k), str(v)) for k, v in options.items())))


class Worker:
    """The model-owning generation thread and its bounded request queue.

    Args:
        model: model spec (alias, folder, ``.gguf``, HF repo id); also the id
            clients send as ``"model"``.
        method / options: the default method and its options (as ``load``;
            the operator's choice, so paths are not restricted here).
        dtype / max_kv_size / kv_bits / kv_group_size: as :func:`mlx_mtp.load`
            (with ``kv_bits`` requests are decoded one at a time, not batched).
        max_tokens: new tokens when a request does not say (clipped to the
            context left).
        temp / top_p / top_k / min_p / seed: sampling defaults when a request
            does not say (seed None: a random one per request).
        queue_size: requests waiting beyond the running ones; more get 429.
        max_methods: (method, options) models kept at once (each holds a KV
            cache); the least recently used is dropped, never the default.
        limits: the bounds on requests (:class:`~.limits.Limits`; default
            ones if None). Its forward-time bound is measured at start.
        max_batch: ``ntp`` requests, or greedy ``pld``, ``recycle``,
            ``probe``, ``hybrid``, ``clp`` or ``draft`` requests with their drafts,
            decoded together in one forward pass (:mod:`~.batch`; at most
            the slots bound; default :data:`DEFAULT_MAX_BATCH`); 1: one
            request at a time, whatever its method.

    Raises:
        InvalidArgumentError: queue_size, max_methods or max_batch below 1,
            or a bad sampling default.
    """

    def __init__(
        self,
        model: str,
        method: str = "ntp",
        options: dict[str, Any] | None = None,
        *,
        dtype: str | None = None,
        max_kv_size: int | None = None,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        max_tokens: int = 512,
        temp: float = 0.0,
        top_p: float = 0.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | None = None,
        queue_size: int = 8,
        max_methods: int = 4,
        pipeline: bool = False,
        runner: str = "auto",
        limits: Limits | None = None,
        max_batch: int = DEFAULT_MAX_BATCH,
    ):
        from ..validation import check_generation_args, check_kv

        check_kv(kv_bits, kv_group_size)  # before the load
        if kv_bits is not None and max_kv_size is not None:
            raise InvalidArgumentError(
                "--kv-bits and --max-kv-size cannot be combined: a sliding window is not quantized."
            )

        if queue_size < 1 or max_methods < 1:
            raise InvalidArgumentError("queue_size and max_methods must be >= 1.")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise InvalidArgumentError(f"--max-batch must be an integer >= 1, got {max_batch!r}.")
        self.max_batch = max_batch
        self.model_id = model
        self.method = method
        self.options = dict(options or {})
        self.dtype = dtype
        self.max_kv_size = max_kv_size
        #: a quantized KV cache for every binding (requests then run one at a
        #: time: the batched runner keeps full-precision caches)
        self.kv = {"kv_bits": kv_bits, "kv_group_size": kv_group_size}
        self.sampling = check_generation_args(
            max_tokens=max_tokens, temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed
        )
        self.max_tokens = self.sampling.pop("max_tokens")
        self.queue_size = queue_size
        self.max_methods = max_methods
        self.pipeline = pipeline
        #: the runner every bound model asks for (:mod:`mlx_mtp.runners`)
        self.runner = check_runner(runner)
        self.limits = limits if limits is not None else Limits()
        self.default_key = method_key(method, self.options)
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self._models: OrderedDict[tuple, Any] = OrderedDict()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._durations: deque[float] = deque(maxlen=20)
        self.loaded: Any = None
        self.running: Job | None = None
        #: the batch of ntp or pld jobs (:class:`~.batch.BatchRunner`), made at the first one
        self._batch: Any = None
        #: whether the model can run a drafting batch (None: not checked yet)
        self._draft_batchable: dict[str, bool] = {}
        #: the table of a ``recycle`` batch, kept for the next one (as a
        #: recycle method object keeps its own across generations)
        self._recycle_table: Any = None
        #: the CLP heads of a ``clp`` batch (loaded once, when first checked)
        self._clp_heads: Any = None
        #: the MTP layer of an ``mtp`` batch (loaded once, when first checked)
        self._native_layer: Any = None
        #: a job taken off the queue that waits for the batch to drain (another method)
        self._held: Job | None = None
        self._loaded_names: tuple[str, ...] = ()  # a snapshot for other threads
        self.counts = {"done": 0, "cancelled": 0, "failed": 0, "rejected": 0}
        #: the last finished jobs (for /health and tests)
        self.recent: deque[Job] = deque(maxlen=64)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the thread and wait until the model is loaded and the
        forward-time bound measured.

        Raises:
            MTPError: the model or the default method could not be loaded, or
                the default method is over the limits (ModelNotFoundError,
                UnknownMethodError, InvalidArgumentError, ...).
            KeyboardInterrupt: Ctrl-C while loading (the thread is stopped).
        """
        self._thread = threading.Thread(target=self._run, name="mlx-mtp-worker", daemon=True)
        self._thread.start()
        try:
            while not self._ready.wait(0.2):  # a timed wait lets Ctrl-C through
                pass
        except KeyboardInterrupt:
            self._queue.put(None)  # served once the load ends
            self.stop(timeout=600)  # waits for the load (MLX aborts a process left by it)
            raise
        if self._load_error is not None:
            self._thread.join()
            self._thread = None
            raise self._load_error

    def stop(self, timeout: float = 60.0) -> None:
        """Cancel the running job, drop queued ones, stop the thread (within
        about one forward pass: the bound ``--max-forward-s``)."""
        if self._thread is None:
            return
        if self.running is not None:
            self.running.cancel.set()
        held = self._held
        for job in [*self.batched(), *([held] if held is not None else [])]:
            job.cancel.set()
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel.set()
                self._emit(job, Failed(OpenAIError(503, "The server is shutting down.")))
        self._queue.put(None)
        # the thread must end before the interpreter does (MLX aborts the process
        # otherwise), so a Ctrl-C arriving now waits for it too, then goes on
        interrupted, deadline = False, time.monotonic() + timeout
        while self._thread.is_alive() and time.monotonic() < deadline:
            try:
                self._thread.join(0.2)
            except KeyboardInterrupt:
                interrupted = True
        if self._thread.is_alive():
            log.warning("the worker did not stop within %.0f s", timeout)
        self._thread = None
        if interrupted:
            raise KeyboardInterrupt

    def wait(self) -> None:
        """Block until the worker thread ends (the other ranks of a sharded
        model: until rank 0's worker stops)."""
        if self._thread is not None:
            self._thread.join()

    @property
    def alive(self) -> bool:
        """Whether the worker thread is running and has its model."""
        return self._thread is not None and self._thread.is_alive() and self.loaded is not None

    def admit(self, req: GenRequest) -> tuple[tuple, Any] | None:
        """Check what a request asks before it is queued (pure Python, no
        model: safe on the HTTP side), so that a request over a bound or with
        a bad setting is refused at once, never told to wait (429) first:
        ``max_tokens`` against its limit, the sampling settings, the
        method, its options (files among them) and its slots per forward
        pass, ``tools`` against the model's tool-call format and
        ``logprobs`` against the method (lossless only). The prompt (its
        encoding, vocabulary and length) is the worker's, through the API.

        Returns:
            ``(cache key, method)`` for a request naming a method, else None
            (give it to the :class:`Job` as ``prepared``).

        Raises:
            OpenAIError: 400 naming the field or bound.
        """
        from ..validation import check_generation_args

        try:
            self.limits.check_tokens(req.max_tokens)
            given = {**self.sampling, **sampling_of(req)}
            asked = self.max_tokens if req.max_tokens is None else req.max_tokens
            check_generation_args(max_tokens=asked, labels=REQUEST_FIELDS, **given)
            if req.tools is not None:
                check_tools(self.loaded, self.model_id)
            if req.method is None:
                if req.logprobs is not None:
                    check_logprobs(self._models[self.default_key].method, req.logprobs)
                return None
            self.check_option_names(req.method, req.options)
            options = self.limits.request_options(req.method, req.options)
            method = make_method(req.method, **options)
            self.limits.check_method(method)
            check_logprobs(method, req.logprobs)
        except MTPError as e:
            raise openai_error(e, req) from None
        return method_key(req.method, options), method

    def check_option_names(self, method: str, options: dict[str, Any]) -> None:
        """Refuse, in the request's words, a method option the method does not
        take and a required option left out (the package's own messages for
        these speak of CLI flags).

        Raises:
            UnknownMethodError: ``method`` is not a method.
            OpenAIError: 400 naming ``mtp.OPTION``.
        """
        takes = method_options(method_class(method))
        unknown = sorted(set(options) - set(takes))
        if unknown:
            s = "s" if len(unknown) > 1 else ""
            raise OpenAIError(
                400,
                f"Method {method} does not take the option{s} "
                f"{', '.join('mtp.' + u for u in unknown)}. It takes: "
                f"{', '.join(takes) if takes else 'no options'}.",
                param=f"mtp.{unknown[0]}",
                code="invalid_argument_error",
            )
        need = REQUIRED_OPTIONS.get(method)
        if need is not None and options.get(need) in (None, ""):
            how = (
                f"a path inside a folder this server allows (--allow-artifacts; "
                f"{len(self.limits.allow_artifacts)} folder(s))"
                if self.limits.allow_artifacts
                else "which requests may not name on this server; choose another method"
            )
            raise OpenAIError(
                400,
                f"Method {method} needs the option mtp.{need}, {how}.",
                param=f"mtp.{need}",
                code="invalid_argument_error",
            )

    def submit(self, job: Job) -> None:
        """Queue a job.

        Raises:
            OpenAIError: 429 with ``Retry-After`` when the queue is full, 503
                when the worker is not running.
        """
        if not self.alive:
            raise OpenAIError(503, "The generation worker is not running.", type="server_error")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self.counts["rejected"] += 1
            raise OpenAIError(
                429,
                f"The server is busy ({self.queue_size} requests waiting); retry after "
                f"{self.retry_after()} s.",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(self.retry_after())},
            ) from None

    def retry_after(self) -> int:
        """Seconds a rejected client should wait: the mean recent request time
        times the requests ahead of it (at least 1)."""
        mean = sum(self._durations) / len(self._durations) if self._durations else 1.0
        return max(1, math.ceil(mean * (self._queue.qsize() + 1)))

    def health(self) -> dict[str, Any]:
        """State for ``GET /health`` (the full form, for a client with the key)."""
        return {
            "status": "ok" if self.alive else "unavailable",
            "model": self.model_id,
            "method": self.method,
            "busy": self.running is not None or bool(self.batched()),
            "batch": len(self.batched()),
            "queue": {"waiting": self._queue.qsize(), "capacity": self.queue_size},
            "jobs": dict(self.counts),
            "methods_loaded": list(self._loaded_names),
            "limits": self.limits.describe(),
        }

    # --------------------------------------------------------------- thread
    def _run(self) -> None:
        try:
            default = make_method(self.method, **self.options)  # checked before the load
            self.limits.resolve(default.block_complexity, self.max_tokens)
            self.limits.check_default(default)
            self.loaded = load_model(self.model_id, self.dtype, pipeline=self.pipeline)
            shared = share_target(self.loaded, self.options)
            if shared is not self.options:  # the draft model is the target: its weights
                default = make_method(self.method, **shared)
            # timed on a cache of its own (no sliding window, nothing to restore)
            self.limits.measure(Engine(self.loaded.model))
            self.limits.check_default(default)
            m = self.loaded.bind(
                default, max_kv_size=self.max_kv_size, runner=self.runner, **self.kv
            )
            m.prefill_step = self.limits.prefill_step
            self._models[self.default_key] = m
            self._snapshot()
        except BaseException as e:  # reported by start()
            self._load_error = e
            self._models.clear()
            self.loaded = None
            gc.collect()
            _end_thread_streams()
            self._ready.set()
            return
        self._ready.set()
        try:
            self._serve_jobs()
        finally:
            # free the model and caches in the thread that made them
            if self._batch is not None:
                self._batch.close()
                self._batch = None
            self._models.clear()
            self.loaded = None
            gc.collect()
            _end_thread_streams()

    def batched(self) -> list[Job]:
        """The jobs in the batch now (a snapshot, for other threads)."""
        batch = self._batch
        while batch is not None:
            try:
                return [row.job for row in tuple(batch.rows.values())]
            except RuntimeError:  # the worker changed the rows meanwhile: look again
                continue
        return []

    def batchable(self, job: Job) -> str | None:
        """The kind of batch a job runs in (None: it runs alone): ``"ntp"``
        for plain decoding, ``"pld"`` for greedy prompt lookup,
        ``"recycle"`` for greedy token recycling (with prompt lookup),
        ``"probe"`` for greedy ESP mask slots, ``"hybrid"`` for both
        prompt lookup and mask slots, ``"clp"`` for greedy CLP heads
        (verified), ``"lookahead"`` for greedy Jacobi columns and their
        n-gram pool, ``"mtp"`` for the checkpoint's own MTP layer and
        ``"draft"`` for the server's greedy draft model, on a model whose
        layers all keep a full KV cache (the server's method without options
        but its draft model, or a method asked for without options); with
        ``--max-batch`` above 1, an unbounded cache and a model on one rank.
        A request for ``logprobs`` runs alone: a batched row's step reads
        back its tokens, not the target's rows."""
        req = job.request
        if req.logprobs is not None:
            return None
        if (
            self.max_batch < 2
            or self.max_kv_size is not None
            or self.kv["kv_bits"] is not None
            or distributed.group() is not None
        ):
            return None
        method, options = (
            (self.method, self.options) if req.method is None else (req.method, req.options)
        )
        # the server's draft model is the one option a batch takes (a request
        # cannot name one)
        own_draft = method == "draft" and req.method is None and set(options) == {"draft_model"}
        if (options and not own_draft) or method not in BATCH_METHODS:
            return None
        if method != "ntp":
            temp = sampling_of(req).get("temp", self.sampling["temp"])
            if temp > 0 or not self._drafts_batch(method):
                return None
        return method

    def _drafts_batch(self, kind: str) -> bool:
        """Whether this model can run a drafting batch of ``kind`` (checked
        once per kind): a full KV cache in every layer; for ``recycle`` and
        ``lookahead`` a family that runs draft trees; for ``probe`` and ``hybrid`` one that
        also takes input embeddings (mask slots); for ``clp`` CLP heads
        made for the model (loaded here); for ``mtp`` a native MTP layer
        (loaded here); for ``draft`` a draft model that loads,
        shares the tokenizer and keeps a full KV cache too. Where it cannot,
        the requests run alone (and get the method's own error if it cannot
        run at all)."""
        if kind not in self._draft_batchable:
            from ..batching import BatchDrafter, check_batchable, check_mask_support
            from ..families import check_tree_support

            try:
                check_batchable(self.loaded.model)
                if kind in ("recycle", "lookahead"):
                    check_tree_support(self.loaded.model, kind)
                if kind in ("probe", "hybrid"):
                    check_mask_support(self.loaded.model)
                if kind == "clp":
                    from ..clp_format import heads_for

                    name = getattr(self.loaded, "name", self.model_id)
                    self._clp_heads = heads_for(self.loaded.model, None, name)[0]
                if kind == "draft":
                    BatchDrafter(self._draft_model())
                if kind == "mtp":
                    from ..api import native_layer

                    self._native_layer = native_layer(self.loaded)
                self._draft_batchable[kind] = True
            except MTPError:
                self._draft_batchable[kind] = False
        return self._draft_batchable[kind]

    def _draft_model(self) -> Any:
        """The server's draft model (loaded once per process; the target
        itself where ``draft_model`` names it), its tokenizer checked.

        Raises:
            MTPError: it does not load, or its tokenizer differs."""
        return draft_for(self.loaded, self.options["draft_model"]).model

    def _fits(self, kind: str | None) -> bool:
        """Whether a job of ``kind`` joins the batch now."""
        return kind is not None and self._batch is not None and self._batch.kind == kind

    def _serve_jobs(self) -> None:
        """Serve jobs until told to stop: ``ntp`` jobs join the batch while
        it has room; a job of another method waits for the batch to drain
        (jobs start in the order they came) and then runs alone."""
        stopping = False
        while True:
            batch = self._batch
            if batch is not None and len(batch):
                while not stopping and self._held is None and batch.room > 0:
                    try:
                        job = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if job is None:
                        stopping = True
                    elif self._fits(self.batchable(job)):
                        self._join_batch(job)
                    else:
                        self._held = job
                self._step_batch()
                continue
            if self._held is not None:
                job, self._held = self._held, None
            elif stopping:
                return
            else:
                job = self._next_job()
                if job is None:
                    return
            kind = self.batchable(job)
            if kind is not None:
                self._join_batch(job, kind)
            else:
                self._serve(job)

    def _join_batch(self, job: Job, kind: str | None = None) -> None:
        from .batch import BatchRunner

        if kind is not None and self._batch is not None and self._batch.kind != kind:
            self._batch.close()  # drained: a batch of the other kind starts
            self._batch = None
        try:
            if self._batch is None:
                if kind == "recycle" and self._recycle_table is None:
                    from ..sources.recycle import RecycleTable

                    self._recycle_table = RecycleTable()
                self._batch = BatchRunner(
                    self._models[self.default_key],
                    max(1, min(self.max_batch, self.limits.slots)),
                    self.limits.prefill_step,
                    self.sampling,
                    self.max_tokens,
                    self._emit,
                    self._finish,
                    kind or "ntp",
                    self.limits.slots,
                    self._recycle_table,
                    self._draft_model() if kind == "draft" else None,
                    self._clp_heads if kind == "clp" else None,
                    self._native_layer if kind == "mtp" else None,
                )
            self._batch.add(job, sampling_of(job.request))
        except Exception as e:  # a bug or an MLX failure: answer 500, keep serving
            log.error("a job could not join the batch:\n%s", traceback.format_exc())
            job.status = "failed"
            self._emit(
                job, Failed(OpenAIError(500, f"{type(e).__name__}: {e}", type="server_error"))
            )
            self._finish(job)

    def _step_batch(self) -> None:
        try:
            self._batch.step()
        except Exception as e:  # a bug or an MLX failure: answer 500, keep serving
            log.error("batched generation failed:\n%s", traceback.format_exc())
            batch, self._batch = self._batch, None
            batch.fail_all(OpenAIError(500, f"{type(e).__name__}: {e}", type="server_error"))
            for m in self._models.values():
                m.engine.reset()

    def _next_job(self) -> Job | None:
        """The next job, None to stop. On a sharded model (several ranks),
        rank 0 takes it from its queue and every other rank gets a copy of
        the request (answering to nobody), so that all ranks run the same
        generations in the same order; while idle, rank 0 tells the others
        so every ``IDLE_POLL`` seconds."""
        if distributed.group() is None:
            return self._queue.get()
        while True:
            shared: Any = "idle"
            if distributed.is_main():
                try:
                    job = self._queue.get(timeout=IDLE_POLL)
                except queue.Empty:
                    job = "idle"
                shared = job if job is None or job == "idle" else job.request
            shared = distributed.agree(shared)
            if shared is None:
                return None
            if isinstance(shared, str):
                continue
            return job if distributed.is_main() else Job(shared, emit=lambda event: None)

    @staticmethod
    def _emit(job: Job, event: Event) -> None:
        try:
            job.emit(event)
        except Exception:  # the HTTP side is gone (closed event loop): nothing to tell
            job.cancel.set()

    def _model_for(self, job: Job) -> Any:
        """The bound model of a job's method (built on first use through
        ``LoadedModel.bind``, after the limits are checked)."""
        req = job.request
        if req.method is None:
            self._models.move_to_end(self.default_key)
            return self._models[self.default_key]
        key, method = job.prepared or self.admit(req)  # (other ranks: not admitted yet)
        if key in self._models:
            self._models.move_to_end(key)
            return self._models[key]
        m = self.loaded.bind(method, max_kv_size=self.max_kv_size, runner=self.runner, **self.kv)
        m.prefill_step = self.limits.prefill_step
        self._models[key] = m
        while len(self._models) > self.max_methods:
            old = next(k for k in self._models if k != self.default_key)
            del self._models[old]
        self._snapshot()
        return m

    def _snapshot(self) -> None:
        self._loaded_names = tuple(
            k[0] + "".join(f",{a}={b}" for a, b in k[1]) for k in self._models
        )

    def _serve(self, job: Job) -> None:
        job.started = time.perf_counter()
        self._emit(job, Taken())
        if distributed.agree_flag(job.cancel.is_set()):  # the client left while queued
            job.status = "cancelled"
            self._emit(job, Cancelled())  # ends the request's handler
            self._finish(job)
            return
        self.running = job
        try:
            self._generate(job)
        except OpenAIError as e:
            job.status = "failed"
            self._emit(job, Failed(e))
        except MTPError as e:
            job.status = "failed"
            self._emit(job, Failed(openai_error(e, job.request)))
        except Exception as e:  # a bug or an MLX failure: answer 500, keep serving
            job.status = "failed"
            log.error("generation failed:\n%s", traceback.format_exc())
            for m in self._models.values():  # do not trust any cache after that
                m.engine.reset()
            self._emit(
                job, Failed(OpenAIError(500, f"{type(e).__name__}: {e}", type="server_error"))
            )
        finally:
            self.running = None
            self._finish(job)

    def _finish(self, job: Job) -> None:
        job.finished = time.perf_counter()
        self.counts[job.status if job.status in self.counts else "done"] += 1
        if job.status == "done":
            self._durations.append(job.finished - job.started)
        self.recent.append(job)

    def _generate(self, job: Job) -> None:
        req = job.request
        self.limits.check_tokens(req.max_tokens)
        m = self._model_for(job)
        sampling = {**self.sampling, **sampling_of(req)}
        gen = m.stream_generate(
            req.prompt,
            max_tokens=self.max_tokens if req.max_tokens is None else req.max_tokens,
            fit_context=req.max_tokens is None,
            chat_template=req.kind == "chat",
            # rank 0's client decides for every rank of a sharded model
            should_stop=lambda: distributed.agree_flag(job.cancel.is_set()),
            logprobs=req.logprobs,
            tools=req.tools,
            **sampling,
        )
        cutter = StopCutter(req.stop)
        finish, last = None, None
        new: list[int] = []  # the tokens generated so far
        counted = None  # tokens up to the one that completed a stop string
        try:
            for chunk in gen:
                last = chunk
                job.generated_tokens = chunk.stats.generated_tokens
                if chunk.finish_reason == "cancelled":
                    finish = "cancelled"
                    break
                if job.status != "running":
                    job.status = "running"
                    self._emit(job, Started())
                before = copy.copy(cutter)
                text = cutter.feed(chunk.text)
                if chunk.finish_reason is not None and not cutter.stopped:
                    text += cutter.flush()
                lps = chunk.logprobs
                if cutter.stopped:
                    finish = "stop"
                    counted = len(new) + tokens_to_stop(m, new, chunk.tokens, before)
                    job.generated_tokens = counted
                    lps = lps[: counted - len(new)] if lps is not None else None
                elif chunk.finish_reason is not None:
                    finish = chunk.finish_reason
                entries = logprob_entries(m.tokenizer, lps, m.eos_ids) if lps else None
                if text or entries:
                    self._emit(job, Delta(text, entries))
                new += chunk.tokens
                if finish is not None:
                    break
        finally:
            gen.close()  # runs the decoding loop's cleanup: the cache stays consistent
        assert last is not None and finish is not None
        job.status = "cancelled" if finish == "cancelled" else "done"
        st = last.stats
        cached = max(0, st.prompt_tokens - 1 - st.prefill_tokens)
        n = st.generated_tokens if counted is None else counted
        self._emit(
            job,
            Done(
                finish,
                usage(st.prompt_tokens, n, cached),
                mtp_stats(st, cached, job),
            ),
        )


#: the API's generation arguments -> the request fields that give them (how a
#: 400 names a bad value)
REQUEST_FIELDS = {
    "max_tokens": "max_tokens",
    "temp": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
}
#: method -> the option it cannot run without (the package's message for a
#: missing one names a CLI flag)
REQUIRED_OPTIONS = {"draft": "draft_model"}


def check_tools(loaded: Any, name: str) -> None:
    """Refuse ``tools`` for a model whose tool calls this server cannot parse:
    without a chat template, or a template for which mlx-lm has no tool
    parser (``TokenizerWrapper.has_tool_calling``).

    Raises:
        OpenAIError: 400 ``tools_not_supported``.
    """
    tok = getattr(loaded, "tokenizer", None)
    if tok is None or not getattr(tok, "chat_template", None):
        why = "has no chat template to render tools with"
    elif not getattr(tok, "has_tool_calling", False):
        why = (
            "has no tool-call format mlx-lm can parse (none is known for its chat template "
            "or set as tool_parser_type in its tokenizer_config.json)"
        )
    else:
        return
    raise OpenAIError(
        400,
        f"The model {name!r} {why}; send the request without 'tools' (or with "
        'tool_choice: "none").',
        param="tools",
        code="tools_not_supported",
    )


def tokens_to_stop(m: Any, before: list[int], chunk: list[int], cutter: StopCutter) -> int:
    """How many of a chunk's tokens it takes to complete the stop string
    that ``cutter`` (as it was before the chunk) finds in the chunk's text:
    the chunk's tokens detokenized one at a time after the ``before`` ones
    (end-of-sequence tokens give no text), as a batched row counts its
    tokens; a method that drafts may have accepted tokens past it, which a
    request's ``completion_tokens`` leaves out. All of the chunk when none
    completes it alone."""
    detok = m.tokenizer.detokenizer  # a copy of its own
    detok.reset()
    for t in before:
        if t not in m.eos_ids:
            detok.add_token(t)
    _ = detok.last_segment  # the text before the chunk, which the cutter has seen
    for k, t in enumerate(chunk, 1):
        if t not in m.eos_ids:
            detok.add_token(t)
        cutter.feed(detok.last_segment)
        if cutter.stopped:
            return k
    return len(chunk)


def sampling_of(req: GenRequest) -> dict[str, Any]:
    """The sampling settings a request gives (the API's keywords); the ones
    it leaves out are not in the dict."""
    given = {
        "temp": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "seed": req.seed,
    }
    return {k: v for k, v in given.items() if v is not None}


def _end_thread_streams() -> None:
    """Finish and destroy the MLX streams of the calling thread. MLX keeps
    streams per thread; left to the thread's own teardown, which goes on after
    ``Thread.join`` has returned, they can still be running when the
    interpreter exits, and the process aborts ("terminate called without an
    active exception", exit 134). Ending them here, before the thread
    returns, makes ``join`` mean that the worker is gone."""
    mx.synchronize()
    if hasattr(mx, "clear_streams"):  # MLX >= 0.31
        mx.clear_streams()
