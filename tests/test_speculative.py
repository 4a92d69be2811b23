"""The shared verification stage (mlx_mtp.speculative) and the planner with
methods written only against propose/observe, the engine's model swap, and
named data sets; sampling through the verification (every lossless method's
distribution at temperature > 0, proved once here on random drafts).
Small generated models (plumbing only); exactness on the real models is
tests/test_lossless.py."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import decode, run_method
from tiny_models import make_tiny_model

from mlx_mtp.budget import CostCurve
from mlx_mtp.cache_view import SlidingKVCache
from mlx_mtp.context import Context
from mlx_mtp.data import DATA_SETS, resolve_data
from mlx_mtp.engine import Engine
from mlx_mtp.errors import InvalidArgumentError
from mlx_mtp.families import check_tree_support
from mlx_mtp.methods.base import DraftMethod
from mlx_mtp.methods.ntp import NTP
from mlx_mtp.offers import Item, Offer, chain_offer
from mlx_mtp.speculative import Draft, speculative_step

PROMPT = [3, 17, 42, 9, 100, 7, 12]


class Oracle(DraftMethod):
    """Drafts from a known greedy continuation: a tree whose root has a wrong
    child (the right token + 1) and the right chain, and one mask slot that is
    never accepted. Fixed settings: the whole offer goes every step."""

    name = "oracle"

    def __init__(self, reference: list[int], depth: int = 3):
        self.reference, self.depth = reference, depth
        self.seen: list[tuple[list[int], int]] = []

    def prepare(self, ctx):
        check_tree_support(ctx.engine.model, self.name)

    def begin(self, ctx, prompt, sampler):
        super().begin(ctx, prompt, sampler)
        self.done = 0  # committed tokens so far

    def propose(self, ctx, root):
        right = self.reference[self.done : self.done + self.depth]
        wrong = [(t + 1) % 256 for t in right[:1]]
        tokens = [root, *wrong, *right, -1]
        parents = [-1] + [0] * len(wrong) + [0] + list(range(len(wrong) + 1, len(tokens) - 2))
        parents.append(0)  # the mask slot hangs off the root
        emb = ctx.engine.embed_tokens([max(t, 0) for t in tokens])
        n_tok = len(tokens) - 1
        draft = Draft(np.array(tokens), np.array(parents), emb, verify=n_tok)
        return Offer([Item(1.0)], lambda n: draft)

    def observe(self, ctx, draft, result):
        self.seen.append((result.path, result.bonus))
        self.done += len(result.tokens)


class SpellOracle(DraftMethod):
    """An ``auto`` method written only against propose/observe: a chain of
    the known continuation while ``good(position)`` holds, of wrong tokens
    otherwise. It never sees the budget; the planner decides everything."""

    name = "spell-oracle"
    auto = True

    def __init__(self, reference: list[int], good, depth: int = 4):
        self.reference, self.good, self.depth = reference, good, depth
        self.log: list[tuple[int, str, int]] = []

    def begin(self, ctx, prompt, sampler):
        super().begin(ctx, prompt, sampler)
        self.done = 0

    def propose(self, ctx, root):
        chain = self.reference[self.done : self.done + self.depth]
        if not self.good(self.done):
            chain = [(t + 1) % 256 for t in chain]
        return chain_offer(root, chain, "oracle", ctx.acceptance)

    def observe(self, ctx, draft, result):
        kind = "plain" if draft is None else "draft"
        self.log.append((self.done, kind, len(result.tokens) - 1))
        self.done += len(result.tokens)


def test_a_propose_observe_method_is_exact_and_accepts_the_right_chain():
    model = make_tiny_model("llama", seed=3)
    engine = Engine(model)
    ref = run_method(engine, NTP(), PROMPT, 12)
    oracle = Oracle(ref, depth=3)
    engine.reset()
    got = run_method(engine, oracle, PROMPT, 12)
    assert got == ref
    # every step accepts the whole right chain (3 drafts) and never the wrong child
    # or the mask slot: 4 tokens per step
    assert all(len(path) == 3 and 1 not in path for path, _ in oracle.seen[:-1])
    assert engine.cached == PROMPT + got[:-1]


def test_an_auto_method_goes_plain_when_drafts_stop_paying_and_comes_back():
    """The done-when of the planner: a method that only proposes and observes
    runs at auto, switches to plain one-token steps when its drafts stop
    paying (the ledger allows it to lose a share of the time only), drafts
    again and finds them right, and stays exact."""
    model = make_tiny_model("llama", seed=3)
    n = 120
    ref = run_method(Engine(model), NTP(), PROMPT, n)
    good = lambda pos: pos < 20 or pos >= 60  # noqa: E731  (right, wrong, right again)
    oracle = SpellOracle(ref, good)
    cpu = CostCurve([1, 2, 4, 8, 16, 32], [1.0, 1.24, 1.42, 1.66, 1.88, 2.97])
    ctx = Context(Engine(model), curves=cpu)
    out, stats = decode(ctx, oracle, PROMPT, n)
    assert out == ref
    drafts = [(pos, acc) for pos, kind, acc in oracle.log if kind == "draft"]
    plain = [pos for pos, kind, _ in oracle.log if kind == "plain"]
    assert any(acc == 4 for pos, acc in drafts if pos < 20)  # drafting while right
    assert plain and 20 <= min(plain) < 60  # plain steps once the drafts went wrong
    # the wrong drafts stop once the estimates fall (each loses c(5) - 1 = 0.51
    # forwards, paid from what the right ones gained)
    assert sum(1 for pos, _ in drafts if 20 <= pos < 60) <= 10
    assert any(acc > 0 for pos, acc in drafts if pos >= 60)  # drafting again, right
    # fewer forward passes than tokens: the good stretches were drafted
    assert stats.forward_passes < n - 40


class LookupOracle(SpellOracle):
    """A prompt-lookup-like ``auto`` method: the right chain where
    ``good(position)`` holds, nothing otherwise; its offers take no device
    work (``free``)."""

    name = "lookup-oracle"

    def propose(self, ctx, root):
        chain = self.reference[self.done : self.done + self.depth] if self.good(self.done) else []
        return chain_offer(root, chain, "oracle", ctx.acceptance, free=True)

    def observe(self, ctx, draft, result):
        queued = getattr(result, "queued", False)
        self.log.append((self.done, "plain" if draft is None else "draft", queued))
        self.done += len(result.tokens)


def test_plain_steps_stay_pipelined_and_a_draft_goes_in_after_the_queued_one():
    """Steps with nothing to draft stay pipelined (each queues the next
    pass, as ntp does); a draft that turns up at a root whose pass is
    queued waits for that step to finish, then goes in after its token."""
    model = make_tiny_model("llama", seed=3)
    n = 60
    ref = run_method(Engine(model), NTP(), PROMPT, n)
    oracle = LookupOracle(ref, lambda pos: 30 <= pos < 40)
    flat = CostCurve([1, 64], [1.0, 1.0])  # drafts pay whenever there is one
    out, stats = decode(Context(Engine(model), curves=flat), oracle, PROMPT, n)
    assert out == ref
    before = [(pos, q) for pos, kind, q in oracle.log if pos < 29]
    assert before and all(kind == "plain" for pos, kind, _ in oracle.log if pos < 30)
    assert all(q for _, q in before)  # queued: pipelined, not one sync per step
    drafts = [pos for pos, kind, _ in oracle.log if kind == "draft"]
    assert drafts and 30 < min(drafts) < 40  # the draft after the queued step's token
    assert stats.accepted > 0


def test_auto_carries_what_it_learned_to_the_next_generation():
    """A second generation on the same context starts from the first's
    acceptance estimates (at less weight), not from the priors: drafts that
    never paid are tried less at its start."""
    model = make_tiny_model("llama", seed=3)
    n = 40
    ref = run_method(Engine(model), NTP(), PROMPT, n)
    oracle = SpellOracle(ref, lambda pos: False)  # always wrong
    cpu = CostCurve([1, 2, 4, 8, 16, 32], [1.0, 1.24, 1.42, 1.66, 1.88, 2.97])
    ctx = Context(Engine(model), curves=cpu)
    runs = []
    for _ in range(3):
        oracle.log.clear()
        out, stats = decode(ctx, oracle, PROMPT, n)
        assert out == ref
        runs.append([kind for _, kind, _ in oracle.log])
    assert runs[0][:2] == ["draft", "draft"] and "plain" in runs[0]  # the prior's drafts
    assert oracle.settings_key() in ctx.learned
    # the prior's drafts first; later generations start from the estimates
    assert runs[1].count("draft") <= runs[0].count("draft")
    assert runs[2].count("draft") < runs[0].count("draft")


class CostlyOracle(SpellOracle):
    """Always the right chain, but each proposal runs ``cost`` seconds of
    device work beside the target's passes (a draft model's passes)."""

    name = "costly-oracle"

    def __init__(self, reference: list[int], cost: float):
        super().__init__(reference, lambda pos: True)
        self.cost, self.proposals = cost, 0

    def propose(self, ctx, root):
        self.proposals += 1
        ctx.engine.clock.add_beside(self.cost)
        return super().propose(ctx, root)


def test_the_device_work_an_offer_took_counts_against_its_draft(monkeypatch):
    """A draft whose proposal cost ten one-token forwards of device work (a
    draft model's passes) is sent once made (that work is spent either way),
    and its step loses against plain steps even with every draft accepted:
    the ledger counts the work, a probe of it costs more than the ledger
    ever allows in a 300-token generation, and auto does not propose again
    (each proposal's device work would be lost). The same drafts without
    that cost run every step."""
    monkeypatch.setenv("MLX_MTP_HOST_TERM", "0")
    model = make_tiny_model("llama", seed=3)
    n = 300
    ref = run_method(Engine(model), NTP(), PROMPT, n)
    flat = CostCurve([1, 64], [1.0, 1.05], seconds=0.01)
    logs = {}
    for cost in (0.0, 0.1):
        oracle = CostlyOracle(ref, cost)
        out, stats = decode(Context(Engine(model), curves=flat), oracle, PROMPT, n)
        assert out == ref
        logs[cost] = [kind for _, kind, _ in oracle.log]
        proposals = oracle.proposals
    assert set(logs[0.0]) == {"draft"}
    assert logs[0.1][0] == "draft" and set(logs[0.1][1:]) == {"plain"} and proposals == 1


class EmptyPrimer(SpellOracle):
    """A method whose drafts come from the pass before (``primes``, as
    clp's heads) and whose passes never yield a draft (clp's span
    predictor saying 0)."""

    name = "empty-primer"

    def propose(self, ctx, root):
        offer = chain_offer(root, [], "oracle", ctx.acceptance)
        offer.primes = True
        return offer


def test_an_empty_offer_after_a_priming_pass_goes_plain():
    """At auto, a priming method whose pass made no candidates is not primed
    again at once: a plain step follows, and only probes prime."""
    model = make_tiny_model("llama", seed=3)
    n = 60
    ref = run_method(Engine(model), NTP(), PROMPT, n)
    oracle = EmptyPrimer(ref, lambda pos: True)
    cpu = CostCurve([1, 2, 4, 8, 16, 32], [1.0, 1.24, 1.42, 1.66, 1.88, 2.97])
    out, stats = decode(Context(Engine(model), curves=cpu), oracle, PROMPT, n)
    assert out == ref
    kinds = [kind for _, kind, _ in oracle.log]
    assert kinds[0] == "draft" and kinds[1] == "plain"
    assert kinds.count("draft") <= 1 + stats.reprobes


def test_chain_draft_of_wrong_tokens_commits_only_the_bonus():
    model = make_tiny_model("qwen2", seed=1)
    engine = Engine(model)
    ref = run_method(engine, NTP(), PROMPT, 2)
    engine.reset()
    engine.sync(PROMPT[:-1])
    wrong = [(ref[0] + 1) % 256, 5, 6]
    v = speculative_step(engine, Draft.chain(PROMPT[-1], wrong), None)
    assert v.path == [] and v.tokens == [ref[0]] and v.bonus == ref[0]
    assert engine.cached == PROMPT  # the root stays, the drafts are dropped
    v = speculative_step(engine, Draft.chain(ref[0], [ref[1]]), None)
    assert v.path == [1] and v.tokens[0] == ref[1]


def test_a_full_sliding_window_drops_rejected_drafts():
    """--max-kv-size 16 (4 first tokens + a window of 12) past its end: a
    rejected draft chain is dropped again (the ring has room for the pass) and
    the committed token is plain decoding's with the same window."""
    model = make_tiny_model("llama", seed=0)
    prompt = PROMPT * 4  # 28 tokens: the window has wrapped
    ref = run_method(Engine(model, max_kv_size=16), NTP(), prompt, 2)
    engine = Engine(model, max_kv_size=16)
    engine.sync(prompt[:-1])
    wrong = [(ref[0] + 1) % 256, 5, 6]
    v = speculative_step(engine, Draft.chain(prompt[-1], wrong), None)
    assert v.path == [] and v.tokens == [ref[0]] and engine.cached == prompt
    v = speculative_step(engine, Draft.chain(ref[0], [ref[1]]), None)
    assert v.path == [1] and v.tokens[0] == ref[1]


def test_use_model_builds_the_engines_own_cache():
    """A wrapped model (an MTP adapter) gets the same cache layout as the
    first model: --max-kv-size applies with an adapter too."""
    a, b = make_tiny_model("llama", seed=0), make_tiny_model("llama", seed=1)
    engine = Engine(a, max_kv_size=64)
    engine.sync(PROMPT)
    engine.use_model(b)
    assert engine.model is b and engine.cached == []
    assert all(
        isinstance(c, SlidingKVCache) and (c.keep, c.window) == (4, 60) for c in engine.cache
    )
    assert mx.array_equal(engine.embed_tokens([1]), b.model.embed_tokens(mx.array([1]))).item()


def test_named_data_sets(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_MTP_DATA", str(tmp_path))
    rel = tmp_path / DATA_SETS["gsm8k-train"]
    rel.parent.mkdir(parents=True)
    rel.write_text('{"question": "1 + 1?"}\n')
    assert resolve_data("gsm8k-train") == rel
    with pytest.raises(InvalidArgumentError, match="no such file"):
        resolve_data(str(tmp_path / "missing.jsonl"))
    monkeypatch.delenv("MLX_MTP_DATA")  # not shipped: found nowhere else
    with pytest.raises(InvalidArgumentError, match="set MLX_MTP_DATA"):
        resolve_data("gsm8k-train")


# ------------------------------------------------------------------ sampling
def _synthetic_draft(rng, engine, root: int, marginals: list[np.ndarray], chain: bool) -> Draft:
    """A random draft after ``root``: the candidates for the token ``d``
    places after the root are drawn from ``marginals[d]`` (the token there in
    plain sampling, as a 32-way distribution; uniform past the last), so that
    drafts are often but not always right. ``chain``: one chain of 1-4
    tokens; else a tree of up to 24 nodes, 3 deep, distinct siblings, and 0-2
    mask slots (never accepted) hanging anywhere."""
    uniform = np.full(32, 1 / 32)

    def pick(depth: int, taken: set[int]) -> int | None:
        p = (marginals[depth] if depth < len(marginals) else uniform).copy()
        p[list(taken)] = 0.0
        return int(rng.choice(32, p=p / p.sum())) if p.sum() > 0 else None

    if chain:
        return Draft.chain(root, [pick(d, set()) for d in range(int(rng.integers(1, 5)))])
    tokens, parents, depth = [root], [-1], [0]
    for _ in range(int(rng.integers(1, 25))):
        parent = int(rng.integers(0, len(tokens)))
        if depth[parent] >= 3:
            continue
        siblings = {tokens[i] for i in range(len(tokens)) if parents[i] == parent}
        t = pick(depth[parent], siblings)
        if t is not None:
            tokens, parents, depth = tokens + [t], parents + [parent], depth + [depth[parent] + 1]
    verify = len(tokens)
    for _ in range(int(rng.integers(0, 3))):  # mask slots after the verified tree
        tokens, parents = tokens + [-1], parents + [int(rng.integers(0, verify))]
    emb = engine.embed_tokens([max(t, 0) for t in tokens])  # a mask row: any vector
    return Draft(np.array(tokens), np.array(parents), emb, verify=verify)


#: a small qwen3_next (two gated delta-net and two attention layers, MoE MLPs)
SMALL_HYBRID = {
    "hidden_size": 64,
    "head_dim": 16,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
}


@pytest.mark.parametrize(
    "family,chain,positional",
    [("llama", False, False), ("qwen3_next", True, True)],
    ids=["tree-mlx-lm-sampler", "recurrent-chain-positional-sampler"],
)
def test_sampling_through_verification_keeps_the_target_distribution(family, chain, positional):
    """Failure class 8, for every lossless method at once (each verifies
    through ``speculative_step``, docs/design.md §7): at temperature 0.8 /
    top-p 0.9 the first three tokens committed through random drafts (trees
    with mask slots, or chains on a hybrid recurrent model whose state is
    rolled back by replay) follow plain sampling's distribution (chi-square on
    tokens 1-2 jointly and on token 3), with mlx-lm's sampler and with the
    seeded positional one, while drafts are accepted at many steps."""
    from collections import Counter

    from conftest import chi2_same
    from mlx_lm.sample_utils import make_sampler

    from mlx_mtp.sampling import PositionalSampler

    n, length = (400 if chain else 600), 3
    model = make_tiny_model(family, seed=5, vocab_size=32, **(SMALL_HYBRID if chain else {}))
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * 0.1  # flatter
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    plain_sampler = make_sampler(0.8, 0.9)

    def sampler_of(i: int):
        """The sampler of generation i: the positional one draws as a
        function of its seed (one per generation), mlx-lm's from mx.random."""
        return PositionalSampler(0.8, top_p=0.9, seed=i) if positional else plain_sampler

    mx.random.seed(0)
    engine = Engine(model)
    plain = [
        tuple(decode(engine, NTP(), prompt, length, sampler=sampler_of(i))[0]) for i in range(n)
    ]
    marginals = [np.bincount([s[d] for s in plain], minlength=32) / n for d in range(length)]
    rng = np.random.default_rng(0)
    mx.random.seed(1)
    engine = Engine(model)
    assert (engine.rollback is not None) == chain  # the recurrent state is rolled back
    if not chain:
        check_tree_support(model, "test")  # per-slot RoPE positions
    seqs, accepted = [], 0
    for i in range(n):
        s = sampler_of(n + i)  # seeds other than plain sampling's
        engine.reset()
        engine.sync(prompt[:-1])
        root, out = prompt[-1], []
        while len(out) < length:
            draft = _synthetic_draft(rng, engine, root, marginals[len(out) :], chain)
            v = speculative_step(engine, draft, s)
            out += v.tokens
            accepted += len(v.path)
            root = v.bonus
        seqs.append(tuple(out[:length]))
    assert accepted > n // (10 if chain else 2), accepted  # the draft paths were exercised
    assert chi2_same(Counter(s[:2] for s in plain), Counter(s[:2] for s in seqs), n)
    assert chi2_same(Counter(s[2] for s in plain), Counter(s[2] for s in seqs), n)
