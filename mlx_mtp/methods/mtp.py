"""``mtp``: draft with the checkpoint's own MTP layer, verify with the backbone.

Qwen3.5 / Qwen3.6 and Qwen3-Next checkpoints ship one multi-token-prediction
layer under ``mtp.*`` (see :mod:`mlx_mtp.native_mtp`). Each step:

1. Catch up: feed the MTP layer the pairs ``(h_i, t_{i+1})`` of every position
   committed since the last step (backbone hidden state at i from the last
   verify pass, token i+1 committed there); the layer keeps its own KV cache
   over these positions. Its output at the last pair, through the backbone's
   LM head, is draft 1 (the token after the root).
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
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..engine import Engine
from ..errors import InvalidArgumentError, UnsupportedModelError
from ..native_mtp import HIDDEN_STATES, install_hidden_tap, load_native_mtp
from ..speculative import Draft, Verified
from ..verify import Sampler
from .base import SpeculativeMethod, parse_int


class MTP(SpeculativeMethod):
    """Native MTP-layer drafting (see module doc).

    Args:
        depth: drafts per step, 1..16 (the layer is trained for depth 1 and
            re-fed beyond it). Default 2.
        hidden_state: ``"final-norm"`` (what the public runtimes feed) or
            ``"pre-norm"`` (the last decoder layer's output before the final
            norm).
        heads: a folder holding the ``mtp.*`` safetensors; default the model's
            own checkpoint folder.

    Attributes:
        depth_drafted, depth_accepted: (depth,) counts per draft depth since
            :meth:`prepare` (acceptance per depth = accepted / drafted).

    Raises:
        InvalidArgumentError: bad depth or hidden_state.
    """

    name = "mtp"
    lossless = True
    chain_shaped = True

    def __init__(self, depth: Any = 2, hidden_state: str = "final-norm", heads: Any = None):
        self.depth = parse_int("depth", depth, 1, 16)
        if hidden_state not in HIDDEN_STATES:
            raise InvalidArgumentError(
                f"option hidden_state must be one of {', '.join(HIDDEN_STATES)}, got "
                f"{hidden_state!r}"
            )
        self.hidden_state = hidden_state
        self.heads = heads
        self.depth_drafted = np.zeros(self.depth, dtype=np.int64)
        self.depth_accepted = np.zeros(self.depth, dtype=np.int64)

    @property
    def block_complexity(self) -> int:
        return self.depth + 1

    def describe(self) -> str:
        extra = "" if self.hidden_state == "final-norm" else f", hidden_state={self.hidden_state}"
        return f"mtp(depth={self.depth}{extra})"

    def prepare(self, engine: Engine) -> None:
        loaded = getattr(engine, "loaded", None)
        folder = self.heads if self.heads is not None else getattr(loaded, "path", None)
        if folder is None:
            raise UnsupportedModelError(
                "--method mtp needs the model's checkpoint folder (load it with mlx_mtp.load / "
                "--model), or the option heads=FOLDER holding its mtp.* tensors."
            )
        config = getattr(loaded, "config", None) if self.heads is None else None
        self.layer = load_native_mtp(Path(folder), engine.model, config)
        self.tap = install_hidden_tap(engine.model)
        self.cache = self.layer.make_cache()
        #: token t_p of every pair (h_{p-1}, t_p) in the MTP layer's cache, in order
        self.fed: list[int] = []
        self.pending: tuple[mx.array | None, list[int]] = (None, [])

    def _clear_tap(self) -> None:
        self.tap.inputs.clear()
        self.tap.outputs.clear()

    def _prefill_rows(self, r: int) -> mx.array | None:
        # the hidden states of the last ``r`` prefilled tokens: the trailing tap
        # records (the sync's chunks were the model's last forward passes)
        recs = self.tap.inputs if self.hidden_state == "pre-norm" else self.tap.outputs
        taken, n = [], 0
        for rec in reversed(recs):
            if n >= r:
                break
            taken.append(rec[0])
            n += rec.shape[1]
        if r == 0 or n != r:
            return None
        return mx.concatenate(taken[::-1], axis=0)

    def begin(self, engine: Engine, prompt: list[int], sampler: Sampler | None) -> None:
        super().begin(engine, prompt, sampler)
        # the prefill's hidden states: positions L-1-R .. L-2
        h = self._prefill_rows(getattr(engine, "last_prefill", 0))
        self._clear_tap()
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
        self.pending = (h, list(prompt[common + 1 : n]))

    def _draft(self, engine: Engine) -> list[int]:
        h, toks = self.pending
        if not toks:
            return []
        o = self.layer(h[None], engine.embed_tokens(toks)[None], self.cache)[0]
        self.fed += toks
        last = o[-1:]
        d = mx.argmax(engine.lm_head(last), axis=-1)
        drafts = [d]
        for _ in range(1, self.depth):
            last = self.layer(last[None], engine.embed(d)[None], self.cache)[0]
            d = mx.argmax(engine.lm_head(last), axis=-1)
            drafts.append(d)
        engine.timed_eval(*drafts)
        if self.depth > 1:  # the speculative entries of depths 2..k
            for c in self.cache:
                c.trim(self.depth - 1)
        return [int(x.item()) for x in drafts]

    def propose(self, engine: Engine, root: int) -> Draft:
        drafts = self._draft(engine)
        self._clear_tap()
        return Draft.chain(root, drafts, hidden=True)

    def observe(self, engine: Engine, draft: Draft, verified: Verified) -> None:
        a = len(verified.path)
        self.depth_drafted[: draft.drafted] += 1
        self.depth_accepted[:a] += 1
        if self.hidden_state == "pre-norm":
            rows = self.tap.inputs[-1][0, : a + 1]
        else:
            rows = verified.hidden[: a + 1]
        self._clear_tap()
        # the MTP layer's next pairs: (h_i, t_{i+1}) for the root and the accepted drafts
        self.pending = (rows, list(verified.tokens))

    def acceptance_per_depth(self) -> list[float]:
        """Share of drafts accepted at each depth 1..k (NaN where none was drafted)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return (self.depth_accepted / self.depth_drafted).tolist()
