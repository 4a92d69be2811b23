"""Batched generation (:func:`mlx_mtp.api.batch_generate`, issue 53): several
prompts decoded together by mlx-lm's continuous batching give each prompt the
answer the Python API gives it alone (SmolLM2-135M float32), greedy and
seeded, with prompts joining the batch as others leave."""

from __future__ import annotations

import pytest

from mlx_mtp.api import MTPModel
from mlx_mtp.errors import ContextLengthError, InvalidArgumentError
from mlx_mtp.methods import make_method

#: prompts of differing lengths and kinds (text, chat messages, raw text)
PROMPTS = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue, and then say what colour the sun is "
    "at noon and at sunset, and why.",
    [
        {"role": "system", "content": "You answer in one short line."},
        {"role": "user", "content": "Name a prime number above 10."},
    ],
    "Hi",
    "Write a haiku about the sea.",
]
N = 24


@pytest.fixture(scope="module")
def solo(smollm):
    model = MTPModel(smollm, make_method("ntp"))

    def run(prompt, **kw):
        return model.generate(prompt, **kw)

    return run


def test_batched_greedy_equals_solo_greedy_with_prompts_joining_and_leaving(smollm, solo):
    """Five prompts through a batch of at most three: two join as the first
    ones finish (EOS, or their own max_tokens); every answer is the solo one."""
    limits = [N, N, 6, N, 10]  # two leave early, making room
    batched = smollm.batch_generate(PROMPTS, max_tokens=limits, max_batch=3)
    for prompt, n, got in zip(PROMPTS, limits, batched):
        want = solo(prompt, max_tokens=n, temp=0.0)
        assert got.tokens == want.tokens, (prompt, got.tokens, want.tokens)
        assert got.text == want.text and got.finish_reason == want.finish_reason
        assert got.stats.prompt_tokens == want.stats.prompt_tokens
        assert got.stats.generated_tokens == len(want.tokens)
    # raw text, no chat template
    got = smollm.batch_generate(["The three primary colors are", "Once upon a time"], max_tokens=12,
                                chat_template=False)  # fmt: skip
    for prompt, g in zip(["The three primary colors are", "Once upon a time"], got):
        assert g.tokens == solo(prompt, max_tokens=12, chat_template=False).tokens


def test_batched_sampling_keeps_each_prompts_seed(smollm, solo):
    kw = {"temp": 0.9, "top_p": 0.95, "seed": 11}
    batched = smollm.batch_generate(PROMPTS[:3], max_tokens=10, max_batch=2, **kw)
    for prompt, got in zip(PROMPTS[:3], batched):
        assert got.tokens == solo(prompt, max_tokens=10, **kw).tokens


@pytest.mark.parametrize(
    "prompts,kw,needle",
    [
        ([], {}, "non-empty list"),
        ("one prompt", {}, "non-empty list"),
        (["a", "b"], {"max_tokens": [3]}, "max_tokens has 1 values for 2 prompts"),
        (["a"], {"max_batch": 0}, "max_batch must be an integer >= 1"),
        (["a", ""], {}, r"prompts\[1\]: The prompt is empty"),
        (["a"], {"temp": -1.0}, r"^temp \(--temp\) must be >= 0"),
        (["a"], {"temp": "hot", "method": "pld"}, r"^temp \(--temp\) must be a number"),
        (["a"], {"temp": None, "method": "pld"}, r"^temp \(--temp\) must be a number"),
        (["a"], {"max_tokens": "64"}, r"prompts\[0\]: max_tokens .* must be .*'64'"),
        (["a"], {"method": "draft", "draft_model": 5}, "draft_model must name a model"),
    ],
)
def test_batch_generate_refuses_bad_input(smollm, prompts, kw, needle):
    with pytest.raises(InvalidArgumentError, match=needle):
        smollm.batch_generate(prompts, **kw)


