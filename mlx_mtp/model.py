"""A loaded model bound to a method: :class:`MTPModel` (generate, stream,
chat), made by :meth:`LoadedModel.bind <mlx_mtp.loading.LoadedModel.bind>`
or :func:`mlx_mtp.api.load`; its results (:class:`Chunk`, :class:`Result`)
and multi-turn chat (:class:`ChatSession`)."""

from __future__ import annotations

import copy
import numbers
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np

from . import distributed
from .context import Context
from .data import render_prompt
from .decoding import GenerationStats, check_logprobs, generate_steps
from .engine import PREFILL_STEP, Engine
from .errors import (
    ContextLengthError,
    InvalidArgumentError,
    ModelBusyError,
    ModelLoadError,
    UnsupportedModelError,
    WrongThreadError,
)
from .families import check_cache_support
from .logprobs import TokenLogprob
from .methods import Method
from .runners import check_runner
from .sampling import PositionalSampler, random_seed
from .threads import model_lock
from .validation import (
    GENERATION_ARGS,
    chat_role,
    check_flag,
    check_generation_args,
    check_kv,
    check_value,
)

Prompt = Union[str, list[int], list[dict[str, str]], np.ndarray]  # noqa: UP007 (py3.10 alias)


@dataclass
class Chunk:
    """One streamed piece: ``text`` (new text), ``tokens`` (new token ids),
    ``stats`` (running :class:`GenerationStats`), ``finish_reason`` (None,
    ``"stop"``, ``"length"``, or ``"cancelled"`` when ``should_stop`` asked),
    ``logprobs`` (one :class:`~mlx_mtp.logprobs.TokenLogprob` per token when
    :meth:`MTPModel.stream_generate` was asked for them, else None)."""

    text: str
    tokens: list[int]
    stats: GenerationStats
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Result:
    """A finished generation: full ``text``, ``tokens``, ``stats``, ``finish_reason``."""

    text: str
    tokens: list[int]
    stats: GenerationStats
    finish_reason: str | None


