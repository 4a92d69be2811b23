"""The Python API's state and what it says (issue 34): one generation at a
time per model, context-length checks before the prefill, cancellation
between forward passes, a chat session that outlives a failed turn, and a
stats line that says when ``auto`` kept to plain steps. SmolLM2-135M float32."""

from __future__ import annotations

import pytest

from mlx_mtp.api import MTPModel
from mlx_mtp.budget import CostCurve
from mlx_mtp.decoding import GenerationStats
from mlx_mtp.errors import (
    CacheNotTrimmableError,
    ContextLengthError,
    InvalidArgumentError,
    ModelBusyError,
)
from mlx_mtp.methods import make_method

PROMPTS = ["Tell me a story about a cat.", "Name three colours.", "What is 7 times 8?"]


@pytest.fixture(scope="module")
def probe(smollm):
    return MTPModel(smollm, make_method("probe", bc=10))


# --------------------------------------------------------- one at a time
def test_a_second_stream_while_one_is_suspended_is_refused(probe):
    alone = [probe.generate(p, max_tokens=12).tokens for p in PROMPTS[:2]]
    first = probe.stream_generate(PROMPTS[0], max_tokens=12)
    got = list(next(first).tokens)  # started, suspended after its first step
    for call in (
        lambda: probe.generate(PROMPTS[1], max_tokens=12),
        lambda: next(probe.stream_generate(PROMPTS[1], max_tokens=12)),
        lambda: next(probe.chat().send("hello", max_tokens=4)),
    ):
        with pytest.raises(ModelBusyError, match="already generating"):
            call()
    for chunk in first:  # the first stream goes on from its own cache, unmixed
        got.extend(chunk.tokens)
    assert got == alone[0]
    assert probe.generate(PROMPTS[1], max_tokens=12).tokens == alone[1]  # free again


def test_closing_or_finishing_a_stream_frees_the_model(probe):
    want = probe.generate(PROMPTS[2], max_tokens=8).tokens
    s = probe.stream_generate(PROMPTS[0], max_tokens=30)
    next(s)
    s.close()
    assert probe.generate(PROMPTS[2], max_tokens=8).tokens == want
    for _ in probe.stream_generate(PROMPTS[0], max_tokens=3):  # left by break
        break
    assert probe.generate(PROMPTS[2], max_tokens=8).tokens == want
    # a stream created but never started holds nothing
    probe.stream_generate(PROMPTS[0], max_tokens=3)
    assert probe.generate(PROMPTS[2], max_tokens=8).tokens == want


def test_interleaved_generators_on_two_bound_models(smollm, probe):
    """Two models bound to one loaded model have their own caches: streams
    interleaved step by step give each one's text alone."""
    other = smollm.bind("probe", bc=10)
    want = [probe.generate(p, max_tokens=16).tokens for p in PROMPTS[:2]]
    a = probe.stream_generate(PROMPTS[0], max_tokens=16)
    b = other.stream_generate(PROMPTS[1], max_tokens=16)
    got: list[list[int]] = [[], []]
    live = {0: a, 1: b}
    while live:
        for i in list(live):
            try:
                got[i].extend(next(live[i]).tokens)
            except StopIteration:
                del live[i]
    assert got == want


# ------------------------------------------------------------ context length
def test_context_length_is_checked_before_the_prefill(smollm):
    m = MTPModel(smollm, make_method("ntp"))
    ctx = m.context_length
    assert ctx == smollm.config["max_position_embeddings"] == 8192
    long = [5] * (ctx + 10)
    with pytest.raises(ContextLengthError, match=f"context is {ctx} tokens.*{ctx + 10} tokens"):
        m.generate(long, max_tokens=2)
    assert m.engine.offset == 0  # nothing was prefilled
    with pytest.raises(ContextLengthError, match="lower max_tokens"):
        m.generate([5] * (ctx - 5), max_tokens=10)
    assert m.engine.offset == 0
    assert issubclass(ContextLengthError, InvalidArgumentError)  # the CLI's exit 2
    # fit_context clips max_tokens to what is left instead (the server's default)
    assert m.check_context(ctx - 5, 10, fit=True) == 5
    with pytest.raises(ContextLengthError):
        m.check_context(ctx, 10, fit=True)  # a prompt that fills it: nothing left


@pytest.mark.parametrize("fit", [True, False])
def test_a_prompt_over_the_context_says_to_shorten_it(smollm, fit):
    """A prompt longer than the context (a server request without
    max_tokens: ``fit``) is refused as too long, never as asking for a
    negative number of new tokens; the server's 400 says the same in its words."""
    from types import SimpleNamespace

    from mlx_mtp.server.replies import openai_error

    m = MTPModel(smollm, make_method("ntp"))
    with pytest.raises(ContextLengthError) as e:
        m.check_context(100_000, 256, fit=fit)
    api = str(e.value)
    reply = openai_error(e.value, SimpleNamespace(kind="chat")).message
    for text in (api, reply):
        assert "-" not in text and "100000 tokens" in text, text
        assert "context is 8192 tokens" in text and "Shorten the prompt" in text, text
    assert "--max-tokens" not in reply and e.value.max_tokens == 256


def test_cli_refuses_a_prompt_longer_than_the_context(tmp_path, capsys, monkeypatch):
    import sys

    from mlx_mtp import cli

    monkeypatch.setattr(sys, "argv", ["mlx-mtp", "generate", "--raw", "-p", "word " * 9000])
    with pytest.raises(SystemExit) as e:
        cli.main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and "error: This model's context is 8192 tokens" in err
    assert "Traceback" not in err