def test_batch_generate_checks_the_context(smollm):
    with pytest.raises(ContextLengthError, match=r"prompts\[1\]"):
        smollm.batch_generate(["hi", "word " * 9000], max_tokens=4)


# ------------------------------------------------- drafting inside the batch
def _run_draft_batch(batch, prompts, limits, max_batch, remove_at=None):
    """Drive a DraftBatch as the API does (prompts join in order as rows
    leave); ``remove_at=(step, index)`` drops one prompt mid-generation.
    Returns each prompt's tokens (None for the removed one)."""
    out, uid_of, waiting, steps = {}, {}, list(range(len(prompts))), 0
    while waiting or len(batch):
        while waiting and len(batch) < max_batch:
            i = waiting.pop(0)
            uid, got = batch.add(prompts[i], limits[i])
            uid_of[uid], out[i] = i, list(got.tokens)
        for got in batch.step():
            out[uid_of[got.uid]].extend(got.tokens)
        steps += 1
        if remove_at and steps == remove_at[0]:
            uid = next(u for u, i in uid_of.items() if i == remove_at[1])
            batch.remove(uid)
            out[remove_at[1]] = None
    return [out[i] for i in range(len(prompts))]


def _always_draft(batch):
    """Make every pass as wide as the longest draft (rows with shorter or no
    drafts padded), so rejected slots pile up in the cache."""
    batch._width = lambda drafts, per=1: (max(len(d.tokens) for d in drafts), 0.0)
    batch.compact_at = 1.0


def test_pld_batch_equals_solo_greedy_with_rejected_slots_and_compaction(
    smollm, solo, short_spec_prompts
):
    """Seven prompts (six Spec-Bench tasks and a copy task) through a pld
    batch of at most three, every pass as wide as the longest draft: rows
    accept different numbers of tokens, so each row's cache holds rejected
    slots (masked) and is compacted; every answer is the solo greedy one."""
    from mlx_mtp.batching import DraftBatch

    tok = smollm.tokenizer
    copy = tok.apply_chat_template(
        [{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the "
          "lazy dog, and the lazy dog sleeps under the old oak tree."}],
        add_generation_prompt=True,
    )  # fmt: skip
    prompts = [list(p) for p in short_spec_prompts[:6]] + [list(copy)]
    limits = [24, 10, 24, 16, 24, 24, 30]
    ntp = MTPModel(smollm, make_method("ntp"))
    batch = DraftBatch(smollm.model, ntp.eos_ids, max_draft=4)
    _always_draft(batch)
    compactions = []
    real = batch._compact
    batch._compact = lambda: (compactions.append(1), real())[1]
    got = _run_draft_batch(batch, prompts, limits, max_batch=3)
    for p, n, g in zip(prompts, limits, got):
        assert g == solo(p, max_tokens=n, temp=0.0).tokens
    rows = [batch.take_row(u) for u in range(1, len(prompts) + 1)]
    drafted = sum(r.drafted for r in rows if r)
    accepted = sum(r.accepted for r in rows if r)
    assert accepted > 0 and drafted > accepted  # right and wrong drafts both
    assert compactions


def test_pld_batch_row_removed_midway_leaves_the_others_exact(smollm, solo, short_spec_prompts):
    from mlx_mtp.batching import DraftBatch

    prompts = [list(p) for p in short_spec_prompts[6:10]]
    ntp = MTPModel(smollm, make_method("ntp"))
    batch = DraftBatch(smollm.model, ntp.eos_ids)
    _always_draft(batch)
    got = _run_draft_batch(batch, prompts, [20] * 4, max_batch=4, remove_at=(3, 1))
    assert got[1] is None
    for i in (0, 2, 3):
        assert got[i] == solo(prompts[i], max_tokens=20, temp=0.0).tokens


