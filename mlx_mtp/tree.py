"""Draft-tree sizes and layouts (pure functions): block complexity, the most
probable path first, the best-first tree of rank paths (:func:`rank_tree`).
Trees of scored items are grown best first by
:class:`~mlx_mtp.allocate.Allocator` (ESP's tree: :func:`~mlx_mtp.allocate.build_tree`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence


def block_complexity(masks: int, nodes: int) -> int:
    """BC = (k + 1) * (1 + sum K_i): tokens per forward with k masks per node."""
    return (masks + 1) * (1 + nodes)


def heavy_path_order(parents: Sequence[int], probs: Sequence[float]) -> list[int]:
    """A slot layout of a draft tree in which the most probable path comes first.

    The tree's nodes in depth-first preorder, the children of every node
    visited by probability descending (ties: original order). The most
    probable child of the root is then node 0, its most probable child node
    1, and so on: when verification accepts the most probable branch (the
    common case), the accepted slots are a prefix of the pass and
    :meth:`~mlx_mtp.engine.Engine.keep` only trims the cache instead of
    gathering and moving KV rows in every layer (host time, issue 22). The
    tree and its verification are the same in any layout.

    Args:
        parents: (N,) parent node of each node (-1 = the root), parents first.
        probs: (N,) a score per node (path probability or acceptance estimate).

    Returns:
        ``order``: the old index of the node at each new position, a
        permutation of ``range(N)`` in which parents still come first.
    """
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]  # slot 0: the root
    for i, p in enumerate(parents):
        kids[int(p) + 1].append(i)
    order: list[int] = []
    stack = sorted(kids[0], key=lambda i: (probs[i], -i))  # popped best first
    while stack:
        i = stack.pop()
        order.append(i)
        if kids[i + 1]:
            stack.extend(sorted(kids[i + 1], key=lambda j: (probs[j], -j)))
    return order


def reorder_tree(order: Sequence[int], parents: Sequence[int]) -> list[int]:
    """The parents of the nodes laid out as ``order`` (see :func:`heavy_path_order`):
    ``new_parents[k]`` is the new position of node ``order[k]``'s parent (-1: root)."""
    pos = {old: new for new, old in enumerate(order)}
    return [-1 if parents[o] < 0 else pos[int(parents[o])] for o in order]


def rank_tree(
    estimates: Callable[[int], Sequence[float]], most: int, deepest: int | None = None
) -> tuple[list[int], list[int], list[float]]:
    """The best-first draft tree of rank paths: a node at depth d of rank r
    is worth its parent's value times ``estimates(d)[r]`` (the root's value
    is 1), and the ``most`` most valuable nodes are taken, each after its
    parent (the shape of token recycling's and of ESP's mask-candidate
    trees on the pipelined step: Luo et al. 2024 §3; Goel et al. §3.2).

    A node's children enter the heap one at a time, best first (the next
    sibling once one is taken), so the host time is O(most log most)
    whatever the number of ranks.

    Args:
        estimates: depth (1-based) -> the acceptance estimate of each rank.
        most: nodes to take at most.
        deepest: the deepest depth (None: no limit).

    Returns:
        ``(parents, ranks, values)``: per slot, the root first, its parent
        slot (-1 for the root) and rank (0 for the root); per node (slot 1
        on), its value, non-increasing.
    """
    orders: dict[int, tuple[list[int], Sequence[float]]] = {}

    def order(d: int) -> tuple[list[int], Sequence[float]]:
        got = orders.get(d)
        if got is None:
            q = estimates(d)
            got = orders[d] = (sorted(range(len(q)), key=lambda r: -q[r]), q)
        return got

    parents, ranks, depths, worth, values = [-1], [0], [0], [1.0], []
    best, q1 = order(1)
    heap = [(-q1[best[0]], 0, 0)] if best and most > 0 else []  # (-value, parent, i)
    while heap and len(values) < most:
        v, parent, i = heapq.heappop(heap)
        d = depths[parent] + 1
        ranks_d, q = order(d)
        slot = len(parents)
        parents.append(parent)
        ranks.append(ranks_d[i])
        depths.append(d)
        worth.append(-v)
        values.append(-v)
        if i + 1 < len(ranks_d):  # the next sibling
            heapq.heappush(heap, (-worth[parent] * q[ranks_d[i + 1]], parent, i + 1))
        if deepest is None or d < deepest:  # the best child
            child, qc = order(d + 1)
            if child:
                heapq.heappush(heap, (v * qc[child[0]], slot, 0))
    return parents, ranks, values
