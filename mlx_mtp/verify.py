"""Lossless verification of a draft tree (greedy and sampling).

Pure functions of the target logits and the tree: easy to test by hand. The
one place that runs them on a forward pass is
:func:`mlx_mtp.speculative.speculative_step`.

Greedy (ESP paper §3.3; Medusa/EAGLE tree verification): starting at the root,
follow the child whose token equals the argmax at its parent; the deepest
accepted node gives one bonus token (its own argmax).

Sampling at temperature > 0: at every visited node draw the target token from
the target model's processed distribution (same sampler as plain decoding) and
follow the child carrying that token if there is one. Each committed token is
then an exact draw from the target distribution given the committed prefix, so
the output distribution equals plain sampling (SpecInfer-style tree sampling
with deterministic drafts).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from .sampling import PositionalSampler, draw

#: greedy (None), an mlx-lm sampler ``f(logprobs)``, or a PositionalSampler
Sampler = Callable[..., mx.array]


def target_graph(
    logits: mx.array,
    rows: np.ndarray,
    sampler: Sampler | None,
    positions: np.ndarray | None = None,
) -> mx.array:
    """The (R,) uint32 mx array (not evaluated) of the target tokens:
    argmax, or one draw of ``sampler``, at each of ``rows`` of ``logits`` (N, V).

    ``positions`` (R,): the sequence position of the token drawn at each row,
    which keys a :class:`~mlx_mtp.sampling.PositionalSampler` (required for
    one; ignored by greedy decoding and by mlx-lm samplers)."""
    sel = logits[mx.array(rows)] if len(rows) != logits.shape[0] else logits
    if sampler is None:
        return mx.argmax(sel, axis=-1)
    if positions is None and isinstance(sampler, PositionalSampler):
        raise ValueError("a PositionalSampler needs the positions of the drawn tokens")
    sel = sel.astype(mx.float32)
    return draw(sampler, sel - mx.logsumexp(sel, axis=-1, keepdims=True), positions)


def walk_tree(
    parents: np.ndarray,
    slot_tokens: np.ndarray,
    targets: dict[int, int],
) -> tuple[list[int], int]:
    """Follow the tree from the root along children that match the target token.

    Args:
        parents: (N,) parent slot of each slot (-1 for the root, slot 0).
        slot_tokens: (N,) token id of each slot; -1 marks a mask slot, which is
            never accepted.
        targets: target token at each token slot that may be visited.

    Returns:
        (accepted path as slot indices, excluding the root; bonus token).
    """
    children: dict[int, dict[int, int]] = {}
    for i in range(1, len(parents)):
        tok = int(slot_tokens[i])
        if tok >= 0:
            children.setdefault(int(parents[i]), {}).setdefault(tok, i)
    cur, path = 0, []
    while True:
        nxt = children.get(cur, {}).get(targets[cur])
        if nxt is None:
            return path, targets[cur]
        path.append(nxt)
        cur = nxt


def top_tokens(rows: mx.array, k: int) -> mx.array:
    """The graph (not evaluated) of the ``k`` highest-scoring token ids of
    each row of ``rows`` (R, V) logits: (R, k) int, best first.

    Two-stage on vocabularies with a block size B in 16..128 that divides V:
    the maximum of every block of B ids, the k best blocks, then the k best
    of those k * B ids. Each of the k best ids lies in one of the k best
    blocks (a block outside them has k blocks above it, each holding an id at
    least as high), so the result is that of one full ``argpartition``, which
    on a CPU costs 4-10x as much for V = 49,152 or 151,936. Ties may come out
    in another order.
    """
    n, vocab = rows.shape
    k = min(max(k, 1), vocab)
    block = next((b for b in (64, 128, 32, 16) if vocab % b == 0 and vocab // b >= 4 * k), 0)
    ids = None
    if block:  # the k best blocks' ids: rows becomes (R, k * B)
        blocks = rows.reshape(n, vocab // block, block)
        best = mx.argpartition(-blocks.max(axis=-1), kth=k - 1, axis=-1)[:, :k]
        rows = mx.take_along_axis(blocks, best[..., None], axis=1).reshape(n, k * block)
        ids = (best[..., None] * block + mx.arange(block)).reshape(n, k * block)
    part = mx.argpartition(-rows, kth=k - 1, axis=-1)[:, :k]
    order = mx.argsort(-mx.take_along_axis(rows, part, axis=-1), axis=-1)
    top = mx.take_along_axis(part, order, axis=-1)
    return top if ids is None else mx.take_along_axis(ids, top, axis=-1)
