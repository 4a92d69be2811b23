"""confadapt decoding (Kirchenbauer et al., arXiv 2602.06019) on tiny random models.

A tiny model gets a mask token through ``mtp_config.json`` in a temporary
folder; its predictions at the masks are random, which is all the plumbing
tests need: block lengths, EOS inside a block, the cache after each step, and
equality with plain greedy decoding where the paper's rule says so.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from tiny_models import make_tiny_model

from mlx_mtp.context import Context
from mlx_mtp.decoding import generate_steps
from mlx_mtp.engine import Engine
from mlx_mtp.errors import InvalidArgumentError, MTPError
from mlx_mtp.methods import make_method
from mlx_mtp.methods.confadapt import (
    ConfAdapt,
    MissingMaskTokenError,
    confadapt_length,
)

MASK_ID = 255  # last row of the tiny models' 256-token vocabulary
PROMPT = [3, 17, 42, 9, 100, 7, 12]


class _Tok:
    """A tokenizer stand-in: no mask token in its vocabulary, fixed EOS ids."""

    def __init__(self, eos=()):
        self.eos_token_ids = list(eos)

    def get_vocab(self):
        return {}


def _engine(tmp_path, family="llama", eos=(), seed=0, with_meta=True):
    model = make_tiny_model(family, seed=seed)
    if with_meta:
        meta = {"mask_token_id": MASK_ID, "eos_token_ids": list(eos), "prompt_format": "chat"}
        (tmp_path / "mtp_config.json").write_text(json.dumps(meta))
    loaded = SimpleNamespace(path=tmp_path, tokenizer=_Tok(eos), name="tiny")
    return Context(Engine(model), loaded)


def _run(ctx, method, prompt=PROMPT, max_tokens=24, eos=frozenset()):
    method.prepare(ctx)
    toks, last = [], None
    for step in generate_steps(ctx, method, prompt, max_tokens=max_tokens, eos_ids=eos):
        toks += step.tokens
        last = step
    return toks, last.stats, last.finish_reason


def _greedy(tmp_path, family="llama", max_tokens=24, prompt=PROMPT):
    engine = _engine(tmp_path, family)
    return _run(engine, make_method("ntp"), prompt, max_tokens)[0]


def test_confadapt_length_rule():
    c = np.array([0.95, 0.92, 0.5, 0.99])
    assert confadapt_length(c, 0.9) == 2
    assert confadapt_length(c, 0.0) == 4
    assert confadapt_length(np.array([0.5, 0.99, 0.99]), 0.9) == 1  # leading run only
    assert confadapt_length(np.array([1.0, 1.0]), 1.01) == 1
    assert confadapt_length(np.array([0.95, 0.95]), 0.9) == 2


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_static_k1_equals_greedy(tmp_path, family):
    ref = _greedy(tmp_path, family)
    toks, stats, _ = _run(_engine(tmp_path, family), ConfAdapt(k=1, mode="static"))
    assert toks == ref
    assert stats.forward_passes == len(ref)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tau_above_one_equals_greedy(tmp_path, family):
    ref = _greedy(tmp_path, family)
    toks, stats, _ = _run(_engine(tmp_path, family), ConfAdapt(k=8, tau=1.01))
    assert toks == ref
    assert stats.tau == pytest.approx(1.0)
    # 7 masks per step; the last token's step sends none (none could be kept)
    assert stats.drafted == 7 * (len(ref) - 1) and stats.accepted == 0


def test_all_confident_emits_k_per_step_and_refeeds(tmp_path):
    k, n = 5, 23
    ctx = _engine(tmp_path)
    toks, stats, finish = _run(ctx, ConfAdapt(k=k, tau=0.0), max_tokens=n)
    engine = ctx.engine
    assert finish == "length" and len(toks) == n
    assert stats.accept_lengths[:-1] == [k] * (len(stats.accept_lengths) - 1)
    assert stats.forward_passes == -(-n // k)
    assert stats.tau == pytest.approx(n / stats.forward_passes)  # Eff. k
    # the first block is the root's greedy token, then the masks' predictions
    assert toks[0] == _greedy(tmp_path, max_tokens=1)[0]
    # the cache holds only committed tokens, at matching positions
    full = PROMPT + toks
    assert engine.cached == full[: len(engine.cached)]
    assert all(c.offset == len(engine.cached) for c in engine.cache)
    # static mode is the same as tau = 0
    toks2, _, _ = _run(_engine(tmp_path), ConfAdapt(k=k, mode="static"), max_tokens=n)
    assert toks2 == toks


def test_step_feeds_pending_tokens_then_masks(tmp_path):
    """Each step processes n + k - 1 tokens: the n tokens emitted last step
    (n - 1 re-fed plus the root) and k - 1 masks; only the real ones stay cached."""
    from mlx_mtp.planner import Planner

    k = 4
    ctx = _engine(tmp_path)
    engine = ctx.engine
    method = ConfAdapt(k=k, tau=0.0)
    method.prepare(ctx)
    engine.sync(PROMPT[:-1])
    planner = Planner(ctx, method, None)
    method.begin(ctx, PROMPT, None)
    seen = []
    orig = engine.forward_chain

    def spy(tokens, hidden=False):
        seen.append(list(tokens))
        return orig(tokens, hidden)

    engine.forward_chain = spy
    out1 = planner.step(PROMPT[-1])
    assert seen[0] == [PROMPT[-1]] + [MASK_ID] * (k - 1)
    assert engine.cached == PROMPT
    out2 = planner.step(out1.tokens[-1])
    assert seen[1] == out1.tokens + [MASK_ID] * (k - 1)
    assert engine.cached == PROMPT + out1.tokens
    assert len(out2.tokens) == k


def test_eos_inside_a_block(tmp_path):
    k = 6
    toks, _, _ = _run(_engine(tmp_path), ConfAdapt(k=k, tau=0.0), max_tokens=k)
    pos = next(i for i in range(1, k) if toks[i] not in toks[:i])
    eos = toks[pos]
    ctx = _engine(tmp_path, eos=[eos])
    got, stats, finish = _run(ctx, ConfAdapt(k=k, tau=0.0), max_tokens=50, eos={eos})
    engine = ctx.engine
    assert got == toks[: pos + 1]
    assert finish == "stop"
    assert stats.generated_tokens == pos + 1
    assert stats.accept_lengths == [pos + 1]
    assert stats.accepted == pos and stats.forward_passes == 1
    assert engine.cached == (PROMPT + got)[: len(engine.cached)]


def test_multi_turn_reuses_cache(tmp_path):
    k = 4
    engine = _engine(tmp_path)
    first, _, _ = _run(engine, ConfAdapt(k=k, tau=0.0), max_tokens=10)
    turn2 = PROMPT + first + [5, 6, 7]
    again, _, _ = _run(engine, ConfAdapt(k=k, tau=0.0), prompt=turn2, max_tokens=10)
    fresh, _, _ = _run(_engine(tmp_path), ConfAdapt(k=k, tau=0.0), prompt=turn2, max_tokens=10)
    assert again == fresh


def test_no_mask_token_is_refused(tmp_path):
    ctx = _engine(tmp_path, with_meta=False)
    with pytest.raises(MissingMaskTokenError, match="mlx-mtp train mtp"):
        ConfAdapt().prepare(ctx)


@pytest.mark.parametrize(
    "opts", [{"k": 0}, {"k": "x"}, {"tau": -0.1}, {"tau": "nan"}, {"mode": "fast"}]
)
def test_bad_options(opts):
    with pytest.raises(InvalidArgumentError):
        ConfAdapt(**opts)


def test_options_from_strings_and_describe():
    m = make_method("confadapt", k="8", tau="0.6")
    assert (m.k, m.tau, m.block_complexity, m.lossless) == (8, 0.6, 8, False)
    assert m.describe() == "confadapt(k=8, conf>=0.6)"
    assert ConfAdapt().k == 16 and ConfAdapt().tau == 0.9


def test_shipped_adapter_for_embedded_model(smollm):
    """The example adapter is not applied on its own: without an adapter the
    embedded model is refused with a message naming `train mtp`. Asked for
    explicitly, it decodes without modifying the caller's model. It is gated,
    so every block's first token is the base model's greedy token: with tau > 1
    (or static k = 1) the output is plain greedy decoding of the base model,
    token for token, on a math prompt and another."""
    import mlx.core as mx

    from mlx_mtp.fingerprint import model_fingerprint
    from mlx_mtp.methods.confadapt import SHIPPED_ADAPTERS, find_adapter, read_adapter_config

    assert find_adapter(model_fingerprint(smollm.model)) is None
    engine = Engine(smollm.model)
    with pytest.raises(MTPError, match="train mtp"):
        ConfAdapt().prepare(Context(engine, smollm))
    shipped = SHIPPED_ADAPTERS / "smollm2-135m-gsm8k"
    assert read_adapter_config(shipped)["lora"]["gated"] is True
    before = mx.array(smollm.model.model.layers[0].self_attn.q_proj.weight)
    eos = set(smollm.tokenizer.eos_token_ids)

    def run(method, question, n=16):
        prompt = smollm.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True
        )
        ctx = Context(Engine(smollm.model), smollm)
        method.prepare(ctx)
        engine = ctx.engine
        toks, st = [], None
        for s in generate_steps(ctx, method, prompt, max_tokens=n, eos_ids=eos):
            toks += s.tokens
            st = s.stats
        return toks, st, engine

    questions = ["What is 12 + 30?", "Name three colours."]  # a math task and another
    for q in questions:
        ref, _, _ = run(make_method("ntp"), q)
        one, _, eng = run(ConfAdapt(k=1, mode="static", adapter=shipped), q)
        assert eng.model is not smollm.model
        assert one == ref
        slow, _, _ = run(ConfAdapt(k=8, tau=1.5, adapter=shipped), q)
        assert slow == ref
    fast, st, _ = run(ConfAdapt(k=4, tau=0.0, adapter=shipped), questions[0])
    assert st.tau == pytest.approx(len(fast) / -(-len(fast) // 4))  # Eff. k = k
    first, _, _ = run(make_method("ntp"), questions[0], n=1)
    assert fast[:1] == first
    assert mx.array_equal(before, smollm.model.model.layers[0].self_attn.q_proj.weight)


def test_adapted_model_has_its_base_fingerprint_and_a_measured_curve(smollm):
    """A model with an on-device gated adapter keeps the base model's
    fingerprint (its embedding wraps the base one) and its cost curve is
    measured with token ids, which the gate reads (``k=auto`` measures the
    curve before the first step)."""
    from mlx_mtp.costs import measure_cost_curve
    from mlx_mtp.fingerprint import model_fingerprint
    from mlx_mtp.methods.confadapt import SHIPPED_ADAPTERS

    ctx = Context(Engine(smollm.model), smollm)
    ConfAdapt(adapter=SHIPPED_ADAPTERS / "smollm2-135m-gsm8k").prepare(ctx)
    engine = ctx.engine
    assert engine.model is not smollm.model
    assert model_fingerprint(engine.model) == model_fingerprint(smollm.model)
    engine.forward_chain([1, 2, 3, 4])
    assert measure_cost_curve(engine, sizes=(1, 2), repeats=1).sizes == [1, 2]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_verified_mode_equals_greedy_on_pipelined_steps(tmp_path, family):
    """``mode=verified`` drafts the masks' tokens and verifies them: plain
    greedy decoding token for token, on pipelined steps (the runner named in
    the stats), under ``auto`` too, where this CPU's device does not overlap
    the host."""
    ref = _greedy(tmp_path, family, max_tokens=30)
    for runner in ("auto", "pipelined"):
        ctx = _engine(tmp_path, family)
        method = ConfAdapt(k=4, mode="verified")
        method.prepare(ctx)
        out, stats = [], None
        for step in generate_steps(ctx, method, PROMPT, max_tokens=30, runner=runner):
            out += step.tokens
            stats = step.stats
        assert out == ref, runner
        assert stats.runner == "pipelined" and stats.drafted > 0
        assert ctx.engine.cached == PROMPT + out[:-1]


def test_verified_mode_refuses_what_pipelined_steps_cannot_run(tmp_path):
    """Verified mode has no synchronous form: asking for it, or sampling at
    temperature > 0, is an error naming why, not plain decoding."""
    from mlx_lm.sample_utils import make_sampler

    for kwargs, why in (
        ({"runner": "synchronous"}, "synchronous"),
        ({"sampler": make_sampler(temp=0.8)}, "temperature"),
    ):
        ctx = _engine(tmp_path)
        method = ConfAdapt(k=4, mode="verified")
        method.prepare(ctx)
        with pytest.raises(InvalidArgumentError, match=f"pipelined steps only.*{why}"):
            list(generate_steps(ctx, method, PROMPT, max_tokens=8, **kwargs))
    with pytest.raises(InvalidArgumentError, match="k >= 2"):
        ConfAdapt(k=1, mode="verified")
    m = make_method("confadapt", mode="verified")
    assert m.lossless and m.describe() == "confadapt(k=auto<=16, verified)"


def test_verified_mode_with_the_shipped_adapter(smollm_case):
    """SmolLM2 with the shipped gated adapter in verified mode: the base
    model's greedy decoding on three Spec-Bench prompts, the mask token's
    drafts accepted."""
    from mlx_mtp.methods.confadapt import SHIPPED_ADAPTERS

    case = smollm_case
    method = ConfAdapt(mode="verified", adapter=SHIPPED_ADAPTERS / "smollm2-135m-gsm8k")
    accepted = 0
    for prompt, n in case.prompts:
        ctx = Context(Engine(case.loaded.model), case.loaded)
        method.prepare(ctx)
        out, stats = [], None
        for step in generate_steps(ctx, method, prompt, max_tokens=n, eos_ids=set()):
            out += step.tokens
            stats = step.stats
        assert out == case.greedy(prompt, n)
        assert stats.runner == "pipelined"
        accepted += stats.accepted
    assert accepted > 0