def _run_joining_in_chunks(batch, prompts, limits, max_batch, step):
    """Drive a DraftBatch as the server does: prompts begin as rows leave
    and are prefilled ``step`` tokens after each step (``advance``).
    Returns each prompt's tokens and the steps in which rows decoded while
    a prompt was still being prefilled."""
    out, uid_of, waiting, overlapped = {}, {}, list(range(len(prompts))), 0
    while waiting or len(batch) or batch.joining:
        while waiting and len(batch) + len(batch.joining) < max_batch:
            i = waiting.pop(0)
            uid_of[batch.begin(prompts[i], limits[i])], out[i] = i, []
        got = batch.step()
        overlapped += bool(got and batch.joining)
        joined = batch.advance(step)
        for g in [*got, *([joined] if joined is not None else [])]:
            out[uid_of[g.uid]].extend(g.tokens)
    return [out[i] for i in range(len(prompts))], overlapped


@pytest.mark.parametrize("method", ["pld", "draft"])
def test_a_prompt_prefilled_in_chunks_between_steps_joins_exactly(
    smollm, solo, near_draft, short_spec_prompts, method
):
    """A long prompt joins a pld batch (and a draft model's batch) 64
    tokens per step while the other rows go on decoding; every answer is
    the solo greedy one; a prompt removed while it is prefilled never
    answers and leaves the others exact."""
    from mlx_mtp.batching import DraftBatch

    ntp = MTPModel(smollm, make_method("ntp"))
    longest = max(short_spec_prompts, key=len)
    assert len(longest) > 300
    prompts = [list(short_spec_prompts[1]), list(short_spec_prompts[2]), list(longest),
               list(short_spec_prompts[3])]  # fmt: skip
    limits = [20, 30, 16, 12]
    kw = {"draft_model": near_draft.model} if method == "draft" else {}
    batch = DraftBatch.for_method(smollm.model, ntp.eos_ids, method, **kw)
    got, overlapped = _run_joining_in_chunks(batch, prompts, limits, max_batch=3, step=64)
    for p, n, g in zip(prompts, limits, got):
        assert g == solo(p, max_tokens=n, temp=0.0).tokens
    assert overlapped >= len(longest) // 64  # rows decoded while it was prefilled

    # removed while it is prefilled: the others go on, exact
    batch = DraftBatch.for_method(smollm.model, ntp.eos_ids, method, **kw)
    _, first = batch.add(prompts[0], 12)
    gone = batch.begin(list(longest), 8)
    assert batch.advance(64) is None and batch.joining
    mine = list(first.tokens)
    got_all = batch.step()
    batch.remove(gone)
    assert not batch.joining and batch.advance(64) is None
    while len(batch):
        mine += [t for g in got_all for t in g.tokens]
        got_all = batch.step()
    mine += [t for g in got_all for t in g.tokens]
    assert mine == solo(prompts[0], max_tokens=12, temp=0.0).tokens


def test_pld_batch_on_qwen_with_grouped_kv_heads(qwen):
    """Qwen2.5-Coder-0.5B (2 KV heads for 14 query heads): a code edit, which
    copies, and a question, drafted in one batch, equal their solo answers."""
    from conftest import CODE_PROMPT, EDIT_PROMPT

    from mlx_mtp.batching import DraftBatch

    ntp = MTPModel(qwen, make_method("ntp"))
    prompts = [ntp.encode(p, True) for p in (EDIT_PROMPT, CODE_PROMPT)]
    batch = DraftBatch(qwen.model, ntp.eos_ids)
    _always_draft(batch)
    got = _run_draft_batch(batch, prompts, [40, 24], max_batch=2)
    for p, n, g in zip(prompts, [40, 24], got):
        assert g == ntp.generate(p, max_tokens=n).tokens
    row = batch.take_row(1)
    assert 0 < row.accepted < row.drafted  # the edit copies: right drafts and wrong ones


