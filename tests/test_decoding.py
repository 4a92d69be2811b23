"""Plain decoding (ntp), the decoding loop, the Python API and the CLI on the
real SmolLM2 model (float32)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import run_method
from mlx_lm.generate import generate_step
from typer.testing import CliRunner

import mlx_mtp
from mlx_mtp.api import MTPModel
from mlx_mtp.decoding import generate_steps
from mlx_mtp.engine import Engine
from mlx_mtp.errors import InvalidArgumentError, ModelNotFoundError, UnknownMethodError
from mlx_mtp.methods import make_method
from mlx_mtp.methods.ntp import NTP


def _mlx_lm_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = []
    for tok, _ in generate_step(
        mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1)
    ):
        out.append(int(tok))
    return out


def test_ntp_greedy_equals_mlx_lm_on_spec_bench(smollm, smollm_case):
    """The greedy reference every exactness test compares with (ntp) is
    mlx-lm's own greedy loop, on the shared Spec-Bench prompts."""
    for p, n in smollm_case.prompts:
        assert smollm_case.greedy(p, n) == _mlx_lm_greedy(smollm.model, p, n)


def test_max_tokens_and_eos(smollm, short_spec_prompts):
    engine = Engine(smollm.model)
    p = short_spec_prompts[0]
    toks = run_method(engine, NTP(), p, 7)
    assert len(toks) == 7
    # declare the 4th generated token an EOS: output stops right after it
    eos = {toks[3]}
    first = toks.index(toks[3])
    cut = run_method(engine, NTP(), p, 50, eos=eos)
    assert cut == toks[: first + 1]
    # the loop leaves the cache holding prompt + generated[:-1]
    assert engine.cached == list(p) + cut[:-1]


def test_bad_arguments(smollm):
    engine = Engine(smollm.model)
    with pytest.raises(InvalidArgumentError, match="empty"):
        next(generate_steps(engine, NTP(), [], max_tokens=5))
    with pytest.raises(InvalidArgumentError, match="max_tokens"):
        next(generate_steps(engine, NTP(), [1, 2], max_tokens=0))
    m = MTPModel(smollm, NTP())
    with pytest.raises(InvalidArgumentError, match="empty"):
        m.generate("   ")
    with pytest.raises(InvalidArgumentError, match="temp"):
        m.generate("hi", temp=-1)
    with pytest.raises(UnknownMethodError, match="Unknown method 'nope'"):
        make_method("nope")
    with pytest.raises(InvalidArgumentError, match="not take the option bc.*takes: no options"):
        make_method("ntp", bc=3)
    with pytest.raises(ModelNotFoundError):
        mlx_mtp.load("definitely-not-a-model")


def test_api_generate_answers_paris(smollm):
    m = MTPModel(smollm, make_method("probe", bc=10))
    r = m.generate("What is the capital of France?", max_tokens=30)
    assert "Paris" in r.text
    assert r.stats.generated_tokens == len(r.tokens) <= 30
    assert r.finish_reason in ("stop", "length")
    chunks = list(m.stream_generate("What is the capital of France?", max_tokens=30))
    assert "".join(c.text for c in chunks) == r.text
    assert chunks[-1].stats.forward_passes == r.stats.forward_passes


def test_chat_reuses_cache_and_matches_cold_start(smollm):
    warm = MTPModel(smollm, make_method("pld"))
    chat = warm.chat()
    a1 = "".join(c.text for c in chat.send("My name is Alice. Say hello to me.", max_tokens=24))
    assert a1
    prefix_before = len(warm.engine.cached)
    chunks = list(chat.send("What is my name?", max_tokens=24))
    warm_tokens = [t for c in chunks for t in c.tokens]
    # the second turn reused the first turn's cache: it prefilled only the new part
    assert chunks[-1].stats.prefill_tokens < chunks[-1].stats.prompt_tokens - prefix_before // 2
    cold = MTPModel(smollm, make_method("pld"))
    cold_tokens = cold.generate(chat.messages[:-1], max_tokens=24).tokens
    assert warm_tokens == cold_tokens
    # the second answer depends on the first turn (SmolLM2-135M does not
    # reliably recall the name itself, so compare with the question alone)
    alone = MTPModel(smollm, make_method("pld")).generate("What is my name?", max_tokens=24)
    assert warm_tokens != alone.tokens


def test_cli_generate_and_errors(monkeypatch):
    from mlx_mtp.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["generate", "-p", "What is the capital of France?", "-n", "24"])
    assert res.exit_code == 0, res.output
    assert "Paris" in res.output
    assert "tau" in res.output  # stats line
    res = runner.invoke(app, ["generate", "-p", "hi", "--method", "nope"])
    assert res.exit_code != 0
    assert isinstance(res.exception, UnknownMethodError)
    res = runner.invoke(app, ["models"])
    assert res.exit_code == 0 and "smollm2-135m" in res.output and "probe" in res.output


def test_cli_chat_two_turns():
    from mlx_mtp.cli import app

    runner = CliRunner()
    res = runner.invoke(
        app,
        ["chat", "--method", "probe", "--bc", "10", "-n", "16"],
        input="What is the capital of France?\nAnd of Italy?\n/quit\n",
    )
    assert res.exit_code == 0, res.output
    assert res.output.count("[probe(bc=10") == 2  # one stats line per answer
    assert "Paris" in res.output


def test_ntp_pipeline_counts_cache_and_next_turn(smollm, short_spec_prompts):
    """Pipelined greedy ntp (the next forward queued before a token is read):
    one forward and one slot per token (the discarded last pass is not
    counted), the cache left holding prompt + generated[:-1], and a next turn
    on the same engine equal to mlx-lm's own greedy loop."""
    engine = Engine(smollm.model)
    p = list(short_spec_prompts[1])
    steps = list(generate_steps(engine, NTP(), p, max_tokens=10))
    toks = [t for st in steps for t in st.tokens]
    s = steps[-1].stats
    assert s.generated_tokens == s.forward_passes == s.slots == 10 and s.steps == 10
    assert engine.cached == p + toks[:-1] and engine.offset == len(p) + 9
    nxt = p + toks + smollm.tokenizer.encode(" Thanks. And then?")
    out = [t for st in generate_steps(engine, NTP(), nxt, max_tokens=12) for t in st.tokens]
    assert out == _mlx_lm_greedy(smollm.model, nxt, 12)
