"""mlx-mtp: several tokens per forward pass for MLX language models.

:func:`load` loads a model with a decoding method: ``ntp`` (plain decoding),
``probe`` (ESP embedding-space probing), ``pld`` (prompt lookup) and the
others that ``mlx-mtp models`` lists; the greedy answers of the lossless
ones equal plain decoding's. For example, with the embedded model::

    import mlx_mtp

    m = mlx_mtp.load("smollm2-135m", method="pld")
    result = m.generate("Write is_prime(n) in Python.", max_tokens=32)
    print(result.text)
    print(result.finish_reason, result.stats.summary())
    chat = m.chat()  # multi-turn; the KV cache is reused across turns
    for chunk in chat.send("My name is Alice.", max_tokens=16):
        print(chunk.text, end="", flush=True)

More in :mod:`mlx_mtp.api` (tests/test_api_state.py runs these examples).
"""

import os as _os

from ._blas import preload_openblas as _preload_openblas

_os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
_preload_openblas()  # before anything imports mlx (Linux CPU speed, docs/design.md §9)

from .api import ChatSession, Chunk, MTPModel, Result, load  # noqa: E402
from .decoding import GenerationStats  # noqa: E402
from .errors import MTPError  # noqa: E402

__version__ = "0.1.0"
__all__ = ["load", "MTPModel", "ChatSession", "Chunk", "Result", "GenerationStats", "MTPError"]
