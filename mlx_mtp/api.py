"""Python API for apps: load a model with a method, generate or stream text.

One model and one method (:func:`load`)::

    import mlx_mtp

    m = mlx_mtp.load("smollm2-135m", method="probe", bc=30, masks=1)
    print(m.generate("What is the capital of France?", max_tokens=32).text)
    for chunk in m.stream_generate("Tell me a story", max_tokens=32):
        print(chunk.text, end="", flush=True)

Several methods on one model, loaded once (each binding has its own KV
cache; :meth:`LoadedModel.bind <mlx_mtp.loading.LoadedModel.bind>`)::

    from mlx_mtp.loading import load_model

    lm = load_model("smollm2-135m")
    probe, pld = lm.bind("probe"), lm.bind("pld", max_draft=10)
    print(pld.generate("Repeat after me: one two three.", max_tokens=16).text)

(tests/test_api_state.py runs these examples.)
"""

from __future__ import annotations

from typing import Any

from .batch_api import BATCH_METHODS, RowSampler, batch_generate, native_layer
from .errors import (
    InvalidArgumentError,
)
from .loading import (
    EMBEDDED_MODEL,
    load_model,
    share_target,
)
from .methods import make_method
from .model import ChatSession, Chunk, MTPModel, Prompt, Result, check_keywords
from .runners import check_runner
from .validation import check_kv, check_value

__all__ = [
    "BATCH_METHODS",
    "ChatSession",
    "Chunk",
    "MTPModel",
    "Prompt",
    "Result",
    "RowSampler",
    "batch_generate",
    "check_keywords",
    "load",
    "native_layer",
]


def load(
    model: str = EMBEDDED_MODEL,
    method: str = "ntp",
    *,
    dtype: str | None = None,
    max_kv_size: int | None = None,
    thinking: bool = False,
    pipeline_parallel: bool = False,
    runner: str = "auto",
    pipeline: bool = False,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    **method_options: Any,
) -> MTPModel:
    """Load a model and a multi-token method.

    Args:
        model: alias, folder, ``.gguf`` file or Hugging Face repo id.
        method: ``ntp``, ``pld``, ``probe`` (see ``mlx-mtp models``).
        thinking: ``enable_thinking`` for hybrid-thinking chat templates
            (Qwen3); off by default.
        dtype: compute dtype (float32 default on Linux CPU; as stored on Mac).
        max_kv_size: sliding-window KV cache size (tokens), None for unbounded.
        kv_bits: 4 or 8: keep the KV cache quantized (mlx-lm's
            ``QuantizedKVCache``, from the first token), None for full
            precision; not with ``max_kv_size``.
        kv_group_size: quantization group size of the KV cache (32, 64, 128).
        pipeline_parallel: under ``mlx.launch`` (a group of several ranks),
            shard the model by layers instead of by heads (see
            :mod:`mlx_mtp.distributed`); ``pipeline`` is the same.
        runner: ``auto``, ``pipelined`` or ``synchronous``: the runner of
            the decoding steps (:mod:`mlx_mtp.runners`).
        **method_options: e.g. ``bc=30, masks=2, tree="dynamic"`` for probe.

    Raises:
        ModelNotFoundError, ModelLoadError, UnknownMethodError,
        UnsupportedModelError, InvalidArgumentError (unknown method options,
        out-of-range values; all checked before the model is loaded where
        they can be).
    """
    if not isinstance(model, str):
        raise InvalidArgumentError(
            f"model must be a string (alias, path or repo id), got {model!r}"
        )
    if not isinstance(method, str):
        raise InvalidArgumentError(f"method must be a string, got {method!r}")
    m = make_method(method, **method_options)  # validate before the slow load
    if max_kv_size is not None:
        check_value("max_kv_size", max_kv_size)
    if not isinstance(thinking, bool):
        raise InvalidArgumentError(f"thinking must be True or False, got {thinking!r}")
    check_runner(runner)
    check_kv(kv_bits, kv_group_size)
    if kv_bits is not None and max_kv_size is not None:
        raise InvalidArgumentError(
            "kv_bits and max_kv_size cannot be combined: a sliding window is not quantized "
            "(use one of --kv-bits and --max-kv-size)."
        )
    lm = load_model(model, dtype, pipeline=pipeline_parallel or pipeline)
    shared = share_target(lm, method_options)
    if shared is not method_options:  # the draft model is the target: its weights, once
        m = make_method(method, **shared)
    return lm.bind(
        m,
        max_kv_size=max_kv_size,
        thinking=thinking,
        runner=runner,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
    )
