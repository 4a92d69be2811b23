"""The one verification stage every lossless method shares.

A lossless method only *proposes* (:class:`Draft`: a tree or chain of slots
after the root) and *observes* the outcome (:class:`Verified`). Everything that
makes the output exact lives in :func:`speculative_step`, in this order:

1. forward: one pass over the draft (:meth:`Engine.forward_chain` for a chain,
   :meth:`Engine.forward_tree` for a tree with mask slots), started without
   waiting (``wait=False``);
2. targets: while the device runs, build the graph of the target token at
   every verified slot (argmax, or one draw of the sampler at that slot's
   sequence position) and the method's extra graphs (top-k of mask rows, MTP
   heads), then one synchronisation (:meth:`Engine.timed_eval`);
3. walk: from the root, follow the child whose token equals its parent's
   target (:func:`~mlx_mtp.verify.walk_tree`); the deepest accepted slot's
   target is the bonus token;
4. keep: only the root and the accepted path stay in the KV cache
   (:meth:`Engine.keep`).

Greedy: the committed tokens equal plain greedy decoding's (ESP §3.3;
Medusa/EAGLE tree verification). Sampling: each committed token is a draw of
the target distribution given the committed prefix (SpecInfer-style tree
sampling with deterministic drafts), see :mod:`mlx_mtp.verify`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from .acceptance import Tag
from .engine import Engine
from .verify import Sampler, target_graph, walk_tree

#: ``extras(logits, hidden, targets)`` -> graphs evaluated with the target tokens
Extras = Callable[[mx.array, "mx.array | None", mx.array], Sequence[mx.array]]


@dataclass
class Draft:
    """What a lossless method proposes for one step.

    Attributes:
        tokens: (N,) int64 token id of every slot. Slot 0 is the root (the last
            committed token, not yet in the cache); -1 marks a mask slot, which
            is never accepted.
        parents: (N,) int64 parent slot of every slot (-1 for the root; a
            parent comes before its children). None: a chain, each slot the
            child of the one before, run as one causal forward pass (no tree
            mask; the cheapest layout for one candidate).
        embeddings: (N, D) input embeddings of the slots (mask vectors at the
            -1 slots); None: the embeddings of ``tokens`` (then every slot
            must be a token). Trees only.
        verify: the first ``verify`` slots are the verified tree (root and
            draft nodes; later slots, such as mask slots or lookahead's Jacobi
            window, are carried but never accepted). None: all N slots.
        logit_rows: compute logits only for the first ``logit_rows`` slots
            (trees only; the LM head over the vocabulary is a large share of a
            small model's forward). None: all; must be >= ``verify``.
        hidden: also hand the hidden states (N, D) to :meth:`observe
            <mlx_mtp.methods.base.DraftMethod.observe>`.
        extras: ``f(logits, hidden, targets)`` -> more graphs to build while
            the forward pass runs and to evaluate in the same synchronisation
            as the target tokens (lazy (V,)-wide work: top-k of mask rows, MTP
            heads fed with the target tokens). ``targets`` is the lazy (verify,)
            target-token array.
        tags: per verified draft node (slot 1 .. ``verify - 1``), the
            sources that proposed it as ``(source, depth, raw score)``: the
            planner learns their acceptance from the outcome. None: nothing
            to learn.
        info: anything the method wants back in ``observe``.
    """

    tokens: np.ndarray
    parents: np.ndarray | None = None
    embeddings: mx.array | None = None
    verify: int | None = None
    logit_rows: int | None = None
    hidden: bool = False
    extras: Extras | None = None
    tags: list[list[Tag]] | None = None
    info: Any = None

    @classmethod
    def chain(cls, root: int, drafts: Sequence[int], **kw: Any) -> Draft:
        """A chain ``[root, *drafts]`` verified in one causal forward pass."""
        return cls(np.array([root, *drafts], dtype=np.int64), **kw)

    @property
    def n_verify(self) -> int:
        """Slots of the verified tree (root included)."""
        return len(self.tokens) if self.verify is None else self.verify

    @property
    def drafted(self) -> int:
        """Draft tokens sent to verification (the root is not a draft)."""
        return self.n_verify - 1

    def parent_slots(self) -> np.ndarray:
        """(N,) parent slot of every slot (a chain's too)."""
        if self.parents is None:
            return np.arange(-1, len(self.tokens) - 1, dtype=np.int64)
        return self.parents


@dataclass
class Verified:
    """The outcome of :func:`speculative_step`.

    Attributes:
        start: cache offset before the step (the root's position).
        path: accepted slots in order, root excluded (a path of the draft tree).
        bonus: the target token at the deepest accepted slot (always committed).
        tokens: committed ids, ``[tokens of path..., bonus]``; now in the cache
            are the root and the path's tokens (the bonus is the next root).
        targets: (verify,) int64 target token at every verified slot (the
            slots on no accepted path too: useful as the model's own
            predictions, e.g. hybrid's pool).
        logits: (N or logit_rows, V) logits of the pass (evaluated).
        hidden: (N, D) hidden states if the draft asked for them, else None.
        extras: the draft's extra graphs, evaluated.
    """

    start: int
    path: list[int]
    bonus: int
    tokens: list[int]
    targets: np.ndarray
    logits: mx.array
    hidden: mx.array | None = None
    extras: list[mx.array] = field(default_factory=list)

    @property
    def deepest(self) -> int:
        """The deepest accepted slot (0: the root, nothing accepted)."""
        return self.path[-1] if self.path else 0


def speculative_step(engine: Engine, draft: Draft, sampler: Sampler | None) -> Verified:
    """Forward pass over ``draft``, target tokens, tree walk, keep the accepted
    path: one lossless step (see the module docstring).

    Args:
        engine: the engine; its cache holds the committed tokens but the root.
        draft: the proposal; slot 0 must be the root.
        sampler: None for greedy decoding, else the sampler of plain decoding
            (an mlx-lm sampler or a PositionalSampler).

    Returns:
        The :class:`Verified` outcome; on return the cache holds the root and
        the accepted path.

    Raises:
        CacheNotTrimmableError: the cache could not drop the rejected slots
            (refused before the pass: a full sliding window, recurrent layers).
        InvalidArgumentError: the pass would not fit in memory.
    """
    tokens = draft.tokens
    n = draft.n_verify
    start = engine.offset
    parents = draft.parent_slots()
    if draft.parents is None:  # a chain: one causal pass, no tree mask
        logits, hidden = engine.forward_chain(
            tokens.tolist(), hidden=draft.hidden, wait=False, droppable=len(tokens) > 1
        )
    else:
        emb = draft.embeddings if draft.embeddings is not None else engine.embed_tokens(tokens)
        logits, hidden = engine.forward_tree(
            emb, parents, tokens.tolist(), draft.hidden, draft.logit_rows, wait=False
        )
    # built while the device runs the pass; one synchronisation for all of it
    verify_logits = logits if logits.shape[0] == n else logits[:n]
    targets = target_graph(verify_logits, np.arange(n), sampler, engine.slot_positions[:n] + 1)
    extras = list(draft.extras(logits, hidden, targets)) if draft.extras is not None else []
    engine.timed_eval(targets, *extras)
    tgt = np.array(targets, dtype=np.int64)
    path, bonus = walk_tree(parents[:n], tokens[:n], dict(enumerate(tgt.tolist())))
    engine.keep(start, [0, *path])
    committed = [int(tokens[s]) for s in path] + [int(bonus)]
    if engine.logprobs is not None:  # each committed token from its parent slot's row
        engine.logprobs.record(logits[mx.array([0, *path])], committed)
    return Verified(start, path, int(bonus), committed, tgt, logits, hidden, extras)