# -------------------------------------------------------------- cancellation
@pytest.mark.parametrize("method", ["ntp", "probe"])
def test_should_stop_cancels_between_forward_passes(smollm, method):
    m = MTPModel(smollm, make_method(method))
    m.prefill_step = 64  # a prefill of several passes
    prompt = m.encode("Summarise: " + "the quick brown fox jumps over the lazy dog. " * 30)
    calls = []

    def stop_after(n):
        def stop():
            calls.append(1)
            return len(calls) > n

        return stop

    # during the prefill: stops before the third chunk, the cache keeps two
    r = m.generate(prompt, max_tokens=20, should_stop=stop_after(2))
    assert r.finish_reason == "cancelled" and r.tokens == []
    assert m.engine.offset == 128 and m.engine.cached == prompt[:128]
    # during decoding: a few steps, then stop; the cache invariant holds
    calls.clear()
    n_chunks = -(-(len(prompt) - 1 - 128) // 64)
    r = m.generate(prompt, max_tokens=40, should_stop=stop_after(n_chunks + 3))
    assert r.finish_reason == "cancelled" and r.stats.steps == 3 and r.tokens
    assert m.engine.offset == len(prompt) - 1 + len(r.tokens)
    # and the next generation reuses that cache and is exact
    fresh = MTPModel(smollm, make_method(method)).generate(prompt, max_tokens=10)
    assert m.generate(prompt, max_tokens=10).tokens == fresh.tokens


# ------------------------------------------------------------------- chat
def test_a_failed_chat_turn_leaves_the_session_going(smollm, monkeypatch):
    m = MTPModel(smollm, make_method("probe", bc=10))
    ref = MTPModel(smollm, make_method("probe", bc=10)).chat()
    chat = m.chat()
    first = "".join(c.text for c in chat.send("My name is Alice.", max_tokens=6))
    assert first == "".join(c.text for c in ref.send("My name is Alice.", max_tokens=6))
    history = list(chat.messages)
    # a turn refused before generating (text that is not UTF-8)
    with pytest.raises(InvalidArgumentError, match="UTF-8"):
        list(chat.send("bad \udcff text", max_tokens=6))
    assert chat.messages == history
    # a turn that fails in the middle of generating (a cache that cannot drop drafts)
    real = type(m.method).observe
    steps = []

    def failing(self, ctx, draft, result):
        steps.append(1)
        if len(steps) == 3:
            raise CacheNotTrimmableError("simulated: the cache cannot drop the rejected drafts")
        return real(self, ctx, draft, result)

    monkeypatch.setattr(type(m.method), "observe", failing)
    with pytest.raises(CacheNotTrimmableError):
        list(chat.send("What is my name?", max_tokens=20))
    monkeypatch.setattr(type(m.method), "observe", real)
    assert chat.messages == history and m.engine.offset == 0  # the cache was dropped
    # the session goes on: the same answer as a session that never failed
    again = "".join(c.text for c in chat.send("What is my name?", max_tokens=8))
    assert again == "".join(c.text for c in ref.send("What is my name?", max_tokens=8))
    assert len(chat.messages) == 4


# -------------------------------------------------------------- stats line
def test_stats_line_says_when_auto_kept_to_plain_steps(smollm):
    m = MTPModel(smollm, make_method("probe"))  # bc=auto, cap 64
    m.ctx.curves = CostCurve.linear(1.0)  # every slot costs a whole forward: nothing pays
    r = m.generate(PROMPTS[0], max_tokens=40)
    st = r.stats
    assert st.plain_steps > 0 and st.plain_spells > 0
    assert st.max_slots < st.block_complexity == 64
    line = st.summary()
    assert f"largest pass {st.max_slots} of BC 64" in line
    assert f"{st.plain_steps} of {st.steps} steps were plain one-token steps" in line
    assert "auto kept to them" in line and "an 8-slot pass costs 8.00 1-slot passes" in line


@pytest.mark.parametrize(
    "fields,says,not_says",
    [
        ({}, "largest pass 0 of BC 1", "plain one-token"),
        ({"plain_steps": 5, "steps": 9}, "the method had nothing to draft", "auto kept"),
        (
            {"plain_steps": 5, "steps": 9, "plain_spells": 1, "reprobes": 2, "cost_8": 1.3},
            "auto kept to them 1 time(s)",
            "nothing to draft",
        ),
    ],
)
def test_stats_line_cases(fields, says, not_says):
    line = GenerationStats(method="m", **fields).summary()
    assert says in line and not_says not in line


# ------------------------------------------------------ docstring examples
def docstring_examples(doc: str) -> list[str]:
    """The code blocks of a docstring: the indented lines after a line that
    ends in ``::`` (reStructuredText's literal blocks)."""
    import textwrap

    blocks: list[str] = []
    lines: list[str] | None = None
    for line in [*doc.splitlines(), "end"]:
        if lines is not None:
            if not line.strip() or line.startswith("    "):
                lines.append(line)
                continue
            blocks.append(textwrap.dedent("\n".join(lines)).strip())
            lines = None
        if line.rstrip().endswith("::"):
            lines = []
    return blocks


@pytest.mark.parametrize("module", ["mlx_mtp", "mlx_mtp.api"])
def test_the_docstring_examples_run(module, capsys):
    """Every example in the package's and the API module's docstrings runs
    as written (the embedded model, a few tokens each) and prints an answer."""
    import importlib

    blocks = docstring_examples(importlib.import_module(module).__doc__)
    assert blocks and all("import" in b for b in blocks), blocks
    for code in blocks:
        exec(compile(code, f"<{module} docstring>", "exec"), {})
        assert capsys.readouterr().out.strip(), code
