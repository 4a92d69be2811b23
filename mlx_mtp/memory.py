"""How large a forward pass may be: scratch memory against the machine's limit.

An unbounded block size allocates an ``(N, N)`` mask and ``N x vocabulary``
logits (docs/design.md, failure class 13). :func:`check_slots` refuses such a
pass with a message that names the estimate, the limit and the largest block
complexity that fits, before anything is allocated.
"""

from __future__ import annotations

import os
import resource
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from . import distributed
from .errors import InvalidArgumentError

#: share of :func:`memory_limit` one forward pass's scratch memory may take
SLOT_MEMORY_SHARE = 0.25

_GROUP_LIMIT: list[tuple[int, str]] = []


def memory_limit() -> tuple[int, str]:
    """The memory a process may use, in bytes, and where the figure comes from:
    the smallest of physical memory, the GPU's recommended working set (Apple
    silicon) and the address-space limit (``ulimit -v``)."""
    limits: list[tuple[int, str]] = []
    try:
        limits.append((os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "memory"))
    except (ValueError, OSError, AttributeError):
        pass
    try:
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        ws = int(info.get("max_recommended_working_set_size", 0))
        if ws > 0:
            limits.append((ws, "GPU working set"))
    except Exception:  # no Metal device (CPU backend): nothing to add
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append((int(soft), "address-space limit (ulimit -v)"))
    limit = min(limits) if limits else (16 << 30, "assumed")
    if distributed.group() is not None:  # the smallest rank's, so all refuse alike
        if not _GROUP_LIMIT:
            least = distributed.all_min(limit[0])
            _GROUP_LIMIT.append(limit if least == limit[0] else (least, "smallest rank's memory"))
        return _GROUP_LIMIT[0]
    return limit


def forward_bytes(model: Any, n: int, context: int = 0) -> int:
    """Estimated scratch memory (bytes) of one forward pass of ``n`` slots
    after ``context`` cached tokens: attention scores and their softmax
    (float32, every query head, ``n x (context + n)``), the tree mask, and the
    logits of every slot (``n x vocab``, float32)."""
    args = getattr(model, "args", None)
    heads = int(getattr(args, "num_attention_heads", 0) or 32)
    vocab = int(getattr(args, "vocab_size", 0) or 152_064)
    hidden = int(getattr(args, "hidden_size", 0) or 4096)
    width = context + n
    return n * width * (2 * 4 * heads + 3) + n * vocab * 4 + n * hidden * 4 * 16


def max_slots(model: Any, context: int = 0) -> int:
    """The largest forward pass (slots) whose :func:`forward_bytes` fits in
    ``SLOT_MEMORY_SHARE`` of :func:`memory_limit`."""
    budget = SLOT_MEMORY_SHARE * memory_limit()[0]
    lo, hi = 0, 1
    while forward_bytes(model, hi, context) <= budget and hi < 1 << 24:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if forward_bytes(model, mid, context) <= budget else (lo, mid)
    return lo


def check_slots(model: Any, n: int, context: int, what: str = "") -> None:
    """Refuse a forward pass of ``n`` slots after ``context`` cached tokens
    that would not fit in memory.

    Args:
        model: the mlx-lm model (its args give heads, vocabulary, width).
        n: slots (tokens + masks) of the pass, i.e. the block complexity.
        context: cached tokens before it.
        what: the method's settings, for the message.

    Raises:
        InvalidArgumentError: naming the estimate, the limit and the largest
            block complexity that fits.
    """
    if n <= 1:
        return
    need = forward_bytes(model, n, context)
    limit, source = memory_limit()
    if need > SLOT_MEMORY_SHARE * limit:
        raise InvalidArgumentError(
            f"{what or 'this method'}: a forward pass of {n} tokens (block complexity) "
            f"after {context} cached tokens needs about {need / 1e9:.1f} GB of scratch "
            f"memory, over {SLOT_MEMORY_SHARE:.0%} of the {limit / 1e9:.1f} GB {source}. "
            f"The largest block complexity that fits is {max_slots(model, context)}; the "
            "papers use 10-60. Use a smaller --bc (or method option), or --bc auto."
        )


def weight_bytes(model: Any) -> int:
    """Bytes of a model's parameters (what a memory-bound pass reads)."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))
