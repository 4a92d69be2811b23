"""The second real model: Qwen2.5-Coder-0.5B-Instruct (qwen2 architecture, Q4_K_M
GGUF with Q4_K/Q5_0/Q6_K/Q8_0 tensors, imported as float16 by
scripts/get_test_model.sh, run in float32).

CI runs a short version: a recorded greedy reference, the tokenizer and chat
template, streaming of multi-byte text and the shipped learned masks (every
lossless method against plain greedy on it: tests/test_lossless.py, with the
``qwen_case`` set-up of conftest.py); ``-m slow`` runs every method and
setting on 30 Spec-Bench prompts x 64 tokens.
"""

from __future__ import annotations

import pytest
from conftest import (
    CODE_PROMPT,
    assert_exact,
    chat_ids,
    decode,
    run_method,
    sweep,
    untrained_clp_heads,
)

from mlx_mtp.context import Context
from mlx_mtp.engine import Engine
from mlx_mtp.methods import make_method

#: Greedy (ntp) continuation of CODE_PROMPT, float32, 32 tokens, recorded once
#: on Linux x86-64 (MLX 0.32.4 CPU, OpenBLAS): "Here's a Python function to check
#: if a number is prime:\n\n```python\ndef is_prime(n):\n    \"\"\"\n    Check if a
#: number is prime.\n\n   "
CODE_REFERENCE = [
    8420, 594, 264, 13027, 729, 311, 1779, 421, 264, 1372, 374, 10250, 1447, 73594,
    12669, 198, 750, 374, 38217, 1445, 982, 262, 3190, 262, 4248, 421, 264, 1372,
    374, 10250, 382, 262,
]  # fmt: skip
IM_END = 151645


def test_qwen_config_tokenizer_and_chat_template(qwen):
    cfg = qwen.config
    assert cfg["model_type"] == "qwen2" and cfg["rope_traditional"] is False
    assert cfg["num_hidden_layers"] == 24 and cfg["hidden_size"] == 896
    assert cfg["num_attention_heads"] == 14 and cfg["num_key_value_heads"] == 2
    assert cfg["vocab_size"] == 151936 and cfg["tie_word_embeddings"] is False
    tok = qwen.tokenizer
    assert tok.eos_token_ids == {IM_END}
    assert tok._tokenizer.convert_ids_to_tokens(IM_END) == "<|im_end|>"
    # ChatML, with Qwen's default system prompt
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\nYou are Qwen")
    assert text.endswith("<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert ids.count(151644) == 3 and ids.count(IM_END) == 2  # <|im_start|>, <|im_end|>
    # byte-level BPE round trip with multi-byte text; Qwen splits digits one by one
    for s in ("def f(x):\n    return x ** 2  # square", "héllo wörld 你好，世界 🚀", "12345"):
        assert tok.decode(tok.encode(s, add_special_tokens=False)) == s
    assert len(tok.encode("12345", add_special_tokens=False)) == 5
    assert tok.encode(" world", add_special_tokens=False) == [1879]  # one merged token
    # the streaming detokenizer never emits half a UTF-8 character
    detok = tok.detokenizer
    detok.reset()
    pieces = []
    for t in tok.encode("emoji 🚀🚀 and 世界", add_special_tokens=False):
        detok.add_token(t)
        pieces.append(detok.last_segment)
    detok.finalize()
    pieces.append(detok.last_segment)
    assert "".join(pieces) == "emoji 🚀🚀 and 世界"
    assert not any("\ufffd" in p for p in pieces)


def test_qwen_greedy_matches_recorded_reference(qwen, qwen_case):
    got = qwen_case.greedy(chat_ids(qwen.tokenizer, CODE_PROMPT), 32)
    assert got == CODE_REFERENCE, qwen.tokenizer.decode(got)


def test_qwen_streams_multibyte_text_with_a_drafting_method(qwen):
    from mlx_mtp.api import MTPModel

    m = MTPModel(qwen, make_method("pld"))
    chunks = list(
        m.stream_generate(
            "Translate 'hello world' into Chinese. Answer with the translation only.",
            max_tokens=12,
        )
    )
    text = "".join(c.text for c in chunks)
    assert text == "你好，世界"
    assert not any("\ufffd" in c.text for c in chunks)
    assert chunks[-1].finish_reason == "stop"  # ended by <|im_end|>


# ------------------------------------------------------------------ slow sweep
@pytest.fixture(scope="module")
def qwen_spec_prompts(qwen):
    """30 Spec-Bench prompts under 700 tokens, round-robin over the six tasks,
    in Qwen's chat template."""
    from mlx_mtp.data import TASKS, load_questions

    qs = load_questions()
    by_task = {t: [q for q in qs if q["task"] == t] for t in TASKS}
    order = [by_task[t][i] for i in range(80) for t in TASKS if i < len(by_task[t])]
    prompts = [chat_ids(qwen.tokenizer, q["turns"][0]) for q in order]
    return [p for p in prompts if len(p) < 700][:30]


SLOW_METHODS = [
    ("pld", {}),
    ("lookahead", {}),
    ("hybrid", {"bc": 10}),
    ("hybrid", {"bc": 30}),
    *[("probe", {"bc": bc, "masks": k}) for bc in (10, 30, 60) for k in (1, 2)],
]


@sweep(SLOW_METHODS)
def test_qwen_exact_full_sweep(qwen, qwen_case, qwen_spec_prompts, name, opts):
    assert_exact(Engine(qwen.model), qwen_case.greedy, qwen_spec_prompts, name, opts, 64)


@pytest.mark.slow
def test_qwen_clp_untrained_exact_full_sweep(qwen, qwen_case, qwen_spec_prompts, tmp_path):
    method = make_method("clp", heads=untrained_clp_heads(qwen, tmp_path / "heads"))
    engine = Engine(qwen.model)
    for i, p in enumerate(qwen_spec_prompts):
        assert run_method(engine, method, p, 64) == qwen_case.greedy(p, 64), f"prompt {i}"


def test_qwen_shipped_learned_masks(qwen, qwen_case):
    """The learned masks shipped for this model (``mlx-mtp train masks``, issue
    17) are found by fingerprint, predict the model's own greedy continuation of
    a code prompt at t+2 better than the paper's mean-embedding init, and probe
    with them still reproduces plain greedy (float32)."""
    from mlx_mtp.fingerprint import model_fingerprint
    from mlx_mtp.learned_masks import ASSETS_DIR, load_learned_masks
    from mlx_mtp.training.continuations import TrainSequence
    from mlx_mtp.training.masks import eval_masks, mean_prompt_vectors

    assert (ASSETS_DIR / f"{model_fingerprint(qwen.model)}.json").exists()
    learned = load_learned_masks(qwen.model)
    assert learned.shape == (2, 896)
    p = chat_ids(qwen.tokenizer, CODE_PROMPT)
    ref = qwen_case.greedy(p, 24)
    seq = [TrainSequence(p, ref)]
    mean = eval_masks(qwen.model, seq, lambda s: mean_prompt_vectors(qwen.model, [s], 2), 2)
    ours = eval_masks(qwen.model, seq, learned, 2)
    assert ours["top1_t+2"] > mean["top1_t+2"], (mean, ours)
    method = make_method("probe", bc=10, masks=2, mask_init="learned")
    ctx = Context(qwen_case.engines[0], qwen)  # the engine that holds this prompt
    method.prepare(ctx)
    assert decode(ctx, method, p, 24, eos_ids=set())[0] == ref
