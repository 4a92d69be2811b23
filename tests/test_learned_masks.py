"""Learned mask embeddings: file keyed to the model, refused for another model,
the training forward equals the engine's tree forward, training reduces the
held-out loss, and the shipped SmolLM2 masks load."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from tiny_models import make_tiny_model

from mlx_mtp.context import Context
from mlx_mtp.errors import CheckpointMismatchError, InvalidArgumentError
from mlx_mtp.learned_masks import (
    ASSETS_DIR,
    LearnedMasksNotFoundError,
    load_learned_masks,
    save_learned_masks,
)


@pytest.fixture()
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_MTP_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_save_load_roundtrip_default_search(home):
    m = make_tiny_model("llama", seed=0)
    vec = mx.random.normal((2, 64))
    meta = save_learned_masks(vec, m, info={"model": "tiny"})
    assert meta.parent == home / "masks" and meta.suffix == ".json"
    got = load_learned_masks(m)  # found in the user cache by fingerprint
    assert got.shape == (2, 64)
    assert np.allclose(np.array(got), np.array(vec))
    assert np.allclose(np.array(load_learned_masks(m, path=meta)), np.array(vec))


def test_refused_for_another_model(home, tmp_path):
    a = make_tiny_model("llama", seed=0)
    b = make_tiny_model("llama", seed=1)
    meta = save_learned_masks(mx.zeros((1, 64)), a, tmp_path / "a.safetensors")
    with pytest.raises(CheckpointMismatchError, match="fingerprint"):
        load_learned_masks(b, path=meta)
    with pytest.raises(CheckpointMismatchError):
        load_learned_masks(b, path=tmp_path / "a.safetensors")
    # b has none of its own: a clear error naming the training command
    with pytest.raises(LearnedMasksNotFoundError, match="mlx-mtp train masks"):
        load_learned_masks(b)


def test_wrong_shape_refused(home):
    m = make_tiny_model("llama", seed=0)
    with pytest.raises(InvalidArgumentError):
        save_learned_masks(mx.zeros((2, 32)), m)


def test_probe_with_learned_masks_for_other_model_is_refused(home, tmp_path):
    from mlx_mtp.engine import Engine
    from mlx_mtp.methods import make_method

    a = make_tiny_model("llama", seed=0)
    b = make_tiny_model("llama", seed=1)
    meta = save_learned_masks(mx.zeros((2, 64)), a, tmp_path / "x.safetensors")
    # a copy under b's fingerprint name in the user cache is still refused by content
    from mlx_mtp.fingerprint import model_fingerprint

    dst = home / "masks"
    dst.mkdir(parents=True)
    fp_b = model_fingerprint(b)
    text = meta.read_text().replace('"x.safetensors"', '"w.safetensors"')
    (dst / f"{fp_b}.json").write_text(text)
    (dst / "w.safetensors").write_bytes((tmp_path / "x.safetensors").read_bytes())
    for name in ("probe", "hybrid"):
        with pytest.raises(CheckpointMismatchError):
            make_method(name, mask_init="learned").prepare(Context(Engine(b)))


def test_training_forward_matches_tree_forward():
    from mlx_mtp.engine import Engine
    from mlx_mtp.families import check_tree_support
    from mlx_mtp.training.masks import mask_logits, prefix_kv

    m = make_tiny_model("llama", seed=0)
    check_tree_support(m, "probe")
    toks = [int(x) for x in np.random.RandomState(0).randint(0, 256, 20)]
    vec = mx.random.normal((2, 64))
    logits = mask_logits(m, prefix_kv(m, toks), np.array([5, 9, 12]), vec)
    for i, t in enumerate([5, 9, 12]):
        e = Engine(m)
        e.sync(toks[:t])
        emb = mx.concatenate([e.embed_tokens([toks[t]]), vec])
        ref, _ = e.forward_tree(emb, np.array([-1, 0, 1]), [toks[t], -1, -1])
        assert np.allclose(np.array(ref[1:]), np.array(logits[2 * i : 2 * i + 2]), atol=1e-4)


def _tiny_sequences(model, n, seed):
    from mlx_mtp.decoding import generate_steps
    from mlx_mtp.engine import Engine
    from mlx_mtp.methods import make_method
    from mlx_mtp.training.continuations import TrainSequence

    rng = np.random.RandomState(seed)
    out = []
    for _ in range(n):
        prompt = [int(x) for x in rng.randint(0, 256, 12)]
        gen = []
        for s in generate_steps(Engine(model), make_method("ntp"), prompt, max_tokens=24):
            gen.extend(s.tokens)
        out.append(TrainSequence(prompt, gen))
    return out


@pytest.mark.parametrize("quantized", [False, True])
def test_training_reduces_heldout_loss(quantized):
    """Also on stored 4-bit weights (issue 18: a Mac trains on the model it runs,
    no float copy)."""
    import mlx.nn as nn

    from mlx_mtp.training.masks import eval_masks, mean_prompt_vectors, train_masks

    m = make_tiny_model("llama", seed=0)
    if quantized:
        nn.quantize(m, group_size=32, bits=4)
    train = _tiny_sequences(m, 8, seed=1)
    val = _tiny_sequences(m, 4, seed=2)
    init = mean_prompt_vectors(m, train, 2)
    before = eval_masks(m, val, init, 2)
    res = train_masks(m, train, slots=2, steps=40, lr=0.05, anchors_per_step=16, progress=False)
    after = eval_masks(m, val, res.vectors, 2)
    assert np.mean(res.train_loss[-10:]) < np.mean(res.train_loss[:10])
    assert after["loss"] < before["loss"] - 0.1
    assert after["anchors"] == before["anchors"] > 0


def test_shipped_smollm_masks(smollm):
    from mlx_mtp.fingerprint import model_fingerprint

    fp = model_fingerprint(smollm.model)
    assert (ASSETS_DIR / f"{fp}.json").exists(), "no shipped learned masks for SmolLM2"
    vec = load_learned_masks(smollm.model)
    assert vec.shape[1] == 576 and vec.shape[0] >= 1
    assert bool(mx.all(mx.isfinite(vec)))


def test_bounded_prefix_cache_gives_the_same_training():
    """Dropping prefix keys/values past the memory bound only costs recomputation:
    the learned vectors are the same as with every prefix kept."""
    from mlx_mtp.training.masks import train_masks

    m = make_tiny_model("llama", seed=0)
    train = _tiny_sequences(m, 5, seed=3)
    kw = dict(slots=2, steps=12, lr=0.05, anchors_per_step=8, progress=False)
    kept = train_masks(m, train, **kw)
    dropped = train_masks(m, train, kv_cache_gb=1e-9, **kw)  # keeps one prefix at a time
    assert kept.train_loss == pytest.approx(dropped.train_loss, rel=1e-5)
    assert np.allclose(np.array(kept.vectors), np.array(dropped.vectors), atol=1e-6)


def test_continuations_file_roundtrip_and_mismatch(tmp_path):
    from mlx_mtp.training.continuations import (
        TrainSequence,
        load_continuations,
        save_continuations,
    )

    seqs = [TrainSequence([1, 2, 3], [4, 5]), TrainSequence([7], [8, 9, 2])]
    meta = {"model_fingerprint": "abc", "max_tokens": 2, "prompts_sha256": "x"}
    path = tmp_path / "c" / "cont.jsonl"
    assert load_continuations(path, meta) is None  # nothing there yet
    save_continuations(path, seqs, meta)
    assert not list(path.parent.glob("*.tmp"))
    assert load_continuations(path, meta) == seqs
    assert load_continuations(path, {**meta, "model_fingerprint": "other"}) is None
    path.write_text('{"meta": {}}\n{"prompt": [1]\n')
    with pytest.raises(InvalidArgumentError, match="continuations"):
        load_continuations(path, meta)


def test_batched_continuations_equal_greedy(smollm, short_spec_prompts, greedy_reference):
    """Batched decoding (left-padded, float32) gives the same greedy
    continuations as one-by-one decoding on real prompts of different lengths."""
    from mlx_mtp.confadapt_format import tokenizer_eos_ids
    from mlx_mtp.data import load_questions, render_prompt
    from mlx_mtp.training.continuations import greedy_continuations

    tok = smollm.tokenizer
    texts = [q["turns"][0] for q in load_questions()[:3]]
    ids = [render_prompt(tok, [{"role": "user", "content": t}]) for t in texts]
    eos = set(tokenizer_eos_ids(tok))
    seqs = greedy_continuations(smollm.model, ids, 12, eos, batch_size=3, progress=False)
    assert len({len(s.prompt) for s in seqs}) > 1  # padding really happened
    for s in seqs:
        assert len(s.generated) == 12
        assert s.generated == greedy_reference(s.prompt, 12)


def test_train_masks_command_reuses_continuations(tmp_path, monkeypatch):
    """A second run with the same model, prompts and max_tokens reads the saved
    continuations instead of decoding again."""
    import json

    import mlx_mtp.training.continuations as tc
    from mlx_mtp.commands.masks import run_train_masks

    monkeypatch.setenv("MLX_MTP_HOME", str(tmp_path / "home"))
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Count to {i}."}) + "\n" for i in (3, 4, 5)))
    cont = tmp_path / "cont.jsonl"
    kw = dict(slots=1, steps=2, max_tokens=8, anchors=4, batch_size=3, progress=False)
    first = run_train_masks("smollm2-135m", [data], out=tmp_path / "a", continuations=cont, **kw)
    assert cont.is_file()

    def no_decoding(*a, **k):
        raise AssertionError("continuations were decoded again")

    monkeypatch.setattr(tc, "greedy_continuations", no_decoding)
    second = run_train_masks("smollm2-135m", [data], out=tmp_path / "b", continuations=cont, **kw)
    assert second["heldout_after"] == first["heldout_after"]


@pytest.fixture(scope="module")
def smollm_quantized():
    """The embedded SmolLM2 with its GGUF weights kept (``dtype="auto"``: 4-bit
    layers, an 8-bit embedding), the rest (norms, scales, biases) in float32 so
    that every activation is float32."""
    import mlx.nn as nn

    from mlx_mtp.loading import load_model

    loaded = load_model("smollm2-135m", dtype="auto")
    assert isinstance(loaded.model.model.embed_tokens, nn.QuantizedEmbedding)
    assert isinstance(loaded.model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    loaded.model.set_dtype(mx.float32)  # quantized weights stay packed
    return loaded


def test_learned_masks_on_the_quantized_model_agree_with_greedy(smollm_quantized):
    """``mask_init=learned`` runs on quantized weights for probe and hybrid (the
    hidden size is the model's, not the QuantizedEmbedding's packed width) and,
    with float32 activations, reproduces plain greedy decoding token for token.
    (Quantized matmuls are slow on the CPU: a short prompt, 6 tokens.)"""
    from conftest import run_method

    from mlx_mtp.dims import model_dims
    from mlx_mtp.engine import Engine
    from mlx_mtp.methods import make_method
    from mlx_mtp.methods.ntp import NTP

    model, tok = smollm_quantized.model, smollm_quantized.tokenizer
    assert model_dims(model) == (576, 49152)
    assert model.model.embed_tokens.weight.shape[-1] != 576  # packed
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Count from one to twenty in words."}],
        add_generation_prompt=True,
    )
    engine = Engine(model)  # later runs reuse the prompt's cache
    ref = run_method(Engine(model), NTP(), prompt, 6, eos=set())
    for name in ("probe", "hybrid"):
        method = make_method(name, mask_init="learned", bc="10")
        got = run_method(engine, method, prompt, 6, eos=set())
        assert method.learned is not None and method.learned.shape[1] == 576
        assert got == ref, name
