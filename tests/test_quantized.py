"""The user's precision: pipelined steps on stored quantized weights. The
embedded SmolLM2 loaded with ``dtype="auto"`` keeps its GGUF's weights as
stored (MLX affine 4-bit, group 32; the token embedding, which is also the
LM head, 8-bit), and ``mlx-mtp convert gguf --quantize 8`` re-quantizes the
same file to 8 bits (affine, group 64). Compute runs in float16 (the
scales' dtype) on MLX's CPU backend.

On this backend a quantized matmul gives each row the same result whatever
the other rows are (checked below, one row against many, at the kernel's
switch sizes), and so do the rest of the pass's kernels here: a multi-slot
pass then equals one-token decoding bit for bit, and every pipelined method
must reproduce plain decoding (ntp) in the same precision token for token.
Where a backend's kernels are not row-invariant (Metal's quantized
matmuls switch kernels by row count), ``mlx-mtp doctor`` and the bench
report an agreement rate instead. Decoding in float16 is slow on this CPU
(no native half precision): the decoding tests are ``-m slow``."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import PIPELINED_SETTINGS, memoised_greedy, setting_ids

from mlx_mtp.budget import CostCurve
from mlx_mtp.context import Context
from mlx_mtp.decoding import generate_steps
from mlx_mtp.engine import Engine
from mlx_mtp.methods import make_method

#: tokens decoded per prompt
N = 16
METHODS = PIPELINED_SETTINGS


@pytest.fixture(scope="module")
def q4():
    """The embedded model as stored: 4-bit weights, an 8-bit embedding."""
    from mlx_mtp.loading import load_model

    return load_model("smollm2-135m", dtype="auto")


@pytest.fixture(scope="module")
def q8(tmp_path_factory):
    """The embedded GGUF converted with ``--quantize 8`` (8-bit, group 64)."""
    from mlx_mtp.converters.gguf import convert_gguf

    from mlx_mtp.loading import ALIASES, _embedded_gguf, load_model

    gguf = _embedded_gguf(ALIASES["smollm2-135m"].removeprefix("embedded:"))
    out = tmp_path_factory.mktemp("q8") / "smollm2-q8"
    convert_gguf(gguf, out, quantize=8)
    return load_model(str(out), dtype="auto")


def _bits(lm) -> set[int]:
    return {m.bits for _, m in lm.model.named_modules() if hasattr(m, "bits")}


@pytest.mark.parametrize("which", ["q4", "q8"])
def test_quantized_matmuls_are_row_invariant_on_the_cpu(request, which):
    """One row alone and the same row among 1-32 others give the same bits,
    in every quantized projection kind and the quantized LM head (float32
    inputs: float16 ones take minutes on this CPU)."""
    lm = request.getfixturevalue(which)
    assert _bits(lm) == ({4, 8} if which == "q4" else {8})
    layers = lm.model.model.layers
    mods = [layers[0].self_attn.q_proj, layers[0].mlp.down_proj, layers[-1].mlp.up_proj]
    head = lm.model.model.embed_tokens
    assert isinstance(head, nn.QuantizedEmbedding)
    mx.random.seed(0)
    for fn, d in [*((m, m.weight.shape[1] * 32 // m.bits) for m in mods), (head.as_linear, 576)]:
        for rows in (2, 9, 33):
            x = mx.random.normal((1, rows, d))
            whole = fn(x)
            alone = mx.concatenate([fn(x[:, i : i + 1]) for i in range(rows)], axis=1)
            assert mx.array_equal(whole, alone).item(), (which, rows)


@pytest.mark.slow
@pytest.mark.parametrize("name,opts", METHODS, ids=setting_ids(METHODS))
def test_pipelined_methods_on_4_bit_weights_equal_ntp(
    q4, short_spec_prompts, monkeypatch, name, opts
):
    """Pipelined steps of every method on the stored 4-bit weights give ntp's
    tokens in the same precision (the kernels are row-invariant here), on
    two Spec-Bench prompts of two tasks, drafting and accepting drafts."""
    _pipelined_equal_ntp(q4, short_spec_prompts, monkeypatch, name, opts)


@pytest.mark.slow
@pytest.mark.parametrize("name,opts", [("pld", {}), ("hybrid", {})], ids=["pld", "hybrid"])
def test_pipelined_methods_on_8_bit_weights_equal_ntp(
    q8, short_spec_prompts, monkeypatch, name, opts
):
    """The same on 8-bit weights (a chain method and the tree of all)."""
    _pipelined_equal_ntp(q8, short_spec_prompts, monkeypatch, name, opts)


_REFERENCES: dict[int, object] = {}


def _pipelined_equal_ntp(lm, prompts, monkeypatch, name, opts):
    monkeypatch.setenv("MLX_MTP_PIPELINE", "1")
    ref = _REFERENCES.setdefault(id(lm.model), memoised_greedy(Engine(lm.model)))
    ctx = Context(Engine(lm.model), curves=CostCurve.flat())
    m = make_method(name, **opts)
    m.prepare(ctx)
    drafted = accepted = 0
    for i, p in enumerate(prompts[1:3]):
        out = []
        for step in generate_steps(ctx, m, p, max_tokens=N):
            out += step.tokens
            stats = step.stats
        assert out == ref(p, N), (name, opts, i)
        drafted += stats.drafted
        accepted += stats.accepted
    assert drafted > 0 and accepted > 0, (drafted, accepted)
