"""Log-probabilities of committed tokens, from the target model's logits.

A lossless step commits each token from the target model's logits at the
position before it: a one-token step (:class:`~mlx_mtp.plain.PlainSteps`)
from the row of its one pass, a verified draft step
(:func:`~mlx_mtp.speculative.speculative_step`) from the rows of the root
and of the accepted path. Where a generation asks for them
(:func:`~mlx_mtp.decoding.generate_steps` with ``logprobs``), those paths
hand the rows to the engine's :class:`LogprobRecorder`, which keeps each
committed token's log-probability under the log-softmax of its row and the
``top`` most likely tokens of that row. With no recorder (the default)
nothing is computed: no extra graph, no synchronisation.

The values are the model's own distribution (the logits before temperature,
top-p and the other sampling settings), as ``mlx_lm``'s ``logprobs`` are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

#: most alternatives a request may ask per token (OpenAI's chat bound)
MAX_TOP_LOGPROBS = 20


@dataclass
class TokenLogprob:
    """One committed token's log-probability under the target model.

    Attributes:
        token: the token id.
        logprob: its log-probability (natural log, float32 log-softmax).
        top: the ``top`` most likely ``(token id, logprob)`` of the same row,
            most likely first (empty when none were asked).
    """

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class LogprobRecorder:
    """Collects :class:`TokenLogprob` entries of a generation's committed tokens.

    Args:
        top: alternatives to keep per token (0: only the committed token's).
    """

    def __init__(self, top: int = 0):
        self.top = int(top)
        self.entries: list[TokenLogprob] = []

    def record(self, logits: mx.array, tokens: list[int]) -> None:
        """Record ``tokens`` committed from the rows of ``logits`` (R, V), one
        row per token in order (a (V,) array is one row). Evaluates the
        log-softmax of those rows (one synchronisation)."""
        if not tokens:
            return
        rows = logits.reshape(-1, logits.shape[-1])[: len(tokens)].astype(mx.float32)
        lp = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
        ids = mx.array(tokens, dtype=mx.int32)
        chosen = mx.take_along_axis(lp, ids[:, None], axis=-1)[:, 0]
        graphs = [chosen]
        k = min(self.top, lp.shape[-1])
        if k > 0:
            top_ids = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
            graphs += [top_ids, mx.take_along_axis(lp, top_ids, axis=-1)]
        mx.eval(*graphs)
        values = np.array(chosen).tolist()
        tops: list[list[tuple[int, float]]] = [[] for _ in tokens]
        if k > 0:
            t_ids, t_lp = np.array(graphs[1]), np.array(graphs[2])
            for r in range(len(tokens)):
                order = np.argsort(-t_lp[r], kind="stable")
                tops[r] = [(int(t_ids[r, j]), float(t_lp[r, j])) for j in order]
        self.entries += [
            TokenLogprob(int(t), float(v), top) for t, v, top in zip(tokens, values, tops)
        ]

    def take(self, n: int) -> list[TokenLogprob]:
        """The entries of a step's ``n`` committed tokens (a step cut at EOS or
        ``max_tokens`` drops the entries past its cut); the recorder is
        emptied for the next step."""
        out, self.entries = self.entries[:n], []
        return out
