"""``lookahead``: lookahead decoding (LADE), a training-free n-gram baseline.

Fu, Bailis, Stoica, Zhang, *Break the Sequential Dependency of LLM Inference
Using Lookahead Decoding* (ICML 2024, arXiv 2402.02057), §3. Read top to bottom:

1. A 2D *lookahead window* of ``N - 1`` levels x ``W`` columns holds past
   Jacobi trajectories (N = ``level``, W = ``window``). Level 0 starts as W
   tokens drawn from the prompt; the window fills one level per step.
2. Every step is ONE forward pass over the root (the last committed token), the
   *verification branch* and the *lookahead branch*. With the LADE attention
   pattern (paper Fig. 2b) the lookahead branch is itself a tree: level-0
   column j follows level-0 columns 0..j-1 (a causal chain after the root), and
   level-l column j follows level-(l-1) column j (the diagonal). So a token at
   level l, column j sits at position ``L + 1 + j + l`` and sees the cache, the
   root, level 0 up to column j and its own column above it. That is exactly a
   parent-indexed tree mask, so :meth:`Engine.forward_tree` runs it unchanged.
3. The outputs at the last level are one Jacobi update: ``out[j]`` continues
   the diagonal ``level0[j], level1[j], ..., level_{N-2}[j]``. Once the window
   is full, each column gives an N-gram whose first token is the key and whose
   N-1 other tokens enter the *n-gram pool* (at most ``guess`` per key, most
   recent first). Then the window shifts: level l <- level l+1, last level <-
   ``out`` (the paper's shift by one step).
4. The verification branch holds up to G = ``guess`` pool entries keyed by the
   root, laid out as a trie from the root (entries sharing a prefix share
   slots). Verification walks that trie with the target tokens (greedy argmax
   or the same sampler as plain decoding), so the output is exactly plain
   decoding's (lossless; deterministic drafts keep the target distribution at
   temperature > 0): the shared stage :mod:`mlx_mtp.speculative` does it.
   Only the root and the accepted path stay in the KV cache; the lookahead
   branch is dropped every step.

Block complexity (tokens per forward) is ``1 + (N - 1) * (W + G)``: 57 at the
paper's defaults N=5, W=7, G=7 (the verification branch may be smaller when the
pool has fewer entries or they share prefixes).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from ..acceptance import chain_values
from ..context import Context
from ..families import check_tree_support
from ..offers import Item, Offer, PlainResult
from ..sources.pool import JACOBI_EXTRA, NGramPool, build_trie
from ..speculative import Draft, Verified
from ..verify import Sampler
from .base import DraftMethod, parse_int


def lookahead_parents(levels: int, window: int, offset: int) -> np.ndarray:
    """Parent slots of the lookahead branch (LADE Fig. 2b attention as a tree).

    Slots are laid out level by level, column by column, starting at slot
    ``offset``. Level-0 column 0 hangs off the root (slot 0), level-0 column j
    off level-0 column j-1, level-l column j off level-(l-1) column j.

    Returns:
        (levels * window,) int64 parent slot indices.
    """
    par = np.empty((levels, window), dtype=np.int64)
    for lv in range(levels):
        for j in range(window):
            if lv == 0:
                par[lv, j] = 0 if j == 0 else offset + j - 1
            else:
                par[lv, j] = offset + (lv - 1) * window + j
    return par.reshape(-1)


class Lookahead(DraftMethod):
    """Lookahead decoding with a lossless verification branch.

    Args:
        level: N, the n-gram size (the window has N - 1 levels); 5 in the paper.
        window: W, Jacobi columns per level; 7 in the paper. ``"auto"``
            (default): the widest W <= 7 whose lookahead step (its pass on
            this device's cost curve, :mod:`mlx_mtp.costs`, and the host work
            the last generation's lookahead steps measured, the host term of
            :mod:`mlx_mtp.planner`) costs at most ``AUTO_WINDOW_COST`` more
            than a plain step; 0 where even one column costs more (a CPU):
            then no Jacobi branch runs and every step is a pipelined
            one-token step, as in ``ntp``.
        guess: G, pool candidates verified per step (and kept per key); 7.
            ``"auto"`` (default): up to 7, cut per step by the planner to the
            candidates whose expected accepted tokens pay for their slots.
        seed: seed of the random prompt tokens that start level 0.

    Raises:
        InvalidArgumentError: an option out of range (level >= 2, window >= 1,
            guess >= 1).
    """

    name = "lookahead"
    lossless = True
    #: the extra cost (fraction of a one-token forward) ``window="auto"`` allows
    AUTO_WINDOW_COST = JACOBI_EXTRA
    #: the paper's W and G: the caps of ``"auto"``
    PAPER_WINDOW = PAPER_GUESS = 7

    def __init__(self, level: Any = 5, window: Any = "auto", guess: Any = "auto", seed: Any = 0):
        self.level = parse_int("level", level, 2, 16)
        self.auto_window = str(window) == "auto"
        self.window = self.PAPER_WINDOW if self.auto_window else parse_int("window", window, 1, 64)
        self.auto_guess = str(guess) == "auto"
        self.guess = self.PAPER_GUESS if self.auto_guess else parse_int("guess", guess, 1, 64)
        self.seed = parse_int("seed", seed, 0)
        self.auto = self.auto_window or self.auto_guess

    @property
    def block_complexity(self) -> int:
        return 1 + (self.level - 1) * (self.window + self.guess)

    def describe(self) -> str:
        w = str(self.window)
        if self.auto_window:  # the chosen width once a generation has begun
            w = f"auto={self.window}" if hasattr(self, "levels") else "auto"
        g = f"auto<={self.guess}" if self.auto_guess else str(self.guess)
        return f"lookahead(level={self.level}, window={w}, guess={g})"

    def settings_key(self) -> str:
        w = "auto" if self.auto_window else str(self.window)
        return f"lookahead(level={self.level}, window={w}, guess={self.auto_guess or self.guess})"

    def prepare(self, ctx: Context) -> None:
        check_tree_support(ctx.engine.model, self.name)

    def begin(self, ctx: Context, prompt: list[int], sampler: Sampler | None) -> None:
        super().begin(ctx, prompt, sampler)
        if self.auto_window:  # the widest window that is nearly free on this device
            # (its pass and the host work of a lookahead step, as measured, against
            # a plain step's time)
            host, plain = ctx.budget.host_cost, ctx.budget.plain_cost
            self.window = 0
            for w in range(self.PAPER_WINDOW, 0, -1):
                step = ctx.curve(1 + (self.level - 1) * w) + host
                if step <= (1.0 + self.AUTO_WINDOW_COST) * plain:
                    self.window = w
                    break
        rng = np.random.default_rng(self.seed)
        # level 0: W tokens drawn from the prompt (LADE's initialisation)
        self.levels: list[np.ndarray] = [rng.choice(np.asarray(prompt), size=self.window)]
        self.pool = NGramPool(self.guess)

    def propose(self, ctx: Context, root: int) -> Offer:
        n_lv, w = len(self.levels), self.window
        if w == 0:  # window=auto found no column worth its cost: one-token steps
            return Offer([], None)
        # verification branch: trie of the pool's candidates for the root. Candidate
        # i is worth its new trie nodes' chance of acceptance (per-depth rates
        # learned online), halved per rank (the candidates are alternatives), and
        # costs those nodes' slots
        cand = self.pool.get(int(root), self.guess)
        acc = ctx.acceptance
        seen: set[tuple[int, ...]] = set()
        items = []
        for i, c in enumerate(cand):
            chain = chain_values(acc.qs("lookahead", len(c)))
            new = [d for d in range(len(c)) if c[: d + 1] not in seen]
            seen.update(c[: d + 1] for d in range(len(c)))
            items.append(Item(sum(chain[d] for d in new) * 0.5**i, len(new)))

        def build(n: int) -> Draft:
            v_toks, v_par = build_trie(cand[:n])
            n_v = 1 + len(v_toks)
            depth = [0]
            for p in v_par:
                depth.append(depth[p + 1] + 1)
            # lookahead branch: the current window, level by level
            la_toks = np.concatenate(self.levels).astype(np.int64)
            parents = np.concatenate(
                [[-1], [p + 1 for p in v_par], lookahead_parents(n_lv, w, n_v)]
            ).astype(np.int64)
            slot_tokens = np.concatenate([[root], v_toks, la_toks]).astype(np.int64)
            last = n_v + (n_lv - 1) * w  # first slot of the window's last level

            def jacobi(logits: mx.array, hidden: Any, targets: Any) -> list[mx.array]:
                # Jacobi update: greedy outputs at the window's last level
                return [mx.argmax(logits[last : last + w], axis=-1)]

            tags = [[("lookahead", d, 1.0)] for d in depth[1:]]
            return Draft(slot_tokens, parents, verify=n_v, extras=jacobi, tags=tags)

        # the Jacobi window goes in every pass: the planner cuts only the guesses
        return Offer(items, build, base_slots=1 + n_lv * w, required=True)

    def observe(self, ctx: Context, draft: Draft | None, result: Verified | PlainResult) -> None:
        if draft is not None:
            self._update_window(np.array(result.extras[0], dtype=np.int64))

    def _update_window(self, out: np.ndarray) -> None:
        """Add the new level; once the window is full, harvest N-grams and shift."""
        if len(self.levels) < self.level - 1:
            self.levels.append(out)
            return
        grams = np.stack([*self.levels, out], axis=1)  # (W, N): one N-gram per column
        for g in grams.tolist():
            self.pool.add(g[0], tuple(g[1:]))
        self.levels = [*self.levels[1:], out]
