"""Token recycling (``--method recycle``, and the table as a source of
``hybrid``): the two-stage top-k, the table's update from a verified step and
from plain steps (hand-made logits), its lifetime across turns, and float32
exactness against plain greedy decoding on tiny random models (the real
models: tests/test_lossless.py; sampling: tests/test_speculative.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import decode
from tiny_models import make_tiny_model

from mlx_mtp.acceptance import Acceptance
from mlx_mtp.context import Context
from mlx_mtp.engine import Engine
from mlx_mtp.errors import InvalidArgumentError, UnsupportedModelError
from mlx_mtp.methods import make_method
from mlx_mtp.methods.recycle import Recycle
from mlx_mtp.offers import PlainResult
from mlx_mtp.plain import PlainSteps
from mlx_mtp.sources.recycle import RANK_PRIORS, RecycleTable
from mlx_mtp.speculative import Draft, Verified
from mlx_mtp.verify import top_tokens


# ------------------------------------------------------------------ top-k
@pytest.mark.parametrize("vocab", [49152, 151936, 1000, 37])
def test_top_tokens_equals_a_full_sort(vocab):
    """The two-stage top-k (block maxima first) gives the k best ids best
    first, as a full sort does, on vocabularies with and without a block size."""
    rng = np.random.default_rng(vocab)
    rows = np.stack([rng.permutation(vocab) for _ in range(5)]).astype(np.float32)
    rows[1, :16] = vocab + np.arange(16)  # the best ids packed into one block
    for k in (1, 8, 12):
        got = np.array(top_tokens(mx.array(rows), k))
        want = np.argsort(-rows, axis=-1)[:, : min(k, vocab)]
        assert (got == want).all(), k


# ------------------------------------------------------------------ table
def _table(rows=64, k=3, **kw):
    t = RecycleTable(k, **kw)
    t.rows = rows
    return t


def test_verified_step_fills_every_slot_and_the_accepted_path_wins():
    """A tree pass: every token slot's top-k goes into its token's row, rejected
    branches included; a token on a rejected branch and on the accepted path
    keeps the path's row; mask slots (-1) and slots without logits are
    skipped; rows of other tokens stay unknown."""
    #  slot: 0 root 5 | 1: 7 (parent 0) | 2: 9 (parent 1) | 3: 9 (parent 0) | 4: mask
    tokens = np.array([5, 7, 9, 9, -1], dtype=np.int64)
    parents = np.array([-1, 0, 1, 0, 0], dtype=np.int64)
    draft = Draft(tokens, parents, verify=4)
    vocab, k = 40, 3
    logits = np.full((5, vocab), -5.0, dtype=np.float32)
    best = {0: [7, 1, 2], 1: [9, 3, 4], 2: [11, 12, 13], 3: [21, 22, 23], 4: [30, 31, 32]}
    for r, ids in best.items():
        logits[r, ids] = [3.0, 2.0, 1.0]
    # root 5 -> 7 (target 7) -> 9 (target 9) accepted: path [1, 2]; slot 3 rejected
    verified = Verified(0, [1, 2], 11, [7, 9, 11], np.array([7, 9, 11, 21]), mx.array(logits))
    t = _table(rows=vocab, k=k)
    t.learn(draft, verified, t.graph(mx.array(logits), 4))
    assert t.table.shape == (vocab, k) and t.table.dtype == np.int32
    assert t.table[5].tolist() == [7, 1, 2] and t.table[7].tolist() == [9, 3, 4]
    assert t.table[9].tolist() == [11, 12, 13]  # the accepted slot 2, not rejected slot 3
    known = {5, 7, 9}
    assert (t.table[[i for i in range(vocab) if i not in known]] == -1).all()
    # the same pass with the other 9 accepted: its row wins now
    verified = Verified(0, [3], 21, [9, 21], np.array([9, 9, 11, 21]), mx.array(logits))
    t.learn(draft, verified, t.graph(mx.array(logits), 4))
    assert t.table[9].tolist() == [21, 22, 23]
    # a plain step writes its root's row (and grows the table for an unseen id)
    t.plain(PlainResult([4], root=70, top=np.array([4, 2, 1], dtype=np.int32)))
    assert t.table.shape[0] == 71 and t.table[70].tolist() == [4, 2, 1]
    t.plain(PlainResult([4], root=3))  # no top-k computed: nothing written
    assert (t.table[3] == -1).all()


def test_children_are_ranked_by_learned_acceptance():
    t = _table(rows=10, k=3)
    t.write(np.array([2]), np.array([[5, 6, 7]]))
    acc = Acceptance(Recycle().acceptance_model())
    kids = t.children(acc)
    assert kids(9) == [] and kids(99) == [] and kids(-1) == []
    got = kids(2)
    assert [c.token for c in got] == [5, 6, 7]
    assert [c.q for c in got] == pytest.approx(list(RANK_PRIORS[:3]))
    assert [c.sources for c in got] == [[("recycle", r, 1.0)] for r in (1, 2, 3)]
    for _ in range(40):  # rank 3 turns out the best: it comes first
        acc.record([("recycle", 3, 1.0)], True)
        acc.record([("recycle", 1, 1.0)], False)
    assert [c.token for c in t.children(acc)(2)] == [7, 6, 5]


def test_reset_never_conversation_turn():
    first = [1, 2, 3]
    for reset, kept_next_turn, kept_new_chat in [
        ("never", True, True),
        ("conversation", True, False),
        ("turn", False, False),
    ]:
        t = _table(reset=reset)
        t.begin(first)
        t.write(np.array([3]), np.array([[4, 5, 6]]))
        t.begin(first + [4, 9, 9])  # the next turn continues the prompt
        assert (t.table is not None) == kept_next_turn, reset
        t.write(np.array([3]), np.array([[4, 5, 6]]))
        t.begin([7, 7])  # another conversation
        assert (t.table is not None) == kept_new_chat, reset
    with pytest.raises(InvalidArgumentError, match="reset"):
        RecycleTable(8, "sometimes")


def test_options():
    m = make_method("recycle")
    assert m.auto and m.block_complexity == 64 and m.plain_topk == 8
    assert m.describe() == "recycle(bc=auto<=64, k=8, reset=never)"
    m = make_method("recycle", bc="12", k="4", reset="turn")
    assert (m.auto, m.bc, m.source.k, m.source.reset) == (False, 12, 4, "turn")
    assert m.acceptance_model().max_depth == 4
    for bad in ({"bc": 1}, {"k": 0}, {"k": 33}, {"reset": "x"}, {"window": 3}):
        with pytest.raises(InvalidArgumentError):
            make_method("recycle", **bad)
    assert (
        make_method("hybrid").plain_topk == 0 and "recycle" not in make_method("hybrid").describe()
    )
    hybrid = make_method("hybrid", recycle=1)
    assert hybrid.plain_topk == 8 and "recycle" in hybrid.describe()


def test_recurrent_or_unknown_models_are_refused():
    class Bare:  # no tree support: refused with the method's name, not deep in MLX
        model_type = "mystery"

    ctx = Context(Engine(make_tiny_model("llama")))
    ctx.engine.model = Bare()
    with pytest.raises(UnsupportedModelError, match="--method recycle"):
        make_method("recycle").prepare(ctx)


# ------------------------------------------------------------- plain steps
def test_plain_steps_top_k_beside_the_argmax():
    """Pipelined plain steps with ``topk`` commit the same tokens as without,
    and each step's top-k is that of its root's logits (a separate pass)."""
    model = make_tiny_model("llama", seed=3, tie_word_embeddings=False)
    prompt = [5, 17, 99, 3]
    runs = {}
    for topk in (0, 4):
        eng = Engine(model)
        eng.sync(prompt[:-1])
        plain, root, out, tops = PlainSteps(None, topk), prompt[-1], [], []
        for _ in range(12):
            tok = plain.step(eng, root)[0]
            tops.append((root, plain.last_top))
            out.append(tok)
            root = tok
        runs[topk] = out, tops
    assert runs[0][0] == runs[4][0] and all(t is None for _, t in runs[0][1])
    ref = Engine(model)
    ref.sync(prompt[:-1])
    for root, top in runs[4][1]:
        logits, _ = ref.forward_chain([root])
        want = np.argsort(-np.array(logits[-1]), kind="stable")[:4]
        assert top.tolist() == want.tolist()


# --------------------------------------------------------------- exactness
def _tiny(family):
    # untied embeddings: a random model whose greedy text varies (tied ones
    # repeat one token)
    return make_tiny_model(family, seed=3, tie_word_embeddings=False)


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(rng.integers(4, 20))).tolist() for _ in range(n)]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tiny_models_exact_and_drafting(family):
    from mlx_mtp.budget import CostCurve

    model, prompts = _tiny(family), _prompts(6)
    ref_ctx = Context(Engine(model))
    ntp = make_method("ntp")
    refs = [decode(ref_ctx, ntp, p, 48)[0] for p in prompts]
    settings = [
        ("recycle", {"bc": 10}),
        ("recycle", {}),
        ("recycle", {"reset": "turn", "k": 3}),
        ("hybrid", {"bc": 16, "recycle": 1}),
        ("hybrid", {"recycle": 1}),
    ]
    for name, opts in settings:
        ctx = Context(Engine(model), curves=CostCurve.flat(64, 0.003))
        m = make_method(name, **opts)
        m.prepare(ctx)
        accepted = 0
        for p, ref in zip(prompts, refs):
            out, st = decode(ctx, m, p, 48)
            assert out == ref, (name, opts, p)
            assert ctx.engine.offset == len(p) + len(out) - 1  # the cache invariant
            accepted += st.accepted
        assert accepted > 48, (name, opts)  # the table drafts and is accepted


def _check_exact(loaded, prompts, n, settings, reference):
    """Each setting (one method instance for every prompt, its table kept
    across them) commits ``reference(prompt, n)`` and really drafts."""
    engine = Engine(loaded.model)
    for label, (name, opts) in settings.items():
        m = make_method(name, **opts)
        ctx = Context(engine, loaded)
        m.prepare(ctx)
        passes = accepted = 0
        for i, p in enumerate(prompts):
            engine.reset()
            out, st = decode(ctx, m, p, n)
            assert out == reference(p, n), f"{label} differs from greedy on prompt {i}"
            passes, accepted = passes + st.forward_passes, accepted + st.accepted
        # it drafted and was accepted (no silent plain decoding)
        assert accepted > 0 and passes < n * len(prompts), label


SMOL_SETTINGS = {"recycle:30": ("recycle", {"bc": 30}), "recycle:auto": ("recycle", {})}


@pytest.mark.slow
def test_exact_float32_smollm_long(smollm, spec_prompts, greedy_reference):
    settings = {
        **SMOL_SETTINGS,
        "recycle:10:turn": ("recycle", {"bc": 10, "reset": "turn"}),
        "hybrid:30": ("hybrid", {"bc": 30, "recycle": 1}),
        "hybrid:auto": ("hybrid", {"recycle": 1}),
        "hybrid:10:k2": ("hybrid", {"bc": 10, "masks": 2, "recycle": 1}),
    }
    _check_exact(smollm, spec_prompts[:30], 64, settings, greedy_reference)


def test_hybrid_recycle_on_a_recurrent_model_runs_chains(tmp_path):
    """On a hybrid recurrent model hybrid drafts chains; the table fills from
    them (chain passes) and its drafts are accepted, output exact."""
    from mlx_lm.utils import load_model
    from tiny_models import write_tiny_hybrid

    from mlx_mtp.budget import CostCurve

    write_tiny_hybrid(tmp_path, "qwen3_5", seed=1)
    model, _ = load_model(tmp_path)
    prompts = _prompts(3, seed=4)
    ref_ctx, ctx = Context(Engine(model)), Context(Engine(model), curves=CostCurve.flat(64, 0))
    ntp, m = (
        make_method("ntp"),
        make_method("hybrid", bc=8, masks=0, mtp=0, pool=0, matches=0, recycle=1),
    )
    m.prepare(ctx)
    assert m.chain
    accepted = 0
    for p in prompts:
        out, st = decode(ctx, m, p, 40)
        assert out == decode(ref_ctx, ntp, p, 40)[0]
        accepted += st.accepted
    assert accepted > 0 and m.recycle.table is not None


# ---------------------------------------------------------------- turns
def _tables_at_begin(source):
    """A list that gets the source's table right after each ``begin``."""
    begin, seen = source.begin, []

    def recorded(prompt):
        begin(prompt)
        seen.append(source.table)

    source.begin = recorded
    return seen


