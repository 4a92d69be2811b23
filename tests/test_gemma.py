"""The third real model: Gemma 3 270M (base; gemma3 architecture, five
512-token sliding-window layers per global one, head dimension 256, 4 query /
1 KV heads, 262,144-token SentencePiece vocabulary; Q4_K_M GGUF imported as
float16 by scripts/get_test_model.sh, run in float32). No chat template: the
API encodes text prompts as they are, the benchmark renders chat messages as
``user: ...`` lines (mlx_mtp.data.role_lines).

CI runs a short version: config and tokenizer, and a recorded greedy
reference (pld / probe / hybrid / lookahead against plain greedy on a prompt
longer than the window and on one whose generation crosses it:
tests/test_lossless.py, with the ``gemma_case`` set-up of conftest.py).
``-m slow`` runs every lossless setting of the benchmark on its 12 Spec-Bench
prompts (``--limit 2``) and the long prompt x 64 tokens.
"""

from __future__ import annotations

import pytest
from conftest import GEMMA_LONG_QID, GEMMA_WINDOW, assert_exact, gemma_prompt, sweep

from mlx_mtp.cache_view import SlidingKVCache
from mlx_mtp.data import render_prompt
from mlx_mtp.engine import Engine

PROMPT = "The capital of France is"
#: Greedy (ntp) continuation of PROMPT (BOS first, no template), float32, 24
#: tokens, recorded once on Linux x86-64 (MLX 0.32.4 CPU, OpenBLAS): " the
#: capital of the country of France. It is the largest city in France and the
#: second largest city in Europe. It"
REFERENCE = [
    506, 5279, 529, 506, 2891, 529, 7001, 236761, 1030, 563, 506, 7488,
    3207, 528, 7001, 532, 506, 1855, 7488, 3207, 528, 3879, 236761, 1030,
]  # fmt: skip


def test_gemma_config_tokenizer_and_caches(gemma):
    cfg = gemma.config
    assert cfg["model_type"] == "gemma3_text" and cfg["num_hidden_layers"] == 18
    assert (cfg["hidden_size"], cfg["head_dim"]) == (640, 256)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (4, 1)
    assert (cfg["sliding_window"], cfg["sliding_window_pattern"]) == (GEMMA_WINDOW, 6)
    assert cfg["vocab_size"] == 262144 and cfg["tie_word_embeddings"] is True
    tok = gemma.tokenizer
    assert tok.eos_token_ids == {1} and not getattr(tok, "chat_template", None)
    ids = tok.encode(PROMPT)
    assert ids[0] == 2 and len(ids) == 6  # <bos>, then 5 pieces
    texts = ("def f(x):\n    return x ** 2  # square", "héllo wörld 你好，世界 🚀", "  two  spaces")
    for s in texts:
        assert tok.decode(tok.encode(s, add_special_tokens=False)) == s
    assert len(tok.encode("12345", add_special_tokens=False)) == 5  # digits one by one
    eng = Engine(gemma.model, slots=64)
    kinds = [type(c).__name__ for c in eng.cache]
    assert kinds == (["SlidingKVCache"] * 5 + ["KVCache"]) * 3
    c = eng.cache[0]
    assert isinstance(c, SlidingKVCache) and (c.window, c.keep, c.room) == (GEMMA_WINDOW, 0, 64)


def test_gemma_greedy_matches_recorded_reference(gemma, gemma_case):
    got = gemma_case.greedy(gemma.tokenizer.encode(PROMPT), 24)
    assert got == REFERENCE, gemma.tokenizer.decode(got)


# ------------------------------------------------------------------ slow sweep
#: the benchmark's lossless settings (docs/results/gemma3-cpu-12)
SLOW_SETTINGS = [
    ("pld", {}),
    ("pld", {"max_draft": 10}),
    ("probe", {}),
    ("probe", {"bc": 10}),
    ("probe", {"bc": 30}),
    ("hybrid", {}),
    ("hybrid", {"bc": 10}),
    ("hybrid", {"bc": 30}),
    ("lookahead", {}),
]


@pytest.fixture(scope="module")
def bench_prompts(gemma):
    """The 12 Spec-Bench prompts of ``mlx-mtp bench --limit 2`` (2 per task,
    round-robin), rendered as the benchmark renders them, and the long one."""
    from mlx_mtp.bench.config import BenchConfig
    from mlx_mtp.bench.runner import select_prompts

    prompts, _ = select_prompts(BenchConfig(model="gemma3-270m", limit=2))
    tok = gemma.tokenizer
    out = [render_prompt(tok, [{"role": "user", "content": p.turns[0]}]) for p in prompts]
    assert len(out) == 12
    return [*out, gemma_prompt(tok, GEMMA_LONG_QID)]


@sweep(SLOW_SETTINGS)
def test_gemma_exact_on_the_bench_prompts(gemma, gemma_case, bench_prompts, name, opts):
    engine = Engine(gemma.model, slots=64)
    assert_exact(engine, gemma_case.greedy, bench_prompts, name, opts, 64)
