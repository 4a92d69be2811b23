"""Memory against the machine's limit: a model's weights before they are
read, and how large a forward pass may be.

:func:`check_weights_fit` compares the weights a load will hold (summed from
the safetensors headers, at the dtype they are loaded in) with the memory
this machine can give them (:func:`load_limit`), before any weight is read.
An unbounded block size allocates an ``(N, N)`` mask and ``N x vocabulary``
logits (docs/design.md, failure class 13). :func:`check_slots` refuses such a
pass with a message that names the estimate, the limit and the largest block
complexity that fits, before anything is allocated.
"""

from __future__ import annotations

import json
import math
import os
import resource
import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from . import distributed
from .errors import InvalidArgumentError, ModelLoadError

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


# ------------------------------------------------------------ model weights
#: bytes per element of the compute dtypes a load casts float weights to
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: the weights' copies that full fine-tuning holds beside the model: the
#: student, its gradients and AdamW's two moments
FULL_TRAINING_COPIES = 4


def safetensors_header(path: Path) -> dict[str, dict]:
    """The tensors a ``.safetensors`` file holds (name -> dtype, shape,
    data_offsets), read from its header only (no tensor data).

    Raises:
        ModelLoadError: the file is too short or its header is not JSON.
    """
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 << 20:
                raise ValueError(f"a header of {n} bytes")
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as e:
        raise ModelLoadError(
            f"{path} is not a readable safetensors file ({e}); the folder may be corrupt or "
            "incomplete: delete it and convert or download it again."
        ) from e
    header.pop("__metadata__", None)
    return header


def weights_bytes(folder: Path, dtype: str) -> tuple[int, int]:
    """The bytes of a model folder's weights as stored and as loaded in
    ``dtype``, from the safetensors headers of the files mlx-lm loads
    (``model*.safetensors``).

    With ``dtype`` ``"auto"`` the weights are loaded as stored. Otherwise
    float weights take ``dtype``'s size, and quantized ones (a packed
    ``uint32`` weight beside its ``scales``; the group size from
    ``config.json``) their dequantized size, their scales and biases gone.
    """
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    quant = config.get("quantization") or {}
    tensors: dict[str, dict] = {}
    for f in sorted(folder.glob("model*.safetensors")):
        tensors.update(safetensors_header(f))
    stored = loaded = 0
    size = DTYPE_BYTES.get(dtype)
    for name, t in tensors.items():
        start, end = t["data_offsets"]
        stored += end - start
        if size is None:
            continue
        module, _, leaf = name.rpartition(".")
        packed = quant and f"{module}.scales" in tensors
        elements = math.prod(t["shape"])
        if packed and leaf in ("scales", "biases"):
            continue  # dequantized into the weight
        if packed and t["dtype"] == "U32":
            # the input width is the scales' groups x the group size (a
            # per-layer setting where config.json has one); the bits may vary
            own = quant.get(module)
            group = (own if isinstance(own, dict) else quant).get("group_size", 64)
            rows = math.prod(t["shape"][:-1])
            loaded += rows * tensors[f"{module}.scales"]["shape"][-1] * group * size
        elif t["dtype"].startswith(("F", "BF")):
            loaded += elements * size
        else:
            loaded += end - start
    return stored, (loaded if size is not None else stored)


def available_memory() -> int | None:
    """Memory the system can give now without swapping (Linux's
    ``MemAvailable``), or None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def load_limit() -> tuple[int, str]:
    """The memory a model's weights may take, in bytes, and where the figure
    comes from: :func:`memory_limit` (on a Mac the GPU's recommended working
    set), or the memory available now where that is smaller (Linux). In a
    process group, :func:`memory_limit`'s smallest rank's figure, so that
    every rank refuses alike."""
    limit = memory_limit()
    if distributed.group() is not None:
        return limit
    avail = available_memory()
    if avail is not None and avail < limit[0]:
        return avail, "memory available now"
    return limit


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def check_weights_fit(
    folder: Path,
    dtype: str,
    name: str,
    copies: int = 1,
    what: str = "its weights",
    todo: str | None = None,
) -> None:
    """Refuse to load a model whose weights would not fit in memory, before
    any weight is read.

    Args:
        folder: the model folder (``model*.safetensors``, ``config.json``).
        dtype: the dtype it is loaded in (``"auto"``: as stored).
        name: the model as the user named it (for the message).
        copies: how many times the weights are held (training: the model
            and :data:`FULL_TRAINING_COPIES` more).
        what: what the memory is for (for the message).
        todo: what to do instead (default: a smaller or quantized model, or
            ``--dtype auto`` where the load upcasts).

    Raises:
        ModelLoadError: naming the weights' size, the memory and what to do.
    """
    stored, loaded = weights_bytes(folder, dtype)
    need = max(stored, loaded) * copies
    need //= distributed.size()  # in a group each rank holds its share
    limit, source = load_limit()
    if need <= limit:
        return
    kind = "weights as stored" if dtype == "auto" else f"{dtype} weights"
    size = (f"{copies} x " if copies > 1 else "") + f"{_gb(max(stored, loaded))} of {kind}"
    if loaded > stored:
        size += f"; {_gb(stored)} as stored"
    if todo is None:
        todo = "a smaller or quantized model"
        if loaded > stored:
            todo += ", or dtype 'auto' (--dtype auto) to keep the weights as stored"
    raise ModelLoadError(
        f"{name}: {what} would take {_gb(need)} ({size}), more than the {_gb(limit)} "
        f"{source} on this machine. Use {todo}."
    )


def check_gguf_fits(path: Path) -> None:
    """Refuse to import a ``.gguf`` file larger than the memory this machine
    can give it (the import reads it whole), before it is read.

    Raises:
        ModelLoadError: naming the file's size, the memory and what to do.
    """
    size = Path(path).stat().st_size
    limit, source = load_limit()
    if size > limit:
        raise ModelLoadError(
            f"{path}: the GGUF file is {_gb(size)}, more than the {_gb(limit)} {source} on "
            "this machine. Use a smaller or more quantized model."
        )
