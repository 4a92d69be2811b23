"""The ``mlx_lm`` benchmark row: mlx-lm's own generation loop as a peer baseline.

``ntp`` is this package's plain decoding through :class:`~mlx_mtp.engine.Engine`;
``mlx_lm`` is what a user would otherwise run: ``mlx_lm.generate.stream_generate``
(its prefill in steps of 2048, ``mx.async_eval`` pipelining, ``wired_limit``,
periodic ``mx.clear_cache``) on the same model object and the same prompt ids,
interleaved with the other methods by the runner (DESIGN §7: "a fair baseline
is mlx-lm's own loop").
"""

from __future__ import annotations

import time
from importlib.metadata import version
from typing import Any

import mlx.core as mx
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler

from ..api import Result
from ..decoding import GenerationStats
from ..errors import InvalidArgumentError

#: the ``--methods`` name of the peer row
PEER_NAME = "mlx_lm"


class MLXLMPeer:
    """Plain greedy / sampled decoding by mlx-lm's ``stream_generate``.

    Plays both roles the runner needs: the method (``lossless``,
    ``block_complexity``, :meth:`describe`) and the model (:meth:`generate`,
    :meth:`reset`).

    Timing, so that the row compares with ``ntp``'s: ``prefill_time`` runs
    until mlx-lm's prefill of ``prompt[:-1]`` ends (its progress callback
    after the last prefill chunk); ``decode_time`` from there to the last
    token, so it includes the forward of the last prompt token that yields the
    first new token, as ``ntp``'s does. mlx-lm does not emit EOS; the EOS that
    ended the generation is appended to ``tokens`` (``ntp`` emits it), so the
    two token lists compare one to one. ``forward_time`` is set to the whole
    decode time (mlx-lm's loop does not separate device from host time).

    Raises:
        InvalidArgumentError: any option given (``mlx_lm`` takes none).
    """

    name = PEER_NAME
    lossless = True
    block_complexity = 1

    def __init__(self, **options: Any):
        if options:
            raise InvalidArgumentError(
                f"--methods: {PEER_NAME} (mlx-lm's own stream_generate) takes no settings, got "
                f"{', '.join(f'{k}={v}' for k, v in options.items())}."
            )
        self.loaded: Any = None

    def describe(self) -> str:
        try:
            ver = version("mlx-lm")
        except Exception:  # pragma: no cover - metadata missing in odd installs
            ver = "?"
        return f"mlx_lm.stream_generate (mlx-lm {ver}, prefill step 2048)"

    def bind(self, loaded: Any) -> MLXLMPeer:
        """Use ``loaded`` (a :class:`~mlx_mtp.loading.LoadedModel`); returns self."""
        self.loaded = loaded
        return self

    def reset(self) -> None:
        """Nothing to drop: mlx-lm builds a new KV cache for every generation."""

    def generate(
        self, ids: list[int], max_tokens: int = 256, temp: float = 0.0, seed: int | None = None
    ) -> Any:
        """Generate after the token ids ``ids`` with mlx-lm's loop.

        Returns:
            An :class:`~mlx_mtp.api.Result` (text, tokens, stats, finish_reason).

        Raises:
            InvalidArgumentError: empty prompt or max_tokens <= 0.
        """
        if not ids:
            raise InvalidArgumentError("The prompt is empty; give at least one token of input.")
        if max_tokens <= 0:
            raise InvalidArgumentError(f"max_tokens must be > 0, got {max_tokens}.")
        tok = self.loaded.tokenizer
        if seed is not None:
            mx.random.seed(seed)
        sampler = make_sampler(temp) if temp > 0 else None
        stats = GenerationStats(method=self.describe(), prompt_tokens=len(ids))
        stats.prefill_tokens = len(ids) - 1
        marks: list[float] = []

        def progress(done: int, total: int) -> None:
            if done < total:  # before the prompt's last token: prefill still running
                marks.append(time.perf_counter())

        mx.reset_peak_memory()
        t0 = time.perf_counter()
        tokens, text, finish, last = [], [], None, t0
        for r in stream_generate(
            self.loaded.model,
            tok,
            mx.array(ids),
            max_tokens=max_tokens,
            sampler=sampler,
            prompt_progress_callback=progress,
        ):
            last = time.perf_counter()
            text.append(r.text)
            finish = r.finish_reason
            tokens.append(int(r.token))  # the last response carries the EOS that stopped it
        start = marks[-1] if marks else t0
        stats.prefill_time = start - t0
        stats.generated_tokens = len(tokens)
        stats.decode_time = stats.forward_time = last - start
        stats.forward_passes = stats.steps = stats.slots = len(tokens)
        stats.accept_lengths = [1] * len(tokens)
        stats.peak_memory_gb = mx.get_peak_memory() / 1e9
        return Result("".join(text), tokens, stats, finish)
