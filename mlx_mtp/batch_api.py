"""Several prompts answered at once, batched: :func:`batch_generate`
(:meth:`LoadedModel.batch_generate <mlx_mtp.loading.LoadedModel.batch_generate>`
calls it), continuous batching of plain steps or of draft steps
(:mod:`mlx_mtp.batching`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .decoding import GenerationStats
from .engine import PREFILL_STEP
from .errors import (
    InvalidArgumentError,
    UnsupportedModelError,
)
from .methods import make_method
from .model import MTPModel, Prompt, Result
from .sampling import PositionalSampler, random_seed
from .validation import (
    check_flag,
    check_generation_args,
)


class RowSampler:
    """One prompt's :class:`PositionalSampler` inside mlx-lm's batch, which
    calls it once per token drawn, in order, with that row's log-probabilities
    only: it supplies the position of each draw (the prompt's length for the
    first), so that the row draws what a solo generation with the same seed
    draws."""

    def __init__(self, sampler: PositionalSampler, first_position: int):
        self.sampler = sampler
        self.position = first_position

    def __call__(self, logprobs: Any) -> Any:
        out = self.sampler(logprobs, [self.position])
        self.position += 1
        return out


def batch_generate(
    loaded: Any,
    prompts: Sequence[Prompt],
    *,
    max_tokens: int | Sequence[int] = 256,
    temp: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    chat_template: bool = True,
    fit_context: bool = False,
    max_batch: int = 8,
    prefill_step: int = PREFILL_STEP,
    method: str = "ntp",
    max_draft: int = 4,
    draft_model: Any = None,
) -> list[Result]:
    """Generate answers to several prompts at once, batched: every unfinished
    prompt runs in one forward pass per step; a prompt leaves the batch at
    EOS or ``max_tokens`` and the next one waiting joins after its prefill.

    ``method="ntp"``: plain next-token decoding with mlx-lm's continuous
    batching (``BatchGenerator``, ``BatchKVCache``). ``method="pld"``: each
    row drafts by prompt lookup and the drafts of every row are verified in
    the batch's one forward pass (:class:`~mlx_mtp.batching.DraftBatch`,
    greedy only; models whose layers all keep a full KV cache).
    ``method="recycle"``: the same, and each row's draft is a tree, its
    lookup's chain and the candidates a table of the model's own
    predictions (token recycling), filled from every slot of every pass of
    the batch, holds after its newest token and after every node.
    ``method="draft"``: ``draft_model``, a smaller model of the same
    tokenizer, drafts a greedy chain for every row in batched passes of its
    own, verified in the target's one pass (:class:`~mlx_mtp.batching.BatchDrafter`).
    ``method="probe"``: ESP's mask slots (one after every token slot of a
    row) predict the next step's tree of each row
    (:class:`~mlx_mtp.batching.BatchMasks`); passes run with masks while
    they win over plain steps under the batch's measured pass times.
    ``method="hybrid"``: one tree per row of its lookup's chain and its
    mask candidates (hybrid's ``pld`` and ``probe`` sources; its other
    sources do not run in a batch).
    ``method="clp"``: the model's CLP heads (verified mode) at each row's
    deepest accepted slot write its next chain, cut to the span predictor's
    length; they run while that wins over plain steps.
    ``method="lookahead"``: each row's Jacobi columns ride in the batch's
    pass (:class:`~mlx_mtp.batching.BatchLookahead`, at most 10% more pass
    time, within the batch's ledger), fill its n-gram pool, and the pool's
    n-grams after its newest token are its draft.
    ``method="mtp"``: the checkpoint's own MTP layer
    (:class:`~mlx_mtp.batching.BatchNative`, its own batched KV cache)
    drafts each row's chain, as a draft model would.

    Each prompt's answer is the one :meth:`MTPModel.generate` gives it alone
    with the same arguments (greedy: the argmax of each row; sampled: each
    prompt draws with its own :class:`PositionalSampler`, keyed by ``seed``
    and the position, as a solo generation does). A batched forward pass
    computes the same function as a one-row pass but may round differently,
    so where two tokens nearly tie the batch can pick the other one: the
    agreement with solo answers is measured, not guaranteed (tests/test_batch.py).

    Args:
        loaded: the model (:meth:`LoadedModel.batch_generate
            <mlx_mtp.loading.LoadedModel.batch_generate>` passes itself).
        prompts: a list of prompts, each as :meth:`MTPModel.encode` takes.
        max_tokens: new tokens per prompt: one limit for all, or one each.
        temp / top_p / top_k / min_p / seed / chat_template / fit_context:
            as :meth:`MTPModel.stream_generate`, the same for every prompt
            (seed None with ``temp > 0``: a random base seed per prompt).
        max_batch: most prompts decoded in one forward pass (>= 1).
        prefill_step: prompt tokens per prefill pass.
        method: ``"ntp"``, ``"pld"``, ``"recycle"``, ``"draft"``, ``"probe"``,
            ``"hybrid"``, ``"clp"`` (the heads made for the model),
            ``"lookahead"`` or ``"mtp"`` (the checkpoint's MTP layer).
        max_draft: with a drafting method, most draft tokens per row and step
            (the width of each pass, and a draft model's passes, are chosen by
            measured cost, 0 to ``max_draft``).
        draft_model: with ``"draft"``, the draft model (an alias, folder,
            GGUF file or hub id, loaded once per process in the target's
            dtype, or a :class:`~mlx_mtp.loading.LoadedModel`).

    Returns:
        One :class:`Result` per prompt, in order. Its ``stats`` count the
        prompt's own tokens; ``prefill_time`` is the seconds from the start
        to its first new token and ``decode_time`` from then to its last (the
        passes are shared with the rest of the batch).

    Raises:
        InvalidArgumentError: no prompts, a bad prompt or argument (naming
            which prompt), ``max_tokens`` of the wrong length, another method,
            a drafting method with ``temp > 0``, ``draft`` without a draft
            model or a draft model with another method.
        UnsupportedModelError: a drafting method on a model with
            sliding-window or state-space layers; ``recycle``, ``probe`` or
            ``hybrid`` on a family that cannot run draft trees, ``probe`` or
            ``hybrid`` on one that takes no input embeddings; a draft model
            whose tokenizer differs from the target's.
        ModelNotFoundError: ``clp`` on a model with no CLP heads.
        CheckpointMismatchError: CLP heads made for another model.
        ContextLengthError: a prompt and its ``max_tokens`` do not fit in the
            model's context.
    """
    import time

    from mlx_lm.generate import BatchGenerator

    if isinstance(prompts, (str, dict)) or not isinstance(prompts, Sequence) or not prompts:
        raise InvalidArgumentError(
            "prompts must be a non-empty list of prompts (texts, chat message lists or "
            f"token id lists), got {type(prompts).__name__}."
        )
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise InvalidArgumentError(f"max_batch must be an integer >= 1, got {max_batch!r}.")
    if isinstance(prefill_step, bool) or not isinstance(prefill_step, int) or prefill_step < 1:
        raise InvalidArgumentError(f"prefill_step must be an integer >= 1, got {prefill_step!r}.")
    if method not in BATCH_METHODS:
        raise InvalidArgumentError(
            f"batched generation runs method {', '.join(map(repr, BATCH_METHODS))}, got "
            f"{method!r}; decode other methods one prompt at a time (MTPModel.generate)."
        )
    if (method == "draft") != (draft_model not in (None, "")):
        raise InvalidArgumentError(
            "method 'draft' needs draft_model= (a smaller model of the target's tokenizer)"
            if method == "draft"
            else f"draft_model is for method 'draft', not {method!r}."
        )
    if isinstance(max_draft, bool) or not isinstance(max_draft, int) or not 0 <= max_draft <= 64:
        raise InvalidArgumentError(f"max_draft must be an integer in [0, 64], got {max_draft!r}.")
    # the sampling settings hold for every prompt: checked once, named without a prompt
    sampling = check_generation_args(
        max_tokens=1, temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed
    )
    del sampling["max_tokens"]
    chat_template = check_flag("chat_template", chat_template)
    fit_context = check_flag("fit_context", fit_context)
    if method != "ntp" and sampling["temp"] > 0:
        raise InvalidArgumentError(
            f"batched drafting (method {method!r}) is greedy only; use temp=0, or method "
            "'ntp' for a sampled batch."
        )
    if isinstance(max_tokens, Sequence) and not isinstance(max_tokens, (str, bytes)):
        limits = list(max_tokens)
    else:
        limits = [max_tokens] * len(prompts)
    if len(limits) != len(prompts):
        raise InvalidArgumentError(
            f"max_tokens has {len(limits)} values for {len(prompts)} prompts; give one for "
            "all or one per prompt."
        )
    ntp = MTPModel(loaded, make_method("ntp"))  # its prompt encoding and context checks
    tokens, limit_of, samplers = [], [], []
    for i, (prompt, n) in enumerate(zip(prompts, limits)):
        try:
            args = check_generation_args(max_tokens=n, **sampling)
            toks = ntp.encode(prompt, chat_template)
            limit_of.append(ntp.check_context(len(toks), args["max_tokens"], fit_context))
        except InvalidArgumentError as e:
            raise type(e)(f"prompts[{i}]: {e}") from None
        tokens.append(toks)
        if args["temp"] > 0:
            base = args["seed"] if args["seed"] is not None else random_seed()
            row = PositionalSampler(args["temp"], args["top_p"], args["top_k"], min_p, base)
            samplers.append(RowSampler(row, len(toks)))
    eos = ntp.eos_ids
    if method != "ntp":
        return _draft_batch(
            loaded, tokens, limit_of, max_batch, prefill_step, max_draft, eos, method, draft_model
        )
    gen = BatchGenerator(
        loaded.model,
        stop_tokens=[[t] for t in sorted(eos)],
        completion_batch_size=max_batch,
        prefill_batch_size=min(max_batch, 8),
        prefill_step_size=prefill_step,
    )
    try:
        uids = gen.insert(tokens, limit_of, samplers=samplers or None)
        out: dict[int, list[int]] = {u: [] for u in uids}
        finish: dict[int, str] = {}
        first: dict[int, float] = {}
        last: dict[int, float] = {}
        t0 = time.perf_counter()
        while responses := gen.next_generated():
            now = time.perf_counter()
            for r in responses:
                out[r.uid].append(int(r.token))
                first.setdefault(r.uid, now)
                last[r.uid] = now
                if r.finish_reason is not None:
                    finish[r.uid] = r.finish_reason
    finally:
        gen.close()
    detok = loaded.tokenizer.detokenizer
    results = []
    for uid, toks in zip(uids, tokens):
        new = out[uid]
        stats = GenerationStats(
            method="ntp(batch)",
            runner="batched",
            prompt_tokens=len(toks),
            prefill_tokens=len(toks),
            prefill_time=first[uid] - t0,
            generated_tokens=len(new),
            decode_time=last[uid] - first[uid],
            forward_passes=len(new),
            steps=len(new),
            slots=len(new),
            max_slots=1,
        )
        results.append(Result(_detokenize(detok, new, eos), new, stats, finish[uid]))
    return results


def _detokenize(detok: Any, tokens: list[int], eos: set[int]) -> str:
    """The text of one batched answer (end-of-sequence tokens left out)."""
    detok.reset()
    for t in tokens:
        if t not in eos:
            detok.add_token(t)
    detok.finalize()
    return detok.text


def _draft_batch(
    loaded: Any,
    prompts: list[list[int]],
    limits: list[int],
    max_batch: int,
    prefill_step: int,
    max_draft: int,
    eos: set[int],
    method: str,
    draft_model: Any = None,
) -> list[Result]:
    """:func:`batch_generate` with a drafting method: prompts join a
    :class:`~mlx_mtp.batching.DraftBatch` in order as rows leave it."""
    import time

    from .batching import DraftBatch
    from .clp_format import heads_for

    batch = DraftBatch.for_method(
        loaded.model,
        eos,
        method,
        draft_model=loaded.draft(draft_model).model if method == "draft" else None,
        heads=heads_for(loaded.model, None, loaded.name)[0] if method == "clp" else None,
        native=native_layer(loaded) if method == "mtp" else None,
        max_draft=max_draft,
        prefill_step=prefill_step,
    )
    out: dict[int, list[int]] = {}
    finish: dict[int, str] = {}
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    prefill: dict[int, float] = {}
    rows: dict[int, int] = {}
    waiting = list(range(len(prompts)))
    while waiting or len(batch):
        while waiting and len(batch) < max_batch:
            i = waiting.pop(0)
            t = time.perf_counter()
            uid, got = batch.add(prompts[i], limits[i])
            first[i] = last[i] = time.perf_counter()
            prefill[i] = first[i] - t
            out[i] = list(got.tokens)
            rows[uid] = i
            if got.finish_reason is not None:
                finish[i] = got.finish_reason
        for got in batch.step():
            i = rows[got.uid]
            out[i].extend(got.tokens)
            last[i] = time.perf_counter()
            if got.finish_reason is not None:
                finish[i] = got.finish_reason
    done = {i: batch.take_row(uid) for uid, i in rows.items()}
    detok = loaded.tokenizer.detokenizer
    results = []
    for i, toks in enumerate(prompts):
        new, row = out[i], done[i]
        stats = GenerationStats(
            method=f"{method}(batch, max_draft={max_draft})",
            runner="batched",
            prompt_tokens=len(toks),
            prefill_tokens=len(toks),
            prefill_time=prefill[i],
            generated_tokens=len(new),
            decode_time=last[i] - first[i],
            forward_passes=1 + (row.passes if row else 0),
            steps=row.passes if row else 0,
            drafted=row.drafted if row else 0,
            accepted=row.accepted if row else 0,
            slots=row.slots if row else 1,
            max_slots=row.max_slots if row else 1,
        )
        results.append(Result(_detokenize(detok, new, eos), new, stats, finish[i]))
    return results


def native_layer(loaded: Any) -> Any:
    """The native MTP layer of ``loaded``'s checkpoint (for a batch).

    Raises:
        UnsupportedModelError: a model a drafting batch cannot run (see
            :func:`~mlx_mtp.batching.check_batchable`), one loaded without
            its folder, or of a family without a native MTP layer.
        ModelLoadError: no (or unfitting) MTP tensors in the folder.
    """
    from pathlib import Path

    from .batching import check_batchable
    from .native_mtp import native_layer_for

    check_batchable(loaded.model)  # before reading the layer

    folder = getattr(loaded, "path", None)
    if folder is None:
        raise UnsupportedModelError(
            "the native MTP layer is read from the model's checkpoint folder; load the model "
            "with mlx_mtp.load(...) or --model."
        )
    return native_layer_for(Path(folder), loaded.model, getattr(loaded, "config", None))


#: the methods :func:`batch_generate` runs
BATCH_METHODS = ("ntp", "pld", "recycle", "draft", "probe", "hybrid", "clp", "lookahead", "mtp")
