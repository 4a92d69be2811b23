"""One draft tree from several candidate sources: the trie merge and the allocator.

Pure functions and small classes (no model), used by ``hybrid`` and by any
method that combines sources. Read top to bottom:

1. Candidates: chains (source, tokens, per-depth conditional acceptance
   estimates q) and, from ESP's mask slots, per-depth candidate lists whose
   every depth-d token may hang under every depth-(d-1) node (as in ESP's
   tree, Goel et al., arXiv 2603.17942, §3.2).
2. :func:`merge_chains`: chains become a trie; where sources propose the same
   token at the same place they are merged, same source -> max, different
   sources -> noisy-or ``1 - prod(1 - q)``. :class:`CandidateChildren` adds
   the mask candidates (scaled per depth) to every node.
3. :class:`Allocator`: spends a slot budget best-first by value per slot. A
   node's value is its path acceptance estimate (the product of q along the
   path, so parents come before children); a mask set (k slots) after an
   anchor is worth ``P(path) * (1 - sum q of its candidate children) *
   gain``, the chance that this anchor ends up the deepest accepted node (the
   only case where its masks are read) times the tokens the masks' drafts add.
   It yields :class:`~mlx_mtp.offers.Item` s one at a time, so the planner
   can stop when no longer prefix can pay; :meth:`Allocator.remaining` bounds
   what it has not produced yet.

Not from a paper: a best-first allocation over merged candidate sources in
the spirit of SpecInfer's token-tree merge (Miao et al., 2024) and EAGLE-2's
dynamic tree (Li et al., 2024).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .acceptance import Tag
from .offers import Item
from .tree import heavy_path_order, reorder_tree


@dataclass
class Child:
    """A candidate child of a tree node: token, conditional acceptance estimate
    q in [0, 1], and the sources that proposed it."""

    token: int
    q: float
    sources: list[Tag] = field(default_factory=list)


@dataclass
class Allocation:
    """A draft tree chosen within a slot budget.

    ``tokens``/``parents``/``probs``/``sources`` describe nodes in selection
    order (parents index earlier nodes, -1 = root; probs = path acceptance
    estimates). ``mask_anchors`` are slot indices (0 = root, node i -> i + 1)
    that get a mask set, in selection order.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    sources: list[list[Tag]] = field(default_factory=list)
    mask_anchors: list[int] = field(default_factory=list)
    #: every item in selection order: (is a mask set, value, slots)
    order: list[tuple[bool, float, int]] = field(default_factory=list)

    def prefix(self, n: int) -> Allocation:
        """The allocation of the first ``n`` selected items (a valid tree:
        parents and anchors are always selected before what hangs off them)."""
        items = self.order[:n]
        nodes = sum(1 for m, _, _ in items if not m)
        masks = sum(1 for m, _, _ in items if m)
        return Allocation(
            self.tokens[:nodes],
            self.parents[:nodes],
            self.probs[:nodes],
            self.sources[:nodes],
            self.mask_anchors[:masks],
            items,
        )

    def heavy_first(self) -> Allocation:
        """The same tree with its nodes laid out most probable path first
        (:func:`~mlx_mtp.tree.heavy_path_order`), mask anchors renumbered: an
        accepted most-probable branch is then a prefix of the pass, which the
        cache keeps by trimming alone."""
        order = heavy_path_order(self.parents, self.probs)
        pos = {old + 1: new + 1 for new, old in enumerate(order)}
        pos[0] = 0
        return Allocation(
            [self.tokens[i] for i in order],
            reorder_tree(order, self.parents),
            [self.probs[i] for i in order],
            [self.sources[i] for i in order],
            [pos[a] for a in self.mask_anchors],
            self.order,
        )

    def slots(self, masks: int) -> int:
        """Slots of the forward pass: root + nodes + mask slots."""
        return 1 + len(self.tokens) + masks * len(self.mask_anchors)


def combine(qs_by_source: dict[str, float]) -> float:
    """Noisy-or over sources: ``1 - prod(1 - q)``."""
    out = 1.0
    for q in qs_by_source.values():
        out *= 1.0 - min(max(q, 0.0), 1.0)
    return 1.0 - out


