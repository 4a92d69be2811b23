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
   (building graphs, reading, learning) overlaps the device.

A plain step is a step of width 0 (the root alone), so plain steps and draft
steps share one pipeline and switching between them costs nothing. Each
width is chosen before the step before it is read, from what is known then
(:class:`WidthPolicy`).

Greedy only: the committed tokens are exactly plain greedy decoding's (the
walk follows the argmax, as :func:`mlx_mtp.verify.walk_tree`), checked token
for token in float32 by the tests. The policy is the expected-tokens-per-time
objective of Leviathan et al. 2023 (§3.4) under the device's cost curve; the
pipeline itself follows mlx-lm's ``generate_step`` (``mx.async_eval`` of the
next step before the current one is read).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from . import distributed
from .acceptance import Acceptance, chain_values
from .budget import CostCurve, best_prefix
from .engine import Engine, ancestors
from .planner import StepOutput

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
    """

    parents: np.ndarray
    depth: np.ndarray
    paths: np.ndarray
    chain: bool
    anc: np.ndarray | None = None
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
        return cls(par, depth, paths, chain, None if chain else anc)

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


class DeviceDrafter:
    """A draft source whose drafts are chosen on the device (see the module
    doc). Subclasses implement :meth:`template`, :meth:`draft` and, to
    learn, :meth:`learn` (host, after the next step was launched) and
    :meth:`update` (lazy state updates inside a step's graph)."""

    #: the acceptance statistics' source name
    name = ""

    def begin(self, ctx: Context, prompt: list[int]) -> None:
        """A generation starts after ``prompt``."""

    def template(self, width: int) -> Template:
        """The pass of ``width`` draft nodes (0: a plain step)."""
        return Template.chain_of(width)

    def values(self, acceptance: Acceptance, most: int, signal: Any) -> list[float]:
        """Expected accepted tokens of each of the first ``most`` template
        nodes, best first, for the width policy (``signal``: what
        :meth:`learn` returned last, a hint about the next draft)."""
        return chain_values(acceptance.qs(self.name, most))

    def draft(self, state: DeviceState, tpl: Template) -> mx.array:
        """The (N - 1,) int32 lazy draft tokens of ``tpl``'s nodes after
        ``state.root``."""
        raise NotImplementedError

    def update(self, state: DeviceState, tokens: mx.array, logits: mx.array, tpl: Template) -> None:
        """Lazy updates of the drafter's device state from a pass (``tokens``
        (N,), ``logits`` (N, V)); none by default."""

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
    """

    start: int
    width: int
    accepted: int
    tokens: list[int]


@dataclass
class _Launched:
    tpl: Template
    width: int
    out: mx.array  # (D + 2,) int32: [accepted, committed tokens...]
    done: float
    slots: int


class Pipeline:
    """Runs one generation's steps of a method with a :class:`DeviceDrafter`
    (see the module doc); the decoding loop calls :meth:`step` as it would
    a planner's.

    Args:
        ctx: the method's context.
        drafter: the device drafter.
        policy: the width of each step.
        acceptance: the acceptance estimates the drafter learns into.

    Attributes:
        plain_steps: steps of width 0 so far.
        reprobes, plain_spells: 0 (the decoding loop's statistics ask).
        curve: the cost curve the policy plans with (None at a fixed width).
    """

    def __init__(self, ctx: Context, drafter: DeviceDrafter, policy: WidthPolicy):
        self.ctx, self.drafter, self.policy = ctx, drafter, policy
        self.engine: Engine = ctx.engine
        self.plain_steps = self.reprobes = self.plain_spells = 0
        self.state: DeviceState | None = None
        self.inflight: list[_Launched] = []
        self.bound = 0  # the most tokens the cache can hold after the steps in flight
        self.history: list[int] = []
        self.unread: list[StepRecord] = []
        self.signal: Any = None
        drafter.begin(ctx, list(self.engine.cached))

    @property
    def curve(self) -> CostCurve | None:
        """The cost curve the width policy planned the last step with."""
        return self.policy.curve

    # -------------------------------------------------------------- steps
    def _start(self, root: int) -> None:
        engine = self.engine
        self.history = [*engine.cached, int(root)]
        at = len(engine.cached)
        buf = np.zeros(_round_up(at + 1 + HISTORY_STEP, HISTORY_STEP), dtype=np.int32)
        buf[: at + 1] = self.history
        self.state = DeviceState(
            mx.array(at, dtype=mx.int32), mx.array(int(root), dtype=mx.int32), mx.array(buf)
        )
        self.bound = at

    def _launch(self, width: int) -> None:
        """Build step k+1 on the lazy state after step k and start it."""
        engine, st = self.engine, self.state
        tpl = self.drafter.template(width)
        n = tpl.n
        rows = self.bound + n
        hist = st.history
        need = rows + tpl.deepest + 2
        if hist.shape[0] < need:
            grow = _round_up(need, HISTORY_STEP) - hist.shape[0]
            hist = mx.concatenate([hist, mx.zeros((grow,), dtype=mx.int32)])
        st = DeviceState(st.at, st.root, hist)
        if n > 1:
            drafts = self.drafter.draft(st, tpl).astype(mx.int32)
            tokens = mx.concatenate([st.root.reshape(1), drafts])
        else:
            tokens = st.root.reshape(1)
        anc = tpl.arrays().get("anc")
        logits, views = engine.forward_at(
            tokens, st.at, rows, anc, None if tpl.chain else tpl.depth
        )
        targets = mx.argmax(logits, axis=-1).astype(mx.int32)
        a, path, committed = device_walk(tokens, targets, tpl)
        if not tpl.chain:
            engine.move_rows_at(views, path[1:], st.at + 1)
        self.drafter.update(st, tokens, logits, tpl)
        history = mx.slice_update(hist, committed, (st.at + 1).reshape(1), axes=(0,))
        bonus = mx.take(committed, a)
        self.state = DeviceState(st.at + a + 1, bonus, history)
        out = mx.concatenate([a.reshape(1), committed])
        state = [self.state.at, self.state.root, self.state.history]
        done = engine.clock.launch([out, *state, *_cache_arrays(engine)], n)
        self.inflight.append(_Launched(tpl, width, out, done, n))
        self.bound += n

    def step(self, root: int) -> StepOutput:
        """Commit the tokens of the step in flight after ``root`` (launching
        it first if none is), with the next step launched before reading."""
        clock = self.engine.clock
        t0 = clock.now()
        if self.state is None:
            self._start(root)
        if not self.inflight:
            self._launch(self._width())
        left = self.ctx.left
        if left is None or left > 1:  # a generation that goes on: the next step first
            self._launch(self._width())
        out, waited, slots = self._read(root)
        # device time, as for pipelined plain steps: the whole step but the host
        # work the device did not overlap, which is none where the host had to
        # wait for the result, else what exceeds the pass's time as the clock
        # or the cost curve knows it (unknown: all of it)
        wall = clock.now() - t0
        host = 0.0 if waited > WAITED else max(wall - self._device_seconds(slots), 0.0)
        clock.add(wall - host)
        return out

    def _device_seconds(self, slots: int) -> float:
        clock = self.engine.clock
        if clock.simulated:
            return clock.seconds_per_token * clock.curve(slots)
        t1 = self.policy.curves.t1 if self.policy.curves is not None else None
        return t1 * self.curve(slots) if t1 and self.curve is not None else 0.0

    def _width(self) -> int:
        width = self.policy.width(self.drafter, self.signal, self.ctx)
        if width == 0:
            self.plain_steps += 1
        return width

    def _read(self, root: int) -> tuple[StepOutput, float, int]:
        engine = self.engine
        step = self.inflight.pop(0)
        t0 = engine.clock.now()
        out = engine.clock.block(lambda: np.array(step.out), step.done)
        waited = engine.clock.now() - t0
        a = int(out[0])
        tokens = [int(t) for t in out[1 : a + 2]]
        start = len(self.history) - 1
        engine.count_forward(step.slots)
        # the cache now holds the root and the accepted drafts
        engine.cached.append(int(root))
        engine.cached.extend(tokens[:-1])
        self.history.extend(tokens)
        self.bound -= step.slots - (a + 1)
        self.unread.append(StepRecord(start, step.width, a, tokens))
        self.signal = self.drafter.learn(self.policy.acceptance, self.history, self.unread)
        self.unread = []
        return StepOutput(tokens, step.width, a, 1), waited, step.slots

    def finish(self) -> None:
        """The generation ended: the steps still in flight are dropped and
        the cache holds exactly the committed tokens (``engine.cached``)."""
        self.inflight.clear()
        self.engine.settle_at(self.engine.cached)


class WidthPolicy:
    """The width of each pipelined step.

    At a fixed width every step drafts ``most`` nodes. At ``auto`` each step
    takes the prefix of the drafter's best-first node values that maximises
    expected tokens per unit of forward time under the device's cost curve
    (Leviathan et al. 2023, §3.4), 0 where none beats a plain step. The host
    work is left out: it overlaps the device.

    Args:
        most: the widest step.
        auto: plan each width (False: always ``most``).
        acceptance: the estimates the drafter learns into.
        curves: the cost curves (``auto``).
    """

    def __init__(
        self, most: int, auto: bool, acceptance: Acceptance, curves: LiveCurves | None = None
    ):
        self.most, self.auto, self.acceptance, self.curves = most, auto, acceptance, curves
        self.curve: CostCurve | None = None

    def width(self, drafter: DeviceDrafter, signal: Any, ctx: Context) -> int:
        """The width of the next step launched."""
        if not self.auto:
            return self.most
        self.curve = self.curves.at(ctx.engine.offset)
        values = drafter.values(self.acceptance, self.most, signal)
        n, _ = best_prefix(self.curve, values, 1)
        return n


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def _cache_arrays(engine: Engine) -> list[mx.array]:
    out = []
    for c in engine.cache:
        if c.keys is not None:
            out += [c.keys, c.values]
    return out


def pipeline_for(
    ctx: Context, method: Any, sampler: Any, curves: LiveCurves | None
) -> Pipeline | None:
    """The :class:`Pipeline` of a generation of ``method`` on ``ctx``, or None
    where its steps run through the planner instead: a method without a
    device drafter, sampling (temperature > 0), a cache that is not plain
    (sliding windows, quantized or recurrent layers), a model sharded over
    several ranks, or ``MLX_MTP_PIPELINE=0``."""
    if sampler is not None or os.environ.get("MLX_MTP_PIPELINE") == "0":
        return None
    if distributed.size() > 1 or not ctx.engine.lazy_ready():
        return None
    drafter = method.device_drafter(ctx)
    if drafter is None:
        return None
    key = f"pipeline:{method.settings_key()}"
    acceptance = ctx.learned.get(key)
    if not isinstance(acceptance, Acceptance):
        acceptance = ctx.learned[key] = Acceptance(method.pipeline_acceptance())
    else:
        acceptance.soften(CARRY_WEIGHT)
    policy = WidthPolicy(method.max_width, method.auto, acceptance, curves)
    return Pipeline(ctx, drafter, policy)


#: weight of what one generation learned when the next one on the context starts
CARRY_WEIGHT = 0.5
