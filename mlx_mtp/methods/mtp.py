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

``depth="auto"`` (the default): before drafting, the chain length n is the one
that maximises expected tokens per unit of time,
``(1 + sum_{d<=n} prod_{j<=d} q_j) / (c(1 + n) + n * draft_cost)``, with ``c``
the device's forward cost curve, ``q_d`` the acceptance rate at depth d
learned online (:class:`~mlx_mtp.budget.DepthAcceptance`) and ``draft_cost``
one MTP draft (the layer's pass and the LM head) relative to a one-token
backbone forward. When no length pays, the method runs pipelined one-token
steps and re-probes periodically (:mod:`mlx_mtp.budget`); the MTP layer still
gets every committed position (in one batch at the next draft), so its context
has no gaps. The policy is the expected-tokens-per-time objective of Leviathan
et al. 2023, §3.4, with a measured cost; it is not from the Qwen or DeepSeek
reports.

:class:`NativeDrafter` keeps the MTP layer's context and drafts a chain;
``hybrid`` uses it too (its ``mtp`` source).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..budget import DepthAcceptance, best_prefix, chain_values
from ..engine import Engine
from ..errors import InvalidArgumentError, UnsupportedModelError
from ..native_mtp import HIDDEN_STATES, install_hidden_tap, load_native_mtp
from ..speculative import Draft, Verified
from ..verify import Sampler
from .base import SpeculativeMethod, parse_int

#: the longest chain ``depth="auto"`` may draft (the layer is trained for depth
#: 1; re-fed beyond it, acceptance falls with depth)
AUTO_MAX_DEPTH = 8
#: committed positions that may wait for the MTP layer while nothing is drafted
#: (hybrid whose other sources pay, the layer's do not): fed without drafting beyond
MAX_PENDING = 64


def draft_cost_of(layer: Any, model: Any) -> float:
    """Cost of one MTP draft (the layer's pass and the LM head) relative to a
    one-token forward of the backbone: the ratio of the weight bytes each
    reads, which is what a memory-bound decode step costs (the input
    embedding is a lookup, not read whole; a tied LM head is the embedding
    matrix). On a MoE model every expert counts on both sides.

    Returns:
        The ratio (float >= 0).
    """
    params = tree_flatten(model.parameters())
    total = sum(v.nbytes for _, v in params)
    emb = sum(v.nbytes for k, v in params if "embed_tokens" in k)
    tied = not any("lm_head" in k for k, _ in params)
    head = emb  # (V, D) either way: the embedding itself, or an untied head of its size
    backbone = total - emb + (emb if tied else 0)
    if backbone <= 0:
        return 0.0
    layer_bytes = sum(v.nbytes for _, v in tree_flatten(layer.parameters()))
    return (layer_bytes + head) / backbone


class NativeDrafter:
    """The checkpoint's MTP layer as a chain drafter, with its own context.

    The layer's KV cache holds one entry per committed position i: the pair
    ``(h_i, t_{i+1})`` (backbone hidden state (D,) at i, committed token
    i+1). Pairs of positions committed since the last draft wait in
    ``pending`` and are fed in one pass at the next :meth:`draft`.

    Args:
        hidden_state: ``"final-norm"`` or ``"pre-norm"`` (see :class:`MTP`).
    """

    def __init__(self, hidden_state: str = "final-norm"):
        self.hidden_state = hidden_state

    def prepare(self, engine: Engine, heads: Any = None) -> None:
        """Load the layer (from ``heads`` or the model's checkpoint folder) and
        tap the backbone's hidden states.

        Raises:
            UnsupportedModelError: no checkpoint folder to read from, or a
                model type without a native MTP layer.
            ModelLoadError: no (or unfitting) MTP tensors.
        """
        loaded = getattr(engine, "loaded", None)
        folder = heads if heads is not None else getattr(loaded, "path", None)
        if folder is None:
            raise UnsupportedModelError(
                "the native MTP layer is read from the model's checkpoint folder (load it with "
                "mlx_mtp.load / --model), or from the option heads=FOLDER holding its mtp.* "
                "tensors."
            )
        config = getattr(loaded, "config", None) if heads is None else None
        self.layer = load_native_mtp(Path(folder), engine.model, config)
        self.tap = install_hidden_tap(engine.model)
        self.cache = self.layer.make_cache()
        #: token t_p of every pair (h_{p-1}, t_p) in the MTP layer's cache, in order
        self.fed: list[int] = []
        self.pending: list[tuple[mx.array, list[int]]] = []
        self.draft_cost = draft_cost_of(self.layer, engine.model)

    def _records(self) -> list[mx.array]:
        return self.tap.inputs if self.hidden_state == "pre-norm" else self.tap.outputs

    def clear_tap(self, keep_last: bool = False) -> None:
        """Forget the tap's records (all, or all but the last one)."""
        n = max(len(self.tap.inputs) - (1 if keep_last else 0), 0)
        del self.tap.inputs[:n], self.tap.outputs[:n]

    def _prefill_rows(self, r: int) -> mx.array | None:
        # the hidden states of the last ``r`` prefilled tokens: the trailing tap
        # records (the sync's chunks were the model's last forward passes)
        taken, n = [], 0
        for rec in reversed(self._records()):
            if n >= r:
                break
            taken.append(rec[0])
            n += rec.shape[1]
        if r == 0 or n != r:
            return None
        return mx.concatenate(taken[::-1], axis=0)

    def begin(self, engine: Engine, prompt: list[int]) -> None:
        """After the prompt's sync: keep the pairs still valid from the last
        generation, queue the prefill's pairs."""
        h = self._prefill_rows(getattr(engine, "last_prefill", 0))
        self.clear_tap()
        r = 0 if h is None else h.shape[0]
        n = len(prompt)
        common = n - 1 - r
        valid = 0
        for a, b in zip(self.fed, prompt[1:]):
            if a != b:
                break
            valid += 1
        if valid >= common:  # pairs p = 1..common are cached: drop the rest
            drop = len(self.fed) - common
            if drop > 0:
                for c in self.cache:
                    c.trim(drop)
            del self.fed[common:]
        else:  # earlier hidden states are gone: start the layer's context afresh
            self.cache = self.layer.make_cache()
            self.fed = []
        toks = list(prompt[common + 1 : n])
        self.pending = [(h, toks)] if toks else []

    def draft(self, engine: Engine, depth: int) -> list[int]:
        """Feed the pending pairs, then draft ``depth`` tokens after the root
        (one synchronisation). Empty when nothing is pending (no hidden state
        yet) or ``depth`` is 0 (the pairs then wait for the next draft)."""
        if not self.pending or depth < 1:
            self.clear_tap()
            if sum(len(ts) for _, ts in self.pending) > MAX_PENDING:  # keep memory bounded
                engine.timed_eval(self._feed(engine))
            return []
        last = self._feed(engine)[-1:]
        d = mx.argmax(engine.lm_head(last), axis=-1)
        drafts = [d]
        for _ in range(1, depth):
            last = self.layer(last[None], engine.embed(d)[None], self.cache)[0]
            d = mx.argmax(engine.lm_head(last), axis=-1)
            drafts.append(d)
        engine.timed_eval(*drafts)
        if depth > 1:  # the speculative entries of depths 2..k
            for c in self.cache:
                c.trim(depth - 1)
        self.clear_tap()
        return [int(x.item()) for x in drafts]

    def _feed(self, engine: Engine) -> mx.array:
        # the pending pairs through the layer (lazy): (P, D) outputs
        h = mx.concatenate([r for r, _ in self.pending], axis=0)
        toks = [t for _, ts in self.pending for t in ts]
        self.pending = []
        self.fed += toks
        return self.layer(h[None], engine.embed_tokens(toks)[None], self.cache)[0]

    def verified(self, rows: mx.array | None, tokens: list[int]) -> None:
        """A verify pass committed ``tokens`` (accepted drafts and the bonus).

        Args:
            rows: (>= len(tokens), D) the pass's final-norm hidden states of
                the root and the accepted slots, in order (``pre-norm`` mode
                reads the tap instead: the pass must then be a chain).
            tokens: committed ids; ``tokens[i]`` follows row i.
        """
        a = len(tokens)
        if self.hidden_state == "pre-norm":
            rows = self.tap.inputs[-1][0]
        self.clear_tap()
        self.pending.append((rows[:a], list(tokens)))

    def plain(self, tokens: list[int], queued: bool) -> None:
        """A one-token step committed ``tokens``; ``queued``: it also started
        the forward pass of its token (a pipelined step), whose tap record
        stays for the next step."""
        recs = self._records()
        use = recs[: len(recs) - 1] if queued else list(recs)
        k = len(tokens)
        rows = mx.concatenate([r[0] for r in use], axis=0) if use else None
        if rows is not None and rows.shape[0] >= k:
            self.pending.append((rows[-k:], list(tokens)))
        else:  # no hidden state for a committed position: restart the context
            self.pending, self.fed = [], []
            self.cache = self.layer.make_cache()
        self.clear_tap(keep_last=queued)


class MTP(SpeculativeMethod):
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
        lengths: drafts of every draft decision of the last generation (0: it
            chose a one-token step; plain mode's further steps are not listed).

    Raises:
        InvalidArgumentError: bad depth, max_depth, draft_cost or hidden_state.
    """

    name = "mtp"
    lossless = True
    chain_shaped = True
    #: drafts a re-probe verifies even when the policy says none pay
    REPROBE_DRAFT = 2

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

    def prepare(self, engine: Engine) -> None:
        self.drafter.prepare(engine, self.heads)
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

    def begin(self, engine: Engine, prompt: list[int], sampler: Sampler | None) -> None:
        super().begin(engine, prompt, sampler)
        self.drafter.begin(engine, prompt)
        self.begin_budget(engine, sampler, self.auto)
        self.acceptance = DepthAcceptance()
        self.lengths = []

    def _length(self) -> int | None:
        """This step's chain length (None: a one-token step, plain mode)."""
        b = self.budget
        if b is None:
            return self.depth
        values = chain_values(self.acceptance.qs(self.depth))
        n, rate = best_prefix(b.curve, values, 1, item_cost=self.draft_cost)
        if self._reprobe or b.cheap(1 + self.REPROBE_DRAFT):  # re-probe, or nearly free
            return max(n, min(self.depth, self.REPROBE_DRAFT))
        if not b.pays(rate):
            b.go_plain(1 + self.REPROBE_DRAFT)
            return None
        return n

    def propose(self, engine: Engine, root: int) -> Draft | None:
        n = self._length()
        if n is None:
            self.lengths.append(0)
            return None
        drafts = self.drafter.draft(engine, n)
        self.lengths.append(len(drafts))
        return Draft.chain(root, drafts, hidden=True)

    def observe_plain(self, engine: Engine, tokens: list[int]) -> None:
        self.drafter.plain(tokens, queued=self.plain_steps.ntp._next is not None)

    def observe(self, engine: Engine, draft: Draft, verified: Verified) -> None:
        a = len(verified.path)
        self.depth_drafted[: draft.drafted] += 1
        self.depth_accepted[:a] += 1
        if self.budget is not None and draft.drafted:
            if self._reprobe_step and a == draft.drafted:
                self.acceptance.reset()  # the text changed: old rates no longer apply
            self.acceptance.record(draft.drafted, a)
        self.drafter.verified(verified.hidden, verified.tokens)

    def acceptance_per_depth(self) -> list[float]:
        """Share of drafts accepted at each depth 1..k (NaN where none was drafted)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return (self.depth_accepted / self.depth_drafted).tolist()