def merge_chains(
    chains: Sequence[tuple[Any, ...]],
) -> dict[tuple[int, ...], dict[int, Child]]:
    """Merge candidate chains into a trie: path (tokens below the root) ->
    {token: Child}.

    Args:
        chains: (source name, tokens, per-depth conditional q[, raw scores])
            tuples; q[d] is the estimate for tokens[d] given tokens[:d]
            accepted; the raw scores (default 1: a token guess) go into the
            nodes' tags, for the source's calibration (a draft model's
            probabilities).

    Returns:
        The trie. Where chains agree on a prefix they share nodes; a token
        proposed by several chains gets q = noisy-or over sources of the max q
        per source, and every proposing source is recorded.
    """
    per: dict[tuple[int, ...], dict[int, dict[str, float]]] = {}
    srcs: dict[tuple[int, ...], dict[int, list[Tag]]] = {}
    for name, toks, qs, *more in chains:
        raws = more[0] if more else [1.0] * len(toks)
        path: tuple[int, ...] = ()
        for d, (t, q, r) in enumerate(zip(toks, qs, raws)):
            t, q = int(t), float(q)
            slot = per.setdefault(path, {}).setdefault(t, {})
            slot[name] = max(slot.get(name, 0.0), q)
            lst = srcs.setdefault(path, {}).setdefault(t, [])
            if all(s[0] != name for s in lst):
                lst.append((name, d + 1, float(r)))
            path += (t,)
    return {
        path: {t: Child(t, combine(by_src), srcs[path][t]) for t, by_src in kids.items()}
        for path, kids in per.items()
    }


class CandidateChildren:
    """The children of every node of one draft step: chain children from the
    trie plus the mask candidates of the node's depth (merged by noisy-or),
    most probable first. The mask levels are read into :class:`Child` lists
    once, shared by every node without chain children at that depth.

    Args:
        trie: chain candidates (:func:`merge_chains`).
        levels: per depth, (tokens (m,) int, mask probabilities (m,)).
        scale: per depth, calibration factor for mask probabilities.
        source: the tag of the mask candidates.
        by_token: ``f(parent token)`` -> more children of every node whose
            token that is (token recycling's table), merged by noisy-or too.

    Calling it with ``(path, parent_token)`` returns the children of that node
    (mask candidates repeating the parent's token are pruned, as in ESP); the
    returned :class:`Child` objects must not be changed.
    """

    def __init__(
        self,
        trie: dict[tuple[int, ...], dict[int, Child]],
        levels: Sequence[tuple[np.ndarray, np.ndarray]] = (),
        scale: Sequence[float] = (),
        source: str = "probe",
        by_token: Callable[[int], list[Child]] | None = None,
    ):
        self.trie, self.by_token = trie, by_token
        self.levels: list[list[Child]] = []
        for d, (toks, ps) in enumerate(levels):
            f = scale[d] if d < len(scale) else 1.0
            row = []
            for t, p in zip(toks.tolist(), ps.tolist()):
                q = min(f * p, 1.0)
                if q > 0.0:
                    row.append(Child(t, q, [(source, d + 1, p)]))
            row.sort(key=lambda c: -c.q)  # stable: ties keep the level's order
            self.levels.append(row)

    def __call__(self, path: tuple[int, ...], parent_token: int) -> list[Child]:
        d = len(path)
        probe = self.levels[d] if d < len(self.levels) else []
        chain = self.trie.get(path)
        more = self.by_token(parent_token) if self.by_token is not None else []
        if not chain and not more:
            return [c for c in probe if c.token != parent_token]
        # copies of the chain and by-token children take the merges; a mask
        # candidate no other source proposes goes in as it is (shared)
        kids = {t: Child(c.token, c.q, list(c.sources)) for t, c in (chain or {}).items()}
        for c in more:
            k = kids.get(c.token)
            if k is None:
                kids[c.token] = Child(c.token, c.q, list(c.sources))
            else:
                k.q = 1.0 - (1.0 - k.q) * (1.0 - c.q)
                k.sources += c.sources
        for c in probe:
            if c.token == parent_token:
                continue
            k = kids.get(c.token)
            if k is None:
                kids[c.token] = c
            else:
                k.q = 1.0 - (1.0 - k.q) * (1.0 - c.q)
                k.sources.append(c.sources[0])
        return sorted(kids.values(), key=lambda c: -c.q)


