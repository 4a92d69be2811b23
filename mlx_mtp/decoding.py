"""The one decoding loop every method plugs into.

Like mlx-lm's ``generate_step`` it is a plain generator: cache the prompt, then
repeatedly ask the method for a step, cut the step's tokens at EOS and
``max_tokens``, yield them with running statistics. The loop owns the cache
invariant: when it returns, the cache holds the prompt and every generated
token but the last, so the next chat turn reuses it. Like mlx-lm's loop it
runs inside ``mlx_lm.generate.wired_limit`` from before the prefill (Metal:
the wired memory limit raised to the GPU's recommended working set; one for
the threads of a process, :func:`mlx_mtp.threads.wired_limit`), clears
MLX's buffer cache every 256 tokens, and prefills in steps of 2048 on a GPU
(512 on a CPU: :data:`~mlx_mtp.engine.PREFILL_STEP`, :meth:`Engine.sync`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx

from .budget import as_curves
from .context import Context
from .costs import LiveCurves, device_curves
from .engine import PREFILL_STEP, Engine
from .errors import InvalidArgumentError
from .logprobs import MAX_TOP_LOGPROBS, LogprobRecorder, TokenLogprob
from .methods.base import DraftMethod, Method
from .runners import check_runner, choose_runner
from .threads import wired_limit
from .verify import Sampler

#: tokens between ``mx.clear_cache()`` calls in the decoding loop (mlx-lm: 256)
CLEAR_CACHE_EVERY = 256


@dataclass
class GenerationStats:
    """Counters of one generation. Times in seconds, memory in GB.

    ``tau`` (acceptance length) = generated tokens / target forward passes,
    bonus token included; plain decoding gives 1.00.
    """

    method: str = ""
    #: the runner that decoded it (:mod:`mlx_mtp.runners`): ``plain``,
    #: ``pipelined``, ``synchronous`` or ``batched``
    runner: str = ""
    #: why that runner (:func:`~mlx_mtp.runners.choose_runner`)
    runner_reason: str = ""
    block_complexity: int = 1
    prompt_tokens: int = 0
    prefill_tokens: int = 0
    prefill_time: float = 0.0
    generated_tokens: int = 0
    decode_time: float = 0.0
    forward_passes: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    peak_memory_gb: float = 0.0
    #: seconds of decode_time spent on the device: model forward passes (incl.
    #: eval) and vocabulary-wide argmax / top-k / sampling on their logits
    forward_time: float = 0.0
    #: input slots over all forward passes (tokens + masks); slots / forward_passes
    #: is the mean tree size actually sent, at most the BC
    slots: int = 0
    #: one-token steps the planner ran instead of a draft (``auto``: no draft paid)
    plain_steps: int = 0
    #: probes: draft steps the planner's cut did not predict to pay, paid from
    #: the generation's loss budget (docs/budget.md)
    reprobes: int = 0
    #: times ``auto`` began a run of plain steps because no draft paid for its
    #: slots
    plain_spells: int = 0
    #: pipelined runner: plain steps where the method offered drafts and the
    #: width policy judged none worth its cost (the others had nothing to draft)
    declined_steps: int = 0
    #: the cost curve's ``c(8)`` (an 8-slot pass in one-slot passes: a small
    #: draft tree) the planner last planned with; 0 without ``auto``
    cost_8: float = 0.0
    #: the largest forward pass sent (slots per pass of one step)
    max_slots: int = 0
    #: seconds of decode_time the device sat idle waiting for the host: the
    #: host work on the critical path (known on a simulated device only;
    #: None on a real one)
    idle_time: float | None = None
    accept_lengths: list[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        return self.generated_tokens / self.forward_passes if self.forward_passes else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_time if self.prefill_time > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.generated_tokens / self.decode_time if self.decode_time > 0 else 0.0

    @property
    def host_ms_per_step(self) -> float:
        """Milliseconds per decoding step spent on the host: everything outside the
        model's forward pass and the vocabulary-wide argmax / top-k / sampling on
        its logits (drafting, tree building, the verification walk, cache
        bookkeeping, Python)."""
        return 1000 * (self.decode_time - self.forward_time) / self.steps if self.steps else 0.0

    @property
    def idle_ms_per_step(self) -> float | None:
        """Milliseconds per step the device sat idle waiting for the host
        (``idle_time``; None but on a simulated device)."""
        if self.idle_time is None or not self.steps:
            return None
        return 1000 * self.idle_time / self.steps

    @property
    def slots_per_forward(self) -> float:
        return self.slots / self.forward_passes if self.forward_passes else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def summary(self) -> str:
        """A human-readable stats line, the runner first; where the runner ran
        one-token steps instead of drafts, a second line says how many and why."""
        idle = self.idle_ms_per_step
        line = (
            f"[{self.method}] "
            + (f"{self.runner}: " if self.runner else "")
            + f"{self.generated_tokens} tokens, {self.decode_tps:.1f} tok/s, "
            f"tau {self.tau:.2f} ({self.slots_per_forward:.1f} slots/forward, largest pass "
            f"{self.max_slots} of BC {self.block_complexity}), "
            f"drafted {self.drafted} / accepted {self.accepted}, "
            f"{self.forward_passes} forwards, host {self.host_ms_per_step:.2f} ms/step, "
            + ("" if idle is None else f"device idle {idle:.2f} ms/step, ")
            + f"prefill {self.prefill_tokens} tok "
            f"@ {self.prefill_tps:.0f} tok/s, peak {self.peak_memory_gb:.2f} GB"
        )
        if not self.plain_steps:
            return line
        plain = f"{self.plain_steps} of {self.steps} steps were plain one-token steps"
        if self.runner == "pipelined":
            nothing = self.plain_steps - self.declined_steps
            whys = []
            if self.declined_steps:
                whys.append(
                    f"{self.declined_steps} because the policy judged no draft worth its cost "
                    f"on this device (an 8-slot pass costs {self.cost_8:.2f} 1-slot passes here)"
                )
            if nothing:
                whys.append(f"{nothing} because the method had nothing to draft")
            why = "; ".join(whys)
        elif self.plain_spells:
            why = (
                f"auto kept to them {self.plain_spells} time(s) because no draft's expected "
                "tokens paid for its slots on this device (an 8-slot pass costs "
                f"{self.cost_8:.2f} 1-slot passes here), probing {self.reprobes} time(s)"
            )
        else:
            why = "the method had nothing to draft at those steps"
        return f"{line}\n[{self.method}] {plain}: {why}"

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "accept_lengths"}
        d.update(
            tau=self.tau,
            prefill_tps=self.prefill_tps,
            decode_tps=self.decode_tps,
            host_ms_per_step=self.host_ms_per_step,
            idle_ms_per_step=self.idle_ms_per_step,
            slots_per_forward=self.slots_per_forward,
        )
        return d


def _synchronize_streams() -> None:
    """Wait for work other code left running: mlx-lm's generator queues its
    next step with ``mx.async_eval`` on its own stream, so a caller that left
    it early may still have that step in flight (issue 16, item 11)."""
    mx.synchronize()
    try:
        from mlx_lm.generate import generation_stream
    except ImportError:  # an mlx-lm without the module-level stream
        return
    mx.synchronize(generation_stream)


@dataclass
class Step:
    """One yield of :func:`generate_steps`: the tokens committed by one decoding
    step (after EOS / max_tokens cuts), and the stats so far.

    ``finish_reason`` is None while generating, then ``"stop"`` (EOS),
    ``"length"`` (max_tokens) or ``"cancelled"`` (``should_stop``; that last
    step has no tokens).

    ``logprobs``: with :func:`generate_steps`'s ``logprobs``, one
    :class:`~mlx_mtp.logprobs.TokenLogprob` per token, else None."""

    tokens: list[int]
    stats: GenerationStats
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None


def check_logprobs(method: Method, logprobs: int | None) -> None:
    """Refuse a ``logprobs`` setting :func:`generate_steps` cannot honour.

    Raises:
        InvalidArgumentError: not None nor an integer in
            [0, :data:`~mlx_mtp.logprobs.MAX_TOP_LOGPROBS`], or asked of a
            lossy method (its tokens do not come from the target's logits).
    """
    if logprobs is None:
        return
    if isinstance(logprobs, bool) or not isinstance(logprobs, int):
        raise InvalidArgumentError(f"logprobs must be an integer, got {logprobs!r}.")
    if not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgumentError(
            f"top logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}."
        )
    if not method.lossless:
        raise InvalidArgumentError(
            f"{method.describe()} is lossy: its tokens are not drawn from the target model's "
            "logits, so it has no logprobs to report. Use a lossless method (ntp, pld, probe, "
            "...)."
        )


def generate_steps(
    ctx: Context | Engine,
    method: Method,
    prompt: list[int],
    *,
    max_tokens: int = 256,
    sampler: Sampler | None = None,
    eos_ids: set[int] | frozenset[int] = frozenset(),
    should_stop: Callable[[], bool] | None = None,
    prefill_step: int = PREFILL_STEP,
    logprobs: int | None = None,
    runner: str = "auto",
) -> Iterator[Step]:
    """Decode with ``method`` after ``prompt`` and yield each step's tokens.

    Args:
        ctx: the method's context (an engine alone: no checkpoint folder, this
            device's cost curves); the engine's cache from an earlier turn is
            reused up to the longest common prefix with ``prompt``.
        method: a method prepared on this context.
        prompt: token ids (at least one).
        max_tokens: hard limit on generated tokens (> 0); never exceeded.
        sampler: None for greedy, else an mlx-lm sampler.
        eos_ids: tokens that end generation; an EOS is emitted and nothing
            after it.
        should_stop: asked before each prefill chunk and each decoding step
            (between forward passes); True ends the generation with a last
            step of no tokens and ``finish_reason`` ``"cancelled"`` (a
            prefill stopped early leaves its prefix in the cache).
        prefill_step: prompt tokens per prefill forward pass.
        logprobs: None: no log-probabilities (nothing is computed for
            them). An integer in [0, :data:`~mlx_mtp.logprobs.MAX_TOP_LOGPROBS`]:
            each step's tokens come with their log-probabilities under the
            target model's logits at their positions and that many most
            likely alternatives (:mod:`mlx_mtp.logprobs`). Lossless methods
            only; their steps then run through the planner, never the
            pipelined runner, whose verification reads back target tokens,
            not rows.
        runner: ``auto``, ``pipelined`` or ``synchronous``: the runner of the
            steps (:func:`~mlx_mtp.runners.choose_runner`; the one that ran
            is ``stats.runner``).

    Raises:
        InvalidArgumentError: empty prompt, max_tokens <= 0, ``logprobs``
            out of range or asked of a lossy method, or a ``runner`` that is
            unknown or cannot run this generation.
        CacheNotTrimmableError: the cache cannot drop rejected drafts.
    """
    if not prompt:
        raise InvalidArgumentError("The prompt is empty; give at least one token of input.")
    if max_tokens <= 0:
        raise InvalidArgumentError(f"max_tokens must be > 0, got {max_tokens}.")
    check_logprobs(method, logprobs)
    check_runner(runner)
    ctx = ctx if isinstance(ctx, Context) else Context(ctx)
    engine = ctx.engine
    _synchronize_streams()
    stats = GenerationStats(
        method=method.describe(),
        block_complexity=method.block_complexity,
        prompt_tokens=len(prompt),
    )
    mx.reset_peak_memory()
    clock = engine.clock  # a simulated device's virtual clock too (mlx_mtp.timing)
    planner, n = None, 0
    # mlx-lm's generation hygiene: the wired memory limit (Metal) from before
    # the prefill, as mlx-lm's stream_generate sets it around generate_step (on
    # exit it waits for the passes still queued on the stream before restoring
    # the limit), buffer cache cleared every CLEAR_CACHE_EVERY tokens
    wired = wired_limit(engine.model, streams=[mx.default_stream(mx.default_device())])
    # each step under the engine's turn (the model's lock where threads share it,
    # mlx_mtp.threads); none is held across a yield
    wired.__enter__()
    recorder = None if logprobs is None else LogprobRecorder(logprobs)
    engine.logprobs = recorder
    try:
        t0 = clock.now()
        stats.prefill_tokens = engine.sync(prompt[:-1], prefill_step, should_stop)
        stats.prefill_time = clock.now() - t0
        if engine.offset != len(prompt) - 1:  # should_stop during the prefill
            yield Step([], stats, "cancelled")
            return
        with engine.turn:
            curves = None
            if isinstance(method, DraftMethod):
                curves = ctx.curves
                if method.auto and curves is None:
                    curves = device_curves(engine)
                if curves is not None and not isinstance(curves, LiveCurves):
                    curves = LiveCurves(as_curves(curves), learn=False)
            choice = choose_runner(
                ctx, method, sampler, curves, logprobs=recorder is not None, runner=runner
            )
            planner = choice.runner
            stats.runner, stats.runner_reason = choice.name, choice.reason
            t0 = clock.now()
            method.begin(ctx, prompt, sampler)  # a draft model's prefill: prefill time
        stats.prefill_time += clock.now() - t0
        if recorder is not None:  # only the decoding steps' tokens are reported
            recorder.entries.clear()
        root, finish = prompt[-1], None
        f0, s0 = engine.forward_seconds, engine.forward_slots
        cleared = 0
        t0 = clock.now()
        clock.start_idle_count()
        i0 = clock.idle
        while finish is None:
            if should_stop is not None and should_stop():
                yield Step([], stats, "cancelled")
                return
            if n - cleared >= CLEAR_CACHE_EVERY:
                mx.clear_cache()
                cleared = n
            slots0 = engine.forward_slots
            ctx.left = max_tokens - n
            with engine.turn:
                out = planner.step(root) if planner is not None else method.step(ctx, root)
            tokens = out.tokens[: max_tokens - n]
            for i, t in enumerate(tokens):
                if t in eos_ids:
                    tokens, finish = tokens[: i + 1], "stop"
                    break
            n += len(tokens)
            if finish is None and n >= max_tokens:
                finish = "length"
            stats.generated_tokens = n
            stats.forward_passes += out.forwards
            stats.steps += 1
            stats.drafted += out.drafted
            stats.accepted += min(out.accepted, len(tokens) - 1) if tokens else 0
            stats.accept_lengths.append(len(tokens))
            stats.decode_time = clock.now() - t0
            stats.forward_time = engine.forward_seconds - f0
            stats.slots = engine.forward_slots - s0
            if clock.idle is not None:
                stats.idle_time = clock.idle - i0
            stats.peak_memory_gb = mx.get_peak_memory() / 1e9
            passes = max(out.forwards, 1)
            stats.max_slots = max(stats.max_slots, -(-(engine.forward_slots - slots0) // passes))
            if planner is not None:
                stats.plain_steps, stats.reprobes = planner.plain_steps, planner.reprobes
                stats.plain_spells = planner.plain_spells
                stats.declined_steps = getattr(planner, "declined", 0)
                if planner.curve is not None:
                    stats.cost_8 = planner.curve(8)
            root = tokens[-1]
            lps = None
            if recorder is not None:
                if len(recorder.entries) < len(out.tokens):
                    raise InvalidArgumentError(
                        f"{method.describe()} committed tokens without the target's logits "
                        "at their positions: it cannot report logprobs."
                    )
                lps = recorder.take(len(tokens))
            yield Step(tokens, stats, finish, lps)
    finally:
        engine.logprobs = None
        ctx.left = None
        # cache = prompt + generated tokens but the last one
        expected = len(prompt) - 1 + max(n - 1, 0) + (1 if n else 0)
        with engine.turn:
            wired.__exit__(None, None, None)
            if planner is not None:
                planner.finish()
            if engine.offset > expected:
                engine.trim_to(expected)
            engine.materialize()  # no pending work left for another thread
