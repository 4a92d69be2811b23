"""Scale-out over several processes or machines with ``mlx.distributed``.

When a launcher sets up an MLX group of more than one process (``mlx.launch
-n N``, or ``MLX_HOSTFILE`` + ``MLX_RANK`` with the ring backend), the model is
sharded at load as mlx-lm's ``sharded_load`` / ``mlx_lm.chat`` do: tensor
parallel by default (``model.shard(group)``: every rank holds 1/N of each
layer's heads and MLP columns), pipeline parallel on request or where the head
counts do not divide N (``model.model.pipeline(group)``: every rank holds a
run of layers). A sharded model keeps the ``model(inputs, cache=...,
input_embeddings=...)`` interface and every rank gets the full logits, so
the tree forward passes of the multi-token methods run unchanged.

The one rule this module serves: **every rank takes the same decisions.**
Anything that is a pure function of the logits (greedy choices, draft trees)
agrees by itself. Anything else -- a timing measurement (``bc=auto``'s
slot cost), a random seed, a line typed by the user, a request, a
cancellation -- is decided on rank 0 and shared with :func:`agree` (one
line at the call site). Ranks that disagree build different graphs, wait on
each other's collectives and hang or lose the ring connection (docs/design.md,
failure class 14).

Without a group (one process) every function here is a no-op that returns
its input, so callers need no ``if distributed`` of their own.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, TypeVar

import mlx.core as mx
import mlx.nn as nn

from .errors import MTPError, UnsupportedModelError

T = TypeVar("T")

_GROUP: list[Any] = []  # [group or None] once initialised


def group() -> mx.distributed.Group | None:
    """The MLX group of this process, or None when it runs alone.

    Initialised once, on first use, with ``mx.distributed.init()`` (any
    backend the launcher configured: ring with ``MLX_HOSTFILE``/``MLX_RANK``,
    JACCL, MPI). Without a launcher that is a group of one, reported as None.
    """
    if not _GROUP:
        g = mx.distributed.init()
        _GROUP.append(g if g.size() > 1 else None)
    return _GROUP[0]


def size() -> int:
    """Number of processes in the group (1 when alone)."""
    g = group()
    return 1 if g is None else g.size()


def rank() -> int:
    """This process's rank (0 when alone)."""
    g = group()
    return 0 if g is None else g.rank()


def is_main() -> bool:
    """Whether this process is rank 0, the one that prints, writes files and
    serves HTTP."""
    return rank() == 0


def _all_sum(x: mx.array) -> mx.array:
    out = mx.distributed.all_sum(x, group=group(), stream=mx.cpu)
    mx.eval(out)
    return out


def agree(value: T) -> T:
    """Rank 0's ``value`` on every rank (every rank must call it, in the same
    order).

    Use it for every decision that is not a pure function of the logits:
    timings (``bc=auto``, cost curves, budgets), seeds, user input, requests,
    stop and cancellation flags. Any picklable object; it travels as bytes
    (one ``all_sum`` of the length, one of the bytes, zeros on the other
    ranks), so a float arrives bit for bit. Rank 0 gets its own value back.
    Alone (no group) it returns ``value`` at once.
    """
    if group() is None:
        return value
    if rank() == 0:
        data = pickle.dumps(value)
        _all_sum(mx.array([len(data)], dtype=mx.int32))
        _all_sum(mx.array(memoryview(data), dtype=mx.uint8))
        return value
    n = int(_all_sum(mx.zeros((1,), dtype=mx.int32)).item())
    data = _all_sum(mx.zeros((n,), dtype=mx.uint8))
    return pickle.loads(bytes(memoryview(data)))


