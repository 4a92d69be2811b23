"""A small model drafting for a large one: the draft-model source.

Speculative decoding with a draft model (Leviathan, Kalman, Matias 2023;
Chen et al. 2023): a smaller model of the same tokenizer proposes the next
tokens greedily, the target verifies them in one forward pass. Read top to
bottom:

1. The draft model has its own :class:`~mlx_mtp.engine.Engine`. Before it
   drafts, its KV cache is brought in step with the target's committed tokens
   (:meth:`Engine.catch_up <mlx_mtp.engine.Engine.catch_up>` keeps the
   longest common prefix: rejected drafts are dropped; tokens it has not
   seen, such as the last draft of a step that accepted every draft or those
   of plain steps, are fed in its first pass, in front of the root).
2. Depth by depth it feeds its last token and takes its most probable token
   as the next draft (the chain); with a fixed depth the passes are queued
   one behind the other on the device and read in one synchronisation, as
   mlx-lm's draft loop does. Its ``width - 1`` next most probable tokens
   at each depth become siblings of that draft (leaves), so that one target
   pass verifies a tree: the chain plus the draft's alternatives at every
   depth, a cheap form of the dynamic trees of SpecInfer (Miao et al. 2024)
   and EAGLE-2 (Li et al. 2024), which expand only the most probable path.
3. A node's value is its path probability under the draft model, each
   factor scaled by a per-depth calibration learned online (accepted per
   predicted, prior 1). With ``depth="auto"`` drafting stops once no longer
   chain can pay for its slots and for the draft model's own passes under
   the planner's cost curve; the planner then cuts the tree as any offer.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from ..budget import PrefixBound
from ..context import Context
from ..engine import Engine
from ..errors import InvalidArgumentError, UnsupportedModelError
from ..loading import draft_for
from ..memory import weight_bytes
from ..pipeline import DeviceDrafter, DeviceState, Template
from ..verify import top_tokens
from .masks import candidate_lists, top_candidates

#: the most tokens the draft model lacks that its first pass of a step feeds
#: in front of the root (more are prefilled on their own first)
CATCH_UP = 64


class DraftModel:
    """The draft model as a draft source (see the module doc).

    Args:
        spec: the draft model (as :func:`~mlx_mtp.loading.load_draft` takes it).
        width: candidates per depth (1: a chain, mlx-lm's algorithm).

    Attributes:
        draft_cost: one draft pass's time in one-token target forwards: the
            ratio of the two models' weight bytes until a pass is measured,
            then measured draft seconds per pass over the target's.
        passes: draft passes per drafting step (average).
    """

    #: steps a draft model that does not pay sits out before it drafts again
    RETRY = 16

    def __init__(self, spec: Any, width: int = 1):
        self.spec, self.width = spec, width
        self.engine: Engine | None = None
        self.draft_cost, self.passes, self.skipped = 0.0, 1.0, 0

    def pays(self, ctx: Context) -> bool:
        """Whether to run the draft model this step, as one source among
        others at ``auto`` (``hybrid``): the tokens its candidates earned per
        step (``ctx.acceptance.gain("draft")``) cover its passes, or it sat
        out ``RETRY`` steps. Its passes are spent before the planner cuts the
        offer, so without this a draft model that does not pay makes every
        step of the other sources cost them too."""
        cost = self.draft_cost * self.passes
        if ctx.acceptance.gain("draft") >= cost or self.skipped >= self.RETRY:
            self.skipped = 0
            return True
        self.skipped += 1
        return False

    def prepare(self, ctx: Context) -> None:
        """Load the draft model (in the target's dtype) and check its tokenizer.

        Raises:
            UnsupportedModelError: no tokenizer to compare (a bare model), or
                a tokenizer that differs from the target's.
        """
        if ctx.loaded is None:
            raise UnsupportedModelError(
                "a draft model needs the target's tokenizer to check against: load the "
                "target with mlx_mtp.load / load_model (a LoadedModel), not a bare model."
            )
        self.loaded = draft_for(ctx.loaded, self.spec)
        self.vocab = len(ctx.loaded.tokenizer.vocab) if ctx.loaded.tokenizer else None
        self.draft_cost = weight_bytes(self.loaded.model) / max(weight_bytes(ctx.engine.model), 1)
        self.engine = Engine(self.loaded.model)
        # on the target's device; a simulated one runs a draft pass in the
        # target pass's time times their weight bytes
        self.engine.clock = ctx.engine.clock.fork(self.draft_cost)
        self.seconds_per_pass: float | None = None

    def begin(self, prompt: list[int]) -> None:
        """Prefill the draft model with the prompt (all but its last token, as
        the target's cache holds it), as mlx-lm's draft loop does before its
        first step: part of the generation's prefill, not of its decoding."""
        self.engine.sync(prompt[:-1])

    def candidates(
        self, ctx: Context, root: int, depth: int, auto: bool
    ) -> list[tuple[str, list[int], list[float], list[float]]]:
        """Draft after ``root`` (the target's cache holds everything before
        it): up to ``depth`` chain tokens (fewer with ``auto`` once no longer
        chain can pay, and no more than ``ctx.left - 1``), with ``width - 1``
        alternatives at every depth.

        With a fixed depth the draft model's passes are queued one behind the
        other, each fed the argmax of the one before while it is still
        lazy, and read in one synchronisation (mlx-lm's draft loop); at
        ``auto`` each pass is read before the next, since the planner's bound
        decides from its probabilities whether to draft on.

        Returns:
            Chains ``("draft", tokens, conditional estimates, raw draft
            probabilities)`` for :func:`~mlx_mtp.allocate.merge_chains`: the
            chain first, then one chain per alternative (the chain's prefix
            and the alternative token).
        """
        if ctx.left is not None:  # drafts past the generation's end: passes for nothing
            depth = min(depth, ctx.left - 1)
        if depth < 1 or (auto and not self._may_pay(ctx, depth)):
            return [("draft", [], [], [])]
        eng = self.engine
        with ctx.engine.clock.work_of(eng.clock):  # the draft passes: device work
            # in step with the target's committed tokens before root; the few it
            # lacks (the last draft of a step that accepted them all, the tokens
            # of plain steps) go into its first pass, in front of root, more
            # than CATCH_UP are prefilled first (device work too)
            t0 = eng.clock.now()
            feed = [*eng.catch_up(ctx.history(root)[:-1], CATCH_UP), root]
            eng.clock.add(eng.clock.now() - t0)
            t0 = eng.clock.now()
            if auto or eng.rollback is not None:
                bound = ctx.budget.prefix_bound(self.draft_cost, 1 + depth) if auto else None
                rows = self._stepwise(ctx, feed, depth, bound)
            else:
                rows = self._queued(feed, depth)
            self._measure(ctx, len(rows), eng.clock.now() - t0)
        acc = ctx.acceptance
        chain: list[int] = []
        conds: list[float] = []
        raws: list[float] = []
        alts: list[tuple[int, int, float, float]] = []  # (depth, token, cond, raw)
        for d, (toks, ps) in enumerate(rows, start=1):
            cal = acc.q("draft", d)
            for t, p in zip(toks[1:].tolist(), ps[1:].tolist()):
                alts.append((d, int(t), min(p * cal, 1.0), float(p)))
            chain.append(int(toks[0]))
            conds.append(min(float(ps[0]) * cal, 1.0))
            raws.append(float(ps[0]))
        self.passes += 0.2 * (len(chain) - self.passes)
        out = [("draft", chain, conds, raws)]
        for d, t, cond, raw in alts:
            out.append(
                ("draft", [*chain[: d - 1], t], [*conds[: d - 1], cond], [*raws[: d - 1], raw])
            )
        return out

    def _row(self, logits: mx.array) -> mx.array:
        """The last row (1, V') of a draft pass's logits, without the rows past
        the tokenizer (embedding padding)."""
        row = logits[-1:]
        if self.vocab is not None and row.shape[-1] > self.vocab:
            row = row[:, : self.vocab]
        return row

    def _may_pay(self, ctx: Context, depth: int) -> bool:
        """Whether a draft could pay this step at all, before its first pass:
        drafts worth at most the first depth's estimate per slot beat a step
        without them (:meth:`~mlx_mtp.budget.PrefixBound.exhausted`), or the
        planner may probe. Otherwise the passes are not run: a plain step
        then costs what ``ntp``'s does."""
        budget = ctx.budget
        if budget.curve is None:
            return True
        if budget.worst(1, self.draft_cost) > max(budget.credit, 0.0):
            return False  # even one rejected draft would lose more than the credit
        if budget.probing:
            return True
        bound = budget.prefix_bound(self.draft_cost, 1 + depth)
        acc = ctx.acceptance
        return not bound.exhausted(min(acc.q("draft", 1), 1.0) * acc.factor)

    def _stepwise(
        self, ctx: Context, feed: list[int], depth: int, bound: PrefixBound | None
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Draft pass by pass, each read before the next: per depth the
        ``width`` best tokens and their probabilities, most probable first
        (the chain's token); with ``bound``, until no longer chain can pay."""
        eng, acc = self.engine, ctx.acceptance
        rows: list[tuple[np.ndarray, np.ndarray]] = []
        path = 1.0
        for d in range(1, depth + 1):
            logits, _ = eng.forward_chain(feed, wait=False, last=1)
            top, top_p = top_candidates(self._row(logits), self.width)
            eng.timed_eval(top, top_p)
            rows.append(candidate_lists(top, top_p)[0])
            feed = [int(rows[-1][0][0])]
            if bound is not None:  # node values as the cut scales them
                path *= min(float(rows[-1][1][0]) * acc.q("draft", d), 1.0)
                bound.add(path * acc.factor, 1)
                if bound.exhausted(path * acc.factor):  # a longer chain's nodes: at most this
                    break
                # a longer chain, every draft rejected, may lose at most half the
                # credit: one step's misses leave the next one room to draft
                if ctx.budget.worst(d + 1, self.draft_cost) > ctx.budget.credit / 2:
                    break
        return rows

    def _queued(self, feed: list[int], depth: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Draft ``depth`` passes queued one behind the other, each fed the
        lazy argmax of the one before, read in one synchronisation; per depth
        as :meth:`_stepwise` returns them, the fed token first."""
        eng = self.engine
        logits, _ = eng.forward_chain(feed, wait=False, last=1)
        reads: list[tuple[mx.array, mx.array, mx.array]] = []
        for d in range(1, depth + 1):
            top, top_p = top_candidates(self._row(logits), self.width)
            # the chain's token: the most probable of the top (the first of ties)
            nxt = mx.take_along_axis(top, mx.argmax(top_p, axis=-1, keepdims=True), axis=-1)
            reads.append((nxt, top, top_p))
            if d < depth:
                logits = eng.queue_behind(nxt)
                eng.clock.extend([logits, nxt, top, top_p], 1)
        eng.timed_eval(*(a for r in reads for a in r))
        rows = []
        for nxt, top, top_p in reads:
            toks, ps = candidate_lists(top, top_p)[0]
            # the fed token leads (it is the first of any tie for the top)
            i = int(np.flatnonzero(toks == int(nxt.item()))[0])
            order = [i, *range(i), *range(i + 1, len(toks))]
            rows.append((toks[order], ps[order]))
        eng.resolve_queued([int(toks[0]) for toks, _ in rows[:-1]])
        return rows

    def _measure(self, ctx: Context, passes: int, seconds: float) -> None:
        """Refine :attr:`draft_cost` from the draft passes just run."""
        if passes < 1:
            return
        per = seconds / passes
        old = self.seconds_per_pass
        self.seconds_per_pass = per if old is None else 0.8 * old + 0.2 * per
        t1 = ctx.budget.t1 if ctx.budget is not None else None
        if t1:
            self.draft_cost = self.seconds_per_pass / t1


def parse_width(value: Any) -> int:
    """The ``width`` option: candidates per depth, 1..16.

    Raises:
        InvalidArgumentError: not an integer in range.
    """
    try:
        w = int(value)
    except (TypeError, ValueError):
        w = 0
    if isinstance(value, bool) or not 1 <= w <= 16 or str(value).strip() != str(w):
        raise InvalidArgumentError(f"option width must be an integer in [1, 16], got {value!r}")
    return w


class DraftModelDrafter(DeviceDrafter):
    """The draft model on the device, for :mod:`mlx_mtp.pipeline`: its passes
    are built on the lazy state of the step before and queued ahead of the
    target's pass, with no read in between.

    Each step feeds the draft model the committed token before the root and
    the root, at the lazy cache length (the first is already in its cache
    unless the step before accepted every draft: rewriting its row changes
    nothing), then its argmax depth by depth (the chain); with ``width`` > 1
    its next ``width - 1`` most probable tokens at every depth hang beside
    the chain's token as leaves (:class:`DraftModel`'s tree). An item of the
    width policy is one depth: ``width`` slots and one draft pass. At
    ``auto`` the policy also weighs the chain alone (``widths``, :meth:`use`):
    on a steep cost curve (a 4-bit model on a Mac) a chain of 2-3 tokens
    pays where a depth of ``width`` slots does not.

    Args:
        source: the method's prepared :class:`DraftModel` (its engine holds
            the prompt: :meth:`DraftModel.begin`).
        width: candidates per depth.
    """

    name = "draft"
    learns_free = False

    def __init__(self, source: DraftModel, width: int):
        super().__init__()
        self.source = source
        #: candidates per depth: the tree's, and the chain alone
        self.widths = (width, 1) if width > 1 else (width,)
        self.use(width)
        self.item_cost = source.draft_cost
        self._tpls: dict[tuple[int, int], Template] = {}

    def use(self, width: int) -> None:
        """Lay out the next steps launched with ``width`` candidates per depth."""
        self.width = self.item_slots = width

    def values(self, acceptance: Any, most: int, signal: Any) -> list[float]:
        qs = acceptance.qs("draft", most)
        alt = acceptance.q("draft_alt", 1) if self.width > 1 else 0.0
        out, path = [], 1.0
        for q in qs:
            out.append(path * (q + (1.0 - q) * alt))
            path *= q
        return out

    def template(self, width: int) -> Template:
        w = self.width
        tpl = self._tpls.get((w, width))
        if tpl is None:
            parents = [-1]
            for d in range(1, width + 1):
                up = 0 if d == 1 else (d - 2) * w + 1  # the chain's node one depth up
                parents += [up] * w
            tpl = self._tpls[(w, width)] = Template.of(parents)
        return tpl

    def draft(self, state: DeviceState, tpl: Template, rows: int) -> mx.array:
        eng, w = self.source.engine, self.width
        depth = (tpl.n - 1) // w
        at = state.at
        p0 = mx.maximum(at - 1, 0)
        feed = mx.concatenate([mx.take(state.history, p0).reshape(1), state.root.reshape(1)])
        logits, _ = eng.forward_at(feed, p0, rows)
        nodes: list[mx.array] = []
        for d in range(1, depth + 1):
            row = self.source._row(logits)
            tok = mx.argmax(row, axis=-1).astype(mx.int32)
            nodes.append(tok)
            if w > 1:
                nodes.append(top_tokens(row, w)[0, 1:].astype(mx.int32))
            if d < depth:
                logits, _ = eng.forward_at(tok, at + d, rows)
        out = mx.concatenate(nodes)
        arrays = [out, *(a for c in eng.cache if c.keys is not None for a in (c.keys, c.values))]
        self.aside.append((arrays, depth * self.source.draft_cost))
        return out

    def learn(self, acceptance: Any, history: list[int], steps: list[Any]) -> None:
        for s in steps:
            if s.width == 0:
                continue
            w = int((s.tpl.parents == 0).sum())  # the step's layout: the root's children
            on = set(s.path)
            for d in range(1, s.width + 1):
                up = 0 if d == 1 else (d - 2) * w + 1
                if up not in on:
                    break
                chain = (d - 1) * w + 1
                acceptance.source("draft").add(d, chain in on)
                if w > 1 and chain not in on:
                    alts = range(chain + 1, chain + w)
                    acceptance.source("draft_alt").add(1, any(a in on for a in alts))
        return None

    def resume(self, ctx: Any, history: list[int]) -> None:
        """After a spell of plain steps the draft model's cache catches up
        with the committed tokens (all but the root, as at the start), its
        passes counted as device work beside the target's."""
        eng = self.source.engine
        with ctx.engine.clock.work_of(eng.clock):
            eng.sync(history[:-1])

    def end(self, cached: list[int]) -> None:
        # rows before the last committed token's are certain; the in-flight
        # step may have rewritten the two after with the same tokens
        self.source.engine.settle_at(cached[: max(len(cached) - 1, 0)])
