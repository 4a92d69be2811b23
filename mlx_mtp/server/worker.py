"""The generation worker: one thread that owns the model and runs requests in turn.

MLX models and their KV caches are not thread-safe, so a single thread loads
the model, builds one :class:`~mlx_mtp.api.MTPModel` per (method, options)
asked for (all sharing the one loaded :class:`~mlx_mtp.loading.LoadedModel`;
each has its own KV cache, reused across requests by longest common prefix),
runs every generation and frees everything at the end (as ``mlx_lm.server``
does with its generation thread). The HTTP side only puts :class:`Job` objects
on a bounded queue and receives events through the job's ``emit`` callback.
"""

from __future__ import annotations

import gc
import logging
import math
import queue
import re
import threading
import time
import traceback
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import distributed
from ..errors import InvalidArgumentError, MTPError
from ..loading import load_model
from ..methods import make_method
from .protocol import GenRequest, OpenAIError, StopCutter, usage

log = logging.getLogger("mlx_mtp.server")

#: events sent to ``Job.emit``:
#:   ("started",)                            generation is running (first step done)
#:   ("delta", text)                         new answer text, already cut at stop strings
#:   ("done", finish_reason, usage, mtp)     the end: "stop" | "length" | "cancelled"
#:   ("error", OpenAIError)                  the request failed (before or during generation)
#:   ("cancelled",)                          the client left while the job was queued
Event = tuple

#: seconds rank 0 of a sharded model waits for a request before telling the
#: other ranks it is idle (each tells costs two small ``all_sum``)
IDLE_POLL = 1.0