class MTPModel:
    """A loaded model, a method and one KV cache (reused across calls by prefix).

    Made by :meth:`LoadedModel.bind <mlx_mtp.loading.LoadedModel.bind>` or
    :func:`load`. It runs one generation at a time: a stream that has started
    and not finished (nor been closed) holds the KV cache, and starting
    another one, on any thread, raises :class:`~mlx_mtp.errors.ModelBusyError`
    (the check is race-free; bind a second model for two at once: each has
    its own cache).

    Threads (docs/design.md, "Threads"): one loaded model serves several
    threads, each with its own ``MTPModel`` (``loaded.bind(...)`` per
    thread); each thread's answers are those it gets alone. Their
    generations take turns on the model, one prefill chunk or decoding step
    at a time (the model's lock, :func:`mlx_mtp.threads.model_lock`): N
    threads decode about as fast together as one (batch prompts with
    :func:`~mlx_mtp.api.batch_generate` or the server for throughput). A
    binding may move between threads from one generation to the next, but a
    stream is read on the thread that started it (else
    :class:`~mlx_mtp.errors.WrongThreadError`). ``stats.peak_memory_gb`` is
    the process's peak, all threads included.

    Attributes:
        prefill_step: prompt tokens per prefill forward pass
            (:data:`~mlx_mtp.engine.PREFILL_STEP`: mlx-lm's 2048 on a GPU);
            a smaller one bounds the time of each pass (the server sets it).

    Raises:
        InvalidArgumentError: ``max_kv_size`` out of range; a block complexity
            whose forward pass would not fit in memory (see
            :meth:`Engine.check_slots`).
        UnsupportedModelError: a method that must drop rejected draft tokens on
            a model whose cache cannot (recurrent or hybrid layers), or a model
            architecture the method cannot run.
    """

    def __init__(
        self,
        loaded: Any,
        method: Method,
        max_kv_size: int | None = None,
        thinking: bool = False,
        runner: str = "auto",
        kv_bits: int | None = None,
        kv_group_size: int = 64,
    ):
        if max_kv_size is not None:
            max_kv_size = check_value("max_kv_size", max_kv_size)
        check_kv(kv_bits, kv_group_size, loaded.model)
        if kv_bits is not None and not getattr(method, "quantized_kv", True):
            raise UnsupportedModelError(
                f"{method.describe()} cannot run on a quantized KV cache; drop --kv-bits."
            )
        #: the runner asked for (:mod:`mlx_mtp.runners`): ``auto``,
        #: ``pipelined`` or ``synchronous``; each result's ``stats.runner``
        #: says which ran
        self.runner = check_runner(runner)
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.method = method
        #: ``enable_thinking`` of hybrid-thinking chat templates (Qwen3); off by default
        self.thinking = bool(thinking)
        self._warned_template = False
        # sliding windows keep room for the method's largest forward pass
        self.engine = Engine(
            self.model,
            max_kv_size=max_kv_size,
            slots=method.block_complexity,
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
        )
        self.prefill_step = PREFILL_STEP
        self._active: object | None = None  # the generation holding the cache
        self._claim = threading.Lock()  # guards the check and claim of _active
        # generations of every binding of this model take turns per step
        self.engine.turn = model_lock(self.model)
        #: what the method receives: the engine and the checkpoint it came from
        self.ctx = Context(self.engine, loaded)
        check_cache_support(self.engine, method)
        method.prepare(self.ctx)
        self.engine.check_slots(method.block_complexity, what=method.describe())

    @property
    def eos_ids(self) -> set[int]:
        return set(self.tokenizer.eos_token_ids or [])

    def encode(
        self,
        prompt: Prompt,
        chat_template: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of a prompt.

        Args:
            prompt: text (wrapped as one user message if the tokenizer has a
                chat template and ``chat_template``), a list of chat messages
                ``{"role", "content"}`` (roles: :data:`~mlx_mtp.validation.ROLES`;
                and the template's other keys, such as an assistant message's
                ``tool_calls``), or token ids (a list, or a 1-D integer numpy array).
            tools: function definitions (OpenAI's ``tools``) for the chat
                template's ``tools`` argument; needs a chat template and chat
                messages (or text wrapped as one).

        A tokenizer without a chat template renders chat messages as plain
        text turns (``"user: ...\nassistant: "``, see :func:`mlx_mtp.data.role_lines`)
        and warns once; text prompts are then encoded as they are.

        Raises:
            InvalidArgumentError: an empty prompt, malformed messages (an
                unknown role), or token ids outside the vocabulary.
            ModelLoadError: the tokenizer gave ids the model has no
                embedding for (a tokenizer of another model).
        """
        if tools and not (self.has_chat_template and self.prompt_format == "chat"):
            raise InvalidArgumentError(
                f"{self.loaded.name} has no chat template to render tools with."
            )
        if isinstance(prompt, np.ndarray):
            if prompt.ndim != 1 or prompt.dtype.kind not in "iu":
                raise InvalidArgumentError(
                    "Token ids given as an array must be a 1-D array of integers, got shape "
                    f"{prompt.shape} of {prompt.dtype}."
                )
            prompt = prompt.tolist()
        if isinstance(prompt, str):
            if not prompt.strip():
                raise InvalidArgumentError("The prompt is empty; type some text.")
            _check_text(prompt, "The prompt")
            if chat_template and (self.has_chat_template or self.prompt_format == "plain"):
                prompt = [{"role": "user", "content": prompt}]
            else:
                return self._in_vocabulary(list(self.tokenizer.encode(prompt)))
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            for m in prompt:
                if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                    raise InvalidArgumentError(
                        f"A chat message must have string 'role' and 'content', got {m!r}."
                    )
                _check_text(m["content"], "A chat message")
            # the roles the server takes, "developer" given to the template as "system"
            prompt = [
                {**m, "role": chat_role(m["role"], f"prompt[{i}]['role']")}
                for i, m in enumerate(prompt)
            ]
            if not (self.has_chat_template or self.prompt_format == "plain"):
                if not self._warned_template:
                    warnings.warn(
                        f"{self.loaded.name}: the tokenizer has no chat template; chat "
                        "messages are sent as plain 'role: text' lines.",
                        stacklevel=2,
                    )
                    self._warned_template = True
            return self._in_vocabulary(
                render_prompt(
                    self.tokenizer,
                    prompt,
                    prompt_format=self.prompt_format,
                    thinking=self.thinking,
                    tools=tools,
                )
            )
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt)
        ):
            vocab = self.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise InvalidArgumentError(
                    f"Token id(s) {bad[:5]} are outside this model's vocabulary [0, {vocab})."
                )
            if tools:
                raise InvalidArgumentError("Tools need chat messages, not token ids.")
            return [int(t) for t in prompt]
        raise InvalidArgumentError(
            "The prompt is empty or of the wrong type; give text, chat messages or token ids."
        )

    def _in_vocabulary(self, ids: list[int]) -> list[int]:
        """``ids`` the tokenizer gave, checked against the model's embedding
        rows (an id past them reads no row of it)."""
        vocab = self.vocab_size
        bad = sorted({t for t in ids if not 0 <= t < vocab})
        if bad:
            raise ModelLoadError(
                f"The tokenizer gave token id(s) {bad[:5]} outside this model's vocabulary "
                f"[0, {vocab}): its tokenizer is not the one its weights were trained with. "
                "Load the model's own tokenizer (its folder's tokenizer files)."
            )
        return ids

    @property
    def prompt_format(self) -> str:
        """``chat`` (the chat template), or ``plain`` (BOS + text + blank line)
        where the method says so: a self-distilled MTP checkpoint's
        ``mtp_config.json`` or, unconverted, the paper's format for its model
        type (:func:`mlx_mtp.data.render_prompt`)."""
        return getattr(getattr(self.method, "meta", None), "prompt_format", None) or "chat"

    @property
    def context_length(self) -> int | None:
        """The model's context in tokens (``max_position_embeddings`` of its
        config or text config), None where the config does not say."""
        cfg = getattr(self.loaded, "config", None) or {}
        n = cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get(
            "max_position_embeddings"
        )
        return int(n) if isinstance(n, numbers.Integral) and n > 0 else None

    def check_context(self, prompt_tokens: int, max_tokens: int, fit: bool = False) -> int:
        """The new tokens a generation may make after ``prompt_tokens``.

        Args:
            prompt_tokens: length of the encoded prompt.
            max_tokens: new tokens asked for.
            fit: clip ``max_tokens`` to the context left instead of refusing.

        Returns:
            ``max_tokens``, clipped where ``fit``.

        Raises:
            ContextLengthError: the prompt fills the context (the message
                says to shorten it), or (without ``fit``) prompt and new tokens
                do not fit in it.
        """
        ctx = self.context_length
        if ctx is None:
            return max_tokens
        if prompt_tokens >= ctx:
            raise ContextLengthError(
                f"This model's context is {ctx} tokens; the prompt alone has {prompt_tokens} "
                f"tokens, longer than the context allows (no room is left for new ones). "
                f"Shorten the prompt to fewer than {ctx} tokens.",
                context=ctx,
                prompt_tokens=prompt_tokens,
                max_tokens=max_tokens,
            )
        if fit:
            max_tokens = min(max_tokens, ctx - prompt_tokens)
        if prompt_tokens + max_tokens > ctx:
            raise ContextLengthError(
                f"This model's context is {ctx} tokens; the prompt has {prompt_tokens} tokens "
                f"and asks for {max_tokens} new ones. Shorten the prompt or lower max_tokens "
                "(--max-tokens).",
                context=ctx,
                prompt_tokens=prompt_tokens,
                max_tokens=max_tokens,
            )
        return max_tokens

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer has a chat template."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    @property
    def vocab_size(self) -> int:
        """Rows of the model's embedding table (from its args, not the possibly
        quantized weight)."""
        args = getattr(self.model, "args", None)
        return int(getattr(args, "vocab_size", 0) or len(self.tokenizer.vocab))

    def stream_generate(
        self,
        prompt: Prompt,
        *,
        max_tokens: int = 256,
        temp: float = 0.0,
        top_p: float = 0.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | None = None,
        chat_template: bool = True,
        fit_context: bool = False,
        should_stop: Callable[[], bool] | None = None,
        logprobs: int | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> Iterator[Chunk]:
        """Generate and yield text as it is committed (one chunk per decoding step).

        Args:
            prompt: see :meth:`encode`.
            max_tokens: limit on new tokens (>= 1).
            temp: sampling temperature (>= 0); 0 is greedy.
            top_p: nucleus sampling threshold in [0, 1] (0 or 1 disables).
            top_k: keep the k most likely tokens (0 disables).
            min_p: min-p threshold in [0, 1] (0 disables).
            seed: base seed in [0, 2**64) for sampling. Each sampled token's
                randomness depends only on (seed, its position), so a seed
                fixes the output whatever draft trees the method builds (see
                :mod:`mlx_mtp.sampling`). None draws one from ``mx.random``.
            chat_template: wrap a text prompt as a user message (see :meth:`encode`).
            fit_context: clip ``max_tokens`` to the context the prompt leaves
                instead of refusing (:meth:`check_context`).
            should_stop: asked between forward passes (prefill chunks and
                decoding steps); True ends the stream with a chunk whose
                ``finish_reason`` is ``"cancelled"``.
            logprobs: None, or how many most likely alternatives to report
                with each token's log-probability (0: the token's alone):
                each chunk's ``logprobs``, from the target model's logits at
                the token's position (lossless methods only; see
                :func:`~mlx_mtp.decoding.generate_steps`).
            tools: function definitions (OpenAI's ``tools`` list) rendered
                into a chat prompt by the chat template (see :meth:`encode`).

        The ranges are :data:`mlx_mtp.validation.LIMITS`, the same as the CLI's.
        Everything is checked before the prompt is prefilled.

        Raises:
            InvalidArgumentError: empty or malformed prompt, or an argument out
                of range or of the wrong type (the message names it).
            ContextLengthError: the prompt and ``max_tokens`` do not fit in the
                model's context.
            ModelBusyError: another stream on this model has not finished.
            CacheNotTrimmableError: the model's cache cannot drop rejected drafts.
        """
        args = check_generation_args(
            max_tokens=max_tokens, temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed
        )
        chat_template = check_flag("chat_template", chat_template)
        fit_context = check_flag("fit_context", fit_context)
        if should_stop is not None and not callable(should_stop):
            raise InvalidArgumentError(
                "should_stop must be a function of no arguments that returns True to stop, "
                f"or None; got {should_stop!r}"
            )
        check_logprobs(self.method, logprobs)
        tokens = self.encode(prompt, chat_template, tools=tools)
        max_tokens = self.check_context(len(tokens), args["max_tokens"], fit_context)
        sampler = None
        if args["temp"] > 0:
            # rank 0's seed on every rank of a sharded model (docs/design.md, failure class 14)
            seed = distributed.agree(args["seed"] if args["seed"] is not None else random_seed())
            sampler = PositionalSampler(args["temp"], args["top_p"], args["top_k"], min_p, seed)
        # a detokenizer of its own (older mlx-lm versions hand out one shared by the
        # tokenizer's callers, and every binding of a loaded model shares its tokenizer)
        detok = copy.copy(self.tokenizer.detokenizer)
        detok.reset()
        eos = self.eos_ids
        mine = object()
        with self._claim:  # the check and the claim in one step: race-free across threads
            if self._active is not None:
                raise ModelBusyError(
                    "This model is already generating: a stream on it (stream_generate or a "
                    "chat turn, in this thread or another) has started and not finished. Finish "
                    "or close it (gen.close()) first, or bind a model per thread "
                    "(LoadedModel.bind: its own KV cache)."
                )
            self._active = mine
        owner = threading.get_ident()
        try:
            steps = generate_steps(
                self.ctx,
                self.method,
                tokens,
                max_tokens=max_tokens,
                sampler=sampler,
                eos_ids=eos,
                should_stop=should_stop,
                prefill_step=self.prefill_step,
                logprobs=logprobs,
                runner=self.runner,
            )
            for step in steps:
                for t in step.tokens:
                    if t not in eos:
                        detok.add_token(t)
                if step.finish_reason is not None:
                    detok.finalize()
                yield Chunk(
                    detok.last_segment, step.tokens, step.stats, step.finish_reason, step.logprobs
                )
                if threading.get_ident() != owner:
                    self._moved(steps)
                    raise WrongThreadError(
                        "This stream was started on another thread; read a stream on the thread "
                        "that started it (MLX runs each thread's work on its own streams). The "
                        "model's KV cache was dropped."
                    )
        finally:
            if self._active is mine:
                self._active = None

    def _moved(self, steps: Iterator[Any]) -> None:
        """End a generation resumed on another thread: its pending device work
        belongs to the thread that started it, so its cleanup may fail here
        and the cache it left is not trusted (dropped)."""
        try:
            steps.close()
        except Exception:  # noqa: BLE001 (MLX refuses the other thread's work)
            pass
        self.engine.reset()

    def generate(self, prompt: Prompt, **kwargs: Any) -> Result:
        """Generate to the end; same arguments as :meth:`stream_generate`.

        Raises:
            InvalidArgumentError: an unknown keyword, and see
                :meth:`stream_generate`.
        """
        check_keywords(kwargs)
        text, toks, last = [], [], None
        for chunk in self.stream_generate(prompt, **kwargs):
            text.append(chunk.text)
            toks.extend(chunk.tokens)
            last = chunk
        assert last is not None
        return Result("".join(text), toks, last.stats, last.finish_reason)

    def chat(self) -> ChatSession:
        """A multi-turn conversation that reuses this model's KV cache."""
        return ChatSession(self)


@dataclass
class ChatSession:
    """Multi-turn chat: the history is re-rendered with the chat template each
    turn and the KV cache is reused up to the longest common prefix."""

    model: MTPModel
    messages: list[dict[str, str]] = field(default_factory=list)

    def send(self, text: str, **kwargs: Any) -> Iterator[Chunk]:
        """Stream the assistant's answer to one user message.

        A turn that fails (an error raised while encoding or generating)
        leaves the history as it was before it, so the session goes on; after
        a failure during generation the KV cache is dropped too (the next
        turn prefills the history again). A turn the caller stops early
        (``close()``, Ctrl-C) keeps the partial answer.

        Raises:
            InvalidArgumentError, ContextLengthError, ModelBusyError, ...:
                see :meth:`MTPModel.stream_generate`.
        """
        if not isinstance(text, str):
            raise InvalidArgumentError(f"A chat message must be a string, got {text!r}.")
        if not text.strip():
            raise InvalidArgumentError("The message is empty.")
        check_keywords(kwargs)
        # check the arguments before the history changes
        limits = {k: v for k, v in kwargs.items() if k in GENERATION_ARGS}
        check_generation_args(**{"max_tokens": 256, "temp": 0.0, **limits})
        before = len(self.messages)
        self.messages.append({"role": "user", "content": text})
        answer: list[str] = []
        try:
            for chunk in self.model.stream_generate(list(self.messages), **kwargs):
                answer.append(chunk.text)
                yield chunk
        except Exception as e:
            del self.messages[before:]
            if answer or not isinstance(e, (InvalidArgumentError, ModelBusyError)):
                self.model.engine.reset()  # a failure mid-generation: trust no cache
            raise
        except BaseException:  # stopped by the caller (GeneratorExit, Ctrl-C)
            self.messages.append({"role": "assistant", "content": "".join(answer)})
            raise
        self.messages.append({"role": "assistant", "content": "".join(answer)})


#: the keyword arguments of :meth:`MTPModel.stream_generate`
STREAM_KEYWORDS = (
    *GENERATION_ARGS,
    "chat_template",
    "fit_context",
    "should_stop",
    "logprobs",
    "tools",
)


def check_keywords(kwargs: dict[str, Any]) -> None:
    """Refuse keywords :meth:`MTPModel.stream_generate` does not take, by name
    (before a chat history changes).

    Raises:
        InvalidArgumentError: naming the unknown keywords and listing the valid ones.
    """
    unknown = sorted(set(kwargs) - set(STREAM_KEYWORDS))
    if unknown:
        raise InvalidArgumentError(
            f"unknown generation argument(s) {', '.join(unknown)}; the arguments are "
            f"{', '.join(STREAM_KEYWORDS)}."
        )


def _check_text(text: str, what: str) -> None:
    """Refuse text that is not valid Unicode (lone surrogates, e.g. from
    undecodable bytes on the command line), which tokenizers reject deep inside.

    Raises:
        InvalidArgumentError
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgumentError(
            f"{what} is not valid UTF-8 text (undecodable input at character {e.start}); "
            "re-encode it as UTF-8."
        ) from None
