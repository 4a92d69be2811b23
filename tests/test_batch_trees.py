"""Trees inside the batch (:class:`mlx_mtp.batching.DraftBatch`, issue 53):
ESP's mask slots (probe), hybrid's lookup chains with mask candidates, CLP
heads, lookahead's n-gram columns and a draft model's trees on wide heads
give every row the answer the Python API gives it alone (SmolLM2-135M
float32, greedy), and the batch refuses what it cannot run. The plain and
chain batches are in tests/test_batch.py."""

from __future__ import annotations

import pytest
from batch_support import PROMPTS, N, always_draft, run_draft_batch

from mlx_mtp.api import MTPModel
from mlx_mtp.errors import InvalidArgumentError
from mlx_mtp.methods import make_method


def _always_mask(batch):
    """Make every pass carry masks and as many nodes per row as the largest
    tree (rows with smaller or no trees padded)."""

    def every_pass(batch=batch):
        drafts = batch._drafts(masks=True)
        return drafts, max(len(d.tokens) for d in drafts), True

    batch._mask_width = every_pass
    batch.compact_at = 1.0


@pytest.mark.parametrize("masks,lookup", [(1, False), (2, False), (1, True)])
def test_probe_and_hybrid_batches_equal_solo_greedy(
    smollm, solo, short_spec_prompts, masks, lookup
):
    """ESP's mask slots inside the batch (probe; with ``lookup``, hybrid's
    trees of lookup chains and mask candidates): every pass puts ``masks``
    mask slots after every token slot of every row (their own ancestor
    masks and positions), the masks after each row's deepest accepted slot
    grow its next tree, and every pass is as wide as the largest tree. Rows
    join as others leave and one is dropped midway: every other answer is
    the solo greedy one, and mask candidates were accepted."""
    from mlx_mtp.batching import DraftBatch

    prompts = [list(p) for p in short_spec_prompts[:5]]
    limits = [24, 12, 24, 20, 24]
    ntp = MTPModel(smollm, make_method("ntp"))
    batch = DraftBatch(smollm.model, ntp.eos_ids, max_draft=4, masks=masks, lookup=lookup)
    _always_mask(batch)
    trees = []
    real = batch._drafts
    batch._drafts = lambda masks=False: (trees.extend(real(masks)), trees[-len(batch.rows) :])[1]
    got = run_draft_batch(batch, prompts, limits, max_batch=3, remove_at=(4, 1))
    assert got[1] is None
    for p, n, g in zip(prompts, limits, got):
        if g is not None:
            assert g == solo(p, max_tokens=n, temp=0.0).tokens
    kinds = {k for t in trees for k, _ in t.kinds}
    assert kinds == ({"mask", "lookup"} if lookup else {"mask"})
    assert sum(len(t.tokens) for t in trees) > 50
    if masks == 2:  # trees two deep: a node under a node
        assert any(any(p > 0 for p in t.parents) for t in trees)
    right, tried = batch.masks.rates[0, 0] - (0.3, 1.0)  # the counts, less the prior
    assert tried > 0 and right > 0


def test_probe_batch_drafts_on_a_flat_cost_curve_and_never_on_a_steep_one(smollm, solo):
    """The batch's choice of mask passes follows the pass times: where a pass
    of any size takes as long as a one-token one (a GPU's flat curve) it
    drafts from its masks; where a pass's time grows with its slots it never
    runs one. Both answer as solo."""
    from mlx_mtp.batching import DraftBatch

    ntp = MTPModel(smollm, make_method("ntp"))
    prompts = [ntp.encode(p, True) for p in PROMPTS[:3]]
    for curve, drafts in ((lambda s: 1.0, True), (lambda s: float(s), False)):
        batch = DraftBatch(smollm.model, ntp.eos_ids, max_draft=4, masks=1)
        batch._cost = curve
        got = run_draft_batch(batch, prompts, [N] * 3, max_batch=3)
        for p, g in zip(PROMPTS, got):
            assert g == solo(p, max_tokens=N, temp=0.0).tokens
        rows = list(batch.finished.values())
        assert (sum(r.drafted for r in rows) > 0) == drafts
        assert bool(batch.masks.seconds) == drafts  # mask passes ran
        assert (max(r.max_slots for r in rows) > 2) == drafts


