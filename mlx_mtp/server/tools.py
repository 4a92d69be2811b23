"""Tool calls in an answer's text, found and parsed with mlx-lm's own pieces.

mlx-lm's ``TokenizerWrapper`` knows a model's tool-call format from its chat
template (or ``tool_parser_type`` in ``tokenizer_config.json``): the text
that opens and closes a call (``tool_call_start``, ``tool_call_end``) and the
parser of the text between (``tool_parser``, from ``mlx_lm.tool_parsers``).
:class:`ToolCallStream` feeds the answer's text, as it comes, through
mlx-lm's ``TextStateMachine`` with those two markers (text that may be the
start of a marker is held back until the next piece shows whether it is),
keeps the text outside calls as the answer's content, and formats each
finished call with ``mlx_lm.server.ToolCallFormatter`` into OpenAI's
``{"id", "type": "function", "function": {"name", "arguments"}}`` (the
arguments a JSON string). A call whose text the parser cannot read (cut by
``max_tokens``, or not JSON) is dropped with a warning in the log, as
``mlx_lm.server`` does.

Some models of a family with a tool format write the call without its
markers: Qwen2.5-Coder-Instruct (0.5B and 1.5B, asked with Qwen2.5's
``<tool_call>`` template) answers with the call's JSON object alone, bare or
in a fenced block (```` ```json ... ``` ````). An answer that is nothing but
such a call (an object, or a list of them, each with ``"name"`` one of the
request's tools and ``"arguments"`` an object) is read as its calls. While
the answer so far can still be one, its text is held back (streamed answers
included); once it cannot (any other text, a fence of another language) the
held text is sent as content.
"""

from __future__ import annotations

import json
import uuid
from typing import Any


class ToolCallStream:
    """Split an answer's text into content and tool calls as it streams.

    Args:
        tokenizer: the model's mlx-lm ``TokenizerWrapper`` (``has_tool_calling``).
        tools: the request's ``tools`` (handed to the parser, which some
            formats need to type the arguments).
        streaming: give each call an ``index`` (``delta.tool_calls``).
    """

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]], streaming: bool = False):
        from mlx_lm.generate import TextStateMachine
        from mlx_lm.server import ToolCallFormatter

        start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
        machine = TextStateMachine(
            {"normal": [(start, "tool")], "tool": [(end, "normal")] if end else []}
        )
        self._state = machine.make_state("normal")
        self._format = ToolCallFormatter(tokenizer.tool_parser, tools, streaming)
        self._call = ""  # the text of the call being read
        self._names = {t.get("function", {}).get("name") for t in tools if isinstance(t, dict)} - {
            None
        }
        self._streaming = streaming
        # the content held back while the whole answer may be a call without
        # markers; None once it cannot be
        self._bare: list[str] | None = []
        #: whether the answer has made at least one call
        self.called = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """Add a piece of the answer; return the content that can be sent now
        and the calls that ended in it (formatted)."""
        from mlx_lm.generate import TextStateMachine

        self._state, segments = TextStateMachine.split(self._state, text)
        content, calls = self._take(segments)
        if self._bare is None:
            return content, calls
        self._bare.append(content)
        held = "".join(self._bare)
        if not self.called and not self._call and may_be_bare_call(held):
            return "", calls
        self._bare = None
        return held, calls

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The end of the answer: the text held back, and a call still open
        (its end marker never came: parsed if it can be)."""
        from mlx_lm.generate import TextStateMachine

        self._state, held, state = TextStateMachine.flush(self._state)
        content, calls = self._take([(state, held)])
        if self._call.strip():
            calls += self._parse([self._call])
        self._call = ""
        if self._bare is not None:
            content = "".join(self._bare) + content
            self._bare = None
            bare = None if calls else bare_calls(content, self._names)
            if bare:
                self.called = True
                return "", [self._formatted(i, c) for i, c in enumerate(bare)]
        return content, calls

    def _formatted(self, index: int, call: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "function": {
                "name": call["name"],
                "arguments": json.dumps(call["arguments"], ensure_ascii=False),
            },
            "type": "function",
            "id": str(uuid.uuid4()),
        }
        if self._streaming:
            out["index"] = index
        return out

    def _take(self, segments: list[tuple[str, str]]) -> tuple[str, list[dict[str, Any]]]:
        content, ended = [], []
        for state, text in segments:
            if state == "tool":
                self._call += text
            else:
                if self._call:  # a call just ended
                    ended.append(self._call)
                    self._call = ""
                content.append(text)
        return "".join(content), self._parse(ended)

    def _parse(self, texts: list[str]) -> list[dict[str, Any]]:
        calls = self._format(texts)
        self.called = self.called or bool(calls)
        return calls


_FENCES = ("```json", "```")


def may_be_bare_call(text: str) -> bool:
    """Whether ``text``, the start of an answer, can still grow into a tool
    call without markers: a JSON object or list, bare or in a ```` ```json ````
    (or unlabelled) fence."""
    s = text.lstrip()
    if "```".startswith(s):  # nothing yet, or the start of a fence
        return True
    if s.startswith("```"):
        line, newline, rest = s.partition("\n")
        if not newline:
            return any(f.startswith(line.rstrip()) for f in _FENCES)
        if line.rstrip() not in _FENCES:
            return False
        s = rest.lstrip()
    return s == "" or s[0] in "{["


def bare_calls(text: str, names: set[str | None]) -> list[dict[str, Any]] | None:
    """The calls of a whole answer that is one tool call (or a list of them)
    without markers: ``[{"name", "arguments"}]``, or None where ``text`` is
    anything else (other text, JSON that is not a call, a tool not offered)."""
    s = text.strip()
    if s.startswith("```"):
        line, _, body = s.partition("\n")
        if line.rstrip() not in _FENCES or not body.rstrip().endswith("```"):
            return None
        s = body.rstrip()[:-3]
    try:
        value = json.loads(s)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        args = item.get("arguments", item.get("parameters"))
        if not isinstance(args, dict) or set(item) - {"name", "arguments", "parameters"}:
            return None
        calls.append({"name": item["name"], "arguments": args})
    return calls or None


def finish_reason(reason: str, stream: ToolCallStream | None) -> str:
    """OpenAI's ``"tool_calls"`` for an answer that ended (``"stop"``) after
    making a call; ``reason`` otherwise."""
    return "tool_calls" if reason == "stop" and stream is not None and stream.called else reason
