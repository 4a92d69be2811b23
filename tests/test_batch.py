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
        (["a"], {"temp": -1.0}, r"prompts\[0\]: temp \(--temp\) must be >= 0"),
    ],
)
def test_batch_generate_refuses_bad_input(smollm, prompts, kw, needle):
    with pytest.raises(InvalidArgumentError, match=needle):
        smollm.batch_generate(prompts, **kw)


def test_batch_generate_checks_the_context(smollm):
    with pytest.raises(ContextLengthError, match=r"prompts\[1\]"):
        smollm.batch_generate(["hi", "word " * 9000], max_tokens=4)