def test_probe_batch_measures_its_masks_again_after_its_estimates_fell(smollm, solo):
    """Mask candidates whose estimated rates fell to zero are not predicted
    to pay, even on a flat curve; the batch still runs mask passes while
    its credit lasts (1% of its time; here a second given at the start),
    scores the candidates it did not send against the tokens the rows
    committed, and drafts again once the rates say so."""
    from mlx_mtp.batching import DraftBatch

    ntp = MTPModel(smollm, make_method("ntp"))
    prompts = [ntp.encode(p, True) for p in PROMPTS[:3]]
    batch = DraftBatch(smollm.model, ntp.eos_ids, max_draft=4, masks=1)
    batch._cost = lambda slots: 0.05
    batch.masks.rates[:, :, 0] = 0.0  # every rank: 0 right of 1 tried
    batch._probes = 1.0
    got = run_draft_batch(batch, prompts, [2 * N] * 3, max_batch=3)
    for p, g in zip(PROMPTS, got):
        assert g == solo(p, max_tokens=2 * N, temp=0.0).tokens
    right, tried = batch.masks.rates[0, 0]
    assert right > 0 and tried > 3
    assert sum(r.drafted for r in batch.finished.values()) > 0


def test_clp_batch_equals_solo_greedy(smollm, solo, short_spec_prompts):
    """CLP's heads inside the batch (SmolLM2's shipped heads): after every
    pass the heads at each row's deepest accepted slot write its next chain,
    cut to the span predictor's length, and every pass is as wide as the
    longest chain. Rows join as others leave and one is dropped midway:
    every other answer is the solo greedy one, and head tokens were
    accepted."""
    from mlx_mtp.batching import DraftBatch
    from mlx_mtp.clp_format import heads_for

    prompts = [list(p) for p in short_spec_prompts[:5]]
    limits = [24, 12, 24, 20, 24]
    ntp = MTPModel(smollm, make_method("ntp"))
    heads = heads_for(smollm.model, None, "smollm2-135m")[0]
    batch = DraftBatch(smollm.model, ntp.eos_ids, max_draft=4, heads=heads)
    plan = batch._head_plan

    def every_pass():
        drafts, _, _ = plan()
        return drafts, max(len(d.tokens) for d in drafts), True

    batch._head_plan = every_pass
    batch.compact_at = 1.0
    got = run_draft_batch(batch, prompts, limits, max_batch=3, remove_at=(4, 1))
    assert got[1] is None
    for p, n, g in zip(prompts, limits, got):
        if g is not None:
            assert g == solo(p, max_tokens=n, temp=0.0).tokens
    right, tried = batch.heads.rates[0] - (0.5, 1.0)  # the counts, less the prior
    assert tried > 5 and right > 0


def test_mask_and_head_batches_at_wide_and_narrow_bounds(smollm, solo):
    """Trees wider than a mask can fill (max_draft 8 with one mask of 4
    candidates), three masks, and a clp batch whose slots bound leaves no
    room for a draft token all decode as solo; four masks are refused."""
    from mlx_mtp.batching import DraftBatch
    from mlx_mtp.clp_format import heads_for

    ntp = MTPModel(smollm, make_method("ntp"))
    prompts = [ntp.encode(p, True) for p in PROMPTS[:3]]
    heads = heads_for(smollm.model, None, "smollm2-135m")[0]
    for kw in ({"masks": 1, "max_draft": 8}, {"masks": 1, "lookup": True, "max_draft": 8},
               {"masks": 3}, {"heads": heads, "max_slots": 2}):  # fmt: skip
        batch = DraftBatch(smollm.model, ntp.eos_ids, **kw)
        batch._cost = lambda slots: 1.0  # a flat curve: mask passes and heads pay
        got = run_draft_batch(batch, prompts, [12] * 3, max_batch=3)
        for p, g in zip(PROMPTS, got):
            assert g == solo(p, max_tokens=12, temp=0.0).tokens, kw
    with pytest.raises(InvalidArgumentError, match=r"masks must be an integer in \[0, 3\]"):
        DraftBatch(smollm.model, ntp.eos_ids, masks=4)


