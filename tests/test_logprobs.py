"""Log-probabilities of committed tokens (:mod:`mlx_mtp.logprobs`): a lossless
method reports the target model's own, equal to plain decoding's (SmolLM2-135M
float32)."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_mtp.api import MTPModel
from mlx_mtp.errors import InvalidArgumentError
from mlx_mtp.methods import make_method

#: a text whose continuation repeats it, so that prompt lookup drafts and accepts
PROMPT = "one, two, three, four, five, one, two, three, four, five, one, two, three,"
N = 24
#: fixed drafts (no cost model deciding they do not pay)
OPTIONS = {"pld": {"max_draft": 6}, "probe": {"bc": 6}}


def _run(smollm, method: str, top: int, **options):
    m = MTPModel(smollm, make_method(method, **options))
    tokens, lps, accepted = [], [], 0
    for chunk in m.stream_generate(PROMPT, max_tokens=N, chat_template=False, logprobs=top):
        assert chunk.logprobs is not None and len(chunk.logprobs) == len(chunk.tokens)
        tokens += chunk.tokens
        lps += chunk.logprobs
        accepted = chunk.stats.accepted
    return tokens, lps, accepted


@pytest.mark.parametrize("method", ["pld", "probe"])
def test_a_lossless_methods_logprobs_equal_plain_decodings(smollm, method):
    ref_tokens, ref, _ = _run(smollm, "ntp", 3)
    tokens, got, accepted = _run(smollm, method, 3, **OPTIONS[method])
    assert tokens == ref_tokens
    assert accepted > 0  # drafted tokens were verified in one pass
    assert [e.token for e in got] == tokens
    np.testing.assert_allclose([e.logprob for e in got], [e.logprob for e in ref], atol=1e-4)
    for a, b in zip(got, ref):
        assert len(a.top) == 3 and a.top[0][0] == a.token  # greedy: the best one
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        np.testing.assert_allclose([v for _, v in a.top], [v for _, v in b.top], atol=1e-4)
        assert a.logprob <= 0


def test_sampled_tokens_come_with_their_logprobs(smollm):
    m = MTPModel(smollm, make_method("pld"))
    for chunk in m.stream_generate(PROMPT, max_tokens=8, temp=1.0, seed=5, logprobs=0):
        assert [e.token for e in chunk.logprobs] == chunk.tokens
        assert all(e.top == [] and e.logprob <= 0 for e in chunk.logprobs)


def test_no_logprobs_unless_asked_and_lossy_methods_refuse(smollm):
    m = MTPModel(smollm, make_method("ntp"))
    assert all(c.logprobs is None for c in m.stream_generate(PROMPT, max_tokens=4))
    assert m.engine.logprobs is None
    with pytest.raises(InvalidArgumentError, match=r"\[0, 20\]"):
        next(m.stream_generate(PROMPT, max_tokens=4, logprobs=21))


def test_a_lossy_method_has_no_logprobs():
    from mlx_mtp.decoding import check_logprobs

    with pytest.raises(InvalidArgumentError, match="lossy"):
        check_logprobs(make_method("clp", mode="paper"), 0)
    check_logprobs(make_method("clp"), 2)  # verified: lossless
