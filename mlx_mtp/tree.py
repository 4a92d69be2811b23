"""Draft-tree construction from per-depth candidate distributions (pure functions).

ESP (Goel et al., arXiv 2603.17942, §3.2): mask slot i after the accepted node
predicts the token i+1 positions later. A candidate at depth d has cumulative
probability ``P(child) = P(parent) * p_d(token)``; the tree keeps the most
probable candidates within the node budget, and a child whose token equals its
parent's is pruned. Fixed templates (nodes per depth, e.g. K=[14] or [6, 3])
are the paper's alternative to the dynamic tree.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np


def build_tree(
    dists: Sequence[tuple[np.ndarray, np.ndarray]],
    budget: int,
    root_token: int,
    per_depth: Sequence[int] | None = None,
) -> tuple[list[int], list[int], list[float]]:
    """Grow a draft tree best-first by cumulative probability.

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
    depth_max = len(dists) if per_depth is None else min(len(dists), len(per_depth))
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    used = [0] * depth_max
    if budget <= 0 or depth_max == 0 or len(dists[0][0]) == 0:
        return tokens, parents, probs
    # heap entries: (-P, tiebreak, depth index, parent node, rank in dists[depth])
    heap: list[tuple[float, int, int, int, int]] = []
    counter = 0

    def push(p_parent: float, d: int, parent: int, rank: int) -> None:
        nonlocal counter
        toks, ps = dists[d]
        if rank < len(toks):
            heapq.heappush(heap, (-p_parent * float(ps[rank]), counter, d, parent, rank))
            counter += 1

    push(1.0, 0, -1, 0)
    while heap and len(tokens) < budget:
        negp, _, d, parent, rank = heapq.heappop(heap)
        p_parent = 1.0 if parent < 0 else probs[parent]
        push(p_parent, d, parent, rank + 1)  # next sibling
        if per_depth is not None and used[d] >= per_depth[d]:
            continue
        tok = int(dists[d][0][rank])
        parent_tok = root_token if parent < 0 else tokens[parent]
        if tok == parent_tok:
            continue
        tokens.append(tok)
        parents.append(parent)
        probs.append(-negp)
        used[d] += 1
        if d + 1 < depth_max:
            push(-negp, d + 1, len(tokens) - 1, 0)
    return tokens, parents, probs


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
