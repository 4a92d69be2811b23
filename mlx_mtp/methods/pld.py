"""``pld``: prompt-lookup decoding (Saxena, 2023), a training-free n-gram baseline.

Match the last n tokens (n = window down to 1) against the earlier context and
propose up to ``max_draft`` tokens that followed the most recent match
(:mod:`mlx_mtp.sources.lookup`); verify them as one chain in a single forward
pass (lossless). With ``max_draft="auto"`` the planner cuts the chain where
it stops paying on this device.
"""

from __future__ import annotations

from typing import Any

from ..acceptance import AcceptanceModel
from ..context import Context
from ..offers import Offer, chain_offer
from ..sources.lookup import LookupDrafter, PromptLookup
from .base import DraftMethod, parse_int


class PLD(DraftMethod):
    """Prompt lookup: n-gram window ``window`` (3), up to ``max_draft`` tokens.

    Args:
        window: longest n-gram matched (3).
        max_draft: draft tokens per step: an integer (Saxena's setting is 10),
            or ``"auto"`` (default): the match is cut per step at the length
            that maximises expected tokens per unit of time under this
            device's forward cost curve, up to ``AUTO_MAX_DRAFT``, and nothing
            is drafted while no length pays (:mod:`mlx_mtp.planner`).

    Raises:
        InvalidArgumentError: a window or max_draft below 1.
    """

    name = "pld"
    lossless = True
    chain_shaped = True
    #: the longest chain ``max_draft="auto"`` may verify
    AUTO_MAX_DRAFT = 24

    def __init__(self, window: Any = 3, max_draft: Any = "auto"):
        self.window = parse_int("window", window, 1)
        self.auto = str(max_draft) == "auto"
        self.max_draft = self.AUTO_MAX_DRAFT if self.auto else parse_int("max_draft", max_draft, 1)
        self.lookup = PromptLookup(self.window)

    @property
    def block_complexity(self) -> int:
        return 1 + self.max_draft

    def describe(self) -> str:
        md = f"auto<={self.max_draft}" if self.auto else str(self.max_draft)
        return f"pld(window={self.window}, max_draft={md})"

    #: pipelined steps' estimates, per the n-gram length matched at the root
    #: before (``pld/0``: no match): acceptance of depth 1, then of deeper
    #: depths given the one before accepted
    PIPELINE_ACCEPTANCE = AcceptanceModel(
        priors={"pld/0": (0.02, 0.3), "pld/1": (0.15, 0.5), "pld/2": (0.35, 0.6)},
        default_prior=0.6,
        weight=2.0,
        decay=0.9,
        max_depth=AUTO_MAX_DRAFT,
    )

    def device_drafter(self, ctx: Context) -> LookupDrafter:
        return LookupDrafter(self.window, self.max_draft)

    def pipeline_acceptance(self) -> AcceptanceModel:
        return self.PIPELINE_ACCEPTANCE

    #: the planner's estimates, per the n-gram length matched at the step's
    #: own root (``pld/1`` .. ``pld/3``): the first drafted token was right
    #: after 23%, 43% and 69% of such matches (SmolLM2-135M float32, 24
    #: Spec-Bench prompts x 64 tokens, ``examples/lookup_signal.py --fresh``)
    ACCEPTANCE = AcceptanceModel(
        priors={"pld/1": (0.23, 0.5), "pld/2": (0.43, 0.6), "pld/3": (0.69, 0.7)},
        max_depth=AUTO_MAX_DRAFT,
    )

    def acceptance_model(self) -> AcceptanceModel:
        return self.ACCEPTANCE

    def propose(self, ctx: Context, root: int) -> Offer:
        toks, n = self.lookup.match(ctx, root, self.max_draft)
        # a lookup costs no device work: scored at plain steps too
        return chain_offer(root, toks, f"pld/{min(n, 3)}", ctx.acceptance, free=True)
