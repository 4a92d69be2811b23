"""What several threads of one process share, and the locks that guard it.

The thread contract of the Python API (docs/design.md, "Threads"): one
loaded model may serve several threads, each with its own
:class:`~mlx_mtp.api.MTPModel` (``loaded.bind(...)`` per thread). Their
generations take turns on the model: each prefill chunk and each decoding
step runs under the model's lock (:func:`model_lock`), so that the state
kept on the model's modules between a forward pass and its reading (the
native MTP layer's hidden-state tap, a hybrid model's recurrent recording,
the RoPE wrapping) belongs to one generation at a time, and MLX is never
called from two threads at once for one model (MLX before 0.31.2 was not
thread-safe at all). Between its steps a generation holds no lock: a thread
that stops reading its stream blocks nobody.

The Metal wired memory limit is one per process: :func:`wired_limit` sets it
when the first generation starts and restores it when the last one ends.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: guards the creation of model locks and the wired-limit count
_GUARD = threading.Lock()
_WIRED: dict[str, Any] = {"count": 0, "context": None}


def model_lock(model: Any) -> threading.RLock:
    """The reentrant lock of ``model`` (an ``nn.Module``), made on first use
    and kept on the module itself (its ``__dict__``, not a parameter): every
    engine over the same module object gets the same lock."""
    lock = model.__dict__.get("_mtp_lock")
    if lock is None:
        with _GUARD:
            lock = model.__dict__.get("_mtp_lock")
            if lock is None:
                lock = model.__dict__["_mtp_lock"] = threading.RLock()
    return lock


@contextmanager
def wired_limit(model: Any, streams: list[Any] | None = None) -> Iterator[None]:
    """mlx-lm's ``wired_limit`` (the Metal wired memory limit for ``model``;
    nothing on a CPU) shared by the generations of this process: the first
    to enter sets it, the last to leave restores the limit from before (each
    thread's own exit waits for its ``streams``). Entering it once per
    generation, as a single thread does, behaves as mlx-lm's."""
    import mlx.core as mx
    from mlx_lm.generate import wired_limit as mlx_wired_limit

    with _GUARD:
        if _WIRED["count"] == 0:
            ctx = mlx_wired_limit(model, streams=streams)
            ctx.__enter__()
            _WIRED["context"] = ctx
        _WIRED["count"] += 1
    try:
        yield
    finally:
        for s in streams or []:
            mx.synchronize(s)
        with _GUARD:
            _WIRED["count"] -= 1
            if _WIRED["count"] == 0:
                ctx, _WIRED["context"] = _WIRED["context"], None
                ctx.__exit__(None, None, None)
