"""ESP's mask slots as a draft source (Goel et al., arXiv 2603.17942, §3.1-3.2).

Mask slots are vectors in the input-embedding space, not vocabulary tokens
(:class:`MaskVectors`). The k masks after a draft node predict the tokens 1..k
positions after it; their most probable tokens, per depth
(:func:`mask_candidates`), are the candidates the next draft tree grows from.
Used by ``probe`` (the paper's tree) and ``hybrid`` (one source among others).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from ..engine import Engine
from ..errors import InvalidArgumentError
from ..learned_masks import load_learned_masks
from ..pipeline import DeviceDrafter, Template
from ..tree import rank_tree
from ..verify import top_tokens


def mask_candidates(rows: mx.array, m: int, engine: Engine) -> list[tuple[np.ndarray, np.ndarray]]:
    """The ``m`` most probable tokens of each mask row, best first: the
    per-depth candidate lists that :func:`~mlx_mtp.allocate.build_tree` grows the
    next draft tree from (ESP §3.2).

    Args:
        rows: (k, V) float32 logits of the k mask slots after the deepest
            accepted node.
        m: candidates per row (clipped to [1, V]).
        engine: the top-k runs through ``engine.timed_eval`` (device time).

    Returns:
        k pairs (tokens (m,) int, probabilities (m,) float32), probabilities
        descending.
    """
    top, top_p = top_candidates(rows, m)
    engine.timed_eval(top, top_p)  # vocabulary-wide top-k on k rows: device work
    return candidate_lists(top, top_p)


def top_candidates(rows: mx.array, m: int) -> tuple[mx.array, mx.array]:
    """The graph (not evaluated) behind :func:`mask_candidates`: token ids
    (k, m) and their probabilities (k, m) float32 of the ``m`` most probable
    tokens of each row of ``rows`` (k, V), best first (the ids from
    :func:`~mlx_mtp.verify.top_tokens`)."""
    rows = rows.astype(mx.float32)
    top = top_tokens(rows, m)
    top_p = mx.exp(
        mx.take_along_axis(rows, top, axis=-1) - mx.logsumexp(rows, axis=-1, keepdims=True)
    )
    return top, top_p


def candidate_lists(top: mx.array, top_p: mx.array) -> list[tuple[np.ndarray, np.ndarray]]:
    """Evaluated :func:`top_candidates` output -> per-row (tokens, probabilities)
    sorted by probability descending."""
    out = []
    for toks, ps in zip(np.array(top), np.array(top_p)):
        order = np.argsort(-ps, kind="stable")
        out.append((toks[order], ps[order]))
    return out


class MaskVectors:
    """ESP's mask slots (§3.1): ``slots`` vectors in the input-embedding space
    that stand for "some token to come" after a draft node.

    ``init="mean"`` (the paper): every slot starts as the mean embedding of
    the prompt and moves towards each committed token ``e``:
    ``m <- m + lam * (e - m)``. ``init="learned"``: fixed per-slot vectors
    trained by ``mlx-mtp train masks`` for this model
    (:mod:`mlx_mtp.learned_masks`), never updated. Shared by ``probe`` and
    ``hybrid``.

    Args:
        slots: mask slots after a node (k).
        lam: update step in [0, 1] (0.1 in the paper).
        init: ``"mean"`` or ``"learned"``.

    Raises:
        InvalidArgumentError: lam not a number in [0, 1], unknown init.
    """

    def __init__(self, slots: int, lam: Any = 0.1, init: str = "mean"):
        try:
            self.lam = float(lam)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"option lam must be a number, got {lam!r}") from None
        if not 0.0 <= self.lam <= 1.0:
            raise InvalidArgumentError(f"option lam must be in [0, 1], got {self.lam}")
        if init not in ("mean", "learned"):
            raise InvalidArgumentError(f"mask_init must be 'mean' or 'learned', got {init!r}")
        self.slots = slots
        self.init = init
        #: (slots, D) learned vectors once :meth:`prepare` loaded them
        self.learned: mx.array | None = None
        #: (slots, D) current vectors, set by :meth:`begin`
        self.embedding: mx.array | None = None

    def prepare(self, engine: Engine) -> None:
        """Load the learned vectors for this model (``init="learned"``).

        Raises:
            CheckpointMismatchError, ModelNotFoundError: see
                :func:`~mlx_mtp.learned_masks.load_learned_masks`.
            InvalidArgumentError: the file has fewer slots than needed.
        """
        if self.init != "learned":
            return

        learned = load_learned_masks(engine.model)  # (slots, D), checked for this model
        if learned.shape[0] < self.slots:
            raise InvalidArgumentError(
                f"the learned mask file has {learned.shape[0]} slot(s); --masks "
                f"{self.slots} needs {self.slots}. Retrain with more slots."
            )
        self.learned = learned[: self.slots]

    def begin(self, engine: Engine, prompt: list[int]) -> None:
        """Start a generation: learned vectors, or the prompt's mean embedding.

        Raises:
            InvalidArgumentError: an empty prompt with ``init="mean"`` (no
                embedding to take the mean of).
        """
        if self.learned is not None:
            self.embedding = self.learned
        else:
            if not prompt:
                raise InvalidArgumentError(
                    "mask vectors start from the prompt's mean embedding; the prompt is empty"
                )
            mean = mx.mean(engine.embed_tokens(prompt), axis=0)
            self.embedding = mx.broadcast_to(mean, (self.slots, mean.shape[0]))

    def update(self, engine: Engine, tokens: list[int]) -> None:
        """``m <- m + lam (e - m)`` once per committed token, in order (mean
        init only; learned vectors stay fixed)."""
        if self.learned is not None:
            return
        e = engine.embed_tokens(tokens)  # (n, D)
        m, n, lam = self.embedding, len(tokens), self.lam
        if n == 1:
            self.embedding = m + lam * (e - m)
        else:  # the n updates in closed form: (1-lam)^n m + sum_i lam (1-lam)^(n-1-i) e_i
            w = mx.array([lam * (1 - lam) ** (n - 1 - i) for i in range(n)], dtype=e.dtype)
            self.embedding = (1 - lam) ** n * m + (w @ e)

    def sets(self, count: int, dtype: mx.Dtype) -> mx.array:
        """``count`` mask sets, one after another: (count * slots, D)."""
        return mx.tile(self.embedding.astype(dtype), (count, 1))


class MaskLayer:
    """ESP's mask slots in pipelined steps (:mod:`mlx_mtp.pipeline`): ``k``
    mask slots after every token slot of the steps that carry them, their
    vectors and the candidates they predict kept as lazy arrays (Goel et
    al., §3.1-3.2).

    After a step with mask slots, the masks after its deepest accepted slot
    give the next step's candidates: the ``top`` best tokens of mask j for
    depth j + 1 (:attr:`cands`). A step without them leaves no candidates
    (``cands`` is None until a step carries masks again). After every step
    the vectors move towards each committed token (``m <- m + lam (e -
    m)``, as :meth:`MaskVectors.update`; learned vectors stay fixed), all
    inside the step's graph.

    Args:
        vectors: the method's :class:`MaskVectors` (prepared).
        top: candidates kept per depth.

    Attributes:
        assume: the width policy's question "what if candidates were (True)
            or were not (False) there": :attr:`fresh` answers it instead of
            :attr:`cands` while set.
    """

    #: the vocabulary id every mask slot carries (:class:`TokenMaskLayer`);
    #: None: the slots are :attr:`vec`, vectors in the embedding space
    token: int | None = None

    def __init__(self, vectors: MaskVectors, top: int):
        self.vectors, self.k, self.top = vectors, vectors.slots, max(int(top), 1)
        #: (k, top) int32 lazy, best first; None before the first step with
        #: mask slots and after a step without them
        self.cands: mx.array | None = None
        self.vec: mx.array | None = None
        self.assume: bool | None = None

    @property
    def fresh(self) -> bool:
        """Whether the step launched last left candidates (or :attr:`assume`)."""
        return self.cands is not None if self.assume is None else self.assume

    def begin(self, engine: Engine, prompt: list[int]) -> None:
        """A generation starts: the vectors from the prompt (or learned)."""
        self.vectors.begin(engine, prompt)
        self.vec = self.vectors.embedding
        self.cands = None
        self.assume = None

    def slots(self, nodes: int) -> mx.array:
        """(nodes * k, D) input embeddings of the mask slots after ``nodes``
        token slots, in slot order."""
        return mx.tile(self.vec, (nodes, 1))

    def after(
        self, engine: Engine, step: Any, committed: mx.array, masked: bool = True
    ) -> list[mx.array]:
        """Lazy: the next candidates from the masks after ``step``'s deepest
        accepted slot (``masked``: the step carried mask slots; else none),
        and the vectors after its committed tokens (the first
        ``step.accepted + 1`` of ``committed``); returns them to evaluate."""
        out = self._candidates(step, masked)
        if self.vectors.learned is None:
            lam = self.vectors.lam
            count = (step.accepted + 1).astype(mx.float32)
            i = mx.arange(committed.shape[0], dtype=mx.float32)
            w = mx.where(i < count, lam * mx.power(1.0 - lam, count - 1.0 - i), 0.0)
            e = engine.embed(committed)
            self.vec = mx.power(1.0 - lam, count) * self.vec + (w.astype(e.dtype) @ e)[None]
        return [*out, self.vec]

    def _candidates(self, step: Any, masked: bool) -> list[mx.array]:
        """Lazy: :attr:`cands` from the masks after ``step``'s deepest
        accepted slot (None where the step carried none); returns them to
        evaluate."""
        if not masked:
            self.cands = None
            return []
        n, k = step.tpl.n, self.k
        rows = mx.take(step.logits, n + step.path[-1] * k + mx.arange(k), axis=0)
        self.cands = top_tokens(rows, self.top).astype(mx.int32)
        return [self.cands]


class TokenMaskLayer(MaskLayer):
    """Mask slots that are one vocabulary token, the mask token of a
    self-distilled multi-token-prediction model (Kirchenbauer et al., arXiv
    2602.06019, §3): after a token, the mask token at the next position
    stands for the token after it, and ``k`` of them in a row for the ``k``
    tokens after it. Laid out as :class:`MaskLayer`'s slots (``k`` after
    every token slot, each seeing its node's path and the masks before it,
    as the model saw them in training), so the masks after the deepest
    accepted slot give the next draft's candidates. The pass carries the
    id itself, so an on-device adapter's gate
    (:class:`~mlx_mtp.confadapt_format.MaskedEmbedding`) sees which slots
    are masks; nothing is learned between steps.

    Args:
        token: the mask token's id (may lie past the logits' columns).
        k: mask slots after each token slot.
        top: candidates kept per depth.
    """

    def __init__(self, token: int, k: int, top: int):
        self.vectors, self.vec = None, None
        self.token, self.k, self.top = int(token), int(k), max(int(top), 1)
        self.cands = None
        self.assume = None

    def begin(self, engine: Engine, prompt: list[int]) -> None:
        """A generation starts: no candidates until a step carries masks."""
        self.cands = None
        self.assume = None

    def slots(self, nodes: int) -> mx.array:
        """Not used: the pass carries :attr:`token` in the mask slots."""
        raise TypeError("token mask slots are ids, not vectors")

    def after(
        self, engine: Engine, step: Any, committed: mx.array, masked: bool = True
    ) -> list[mx.array]:
        """Lazy: the next candidates (see :class:`MaskLayer`); returns them
        to evaluate."""
        return self._candidates(step, masked)


#: prior acceptance of the rank-1.. candidates of mask 1, given the root
PROBE_RANK_PRIORS = (0.3, 0.08, 0.04, 0.03, 0.02, 0.015, 0.01, 0.01)


class MaskDrafter(DeviceDrafter):
    """ESP's draft tree in pipelined steps: the candidates of the masks after
    the last step's deepest accepted slot (:class:`MaskLayer`), depth d from
    mask d, hung under every node of the depth before (ESP §3.2). The tree's
    shape is the best-first expansion of (depth, rank) paths, a node worth
    the product of the estimates ``q(NAME/d, rank)`` along its path (the
    tokens are on the device; their probabilities are not read).

    Learning costs nothing: the candidates every step's masks made are read
    back and scored against the tokens committed after that step, at every
    step, as verification would score a tree of all of them.

    Args:
        layer: the mask slots.
        name: the estimates' source; depth d learns ``NAME/d``.
    """

    name = "probe"

    def __init__(self, layer: MaskLayer, name: str = "probe"):
        super().__init__()
        self.masks = layer
        self.name = name
        self._plan: tuple[list[int], list[int]] = ([-1], [0])
        self._tpls: dict[tuple[int, ...], Template] = {}
        self._index: dict[int, mx.array] = {}
        self._pending: list[tuple[int, np.ndarray]] = []

    def begin(self, ctx: Any, prompt: list[int]) -> None:
        self.masks.begin(ctx.engine, prompt)
        self._pending = []

    def pause(self, cached: list[int]) -> None:
        """A spell of plain steps carries no mask slots: no candidates
        through it (the width policy's choices in the spell see none)."""
        self.masks.cands = None

    def resume(self, ctx: Any, history: list[int]) -> None:
        """The vectors start again from ``history``; the candidates still
        waiting for the tokens they guess are scored as those come."""
        self.masks.begin(ctx.engine, history)

    def values(self, acceptance: Any, most: int, signal: Any) -> list[float]:
        if not self.masks.fresh:  # no candidates: the last step carried no masks
            self._plan = ([-1], [0])
            return []
        k, top = self.masks.k, self.masks.top
        qs = [acceptance.qs(f"{self.name}/{d}", top) for d in range(1, k + 1)]
        parents, ranks, values = rank_tree(lambda d: qs[d - 1], most, deepest=k)
        depth = [0] * len(parents)
        for s in range(1, len(parents)):
            depth[s] = depth[parents[s]] + 1
        flat = [0] + [(depth[s] - 1) * top + ranks[s] for s in range(1, len(parents))]
        self._plan = (parents, flat)
        return values

    def template(self, width: int) -> Template:
        parents, flat = self._plan
        key = tuple(parents[: width + 1]) + tuple(flat[: width + 1])
        tpl = self._tpls.get(key)
        if tpl is None:
            if len(self._tpls) > 256:
                self._tpls.clear()
                self._index.clear()
            tpl = self._tpls[key] = Template.of(parents[: width + 1])
            self._index[id(tpl)] = mx.array(np.array(flat[1 : width + 1], dtype=np.int32))
        return tpl

    def draft(self, state: Any, tpl: Template, rows: int) -> mx.array:
        return mx.take(self.masks.cands.reshape(-1), self._index[id(tpl)])

    def learn(self, acceptance: Any, history: list[int], steps: list[Any]) -> None:
        k, top = self.masks.k, self.masks.top
        for s in steps:
            cands = s.extra.get("masked")
            if cands is not None:  # they guess the tokens after the next root
                self._pending.append((s.start + len(s.tokens), cands.reshape(k, top)))
        keep = []
        for r, cands in self._pending:
            known = history[r + 1 : r + 1 + k]
            if len(known) < k and r + 1 + len(known) >= len(history):
                keep.append((r, cands))  # wait for the tokens they guess
                continue
            for d in range(1, len(known) + 1):
                if d > 1 and known[d - 2] not in cands[d - 2]:
                    break  # no candidate path reaches depth d
                est = acceptance.source(f"{self.name}/{d}")
                for rank, t in enumerate(cands[d - 1].tolist()):
                    est.add(rank + 1, t == known[d - 1])
        self._pending = keep
        return None
