"""``mtp``: draft with the checkpoint's own MTP layer, verify with the backbone.

Qwen3.5 / Qwen3.6 and Qwen3-Next checkpoints ship one multi-token-prediction
layer under ``mtp.*``, DeepSeek-V3 one ``nextn`` layer (see
:mod:`mlx_mtp.native_mtp`). Each step:

1. Catch up: feed the MTP layer the pairs ``(h_i, t_{i+1})`` of every position
   committed since the last draft (backbone hidden state at i from the verify
   or one-token passes, token i+1 committed there); the layer keeps its own KV
   cache over these positions. Its output at the last pair, through the
   backbone's LM head, is draft 1 (the token after the root).
2. Depth 2..k: re-feed the layer its own output with the token it drafted
   (``num_nextn_predict_layers`` = 1 checkpoints, as vLLM and SGLang do);
   these speculative entries are dropped from the layer's cache afterwards.
   The whole chain is built lazily and evaluated once.
3. Verify ``[root, d1..dk]`` in one causal backbone pass through the shared
   :func:`mlx_mtp.speculative.speculative_step` (greedy or sampling):
   lossless. On hybrid models the recurrent layers are rolled back to the
   accepted prefix (:mod:`mlx_mtp.recurrent`).

Drafts are the MTP layer's argmax at any temperature; the verifier draws the
target token at every position, so the output distribution is the backbone's.

``depth="auto"`` (the default): before drafting, the planner picks the chain
length n that maximises expected tokens per unit of time,
``(1 + sum_{d<=n} prod_{j<=d} q_j) / (c(1 + n) + n * draft_cost)``, with ``c``
the device's forward cost curve, ``q_d`` the acceptance rate at depth d
learned online and ``draft_cost`` one MTP draft (the layer's pass and the LM
head) relative to a one-token backbone forward. When no length pays, the
method runs pipelined one-token steps and probes now and then
(:mod:`mlx_mtp.planner`); the MTP layer still gets every committed position
(in one batch at the next draft), so its context has no gaps. The policy is
the expected-tokens-per-time objective of Leviathan et al. 2023, §3.4, with a
measured cost; it is not from the Qwen or DeepSeek reports.

:class:`~mlx_mtp.sources.native.NativeDrafter` keeps the MTP layer's context
and drafts a chain; ``hybrid`` uses it too (its ``mtp`` source).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..context import Context
from ..errors import InvalidArgumentError
from ..native_mtp import HIDDEN_STATES
from ..offers import Offer, PlainResult, chain_offer
from ..sources.native import NativeDrafter
from ..speculative import Draft, Verified
from ..verify import Sampler
from .base import DraftMethod, parse_int

#: the longest chain ``depth="auto"`` may draft (the layer is trained for depth
#: 1; re-fed beyond it, acceptance falls with depth)
AUTO_MAX_DEPTH = 8


class MTP(DraftMethod):
    """Native MTP-layer drafting (see module doc).

    Args:
        depth: drafts per step, 1..16 (the layer is trained for depth 1 and
            re-fed beyond it), or ``"auto"`` (default): per step the length
            that maximises expected tokens per unit of time under the
            device's forward cost curve, up to ``max_depth``, and one-token
            steps while no length pays (see module doc).
        hidden_state: ``"final-norm"`` (what the public runtimes feed) or
            ``"pre-norm"`` (the last decoder layer's output before the final
            norm).
        heads: a folder holding the ``mtp.*`` safetensors; default the model's
            own checkpoint folder.
        max_depth: the cap of ``depth="auto"`` (default 8).
        draft_cost: ``"auto"`` (default: :func:`draft_cost_of`, the MTP
            layer's and LM head's weight bytes over the backbone's) or a
            number >= 0: the time of one MTP draft in one-token forwards, as
            ``depth="auto"`` counts it.

    Attributes:
        depth_drafted, depth_accepted: (depth,) counts per draft depth since
            construction (acceptance per depth = accepted / drafted).
        lengths: drafts of every draft step of the last generation.

    Raises:
        InvalidArgumentError: bad depth, max_depth, draft_cost or hidden_state.
    """

    name = "mtp"
    lossless = True
    chain_shaped = True

    def __init__(
        self,
        depth: Any = "auto",
        hidden_state: str = "final-norm",
        heads: Any = None,
        max_depth: Any = AUTO_MAX_DEPTH,
        draft_cost: Any = "auto",
    ):
        self.auto = str(depth) == "auto"
        if self.auto:
            self.depth = parse_int("max_depth", max_depth, 1, 16)
        else:
            self.depth = parse_int("depth", depth, 1, 16)
        if hidden_state not in HIDDEN_STATES:
            raise InvalidArgumentError(
                f"option hidden_state must be one of {', '.join(HIDDEN_STATES)}, got "
                f"{hidden_state!r}"
            )
        self.fixed_draft_cost: float | None = None
        if str(draft_cost) != "auto":
            try:
                cost = float(draft_cost)
            except (TypeError, ValueError):
                cost = -1.0
            if not 0.0 <= cost < 1e6:
                raise InvalidArgumentError(
                    f"option draft_cost must be 'auto' or a number >= 0, got {draft_cost!r}"
                )
            self.fixed_draft_cost = cost
        self.hidden_state = hidden_state
        self.heads = heads
        self.drafter = NativeDrafter(hidden_state)
        self.depth_drafted = np.zeros(self.depth, dtype=np.int64)
        self.depth_accepted = np.zeros(self.depth, dtype=np.int64)
        self.lengths: list[int] = []

    @property
    def block_complexity(self) -> int:
        return self.depth + 1

    def describe(self) -> str:
        extra = "" if self.hidden_state == "final-norm" else f", hidden_state={self.hidden_state}"
        depth = f"auto<={self.depth}" if self.auto else str(self.depth)
        return f"mtp(depth={depth}{extra})"

    def prepare(self, ctx: Context) -> None:
        self.drafter.prepare(ctx, self.heads)
        if self.fixed_draft_cost is not None:
            self.drafter.draft_cost = self.fixed_draft_cost

    @property
    def layer(self) -> Any:
        """The loaded MTP layer."""
        return self.drafter.layer

    @property
    def draft_cost(self) -> float:
        """One MTP draft's time in one-token backbone forwards (``auto`` policy)."""
        return self.drafter.draft_cost

    def begin(self, ctx: Context, prompt: list[int], sampler: Sampler | None) -> None:
        super().begin(ctx, prompt, sampler)
        self.drafter.begin(ctx.engine, prompt)
        self.lengths = []

    def propose(self, ctx: Context, root: int) -> Offer:
        # the chain is valued before it is drafted: a draft costs the layer's pass
        offer = chain_offer(root, [0] * self.depth, "mtp", ctx.acceptance, hidden=True)
        chain = offer.build

        def build(n: int) -> Draft:
            drafts = self.drafter.draft(ctx.engine, n)
            self.lengths.append(len(drafts))
            d = chain(len(drafts))
            d.tokens[1:] = drafts
            return d

        offer.build, offer.item_cost = build, self.draft_cost
        return offer

    def observe(self, ctx: Context, draft: Draft | None, result: Verified | PlainResult) -> None:
        if draft is None:  # a one-token step: its position waits for the next draft
            self.drafter.plain(result.tokens, queued=result.queued)
            return
        a = len(result.path)
        self.depth_drafted[: draft.drafted] += 1
        self.depth_accepted[:a] += 1
        self.drafter.verified(result.hidden, result.tokens)

    def acceptance_per_depth(self) -> list[float]:
        """Share of drafts accepted at each depth 1..k (NaN where none was drafted)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return (self.depth_accepted / self.depth_drafted).tolist()
