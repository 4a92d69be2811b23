"""Every mlx-lm model family: the families table and, per family, a tiny
random model of its shapes and layer pattern (tests/tiny_models.py: FAMILY_CONFIGS).

- The table (mlx_mtp.families) lists every model type of the installed
  mlx-lm, and docs/families.md is its current text.
- Tree families: one tree forward pass (12 slots, 40 tokens of context,
  past the 16-token sliding windows) gives the logits of each root-to-slot
  path decoded one token at a time after the context through mlx-lm's own
  model and caches (float32, 1e-4): each slot sees the window it would see in
  one-token decoding; ``keep`` of a branch then gives the next token's logits
  of that run. This is ``mlx-mtp doctor``'s self-check (mlx_mtp.selfcheck).
- Lossless methods (pld, probe, hybrid, lookahead at their defaults) equal
  plain decoding over 48 tokens on a prompt that repeats itself (so drafts get
  accepted), crossing the window, on one tree family per mechanism the tree
  pass must get right (:data:`DECODE_FAMILIES`); what else a family can get
  wrong is in its forward pass, which the check above proves for every one.
- Chain families refuse tree methods at load with their reason and decode pld
  exactly; plain families refuse every drafting method.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import run_method
from tiny_models import FAMILY_CONFIGS, make_tiny_model

from mlx_mtp.context import Context
from mlx_mtp.engine import Engine
from mlx_mtp.errors import UnsupportedModelError
from mlx_mtp.families import (
    CHAIN,
    NO_TREE,
    PLAIN,
    TREE,
    TREE_FAMILIES,
    check_cache_support,
    check_tree_support,
    families_markdown,
    family_support,
    family_table,
    mlx_lm_model_types,
)
from mlx_mtp.methods import make_method
from mlx_mtp.methods.ntp import NTP
from mlx_mtp.selfcheck import OneTokenDecoding, check_keep, check_pass, path_to

ROOT = Path(__file__).resolve().parents[1]
PARENTS = np.array([-1, 0, 0, 1, 1, 2, 3, 3, 5, 6, 9, 10])
#: families that cannot run here: kernels that need the Metal backend, a
#: weight pack or package to build, mlx-lm's own decoding aborting on the CPU
NOT_HERE = {"bitnet", "muse_spark", "prism_hadamard_qwen35", "olmo", "phi3small"}
#: one tree family per mechanism the tree pass must get right, run first: sliding
#: windows (Gemma 3's 5:1, Cohere 2's 3:1, EXAONE 4's LLLG), attention sinks
#: (GPT-OSS), soft-capping (Gemma 2), QK norms (OLMo 2), NoPE layers (SmolLM3,
#: Llama 4), KV-sharing layers (Gemma 4), MLA (DeepSeek-V3), an indexer cache
#: (DeepSeek-V3.2), MoE routing (Qwen3-MoE), partial / scaled RoPE (Phi-3,
#: GLM-4), logit and residual multipliers (Granite)
DECODE_FAMILIES = [
    "gemma3_text",
    "cohere2",
    "exaone4",
    "gpt_oss",
    "gemma2",
    "olmo2",
    "smollm3",
    "llama4_text",
    "gemma4_text",
    "deepseek_v3",
    "deepseek_v32",
    "qwen3_moe",
    "phi3",
    "glm4",
    "granite",
]
TESTED_TREE = sorted(TREE_FAMILIES - NOT_HERE)
CHAIN_HERE = sorted(t for t, (k, _) in NO_TREE.items() if k == CHAIN and t not in NOT_HERE)
PLAIN_HERE = sorted(t for t, (k, _) in NO_TREE.items() if k == PLAIN and t not in NOT_HERE)


@pytest.fixture(scope="module")
def models():
    """Tiny models by family, built once per module."""
    memo: dict[str, object] = {}

    def get(family: str):
        if family not in memo:
            memo[family] = make_tiny_model(family, seed=0)
        return memo[family]

    return get


# ---------------------------------------------------------------- the table
def test_table_lists_every_mlx_lm_model_type():
    rows = family_table()
    types = [r[0] for r in rows]
    assert types == mlx_lm_model_types() and len(types) > 100
    for t in ("llama", "gemma3_text", "gpt_oss", "deepseek_v3", "mistral", "mamba"):
        assert t in types
    assert all(k in (TREE, CHAIN, PLAIN) and why for _, k, why in rows)
    assert not [r for r in rows if "not in this version" in r[2]], "model types without a verdict"
    assert family_support("mistral") == (TREE, "runs as llama: " + family_support("llama")[1])
    assert family_support("qwen3_next")[0] == CHAIN and family_support("mamba")[0] == PLAIN


def test_every_family_with_a_verdict_has_a_tiny_config():
    """Each tree or refused family is built in these tests (aliases run as
    their module)."""
    assert TREE_FAMILIES <= set(FAMILY_CONFIGS)
    assert set(NO_TREE) - NOT_HERE <= set(FAMILY_CONFIGS)


def test_docs_families_table_is_current():
    assert (ROOT / "docs" / "families.md").read_text() == families_markdown(), (
        "docs/families.md is stale: mlx-mtp models --families --markdown > docs/families.md"
    )


def test_cli_lists_the_families():
    from typer.testing import CliRunner

    from mlx_mtp.cli import app

    out = CliRunner().invoke(app, ["models", "--families"])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert any(ln.split()[:2] == ["gemma3_text", "tree"] for ln in lines)
    assert any(ln.split()[:2] == ["gpt2", "chain"] for ln in lines)
    types = set(mlx_lm_model_types())  # parses mlx-lm's model files: once, not per line
    assert sum(1 for ln in lines if ln.split()[:1] and ln.split()[0] in types) == len(types)


# ---------------------------------------------------------- tree families
@pytest.mark.parametrize("family", TESTED_TREE)
def test_tree_forward_equals_sequential_forward(models, family):
    """The check ``mlx-mtp doctor`` runs on the user's model
    (:mod:`mlx_mtp.selfcheck`), on every tree family."""
    model = models(family)
    rng = np.random.default_rng(0)
    context = [int(t) for t in rng.integers(1, 256, 40)]
    toks = [int(t) for t in rng.integers(1, 256, len(PARENTS))]
    check_tree_support(model, "probe")
    eng = Engine(model, slots=len(PARENTS))
    eng.sync(context)
    reference = OneTokenDecoding(model, context)
    check = check_pass(eng, reference, PARENTS, toks, 1e-4)
    assert check.ok, (family, check)
    # keep a branch (not a prefix of the slots), then decode one more token
    leaf = len(PARENTS) - 1
    check = check_keep(eng, reference, PARENTS, toks, leaf, 5, 1e-4)
    assert check.ok, (family, check)
    assert eng.cached == context + [toks[i] for i in path_to(PARENTS, leaf)] + [5]


def _repeating_prompt(n: int = 30) -> list[int]:
    base = [int(t) for t in np.random.default_rng(1).integers(1, 256, 12)]
    return (base * 3)[:n]


def _lossless_equal_ntp(model, family: str) -> None:
    prompt = _repeating_prompt()
    ref = run_method(Engine(model), NTP(), prompt, 48)
    for spec in ("pld", "probe", "hybrid", "lookahead"):
        method = make_method(spec)
        eng = Engine(model, slots=method.block_complexity)
        assert run_method(eng, method, prompt, 48) == ref, (family, spec)
        assert eng.offset == len(prompt) - 1 + 48


@pytest.mark.parametrize("family", DECODE_FAMILIES)
def test_lossless_methods_equal_ntp_past_the_window(models, family):
    _lossless_equal_ntp(models(family), family)


# --------------------------------------------------- chain / plain families
@pytest.mark.parametrize("family", CHAIN_HERE)
def test_chain_families_refuse_trees_and_decode_chains_exactly(models, family):
    model = models(family)
    for spec in ("probe", "lookahead"):
        e = _refusal(model, spec)
        assert f"'{family}'" in str(e) and NO_TREE[family][1] in str(e) and "pld" in str(e)
    if family in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        return  # rollback families: tests/test_native_mtp.py, test_hybrid.py
    prompt = _repeating_prompt()
    ref = run_method(Engine(model), NTP(), prompt, 32)
    method = make_method("pld")
    eng = Engine(model, slots=method.block_complexity)
    check_cache_support(eng, method)
    assert run_method(eng, method, prompt, 32) == ref


def _refusal(model, spec: str) -> UnsupportedModelError:
    try:
        make_method(spec).prepare(Context(Engine(model)))
    except UnsupportedModelError as e:
        return e
    raise AssertionError(f"{spec} was not refused")


@pytest.mark.parametrize("family", PLAIN_HERE)
def test_plain_families_refuse_every_drafting_method(models, family):
    model = models(family)
    eng = Engine(model)
    with pytest.raises(UnsupportedModelError, match=f"'{family}'"):
        check_cache_support(eng, make_method("pld"))
    with pytest.raises(UnsupportedModelError, match="use ntp"):
        check_tree_support(model, "probe")


@pytest.mark.parametrize("family", TESTED_TREE + CHAIN_HERE)
def test_cost_curve_key_and_fingerprint_of_every_drafting_family(models, family):
    """``auto`` keys its cost curve by the model's fingerprint, read from the
    token embedding whatever the family calls it (``embed_tokens``, ``wte``,
    ...): every family a drafting method runs on gets one."""
    from mlx_mtp.costs import curve_key
    from mlx_mtp.fingerprint import model_fingerprint

    model = models(family)
    key = curve_key(Engine(model))
    assert key["model"].endswith(model_fingerprint(model))
