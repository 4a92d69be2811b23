"""Python API for apps: load a model with a method, generate or stream text.

One model and one method (:func:`load`)::

    import mlx_mtp

    m = mlx_mtp.load("smollm2-135m", method="probe", bc=30, masks=1)
    print(m.generate("What is the capital of France?", max_tokens=32).text)
    for chunk in m.stream_generate("Tell me a story", max_tokens=32):
        print(chunk.text, end="", flush=True)

Several methods on one model, loaded once (each binding has its own KV
cache; :meth:`LoadedModel.bind <mlx_mtp.loading.LoadedModel.bind>`)::

    from mlx_mtp.loading import load_model

    lm = load_model("smollm2-135m")
    probe, pld = lm.bind("probe"), lm.bind("pld", max_draft=10)
    print(pld.generate("Repeat after me: one two three.", max_tokens=16).text)

(tests/test_api_state.py runs these examples.)
"""

from __future__ import annotations

import copy
import numbers
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
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
from .loading import (
    EMBEDDED_MODEL,
    LoadedModel,
    draft_for,
    load_model,
    share_target,
)
from .logprobs import TokenLogprob
from .methods import Method, make_method
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
    :func:`batch_generate` or the server for throughput). A binding may move
    between threads from one generation to the next, but a stream is read
    on the thread that started it (else
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
        loaded: LoadedModel,
        method: Method,
        max_kv_size: int | None = None,
        thinking: bool = False,
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


def load(
    model: str = EMBEDDED_MODEL,
    method: str = "ntp",
    *,
    dtype: str | None = None,
    max_kv_size: int | None = None,
    thinking: bool = False,
    pipeline: bool = False,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    **method_options: Any,
) -> MTPModel:
    """Load a model and a multi-token method.

    Args:
        model: alias, folder, ``.gguf`` file or Hugging Face repo id.
        method: ``ntp``, ``pld``, ``probe`` (see ``mlx-mtp models``).
        thinking: ``enable_thinking`` for hybrid-thinking chat templates
            (Qwen3); off by default.
        dtype: compute dtype (float32 default on Linux CPU; as stored on Mac).
        max_kv_size: sliding-window KV cache size (tokens), None for unbounded.
        kv_bits: 4 or 8: keep the KV cache quantized (mlx-lm's
            ``QuantizedKVCache``, from the first token), None for full
            precision; not with ``max_kv_size``.
        kv_group_size: quantization group size of the KV cache (32, 64, 128).
        pipeline: under ``mlx.launch`` (a group of several ranks), shard the
            model by layers instead of by heads (see :mod:`mlx_mtp.distributed`).
        **method_options: e.g. ``bc=30, masks=2, tree="dynamic"`` for probe.

    Raises:
        ModelNotFoundError, ModelLoadError, UnknownMethodError,
        UnsupportedModelError, InvalidArgumentError (unknown method options,
        out-of-range values; all checked before the model is loaded where
        they can be).
    """
    if not isinstance(model, str):
        raise InvalidArgumentError(
            f"model must be a string (alias, path or repo id), got {model!r}"
        )
    if not isinstance(method, str):
        raise InvalidArgumentError(f"method must be a string, got {method!r}")
    m = make_method(method, **method_options)  # validate before the slow load
    if max_kv_size is not None:
        check_value("max_kv_size", max_kv_size)
    if not isinstance(thinking, bool):
        raise InvalidArgumentError(f"thinking must be True or False, got {thinking!r}")
    check_kv(kv_bits, kv_group_size)
    if kv_bits is not None and max_kv_size is not None:
        raise InvalidArgumentError(
            "kv_bits and max_kv_size cannot be combined: a sliding window is not quantized "
            "(use one of --kv-bits and --max-kv-size)."
        )
    lm = load_model(model, dtype, pipeline=pipeline)
    shared = share_target(lm, method_options)
    if shared is not method_options:  # the draft model is the target: its weights, once
        m = make_method(method, **shared)
    return lm.bind(
        m,
        max_kv_size=max_kv_size,
        thinking=thinking,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
    )


class RowSampler:
    """One prompt's :class:`PositionalSampler` inside mlx-lm's batch, which
    calls it once per token drawn, in order, with that row's log-probabilities
    only: it supplies the position of each draw (the prompt's length for the
    first), so that the row draws what a solo generation with the same seed
    draws."""

    def __init__(self, sampler: PositionalSampler, first_position: int):
        self.sampler = sampler
        self.position = first_position

    def __call__(self, logprobs: Any) -> Any:
        out = self.sampler(logprobs, [self.position])
        self.position += 1
        return out


def batch_generate(
    loaded: LoadedModel,
    prompts: Sequence[Prompt],
    *,
    max_tokens: int | Sequence[int] = 256,
    temp: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    chat_template: bool = True,
    fit_context: bool = False,
    max_batch: int = 8,
    prefill_step: int = PREFILL_STEP,
    method: str = "ntp",
    max_draft: int = 4,
    draft_model: Any = None,
) -> list[Result]:
    """Generate answers to several prompts at once, batched: every unfinished
    prompt runs in one forward pass per step; a prompt leaves the batch at
    EOS or ``max_tokens`` and the next one waiting joins after its prefill.

    ``method="ntp"``: plain next-token decoding with mlx-lm's continuous
    batching (``BatchGenerator``, ``BatchKVCache``). ``method="pld"``: each
    row drafts by prompt lookup and the drafts of every row are verified in
    the batch's one forward pass (:class:`~mlx_mtp.batching.DraftBatch`,
    greedy only; models whose layers all keep a full KV cache).
    ``method="recycle"``: the same, and each row's draft is a tree, its
    lookup's chain and the candidates a table of the model's own
    predictions (token recycling), filled from every slot of every pass of
    the batch, holds after its newest token and after every node.
    ``method="draft"``: ``draft_model``, a smaller model of the same
    tokenizer, drafts a greedy chain for every row in batched passes of its
    own, verified in the target's one pass (:class:`~mlx_mtp.batching.BatchDrafter`).
    ``method="probe"``: ESP's mask slots (one after every token slot of a
    row) predict the next step's tree of each row
    (:class:`~mlx_mtp.batching.BatchMasks`); passes run with masks while
    they win over plain steps under the batch's measured pass times.
    ``method="hybrid"``: one tree per row of its lookup's chain and its
    mask candidates (hybrid's ``pld`` and ``probe`` sources; its other
    sources do not run in a batch).
    ``method="clp"``: the model's CLP heads (verified mode) at each row's
    deepest accepted slot write its next chain, cut to the span predictor's
    length; they run while that wins over plain steps.
    ``method="lookahead"``: each row's Jacobi columns ride in the batch's
    pass (:class:`~mlx_mtp.batching.BatchLookahead`, at most 10% more pass
    time, within the batch's ledger), fill its n-gram pool, and the pool's
    n-grams after its newest token are its draft.
    ``method="mtp"``: the checkpoint's own MTP layer
    (:class:`~mlx_mtp.batching.BatchNative`, its own batched KV cache)
    drafts each row's chain, as a draft model would.

    Each prompt's answer is the one :meth:`MTPModel.generate` gives it alone
    with the same arguments (greedy: the argmax of each row; sampled: each
    prompt draws with its own :class:`PositionalSampler`, keyed by ``seed``
    and the position, as a solo generation does). A batched forward pass
    computes the same function as a one-row pass but may round differently,
    so where two tokens nearly tie the batch can pick the other one: the
    agreement with solo answers is measured, not guaranteed (tests/test_batch.py).

    Args:
        loaded: the model (:meth:`LoadedModel.batch_generate
            <mlx_mtp.loading.LoadedModel.batch_generate>` passes itself).
        prompts: a list of prompts, each as :meth:`MTPModel.encode` takes.
        max_tokens: new tokens per prompt: one limit for all, or one each.
        temp / top_p / top_k / min_p / seed / chat_template / fit_context:
            as :meth:`MTPModel.stream_generate`, the same for every prompt
            (seed None with ``temp > 0``: a random base seed per prompt).
        max_batch: most prompts decoded in one forward pass (>= 1).
        prefill_step: prompt tokens per prefill pass.
        method: ``"ntp"``, ``"pld"``, ``"recycle"``, ``"draft"``, ``"probe"``,
            ``"hybrid"``, ``"clp"`` (the heads made for the model),
            ``"lookahead"`` or ``"mtp"`` (the checkpoint's MTP layer).
        max_draft: with a drafting method, most draft tokens per row and step
            (the width of each pass, and a draft model's passes, are chosen by
            measured cost, 0 to ``max_draft``).
        draft_model: with ``"draft"``, the draft model (an alias, folder,
            GGUF file or hub id, loaded once per process in the target's
            dtype, or a :class:`~mlx_mtp.loading.LoadedModel`).

    Returns:
        One :class:`Result` per prompt, in order. Its ``stats`` count the
        prompt's own tokens; ``prefill_time`` is the seconds from the start
        to its first new token and ``decode_time`` from then to its last (the
        passes are shared with the rest of the batch).

    Raises:
        InvalidArgumentError: no prompts, a bad prompt or argument (naming
            which prompt), ``max_tokens`` of the wrong length, another method,
            a drafting method with ``temp > 0``, ``draft`` without a draft
            model or a draft model with another method.
        UnsupportedModelError: a drafting method on a model with
            sliding-window or state-space layers; ``recycle``, ``probe`` or
            ``hybrid`` on a family that cannot run draft trees, ``probe`` or
            ``hybrid`` on one that takes no input embeddings; a draft model
            whose tokenizer differs from the target's.
        ModelNotFoundError: ``clp`` on a model with no CLP heads.
        CheckpointMismatchError: CLP heads made for another model.
        ContextLengthError: a prompt and its ``max_tokens`` do not fit in the
            model's context.
    """
    import time

    from mlx_lm.generate import BatchGenerator

    if isinstance(prompts, (str, dict)) or not isinstance(prompts, Sequence) or not prompts:
        raise InvalidArgumentError(
            "prompts must be a non-empty list of prompts (texts, chat message lists or "
            f"token id lists), got {type(prompts).__name__}."
        )
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise InvalidArgumentError(f"max_batch must be an integer >= 1, got {max_batch!r}.")
    if isinstance(prefill_step, bool) or not isinstance(prefill_step, int) or prefill_step < 1:
        raise InvalidArgumentError(f"prefill_step must be an integer >= 1, got {prefill_step!r}.")
    if method not in BATCH_METHODS:
        raise InvalidArgumentError(
            f"batched generation runs method {', '.join(map(repr, BATCH_METHODS))}, got "
            f"{method!r}; decode other methods one prompt at a time (MTPModel.generate)."
        )
    if (method == "draft") != (draft_model not in (None, "")):
        raise InvalidArgumentError(
            "method 'draft' needs draft_model= (a smaller model of the target's tokenizer)"
            if method == "draft"
            else f"draft_model is for method 'draft', not {method!r}."
        )
    if isinstance(max_draft, bool) or not isinstance(max_draft, int) or not 0 <= max_draft <= 64:
        raise InvalidArgumentError(f"max_draft must be an integer in [0, 64], got {max_draft!r}.")
    # the sampling settings hold for every prompt: checked once, named without a prompt
    sampling = check_generation_args(
        max_tokens=1, temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed
    )
    del sampling["max_tokens"]
    chat_template = check_flag("chat_template", chat_template)
    fit_context = check_flag("fit_context", fit_context)
    if method != "ntp" and sampling["temp"] > 0:
        raise InvalidArgumentError(
            f"batched drafting (method {method!r}) is greedy only; use temp=0, or method "
            "'ntp' for a sampled batch."
        )
    if isinstance(max_tokens, Sequence) and not isinstance(max_tokens, (str, bytes)):
        limits = list(max_tokens)
    else:
        limits = [max_tokens] * len(prompts)
    if len(limits) != len(prompts):
        raise InvalidArgumentError(
            f"max_tokens has {len(limits)} values for {len(prompts)} prompts; give one for "
            "all or one per prompt."
        )
    ntp = MTPModel(loaded, make_method("ntp"))  # its prompt encoding and context checks
    tokens, limit_of, samplers = [], [], []
    for i, (prompt, n) in enumerate(zip(prompts, limits)):
        try:
            args = check_generation_args(max_tokens=n, **sampling)
            toks = ntp.encode(prompt, chat_template)
            limit_of.append(ntp.check_context(len(toks), args["max_tokens"], fit_context))
        except InvalidArgumentError as e:
            raise type(e)(f"prompts[{i}]: {e}") from None
        tokens.append(toks)
        if args["temp"] > 0:
            base = args["seed"] if args["seed"] is not None else random_seed()
            row = PositionalSampler(args["temp"], args["top_p"], args["top_k"], min_p, base)
            samplers.append(RowSampler(row, len(toks)))
    eos = ntp.eos_ids
    if method != "ntp":
        return _draft_batch(
            loaded, tokens, limit_of, max_batch, prefill_step, max_draft, eos, method, draft_model
        )
    gen = BatchGenerator(
        loaded.model,
        stop_tokens=[[t] for t in sorted(eos)],
        completion_batch_size=max_batch,
        prefill_batch_size=min(max_batch, 8),
        prefill_step_size=prefill_step,
    )
    try:
        uids = gen.insert(tokens, limit_of, samplers=samplers or None)
        out: dict[int, list[int]] = {u: [] for u in uids}
        finish: dict[int, str] = {}
        first: dict[int, float] = {}
        last: dict[int, float] = {}
        t0 = time.perf_counter()
        while responses := gen.next_generated():
            now = time.perf_counter()
            for r in responses:
                out[r.uid].append(int(r.token))
                first.setdefault(r.uid, now)
                last[r.uid] = now
                if r.finish_reason is not None:
                    finish[r.uid] = r.finish_reason
    finally:
        gen.close()
    detok = loaded.tokenizer.detokenizer
    results = []
    for uid, toks in zip(uids, tokens):
        new = out[uid]
        stats = GenerationStats(
            method="ntp(batch)",
            prompt_tokens=len(toks),
            prefill_tokens=len(toks),
            prefill_time=first[uid] - t0,
            generated_tokens=len(new),
            decode_time=last[uid] - first[uid],
            forward_passes=len(new),
            steps=len(new),
            slots=len(new),
            max_slots=1,
        )
        results.append(Result(_detokenize(detok, new, eos), new, stats, finish[uid]))
    return results


def _detokenize(detok: Any, tokens: list[int], eos: set[int]) -> str:
    """The text of one batched answer (end-of-sequence tokens left out)."""
    detok.reset()
    for t in tokens:
        if t not in eos:
            detok.add_token(t)
    detok.finalize()
    return detok.text


def _draft_batch(
    loaded: LoadedModel,
    prompts: list[list[int]],
    limits: list[int],
    max_batch: int,
    prefill_step: int,
    max_draft: int,
    eos: set[int],
    method: str,
    draft_model: Any = None,
) -> list[Result]:
    """:func:`batch_generate` with a drafting method: prompts join a
    :class:`~mlx_mtp.batching.DraftBatch` in order as rows leave it."""
    import time

    from .batching import DraftBatch
    from .clp_format import heads_for

    batch = DraftBatch.for_method(
        loaded.model,
        eos,
        method,
        draft_model=draft_for(loaded, draft_model).model if method == "draft" else None,
        heads=heads_for(loaded.model, None, loaded.name)[0] if method == "clp" else None,
        native=native_layer(loaded) if method == "mtp" else None,
        max_draft=max_draft,
        prefill_step=prefill_step,
    )
    out: dict[int, list[int]] = {}
    finish: dict[int, str] = {}
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    prefill: dict[int, float] = {}
    rows: dict[int, int] = {}
    waiting = list(range(len(prompts)))
    while waiting or len(batch):
        while waiting and len(batch) < max_batch:
            i = waiting.pop(0)
            t = time.perf_counter()
            uid, got = batch.add(prompts[i], limits[i])
            first[i] = last[i] = time.perf_counter()
            prefill[i] = first[i] - t
            out[i] = list(got.tokens)
            rows[uid] = i
            if got.finish_reason is not None:
                finish[i] = got.finish_reason
        for got in batch.step():
            i = rows[got.uid]
            out[i].extend(got.tokens)
            last[i] = time.perf_counter()
            if got.finish_reason is not None:
                finish[i] = got.finish_reason
    done = {i: batch.take_row(uid) for uid, i in rows.items()}
    detok = loaded.tokenizer.detokenizer
    results = []
    for i, toks in enumerate(prompts):
        new, row = out[i], done[i]
        stats = GenerationStats(
            method=f"{method}(batch, max_draft={max_draft})",
            prompt_tokens=len(toks),
            prefill_tokens=len(toks),
            prefill_time=prefill[i],
            generated_tokens=len(new),
            decode_time=last[i] - first[i],
            forward_passes=1 + (row.passes if row else 0),
            steps=row.passes if row else 0,
            drafted=row.drafted if row else 0,
            accepted=row.accepted if row else 0,
            slots=row.slots if row else 1,
            max_slots=row.max_slots if row else 1,
        )
        results.append(Result(_detokenize(detok, new, eos), new, stats, finish[i]))
    return results


def native_layer(loaded: LoadedModel) -> Any:
    """The native MTP layer of ``loaded``'s checkpoint (for a batch).

    Raises:
        UnsupportedModelError: a model a drafting batch cannot run (see
            :func:`~mlx_mtp.batching.check_batchable`), one loaded without
            its folder, or of a family without a native MTP layer.
        ModelLoadError: no (or unfitting) MTP tensors in the folder.
    """
    from pathlib import Path

    from .batching import check_batchable
    from .native_mtp import native_layer_for

    check_batchable(loaded.model)  # before reading the layer

    folder = getattr(loaded, "path", None)
    if folder is None:
        raise UnsupportedModelError(
            "the native MTP layer is read from the model's checkpoint folder; load the model "
            "with mlx_mtp.load(...) or --model."
        )
    return native_layer_for(Path(folder), loaded.model, getattr(loaded, "config", None))


#: the methods :func:`batch_generate` runs
BATCH_METHODS = ("ntp", "pld", "recycle", "draft", "probe", "hybrid", "clp", "lookahead", "mtp")

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
