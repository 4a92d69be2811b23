"""The numerical check of the multi-slot forward pass: a draft tree (or chain)
through :class:`~mlx_mtp.engine.Engine` against one-token decoding.

One check serves ``mlx-mtp doctor`` (on this device, the user's model) and the
tests (``tests/test_families.py``: every tree family's tiny model): the logits
of one :meth:`Engine.forward_tree <mlx_mtp.engine.Engine.forward_tree>` pass
(per-slot RoPE positions, the tree mask through the cache views) or chain pass
must equal, slot by slot, the logits mlx-lm's own model and caches give when
the slot's root-to-slot path is decoded one token at a time after the same
context (:class:`OneTokenDecoding`, which shares nothing with the engine but
the model); and after :meth:`Engine.keep <mlx_mtp.engine.Engine.keep>` of one
path, the next token's logits must equal that path's one-token decoding
(:func:`check_keep`: rows moved in place, a sliding window's ring, recurrent
state rolled back).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

if TYPE_CHECKING:
    from .engine import Engine


@dataclass
class Check:
    """One check's result.

    Attributes:
        name: what was compared: ``tree`` (a draft tree), ``chain`` (a causal
            chain: recurrent models, models without tree support) or the name
            given to :func:`check_keep` (``rollback``: one token decoded after
            a chain pass was kept to ``keep`` of its ``n`` tokens).
        n: slots of the checked forward pass.
        depth: deepest slot of it (0 = the root alone); for a keep check, the
            kept path's length.
        rows: logit rows compared (``n``; 1 for a keep check).
        error: max |checked - one-token decoding| / max |one-token logits|,
            over those rows and the whole vocabulary.
        argmax: rows whose greedy token agrees (a near-tie may differ within
            the tolerance).
        tolerance: the largest ``error`` that passes.
        keep: slots kept of the pass (keep checks).
    """

    name: str
    n: int
    depth: int
    rows: int
    error: float
    argmax: int
    tolerance: float
    keep: int = 0

    @property
    def ok(self) -> bool:
        """Whether the error is within the tolerance."""
        return self.error <= self.tolerance

    def line(self) -> str:
        """The report line of this check (``mlx-mtp doctor``)."""
        kept = self.keep > 0
        what = f"n={self.n}" + (f" keep {self.keep}" if kept else "")
        return (
            f"  {self.name:9s}{what:13s} depth {self.depth:2d}  rel err {self.error:.1e}  "
            f"argmax {self.argmax}/{self.rows}  {'ok' if self.ok else 'FAILED'}"
        )


def random_tree(n: int, seed: int) -> list[int]:
    """Parents of a tree of ``n`` slots: each slot hangs under one of the
    three slots before it (seeded), so the tree has long chains and branches
    at once (64 slots: depth 20-30)."""
    rng = np.random.default_rng(seed)
    return [-1] + [int(rng.integers(max(0, i - 3), i)) for i in range(1, n)]


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of every slot (parents come before their children)."""
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def path_to(parents: Sequence[int], slot: int) -> list[int]:
    """The slots from the root to ``slot``, in order."""
    path = []
    while slot >= 0:
        path.append(slot)
        slot = int(parents[slot])
    return path[::-1]


def logit_rows(x: mx.array) -> np.ndarray:
    """(rows, V) float32 numpy logits of an MLX array."""
    return np.array(x.astype(mx.float32)).reshape(-1, x.shape[-1])


