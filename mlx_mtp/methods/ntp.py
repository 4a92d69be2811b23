"""``ntp``: plain next-token decoding, the baseline every method is measured against."""

from __future__ import annotations

from ..context import Context
from ..offers import StepOutput
from ..plain import PlainSteps
from ..verify import Sampler
from .base import Method


class NTP(Method):
    """One token per forward pass: argmax (greedy) or a draw from mlx-lm's sampler.

    Greedy decoding is pipelined like mlx-lm's ``generate_step``
    (:class:`~mlx_mtp.plain.PlainSteps`): each step queues the forward pass
    of the token it is about to return before reading that id, so the device
    computes token n+1 while the host hands out token n. The cache therefore
    holds one token more than committed between steps (the decoding loop
    trims it when the generation ends), and one forward pass after the last
    token is computed and discarded, as in mlx-lm.
    """

    name = "ntp"
    lossless = True
    needs_trimmable_cache = False

    def begin(self, ctx: Context, prompt: list[int], sampler: Sampler | None) -> None:
        super().begin(ctx, prompt, sampler)
        self.plain = PlainSteps(sampler)

    def step(self, ctx: Context, root: int) -> StepOutput:
        return StepOutput(self.plain.step(ctx.engine, root, queue_next=True))
