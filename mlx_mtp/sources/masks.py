"""ESP's mask slots as a draft source (Goel et al., arXiv 2603.17942, §3.1-3.2).

Mask slots are vectors in the input-embedding space, not vocabulary tokens
(:class:`MaskVectors`). The k masks after a draft node predict the tokens 1..k
positions after it; their most probable tokens, per depth
(:func:`mask_candidates`), are the candidates the next draft tree grows from.
Used by ``probe`` (the paper's tree) and ``hybrid`` (one source among others).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from ..engine import Engine
from ..errors import InvalidArgumentError
from ..learned_masks import load_learned_masks


def mask_candidates(rows: mx.array, m: int, engine: Engine) -> list[tuple[np.ndarray, np.ndarray]]:
    """The ``m`` most probable tokens of each mask row, best first: the
    per-depth candidate lists that :func:`~mlx_mtp.tree.build_tree` grows the
    next draft tree from (ESP §3.2).

    Args:
        rows: (k, V) float32 logits of the k mask slots after the deepest
            accepted node.
        m: candidates per row (clipped to [1, V]).
        engine: the top-k runs through ``engine.timed_eval`` (device time).

    Returns:
        k pairs (tokens (m,) int, probabilities (m,) float32), probabilities
        descending.
    """
    top, top_p = top_candidates(rows, m)
    engine.timed_eval(top, top_p)  # vocabulary-wide top-k on k rows: device work
    return candidate_lists(top, top_p)


def top_candidates(rows: mx.array, m: int) -> tuple[mx.array, mx.array]:
    """The graph (not evaluated) behind :func:`mask_candidates`: token ids
    (k, m) and their probabilities (k, m) float32 of the ``m`` most probable
    tokens of each row of ``rows`` (k, V), in no particular order."""
    vocab = rows.shape[-1]
    m = min(max(m, 1), vocab)
    rows = rows.astype(mx.float32)
    top = mx.argpartition(rows, kth=vocab - m, axis=-1)[:, vocab - m :]
    top_p = mx.exp(
        mx.take_along_axis(rows, top, axis=-1) - mx.logsumexp(rows, axis=-1, keepdims=True)
    )
    return top, top_p


def candidate_lists(top: mx.array, top_p: mx.array) -> list[tuple[np.ndarray, np.ndarray]]:
    """Evaluated :func:`top_candidates` output -> per-row (tokens, probabilities)
    sorted by probability descending."""
    out = []
    for toks, ps in zip(np.array(top), np.array(top_p)):
        order = np.argsort(-ps, kind="stable")
        out.append((toks[order], ps[order]))
    return out


class MaskVectors:
    """ESP's mask slots (§3.1): ``slots`` vectors in the input-embedding space
    that stand for "some token to come" after a draft node.

    ``init="mean"`` (the paper): every slot starts as the mean embedding of
    the prompt and moves towards each committed token ``e``:
    ``m <- m + lam * (e - m)``. ``init="learned"``: fixed per-slot vectors
    trained by ``mlx-mtp train masks`` for this model
    (:mod:`mlx_mtp.learned_masks`), never updated. Shared by ``probe`` and
    ``hybrid``.

    Args:
        slots: mask slots after a node (k).
        lam: update step in [0, 1] (0.1 in the paper).
        init: ``"mean"`` or ``"learned"``.

    Raises:
        InvalidArgumentError: lam not a number in [0, 1], unknown init.
    """

    def __init__(self, slots: int, lam: Any = 0.1, init: str = "mean"):
        try:
            self.lam = float(lam)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"option lam must be a number, got {lam!r}") from None
        if not 0.0 <= self.lam <= 1.0:
            raise InvalidArgumentError(f"option lam must be in [0, 1], got {self.lam}")
        if init not in ("mean", "learned"):
            raise InvalidArgumentError(f"mask_init must be 'mean' or 'learned', got {init!r}")
        self.slots = slots
        self.init = init
        #: (slots, D) learned vectors once :meth:`prepare` loaded them
        self.learned: mx.array | None = None
        #: (slots, D) current vectors, set by :meth:`begin`
        self.embedding: mx.array | None = None

    def prepare(self, engine: Engine) -> None:
        """Load the learned vectors for this model (``init="learned"``).

        Raises:
            CheckpointMismatchError, ModelNotFoundError: see
                :func:`~mlx_mtp.learned_masks.load_learned_masks`.
            InvalidArgumentError: the file has fewer slots than needed.
        """
        if self.init != "learned":
            return

        learned = load_learned_masks(engine.model)  # (slots, D), checked for this model
        if learned.shape[0] < self.slots:
            raise InvalidArgumentError(
                f"the learned mask file has {learned.shape[0]} slot(s); --masks "
                f"{self.slots} needs {self.slots}. Retrain with more slots."
            )
        self.learned = learned[: self.slots]

    def begin(self, engine: Engine, prompt: list[int]) -> None:
        """Start a generation: learned vectors, or the prompt's mean embedding."""
        if self.learned is not None:
            self.embedding = self.learned
        else:
            mean = mx.mean(engine.embed_tokens(prompt), axis=0)
            self.embedding = mx.broadcast_to(mean, (self.slots, mean.shape[0]))

    def update(self, engine: Engine, tokens: list[int]) -> None:
        """``m <- m + lam (e - m)`` once per committed token, in order (mean
        init only; learned vectors stay fixed)."""
        if self.learned is not None:
            return
        e = engine.embed_tokens(tokens)  # (n, D)
        m, n, lam = self.embedding, len(tokens), self.lam
        if n == 1:
            self.embedding = m + lam * (e - m)
        else:  # the n updates in closed form: (1-lam)^n m + sum_i lam (1-lam)^(n-1-i) e_i
            w = mx.array([lam * (1 - lam) ** (n - 1 - i) for i in range(n)], dtype=e.dtype)
            self.embedding = (1 - lam) ** n * m + (w @ e)

    def sets(self, count: int, dtype: mx.Dtype) -> mx.array:
        """``count`` mask sets, one after another: (count * slots, D)."""
        return mx.tile(self.embedding.astype(dtype), (count, 1))
