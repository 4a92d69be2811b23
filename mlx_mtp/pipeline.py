"""Pipelined draft steps: the next forward pass is launched before the host
reads the one in flight.

A draft step that waits for its verification before it builds the next pass
leaves the device idle while the host reads the result, drafts, and builds the
MLX graph of the next pass (about 5 ms for a 30-layer model): on a GPU that
decodes a token in 10 ms, that idle time eats the gain of drafting. Plain
decoding hides its graph building behind the device (mlx-lm's ``async_eval``
loop). This module does the same for draft steps whose drafts can be chosen
on the device:

1. The state after a step is lazy: the cache length ``at``, the root (the
   bonus token, not yet in the cache) and the committed tokens ``history``
   are arrays the host has not read.
2. A :class:`DeviceDrafter` builds the next draft from that state as lazy
   array operations (a prompt lookup over ``history``, a table of the model's
   own earlier predictions), laid out on a fixed :class:`Template` (a chain
   or a tree of known shape).
3. The pass runs at the lazy cache length (:meth:`Engine.forward_at
   <mlx_mtp.engine.Engine.forward_at>`); the verification walk
   (:func:`device_walk`), the accepted path's cache rows and the next state
   are lazy too. The host launches step k+1 (``mx.async_eval``) and only then
   reads step k: one synchronisation per step, and everything the host does
   (building graphs, reading, learning) overlaps the device, up to the
   pass's time: host work beyond it leaves the device idle, and the width
   policy prices it (:class:`HostTimes`).

A plain step is a step of width 0 (the root alone), so plain steps and draft
steps share one pipeline and switching between them costs nothing. Each
width is chosen before the step before it is read, from what is known then
(:class:`WidthPolicy`). Where the host needs longer to build a pipelined
step than the device needs for its pass (a small model on a fast GPU, a busy
host), the plain steps the policy chooses run instead as a *spell* of
one-token steps as ``ntp`` runs them (:class:`~mlx_mtp.plain.PlainSteps`),
whose graphs are smaller; the policy keeps asking after each of them, and
the pipeline starts again where it chooses a draft.

Greedy only: the committed tokens are exactly plain greedy decoding's (the
walk follows the argmax, as :func:`mlx_mtp.verify.walk_tree`), checked token
for token in float32 by the tests. The policy is the expected-tokens-per-time
objective of Leviathan et al. 2023 (§3.4) under the device's cost curve; the
pipeline itself follows mlx-lm's ``generate_step`` (``mx.async_eval`` of the
next step before the current one is read).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from .acceptance import CARRY_WEIGHT, Acceptance, Calibration, CalibrationModel, chain_values
from .budget import CostCurve, best_prefix
from .engine import Engine, ancestors
from .ledger import EPSILON, StepLedger
from .offers import StepOutput
from .plain import PlainSteps

if TYPE_CHECKING:
    from .context import Context
    from .costs import LiveCurves

#: history buffer growth step (tokens)
HISTORY_STEP = 1024
#: a read that waited longer than this (seconds) found the device still busy
WAITED = 2e-4


@dataclass(frozen=True)
class Template:
    """The fixed shape of one step's pass: slot 0 the root, then the draft
    nodes; ``parents[i] < i``.

    Attributes:
        parents: (N,) int64 parent slot of each slot (-1 for the root).
        depth: (N,) int32 depth below the root.
        paths: (N, D + 1) int32: row i holds the slots from the root to slot
            i, padded with i (D: the deepest depth).
        chain: every slot is the child of the one before (no tree mask, no
            cache rows to move).
        anc: (N, N) bool ancestor-or-self relation (None for a chain).
        nodes: the first ``nodes`` slots are tokens; the rest are ESP mask
            slots (:meth:`with_masks`), never accepted.
        masks: mask slots after every token slot (k).
    """

    parents: np.ndarray
    depth: np.ndarray
    paths: np.ndarray
    chain: bool
    anc: np.ndarray | None = None
    nodes: int = 0
    masks: int = 0
    _mx: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, parents: Sequence[int]) -> Template:
        """The template of a tree given by parent slots (slot 0 the root)."""
        par = np.asarray(parents, dtype=np.int64)
        n = len(par)
        chain = bool(np.array_equal(par, np.arange(-1, n - 1)))
        anc, depth = ancestors(par)
        d = int(depth.max()) if n else 0
        paths = np.zeros((n, d + 1), dtype=np.int32)
        for i in range(n):
            path = [i]
            while par[path[-1]] >= 0:
                path.append(int(par[path[-1]]))
            path = path[::-1]
            paths[i, : len(path)] = path
            paths[i, len(path) :] = i
        return cls(par, depth, paths, chain, None if chain else anc, n)

    def with_masks(self, k: int) -> Template:
        """This template with ``k`` ESP mask slots after every token slot
        (Goel et al., §3.2): mask j after slot v sits at v's position + j + 1
        and sees v's path and the masks before it in its set (its parent is
        the one before). Slot ``nodes + v * k + j`` is mask j after slot v."""
        if k < 1:
            return self
        parents = list(self.parents)
        for v in range(self.n):
            up = v
            for _ in range(k):
                parents.append(up)
                up = len(parents) - 1
        t = Template.of(parents)
        anc = t.anc if t.anc is not None else ancestors(t.parents)[0]
        return Template(t.parents, t.depth, t.paths, False, anc, self.n, k)

    @classmethod
    def chain_of(cls, width: int) -> Template:
        """A chain: the root and ``width`` drafts."""
        return cls.of(list(range(-1, width)))

    @property
    def n(self) -> int:
        """Slots of the pass."""
        return len(self.parents)

    @property
    def deepest(self) -> int:
        """The deepest depth (D)."""
        return self.paths.shape[1] - 1

    def arrays(self) -> dict[str, mx.array]:
        """The template as device arrays (made once)."""
        if not self._mx:
            self._mx["parents"] = mx.array(np.maximum(self.parents, 0).astype(np.int32))
            self._mx["depth"] = mx.array(self.depth.astype(np.int32))
            self._mx["paths"] = mx.array(self.paths)
            if self.anc is not None:
                self._mx["anc"] = mx.array(self.anc)
        return self._mx


@dataclass
class DeviceState:
    """The committed state after a step, as lazy arrays.

    Attributes:
        at: scalar int32, tokens in the KV cache (the root's position).
        root: scalar int32, the last committed token (not in the cache).
        history: (C,) int32, the committed tokens: ``history[:at + 1]`` are
            the cached tokens and the root; later entries are stale.
    """

    at: mx.array
    root: mx.array
    history: mx.array


def device_walk(
    tokens: mx.array, targets: mx.array, tpl: Template
) -> tuple[mx.array, mx.array, mx.array]:
    """Greedy verification of a template's pass on the device.

    A draft slot is accepted when its token equals its parent's target and
    its parent is accepted (the root always is); the deepest accepted slot
    (the first of equal depth) gives the bonus token. Where sibling tokens
    differ, this is :func:`mlx_mtp.verify.walk_tree`'s path.

    Args:
        tokens: (N,) int32 slot tokens.
        targets: (N,) int32 argmax after each slot.
        tpl: the pass's template.

    Returns:
        ``(a, path, committed)``, lazy: ``a`` (scalar int32) accepted drafts;
        ``path`` (D + 1,) the slots root .. deepest accepted (padded with the
        deepest); ``committed`` (D + 1,) int32 whose first ``a + 1`` entries
        are the committed tokens (accepted drafts, then the bonus token).
    """
    arr = tpl.arrays()
    n = tpl.n
    if n == 1:
        deepest = mx.array(0, dtype=mx.int32)
    elif tpl.chain:
        match = (tokens[1:] == targets[:-1]).astype(mx.int32)
        deepest = mx.cumprod(match).sum().astype(mx.int32)
    else:
        ok = (tokens == mx.take(targets, arr["parents"])) | (mx.arange(n) == 0)
        bad_path = mx.any(arr["anc"] & ~ok[None, :], axis=1)
        score = mx.where(bad_path, -1, arr["depth"])
        deepest = mx.argmax(score).astype(mx.int32)
    path = mx.take(arr["paths"], deepest, axis=0)
    a = mx.take(arr["depth"], deepest)
    return a, path, mx.take(targets, path)


@dataclass
class Pass:
    """One pipelined step's pass as lazy arrays, for a drafter's
    :meth:`DeviceDrafter.update` and :meth:`DeviceDrafter.read`.

    Attributes:
        state: the state before the step (``state.root`` is slot 0).
        tpl: the template of the token slots (the first ``tpl.n`` slots;
            mask slots follow them, if any).
        tokens: (N,) int32 slot tokens (-1 for mask slots).
        logits: (N, V) logits.
        path: (D + 1,) the accepted slots from the root (padded).
        accepted: scalar int32, the drafts accepted.
        hidden: (N, D) final-norm hidden states, for a drafter that asks for
            them (:attr:`DeviceDrafter.wants_hidden`); else None.
    """

    state: DeviceState
    tpl: Template
    tokens: mx.array
    logits: mx.array
    path: mx.array
    accepted: mx.array
    hidden: mx.array | None = None


class DeviceDrafter:
    """A draft source whose drafts are chosen on the device (see the module
    doc). Subclasses implement :meth:`draft` and, as they need,
    :meth:`template` and :meth:`values` (the shape of a step and what its
    nodes are worth), :meth:`update` (lazy state updates inside a step's
    graph), :meth:`read` (arrays the host reads with the step) and
    :meth:`learn` (host learning, after the next step was launched)."""

    #: the acceptance statistics' source name
    name = ""
    #: slots each item of :meth:`values` adds to the pass
    item_slots = 1
    #: what each item costs besides its slots, in one-token forwards (a
    #: draft model's pass per depth)
    item_cost = 0.0
    #: whether the drafter learns at plain steps too (else the width policy
    #: probes now and then while the cut says no: :class:`WidthPolicy`)
    learns_free = True
    #: the layouts the width policy weighs at ``auto`` (:meth:`use` switches
    #: to one); a single unnamed one for most drafters
    widths: tuple[Any, ...] = (None,)
    #: ESP mask slots after every token slot of the steps that carry them
    #: (a :class:`~mlx_mtp.sources.masks.MaskLayer`), or None
    masks: Any = None
    #: whether :meth:`update` reads the pass's hidden states (:attr:`Pass.hidden`)
    wants_hidden = False
    #: set by the pipeline: no step is in flight when a width is chosen, so
    #: the signal :meth:`learn` returns describes the step about to launch
    #: (else the one in flight before it)
    fresh = False

    def __init__(self) -> None:
        #: device work :meth:`draft` queued beside the target's pass, as
        #: ``(arrays to evaluate, its time in one-token target forwards)``;
        #: the pipeline launches it before the pass and empties the list
        self.aside: list[tuple[list[mx.array], float]] = []

    def use(self, width: Any) -> None:
        """Lay out the next steps launched as ``width``, one of :attr:`widths`
        (:meth:`values`, :meth:`template` and :meth:`draft` follow it)."""

    def begin(self, ctx: Context, prompt: list[int]) -> None:
        """A generation starts after ``prompt`` (all but its last token cached)."""

    def end(self, cached: list[int]) -> None:
        """The generation ended with the target's cache holding ``cached``
        (the state the host keeps is brought back)."""

    def pause(self, cached: list[int]) -> None:
        """A spell of plain steps begins (:class:`Pipeline`) with the target's
        cache holding ``cached``; by default the generation's end."""
        self.end(cached)

    def resume(self, ctx: Context, history: list[int]) -> None:
        """The pipeline starts again after a spell, ``history`` the committed
        tokens (all but the last cached); by default a new beginning."""
        self.begin(ctx, history)

    def values(self, acceptance: Acceptance, most: int, signal: Any) -> list[float]:
        """Expected accepted tokens of each of the first ``most`` nodes of
        the drafter's best-first layout, for the width policy (``signal``:
        what :meth:`learn` returned last, a hint about the next draft);
        :meth:`template` then lays out a prefix of them."""
        return chain_values(acceptance.qs(self.name, most))

    def template(self, width: int) -> Template:
        """The pass of the first ``width`` nodes (0: a plain step)."""
        return Template.chain_of(width)

    def draft(self, state: DeviceState, tpl: Template, rows: int) -> mx.array:
        """The (N - 1,) int32 lazy draft tokens of ``tpl``'s nodes after
        ``state.root`` (``rows``: a bound on ``state.at + N`` the host knows)."""
        raise NotImplementedError

    def update(self, step: Pass) -> list[mx.array]:
        """Lazy updates of the drafter's device state from a pass; returns
        the arrays to evaluate with the step (none by default)."""
        return []

    def read(self, step: Pass) -> dict[str, mx.array]:
        """Lazy (n,) int32 arrays the host reads with the step
        (:attr:`StepRecord.extra`); none by default."""
        return {}

    def learn(self, acceptance: Acceptance, history: list[int], steps: list[StepRecord]) -> Any:
        """Host learning once steps were read (``history``: the committed
        tokens so far, ``steps``: the steps read since the last call);
        returns the signal :meth:`values` gets next."""
        return None


@dataclass
class StepRecord:
    """One pipelined step as the host read it.

    Attributes:
        start: cache length before the step (the root's position).
        width: draft nodes sent.
        accepted: drafts accepted.
        tokens: committed tokens (accepted drafts, then the bonus token).
        tpl: the step's template.
        path: the accepted slots from the root (root included).
        extra: what the drafter's :meth:`DeviceDrafter.read` asked for.
    """

    start: int
    width: int
    accepted: int
    tokens: list[int]
    tpl: Template | None = None
    path: list[int] = field(default_factory=list)
    extra: dict[str, np.ndarray] = field(default_factory=dict)


#: a composite's per-part calibration: counts decay 0.9 per draft step, a
#: prior of one token at ratio 1, at most 1.5 (as a method's whole-draft one)
PART_CALIBRATION = CalibrationModel(decay=0.9, weight=1.0, cap=1.5)


class CompositeDrafter(DeviceDrafter):
    """Several device drafters in one tree under the root: their best-first
    items merged by value (each list falls, so parents stay first), each
    part's nodes laid out as its own template, side by side (``hybrid``:
    prompt lookup beside a table of the model's own predictions).

    Where parts propose the same token under the root, the walk takes the
    deeper branch; each part learns from its own nodes, a node accepted
    when its tokens from the root are the committed ones.

    Each part's values are scaled by its own whole-draft calibration: the
    tokens its nodes had accepted over the sum of their values, over recent
    steps (:data:`PART_CALIBRATION`). Per-node estimates learned from each
    part's own nodes still misjudge a part's share of one tree (measured on
    the simulated device: ``hybrid``'s mask slots accepted 0.06 of the
    tokens their values promised on an mt_bench prompt while its table
    nodes were left out), so the merge weighs each part by what it delivered.

    Args:
        parts: drafters whose items take one slot and cost nothing else.
    """

    def __init__(self, parts: Sequence[DeviceDrafter]):
        super().__init__()
        self.parts = list(parts)
        self.calibrations = [Calibration(PART_CALIBRATION) for _ in self.parts]
        self._lists: list[list[float]] = []  # each part's raw values, last asked
        self._predicted: list[list[float]] = []  # per step in flight: each part's kept value
        self.masks = next((p.masks for p in self.parts if p.masks is not None), None)
        self.wants_hidden = any(p.wants_hidden for p in self.parts)
        self._order: list[int] = []  # the part of each merged item, best first
        # composite template -> (sub-templates, first composite slot of each)
        self._subs: dict[int, tuple[list[Template], list[int]]] = {}
        self._tpls: dict[tuple[int, ...], Template] = {}

    @property
    def learns_free(self) -> bool:  # type: ignore[override]
        return all(p.learns_free for p in self.parts)

    def begin(self, ctx: Context, prompt: list[int]) -> None:
        self._predicted = []
        for p in self.parts:
            p.begin(ctx, prompt)

    def end(self, cached: list[int]) -> None:
        for p in self.parts:
            p.end(cached)

    def pause(self, cached: list[int]) -> None:
        for p in self.parts:
            p.pause(cached)

    def resume(self, ctx: Context, history: list[int]) -> None:
        self._predicted = []
        for p in self.parts:
            p.resume(ctx, history)

    def values(self, acceptance: Acceptance, most: int, signal: Any) -> list[float]:
        sigs = signal if isinstance(signal, tuple) else (None,) * len(self.parts)
        self._lists = [p.values(acceptance, most, g) for p, g in zip(self.parts, sigs)]
        lists = [[v * c.factor for v in raw] for raw, c in zip(self._lists, self.calibrations)]
        at = [0] * len(lists)
        order, out = [], []
        while len(out) < most:
            best = max(
                (i for i in range(len(lists)) if at[i] < len(lists[i])),
                key=lambda i: lists[i][at[i]],
                default=None,
            )
            if best is None:
                break
            out.append(lists[best][at[best]])
            order.append(best)
            at[best] += 1
        self._order = order
        return out

    def template(self, width: int) -> Template:
        counts = tuple(self._order[:width].count(i) for i in range(len(self.parts)))
        lists = self._lists or [[] for _ in self.parts]
        self._predicted.append([sum(raw[:c]) for raw, c in zip(lists, counts)])
        tpl = self._tpls.get(counts)
        if tpl is None:
            subs = [p.template(c) for p, c in zip(self.parts, counts)]
            parents, starts = [-1], []
            for sub in subs:
                base = len(parents) - 1  # composite slot of the sub's slot s: base + s
                starts.append(base)
                parents += [0 if q == 0 else base + int(q) for q in sub.parents[1:]]
            tpl = self._tpls[counts] = Template.of(parents)
            self._subs[id(tpl)] = (subs, starts)
        return tpl

    def draft(self, state: DeviceState, tpl: Template, rows: int) -> mx.array:
        subs, _ = self._subs[id(tpl)]
        out = []
        for p, sub in zip(self.parts, subs):
            if sub.n > 1:
                out.append(p.draft(state, sub, rows).astype(mx.int32))
                self.aside += p.aside
                p.aside = []
        return mx.concatenate(out)

    def update(self, step: Pass) -> list[mx.array]:
        return [a for p in self.parts for a in p.update(step)]

    def read(self, step: Pass) -> dict[str, mx.array]:
        out = {"tokens": step.tokens}
        for i, p in enumerate(self.parts):
            out.update({f"{i}:{k}": v for k, v in p.read(step).items()})
        return out

    def learn(self, acceptance: Acceptance, history: list[int], steps: list[StepRecord]) -> Any:
        per: list[list[StepRecord]] = [[] for _ in self.parts]
        for s in steps:
            predicted = self._predicted.pop(0) if self._predicted else None
            if s.tpl is None or id(s.tpl) not in self._subs:
                continue
            subs, starts = self._subs[id(s.tpl)]
            slots = s.extra.get("tokens")
            for i, (sub, base) in enumerate(zip(subs, starts)):
                extra = {k.split(":", 1)[1]: v for k, v in s.extra.items() if k.startswith(f"{i}:")}
                sub_tokens = (
                    [] if slots is None else [int(slots[base + j]) for j in range(1, sub.n)]
                )
                path = accepted_path(sub, sub_tokens, s.tokens)
                if predicted is not None and sub.n > 1:
                    self.calibrations[i].record(predicted[i], len(path) - 1)
                per[i].append(
                    StepRecord(s.start, sub.n - 1, len(path) - 1, s.tokens, sub, path, extra)
                )
        return tuple(p.learn(acceptance, history, r) for p, r in zip(self.parts, per))


def accepted_path(tpl: Template, nodes: Sequence[int], committed: Sequence[int]) -> list[int]:
    """The slots of ``tpl`` (root first) whose tokens from the root are the
    committed ones: ``nodes`` the tokens of slots 1.., ``committed`` the
    step's committed tokens; the deepest such branch (the first of equal
    depth)."""
    ok = [True] + [False] * (tpl.n - 1)
    best = 0
    for s in range(1, tpl.n):
        d = int(tpl.depth[s])
        if ok[int(tpl.parents[s])] and d <= len(committed) and nodes[s - 1] == committed[d - 1]:
            ok[s] = True
            if d > int(tpl.depth[best]):
                best = s
    return [int(x) for x in tpl.paths[best][: int(tpl.depth[best]) + 1]]


@dataclass
class _Launched:
    tpl: Template  # the pass's (mask slots included)
    base: Template  # its token slots
    width: int
    out: mx.array  # int32: [accepted, committed (D + 1), path (D + 1), extras...], read at once
    extra: list[tuple[str, int]]  # the extras' names and lengths
    done: float
    slots: int
    masked: bool = False  # mask slots ran (a step of the draft class, whatever its width)
    aside: float = 0.0  # device work beside the pass, in one-token forwards


class Pipeline:
    """Runs one generation's steps of a method with a :class:`DeviceDrafter`
    (see the module doc); the decoding loop calls :meth:`step` as it would
    a planner's.

    Args:
        ctx: the method's context.
        drafter: the device drafter.
        policy: the width of each step (and the estimates the drafter
            learns into).
        overlap: launch each step before reading the one in flight (else
            after it).

    Attributes:
        plain_steps: steps of width 0 read so far.
        declined: those of them where the drafter offered nodes and the
            width policy judged none worth its cost (the rest had nothing
            to draft).
        plain_spells: spells of plain steps begun (:meth:`_spell_step`).
        reprobes: 0 (the decoding loop's statistics ask).
        curve: the cost curve the policy plans with (None at a fixed width).
    """

    def __init__(
        self, ctx: Context, drafter: DeviceDrafter, policy: WidthPolicy, overlap: bool = True
    ):
        self.ctx, self.drafter, self.policy = ctx, drafter, policy
        #: launch step k+1 before reading step k (else after: a device whose
        #: passes do not overlap the host, where the width is then chosen
        #: knowing step k's outcome)
        self.overlap = overlap
        for d in [drafter, *getattr(drafter, "parts", [])]:
            d.fresh = not overlap
        self.engine: Engine = ctx.engine
        self.plain_steps = self.reprobes = self.plain_spells = self.declined = 0
        self._declined: list[bool] = []  # per step in flight: a width 0 the policy chose
        self.state: DeviceState | None = None
        self.inflight: list[_Launched] = []
        self.bound = 0  # the most tokens the cache can hold after the steps in flight
        self.history: list[int] = []
        self.signal: Any = None
        self._waited = False  # the last read waited for the device
        #: when a spell's last read returned, having waited for the device
        self._read_at: float | None = None
        #: a spell of plain steps runs (:meth:`_spell_step`)
        self.spell = False
        self.plain = PlainSteps(None)
        self._spell_offered = False
        #: a spell's asks of the policy (:meth:`_spell_step`): when the last
        #: one ended, and the host seconds it took
        self._asked_at: float | None = None
        self._ask_seconds = 0.0
        self._resume: tuple[int, bool] | None = None  # the choice that ends the spell
        #: where a switch into or out of a spell began (:meth:`_idle_mark`)
        self._switch_from: tuple[float, float | None, int] | None = None

    @property
    def curve(self) -> CostCurve | None:
        """The cost curve the width policy planned the last step with."""
        return self.policy.curve

    # -------------------------------------------------------------- steps
    def _start(self, root: int) -> None:
        engine = self.engine
        resuming = bool(self.history)  # after a spell
        self.history = [*engine.cached, int(root)]
        # the whole prompt, root included: a one-token prompt caches nothing
        if resuming:
            self.drafter.resume(self.ctx, list(self.history))
        else:
            self.drafter.begin(self.ctx, list(self.history))
        at = len(engine.cached)
        buf = np.zeros(_round_up(at + 1 + HISTORY_STEP, HISTORY_STEP), dtype=np.int32)
        buf[: at + 1] = self.history
        self.state = DeviceState(
            mx.array(at, dtype=mx.int32), mx.array(int(root), dtype=mx.int32), mx.array(buf)
        )
        self.bound = at

    def _launch(self, choice: tuple[int, bool]) -> None:
        """Build step k+1 on the lazy state after step k and start it
        (``choice``: its width and whether mask slots ride along)."""
        engine, st = self.engine, self.state
        width, masked = choice
        tpl = self.drafter.template(width)
        layer = self.drafter.masks
        masked = masked and layer is not None
        n = tpl.n * (1 + (layer.k if masked else 0))
        rows = self.bound + n
        hist = st.history
        need = rows + n + 2
        if hist.shape[0] < need:
            grow = _round_up(need, HISTORY_STEP) - hist.shape[0]
            hist = mx.concatenate([hist, mx.zeros((grow,), dtype=mx.int32)])
        st = DeviceState(st.at, st.root, hist)
        aside = 0.0
        if tpl.n > 1:
            drafts = self.drafter.draft(st, tpl, rows).astype(mx.int32)
            tokens = mx.concatenate([st.root.reshape(1), drafts])
            for arrays, cost in self.drafter.aside:  # a draft model's passes first
                engine.clock.launch(arrays, 1, cost)
                aside += cost
            self.drafter.aside = []
        else:
            tokens = st.root.reshape(1)
        # ids: what the model reads; tokens: what the walk reads (-1 at mask
        # slots, never accepted)
        emb, base, ids = None, tpl, tokens
        if masked:  # mask slots after every token slot
            tpl = tpl.with_masks(layer.k)
            pad = mx.full((tpl.n - base.n,), -1, dtype=mx.int32)
            if layer.token is None:  # vectors in the embedding space
                emb = mx.concatenate([engine.embed(tokens), layer.slots(base.n)])
                ids = tokens = mx.concatenate([tokens, pad])
            else:  # a vocabulary token the model was trained to read as a mask
                ids = mx.concatenate([tokens, mx.full(pad.shape, layer.token, dtype=mx.int32)])
                tokens = mx.concatenate([tokens, pad])
        anc = tpl.arrays().get("anc")
        out = engine.forward_at(
            ids,
            st.at,
            rows,
            anc,
            None if tpl.chain else tpl.depth,
            emb,
            hidden=self.drafter.wants_hidden,
        )
        logits, views = out[0], out[1]
        hidden = out[2] if len(out) > 2 else None
        targets = mx.argmax(logits, axis=-1).astype(mx.int32)
        a, path, committed = device_walk(tokens, targets, tpl)
        if not tpl.chain:
            engine.move_rows_at(views, path[1:], st.at + 1)
        step = Pass(st, base, tokens, logits, path, a, hidden)
        extras = self.drafter.read(step)  # before the update: the state drafted from
        kept = self.drafter.update(step)
        if layer is not None:  # candidates where masks ran; the vectors see every token
            kept += layer.after(engine, step, committed, masked)
            if masked:
                extras["masked"] = layer.cands
        history = mx.slice_update(hist, committed, (st.at + 1).reshape(1), axes=(0,))
        bonus = mx.take(committed, a)
        self.state = DeviceState(st.at + a + 1, bonus, history)
        parts = [a.reshape(1), committed, path.astype(mx.int32)]
        parts += [x.reshape(-1).astype(mx.int32) for x in extras.values()]
        out = mx.concatenate(parts)
        sizes = [(k, int(np.prod(x.shape))) for k, x in extras.items()]
        state = [self.state.at, self.state.root, self.state.history]
        done = engine.clock.launch([out, *state, *kept, *_cache_arrays(engine)], n)
        self.inflight.append(_Launched(tpl, base, width, out, sizes, done, n, masked, aside))
        self.bound += n

    def step(self, root: int) -> StepOutput:
        """Commit the tokens of the step in flight after ``root`` (launching
        it first if none is), with the next step launched before reading; in
        a spell, one plain step."""
        if self.spell:
            return self._spell_step(root)
        clock = self.engine.clock
        t0, idle0 = clock.now(), clock.idle
        first = self.state is None
        if first:
            self._start(root)
        if not self.inflight:
            choice = self._width()
            if self._spell_begins(choice):
                self._declined.pop()
                self._switch_from = self._idle_mark(t0, idle0, passes=-1)
                self.engine.settle_at(self.engine.cached)
                self.drafter.pause(self.engine.cached)
                return self._spell_step(root)
            self._launch(choice)
        launched = None
        left = self.ctx.left
        if self.overlap and (left is None or left > 1):  # the next step first
            choice = self._width()
            if self._spell_begins(choice):  # after this read: nothing launched now
                self._declined.pop()
                self._switch_from = self._idle_mark(t0, idle0)
            else:
                self._launch(choice)
                launched = self.inflight[-1]
        start = len(self.engine.cached)
        out, waited, step = self._read(root)
        if self.spell:  # the spell begins: the cache holds the committed tokens
            self.engine.settle_at(self.engine.cached)
            self.drafter.pause(self.engine.cached)
        elif first and self._switch_from is not None:
            # the first pipelined step after a spell: the switch out is measured
            self.policy.host.record("switch", self._idle_since(self._switch_from, 2))
            self._switch_from = None
        # device time, as for pipelined plain steps: the whole step but the host
        # work the device did not overlap, which is none where the host had to
        # wait for the result, else what exceeds the pass's time as the clock
        # or the cost curve knows it (unknown: all of it)
        wall = clock.now() - t0
        host = 0.0 if waited > WAITED else max(wall - self._device_seconds(step.slots), 0.0)
        clock.add(wall - host)
        # drafting's cost against plain decoding: drafts or mask slots, and
        # any pipelined step once a spell's steps (plain decoding's) were measured
        drafting = step.width > 0 or step.masked or self.policy.ledger.measured
        self.policy.record(wall, len(out.tokens), drafting, "plain")
        if launched is not None and not first:
            # the host time on the critical path between two launches: the
            # device's idle time where the clock knows it, else the step's
            # time past its pass and the work beside it; a class's by the step
            # launched (whose graph it built)
            idle = clock.idle - idle0 if idle0 is not None and clock.idle is not None else None
            if idle is None:
                device = self._device_seconds(step.slots, step.aside)
                idle = 0.0 if waited > WAITED else max(wall - device, 0.0)
            kind = "draft" if launched.width > 0 or launched.masked else "plain"
            self.policy.host.record(kind, idle)
        if not first and waited > WAITED and self._waited:
            # the device was busy from the step before to this read: the step
            # timed its pass (the work beside it priced at its forwards)
            t1 = self.policy.curves.t1 if self.policy.curves is not None else None
            seconds = wall - (step.aside * t1 if t1 else 0.0)
            if self.policy.auto and self.policy.curves is not None:
                self.policy.curves.observe(step.slots, seconds, start)
        self._waited = waited > WAITED
        return out

    # ------------------------------------------------------------- spells
    def _spell_begins(self, choice: tuple[int, bool]) -> bool:
        """Whether ``choice`` (a plain step at ``auto``) starts a spell of
        plain steps instead of a pipelined step of width 0: where the host
        times say a spell's steps leave the device idle for less
        (:meth:`HostTimes.spells_pay`), or where drafting has no credit left
        (:attr:`WidthPolicy.credit`: plain decoding's own steps, then). The
        steps in flight are read first; nothing more is launched."""
        policy = self.policy
        if choice != (0, False) or not policy.auto or policy.curves is None:
            return False
        if not policy.host.spells_pay(policy.curves.t1) and policy.credit > 0:
            return False
        self.spell = True
        self.plain_spells += 1
        self._read_at = self._asked_at = None
        self._spell_offered = policy.offered
        policy.switch = policy.host.switch_cost(policy.curves.t1)
        return True

    def _spell_step(self, root: int) -> StepOutput:
        """One plain step of a spell (:class:`~mlx_mtp.plain.PlainSteps`,
        mlx-lm's loop), then the width policy asks again from the drafter's
        view of the new root; where it chooses to draft (or to refresh the
        mask candidates), the next step ends the spell with a plain step
        that queues nothing and the pipeline starts again after it."""
        engine, clock = self.engine, self.engine.clock
        idle0, t0 = clock.idle, clock.now()
        leaving = self._resume is not None
        left = self.ctx.left
        if self.inflight:  # the spell begins with nothing in flight
            raise RuntimeError("a spell of plain steps began with a pipelined step in flight")
        queue = not leaving and (left is None or left > 1)
        at = engine.offset
        tokens = self.plain.step(engine, root, queue_next=queue)
        policy = self.policy
        now, last = clock.now(), self._read_at
        self._read_at = now if self.plain.waited > WAITED and not leaving else None
        if last is not None and self._read_at is not None and policy.auto:
            # the device was busy from the spell's read before to this one:
            # the time between them is a one-token pass, as the pipelined
            # steps' reads measure theirs
            policy.curves.observe(1, now - last, at)
        if leaving:  # the switch out: this step and the pipeline's first
            self._switch_from = self._idle_mark(t0, idle0)
        elif self._switch_from is not None:  # the switch in: the step before and this
            policy.host.record("switch", self._idle_since(self._switch_from, 2))
            self._switch_from = None
        else:
            policy.host.record("spell", self._idle_since(self._idle_mark(t0, idle0), 1))
        self.history.extend(tokens)
        self.plain_steps += 1
        self.declined += self._spell_offered
        # the switch out of the spell is drafting's cost (the switch in too)
        policy.record(clock.now() - t0, len(tokens), leaving, "spell")
        if leaving:  # the cache holds exactly the committed tokens
            self.spell = False
            self.state = None
            policy.switch = 0.0
        elif self._asked_at is None or now - self._asked_at >= self._ask_seconds / EPSILON:
            # the drafter learns the new tokens and the policy is asked whether
            # to draft: host work on a spell step's critical path (ntp's steps
            # have none, about 0.15 ms of a 5 ms step for ``pld``), so a cost of
            # drafting, asked once its time fits EPSILON of the spell's
            policy.switch = policy.host.switch_cost(policy.curves.t1)
            ask = clock.now()
            self.signal = self.drafter.learn(policy.acceptance, self.history, [])
            choice = policy.choose(self.drafter, self.signal, self.ctx)
            self._spell_offered = policy.offered
            self._asked_at = clock.now()
            self._ask_seconds = self._asked_at - ask
            if choice != (0, False):
                self._resume = choice
        return StepOutput(tokens, 0, 0, 1)

    def _idle_mark(
        self, t0: float, idle0: float | None, passes: int = 0
    ) -> tuple[float, float | None, int]:
        """A mark to measure the device's idle time from (:meth:`_idle_since`):
        the time, the clock's idle seconds, and passes to leave out."""
        return t0, idle0, passes

    def _idle_since(self, mark: tuple[float, float | None, int], passes: int) -> float:
        """Seconds the device sat idle since ``mark``, over ``passes`` one-token
        passes: the clock's where it knows them (a simulated device), else the
        time past those passes' (the host was on the critical path)."""
        t0, idle0, skip = mark
        clock = self.engine.clock
        if idle0 is not None and clock.idle is not None:
            return clock.idle - idle0
        t1 = self.policy.curves.t1 if self.policy.curves is not None else None
        return max(clock.now() - t0 - (passes + skip) * (t1 or 0.0), 0.0)

    def _device_seconds(self, slots: int, aside: float = 0.0) -> float:
        known = self.engine.clock.pass_seconds(slots)
        t1 = self.policy.curves.t1 if self.policy.curves is not None else None
        if known is not None:
            return known + (aside * self.engine.clock.pass_seconds(1) if aside else 0.0)
        return t1 * (self.curve(slots) + aside) if t1 and self.curve is not None else 0.0

    def _width(self) -> tuple[int, bool]:
        if self._resume is not None:  # chosen in the spell that just ended
            (width, masked), self._resume = self._resume, None
            self._declined.append(False)
            return width, masked
        width, masked = self.policy.choose(self.drafter, self.signal, self.ctx)
        # a width 0 at auto: declined where the drafter had nodes to offer
        self._declined.append(width == 0 and self.policy.auto and self.policy.offered)
        return width, masked

    def _read(self, root: int) -> tuple[StepOutput, float, _Launched]:
        engine = self.engine
        step = self.inflight.pop(0)
        t0 = engine.clock.now()
        out = engine.clock.block(lambda: np.array(step.out), step.done)
        waited = engine.clock.now() - t0
        a = int(out[0])
        d = step.tpl.deepest + 1
        tokens = [int(t) for t in out[1 : a + 2]]
        path = [int(t) for t in out[1 + d : 1 + d + a + 1]]
        extra, at = {}, 1 + 2 * d
        for name, size in step.extra:
            extra[name] = out[at : at + size]
            at += size
        start = len(self.history) - 1
        engine.count_forward(step.slots)
        # the cache now holds the root and the accepted drafts
        engine.cached.append(int(root))
        engine.cached.extend(tokens[:-1])
        self.history.extend(tokens)
        self.bound -= step.slots - (a + 1)
        self.plain_steps += step.width == 0
        self.declined += self._declined.pop(0)
        record = StepRecord(start, step.width, a, tokens, step.base, path, extra)
        self.signal = self.drafter.learn(self.policy.acceptance, self.history, [record])
        return StepOutput(tokens, step.width, a, 1), waited, step

    def finish(self) -> None:
        """The generation ended: the steps still in flight are dropped and
        the cache holds exactly the committed tokens (``engine.cached``)."""
        self.inflight.clear()
        self._declined.clear()
        if self.spell:
            self.plain.unqueue(self.engine, self.history[-1])
            self.spell = False
        self._resume = self._switch_from = None
        self.policy.switch = 0.0
        self.engine.settle_at(self.engine.cached)
        self.drafter.end(self.engine.cached)
        if self.policy.auto and self.policy.curves is not None:
            self.policy.curves.save()


#: host times kept per step class (:class:`HostTimes`), and the fewest that
#: make a measurement
HOST_SAMPLES = 9
HOST_MIN_SAMPLES = 3
#: a spell of plain steps replaces pipelined plain steps where it saves more
#: than this share of a one-token pass in host time on the critical path
SPELL_MARGIN = 0.05
#: what leaving a spell and coming back costs (one-token forwards) until
#: measured: about one pass of the pipelined step's graph building each way
SWITCH_PRIOR = 1.0


class HostTimes:
    """Host seconds on the critical path per step, by class: a pipelined
    plain step (width 0, no mask slots), a draft step (drafts or mask
    slots), a plain step of a *spell* (one-token steps as ``ntp`` runs
    them, :class:`~mlx_mtp.plain.PlainSteps`), and a *switch* into or out of
    a spell (the two steps around it, neither overlapped). Each sample is the time the
    device sat idle waiting for the host between one launch and the next,
    charged to the class of the step launched then (whose graph the host
    built); a class's time is the median of its last :data:`HOST_SAMPLES`
    samples (a host shared with other work stalls now and then for tens of
    milliseconds; the first pass of a new shape takes longer too), measured
    once it has :data:`HOST_MIN_SAMPLES`."""

    CLASSES = ("plain", "draft", "spell", "switch")

    def __init__(self) -> None:
        self.samples: dict[str, deque[float]] = {
            c: deque(maxlen=HOST_SAMPLES) for c in self.CLASSES
        }

    def record(self, kind: str, seconds: float) -> None:
        """One step of class ``kind`` (:attr:`CLASSES`) left the device idle ``seconds``."""
        self.samples[kind].append(max(float(seconds), 0.0))

    def seconds(self, kind: str) -> float | None:
        """The class's host seconds past the pass (None: not measured yet)."""
        got = self.samples[kind]
        # statistics.median: numpy's costs ~0.2 ms a call here, on the critical path
        return statistics.median(got) if len(got) >= HOST_MIN_SAMPLES else None

    def spells_pay(self, t1: float | None) -> bool:
        """Whether plain steps run faster as a spell than pipelined: a
        pipelined plain step leaves the device idle more than
        :data:`SPELL_MARGIN` of a one-token pass longer than a spell's step
        does (a spell not measured yet: none), which is where the host's
        work for a pipelined step exceeds the device's pass (a fast device,
        a busy host). Unknown ``t1`` or pipelined plain steps not measured
        yet: no."""
        pipelined = self.seconds("plain")
        if not t1 or pipelined is None:
            return False
        return pipelined - (self.seconds("spell") or 0.0) > SPELL_MARGIN * t1

    def switch_cost(self, t1: float | None) -> float:
        """What leaving a spell and coming back costs, in one-token forwards:
        the two switches' idle time past four spell steps'
        (:data:`SWITCH_PRIOR` until measured; 0 with ``t1`` unknown)."""
        if not t1:
            return 0.0
        switch = self.seconds("switch")
        if switch is None:
            return SWITCH_PRIOR
        return max(2.0 * (switch - 2.0 * (self.seconds("spell") or 0.0)), 0.0) / t1

    def costs(self, t1: float | None) -> tuple[float, float]:
        """``(plain, draft)`` host time past the pass in one-token forwards
        (``t1``: a one-token forward's seconds; unknown: no host term). A
        plain step is priced as it runs: as a spell's step where spells pay
        (:meth:`spells_pay`), else pipelined. A plain step not measured yet
        costs none (a draft step must pay for its own host time until plain
        steps have shown theirs), a draft step not measured yet a pipelined
        plain one's (it is measured once it runs); a draft step costs at
        least a plain one (what it costs less is noise)."""
        if not t1:
            return 0.0, 0.0
        pipelined = self.seconds("plain") or 0.0
        plain = (self.seconds("spell") or 0.0) if self.spells_pay(t1) else pipelined
        draft = self.seconds("draft")
        draft = pipelined if draft is None else draft
        return plain / t1, max(draft, plain) / t1


class WidthPolicy:
    """The width of each pipelined step, and whether mask slots ride along.

    At a fixed width every step drafts ``most`` nodes (mask slots after
    every slot where the drafter has them). At ``auto`` each step takes the
    prefix of the drafter's best-first node values that maximises expected
    tokens per unit of step time (Leviathan et al. 2023, §3.4), 0 where none
    beats a plain step. A step's time is its pass under the device's cost
    curve (and a draft model's passes beside it) plus the host time its
    class leaves on the critical path (:class:`HostTimes`: the host work
    that exceeds the device's pass makes it idle), so a draft step that
    costs more host time than a plain one must win by more. Every step
    read goes to a :class:`~mlx_mtp.ledger.StepLedger` against plain decoding's
    steps of the same tokens; past its credit (:attr:`credit`) drafting
    runs only as probes (:meth:`_afford`), so where the estimates are wrong
    the measured time bounds the loss.

    Mask slots (a drafter with a :class:`~mlx_mtp.sources.masks.MaskLayer`)
    ride along in every step where drafting with them in every step beats
    drafting without them (each side's best prefix; the candidates they make
    are the next step's drafts). Elsewhere a plain step carries them now and
    then, as a probe of the candidates, once the steps since the last cost
    :data:`EPSILON` of the refresh's price in all; the step after it may
    draft the candidates without masks.

    Args:
        most: the widest step.
        auto: plan each width (False: always ``most``).
        acceptance: the estimates the drafter learns into.
        curves: the cost curves (``auto``); a pipeline's steps refine them.
        host: the host times to start from (default: none measured; each
            generation measures its own: a warm-up's first passes of new
            shapes, or another load of the host, would mislead the next).
    """

    def __init__(
        self,
        most: int,
        auto: bool,
        acceptance: Acceptance,
        curves: LiveCurves | None = None,
        host: HostTimes | None = None,
    ):
        self.most, self.auto, self.acceptance, self.curves = most, auto, acceptance, curves
        self.host = host if host is not None else HostTimes()
        #: what choosing a draft or a refresh costs besides the step, in
        #: one-token forwards: leaving a spell and coming back (the pipeline
        #: sets it while a spell runs)
        self.switch = 0.0
        self.curve: CostCurve | None = None
        #: whether the drafter offered any node for the step last chosen
        self.offered = False
        self._idle = 0  # plain steps since the last draft (probes)
        self._stale = 0  # steps without mask slots since the last with them
        self._saving = 0.0  # the last cut's saving over plain steps (one-token forwards)
        #: the generation's steps against plain decoding's steps of the same tokens
        self.ledger = StepLedger()
        self._probed = 0.0  # the ledger's time at the last step past the credit

    # ------------------------------------------------------------ the ledger
    @property
    def t1(self) -> float | None:
        """Seconds of a one-token forward (None: unknown, or a fixed width)."""
        return self.curves.t1 if self.auto and self.curves is not None else None

    @property
    def plain_seconds(self) -> float:
        """Plain decoding's step in seconds: measured (:meth:`StepLedger.baseline
        <mlx_mtp.ledger.StepLedger.baseline>`), else a pass and a plain step's
        host time (:meth:`HostTimes.costs`)."""
        t1 = self.t1 or 0.0
        return self.ledger.baseline(t1 * (1.0 + self.host.costs(t1)[0]))

    @property
    def credit(self) -> float:
        """Seconds drafting may still lose in this generation
        (:meth:`StepLedger.credit <mlx_mtp.ledger.StepLedger.credit>`)."""
        return self.ledger.credit(self.plain_seconds)

    def record(self, seconds: float, tokens: int, drafting: bool, plain: str = "") -> None:
        """One step read (:meth:`StepLedger.record
        <mlx_mtp.ledger.StepLedger.record>`), at ``auto``."""
        if self.t1:
            self.ledger.record(seconds, tokens, drafting, plain)

    def _fits(self, worst: float) -> bool:
        """Whether a probe whose worst case costs ``worst`` seconds over a
        plain step fits :data:`~mlx_mtp.ledger.EPSILON` of the time since the
        last one; a probe is priced at least one plain step (what a rejected
        draft step measures on a host-bound device, whatever its curve says)."""
        worst = max(worst, self.plain_seconds)
        return worst <= EPSILON * (self.ledger.time - self._probed)

    def _worst(self, drafter: DeviceDrafter, n: int, k: int, hp: float, hd: float) -> float:
        """Seconds a step of ``n`` nodes with ``k`` slots each (a node and
        its mask slots) costs over a plain step where every draft is
        rejected (the switch out of a spell not included)."""
        slots = (1 + n * drafter.item_slots) * k
        cost = self.curve(slots) + n * drafter.item_cost + hd - 1.0 - hp
        return (self.t1 or 0.0) * cost

    def _afford(
        self,
        choice: tuple[int, bool],
        drafter: DeviceDrafter,
        hp: float,
        hd: float,
        credit: float,
    ) -> tuple[int, bool]:
        """``choice`` cut to the widest prefix whose worst case (every draft
        rejected) fits the ``credit`` left (leaving a spell for it, the cut
        weighed); where none does, a draft or mask step only as a probe
        whose worst case, the switch out of a spell included, fits
        :data:`~mlx_mtp.ledger.EPSILON` of the time since the last such
        step, else a plain step."""
        n, masked = choice
        if choice == (0, False):
            return choice
        k = 1 + (drafter.masks.k if masked and drafter.masks is not None else 0)
        if credit > 0:  # the widest prefix of the cut whose worst case fits the credit
            while n > 0 and self._worst(drafter, n, k, hp, hd) > credit:
                n -= 1
            if n or masked:
                return n, masked
            n = choice[0]
        switch = self.switch * (self.t1 or 0.0)
        if not self._fits(self._worst(drafter, n, k, hp, hd) + switch):
            return 0, False
        self._probed = self.ledger.time
        return choice

    def width(self, drafter: DeviceDrafter, signal: Any, ctx: Context) -> int:
        """The width of the next step launched."""
        return self.choose(drafter, signal, ctx)[0]

    def choose(self, drafter: DeviceDrafter, signal: Any, ctx: Context) -> tuple[int, bool]:
        """The width of the next step launched, and whether it carries mask
        slots: at ``auto`` the cut's choice while drafting has credit
        (:attr:`credit`), past it only probes (:meth:`_afford`)."""
        layer = drafter.masks
        if not self.auto:
            values = drafter.values(self.acceptance, self.most, signal)
            self.offered = bool(values)
            return min(self.most, len(values)), layer is not None
        self.curve = self.curves.at(ctx.engine.offset)
        hp, hd = self.host.costs(self.curves.t1)
        credit = self.credit
        if credit <= 0:
            # past the credit not even the cheapest probe (one node, or a
            # refresh of the mask slots) fits yet: a plain step, without the
            # drafter's values (their host time is on a spell step's critical path)
            cheapest = self._worst(drafter, 1, 1, hp, hd)
            if drafter.masks is not None:
                cheapest = min(cheapest, self._worst(drafter, 0, 1 + drafter.masks.k, hp, hd))
            if not self._fits(cheapest + self.switch * (self.t1 or 0.0)):
                return 0, False
        return self._afford(self._choose(drafter, signal, hp, hd), drafter, hp, hd, credit)

    def _choose(
        self, drafter: DeviceDrafter, signal: Any, hp: float, hd: float
    ) -> tuple[int, bool]:
        layer, curve = drafter.masks, self.curve
        if layer is None:
            best = None
            # a drafter with several layouts (a draft model's tree or its
            # chain alone) steps with the one whose best prefix is fastest
            for w in drafter.widths:
                drafter.use(w)
                values = drafter.values(self.acceptance, self.most, signal)
                n, rate = self._cut(curve, drafter, values, 1, hp, hd)
                # where none drafts (each at the plain rate), the layout with
                # the fewest slots an item: the cheapest probe (:meth:`_probe`)
                rank = (rate, -drafter.item_slots)
                if best is None or rank > best[0]:
                    best = (rank, w, values, n, self._saving)
            _, w, values, n, saving = best
            drafter.use(w)
            self.offered = bool(values)
            if saving <= self.switch:  # not worth leaving the spell for
                n = 0
            return self._probe(n, drafter, values, curve, hp, hd), False
        k = 1 + layer.k
        fresh = layer.fresh
        layer.assume = not fresh  # the values with the candidates' state flipped
        try:
            other = drafter.values(self.acceptance, self.most, signal)
        finally:
            layer.assume = None
        values = drafter.values(self.acceptance, self.most, signal)  # the layout sent
        self.offered = bool(values)
        with_masks, without = (values, other) if fresh else (other, values)
        _, on = self._cut(curve, drafter, with_masks, k, hp, hd)
        on_saving = self._saving
        _, off = self._cut(curve, drafter, without, 1, hp, hd)
        if on > off and on_saving > self.switch:  # masks in every step pay
            self._stale = 0
            return self._cut(curve, drafter, values, k, hp, hd)[0], True
        n, _ = self._cut(curve, drafter, values, 1, hp, hd)
        if self._saving <= self.switch:
            n = 0
        self._stale += 1
        # a refresh: a plain step carries the masks once the steps since the
        # last cost EPSILON of its price in all (its candidates are scored)
        price = curve(k) + hd - curve(1) - hp + self.switch
        if n == 0 and self._stale * EPSILON >= price:
            self._stale = 0
            return 0, True
        return n, False

    def _cut(
        self,
        curve: CostCurve,
        drafter: DeviceDrafter,
        values: list[float],
        k: int,
        hp: float,
        hd: float,
    ) -> tuple[int, float]:
        """The best prefix of ``values`` with ``k`` slots a node (a node and
        its masks) and its rate, plain (0) unless it beats a plain step (a
        step with mask slots is of the draft class)."""
        plain = 1.0 / (curve(k) + (hd if k > 1 else hp))
        self._saving = 0.0
        if not values:
            return 0, plain
        n, rate = best_prefix(
            curve,
            values,
            drafter.item_slots * k,
            base_slots=k,
            item_cost=drafter.item_cost,
            base_cost=hd,
        )
        if not n or rate <= plain:
            return 0, plain
        # the time the step saves against plain steps of its expected tokens
        tokens = 1.0 + sum(values[:n])
        self._saving = tokens / (1.0 / (curve(1) + hp)) - tokens / rate
        return n, rate

    def _probe(
        self,
        n: int,
        drafter: DeviceDrafter,
        values: list[float],
        curve: CostCurve,
        hp: float,
        hd: float,
    ) -> int:
        if n or drafter.learns_free or not values:
            self._idle = 0
            return n
        # a drafter that learns only from its drafts probes now and then: one
        # item, once the steps since the last cost EPSILON of them in all
        self._idle += 1
        loss = curve(1 + drafter.item_slots) + drafter.item_cost + hd - curve(1) - hp
        if self._idle * EPSILON >= loss + self.switch:
            self._idle = 0
            return 1
        return 0


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def _cache_arrays(engine: Engine) -> list[mx.array]:
    out = []
    for c in engine.cache:
        if c.keys is not None:
            out += [c.keys, c.values]
    return out


def pipeline_for(
    ctx: Context, method: Any, drafter: DeviceDrafter, curves: LiveCurves | None, overlap: bool
) -> Pipeline:
    """The :class:`Pipeline` of a generation of ``method`` on ``ctx`` with its
    device drafter, carrying the estimates of the method's earlier
    generations on ``ctx`` (at :data:`~mlx_mtp.acceptance.CARRY_WEIGHT`),
    except for a drafter that learns from its own drafts only (a draft
    model): it starts each generation from its priors, since after a text
    it could not predict its probes alone would have to win them back.
    Whether a generation runs one is decided by
    :func:`mlx_mtp.runners.choose_runner`."""
    key = f"pipeline:{method.settings_key()}"
    acceptance = ctx.learned.get(key)
    if not isinstance(acceptance, Acceptance) or not drafter.learns_free:
        acceptance = ctx.learned[key] = Acceptance(method.pipeline_acceptance())
    else:
        acceptance.soften(CARRY_WEIGHT)
    policy = WidthPolicy(method.max_width, method.auto, acceptance, curves)
    return Pipeline(ctx, drafter, policy, overlap)
