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
"""

from __future__ import annotations

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
        #: whether the answer has made at least one call
        self.called = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """Add a piece of the answer; return the content that can be sent now
        and the calls that ended in it (formatted)."""
        from mlx_lm.generate import TextStateMachine

        self._state, segments = TextStateMachine.split(self._state, text)
        return self._take(segments)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The end of the answer: the text held back, and a call still open
        (its end marker never came: parsed if it can be)."""
        from mlx_lm.generate import TextStateMachine

        self._state, held, state = TextStateMachine.flush(self._state)
        content, calls = self._take([(state, held)])
        if self._call.strip():
            calls += self._parse([self._call])
        self._call = ""
        return content, calls

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


def finish_reason(reason: str, stream: ToolCallStream | None) -> str:
    """OpenAI's ``"tool_calls"`` for an answer that ended (``"stop"``) after
    making a call; ``reason`` otherwise."""
    return "tool_calls" if reason == "stop" and stream is not None and stream.called else reason
