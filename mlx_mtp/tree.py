"""Draft-tree sizes and layouts (pure functions): block complexity, the most
probable path first. Trees are grown best first by
:class:`~mlx_mtp.allocate.Allocator` (ESP's tree: :func:`~mlx_mtp.allocate.build_tree`).
"""

from __future__ import annotations

from collections.abc import Sequence


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