class OneTokenDecoding:
    """mlx-lm's own model and caches (``make_prompt_cache``) fed one token at
    a time: the logits each token gets in plain one-token decoding (the window
    it sees there, the recurrent state it reads), after a fixed context fed
    once; each query decodes from a copy of the context's caches.

    Args:
        model: an mlx-lm model.
        context: token ids decoded first.
    """

    def __init__(self, model: Any, context: Sequence[int]):
        from mlx_lm.models.cache import make_prompt_cache

        self.model = model
        self.cache = make_prompt_cache(model)
        for t in context:
            model(mx.array([[int(t)]]), cache=self.cache)
            mx.eval([c.state for c in self.cache])

    def _step(self, token: int, cache: list[Any]) -> np.ndarray:
        row = self.model(mx.array([[int(token)]]), cache=cache)[0, -1]
        mx.eval(row, [c.state for c in cache])
        return logit_rows(row)[0]

    def path(self, tokens: Sequence[int]) -> np.ndarray:
        """(len(tokens), V) logits of ``tokens`` decoded in order after the context."""
        cache = copy.deepcopy(self.cache)
        return np.stack([self._step(t, cache) for t in tokens])

    def tree(self, parents: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """(N, V) logits of every slot of a tree, each decoded after its
        ancestors' tokens (depth first; a branch decodes from a copy of its
        parent's caches)."""
        children: list[list[int]] = [[] for _ in parents]
        roots = []
        for i, p in enumerate(parents):
            (roots if p < 0 else children[p]).append(i)
        out: list[Any] = [None] * len(parents)
        # (slot, caches holding the context and the path to its parent)
        stack = [(r, copy.deepcopy(self.cache)) for r in reversed(roots)]
        while stack:
            v, cache = stack.pop()
            out[v] = self._step(tokens[v], cache)
            kids = children[v]
            for i, c in enumerate(reversed(kids)):  # the first child pops first
                stack.append((c, cache if i == len(kids) - 1 else copy.deepcopy(cache)))
        return np.stack(out)


def multi_slot_logits(
    engine: Engine, parents: Sequence[int], tokens: Sequence[int], chain: bool = False
) -> np.ndarray:
    """(N, V) logits of one forward pass of the slots after the engine's
    cache: :meth:`Engine.forward_tree <mlx_mtp.engine.Engine.forward_tree>`
    over the tree, or with ``chain`` (``parents`` a chain) one causal pass
    (:meth:`Engine.forward_chain <mlx_mtp.engine.Engine.forward_chain>`; on a
    recurrent model that takes input embeddings, ``forward_tree`` of the
    chain). The slots stay in the cache (drop them with ``trim_to`` or
    :meth:`Engine.keep <mlx_mtp.engine.Engine.keep>`)."""
    from mlx_lm.utils import does_model_support_input_embeddings

    tokens = [int(t) for t in tokens]
    embeddings = engine.embed is not None and does_model_support_input_embeddings(engine.model)
    if not chain or (engine.rollback is not None and embeddings):
        logits, _ = engine.forward_tree(engine.embed_tokens(tokens), np.array(parents), tokens)
    else:
        logits, _ = engine.forward_chain(tokens, droppable=True)
    return logit_rows(logits)


def compare(
    name: str,
    got: np.ndarray,
    ref: np.ndarray,
    n: int,
    depth: int,
    tolerance: float,
    keep: int = 0,
) -> Check:
    """The :class:`Check` of logits ``got`` against ``ref`` (rows, V)."""
    err = float(np.max(np.abs(got - ref)) / max(float(np.max(np.abs(ref))), 1e-30))
    agree = int(np.sum(np.argmax(got, axis=-1) == np.argmax(ref, axis=-1)))
    return Check(name, n, depth, int(ref.shape[0]), err, agree, tolerance, keep)


def check_pass(
    engine: Engine,
    reference: OneTokenDecoding,
    parents: Sequence[int],
    tokens: Sequence[int],
    tolerance: float,
    chain: bool = False,
) -> Check:
    """One multi-slot pass (:func:`multi_slot_logits`) against one-token
    decoding of every slot's path; the engine's cache is trimmed back to the
    context afterwards.

    Args:
        engine: an engine whose cache holds exactly the reference's context.
        reference: one-token decoding after that context.
        parents: (N,) parent slot of every slot (-1 for the root); a chain
            (``-1, 0, 1, ...``) with ``chain``.
        tokens: N token ids.
        tolerance: the largest relative error that passes.
        chain: run a causal chain pass instead of a tree pass.
    """
    start = engine.offset
    got = multi_slot_logits(engine, parents, tokens, chain)
    engine.trim_to(start)
    ref = reference.tree(parents, tokens)
    name = "chain" if chain else "tree"
    return compare(name, got, ref, len(parents), max(depths(parents)), tolerance)


def check_keep(
    engine: Engine,
    reference: OneTokenDecoding,
    parents: Sequence[int],
    tokens: Sequence[int],
    slot: int,
    next_token: int,
    tolerance: float,
    chain: bool = False,
    name: str = "keep",
) -> Check:
    """One multi-slot pass, :meth:`Engine.keep
    <mlx_mtp.engine.Engine.keep>` of the path to ``slot`` (a branch of a tree,
    a prefix of a chain), then ``next_token`` decoded: its logits against
    one-token decoding of that path and ``next_token``. The engine's cache
    then holds the context, the kept path and ``next_token``: rebuild it
    before the next check (a recurrent model cannot trim a one-token pass).
    """
    start = engine.offset
    multi_slot_logits(engine, parents, tokens, chain)
    kept = path_to(parents, slot)
    engine.keep(start, kept)
    got = logit_rows(engine.forward_chain([int(next_token)])[0])
    ref = reference.path([tokens[i] for i in kept] + [int(next_token)])[-1:]
    return compare(name, got, ref, len(parents), len(kept), tolerance, len(kept))


#: the tree of the pipelined check's first pass (slot 0 the root): two
#: branches, the deeper one accepted (slots 0, 1, 3, 5)
LAZY_TREE = (-1, 0, 0, 1, 2, 3, 1)
#: the accepted path of :data:`LAZY_TREE`
LAZY_PATH = (0, 1, 3, 5)
#: slots of the pipelined check's second pass (a chain)
LAZY_CHAIN = 5


def check_lazy_passes(
    model: Any, context: Sequence[int], tolerance: float, seed: int = 0
) -> list[Check]:
    """The passes of a pipelined step (:meth:`Engine.forward_at
    <mlx_mtp.engine.Engine.forward_at>`: keys and values written with
    ``mx.slice_update`` at a cache row the host has not read, the attention
    mask built on the device, one RoPE offset per token) against the
    engine's passes at a known length, as the pipeline runs them:

    1. ``at-tree``: a tree pass (:data:`LAZY_TREE`) at a lazy row ``at``
       against :meth:`Engine.forward_tree
       <mlx_mtp.engine.Engine.forward_tree>` after the same context; its
       accepted path's rows are then moved to ``at + 1, ...`` on the device
       (:meth:`Engine.move_rows_at <mlx_mtp.engine.Engine.move_rows_at>`),
       and the pass is started (``mx.async_eval``) before the next is built.
    2. ``at-chain``: a chain pass at ``at + len(path)``, a lazy sum read from
       no host value, against :meth:`Engine.forward_chain
       <mlx_mtp.engine.Engine.forward_chain>` after the context and the
       accepted path.
    3. ``settled``: after :meth:`Engine.settle_at
       <mlx_mtp.engine.Engine.settle_at>` the cache decodes one token as a
       fresh cache that was given the same tokens.

    Each engine is new (its buffers hold nothing a wrong write could
    happen to match). ``model`` must run pipelined passes
    (:meth:`Engine.lazy_ready <mlx_mtp.engine.Engine.lazy_ready>`).

    Returns:
        The three checks.
    """
    from .engine import Engine, ancestors

    rng = np.random.default_rng(seed)
    vocab = 256
    try:
        from .families import model_parts

        vocab = int(model_parts(model)[2].weight.shape[0])
    except Exception:  # no token embedding found: ids below 256
        pass
    context = [int(t) for t in context]
    parents = np.array(LAZY_TREE)
    tree = rng.integers(1, vocab, len(parents)).tolist()
    chain = rng.integers(1, vocab, LAZY_CHAIN).tolist()
    path = list(LAZY_PATH)
    committed = [tree[s] for s in path]
    anc, depth = ancestors(parents)
    L, n = len(context), len(parents)

    eng = Engine(model)
    if not eng.lazy_ready():  # (which also gives the model's RoPE per-token positions)
        raise ValueError("this model's cache or family does not run pipelined passes")
    # the references: passes at a length the host knows, each on a new engine
    ref = Engine(model)
    ref.sync(context)
    ref_tree = logit_rows(ref.forward_tree(ref.embed_tokens(tree), parents, tree)[0])
    ref = Engine(model)
    ref.sync(context + committed)
    ref_chain = logit_rows(ref.forward_chain(chain)[0])
    after = int(rng.integers(1, vocab))
    ref_next = logit_rows(ref.forward_chain([after])[0])

    # the pipelined passes: lengths as device arrays, one pass in flight
    eng.sync(context)
    at = mx.array(L - 1, dtype=mx.int32) + 1  # a lazy length, as a step's result
    rows = L + n
    logits_t, views = eng.forward_at(mx.array(tree, dtype=mx.int32), at, rows, mx.array(anc), depth)
    eng.move_rows_at(views, mx.array(path[1:], dtype=mx.int32), at + 1)
    cache = [a for c in eng.cache for a in (c.keys, c.values)]
    mx.async_eval(logits_t, *cache)
    at2 = at + mx.array(len(path), dtype=mx.int32)
    logits_c, _ = eng.forward_at(mx.array(chain, dtype=mx.int32), at2, rows + LAZY_CHAIN)
    got_tree, got_chain = logit_rows(logits_t), logit_rows(logits_c)
    eng.settle_at(context + committed + chain)
    got_next = logit_rows(eng.forward_chain([after])[0])

    deepest = int(depth.max())
    return [
        compare("at-tree", got_tree, ref_tree, n, deepest, tolerance),
        compare("at-chain", got_chain, ref_chain, LAZY_CHAIN, LAZY_CHAIN - 1, tolerance),
        compare("settled", got_next, ref_next, 1, 0, tolerance),
    ]
