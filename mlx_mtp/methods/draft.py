"""``draft``: a small model drafts for a large one, verified losslessly.

The draft model (``draft_model``, a smaller model of the target's tokenizer)
proposes a greedy chain of ``num_draft_tokens`` tokens (mlx-lm's
``--draft-model`` algorithm, Leviathan et al. 2023) or, in ``shape="tree"``, that
chain with the draft's next most probable tokens at every depth as siblings,
all verified in one target pass (:mod:`mlx_mtp.sources.draft`). With
``num_draft_tokens="auto"`` the depth, and the planner the tree, follow what
drafts earn against the cost of the target's slots and of the draft model's
own passes on this device (:mod:`mlx_mtp.planner`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..acceptance import AcceptanceModel, CalibrationModel, chain_values
from ..allocate import Allocator, CandidateChildren, merge_chains
from ..context import Context
from ..errors import InvalidArgumentError
from ..offers import Item, Offer
from ..sources.draft import DraftModel, DraftModelDrafter, parse_width
from ..speculative import Draft
from .base import SourceMethod, parse_int

#: the longest chain ``num_draft_tokens="auto"`` may draft
AUTO_MAX_DRAFT = 8
#: candidates per depth of ``shape="tree"`` (the chain's token and 3 alternatives)
TREE_WIDTH = 4


class DraftModelMethod(SourceMethod):
    """Draft-model speculative decoding (see the module doc).

    Args:
        draft_model: the draft model: an alias, folder, GGUF file or hub id
            (loaded once per process, in the target's dtype), or a
            :class:`~mlx_mtp.loading.LoadedModel`. Its tokenizer must encode
            text as the target's does.
        num_draft_tokens: drafts per step (mlx-lm's flag), or ``"auto"``
            (default): up to ``max_draft``, drafting stops once a longer chain
            cannot pay on this device, and the planner cuts the tree.
        shape: ``"tree"`` (default: the chain and ``width - 1`` alternatives
            per depth) or ``"chain"`` (mlx-lm's: the greedy chain only; also
            runs on hybrid recurrent targets).
        width: candidates per depth of the tree (default 4).
        max_draft: the cap of ``num_draft_tokens="auto"`` (default 8).

    Raises:
        InvalidArgumentError: no draft model, bad option values.
        UnsupportedModelError: (prepare) a tokenizer that differs from the target's.
    """

    name = "draft"
    lossless = True
    #: draft probabilities, calibrated per depth against what was accepted,
    #: and the whole draft's estimate against its accepted length (a draft
    #: model is overconfident on text it cannot predict)
    ACCEPTANCE = AcceptanceModel(
        priors={"draft": 1.0},
        weight=4.0,
        decay=0.95,
        calibration=CalibrationModel(decay=0.9, weight=1.0, cap=1.5),
    )

    def __init__(
        self,
        draft_model: Any = None,
        num_draft_tokens: Any = "auto",
        shape: str = "tree",
        width: Any = None,
        max_draft: Any = AUTO_MAX_DRAFT,
    ):
        if draft_model in (None, ""):
            raise InvalidArgumentError(
                "--method draft needs a draft model: --draft-model MODEL (a smaller model of "
                "the target's tokenizer, e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b)."
            )
        if shape not in ("tree", "chain"):
            raise InvalidArgumentError(f"option shape must be 'tree' or 'chain', got {shape!r}")
        self.auto = str(num_draft_tokens) == "auto"
        if self.auto:
            self.depth = parse_int("max_draft", max_draft, 1, 32)
        else:
            self.depth = parse_int("num_draft_tokens", num_draft_tokens, 1, 32)
        self.shape = shape
        #: a chain runs through the recurrent layers of hybrid models too
        self.chain_shaped = shape == "chain"
        if shape == "chain" and width not in (None, 1, "1"):
            raise InvalidArgumentError("shape=chain drafts one token per depth: drop width.")
        self.width = 1 if shape == "chain" else parse_width(TREE_WIDTH if width is None else width)
        self.source = DraftModel(draft_model, self.width)

    #: pipelined steps' estimates: per depth the chain's token given the one
    #: before accepted, and that an alternative is accepted where it is not
    PIPELINE_ACCEPTANCE = AcceptanceModel(
        priors={"draft": 0.7, "draft_alt": 0.3}, weight=2.0, decay=0.9, max_depth=32
    )

    @property
    def block_complexity(self) -> int:
        return 1 + self.depth * self.width

    @property
    def max_width(self) -> int:
        return self.depth  # an item of a pipelined step is one depth

    def device_drafter(self, ctx: Context) -> DraftModelDrafter | None:
        if not self.source.engine.lazy_ready():
            return None
        return DraftModelDrafter(self.source, self.width)

    def pipeline_acceptance(self) -> AcceptanceModel:
        return self.PIPELINE_ACCEPTANCE

    def describe(self) -> str:
        n = f"auto<={self.depth}" if self.auto else str(self.depth)
        name = getattr(self.source, "loaded", None)
        name = getattr(name, "name", self.source.spec)
        tree = f", width={self.width}" if self.shape == "tree" else ""
        return f"draft(model={name}, num_draft_tokens={n}, shape={self.shape}{tree})"

    def propose(self, ctx: Context, root: int) -> Offer:
        chains = self.source.candidates(ctx, root, self.depth, self.auto)
        if self.shape == "chain":
            _, toks, conds, raws = chains[0]
            tags = [[("draft", d + 1, r)] for d, r in enumerate(raws)]

            def build_chain(n: int) -> Draft:
                return Draft.chain(root, toks[:n], tags=tags[:n])

            return Offer([Item(v) for v in chain_values(conds)], build_chain)
        bc = self.block_complexity
        allocator = Allocator(CandidateChildren(merge_chains(chains)), root, bc, 0, 0.0)

        def build(n: int) -> Draft:
            # the most probable path first: an accepted chain needs no KV-row move
            alloc = allocator.alloc.prefix(n).heavy_first()
            parents = [-1] + [p + 1 for p in alloc.parents]
            tokens = np.array([root, *alloc.tokens], dtype=np.int64)
            return Draft(tokens, np.array(parents, dtype=np.int64), tags=alloc.sources)

        return Offer(allocator, build, max_slots=bc, remaining=allocator.remaining)
