"""Batched generation (:func:`mlx_mtp.api.batch_generate`, issue 53): several
prompts decoded together by mlx-lm's continuous batching give each prompt the
answer the Python API gives it alone (SmolLM2-135M float32), greedy and
seeded, with prompts joining the batch as others leave."""

from __future__ import annotations

import pytest
from batch_support import PROMPTS, N, always_draft, run_draft_batch

from mlx_mtp.api import MTPModel
from mlx_mtp.errors import ContextLengthError, InvalidArgumentError
from mlx_mtp.methods import make_method


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
    always_draft(batch)
    compactions = []
    real = batch._compact
    batch._compact = lambda: (compactions.append(1), real())[1]
    got = run_draft_batch(batch, prompts, limits, max_batch=3)
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
    always_draft(batch)
    got = run_draft_batch(batch, prompts, [20] * 4, max_batch=4, remove_at=(3, 1))
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
    always_draft(batch)
    got = run_draft_batch(batch, prompts, [40, 24], max_batch=2)
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
        always_draft(batch)
        trees = []

        def counted(*args, real=batch._tree, trees=trees):
            trees.append(real(*args))
            return trees[-1]

        batch._tree = counted
        got = run_draft_batch(batch, prompts, limits, max_batch=3)
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
    always_draft(batch)
    batch._depth = lambda: 4
    pending = []
    real = drafter.settle
    drafter.settle = lambda *a: (real(*a), pending.extend(map(len, drafter.pending)))[0]
    got = run_draft_batch(batch, prompts, limits, max_batch=3, remove_at=(4, 1))
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
    always_draft(batch)
    depths = itertools.cycle([0, 0, 0, 3])
    batch._depth = lambda: next(depths)
    caught = []
    real = drafter._catch_up
    drafter._catch_up = lambda: (caught.append(max(map(len, drafter.pending))), real())[1]
    got = run_draft_batch(batch, prompts, limits, max_batch=3)
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
