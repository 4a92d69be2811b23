"""``clp``: MTP heads with a one-layer span predictor, backbone as architect.

Xie & Zhou, *CLP: Collocation-Length Prediction for Zero-Loss Adaptive
Multi-Token Inference* (arXiv 2606.10935; docs/methods.md). Read top to bottom:

1. The backbone's own LM head always writes token n+1 (argmax, or a sample at
   temperature > 0). MTP head j (j = 1..k) only writes token n+1+j, from the
   backbone's final-norm hidden state ``h_n`` and the embedding of that token
   n+1 (see :mod:`mlx_mtp.clp_format`). A head never competes with the backbone
   for a position.
2. The span predictor, one ``nn.Linear(hidden_size, k + 1)`` on ``h_n``, says
   how many of the k head tokens to keep this step (0..k).
3. ``mode=paper`` (the paper's decoding, no verifier): commit token n+1 plus
   the kept head tokens as they are. One forward pass per step carries the
   tokens committed by the previous step (they need their KV anyway); its last
   hidden state feeds the backbone's LM head and the heads. Not lossless: the
   quality watch is the repetition rate. Between steps the cache lags behind
   the committed text by the previous step's tokens (they are fed at the next
   step; ``engine.sync`` fills them in before another turn).
4. ``mode=verified`` (default): the kept head tokens are drafts. One forward
   pass over ``[root, drafts...]`` verifies them (greedy or sampling, exact);
   the same pass gives the hidden state and target token at every position,
   so the heads at the last accepted position draft the next step without an
   extra forward pass (:meth:`CLP.propose` / :meth:`CLP.observe` around the
   shared stage :mod:`mlx_mtp.speculative`). Output equals plain decoding
   exactly.

Options (``--opt key=value``; ``--k``):
    mode: ``verified`` (default, lossless) or ``paper`` (no verifier).
    k: heads to use (1..the heads' k), or ``auto`` (default): all heads, each
        step's drafts cut by the device-aware budget, and one-token steps
        without the heads (probing now and then) while no draft pays
        (verified mode, :mod:`mlx_mtp.planner`).
    predictor: ``linear`` (CLP span predictor, default), ``gate`` (the ~1M
        parameter MLP gate baseline) or ``all`` (always keep all k heads).
    heads: a heads folder or hub repo id; default: the user's trained heads
        for this model, else the heads shipped for it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from ..acceptance import AcceptanceModel, chain_values
from ..clp_format import CLPHeads, count_params, heads_for
from ..context import Context
from ..engine import Engine, common_prefix
from ..errors import InvalidArgumentError, UnsupportedModelError
from ..offers import Offer, PlainResult, StepOutput, chain_offer
from ..pipeline import DeviceDrafter, DeviceState, Pass, Template
from ..speculative import Draft, Verified
from ..verify import Sampler, target_graph
from .base import DraftMethod, parse_int

MODES = ("verified", "paper")
PREDICTORS = ("linear", "gate", "all")


class CLP(DraftMethod):
    """CLP heads + span predictor, in the paper's mode or a verified mode.

    Args:
        mode: ``"verified"`` (lossless) or ``"paper"`` (no verifier).
        k: number of heads to use, or ``"auto"`` (default: all heads in the
            file; verified mode cuts each step's drafts to the length that
            maximises expected tokens per unit of time under the device's
            forward cost curve, from per-depth acceptance learned online, and
            runs pipelined one-token steps without the heads while no draft
            pays, re-probing periodically: a heads step, then a step that
            verifies a few of its drafts; :mod:`mlx_mtp.planner`).
        predictor: ``"linear"``, ``"gate"`` or ``"all"``.
        heads: heads folder or hub repo id (default: found by fingerprint).

    Raises:
        InvalidArgumentError: unknown mode or predictor, bad k.
    """

    name = "clp"

    def __init__(
        self,
        mode: str = "verified",
        k: Any = None,
        predictor: str = "linear",
        heads: str | None = None,
    ):
        if mode not in MODES:
            raise InvalidArgumentError(f"clp: mode must be one of {', '.join(MODES)}, got {mode!r}")
        if predictor not in PREDICTORS:
            raise InvalidArgumentError(
                f"clp: predictor must be one of {', '.join(PREDICTORS)}, got {predictor!r}"
            )
        self.mode = mode
        self.lossless = mode == "verified"  # instance attribute: exactness depends on mode
        # k=auto (default, verified mode): every head, and each step's drafts cut
        # to the length that pays under the device's cost curve (the planner)
        self.auto = mode == "verified" and str(k) in ("None", "auto")
        self.k = None if str(k) in ("None", "auto") else parse_int("k", k, 1, 8)
        self.predictor = predictor
        self.heads_spec = heads
        self.heads: CLPHeads | None = None

    @property
    def block_complexity(self) -> int:
        return 1 + (self.k or 0)

    def describe(self) -> str:
        sel = self.predictor
        if self.heads is not None and self.selector is not None:
            sel += f" {self.predictor_params():,} params"
        k = f"auto<={self.k}" if self.auto else str(self.k)
        return f"clp(mode={self.mode}, k={k}, predictor={sel})"

    # ------------------------------------------------------------------ setup
    def prepare(self, ctx: Context) -> None:
        engine = ctx.engine
        if engine.backbone is None:
            raise UnsupportedModelError(
                "--method clp needs a model with the llama-style layout (hidden states and an "
                "LM head); use --method ntp for this model."
            )
        name = getattr(ctx.loaded, "name", "this model")
        self.heads, folder = heads_for(engine.model, self.heads_spec, name)
        self.heads_folder = folder
        if self.k is None:
            self.k = self.heads.k
        elif self.k > self.heads.k:
            raise InvalidArgumentError(
                f"--k {self.k}: the heads in {folder} predict only {self.heads.k} token(s) "
                "beyond the backbone's; use a smaller --k or train more heads."
            )
        if self.predictor == "gate" and not hasattr(self.heads, "gate"):
            raise InvalidArgumentError(
                f"--opt predictor=gate: the heads in {folder} have no gate baseline; retrain "
                "with `mlx-mtp train clp --gate` or use predictor=linear."
            )
        if self.predictor == "all":
            self.selector = None
        else:
            self.selector = self.heads.predictor if self.predictor == "linear" else self.heads.gate

    def predictor_params(self) -> int:
        """Parameters of the span selector in use (1,731 for SmolLM2's linear one at k=2)."""
        return count_params(self.selector) if self.selector is not None else 0

    def begin(self, ctx: Context, prompt: list[int], sampler: Sampler | None) -> None:
        super().begin(ctx, prompt, sampler)
        self._root: int | None = None  # root the carried-over state belongs to
        self._carry: list[int] = []  # verified: drafts; paper: committed, not yet cached

    # ------------------------------------------------------------- internals
    def _targets(self, logits: mx.array, positions: np.ndarray) -> mx.array:
        """Backbone token at each row (argmax, or a sample), lazily: (N,).
        ``positions`` (N,): sequence position of each drawn token."""
        return target_graph(logits, np.arange(logits.shape[0]), self.sampler, positions)

    def _heads(self, engine: Engine, h: mx.array, nxt: mx.array) -> tuple[mx.array, mx.array]:
        """Head tokens (N, k) and kept span (N,) at hidden states h (N, D) whose
        backbone tokens are ``nxt`` (N,), lazily."""
        k = self.k
        hl = self.heads.head_logits(h, engine.embed(nxt), engine.lm_head)[:k]  # (k, N, V)
        toks = mx.argmax(hl, axis=-1).T
        if self.selector is None:
            span = mx.full((h.shape[0],), k, dtype=mx.int32)
        else:
            span = mx.minimum(mx.argmax(self.selector(h.astype(mx.float32)), axis=-1), k)
        return toks, span

    # ------------------------------------------------------------------ step
    def propose(self, ctx: Context, root: int) -> Offer:
        engine = ctx.engine
        if self.mode == "paper":  # no verifier: the span predictor decides
            return Offer([], run=lambda n: self._step_paper(engine, root), required=True)
        drafts = self._carry if self._root == root else []

        def heads(logits: mx.array, h: mx.array, targets: mx.array) -> tuple[mx.array, ...]:
            # heads + predictor at every row, fed with the backbone's target tokens,
            # evaluated with them (device work)
            return self._heads(engine, h, targets)

        # the heads at the last accepted position draft the next step: after plain
        # steps (no heads ran) the first pass only makes drafts (primes)
        offer = chain_offer(root, drafts, "clp", ctx.acceptance, hidden=True, extras=heads)
        offer.primes = True
        return offer

    def observe(self, ctx: Context, draft: Draft | None, result: Verified | PlainResult) -> None:
        if draft is None:  # a one-token step: the carried drafts no longer follow
            self._root, self._carry = None, []
            return
        # the heads at the last accepted position draft the next step
        m = len(result.path)
        toks, span = (np.array(a) for a in result.extras)
        self._root = result.bonus
        self._carry = toks[m, : int(span[m])].tolist()  # k=auto: cut by the planner

    def device_drafter(self, ctx: Context) -> DeviceDrafter | None:
        """The heads on pipelined steps (verified mode): :class:`HeadsDrafter`.
        The paper's mode commits unverified tokens and runs the planner's
        steps."""
        if self.mode != "verified":
            return None
        return HeadsDrafter(self)

    def pipeline_acceptance(self) -> AcceptanceModel:
        """Per-span priors of the heads' drafts on pipelined steps
        (:func:`span_priors`; :data:`UNKNOWN_SPAN` before a span is read)."""
        return AcceptanceModel(
            priors=span_priors(self.k or 0), default_prior=UNKNOWN_SPAN, decay=SPAN_DECAY
        )

    def _step_paper(self, engine: Engine, root: int) -> StepOutput:
        pending = self._carry if self._root == root else []
        _, h = engine.forward_chain([*pending, root], hidden=True)
        h = h[-1:]
        # only the last row goes through the LM head
        nxt = self._targets(engine.lm_head(h), engine.slot_positions[-1:] + 1)
        toks, span = self._heads(engine, h, nxt)
        engine.timed_eval(nxt, toks, span)  # LM head, heads, predictor: device work
        s = int(np.array(span)[0])
        committed = [int(np.array(nxt)[0]), *np.array(toks)[0, :s].tolist()]
        self._root = committed[-1]
        self._carry = committed[:-1]
        return StepOutput(committed, drafted=s, accepted=s)


#: prior acceptance of head j (j = 1..k) given heads 1..j-1 accepted, on a
#: step whose span predictor said ``s``: :data:`WITHIN_SPAN` for j <= s,
#: :data:`PAST_SPAN` beyond. Teacher-forced over 4 Spec-Bench replies per
#: task, the shipped Qwen2.5-Coder-0.5B heads' first token is accepted 0.14-0.16
#: of the time after a span of 0 and 0.57-0.63 after a span of 2, at the same
#: position or one or two earlier (``scripts/clp_span_signal.py``;
#: docs/methods.md, clp)
WITHIN_SPAN, PAST_SPAN = 0.5, 0.1
#: prior acceptance of a head's drafts before any span is read (all heads'
#: first tokens: 0.23 in the same measurement)
UNKNOWN_SPAN = 0.25
#: forgetting per observation of each span's estimates: every pipelined pass
#: observes the heads, so a slow decay still follows the text
SPAN_DECAY = 0.95


def span_source(span: int | None) -> str:
    """The acceptance statistics' source name of head drafts made where the
    span predictor said ``span`` (None: not known yet)."""
    return HeadsDrafter.name if span is None else f"{HeadsDrafter.name}/{span}"


def span_priors(k: int) -> dict[str, tuple[float, ...]]:
    """Per-depth priors of each span's source (:func:`span_source`) for ``k`` heads."""
    return {
        span_source(s): tuple(WITHIN_SPAN if j <= s else PAST_SPAN for j in range(1, k + 1))
        for s in range(k + 1)
    }


class HeadsDrafter(DeviceDrafter):
    """CLP heads on pipelined steps (:mod:`mlx_mtp.pipeline`).

    Every pass also runs the heads at its deepest accepted slot, fed with that
    slot's hidden state and the backbone's token after it (the bonus token,
    the next step's root), inside the pass's own graph: their k tokens are the
    next step's chain of drafts, lazily, so the next pass is launched before
    the host has read anything (Xie & Zhou, CLP, §3: the backbone writes token
    n+1, head j token n+1+j). The heads run on plain steps too, which is how
    their acceptance is learned while no draft pays: the host compares each
    step's head tokens with the tokens committed after its root.

    Pipelined passes learn the heads whatever their width; a spell of plain
    steps runs none of ours, so while one runs the width policy probes now
    and then (:attr:`learns_free` False).

    The span predictor (CLP §3.2) runs beside the heads and gates them as the
    paper does, through the width policy: each step's head drafts are
    learned per span the predictor gave them (:func:`span_source`, priors
    :func:`span_priors`), and the next step is valued with the latest span
    the host has read (:meth:`learn`'s signal). Where the next pass is
    launched before the last is read, that span is the step in flight's
    (one step older than the drafts it values); elsewhere it is their own.

    Args:
        method: the :class:`CLP` method, prepared (heads loaded).
    """

    name = "clp"
    wants_hidden = True

    def __init__(self, method: CLP):
        super().__init__()
        self.method = method
        self._drafts: mx.array | None = None  # (k,) after the last launched pass
        self._next: tuple[mx.array, mx.array] | None = None  # read -> update
        self._pending: list[tuple[int, list[int], int | None]] = []
        self._signal: int | None = None
        self._paused = False

    @property
    def learns_free(self) -> bool:  # type: ignore[override]
        """Whether the heads learn without drafting: on pipelined steps,
        not in a spell of plain steps."""
        return not self._paused

    def begin(self, ctx: Context, prompt: list[int]) -> None:
        self._engine = ctx.engine
        self._drafts = None
        self._pending, self._signal, self._paused = [], None, False

    def pause(self, cached: list[int]) -> None:
        self._paused = True

    def end(self, cached: list[int]) -> None:
        self._paused = False

    def values(self, acceptance: Any, most: int, signal: Any) -> list[float]:
        k = min(most, self.method.k or 0)
        return chain_values(acceptance.qs(span_source(signal), k))

    def template(self, width: int) -> Template:
        # where no heads have run (the start, after a spell) a width chosen
        # is a plain pass that runs them, and the next step drafts
        return Template.chain_of(0 if self._drafts is None else min(width, self.method.k or 0))

    def draft(self, state: DeviceState, tpl: Template, rows: int) -> mx.array:
        return self._drafts[: tpl.n - 1]

    def read(self, step: Pass) -> dict[str, mx.array]:
        # the heads and the span at this pass's deepest accepted slot (the
        # next step's drafts), kept for :meth:`update`
        last = mx.take(step.path, step.accepted).reshape(1)
        h = mx.take(step.hidden, last, axis=0)  # (1, D)
        nxt = mx.argmax(mx.take(step.logits, last, axis=0), axis=-1)  # the bonus token
        toks, span = self.method._heads(self._engine, h, nxt)
        self._next = (toks[0].astype(mx.int32), span.astype(mx.int32))
        out = {"next": self._next[1]}
        if self._drafts is not None:  # the head tokens this step's root had
            out["heads"] = self._drafts
        return out

    def update(self, step: Pass) -> list[mx.array]:
        self._drafts = self._next[0]
        self._next = None
        return [self._drafts]

    def learn(self, acceptance: Any, history: list[int], steps: list[Any]) -> Any:
        for s in steps:  # in launch order: a step's heads have the span the step before read
            heads = s.extra.get("heads")
            if heads is not None:
                self._pending.append((s.start, [int(t) for t in heads], self._signal))
            self._signal = int(s.extra["next"][0])
        keep = []
        for r, drafts, span in self._pending:
            known = history[r + 1 : r + 1 + len(drafts)]
            m = common_prefix(known, drafts)
            if m < len(known) or len(known) == len(drafts):
                acceptance.source(span_source(span)).record(len(drafts), m)
            else:
                keep.append((r, drafts, span))
        self._pending = keep
        return self._signal
