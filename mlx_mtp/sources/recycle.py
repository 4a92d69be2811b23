"""Token recycling: the model's own top-k predictions after every token.

Luo et al., 2024, "Turning Trash into Treasure: Accelerating Inference of
Large Language Models with Token Recycling" (arXiv 2408.08696): every forward
pass ranks the whole vocabulary after each of its slots, and all but the top
token are thrown away; kept in a table, they are a draft source that needs
no draft model and no training. Read top to bottom:

1. The table (:class:`RecycleTable`): for every token id, the ``k`` ids the
   model ranked highest after it the last time that token was an input slot
   (an adjacency matrix, vocabulary x k int32 on the host, -1 where nothing
   is known; 151,936 x 8 is 4.9 MB). Every pass a method runs fills it: each
   verified draft, chain or tree, from every slot with logits, rejected
   branches too (:meth:`RecycleTable.learn`; where a token occurs twice in
   one pass, the row from its committed context is the one kept), and every
   plain one-token step (:meth:`RecycleTable.plain`; the planner builds its
   top-k beside the argmax, :class:`~mlx_mtp.plain.PlainSteps`). The
   top-k is device work in the same synchronisation as the target tokens
   (:func:`~mlx_mtp.verify.top_tokens`); only (slots, k) ids reach the host.
2. Candidates (:meth:`RecycleTable.children`): the children of a draft node
   are the row of its token; a rank-r child is worth its parent's value times
   q(r), the acceptance of rank r given its parent accepted, learned online by
   the planner (tag ``("recycle", r, 1.0)``, priors :data:`RANK_PRIORS`).
   A best-first expansion from the root by these values (the planner cuts
   it under the cost curve) replaces the paper's static tree template, a
   breadth-first walk of a fixed shape over the table (§3.2).
3. Lifetime (``reset``): kept across generations (``"never"``: the paper's
   table inherited from earlier queries), reset when a prompt does not
   continue the previous one (``"conversation"``), or at every generation
   (``"turn"``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from ..acceptance import Acceptance
from ..allocate import Child
from ..errors import InvalidArgumentError
from ..pipeline import DeviceDrafter, DeviceState, Pass, Template
from ..tree import rank_tree
from ..verify import top_tokens

if TYPE_CHECKING:
    from ..context import Context
    from ..offers import PlainResult
    from ..speculative import Draft, Verified

#: the acceptance statistics' source name (its depth buckets are ranks 1..k)
SOURCE = "recycle"
#: prior acceptance of the rank-1..8 candidates given their parent accepted
RANK_PRIORS = (0.45, 0.12, 0.06, 0.04, 0.03, 0.02, 0.015, 0.01)
#: pipelined steps' estimates of the candidates below a draft node (not the
#: root), and their priors
DEEP = "recycle/deep"
DEEP_PRIORS = (0.6, 0.12, 0.06, 0.04, 0.03, 0.02, 0.015, 0.01)
#: when the table starts afresh (see the module doc)
RESETS = ("never", "conversation", "turn")


class RecycleTable:
    """The adjacency table of token recycling (see the module doc).

    Args:
        k: candidates kept per token (1..32; the paper's 8).
        reset: ``"never"``, ``"conversation"`` or ``"turn"``.

    Attributes:
        table: (V, k) int32 the best ids after every token, best first, -1
            unknown; None before the first pass (or after a reset).

    Raises:
        InvalidArgumentError: an unknown ``reset``.
    """

    def __init__(self, k: int = 8, reset: str = "never"):
        if reset not in RESETS:
            raise InvalidArgumentError(
                f"option reset must be one of {', '.join(RESETS)}, got {reset!r}"
            )
        self.k, self.reset = k, reset
        self.table: np.ndarray | None = None
        self.rows = 0
        self._model: Any = None
        self._prompt: list[int] = []

    def prepare(self, ctx: Context) -> None:
        """A table belongs to one model: a new model starts an empty one,
        sized by its embedding table (every input token id is below that)."""
        engine = ctx.engine
        if engine.model is not self._model:
            self._model, self.table = engine.model, None
            weight = getattr(engine.embed, "weight", None)
            self.rows = int(weight.shape[0]) if weight is not None else 0

    def begin(self, prompt: Sequence[int]) -> None:
        """A generation starts after ``prompt``: reset the table as ``reset`` says."""
        prompt = list(prompt)
        fresh = prompt[: len(self._prompt)] != self._prompt
        if self.reset == "turn" or (self.reset == "conversation" and fresh):
            self.table = None
        self._prompt = prompt

    # ------------------------------------------------------------ drafting
    def children(self, acceptance: Acceptance) -> Callable[[int], list[Child]]:
        """``f(token)`` -> the candidates after ``token`` for this step, best
        first, valued by the planner's per-rank estimates (read once here)."""
        k, table = self.k, self.table
        qs = acceptance.qs(SOURCE, k)
        tags = [[(SOURCE, r + 1, 1.0)] for r in range(k)]
        ranks = sorted(range(k), key=lambda r: -qs[r])  # stable: rank order on ties

        def kids(token: int) -> list[Child]:
            if table is None or not 0 <= token < len(table):
                return []
            row = table[token].tolist()
            return [Child(row[r], qs[r], tags[r]) for r in ranks if row[r] >= 0]

        return kids

    # ------------------------------------------------------------ learning
    def graph(self, logits: mx.array, rows: int) -> mx.array:
        """The lazy (rows, k) top-k of a pass's first ``rows`` logit rows (the
        token slots), for :meth:`learn` (a draft's ``extras``)."""
        return top_tokens(logits[:rows], self.k)

    def learn(self, draft: Draft, verified: Verified, top: mx.array) -> None:
        """Write the rows of a verified pass: ``top`` (R, k), evaluated
        :meth:`graph` of its first R slots; mask slots (-1) are skipped, the
        root and the accepted path are written last (they win a repeat)."""
        top = np.asarray(top)
        tokens, rows = self.write_order(draft, verified, top.shape[0])
        self.write(tokens, top[rows])

    @staticmethod
    def write_order(draft: Draft, verified: Verified, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens, rows)``: the token and row of the first ``n`` slots of a
        verified pass in the order :meth:`learn` writes them (mask slots left
        out, the root and the accepted path last)."""
        on_path = [0, *(s for s in verified.path if s < n)]
        rest = np.setdiff1d(np.arange(n), on_path, assume_unique=True)
        order = np.concatenate([rest, np.array(on_path)]).astype(np.int64)
        tokens = draft.tokens[:n][order]
        keep = tokens >= 0
        return tokens[keep], order[keep]

    def plain(self, result: PlainResult) -> None:
        """Write the row of a plain step's root (its ``top``, when computed)."""
        if result.top is not None and result.root >= 0:
            self.write(np.array([result.root]), np.asarray(result.top)[None])

    def write(self, tokens: np.ndarray, top: np.ndarray) -> None:
        """Set the rows of ``tokens`` (n,) to ``top`` (n, k); where a token
        repeats, its last row wins."""
        if not len(tokens):
            return
        need = int(tokens.max()) + 1
        if self.table is None or need > len(self.table):
            old = self.table
            self.table = np.full((max(need, self.rows), self.k), -1, dtype=np.int32)
            if old is not None:
                self.table[: len(old)] = old
        if len(tokens) == 1:
            # by a plain index: a fancy-indexed write allocates NumPy's
            # iteration buffer, and on Linux the first allocation of 1 KiB or
            # more after a pass makes glibc merge every small block the pass
            # freed (1-2 ms of host work per plain step on SmolLM2;
            # docs/benchmarks.md, "glibc's fastbins")
            self.table[int(tokens[0])] = top[0, : self.k]
            return
        _, first = np.unique(tokens[::-1], return_index=True)
        last = len(tokens) - 1 - first
        self.table[tokens[last]] = top[last, : self.k]


class RecycleDrafter(DeviceDrafter):
    """Token recycling on the device, for :mod:`mlx_mtp.pipeline`: the
    table is a (V, k) int32 device array, refilled inside every pass's graph
    from the top-k of its slots (rows of the root and the accepted path
    written last), and the draft tree is read from it by rank.

    The tree's shape depends only on the per-rank estimates: the best-first
    expansion of rank paths (a node worth the product of ``q(rank)`` along
    its path, as :meth:`RecycleTable.children` values it, without the
    tokens), laid out best first; its tokens are gathered from the table
    depth by depth on the device. A plain step's root row is read back, so
    the estimates learn at every step, as verification would score a tree
    of the root's children.

    Args:
        table: the method's :class:`RecycleTable` (kept across generations;
            the device table starts from it and is copied back at the end).
    """

    name = SOURCE

    def __init__(self, table: RecycleTable):
        super().__init__()
        self.source = table
        self.table: mx.array | None = None
        # templates by (parents, ranks), and the rank of every slot of each
        self._plans: dict[tuple, Template] = {}
        self._ranks: dict[int, np.ndarray] = {}
        self._plan: tuple[list[int], list[int]] = ([], [])

    def begin(self, ctx: Any, prompt: list[int]) -> None:
        host = self.source.table
        rows = max(self.source.rows, 0 if host is None else len(host))
        t = np.full((max(rows, 1), self.source.k), -1, dtype=np.int32)
        if host is not None:
            t[: len(host)] = host
        self.table = mx.array(t)

    def end(self, cached: list[int]) -> None:
        if self.table is not None:
            self.source.table = np.array(self.table)
        self.table = None

    def pause(self, cached: list[int]) -> None:
        """The device table stays as it is through a spell of plain steps."""

    def resume(self, ctx: Any, history: list[int]) -> None:
        """The device table is the one the spell began with."""

    def values(self, acceptance: Acceptance, most: int, signal: Any) -> list[float]:
        k = self.source.k
        # under the root, and deeper (given the parent accepted, a child is
        # likelier right there than at the root: a continuation under way)
        first, deep = acceptance.qs(SOURCE, k), acceptance.qs(DEEP, k)
        parents, ranks, values = rank_tree(lambda d: first if d == 1 else deep, most)
        self._plan = (parents, ranks)
        return values

    def template(self, width: int) -> Template:
        parents, ranks = self._plan
        key = (tuple(parents[: width + 1]), tuple(ranks[: width + 1]))
        tpl = self._plans.get(key)
        if tpl is None:
            if len(self._plans) > 256:
                self._plans.clear()
                self._ranks.clear()
            tpl = self._plans[key] = Template.of(key[0])
            self._ranks[id(tpl)] = np.array(key[1], dtype=np.int32)
        return tpl

    def draft(self, state: DeviceState, tpl: Template, rows: int) -> mx.array:
        ranks = self._ranks[id(tpl)]
        k = self.source.k
        flat = self.table.reshape(-1)
        rows = self.table.shape[0]
        depth, parents = tpl.depth, tpl.parents
        levels = [state.root.reshape(1)]
        where = {0: (0, 0)}  # slot -> (depth, index in its level)
        order = [0]
        for d in range(1, tpl.deepest + 1):
            nodes = np.flatnonzero(depth == d)
            for i, s in enumerate(nodes):
                where[int(s)] = (d, i)
            pos = np.array([where[int(parents[s])][1] for s in nodes], dtype=np.int32)
            ptok = mx.take(levels[d - 1], mx.array(pos))
            ok = (ptok >= 0) & (ptok < rows)
            idx = mx.where(ok, ptok, 0) * k + mx.array(ranks[nodes])
            levels.append(mx.where(ok, mx.take(flat, idx), -1))
            order.extend(int(s) for s in nodes)
        tokens = mx.concatenate(levels)  # depth order
        inverse = np.argsort(np.array(order))
        tokens = mx.take(tokens, mx.array(inverse[1:].astype(np.int32)))
        return mx.maximum(tokens, 0)

    def update(self, step: Pass) -> list[mx.array]:
        n = step.tpl.n  # the token slots (mask slots after them predict further on)
        top = top_tokens(step.logits[:n], self.source.k).astype(mx.int32)
        rows = self.table.shape[0]
        tokens = mx.clip(step.tokens[:n], 0, rows - 1)
        table = self.table
        table[tokens] = top
        path_tok = mx.take(tokens, step.path)
        table[path_tok] = mx.take(top, step.path, axis=0)
        self.table = table
        return [table]

    def read(self, step: Pass) -> dict[str, mx.array]:
        out = {"tokens": step.tokens}
        if step.tpl.n == 1:  # a plain step: the root's row, scored against its token
            out["row"] = mx.take(
                self.table, mx.clip(step.state.root, 0, self.table.shape[0] - 1), axis=0
            )
        return out

    def learn(self, acceptance: Acceptance, history: list[int], steps: list[Any]) -> None:
        est, deep = acceptance.source(SOURCE), acceptance.source(DEEP)
        for s in steps:
            if s.width == 0:
                row = s.extra.get("row")
                if row is None:
                    continue
                for r, t in enumerate(row.tolist()):
                    if t >= 0:
                        est.add(r + 1, t == s.tokens[0])
                continue
            ranks = self._ranks[id(s.tpl)]
            on_path = set(s.path)
            parents = s.tpl.parents
            for slot in range(1, s.tpl.n):
                if int(parents[slot]) in on_path:
                    (est if parents[slot] == 0 else deep).add(int(ranks[slot]) + 1, slot in on_path)
        return None