def test_batch_generate_pld(smollm, solo):
    """The API's pld batch: solo answers, and its drafts counted."""
    got = smollm.batch_generate(PROMPTS, max_tokens=[N, N, 6, N, 10], max_batch=3, method="pld")
    for prompt, n, g in zip(PROMPTS, [N, N, 6, N, 10], got):
        want = solo(prompt, max_tokens=n, temp=0.0)
        assert g.tokens == want.tokens and g.text == want.text
        assert g.finish_reason == want.finish_reason
        assert g.stats.method.startswith("pld(batch")


def test_recycle_batch_equals_solo_greedy_with_table_trees(smollm, solo, short_spec_prompts):
    """A recycle batch: each row drafts a tree, its lookup's chain and the
    table of the model's own predictions (filled from every slot of every
    pass) after its root and after every node, verified with per-row
    ancestor masks and per-slot positions in the batch's one pass. Every
    pass as wide as the largest tree, rows joining as others leave: every
    answer is the solo greedy one. The table outlives the batch: a second
    batch of the same prompts drafts branching trees from what the first
    wrote, and gets table candidates accepted."""
    from mlx_mtp.batching import DraftBatch
    from mlx_mtp.sources.recycle import RANK_PRIORS, RecycleTable

    prompts = [list(p) for p in short_spec_prompts[:5]]
    limits = [24, 12, 24, 20, 24]
    ntp = MTPModel(smollm, make_method("ntp"))
    table = RecycleTable()
    for run in range(2):
        batch = DraftBatch(smollm.model, ntp.eos_ids, max_draft=4, table=table)
        _always_draft(batch)
        trees = []

        def counted(*args, real=batch._tree, trees=trees):
            trees.append(real(*args))
            return trees[-1]

        batch._tree = counted
        got = _run_draft_batch(batch, prompts, limits, max_batch=3)
        for p, n, g in zip(prompts, limits, got):
            assert g == solo(p, max_tokens=n, temp=0.0).tokens, run
        assert int((table.table >= 0).any(axis=1).sum()) > 100
    # the second batch drafted from the table, in trees that branch
    assert sum(k == "table" for t in trees for k, _ in t.kinds) > 10
    assert any(len(set(t.parents)) < len(t.parents) for t in trees)
    right, tried = batch.table_root[0] - (RANK_PRIORS[0], 1.0)  # the counts, less the prior
    assert tried > 0 and right > 0  # and its rank-1 candidates were right at times


def test_batch_generate_recycle(smollm, solo):
    """The API's recycle batch: solo answers, named as such."""
    got = smollm.batch_generate(PROMPTS, max_tokens=[N, N, 6, N, 10], max_batch=3,
                                method="recycle")  # fmt: skip
    for prompt, n, g in zip(PROMPTS, [N, N, 6, N, 10], got):
        want = solo(prompt, max_tokens=n, temp=0.0)
        assert g.tokens == want.tokens and g.finish_reason == want.finish_reason
        assert g.stats.method.startswith("recycle(batch")


def test_draft_model_batch_equals_solo_greedy(smollm, solo, near_draft, short_spec_prompts):
    """A draft model drafts every row's chain in batched passes of its own
    (its cache masks the drafts the target rejected; a step that accepts a
    whole chain leaves two tokens for its next first pass). Four drafts per
    row and step, rows joining as others leave and one dropped midway: every
    other answer is the solo greedy one, drafts were both accepted and
    rejected, and whole chains were accepted."""
    from mlx_mtp.batching import BatchDrafter, DraftBatch

    prompts = [list(p) for p in short_spec_prompts[:5]]
    limits = [24, 12, 24, 20, 24]
    ntp = MTPModel(smollm, make_method("ntp"))
    drafter = BatchDrafter(near_draft.model)
    batch = DraftBatch(smollm.model, ntp.eos_ids, max_draft=4, drafter=drafter)
    _always_draft(batch)
    batch._depth = lambda: 4
    pending = []
    real = drafter.settle
    drafter.settle = lambda *a: (real(*a), pending.extend(map(len, drafter.pending)))[0]
    got = _run_draft_batch(batch, prompts, limits, max_batch=3, remove_at=(4, 1))
    assert got[1] is None
    for i in (0, 2, 3, 4):
        assert got[i] == solo(prompts[i], max_tokens=limits[i], temp=0.0).tokens
    rows = [batch.take_row(u) for u in (1, 3, 4, 5)]
    drafted, accepted = sum(r.drafted for r in rows), sum(r.accepted for r in rows)
    assert 0 < accepted < drafted
    assert max(pending) == 2  # a whole chain accepted: its last draft and the bonus token