@pytest.mark.parametrize("level,window,widths", [(5, 7, [7]), (3, 3, [3, 1, 0, 2])])
def test_lookahead_batch_equals_solo_greedy(
    smollm, solo, short_spec_prompts, level, window, widths
):
    """Lookahead decoding inside the batch: every pass carries every row's
    Jacobi columns after its token slots (a tree per row: level 0 a chain
    below the root, each level below the one above it; columns of differing
    lengths while they fill), their argmax updates the columns and fills
    each row's n-gram pool, and the pool's n-grams after a row's newest
    token are its draft, every pass as wide as the largest; passes carry
    ``widths`` columns in turn (columns of one row then differ in length).
    Rows join as others leave and one is dropped midway: every other answer
    is the solo greedy one, and pool tokens were accepted."""
    import itertools

    from mlx_mtp.batching import BatchLookahead, DraftBatch

    prompts = [list(p) for p in short_spec_prompts[:5]]
    limits = [24, 12, 24, 20, 24]
    ntp = MTPModel(smollm, make_method("ntp"))
    look = BatchLookahead(level=level, window=window)
    batch = DraftBatch(smollm.model, ntp.eos_ids, max_draft=4, lookahead=look, lookup=False)
    always_draft(batch)
    turn = itertools.cycle(widths)
    batch._columns = lambda nt: next(turn)
    got = run_draft_batch(batch, prompts, limits, max_batch=3, remove_at=(4, 1))
    assert got[1] is None
    for p, n, g in zip(prompts, limits, got):
        if g is not None:
            assert g == solo(p, max_tokens=n, temp=0.0).tokens
    right, tried = look.first - (0.3, 1.0)  # the counts, less the prior
    assert tried > 0 and right > 0
    assert sum(r.accepted for r in batch.finished.values()) > 0


def test_lookahead_batch_runs_its_columns_on_a_flat_cost_curve_and_never_on_a_steep_one(
    smollm, solo
):
    """The Jacobi columns ride in a pass where they add at most a tenth of
    its time: all seven where a pass of any size takes as long as a
    one-token one (a GPU's flat curve), none where a pass's time grows with
    its slots. Both answer as solo."""
    from mlx_mtp.batching import DraftBatch

    ntp = MTPModel(smollm, make_method("ntp"))
    prompts = [ntp.encode(p, True) for p in PROMPTS[:3]]
    for curve, runs in ((lambda s: 1.0, True), (lambda s: float(s), False)):
        batch = DraftBatch.for_method(smollm.model, ntp.eos_ids, "lookahead")
        batch._cost = curve
        columns, update = [], batch.look.update
        batch.look.update = lambda r, outs, c=columns, u=update: (c.append(len(outs)), u(r, outs))
        got = run_draft_batch(batch, prompts, [N] * 3, max_batch=3)
        for p, g in zip(PROMPTS, got):
            assert g == solo(p, max_tokens=N, temp=0.0).tokens
        assert columns == ([7] * len(columns) if runs else [])
        assert len(columns) > 20 if runs else True


@pytest.mark.parametrize("method", ["probe", "hybrid", "clp", "lookahead"])
def test_batch_generate_probe_hybrid_clp_and_lookahead(smollm, solo, method):
    """The API's probe, hybrid, clp and lookahead batches: solo answers,
    named as such."""
    got = smollm.batch_generate(PROMPTS, max_tokens=[N, N, 6, N, 10], max_batch=3,
                                method=method)  # fmt: skip
    for prompt, n, g in zip(PROMPTS, [N, N, 6, N, 10], got):
        want = solo(prompt, max_tokens=n, temp=0.0)
        assert g.tokens == want.tokens and g.finish_reason == want.finish_reason
        assert g.stats.method.startswith(f"{method}(batch")