@dataclass
class Job:
    """One generation request on its way through the worker.

    Attributes:
        request: the parsed request.
        emit: called from the worker thread with each event (must not block).
        cancel: set by the HTTP side when the client has gone; the worker
            stops before the next decoding step (and skips a job still queued).
        enqueued / started / finished: ``time.perf_counter()`` seconds.
        status: ``queued``, ``running``, ``done``, ``cancelled`` or ``failed``.
        generated_tokens: tokens generated (also for a cancelled job).
    """

    request: GenRequest
    emit: Callable[[Event], None]
    cancel: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.perf_counter)
    started: float | None = None
    finished: float | None = None
    status: str = "queued"
    generated_tokens: int = 0

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
        method / options: the default method and its options (as ``load``).
        dtype / max_kv_size: as :func:`mlx_mtp.load`.
        max_tokens: new tokens when a request does not say (clipped to the
            context left).
        temp / top_p: sampling defaults when a request does not say.
        queue_size: requests waiting beyond the running one; more get 429.
        max_methods: (method, options) models kept at once (each holds a KV
            cache); the least recently used is dropped, never the default.
    """

    def __init__(
        self,
        model: str,
        method: str = "ntp",
        options: dict[str, Any] | None = None,
        *,
        dtype: str | None = None,
        max_kv_size: int | None = None,
        max_tokens: int = 512,
        temp: float = 0.0,
        top_p: float = 0.0,
        queue_size: int = 8,
        max_methods: int = 4,
        pipeline: bool = False,
    ):
        if queue_size < 1 or max_methods < 1:
            raise InvalidArgumentError("queue_size and max_methods must be >= 1.")
        self.model_id = model
        self.method = method
        self.options = dict(options or {})
        self.dtype = dtype
        self.max_kv_size = max_kv_size
        self.max_tokens = max_tokens
        self.temp = temp
        self.top_p = top_p
        self.queue_size = queue_size
        self.max_methods = max_methods
        self.pipeline = pipeline
        self.default_key = method_key(method, self.options)
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self._models: OrderedDict[tuple, Any] = OrderedDict()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._durations: deque[float] = deque(maxlen=20)
        self.loaded: Any = None
        self.context_length: int | None = None
        self.running: Job | None = None
        self._loaded_names: tuple[str, ...] = ()  # a snapshot for other threads
        self.counts = {"done": 0, "cancelled": 0, "failed": 0, "rejected": 0}
        #: the last finished jobs (for /health and tests)
        self.recent: deque[Job] = deque(maxlen=64)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the thread and wait until the model is loaded.

        Raises:
            MTPError: the model or the default method could not be loaded
                (ModelNotFoundError, UnknownMethodError, InvalidArgumentError, ...).
        """
        self._thread = threading.Thread(target=self._run, name="mlx-mtp-worker", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            self._thread.join()
            raise self._load_error

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel the running job, drop queued ones, stop the thread."""
        if self._thread is None:
            return
        if self.running is not None:
            self.running.cancel.set()
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel.set()
                self._emit(job, ("error", OpenAIError(503, "The server is shutting down.")))
        self._queue.put(None)
        self._thread.join(timeout)
        self._thread = None

    def wait(self) -> None:
        """Block until the worker thread ends (the other ranks of a sharded
        model: until rank 0's worker stops)."""
        if self._thread is not None:
            self._thread.join()

    @property
    def alive(self) -> bool:
        """Whether the worker thread is running and has its model."""
        return self._thread is not None and self._thread.is_alive() and self.loaded is not None

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
        """State for ``GET /health``."""
        return {
            "status": "ok" if self.alive else "unavailable",
            "model": self.model_id,
            "method": self.method,
            "busy": self.running is not None,
            "queue": {"waiting": self._queue.qsize(), "capacity": self.queue_size},
            "jobs": dict(self.counts),
            "methods_loaded": list(self._loaded_names),
        }

    # --------------------------------------------------------------- thread
    def _run(self) -> None:
        try:
            self._build(self.method, self.options, loaded=None)  # validate options first
            self.loaded = load_model(self.model_id, self.dtype, pipeline=self.pipeline)
            self._models[self.default_key] = self._build(self.method, self.options, self.loaded)
            self._snapshot()
            cfg = self.loaded.config
            self.context_length = cfg.get("max_position_embeddings") or cfg.get(
                "text_config", {}
            ).get("max_position_embeddings")
        except BaseException as e:  # reported by start()
            self._load_error = e
            self.loaded = None
            self._ready.set()
            return
        self._ready.set()
        try:
            while True:
                job = self._next_job()
                if job is None:
                    break
                self._serve(job)
        finally:
            # free the model and caches in the thread that made them
            self._models.clear()
            self.loaded = None
            gc.collect()

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

    def _build(self, method: str, options: dict[str, Any], loaded: Any) -> Any:
        """A method instance (``loaded`` None: options check only) or an MTPModel."""
        try:
            m = make_method(method, **options)
        except TypeError as e:  # an option the method's __init__ does not take
            raise OpenAIError(
                400,
                f"method {method!r} does not take option(s) {', '.join(sorted(options))} ({e}).",
                param="mtp",
                code="invalid_method_option",
            ) from None
        if loaded is None:
            return m
        return loaded.bind(m, max_kv_size=self.max_kv_size)

    def _model_for(self, req: GenRequest) -> Any:
        key = self.default_key if req.method is None else method_key(req.method, req.options)
        if key in self._models:
            self._models.move_to_end(key)
            return self._models[key]
        m = self._build(req.method, req.options, self.loaded)
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
        if distributed.agree_flag(job.cancel.is_set()):  # the client left while queued
            job.status = "cancelled"
            self._emit(job, ("cancelled",))  # ends the request's handler
            self._finish(job)
            return
        self.running = job
        try:
            self._generate(job)
        except OpenAIError as e:
            job.status = "failed"
            self._emit(job, ("error", e))
        except MTPError as e:
            job.status = "failed"
            name = type(e).__name__
            param = "mtp.method" if name == "UnknownMethodError" else None
            # the class name as the code: InvalidArgumentError -> invalid_argument_error
            code = re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()
            self._emit(job, ("error", OpenAIError(400, str(e), param=param, code=code)))
        except Exception as e:  # a bug or an MLX failure: answer 500, keep serving
            job.status = "failed"
            log.error("generation failed:\n%s", traceback.format_exc())
            for m in self._models.values():  # do not trust any cache after that
                m.engine.reset()
            self._emit(
                job,
                ("error", OpenAIError(500, f"{type(e).__name__}: {e}", type="server_error")),
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
        m = self._model_for(req)
        tokens = m.encode(req.prompt, chat_template=req.kind == "chat")
        vocab = self.loaded.config.get("vocab_size")
        if vocab and any(not 0 <= t < vocab for t in tokens):
            raise OpenAIError(400, f"Token ids must lie in [0, {vocab}).", param="prompt")
        ctx, n_prompt = self.context_length, len(tokens)
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens if ctx is None else min(self.max_tokens, ctx - n_prompt)
        if ctx is not None and (n_prompt >= ctx or n_prompt + max_tokens > ctx):
            raise OpenAIError(
                400,
                f"This model's context is {ctx} tokens; the request has {n_prompt} prompt "
                f"tokens and asks for {max_tokens} new ones. Shorten the prompt or lower "
                "max_tokens.",
                param="messages" if req.kind == "chat" else "prompt",
                code="context_length_exceeded",
            )
        gen = m.stream_generate(
            tokens,
            max_tokens=max_tokens,
            temp=self.temp if req.temperature is None else req.temperature,
            top_p=self.top_p if req.top_p is None else req.top_p,
            seed=req.seed,
            chat_template=False,
        )
        cutter = StopCutter(req.stop)
        finish, last = None, None
        try:
            for chunk in gen:
                if last is None:
                    job.status = "running"
                    self._emit(job, ("started",))
                last = chunk
                job.generated_tokens = chunk.stats.generated_tokens
                text = cutter.feed(chunk.text)
                if chunk.finish_reason is not None and not cutter.stopped:
                    text += cutter.flush()
                if text:
                    self._emit(job, ("delta", text))
                if cutter.stopped:
                    finish = "stop"
                elif chunk.finish_reason is not None:
                    finish = chunk.finish_reason
                elif distributed.agree_flag(job.cancel.is_set()):  # rank 0's client
                    finish = "cancelled"
                if finish is not None:
                    break
        finally:
            gen.close()  # runs the decoding loop's cleanup: the cache stays consistent
        assert last is not None
        job.status = "cancelled" if finish == "cancelled" else "done"
        st = last.stats
        cached = max(0, st.prompt_tokens - 1 - st.prefill_tokens)
        self._emit(
            job,
            (
                "done",
                finish,
                usage(st.prompt_tokens, st.generated_tokens, cached),
                mtp_stats(st, cached, job),
            ),
        )


def mtp_stats(st: Any, cached: int, job: Job) -> dict[str, Any]:
    """The ``mtp`` object of a response: method settings, acceptance and timing
    (:class:`~mlx_mtp.decoding.GenerationStats`; seconds, tokens per second)."""
    return {
        "method": st.method,
        "block_complexity": st.block_complexity,
        "tau": round(st.tau, 4),
        "drafted": st.drafted,
        "accepted": st.accepted,
        "acceptance_rate": round(st.acceptance_rate, 4),
        "forward_passes": st.forward_passes,
        "generated_tokens": st.generated_tokens,
        "prompt_tokens": st.prompt_tokens,
        "cached_tokens": cached,
        "prefill_tokens": st.prefill_tokens,
        "prefill_s": round(st.prefill_time, 4),
        "decode_s": round(st.decode_time, 4),
        "tokens_per_s": round(st.decode_tps, 2),
        "queue_wait_s": round(job.queue_wait, 4),
    }
