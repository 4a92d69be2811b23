"""The ``mlx_lm`` and ``mlx_lm_draft`` benchmark rows: mlx-lm's own generation
loop, plain and with its draft-model speculation, as peer baselines.

``ntp`` is this package's plain decoding through :class:`~mlx_mtp.engine.Engine`;
``mlx_lm`` is what a user would otherwise run: ``mlx_lm.generate.stream_generate``
(its prefill in steps of 2048, ``mx.async_eval`` pipelining, ``wired_limit``,
periodic ``mx.clear_cache``) on the same model object and the same prompt ids,
interleaved with the other methods by the runner (a fair baseline is mlx-lm's
own loop). ``mlx_lm_draft`` is the same call with ``draft_model`` and
``num_draft_tokens=k``: mlx-lm's speculative decoding, a greedy chain of k
draft tokens verified by the target.
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

#: the ``--methods`` names of the peer rows
PEER_NAME, PEER_DRAFT_NAME = "mlx_lm", "mlx_lm_draft"
PEER_NAMES = (PEER_NAME, PEER_DRAFT_NAME)


class MLXLMPeer:
    """Plain greedy / sampled decoding by mlx-lm's ``stream_generate``.

    Plays both roles the runner needs: the method (``lossless``,
    ``block_complexity``, :meth:`describe`) and the model (:meth:`generate`,
    :meth:`reset`).

    Timing, so that the row compares with ``ntp``'s: ``prefill_time`` runs
    until mlx-lm's prefill of ``prompt[:-1]`` ends (its progress callback
    after the last prefill chunk; ``mlx_lm_draft``, whose loop takes no
    callback, until the draft model's first decoding call, which follows the
    prefill of both models, as ``draft`` rows count it); ``decode_time`` from
    there to the last token, so it includes the forward of the last prompt
    token that yields the first new token, as ``ntp``'s does. mlx-lm does not
    emit EOS; the EOS that ended the generation is appended to ``tokens``
    (``ntp`` emits it), so the two token lists compare one to one.
    ``forward_time`` is set to the whole decode time (mlx-lm's loop does not
    separate device from host time).

    Args:
        name: ``mlx_lm`` or ``mlx_lm_draft``.
        k: drafts per step of ``mlx_lm_draft`` (mlx-lm's ``num_draft_tokens``, 2).
        draft_model: the draft model of ``mlx_lm_draft`` (a spec or a
            LoadedModel; loaded in the target's dtype when the row is bound).

    Raises:
        InvalidArgumentError: options ``mlx_lm`` does not take, a bad ``k``,
            ``mlx_lm_draft`` without a draft model.
    """

    lossless = True

    def __init__(self, name: str = PEER_NAME, **options: Any):
        self.name = name
        self.k, self.draft_spec, self.draft = 0, None, None
        if name == PEER_DRAFT_NAME:
            self.draft_spec = options.pop("draft_model", None)
            k = options.pop("k", 2)
            if isinstance(k, bool) or not str(k).isdigit() or not 1 <= int(k) <= 32:
                raise InvalidArgumentError(f"--methods: {name}:k must be in [1, 32], got {k!r}")
            self.k = int(k)
            if self.draft_spec in (None, ""):
                raise InvalidArgumentError(
                    f"--methods: {name} needs a draft model: --draft-model MODEL."
                )
        if options:
            takes = "takes only k and draft_model" if self.k else "takes no settings"
            raise InvalidArgumentError(
                f"--methods: {name} (mlx-lm's own stream_generate) {takes}, got "
                f"{', '.join(f'{k}={v}' for k, v in options.items())}."
            )
        self.block_complexity = 1 + self.k
        self.loaded: Any = None

    def describe(self) -> str:
        try:
            ver = version("mlx-lm")
        except Exception:  # pragma: no cover - metadata missing in odd installs
            ver = "?"
        desc = f"mlx_lm.stream_generate (mlx-lm {ver}, prefill step 2048"
        if self.draft is not None:
            desc += f", draft_model={self.draft.name}, num_draft_tokens={self.k}"
        return desc + ")"

    def bind(self, loaded: Any) -> MLXLMPeer:
        """Use ``loaded`` (a :class:`~mlx_mtp.loading.LoadedModel`), and load
        the draft model in its dtype; returns self."""
        from ..loading import draft_for

        self.loaded = loaded
        if self.draft_spec is not None:
            self.draft = draft_for(loaded, self.draft_spec)
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
        stats = GenerationStats(method=self.describe(), runner="mlx-lm", prompt_tokens=len(ids))
        stats.prefill_tokens = len(ids) - 1
        marks: list[float] = []

        def progress(done: int, total: int) -> None:
            if done < total:  # before the prompt's last token: prefill still running
                marks.append(time.perf_counter())

        mx.reset_peak_memory()
        t0 = time.perf_counter()
        tokens, text, finish, last = [], [], None, t0
        draft, calls = {}, []
        model = self.loaded.model
        if self.draft is not None:
            model = _Timed(model, calls, "target")
            draft = {"draft_model": _Timed(self.draft.model, calls, "draft")}
            draft["num_draft_tokens"] = self.k
        drafted = 0
        for r in stream_generate(
            model,
            tok,
            mx.array(ids),
            max_tokens=max_tokens,
            sampler=sampler,
            prompt_progress_callback=progress,
            **draft,
        ):
            last = time.perf_counter()
            text.append(r.text)
            finish = r.finish_reason
            tokens.append(int(r.token))  # the last response carries the EOS that stopped it
            drafted += bool(getattr(r, "from_draft", False))
        if calls and len(ids) > 1:  # the draft's first call after the target's prefill
            first = next(i for i, (who, _) in enumerate(calls) if who == "target")
            marks = [t for who, t in calls[first:] if who == "draft"][:1]
        start = marks[-1] if marks else t0
        stats.prefill_time = start - t0
        stats.generated_tokens = len(tokens)
        stats.decode_time = stats.forward_time = last - start
        # mlx-lm marks the tokens its draft model proposed and the target kept;
        # its target passes are counted as calls (a last step cut by max_tokens
        # yields no bonus token)
        passes = len(tokens) - drafted
        if calls:
            passes = max(sum(who == "target" and t >= start for who, t in calls), 1)
        stats.forward_passes = stats.steps = passes
        stats.slots = passes * (1 + self.k)
        stats.drafted, stats.accepted = passes * self.k, drafted
        stats.accept_lengths = [1] * len(tokens)
        stats.peak_memory_gb = mx.get_peak_memory() / 1e9
        return Result("".join(text), tokens, stats, finish)


class _Timed:
    """A model that logs ``(tag, time.perf_counter())`` into ``log`` when it
    is called and is otherwise the wrapped model (attributes forwarded)."""

    def __init__(self, model: Any, log: list, tag: str):
        self._model, self._log, self._tag = model, log, tag

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._log.append((self._tag, time.perf_counter()))
        return self._model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)