def on_main(fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 only and return its result on every rank (for work
    with side effects that must happen once: reading a file that only rank 0
    has, importing a model, planning a benchmark). An :class:`MTPError` or
    ``OSError`` it raises is raised on every rank, with rank 0's message, so
    that no rank is left waiting for the others. Alone: ``fn()``.
    """
    if group() is None:
        return fn()
    result, err = None, None
    if is_main():
        try:
            result = fn()
        except (MTPError, OSError) as e:
            err = (isinstance(e, OSError), type(e).__name__, str(e))
    result, err = agree((result, err))
    if err is not None:
        from . import errors

        is_os, name, message = err
        cls = getattr(errors, name, None)
        if not (isinstance(cls, type) and issubclass(cls, MTPError)):
            cls = OSError if is_os else MTPError
        raise cls(message)
    return result


def agree_flag(flag: bool) -> bool:
    """Rank 0's boolean on every rank with one 4-byte ``all_sum`` (for checks
    made every decoding step, e.g. a cancellation)."""
    if group() is None:
        return bool(flag)
    mine = 1 if (rank() == 0 and flag) else 0
    return bool(_all_sum(mx.array([mine], dtype=mx.int32)).item())


def all_min(value: int) -> int:
    """The smallest of every rank's integer (e.g. a memory limit, so that
    all ranks refuse the same block size)."""
    if group() is None:
        return int(value)
    out = mx.distributed.all_min(
        mx.array([int(value)], dtype=mx.int64), group=group(), stream=mx.cpu
    )
    return int(out.item())


def barrier() -> None:
    """Wait until every rank gets here (a one-element ``all_sum``)."""
    if group() is not None:
        _all_sum(mx.array([1], dtype=mx.int32))


# ------------------------------------------------------------------ sharding
def _arg(model: nn.Module, *names: str) -> int:
    args = getattr(model, "args", None)
    for n in names:
        v = getattr(args, n, None)
        if isinstance(v, int) and v > 0:
            return v
    return 0


def tensor_sizes(model: nn.Module, up_to: int = 64) -> list[int]:
    """Group sizes (1..``up_to``) that tensor parallelism can split this model
    over: the query heads, the key/value heads and the MLP width must all
    divide by the size. Empty if the model has no ``shard`` method."""
    if not hasattr(model, "shard"):
        return []
    dims = [
        _arg(model, "num_attention_heads"),
        _arg(model, "num_key_value_heads", "num_attention_heads"),
        _arg(model, "intermediate_size"),
    ]
    dims = [d for d in dims if d]
    return [n for n in range(1, up_to + 1) if all(d % n == 0 for d in dims)]


def pipeline_sizes(model: nn.Module) -> list[int]:
    """Group sizes pipeline parallelism can split this model over (at least
    one layer per rank). Empty if ``model.model`` has no ``pipeline`` method."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "pipeline"):
        return []
    return list(range(1, len(inner.layers) + 1))


def shard_model(model: nn.Module, grp: Any = None, pipeline: bool = False) -> str:
    """Shard ``model`` in place over ``grp`` (default: :func:`group`), as
    mlx-lm's ``sharded_load`` does, and return how: ``"tensor"`` or
    ``"pipeline"``.

    Tensor parallel (``model.shard(group)``) unless ``pipeline`` is set; a
    model whose head counts or MLP width do not divide the group size falls
    back to pipeline parallel where the model has it. The check comes first,
    so a refused model is left as it was.

    Raises:
        UnsupportedModelError: the model can be split neither way over this
            many ranks; the message names the model's head counts and the
            group sizes that work.
    """
    grp = grp or group()
    if grp is None:
        raise UnsupportedModelError(
            "shard_model needs a group of several ranks; start the program with mlx.launch."
        )
    n = grp.size()
    mtype = getattr(model, "model_type", type(model).__name__)
    tsizes, psizes = tensor_sizes(model), pipeline_sizes(model)
    heads = _arg(model, "num_attention_heads")
    kv = _arg(model, "num_key_value_heads", "num_attention_heads")
    mlp = _arg(model, "intermediate_size")
    what = f"model type {mtype!r} ({heads} query / {kv} key-value heads, MLP width {mlp})"
    if pipeline:
        if n in psizes:
            model.model.pipeline(grp)
            return "pipeline"
        if not psizes:
            raise UnsupportedModelError(
                f"--pipeline: {what} has no pipeline parallelism in mlx-lm "
                f"(model.model.pipeline). Drop --pipeline for tensor parallelism"
                + (f" (group sizes {_sizes(tsizes)})." if tsizes else ".")
            )
        raise UnsupportedModelError(
            f"--pipeline: {what} has {len(psizes)} layers, fewer than the {n} ranks; "
            f"use at most {len(psizes)} ranks."
        )
    if n in tsizes:
        model.shard(grp)
        return "tensor"
    if n in psizes:
        model.model.pipeline(grp)
        return "pipeline"
    if tsizes:
        hint = f"tensor parallelism works with {_sizes(tsizes)} ranks"
    else:
        hint = "mlx-lm has no tensor parallelism (model.shard) for it"
    if psizes:
        hint += f"; pipeline parallelism with up to {len(psizes)}"
    else:
        hint += " and no pipeline parallelism (model.model.pipeline)"
    raise UnsupportedModelError(
        f"Cannot shard {what} over {n} ranks: {hint}. Launch with a group size that works."
    )


def _sizes(sizes: list[int]) -> str:
    shown = [str(s) for s in sizes[:8]]
    return ", ".join(shown) + (", ..." if len(sizes) > 8 else "")


def sharding(model: nn.Module) -> str | None:
    """How ``model`` is sharded: ``"tensor"``, ``"pipeline"`` or None."""
    inner = getattr(model, "model", None)
    if getattr(inner, "pipeline_size", 1) > 1:
        return "pipeline"
    sharded = (nn.layers.distributed.AllToShardedLinear, nn.layers.distributed.ShardedToAllLinear)
    qsharded = tuple(
        getattr(nn.layers.distributed, c)
        for c in ("QuantizedAllToShardedLinear", "QuantizedShardedToAllLinear")
        if hasattr(nn.layers.distributed, c)
    )
    for _, m in model.named_modules():
        if isinstance(m, sharded + qsharded) and getattr(m, "group", None) is not None:
            if m.group.size() > 1:
                return "tensor"
    return None