def test_table_kept_across_turns_and_exact(smollm, short_spec_prompts):
    """The second turn of a conversation starts from the first turn's table
    with ``reset="never"`` (the default) and afresh with ``"turn"``; both
    stay exact."""
    eos = set(smollm.tokenizer.eos_token_ids)
    first = short_spec_prompts[0]
    ntp_ctx = Context(Engine(smollm.model), smollm)
    ntp = make_method("ntp")
    out1 = decode(ntp_ctx, ntp, first, 16, eos_ids=eos)[0]
    second = first + out1 + smollm.tokenizer.encode("\nSay it again, shorter.\n")
    ref2 = decode(ntp_ctx, ntp, second, 16, eos_ids=eos)[0]
    for reset in ("never", "turn"):
        ctx = Context(Engine(smollm.model), smollm)
        m = make_method("recycle", bc=16, reset=reset)
        m.prepare(ctx)
        assert decode(ctx, m, first, 16, eos_ids=eos)[0] == out1
        after_first = m.source.table.copy()
        assert (after_first >= 0).any(axis=1).sum() > 20  # rows from every pass
        at_begin = _tables_at_begin(m.source)
        out2, st = decode(ctx, m, second, 16, eos_ids=eos)
        assert out2 == ref2, reset
        if reset == "never":
            assert at_begin[0] is m.source.table and st.accepted > 0
        else:
            assert at_begin == [None]