class Allocator:
    """Best-first allocation of ``budget`` slots (root included), produced
    one item at a time (iterate it; the items taken build :attr:`alloc`).

    Items: a node (1 slot, value = its path acceptance estimate) and, for the
    root and every chosen node, a mask set (``masks`` slots, value = path
    estimate * max(0, 1 - sum of its candidates' q) * ``mask_gain``). Children
    are offered only once their parent is chosen, so parents come first.

    Args:
        children: ``(path, token of the node at path) -> candidate children``,
            most probable first (q descending, as :class:`CandidateChildren`).
        root_token: the root's token.
        budget: BC, total slots of the forward pass (>= 1).
        masks: mask slots per mask set (0 = never attach masks).
        mask_gain: expected tokens the masks' drafts add next step.
        per_depth: optional template: at most ``per_depth[d]`` nodes at depth
            d+1 (ESP's fixed trees, e.g. ``[6, 3]``); a candidate at a full
            depth is passed over for its next sibling.
    """

    def __init__(
        self,
        children: Callable[[tuple[int, ...], int], list[Child]],
        root_token: int,
        budget: int,
        masks: int,
        mask_gain: float,
        per_depth: Sequence[int] | None = None,
    ):
        self.children, self.root_token, self.budget = children, root_token, budget
        self.masks, self.mask_gain = masks, mask_gain
        self.room = None if per_depth is None else list(per_depth)
        self.alloc = Allocation()
        # (-value per slot, (offer number, rank), item): a node's children are
        # pushed one at a time, the next sibling when one is popped (they come
        # best first), and the (offer, rank) tie-break pops them in the order of
        # pushing them all
        self.heap: list[tuple[float, tuple[int, int], Any]] = []
        self.offers = 0
        self.paths: list[tuple[int, ...]] = [()]  # by slot index
        # per slot, no item not taken yet is worth more than the heap's top
        # times this (children are worth at most their parent; a mask set
        # gain / masks of it)
        self.lift = max(1.0, mask_gain / masks if masks else 0.0)
        self._offer(0, 1.0)

    def _offer(self, slot: int, prob: float) -> None:
        path = self.paths[slot]
        tok = self.root_token if slot == 0 else self.alloc.tokens[slot - 1]
        kids = self.children(path, tok)
        if kids:
            item = ("node", slot, kids, 0, prob)
            heapq.heappush(self.heap, (-prob * kids[0].q, (self.offers, 0), item))
        if self.masks > 0 and self.mask_gain > 0:
            stay = max(0.0, 1.0 - sum(c.q for c in kids))
            value = prob * stay * self.mask_gain
            if value > 0:
                rank = (self.offers, len(kids))
                heapq.heappush(self.heap, (-value / self.masks, rank, ("masks", slot)))
        self.offers += 1

    def remaining(self, scale: float = 1.0) -> float:
        """An upper bound on the value per slot of any item not produced yet,
        node values times ``scale``."""
        if not self.heap:
            return 0.0
        return -self.heap[0][0] * max(scale, self.lift)

    def __iter__(self) -> Iterator[Item]:
        out, heap, masks = self.alloc, self.heap, self.masks
        left = self.budget - 1
        while heap and left > 0:
            neg, (seq, rank), item = heap[0]
            if item[0] == "masks":
                heapq.heappop(heap)
                if masks <= left:
                    out.mask_anchors.append(item[1])
                    out.order.append((True, -neg * masks, masks))
                    left -= masks
                    yield Item(-neg * masks, masks, node=False)
                continue
            _, parent_slot, kids, i, parent_prob = item
            c, prob = kids[i], -neg
            if i + 1 < len(kids):  # the next sibling takes this one's place
                nxt = ("node", parent_slot, kids, i + 1, parent_prob)
                heapq.heapreplace(heap, (-parent_prob * kids[i + 1].q, (seq, i + 1), nxt))
            else:
                heapq.heappop(heap)
            if prob <= 0.0:
                continue
            depth = len(self.paths[parent_slot])
            if self.room is not None:
                if depth >= len(self.room) or self.room[depth] <= 0:
                    continue
                self.room[depth] -= 1
            out.tokens.append(c.token)
            out.parents.append(parent_slot - 1)
            out.probs.append(prob)
            out.sources.append(c.sources)
            out.order.append((False, prob, 1))
            self.paths.append(self.paths[parent_slot] + (c.token,))
            left -= 1
            # the new node's children are offered before the planner asks for
            # the bound on what is left
            self._offer(len(out.tokens), prob)
            yield Item(prob, 1)


def allocate(
    children: Callable[[tuple[int, ...], int], list[Child]],
    root_token: int,
    budget: int,
    masks: int,
    mask_gain: float,
    per_depth: Sequence[int] | None = None,
) -> Allocation:
    """The whole allocation of an :class:`Allocator` (a fixed BC)."""
    a = Allocator(children, root_token, budget, masks, mask_gain, per_depth)
    for _ in a:
        pass
    return a.alloc


def build_tree(
    dists: Sequence[tuple[np.ndarray, np.ndarray]],
    budget: int,
    root_token: int,
    per_depth: Sequence[int] | None = None,
) -> tuple[list[int], list[int], list[float]]:
    """ESP's draft tree (Goel et al., arXiv 2603.17942, §3.2): best first by
    cumulative probability ``P(child) = P(parent) * p_d(token)`` from one
    candidate list per depth, every depth-d candidate under every
    depth-(d-1) node, a child repeating its parent's token pruned; the
    :class:`Allocator` with the lists as its only source and no mask sets.

    Args:
        dists: one (tokens, probs) pair per depth, each sorted by probability
            descending (tokens int, probs float, same length).
        budget: maximum number of nodes (root excluded).
        root_token: the root's token (children repeating it are pruned).
        per_depth: optional template: at most ``per_depth[d]`` nodes at depth
            d+1 (tree depth is ``len(per_depth)``).

    Returns:
        (node tokens, node parents, node cumulative probabilities); parents
        index into the node list, -1 meaning the root; parents come first.
    """
    if budget <= 0 or not dists:
        return [], [], []
    a = allocate(CandidateChildren({}, dists), root_token, budget + 1, 0, 0.0, per_depth)
    return a.tokens, a.parents, a.probs
