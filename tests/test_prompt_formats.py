"""Prompt formats (issue 18): the ``enable_thinking`` switch of hybrid-thinking
chat templates, and the ``plain`` format of self-distilled MTP checkpoints,
rendered the same by the API, the benchmark and the trainers."""

from __future__ import annotations

import dataclasses

import pytest

from mlx_mtp.api import MTPModel
from mlx_mtp.data import render_prompt
from mlx_mtp.errors import InvalidArgumentError
from mlx_mtp.methods import make_method

#: Qwen3's behaviour in a few lines: thinking off puts an empty think block
#: after the generation prompt; earlier assistant turns render their answer only
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def thinking_tokenizer(smollm):
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(smollm.path))
    hf.chat_template = THINKING_TEMPLATE
    return TokenizerWrapper(hf)


def test_thinking_switch_renders_both_ways(thinking_tokenizer):
    msgs = [{"role": "user", "content": "Is 7 prime?"}]
    off = thinking_tokenizer.decode(render_prompt(thinking_tokenizer, msgs))
    on = thinking_tokenizer.decode(render_prompt(thinking_tokenizer, msgs, thinking=True))
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n") and "<think>" not in on
    with pytest.raises(InvalidArgumentError, match="prompt format"):
        render_prompt(thinking_tokenizer, msgs, prompt_format="markdown")


def test_api_thinking_default_off_and_chat_reuses_the_history(smollm, thinking_tokenizer):
    loaded = dataclasses.replace(smollm, tokenizer=thinking_tokenizer)
    off = MTPModel(loaded, make_method("ntp"))
    on = MTPModel(loaded, make_method("ntp"), thinking=True)
    assert thinking_tokenizer.decode(off.encode("Hi")).endswith("</think>\n\n")
    assert thinking_tokenizer.decode(on.encode("Hi")).endswith("assistant\n")
    # second turn: the re-rendered history starts with the first turn up to
    # its answer (the think block of a finished turn is not kept, as in Qwen3)
    session = off.chat()
    first = off.encode([{"role": "user", "content": "Name a colour."}])
    answer = "".join(c.text for c in session.send("Name a colour.", max_tokens=6))
    second = off.encode(session.messages + [{"role": "user", "content": "Another."}])
    think = len(thinking_tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False))
    assert second[: len(first) - think] == first[: len(first) - think]
    assert answer


def test_plain_format_for_an_unconverted_mtp_checkpoint(smollm):
    """--method confadapt on a checkpoint folder that was never converted uses
    the paper's format of its model type (plain for Qwen3), like a converted
    one: BOS + text + blank line, not the chat template."""

    class Meta:
        prompt_format = "plain"

    method = make_method("ntp")
    method.meta = Meta()  # what confadapt's prepare() finds for a Qwen3 MTP checkpoint
    m = MTPModel(smollm, method)
    assert m.prompt_format == "plain"
    ids = m.encode("Hello there")
    tok = smollm.tokenizer
    assert ids == render_prompt(
        tok, [{"role": "user", "content": "Hello there"}], prompt_format="plain"
    )
    assert tok.decode(ids) == (tok.bos_token or "") + "Hello there\n\n"  # no role markers
    assert MTPModel(smollm, make_method("ntp")).prompt_format == "chat"
