"""Prompt lookup (Saxena, 2023): continuations of the context's last n-gram
found earlier in the context, the training-free source of ``pld`` and
``hybrid``."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from ..acceptance import Acceptance, chain_values
from ..pipeline import DeviceDrafter, DeviceState, Template

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
    out: list[list[int]] = []
    for e_n in reversed(_suffix_ends(context, window)):  # the longest n-gram with a match first
        for e in e_n[::-1]:  # most recent match first
            follow = context[e + 1 : e + 1 + max_draft].tolist()
            if follow not in out:
                out.append(follow)
                if len(out) >= limit:
                    return out
        if out:
            return out
    return out


def _suffix_ends(context: np.ndarray, window: int) -> list[np.ndarray]:
    """``ends[n - 1]``: the last positions ``e <= T - 2`` of the earlier
    n-grams of ``context`` equal to its suffix of length n, for n up to the
    longest with a match (one vectorised compare for n = 1, then each longer
    n-gram filters the shorter one's matches by one more token); [] where
    nothing matches."""
    T = len(context)
    if T < 2:
        return []
    ends = [np.flatnonzero(context[: T - 1] == context[T - 1])]
    if not len(ends[0]):
        return []
    for j in range(1, min(window, T - 1)):
        e = ends[-1]
        e = e[e >= j]
        e = e[context[e - j] == context[T - 1 - j]]
        if not len(e):
            break
        ends.append(e)
    return ends


def lookup_match(context: np.ndarray, window: int, max_draft: int) -> tuple[list[int], int]:
    """The first continuation :func:`lookup_candidates` returns and the
    length n of the n-gram it matched (``([], 0)``: no match): the signal
    of how likely its first token is right."""
    ends = _suffix_ends(context, window)
    if not ends:
        return [], 0
    e = int(ends[-1][-1])
    return context[e + 1 : e + 1 + max_draft].tolist(), len(ends)


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

    def match(self, ctx: Context, root: int, max_draft: int) -> tuple[list[int], int]:
        """The first continuation after ``root`` and the n-gram length it
        matched (:func:`lookup_match`)."""
        context = np.array(ctx.history(root), dtype=np.int64)
        return lookup_match(context, self.window, max_draft)


def device_lookup(history: mx.array, length: mx.array, window: int, width: int) -> mx.array:
    """:func:`lookup_candidates` (one continuation) as lazy array operations,
    for a pipelined step whose context the host has not read yet.

    Args:
        history: (C,) int32 token ids; the first ``length`` are the context.
        length: scalar int32, the context's length T (>= 1).
        window: longest n-gram matched.
        width: tokens to return.

    Returns:
        (width,) int32: the continuation of the most recent match of the
        longest suffix n-gram (n <= window), as :func:`lookup_candidates`
        returns it, then 0 where it ends (or everywhere without a match). A
        filler token is only a poor guess: verification decides what is kept.
    """
    C = history.shape[0]
    idx = mx.arange(C, dtype=mx.int32)
    T = length.astype(mx.int32)
    last = mx.take(history, mx.maximum(T - 1, 0))
    match = (history == last) & (idx <= T - 2)
    best = mx.max(mx.where(match, idx, -1))
    for j in range(1, window):
        want = mx.take(history, mx.maximum(T - 1 - j, 0))
        shifted = mx.concatenate([mx.full((j,), -1, dtype=history.dtype), history[: C - j]])
        match = match & (shifted == want) & (T - 1 - j >= 0)
        e = mx.max(mx.where(match, idx, -1))
        best = mx.where(e >= 0, e, best)
    pos = best + 1 + mx.arange(width, dtype=mx.int32)
    ok = (best >= 0) & (pos <= T - 1)
    return mx.where(ok, mx.take(history, mx.clip(pos, 0, C - 1)), 0)


def match_length(context: np.ndarray, window: int) -> int:
    """The length n (<= window) of the longest suffix n-gram of ``context``
    found earlier in it (0: the last token occurs nowhere before)."""
    T = len(context)
    if T < 2:
        return 0
    e = np.flatnonzero(context[: T - 1] == context[T - 1])
    n = 1 if len(e) else 0
    for j in range(1, min(window, T - 1)):
        e = e[e >= j]
        e = e[context[e - j] == context[T - 1 - j]]
        if not len(e):
            break
        n = j + 1
    return n


class SuffixIndex:
    """Where every n-gram (n <= ``window``) of a growing token list ends, so
    that the lookup after each new token costs a few dictionary reads
    instead of a scan of the whole context: :meth:`match` answers as
    :func:`lookup_match` does on any prefix of the tokens indexed.

    Args:
        window: longest n-gram indexed.
    """

    def __init__(self, window: int):
        self.window = window
        #: the tokens indexed so far
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}

    def extend(self, history: Sequence[int]) -> None:
        """Index ``history``'s tokens past those indexed (``history`` extends them)."""
        toks, ends = self.tokens, self._ends
        for i in range(len(toks), len(history)):
            toks.append(int(history[i]))
            for n in range(1, min(self.window, i + 1) + 1):
                ends.setdefault(tuple(toks[i - n + 1 : i + 1]), []).append(i)

    def match(self, r: int, max_draft: int) -> tuple[list[int], int]:
        """:func:`lookup_match` of the first ``r + 1`` tokens indexed: the
        continuation (at most ``max_draft`` tokens) after the most recent
        earlier end of the longest suffix n-gram, and n (``([], 0)``: no
        match)."""
        toks = self.tokens
        for n in range(min(self.window, r), 0, -1):
            ends = self._ends.get(tuple(toks[r - n + 1 : r + 1]))
            k = bisect_right(ends, r - 1) if ends else 0
            if k:
                e = ends[k - 1]
                return toks[e + 1 : min(e + 1 + max_draft, r + 1)], n
        return [], 0


class LookupDrafter(DeviceDrafter):
    """Prompt lookup on the device, for :mod:`mlx_mtp.pipeline`: each step's
    drafts are :func:`device_lookup` after the lazy root.

    Learning costs no device work: after every step the host runs the same
    lookup (:class:`SuffixIndex`, which answers as :func:`lookup_match` does,
    kept as the history grows) at each root read and scores its
    continuation against the tokens committed after it, exactly as
    verification would have scored it, whether or not the step drafted. The
    estimates are kept per *signal*: the n-gram length the lookup matched at
    the newest root the host knows, which is what a width is chosen from
    (source names ``pld/0`` .. ``pld/window``): the root of the step in
    flight, or with no step in flight (``fresh``) the root of the step
    about to launch, whose continuation then also caps the width.

    Args:
        window: longest n-gram matched.
        most: the longest continuation scored.
    """

    name = "pld"

    def __init__(self, window: int, most: int):
        super().__init__()
        self.window, self.most = window, most
        self.begin(None, [])

    def begin(self, ctx: Any, prompt: list[int]) -> None:
        self._index = SuffixIndex(self.window)
        self._restart()

    def resume(self, ctx: Any, history: list[int]) -> None:
        self._restart()  # the history only grew: the index stays

    def _restart(self) -> None:
        # (root position, continuation, signal when it was drafted) of lookups
        # whose outcome is not known yet; the last root looked up; the signal
        self._pending: list[tuple[int, list[int], int]] = []
        self._last = -1
        self._signal = (0, 0)

    def draft(self, state: DeviceState, tpl: Template, rows: int) -> mx.array:
        return device_lookup(state.history, state.at + 1, self.window, tpl.n - 1)

    def values(self, acceptance: Acceptance, most: int, signal: Any) -> list[float]:
        m, length = signal if signal else (0, most)
        if self.fresh:  # the lookup of the step to launch: no filler tokens
            most = min(most, length)
        return chain_values(acceptance.qs(f"{self.name}/{m}", most))

    def learn(
        self, acceptance: Acceptance, history: list[int], steps: list[Any]
    ) -> tuple[int, int]:
        index = self._index
        if len(history) < len(index.tokens):  # not the history indexed
            index = self._index = SuffixIndex(self.window)
        index.extend(history)
        T = len(history)
        # every root once: those of the steps read, and the newest (the root of
        # the step in flight); each continuation is tagged with the signal known
        # when its step's width was chosen (the match at the root before)
        for r in [*(s.start for s in steps), T - 1]:
            if r <= self._last:
                continue
            self._last = r
            cont, m = index.match(r, self.most)
            # tagged with the signal its width was chosen from: its own match
            # (fresh), or the match at the root before (the step in flight's)
            self._pending.append((r, cont, m if self.fresh else self._signal[0]))
            self._signal = (m, len(cont))
        keep = []
        for r, cont, sig in self._pending:
            known = history[r + 1 : r + 1 + max(len(cont), 1)]
            if not len(known):
                keep.append((r, cont, sig))
                continue
            est = acceptance.source(f"{self.name}/{sig}")
            m = 0
            while m < min(len(known), len(cont)) and known[m] == cont[m]:
                m += 1
            if not cont:  # no match: a filler draft, rejected
                est.record(1, 0)
            elif m < len(known) or len(known) == len(cont):
                est.record(len(cont), m)
            else:
                keep.append((r, cont, sig))
        self._pending = keep
        return self._signal
