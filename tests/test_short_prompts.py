"""The shortest prompts on one binding: a one-token prompt (nothing cached
before the first step), a two-token one, then a longer one, for every method
on every runner (pipelined, synchronous, batched), each equal to plain
greedy decoding in float32; and the two guards that keep a non-finite value
in one cache row from reaching the others."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import memoised_greedy, setting_ids

from mlx_mtp.budget import CostCurve
from mlx_mtp.context import Context
from mlx_mtp.decoding import generate_steps
from mlx_mtp.engine import Engine
from mlx_mtp.methods import make_method

N = 8

#: (method, options) on the solo runners; the batch runs each name at its defaults
SETTINGS = [
    ("ntp", {}),
    ("pld", {}),
    ("probe", {}),
    ("probe", {"bc": 30}),
    ("probe", {"bc": 30, "masks": 2}),
    ("hybrid", {}),
    ("hybrid", {"bc": 10}),
    ("recycle", {}),
    ("lookahead", {}),
    ("clp", {}),
    ("draft", {}),
]


@pytest.fixture(scope="module")
def prompts(short_spec_prompts):
    """One token, two tokens, then 48 tokens of a Spec-Bench prompt, in that order."""
    return [[42], [1, 2], short_spec_prompts[1][:48]]


@pytest.mark.parametrize("runner", ["pipelined", "synchronous"])
@pytest.mark.parametrize("name,opts", SETTINGS, ids=setting_ids(SETTINGS))
def test_short_prompts_on_one_binding_equal_greedy(
    smollm, near_draft, greedy_reference, prompts, monkeypatch, runner, name, opts
):
    """Each prompt, in order on one binding (its cache and mask vectors
    carried from the one before), gives ntp's tokens."""
    monkeypatch.setenv("MLX_MTP_PIPELINE", "1" if runner == "pipelined" else "0")
    if name == "draft":
        opts = {**opts, "draft_model": near_draft}
    bound = smollm.bind(name, **opts)
    for p in prompts:
        got = bound.generate(p, max_tokens=N, chat_template=False)
        assert got.tokens == greedy_reference(p, N), (name, opts, runner, p[:4])


BATCHED = ["ntp", "pld", "probe", "hybrid", "recycle", "lookahead", "clp", "draft"]


@pytest.mark.parametrize("name", BATCHED)
def test_short_prompts_batched_equal_greedy(smollm, near_draft, greedy_reference, prompts, name):
    """The same prompts as rows of one batch, and one after another, give
    ntp's tokens."""
    kw = {"draft_model": near_draft} if name == "draft" else {}
    run = [*[[p] for p in prompts], prompts]
    for batch in run:
        got = smollm.batch_generate(
            batch, max_tokens=N, chat_template=False, method=name, max_batch=3, **kw
        )
        for p, r in zip(batch, got):
            assert r.tokens == greedy_reference(p, N), (name, p[:4])


def test_mask_vectors_of_an_empty_prompt_are_refused(smollm):
    """The mean embedding of no token is refused, not a vector of NaN."""
    from mlx_mtp.errors import InvalidArgumentError
    from mlx_mtp.sources.masks import MaskVectors

    with pytest.raises(InvalidArgumentError, match="prompt is empty"):
        MaskVectors(1).begin(Engine(smollm.model), [])


def _poison_masks(monkeypatch):
    """Mask vectors that are NaN from the start (as a bad init would give)."""
    from mlx_mtp.sources import masks

    real = masks.MaskVectors.begin

    def begin(self, engine, prompt):
        real(self, engine, prompt)
        self.embedding = mx.full(self.embedding.shape, float("nan"), self.embedding.dtype)

    monkeypatch.setattr(masks.MaskVectors, "begin", begin)


@pytest.mark.parametrize("runner", ["pipelined", "synchronous"])
def test_non_finite_mask_slots_do_not_reach_the_tokens(
    smollm, greedy_reference, short_spec_prompts, monkeypatch, runner
):
    """Mask slots whose vectors are NaN write finite keys and values, so the
    token slots that do not attend them (a weight of 0) stay exact: probe
    then drafts garbage, verification rejects it, the output is ntp's."""
    monkeypatch.setenv("MLX_MTP_PIPELINE", "1" if runner == "pipelined" else "0")
    _poison_masks(monkeypatch)
    ctx = Context(Engine(smollm.model), curves=CostCurve.flat())
    m = make_method("probe", bc=30)
    m.prepare(ctx)
    p = short_spec_prompts[0]
    out = []
    for step in generate_steps(ctx, m, p, max_tokens=N):
        out.extend(step.tokens)
    assert out == greedy_reference(p, N)


def test_stale_rows_of_a_poisoned_generation_are_harmless(smollm, monkeypatch):
    """A pipelined generation whose mask slots were NaN leaves only finite
    rows in the cache buffers, past its length included, so the next
    generation on the same cache, which attends over those stale rows with
    a mask of 0, gives ntp's tokens."""
    monkeypatch.setenv("MLX_MTP_PIPELINE", "1")
    ref = memoised_greedy(Engine(smollm.model))
    eng = Engine(smollm.model)
    ctx = Context(eng, curves=CostCurve.flat())
    m = make_method("probe", bc=30)
    m.prepare(ctx)
    with monkeypatch.context() as patch:
        _poison_masks(patch)
        first = [t for s in generate_steps(ctx, m, [42], max_tokens=N) for t in s.tokens]
    assert first == ref([42], N)
    for c in eng.cache:  # every row written, stale ones past the length too
        assert np.isfinite(np.array(c.keys)).all() and np.isfinite(np.array(c.values)).all()
    got = [t for s in generate_steps(ctx, m, [1, 2], max_tokens=N) for t in s.tokens]
    assert got == ref([1, 2], N)
