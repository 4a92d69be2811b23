"""A checkpoint's own MTP layer as a draft source (Qwen3.5 / Qwen3.6,
Qwen3-Next ``mtp.*``, DeepSeek-V3 ``nextn``; the layer itself is
:mod:`mlx_mtp.native_mtp`).

Each draft: feed the layer the pairs ``(h_i, t_{i+1})`` of every position
committed since the last draft (backbone hidden state at i, token i+1; the
layer keeps its own KV cache over them); its output at the last pair, through
the backbone's LM head, is draft 1. Depth 2..k re-feed the layer its own
output with the token it drafted (``num_nextn_predict_layers`` = 1
checkpoints, as vLLM and SGLang do); these speculative entries are dropped
from the layer's cache afterwards. Used by ``mtp`` and ``hybrid``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx

from ..context import Context
from ..engine import Engine
from ..errors import UnsupportedModelError
from ..native_mtp import draft_cost_of, install_hidden_tap, native_layer_for

#: committed positions that may wait for the MTP layer while nothing is drafted
#: (hybrid whose other sources pay, the layer's do not): fed without drafting beyond
MAX_PENDING = 64


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

    def prepare(self, ctx: Context, heads: Any = None) -> None:
        """Load the layer (from ``heads`` or the model's checkpoint folder) and
        tap the backbone's hidden states.

        Raises:
            UnsupportedModelError: no checkpoint folder to read from, or a
                model type without a native MTP layer.
            ModelLoadError: no (or unfitting) MTP tensors.
        """
        engine, loaded = ctx.engine, ctx.loaded
        folder = heads if heads is not None else ctx.folder
        if folder is None:
            raise UnsupportedModelError(
                "the native MTP layer is read from the model's checkpoint folder (load it with "
                "mlx_mtp.load / --model), or from the option heads=FOLDER holding its mtp.* "
                "tensors."
            )
        config = getattr(loaded, "config", None) if heads is None else None
        self.layer = native_layer_for(Path(folder), engine.model, config)
        self.tap = install_hidden_tap(engine.model)
        self.cache = self.layer.make_cache()
        #: token t_p of every pair (h_{p-1}, t_p) in the MTP layer's cache, in order
        self.fed: list[int] = []
        self.pending: list[tuple[mx.array, list[int]]] = []
        self.draft_cost = draft_cost_of(self.layer, engine.model)

    @staticmethod
    def _eval(engine: Engine, *arrays: mx.array) -> None:
        # the layer's passes are device work beside the backbone's forward passes
        with engine.clock.beside():
            engine.timed_eval(*arrays)

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
        h = self._prefill_rows(engine.last_prefill)
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
                self._eval(engine, self._feed(engine))
            return []
        last = self._feed(engine)[-1:]
        d = mx.argmax(engine.lm_head(last), axis=-1)
        drafts = [d]
        for _ in range(1, depth):
            last = self.layer(last[None], engine.embed(d)[None], self.cache)[0]
            d = mx.argmax(engine.lm_head(last), axis=-1)
            drafts.append(d)
        self._eval(engine, *drafts)
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