def test_batch_generate_refuses_a_draft_model_of_another_tokenizer(smollm, qwen):
    from mlx_mtp.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="must share the target's tokenizer"):
        smollm.batch_generate(["Hi"], max_tokens=4, method="draft", draft_model=qwen)


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"method": "confadapt"}, "runs method 'ntp', 'pld', 'recycle', 'draft', 'probe'"),
        ({"method": "draft"}, "method 'draft' needs draft_model="),
        ({"method": "pld", "draft_model": "smollm2-135m"}, "draft_model is for method 'draft'"),
        ({"method": "pld", "temp": 0.7}, "greedy only"),
        ({"method": "recycle", "temp": 0.7}, "method 'recycle'.*greedy only"),
        ({"method": "pld", "max_draft": -1}, r"max_draft must be an integer in \[0, 64\]"),
    ],
)
def test_batch_generate_refuses_other_methods_and_sampled_drafting(smollm, kw, needle):
    with pytest.raises(InvalidArgumentError, match=needle):
        smollm.batch_generate(["a"], **kw)


def test_pld_batch_refuses_a_sliding_window_model(gemma):
    """Gemma 3 keeps a sliding window in most layers: no drafting batch, and
    the error says what to do."""
    from mlx_mtp.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="full KV cache in every layer.*ntp"):
        gemma.batch_generate(["a"], method="pld")


def test_positional_rope_gives_each_row_and_slot_its_own_position():
    """A (B, L) offset array rotates token i of row b to ``o[b, i] + i``:
    the same values as the wrapped RoPE at that row's integer positions,
    one token at a time (what a batch of draft trees needs)."""
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np

    from mlx_mtp.cache_view import PositionalRoPE

    rope = nn.RoPE(64, base=10000.0)
    x = mx.random.normal((3, 4, 5, 64), key=mx.random.key(0))
    positions = np.array([[7, 8, 8, 9, 9], [0, 1, 2, 3, 4], [30, 31, 32, 31, 32]])
    offsets = mx.array((positions - np.arange(5)).astype(np.int32))
    got = PositionalRoPE(rope)(x, offset=offsets)
    for b in range(3):
        for i in range(5):
            want = rope(x[b : b + 1, :, i : i + 1], offset=int(positions[b, i]))
            assert mx.allclose(got[b : b + 1, :, i : i + 1], want, atol=1e-6)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_trees_and_a_draft_model_in_a_batch_on_wide_heads(head_dim):
    """Plumbing on generated models (Qwen3 layout, 8 query heads over 2 KV
    heads of ``head_dim``): a recycle batch's branching trees and a draft
    model's chains, every pass as wide as the largest draft, rows joining as
    others leave, give each prompt its greedy answer alone (mlx-lm's model
    and cache, one token at a time)."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models.cache import make_prompt_cache
    from tiny_models import make_tiny_model

    from mlx_mtp.batching import BatchDrafter, DraftBatch
    from mlx_mtp.sources.recycle import RecycleTable

    shape = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=head_dim)
    model = make_tiny_model("qwen3", seed=5, **shape)
    draft = make_tiny_model("qwen3", seed=5, **shape)
    mx.random.seed(1)
    nudged = [
        (k, v + 0.02 * mx.random.normal(v.shape)) for k, v in tree_flatten(draft.parameters())
    ]
    draft.update(tree_unflatten(nudged))

    def alone(prompt, n):
        cache = make_prompt_cache(model)
        logits, out = model(mx.array(prompt)[None], cache=cache), []
        for _ in range(n):
            out.append(int(mx.argmax(logits[0, -1]).item()))
            logits = model(mx.array([[out[-1]]]), cache=cache)
        return out

    rng = np.random.default_rng(0)
    # short repeating prompts: the lookup and the table find things to draft
    prompts = [(rng.integers(0, 256, 6).tolist() * 3)[: int(rng.integers(9, 18))] for _ in range(5)]
    limits = [20, 12, 20, 16, 20]
    for kind in ("recycle", "draft"):
        batch = DraftBatch(
            model,
            set(),
            max_draft=4,
            table=RecycleTable() if kind == "recycle" else None,
            drafter=BatchDrafter(draft) if kind == "draft" else None,
        )
        always_draft(batch)
        batch._depth = lambda: 4
        got = run_draft_batch(batch, prompts, limits, max_batch=3)
        for p, n, g in zip(prompts, limits, got):
            assert g == alone(p, n), kind
        rows = [batch.take_row(u) for u in range(1, 6)]
        assert sum(r.accepted for r in rows) > 0, kind