def test_draft_model_batch_catches_up_after_steps_without_drafts(
    smollm, solo, near_draft, short_spec_prompts
):
    """Steps that draft nothing leave their tokens to the draft model's next
    drafting step, which first feeds all but the newest two in catch-up
    passes of their own: the answers stay the solo greedy ones."""
    import itertools

    from mlx_mtp.batching import BatchDrafter, DraftBatch

    prompts = [list(p) for p in short_spec_prompts[5:9]]
    limits = [24, 20, 24, 16]
    ntp = MTPModel(smollm, make_method("ntp"))
    drafter = BatchDrafter(near_draft.model)
    batch = DraftBatch(smollm.model, ntp.eos_ids, max_draft=3, drafter=drafter)
    _always_draft(batch)
    depths = itertools.cycle([0, 0, 0, 3])
    batch._depth = lambda: next(depths)
    caught = []
    real = drafter._catch_up
    drafter._catch_up = lambda: (caught.append(max(map(len, drafter.pending))), real())[1]
    got = _run_draft_batch(batch, prompts, limits, max_batch=3)
    for p, n, g in zip(prompts, limits, got):
        assert g == solo(p, max_tokens=n, temp=0.0).tokens
    assert max(caught) > 2  # catch-up passes ran


def test_batch_generate_draft(smollm, solo, near_draft):
    """The API's draft-model batch: solo answers, named as such."""
    got = smollm.batch_generate(PROMPTS, max_tokens=[N, N, 6, N, 10], max_batch=3,
                                method="draft", draft_model=near_draft)  # fmt: skip
    for prompt, n, g in zip(PROMPTS, [N, N, 6, N, 10], got):
        want = solo(prompt, max_tokens=n, temp=0.0)
        assert g.tokens == want.tokens and g.finish_reason == want.finish_reason
        assert g.stats.method.startswith("draft(batch")


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
    got = _run_draft_batch(batch, prompts, limits, max_batch=3, remove_at=(4, 1))
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
        got = _run_draft_batch(batch, prompts, [N] * 3, max_batch=3)
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
    got = _run_draft_batch(batch, prompts, [2 * N] * 3, max_batch=3)
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
    got = _run_draft_batch(batch, prompts, limits, max_batch=3, remove_at=(4, 1))
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
        got = _run_draft_batch(batch, prompts, [12] * 3, max_batch=3)
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
    limits = [32, 12, 32, 28, 32]
    ntp = MTPModel(smollm, make_method("ntp"))
    look = BatchLookahead(level=level, window=window)
    batch = DraftBatch(smollm.model, ntp.eos_ids, max_draft=4, lookahead=look, lookup=False)
    _always_draft(batch)
    turn = itertools.cycle(widths)
    batch._columns = lambda nt: next(turn)
    got = _run_draft_batch(batch, prompts, limits, max_batch=3, remove_at=(4, 1))
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
        got = _run_draft_batch(batch, prompts, [N] * 3, max_batch=3)
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
        _always_draft(batch)
        batch._depth = lambda: 4
        got = _run_draft_batch(batch, prompts, limits, max_batch=3)
        for p, n, g in zip(prompts, limits, got):
            assert g == alone(p, n), kind
        rows = [batch.take_row(u) for u in range(1, 6)]
        assert sum(r.accepted for r in rows) > 0, kind
