"""``pld``: prompt-lookup decoding (Saxena, 2023), a training-free n-gram baseline.

Match the last n tokens (n = window down to 1) against the earlier context and
propose up to ``max_draft`` tokens that followed the most recent match; verify
them as one chain in a single forward pass (lossless).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..engine import Engine
from .base import ChainDraftMethod, parse_int


def lookup_candidates(
    context: np.ndarray, window: int, max_draft: int, limit: int = 1
) -> list[list[int]]:
    """Continuations of the longest suffix n-gram (n <= window) found earlier in
    ``context``, most recent match first, at most ``limit`` distinct ones.

    Args:
        context: (T,) int token ids (prompt + generated, last one included).
        window: longest n-gram to match.
        max_draft: tokens per continuation.
        limit: how many distinct continuations to return.
    """
    T = len(context)
    out: list[list[int]] = []
    if T < 2:
        return out
    # ends[n - 1]: last positions e <= T - 2 of the earlier n-grams equal to the
    # suffix of length n (one vectorised compare for n = 1, then each longer
    # n-gram filters the shorter one's matches by one more token)
    ends = [np.flatnonzero(context[: T - 1] == context[T - 1])]
    for j in range(1, min(window, T - 1)):
        e = ends[-1]
        e = e[e >= j]
        e = e[context[e - j] == context[T - 1 - j]]
        if not len(e):
            break
        ends.append(e)
    for e_n in reversed(ends):  # the longest n-gram with a match first
        for e in e_n[::-1]:  # most recent match first
            follow = context[e + 1 : e + 1 + max_draft].tolist()
            if follow not in out:
                out.append(follow)
                if len(out) >= limit:
                    return out
        if out:
            return out
    return out


class PLD(ChainDraftMethod):
    """Prompt lookup: n-gram window ``window`` (3), up to ``max_draft`` tokens.

    Args:
        window: longest n-gram matched (3).
        max_draft: draft tokens per step: an integer (Saxena's setting is 10),
            or ``"auto"`` (default): the match is cut per step at the length
            that maximises expected tokens per unit of time under this
            device's forward cost curve, up to ``AUTO_MAX_DRAFT``, and nothing
            is drafted while no length pays (:mod:`mlx_mtp.budget`).

    Raises:
        InvalidArgumentError: a window or max_draft below 1.
    """

    name = "pld"
    lossless = True
    #: the longest chain ``max_draft="auto"`` may verify
    AUTO_MAX_DRAFT = 24

    def __init__(self, window: Any = 3, max_draft: Any = "auto"):
        self.window = parse_int("window", window, 1)
        self.auto = str(max_draft) == "auto"
        self.max_draft = self.AUTO_MAX_DRAFT if self.auto else parse_int("max_draft", max_draft, 1)

    @property
    def block_complexity(self) -> int:
        return 1 + self.max_draft

    def describe(self) -> str:
        md = f"auto<={self.max_draft}" if self.auto else str(self.max_draft)
        return f"pld(window={self.window}, max_draft={md})"

    def draft(self, engine: Engine, root: int) -> list[int]:
        context = np.array([*engine.cached, root], dtype=np.int64)
        cands = lookup_candidates(context, self.window, self.max_draft)
        return cands[0] if cands else []
