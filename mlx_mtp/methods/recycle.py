"""``recycle``: token recycling (Luo et al., 2024, arXiv 2408.08696), lossless.

The draft tree grows from the root through the table of the model's own
top-k predictions after every token (:mod:`mlx_mtp.sources.recycle`), best
first by each candidate's value (its path's product of per-rank acceptance
estimates, learned online); one target pass verifies it, and the top-k of
every slot of that pass (and of every plain step) refills the table. With
``bc="auto"`` the planner cuts the tree where expected tokens per unit of
forward time peak on this device, and runs plain steps while no tree pays
(:mod:`mlx_mtp.planner`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from ..acceptance import AcceptanceModel, CalibrationModel
from ..allocate import Allocator
from ..context import Context
from ..offers import Offer, PlainResult
from ..sources.recycle import (
    DEEP,
    DEEP_PRIORS,
    RANK_PRIORS,
    SOURCE,
    RecycleDrafter,
    RecycleTable,
)
from ..speculative import Draft, Verified
from .base import SourceMethod, parse_bc, parse_int


class Recycle(SourceMethod):
    """Token recycling (see the module doc).

    Args:
        bc: block complexity = slots per forward pass (root + drafts), or
            ``"auto"`` (default): up to ``max_bc`` slots, cut per step under
            the device's cost curve.
        max_bc: the cap of ``bc="auto"`` (default 64).
        k: candidates kept per token in the table (default 8, the paper's).
        reset: when the table starts afresh: ``"never"`` (default: kept
            across generations), ``"conversation"`` (a prompt that does not
            continue the previous one) or ``"turn"`` (every generation).

    Raises:
        InvalidArgumentError: bc < 2, k outside 1..32, an unknown reset.
        UnsupportedModelError: (prepare) a model that cannot run a draft tree.
    """

    name = "recycle"
    lossless = True
    #: per rank (the depth buckets), no forgetting; the whole draft scaled by
    #: accepted / predicted tokens
    ACCEPTANCE = AcceptanceModel(
        priors={SOURCE: RANK_PRIORS},
        weight=4.0,
        decay=1.0,
        max_depth=len(RANK_PRIORS),
        reset_on_probe_hit=False,
        calibration=CalibrationModel(decay=0.9, weight=1.0, cap=1.5),
    )

    def __init__(self, bc: Any = "auto", max_bc: Any = 64, k: Any = 8, reset: Any = "never"):
        self.auto, self.bc = parse_bc(bc, max_bc, 2)
        self.source = RecycleTable(parse_int("k", k, 1, 32), str(reset))
        self.plain_topk = self.source.k

    @property
    def block_complexity(self) -> int:
        return self.bc

    def describe(self) -> str:
        bc = f"auto<={self.bc}" if self.auto else str(self.bc)
        return f"recycle(bc={bc}, k={self.source.k}, reset={self.source.reset})"

    def acceptance_model(self) -> AcceptanceModel:
        k = self.source.k
        return replace(
            self.ACCEPTANCE, priors={SOURCE: RANK_PRIORS[:k], DEEP: DEEP_PRIORS[:k]}, max_depth=k
        )

    def device_drafter(self, ctx: Context) -> RecycleDrafter:
        return RecycleDrafter(self.source)

    def propose(self, ctx: Context, root: int) -> Offer:
        kids = self.source.children(ctx.acceptance)
        allocator = Allocator(lambda path, tok: kids(tok), root, self.bc, 0, 0.0)
        source = self.source

        def build(n: int) -> Draft:
            # the most valuable path first: an accepted best branch needs no KV-row move
            alloc = allocator.alloc.prefix(n).heavy_first()
            rows = 1 + len(alloc.tokens)

            def top(logits: Any, hidden: Any, targets: Any) -> list:
                return [source.graph(logits, rows)]

            if alloc.parents == list(range(-1, rows - 2)):  # a chain: no tree mask
                return Draft.chain(root, alloc.tokens, tags=alloc.sources, extras=top)
            parents = np.array([-1] + [p + 1 for p in alloc.parents], dtype=np.int64)
            tokens = np.array([root, *alloc.tokens], dtype=np.int64)
            return Draft(tokens, parents, tags=alloc.sources, extras=top)

        # an empty row now says nothing of the next root's: look again next step
        return Offer(allocator, build, max_slots=self.bc, remaining=allocator.remaining, free=True)

    def observe(self, ctx: Context, draft: Draft | None, result: Verified | PlainResult) -> None:
        if draft is None:
            self.source.plain(result)
        else:
            self.source.learn(draft, result, result.extras[-1])
