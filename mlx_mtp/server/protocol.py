"""The OpenAI wire format: request parsing, response objects, errors, stop strings.

Pure Python (no web framework), so that it is tested and reused without one.
Shapes follow the OpenAI API reference for ``/v1/chat/completions`` and
``/v1/completions`` (https://platform.openai.com/docs/api-reference); mlx-mtp's
own settings and statistics travel in an extra ``mtp`` object, which standard
clients ignore.

Checked here: the *shape* of a request (JSON types, ``n``, ``stop``, the
``mtp`` object, parameters this server cannot honour, fields it does not
know: every field is honoured, accepted at a value that changes nothing, or
refused; none is ignored). Value ranges of the
generation settings (temperature, top_p, max_tokens, seed, method options) are
checked by :mod:`mlx_mtp.api` / :mod:`mlx_mtp.methods`, whose
:class:`~mlx_mtp.errors.MTPError` the server turns into a 400 (one validation
for the CLI, the Python API and the server).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidArgumentError
from ..validation import chat_role

#: most alternatives a request may ask per token (``top_logprobs``; completions'
#: ``logprobs``)
MAX_TOP_LOGPROBS = 20
#: most stop strings per request (OpenAI allows 4; a few more cost nothing here)
MAX_STOP = 16

#: fields of both endpoints that this server honours or checks
COMMON_FIELDS = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "stream", "stream_options", "mtp", "n", "presence_penalty", "frequency_penalty",
    "logprobs", "logit_bias", "user", "metadata",
}  # fmt: skip
#: the fields each endpoint takes (a request with any other field is refused)
FIELDS = {
    "chat": COMMON_FIELDS
    | {
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "parallel_tool_calls",
        "response_format",
    },  # fmt: skip
    "completion": COMMON_FIELDS | {"prompt", "best_of", "echo", "suffix"},
}
#: fields accepted with any value because they do not change the answer
#: (OpenAI's end-user id and request tags)
INERT_FIELDS = {"user", "metadata"}


class OpenAIError(Exception):
    """An error answered in OpenAI's shape ``{"error": {message, type, param, code}}``.

    Args:
        status: HTTP status (400, 401, 403, 404, 405, 413, 415, 429, 500, 503).
        message: what is wrong and what to do.
        type: OpenAI error type (``invalid_request_error``, ``authentication_error``,
            ``rate_limit_error``, ``server_error``).
        param: the request field at fault, if any (e.g. ``"messages"``).
        code: a short machine-readable code (e.g. ``"context_length_exceeded"``).
        headers: extra response headers (``Retry-After`` for 429).
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body ``{"error": {...}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """A 400 ``invalid_request_error``."""
    return OpenAIError(400, message, param=param, code=code)


@dataclass
class GenRequest:
    """A parsed, shape-checked generation request (chat or text completion).

    Attributes:
        kind: ``"chat"`` or ``"completion"``.
        prompt: chat messages (list of ``{"role", "content"}`` with string
            content), prompt text, or token ids.
        max_tokens: requested new tokens, or None for the server default.
        temperature / top_p / top_k / min_p / seed: sampling settings, None
            for the server default.
        stop: stop strings (the text is cut before the first one).
        stream: answer as server-sent events.
        include_usage: with ``stream``, send a usage chunk before ``[DONE]``.
        method: the mlx-mtp method, None for the server's.
        options: that method's options (used only with ``method``).
        logprobs: None (not asked), or how many most likely alternatives to
            report beside each token's log-probability (chat: ``logprobs:
            true`` with ``top_logprobs``; completions: ``logprobs: N``).
        tools: the function definitions to render into the chat prompt and
            parse calls of (None: no tools, also with ``tool_choice: "none"``).
    """

    kind: str
    model: str
    prompt: Any
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    method: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None


def parse_json(raw: bytes) -> dict[str, Any]:
    """Decode a request body that must be a JSON object.

    Raises:
        OpenAIError: 400 ``invalid_json`` for bytes that are not a JSON object
            (also ``NaN``/``Infinity``, which JSON does not have, and nesting
            too deep for the parser).
    """
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
        raise bad(
            f"The request body is not valid JSON ({e}). Send a JSON object with "
            "Content-Type: application/json.",
            code="invalid_json",
        ) from None
    except RecursionError:
        raise bad(
            "The request body is nested too deeply to be a chat or completion request.",
            code="invalid_json",
        ) from None
    if not isinstance(body, dict):
        raise bad("The request body must be a JSON object.", code="invalid_json")
    return body


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _number(body: dict, name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(f"'{name}' must be a number, got {json.dumps(v)}.", param=name)
    return float(v)


def _integer(body: dict, name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        raise bad(f"'{name}' must be an integer, got {json.dumps(v)}.", param=name)
    return v


def _boolean(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be true or false, got {json.dumps(v)}.", param=name)
    return v


def _refuse_unsupported(body: dict) -> None:
    """Refuse settings this server cannot honour instead of ignoring them."""
    n = _integer(body, "n")
    if n is not None and n != 1:
        raise bad(f"Only n=1 is supported (one answer per request), got n={n}.", param="n")
    best_of = _integer(body, "best_of")
    if best_of is not None and best_of != 1:
        raise bad("best_of is not supported; send best_of=1 or leave it out.", param="best_of")
    for name in ("presence_penalty", "frequency_penalty"):
        v = _number(body, name)
        if v not in (None, 0.0):
            raise bad(f"'{name}' is not supported by mlx-mtp; leave it out or 0.", param=name)
    if body.get("logit_bias"):
        raise bad("logit_bias is not supported by mlx-mtp.", param="logit_bias")
    if body.get("functions"):
        raise bad(
            "'functions' (OpenAI's deprecated form) is not supported; send the functions "
            'as \'tools\': [{"type": "function", "function": {...}}].',
            param="functions",
        )
    if body.get("function_call") not in (None, "none"):
        raise bad(
            "'function_call' (OpenAI's deprecated form) is not supported; use 'tools' and "
            "'tool_choice'.",
            param="function_call",
        )
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        raise bad(
            f"response_format {json.dumps(kind if kind is not None else fmt)} is not "
            "supported: mlx-mtp does not constrain its output to JSON. Supported: "
            '{"type": "text"} (or leave it out); ask for JSON in the prompt instead.',
            param="response_format",
            code="response_format_not_supported",
        )
    if _boolean(body, "echo"):
        raise bad("echo is not supported by mlx-mtp.", param="echo")
    if body.get("suffix"):
        raise bad("suffix (insertion) is not supported by mlx-mtp.", param="suffix")


def _logprobs(body: dict, kind: str) -> int | None:
    """How many alternatives per token a request asks with its log-probabilities
    (None: no log-probabilities)."""
    if kind == "completion":
        n = body.get("logprobs")
        if n is None:
            return None
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_TOP_LOGPROBS:
            raise bad(
                f"'logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}] (alternatives per "
                f"token), got {json.dumps(n)}.",
                param="logprobs",
            )
        return n
    asked = _boolean(body, "logprobs")
    top = body.get("top_logprobs")
    if top is None:
        return 0 if asked else None
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad(
            f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}], got {json.dumps(top)}.",
            param="top_logprobs",
        )
    if not asked:
        raise bad("'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
    return top


def _tools(body: dict) -> list[dict[str, Any]] | None:
    """The request's function tools, checked (None: none, or ``tool_choice:
    "none"``: the prompt is rendered without them and no call is parsed)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if body.get("parallel_tool_calls") is not None:
        _boolean(body, "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise bad("'tool_choice' needs 'tools'.", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad("'tools' must be a list of function tools.", param="tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (
            isinstance(t, dict)
            and t.get("type") == "function"
            and isinstance(fn, dict)
            and isinstance(fn.get("name"), str)
            and fn["name"]
            and isinstance(fn.get("parameters", {}), dict)
        ):
            raise bad(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                '"description": ..., "parameters": {...}}}} (function tools only).',
                param=f"tools[{i}]",
            )
    if choice in (None, "auto"):
        return tools
    if choice == "none":
        return None
    raise bad(
        f"tool_choice {json.dumps(choice)} is not supported: mlx-mtp cannot force a call "
        '(no constrained decoding). Supported: "auto" (the model decides) and "none".',
        param="tool_choice",
        code="tool_choice_not_supported",
    )


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad("'stop' must be a string or a list of strings.", param="stop")
    if len(items) > MAX_STOP:
        raise bad(f"At most {MAX_STOP} stop strings, got {len(items)}.", param="stop")
    if any(s == "" for s in items):
        raise bad("Stop strings must not be empty.", param="stop")
    return list(dict.fromkeys(items))


def _mtp(body: dict) -> tuple[str | None, dict[str, Any]]:
    v = body.get("mtp")
    if v is None:
        return None, {}
    if not isinstance(v, dict):
        raise bad('\'mtp\' must be an object such as {"method": "pld", "bc": "auto"}.', param="mtp")
    opts = dict(v)
    method = opts.pop("method", None)
    if method is not None and not isinstance(method, str):
        raise bad("'mtp.method' must be a string such as \"probe\".", param="mtp.method")
    if opts and method is None:
        raise bad(
            "'mtp' options need 'mtp.method' (the options belong to a method).",
            param="mtp.method",
        )
    for k, val in opts.items():
        if isinstance(val, (dict, list)) or val is None:
            raise bad(f"'mtp.{k}' must be a string, number or boolean.", param=f"mtp.{k}")
    return method, opts


def _content(msg: dict, i: int) -> str:
    c = msg.get("content")
    if c is None and msg.get("role") == "assistant":
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # content parts: only text
        out = []
        for part in c:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise bad(
                    f"messages[{i}].content: only text parts are supported.",
                    param=f"messages[{i}].content",
                )
            if not isinstance(part.get("text"), str):
                raise bad(
                    f"messages[{i}].content: a text part needs a string 'text'.",
                    param=f"messages[{i}].content",
                )
            out.append(part["text"])
        return "".join(out)
    raise bad(
        f"messages[{i}].content must be a string or a list of text parts.",
        param=f"messages[{i}].content",
    )


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` for the chat template: each
    ``{"id", "type": "function", "function": {"name", "arguments"}}`` with
    the arguments decoded from their JSON string (templates render them as
    an object, as ``mlx_lm.server`` gives them)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise bad(f"{where} must be a list.", param=where)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
            raise bad(
                f'{where}[{j}] must be {{"id", "type": "function", "function": {{"name", '
                '"arguments"}}}}.',
                param=f"{where}[{j}]",
            )
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise bad(
                    f"{where}[{j}].function.arguments is not valid JSON.",
                    param=f"{where}[{j}].function.arguments",
                ) from None
        call: dict[str, Any] = {
            "type": "function",
            "function": {"name": fn["name"], "arguments": args},
        }
        if isinstance(c.get("id"), str):
            call["id"] = c["id"]
        out.append(call)
    return out


def _messages(body: dict) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list of messages.", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object.", param=f"messages[{i}]")
        try:
            role = chat_role(m.get("role"), f"messages[{i}].role")
        except InvalidArgumentError as e:
            raise bad(str(e), param=f"messages[{i}].role") from None
        msg: dict[str, Any] = {"role": role, "content": _content(m, i)}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], i)
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if m.get(key) is not None:
                    if not isinstance(m[key], str):
                        raise bad(
                            f"messages[{i}].{key} must be a string.", param=f"messages[{i}].{key}"
                        )
                    msg[key] = m[key]
        out.append(msg)
    if not any(m["content"].strip() or m.get("tool_calls") for m in out):
        raise bad("All messages are empty; send some text.", param="messages")
    return out


def _prompt(body: dict) -> str | list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        if not p.strip():
            raise bad("'prompt' is empty; send some text.", param="prompt")
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return p
    if isinstance(p, list) and len(p) > 1 and all(isinstance(t, (str, list)) for t in p):
        raise bad("Only one prompt per request is supported (no batches).", param="prompt")
    raise bad("'prompt' must be a non-empty string or a list of token ids.", param="prompt")


def parse_request(body: dict[str, Any], kind: str) -> GenRequest:
    """Check the shape of a chat (``kind="chat"``) or text completion request.

    Raises:
        OpenAIError: 400 naming the field at fault.
    """
    unknown = sorted(set(body) - FIELDS[kind])
    if unknown:
        raise bad(
            f"Unknown field(s) {', '.join(map(repr, unknown))}: this server does not know "
            f"{'them' if len(unknown) > 1 else 'it'} and ignores nothing. It takes: "
            f"{', '.join(sorted(FIELDS[kind] - INERT_FIELDS))}; mlx-mtp's own settings go "
            "in 'mtp'.",
            param=unknown[0],
            code="unknown_field",
        )
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required (see GET /v1/models).", param="model")
    _refuse_unsupported(body)
    prompt = _messages(body) if kind == "chat" else _prompt(body)
    max_tokens = _integer(body, "max_tokens")
    if kind == "chat":
        mct = _integer(body, "max_completion_tokens")
        if mct is not None:
            if max_tokens is not None and max_tokens != mct:
                raise bad(
                    "max_tokens and max_completion_tokens differ; send one of them.",
                    param="max_completion_tokens",
                )
            max_tokens = mct
    seed = _integer(body, "seed")
    stream = _boolean(body, "stream")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise bad("'stream_options' must be an object.", param="stream_options")
    if so and set(so) - {"include_usage"}:
        extra = sorted(set(so) - {"include_usage"})
        raise bad(
            f"Unknown stream_options field(s) {', '.join(map(repr, extra))}; the one taken "
            "is include_usage.",
            param="stream_options",
            code="unknown_field",
        )
    include_usage = bool(so and _boolean(so, "include_usage"))
    method, options = _mtp(body)
    return GenRequest(
        kind=kind,
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature"),
        top_p=_number(body, "top_p"),
        top_k=_integer(body, "top_k"),
        min_p=_number(body, "min_p"),
        seed=seed,
        stop=_stop(body),
        stream=stream,
        include_usage=include_usage,
        method=method,
        options=options,
        logprobs=_logprobs(body, kind),
        tools=_tools(body) if kind == "chat" else None,
    )


class StopCutter:
    """Cut streamed text before the first stop string, never emitting past it.

    Text that could be the start of a stop string (a suffix of what has come
    so far that is a prefix of one) is held back until the next piece shows
    whether it is; so a stop string split across pieces is still found and
    nothing of it is sent.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Add ``text``; return what can be sent now ('' once stopped)."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending, self.stopped = self.pending[: min(hits)], "", True
            return out
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:k]):
                    hold = k
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        """The text held back, at the end of a generation that hit no stop string."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out


# ------------------------------------------------------------------ responses
def new_id(kind: str) -> str:
    """An id like OpenAI's: ``chatcmpl-...`` or ``cmpl-...``."""
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """The ``usage`` object; ``prompt_tokens_details.cached_tokens`` counts prompt
    tokens whose KV cache was reused from the previous request."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_object(
    kind: str,
    rid: str,
    model: str,
    text: str,
    finish_reason: str | None,
    usage_: dict[str, Any],
    mtp: dict[str, Any],
    created: int | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A non-streamed ``chat.completion`` or ``text_completion`` object.

    ``tool_calls``: the calls the answer made (chat: ``message.tool_calls``;
    the content is then null where no other text came). ``logprobs``: the
    choice's ``logprobs`` object (:func:`chat_logprobs` or
    :func:`completion_logprobs`), null where not asked."""
    created = created or int(time.time())
    if kind == "chat":
        message: dict[str, Any] = {
            "role": "assistant",
            "content": None if tool_calls and not text else text,
        }
        if tool_calls:
            message["tool_calls"] = tool_calls
        choice = {
            "index": 0,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage_,
        "mtp": mtp,
    }


def chunk_object(
    kind: str,
    rid: str,
    model: str,
    created: int,
    text: str | None = None,
    finish_reason: str | None = None,
    role: bool = False,
    usage_: dict[str, Any] | None = None,
    mtp: dict[str, Any] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed ``chat.completion.chunk`` / ``text_completion`` event.

    ``usage_`` set: the usage chunk (empty ``choices``), sent last when
    ``stream_options.include_usage`` asks for it. ``tool_calls``: complete
    calls for ``delta.tool_calls`` (each with its ``index``); ``logprobs``:
    the log-probabilities of the tokens this chunk's text came from.
    """
    if usage_ is not None:
        choices: list[dict[str, Any]] = []
    elif kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choices = [
            {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        ]
    else:
        choices = [
            {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        ]
    out: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage_ is not None:
        out["usage"] = usage_
    if mtp is not None:
        out["mtp"] = mtp
    return out


def chat_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """A chat choice's ``logprobs`` object: ``{"content": [{"token", "logprob",
    "bytes", "top_logprobs": [...]}, ...], "refusal": null}``."""
    return {"content": entries, "refusal": None}


def completion_logprobs(entries: list[dict[str, Any]], offset: int = 0) -> dict[str, Any]:
    """A text completion choice's ``logprobs`` object (OpenAI's legacy shape:
    ``tokens``, ``token_logprobs``, ``top_logprobs`` as ``{token: logprob}``,
    ``text_offset``), of the same entries; ``offset``: the answer's
    characters before the first of them."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


def sse(obj: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` (or a literal like ``[DONE]``)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n".encode()
