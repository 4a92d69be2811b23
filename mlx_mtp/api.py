"""Python API for apps: load a model with a method, generate or stream text.

import mlx_mtp
m = mlx_mtp.load("smollm2-135m", method="probe", bc=30, masks=1)
print(m.generate("What is the capital of France?").text)
for chunk in m.stream_generate("Tell me a story", max_tokens=200):
    print(chunk.text, end="", flush=True)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Union

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

from .decoding import GenerationStats, generate_steps
from .engine import Engine
from .errors import InvalidArgumentError
from .loading import EMBEDDED_MODEL, LoadedModel, load_model
from .methods import Method, make_method

Prompt = Union[str, list[int], list[dict[str, str]]]  # noqa: UP007 (py3.10 alias)


@dataclass
class Chunk:
    """One streamed piece: ``text`` (new text), ``tokens`` (new token ids),
    ``stats`` (running :class:`GenerationStats`), ``finish_reason`` (None,
    ``"stop"`` or ``"length"``)."""

    text: str
    tokens: list[int]
    stats: GenerationStats
    finish_reason: str | None = None


@dataclass
class Result:
    """A finished generation: full ``text``, ``tokens``, ``stats``, ``finish_reason``."""

    text: str
    tokens: list[int]
    stats: GenerationStats
    finish_reason: str | None


class MTPModel:
    """A loaded model, a method and one KV cache (reused across calls by prefix).

    Not thread-safe: use one instance per conversation thread.
    """

    def __init__(self, loaded: LoadedModel, method: Method, max_kv_size: int | None = None):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.method = method
        self.engine = Engine(self.model, max_kv_size=max_kv_size)
        self.engine.loaded = loaded  # the folder and tokenizer, for methods (confadapt)
        method.prepare(self.engine)

    @property
    def eos_ids(self) -> set[int]:
        return set(self.tokenizer.eos_token_ids or [])

    def encode(self, prompt: Prompt, chat_template: bool = True) -> list[int]:
        """Token ids of a prompt.

        Args:
            prompt: text (wrapped as one user message if the tokenizer has a
                chat template and ``chat_template``), a list of chat messages
                ``{"role", "content"}``, or token ids.

        Raises:
            InvalidArgumentError: an empty prompt.
        """
        if isinstance(prompt, str):
            if not prompt.strip():
                raise InvalidArgumentError("The prompt is empty; type some text.")
            if chat_template and getattr(self.tokenizer, "chat_template", None):
                prompt = [{"role": "user", "content": prompt}]
            else:
                return list(self.tokenizer.encode(prompt))
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            return list(self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True))
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) and prompt:
            return list(prompt)
        raise InvalidArgumentError(
            "The prompt is empty or of the wrong type; give text, chat messages or token ids."
        )

    def stream_generate(
        self,
        prompt: Prompt,
        *,
        max_tokens: int = 256,
        temp: float = 0.0,
        top_p: float = 0.0,
        seed: int | None = None,
        chat_template: bool = True,
    ) -> Iterator[Chunk]:
        """Generate and yield text as it is committed (one chunk per decoding step).

        Args:
            prompt: see :meth:`encode`.
            max_tokens: limit on new tokens (> 0).
            temp: sampling temperature; 0 is greedy.
            top_p: nucleus sampling threshold (0 disables), used when temp > 0.
            seed: seed for ``mx.random`` (sampling only).

        Raises:
            InvalidArgumentError: empty prompt, max_tokens <= 0, temp < 0.
            CacheNotTrimmableError: the model's cache cannot drop rejected drafts.
        """
        if temp < 0:
            raise InvalidArgumentError(f"temp must be >= 0, got {temp}")
        tokens = self.encode(prompt, chat_template)
        if seed is not None:
            mx.random.seed(seed)
        sampler = make_sampler(temp, top_p) if temp > 0 else None
        detok = self.tokenizer.detokenizer
        detok.reset()
        eos = self.eos_ids
        for step in generate_steps(
            self.engine,
            self.method,
            tokens,
            max_tokens=max_tokens,
            sampler=sampler,
            eos_ids=eos,
        ):
            for t in step.tokens:
                if t not in eos:
                    detok.add_token(t)
            if step.finish_reason is not None:
                detok.finalize()
            yield Chunk(detok.last_segment, step.tokens, step.stats, step.finish_reason)

    def generate(self, prompt: Prompt, **kwargs: Any) -> Result:
        """Generate to the end; same arguments as :meth:`stream_generate`."""
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
        """Stream the assistant's answer to one user message."""
        if not text.strip():
            raise InvalidArgumentError("The message is empty.")
        self.messages.append({"role": "user", "content": text})
        answer = []
        try:
            for chunk in self.model.stream_generate(list(self.messages), **kwargs):
                answer.append(chunk.text)
                yield chunk
        finally:
            self.messages.append({"role": "assistant", "content": "".join(answer)})


def load(
    model: str = EMBEDDED_MODEL,
    method: str = "ntp",
    *,
    dtype: str | None = None,
    max_kv_size: int | None = None,
    **method_options: Any,
) -> MTPModel:
    """Load a model and a multi-token method.

    Args:
        model: alias, folder, ``.gguf`` file or Hugging Face repo id.
        method: ``ntp``, ``pld``, ``probe`` (see ``mlx-mtp models``).
        dtype: compute dtype (float32 default on Linux CPU; as stored on Mac).
        max_kv_size: sliding-window KV cache size (tokens), None for unbounded.
        **method_options: e.g. ``bc=30, masks=2, tree="dynamic"`` for probe.

    Raises:
        ModelNotFoundError, ModelLoadError, UnknownMethodError,
        UnsupportedModelError, InvalidArgumentError.
    """
    m = make_method(method, **method_options)  # validate before the slow load
    return MTPModel(load_model(model, dtype), m, max_kv_size=max_kv_size)
