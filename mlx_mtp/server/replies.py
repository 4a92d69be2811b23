"""What the worker says back to a request besides its tokens: a package
error as the request's 400 (:func:`openai_error`, in the request's words:
:func:`api_wording`) and the ``mtp`` statistics object (:func:`mtp_stats`)."""

from __future__ import annotations

import re
from typing import Any

from ..errors import ContextLengthError, MTPError
from .limits import ARTIFACT_OPTIONS, VALUE_OPTIONS
from .protocol import GenRequest, OpenAIError

#: method options, as a message may name them: ``--opt NAME=``, ``--NAME``
#: (dashes for underscores) or ``option NAME``
_OPTION_WORDS = re.compile(r"--opt (\w+)=|--([a-z][a-z0-9-]*)|\boption (\w+)")


def api_wording(message: str) -> str:
    """A package error's message in the words of a request: method options as
    ``mtp.NAME`` (not ``--NAME``, ``--opt NAME=...`` or ``option NAME``), the
    method as ``method NAME`` (not ``--method NAME``). Other flags, and
    commands in backticks, stay (they speak to the server's operator)."""
    options = ARTIFACT_OPTIONS | VALUE_OPTIONS

    def word(m: re.Match) -> str:
        if m.group(1):
            return f"mtp.{m.group(1)}="
        name = (m.group(2) or m.group(3)).replace("-", "_")
        if m.group(2) == "method":
            return "method"
        return f"mtp.{name}" if name in options else m.group(0)

    parts = message.split("`")  # a command in backticks is the operator's: kept as it is
    return "`".join(p if i % 2 else _OPTION_WORDS.sub(word, p) for i, p in enumerate(parts))


def openai_error(e: MTPError, req: GenRequest) -> OpenAIError:
    """The 400 of a package error raised for a request: the class name as the
    code (``InvalidArgumentError`` -> ``invalid_argument_error``), except a
    context too short (``context_length_exceeded``, as OpenAI's); the message
    in the request's words (:func:`api_wording`)."""
    if isinstance(e, ContextLengthError):
        param = "messages" if req.kind == "chat" else "prompt"
        message = str(e)
        # the API's message names the CLI's --max-tokens where max_tokens is to blame
        if e.context is not None and e.prompt_tokens is not None and e.prompt_tokens < e.context:
            message = (
                f"This model's context is {e.context} tokens; the prompt has "
                f"{e.prompt_tokens} tokens and asks for {e.max_tokens} new ones. Shorten "
                "the prompt or lower max_tokens."
            )
        return OpenAIError(400, message, param=param, code="context_length_exceeded")
    name = type(e).__name__
    param = "mtp.method" if name == "UnknownMethodError" else None
    code = re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()
    return OpenAIError(400, api_wording(str(e)), param=param, code=code)


def logprob_entries(tokenizer: Any, lps: list[Any], eos: set[int]) -> list[dict[str, Any]]:
    """OpenAI's chat ``logprobs.content`` entries of :class:`~mlx_mtp.logprobs.TokenLogprob`
    records: ``{"token", "logprob", "bytes", "top_logprobs": [{"token",
    "logprob", "bytes"}]}``, each token as the tokenizer decodes it alone;
    end-of-sequence tokens (no text) are left out."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    out = []
    for e in lps:
        if e.token in eos:
            continue
        entry = one(e.token, e.logprob)
        entry["top_logprobs"] = [one(t, v) for t, v in e.top]
        out.append(entry)
    return out


def mtp_stats(st: Any, cached: int, job: Any) -> dict[str, Any]:
    """The ``mtp`` object of a response: method settings, the runner that
    decoded it (:mod:`mlx_mtp.runners`; ``batched`` for a row of a batch),
    acceptance and timing
    (:class:`~mlx_mtp.decoding.GenerationStats`; seconds, tokens per second)."""
    return {
        "method": st.method,
        "runner": st.runner,
        "block_complexity": st.block_complexity,
        "max_slots": st.max_slots,
        "slots_per_forward": round(st.slots_per_forward, 3),
        "tau": round(st.tau, 4),
        "drafted": st.drafted,
        "accepted": st.accepted,
        "acceptance_rate": round(st.acceptance_rate, 4),
        "forward_passes": st.forward_passes,
        "plain_steps": st.plain_steps,
        "reprobes": st.reprobes,
        "generated_tokens": st.generated_tokens,
        "prompt_tokens": st.prompt_tokens,
        "cached_tokens": cached,
        "prefill_tokens": st.prefill_tokens,
        "prefill_s": round(st.prefill_time, 4),
        "decode_s": round(st.decode_time, 4),
        "tokens_per_s": round(st.decode_tps, 2),
        "queue_wait_s": round(job.queue_wait, 4),
    }
