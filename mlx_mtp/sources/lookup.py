"""Prompt lookup (Saxena, 2023): continuations of the context's last n-gram
found earlier in the context, the training-free source of ``pld`` and
``hybrid``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ..context import Context


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


class PromptLookup:
    """The prompt-lookup source: continuations of the newest n-gram.

    Args:
        window: longest n-gram matched.
        matches: distinct continuations per step (the first is the most
            recent match of the longest n-gram).
    """

    def __init__(self, window: int = 3, matches: int = 1):
        self.window, self.matches = window, matches

    def candidates(self, ctx: Context, root: int, max_draft: int) -> list[list[int]]:
        """Up to ``matches`` continuations of up to ``max_draft`` tokens after
        ``root`` (the context: :meth:`Context.history
        <mlx_mtp.context.Context.history>`)."""
        if max_draft < 1 or self.matches < 1:
            return []
        context = np.array(ctx.history(root), dtype=np.int64)
        return lookup_candidates(context, self.window, max_draft, self.matches)
