"""Pools of earlier predictions: candidates the model computed and threw away.

- :class:`PredictionPool` (``hybrid``'s ``pool`` source): the model's own
  target token after every verified slot of earlier passes, rejected branches
  included, keyed by the two tokens before it; a chain is drafted by
  following the table from the root (as lookahead decoding keeps its
  n-grams, Fu et al., 2024).
- :class:`NGramPool` (``lookahead``): n-grams harvested from Jacobi
  trajectories, keyed by their first token, most recent first (LADE §3).
"""

from __future__ import annotations

from collections import OrderedDict

from ..speculative import Draft, Verified

#: the extra time (a fraction of the pass without it) lookahead's Jacobi
#: branch may add to a pass when the method chooses its width itself
JACOBI_EXTRA = 0.10


class PredictionPool:
    """``(previous token, token) -> the model's target token after them``."""

    def __init__(self) -> None:
        self.table: dict[tuple[int, int], int] = {}

    def chain(self, prev: int, root: int, n: int) -> list[int]:
        """Up to ``n`` tokens after ``root`` (``prev`` is the token before it),
        following the table."""
        toks: list[int] = []
        a, b = prev, root
        while len(toks) < n and (a, b) in self.table:
            nxt = self.table[(a, b)]
            toks.append(nxt)
            a, b = b, nxt
        return toks

    def learn(self, draft: Draft, verified: Verified, prev: int) -> None:
        """Record the target token of every verified slot of ``draft``
        (``prev``: the token before its root)."""
        parents, tokens = draft.parent_slots(), draft.tokens
        for slot, t in enumerate(verified.targets.tolist()):
            p = int(parents[slot])
            before = prev if p < 0 else int(tokens[p])
            self.table[(before, int(tokens[slot]))] = int(t)


class NGramPool:
    """Candidate continuations keyed by their first token, most recent first.

    Args:
        per_key: how many distinct continuations to keep per key (LADE keeps G).
    """

    def __init__(self, per_key: int):
        self.per_key = per_key
        self._pool: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, key: int, continuation: tuple[int, ...]) -> None:
        """Insert (or refresh) one continuation; the oldest one per key drops out."""
        entries = self._pool.setdefault(key, OrderedDict())
        entries.pop(continuation, None)
        entries[continuation] = None
        while len(entries) > self.per_key:
            entries.popitem(last=False)

    def get(self, key: int, limit: int) -> list[tuple[int, ...]]:
        """Up to ``limit`` continuations of ``key``, most recent first."""
        entries = self._pool.get(key)
        if not entries:
            return []
        return list(reversed(entries))[:limit]

    def __len__(self) -> int:
        return sum(len(v) for v in self._pool.values())


def build_trie(candidates: list[tuple[int, ...]]) -> tuple[list[int], list[int]]:
    """Merge candidate chains (all starting after the root) into a trie.

    Returns:
        (node tokens, node parents), parents indexing the node list with -1
        for the root; parents come before children.
    """
    tokens, parents, _ = ranked_trie(candidates)
    return tokens, parents


def ranked_trie(
    candidates: list[tuple[int, ...]],
) -> tuple[list[int], list[int], list[int]]:
    """:func:`build_trie`, and for every node the index of the first
    candidate that passes through it (its rank).

    Returns:
        (node tokens, node parents, node ranks).
    """
    tokens: list[int] = []
    parents: list[int] = []
    ranks: list[int] = []
    index: dict[tuple[int, int], int] = {}
    for i, cand in enumerate(candidates):
        parent = -1
        for tok in cand:
            key = (parent, int(tok))
            if key not in index:
                index[key] = len(tokens)
                tokens.append(int(tok))
                parents.append(parent)
                ranks.append(i)
            parent = index[key]
    return tokens, parents, ranks
