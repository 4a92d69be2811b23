"""What the worker tells a request's handler: one small dataclass per event.

The worker thread calls ``Job.emit(event)`` with these, in this order:
:class:`Taken` (the worker took the job off the queue), then either
:class:`Cancelled` (the client left while it waited) or :class:`Failed`
(refused before generating), or :class:`Started`, any number of
:class:`Delta`, and :class:`Done` (or :class:`Failed` if generation broke).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from .protocol import OpenAIError


@dataclass(frozen=True)
class Taken:
    """The worker took the job off the queue (its queue wait is over)."""


@dataclass(frozen=True)
class Started:
    """Generation is running: the prompt is prefilled and the first step done."""


@dataclass(frozen=True)
class Delta:
    """New answer text, already cut at stop strings; ``logprobs``: where the
    request asked for them, one entry (OpenAI's chat shape, see
    :func:`~.replies.logprob_entries`) per token the text came from."""

    text: str
    logprobs: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class Done:
    """The end of a generation.

    Attributes:
        finish_reason: ``"stop"``, ``"length"`` or ``"cancelled"``.
        usage: the OpenAI ``usage`` object.
        mtp: the ``mtp`` statistics object (see :func:`~.replies.mtp_stats`).
    """

    finish_reason: str
    usage: dict[str, Any]
    mtp: dict[str, Any]


@dataclass(frozen=True)
class Failed:
    """The request failed, before or during generation."""

    error: OpenAIError


@dataclass(frozen=True)
class Cancelled:
    """The client left while the job was queued; nothing ran."""


Event = Union[Taken, Started, Delta, Done, Failed, Cancelled]  # noqa: UP007 (py3.10)
