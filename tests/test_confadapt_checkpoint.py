"""Self-distilled MTP checkpoints: the converter and on-device adaptation.

Synthetic checkpoints are laid out like the released repos
(``jwkirchenbauer/Qwen3-4B-Inst-2507-MTP``: Qwen3ForCausalLM, tied embeddings;
``jwkirchenbauer/L3-1-8B-Magpie-MTP``: LlamaForCausalLM, untied LM head): tiny
configs, random bf16 weights in two ``model-0000x-of-00002.safetensors`` shards
with ``model.safetensors.index.json``, and the embedded SmolLM2 tokenizer with
the added ``<|mtp_special_token_0|>``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_mtp.errors import CheckpointMismatchError, InvalidArgumentError, ModelNotFoundError
from mlx_mtp.methods.confadapt import MASK_TOKEN, MissingMaskTokenError, read_metadata

LAYOUTS = {
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "head_dim": 16, "tie_word_embeddings": True},
    "llama": {"architectures": ["LlamaForCausalLM"], "tie_word_embeddings": False},
}


@pytest.fixture(scope="module")
def tokenizer_dirs(smollm, tmp_path_factory):
    """SmolLM2's tokenizer saved twice: with and without the mask token."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("tok")
    out = {}
    for with_mask in (True, False):
        tok = AutoTokenizer.from_pretrained(str(smollm.path))
        if with_mask:
            tok.add_special_tokens({"additional_special_tokens": [MASK_TOKEN]})
        d = root / ("mask" if with_mask else "plain")
        tok.save_pretrained(str(d))
        out[with_mask] = (d, len(tok))
    return out


def make_checkpoint(
    dest: Path, family: str, tokenizer_dirs, with_mask=True, seed=0, **sizes
) -> Path:
    """A tiny HF-style checkpoint folder (see the module docstring); ``sizes``
    override config entries (hidden_size, num_hidden_layers, ...)."""
    from tiny_models import make_tiny_model, tiny_config

    tok_dir, n_tok = tokenizer_dirs[with_mask]
    vocab = -(-n_tok // 8) * 8  # padded, like Qwen's 151936 > 151670
    config = tiny_config(
        family, **{"vocab_size": vocab, "torch_dtype": "bfloat16", **LAYOUTS[family], **sizes}
    )
    model = make_tiny_model(
        family, seed=seed, **{k: v for k, v in config.items() if k != "architectures"}
    )
    weights = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(model.parameters())}
    dest.mkdir(parents=True)
    names = sorted(weights)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:]), 1):
        fname = f"model-0000{i}-of-00002.safetensors"
        mx.save_safetensors(str(dest / fname), {n: weights[n] for n in part}, {"format": "pt"})
        weight_map.update({n: fname for n in part})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index))
    (dest / "config.json").write_text(json.dumps(config))
    for f in tok_dir.iterdir():
        shutil.copy(f, dest / f.name)
    return dest


def _convert(src, dst, **kw):
    from mlx_mtp.converters.confadapt_import import convert_mtp_checkpoint

    return convert_mtp_checkpoint(src, dst, **kw)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_convert_round_trip_and_decode(tmp_path, tokenizer_dirs, family):
    import mlx_mtp

    src = make_checkpoint(tmp_path / "src", family, tokenizer_dirs)
    dst = _convert(src, tmp_path / "out")
    meta = read_metadata(dst)
    _, n_tok = tokenizer_dirs[True]
    assert meta.mask_token_id == n_tok - 1  # the added token, looked up in the tokenizer
    assert meta.prompt_format == ("plain" if family == "qwen3" else "chat")
    assert meta.k == 16 and meta.eos_token_ids
    # the weights are the checkpoint's (bf16, as stored)
    m = mlx_mtp.load(str(dst), method="confadapt", dtype="auto", k=4, tau=0.0)
    src_w = mx.load(str(src / "model-00001-of-00002.safetensors"))
    name = sorted(src_w)[0]
    got = dict(tree_flatten(m.model.parameters()))[name]
    assert mx.array_equal(got, src_w[name])
    assert m.method.mask_id == meta.mask_token_id
    res = m.generate("Hello there", max_tokens=12)
    assert res.stats.generated_tokens >= 1
    assert res.stats.tau > 1.0 or res.finish_reason == "stop"
    if family == "qwen3":  # plain format: BOS (none in this tokenizer) + text + blank line
        ids = m.encode("Hello there")
        assert m.tokenizer.decode(ids).endswith("Hello there\n\n")


def test_convert_quantized(tmp_path, tokenizer_dirs):
    import mlx_mtp

    src = make_checkpoint(tmp_path / "src", "qwen3", tokenizer_dirs)
    dst = _convert(src, tmp_path / "q4", quantize=4)
    assert json.loads((dst / "config.json").read_text())["quantization"]["bits"] == 4
    m = mlx_mtp.load(str(dst), method="confadapt", dtype="auto", k=3, tau=0.0)
    assert m.generate("Hi", max_tokens=6).stats.generated_tokens >= 1


def test_convert_is_lazy_and_writes_shard_by_shard(tmp_path, tokenizer_dirs):
    """Peak memory of a conversion is about one output shard, not the model:
    nothing is evaluated before its shard is written (issue 18). 16 layers of
    3.7 MB next to a 25 MB embedding, 8 MB shards: the whole model is ~84 MB,
    the peak must stay under half of it (evaluating every parameter first, as
    the converter did, peaks above the whole model)."""
    src = make_checkpoint(
        tmp_path / "src",
        "qwen3",
        tokenizer_dirs,
        hidden_size=256,
        intermediate_size=2048,
        num_hidden_layers=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    )
    total = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    dst = _convert(src, tmp_path / "out", max_shard_bytes=8 << 20)
    peak = mx.get_peak_memory() - base
    shards = sorted(dst.glob("model-*.safetensors"))
    assert len(shards) >= 8
    assert peak < 0.5 * total, f"peak {peak / 1e6:.1f} MB for a {total / 1e6:.1f} MB model"
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    src_w = {}
    for f in src.glob("*.safetensors"):
        src_w.update(mx.load(str(f)))
    out_w = {}
    for f in shards:
        out_w.update(mx.load(str(f)))
    assert sorted(out_w) == sorted(src_w)
    assert all(mx.array_equal(out_w[k], src_w[k]) for k in src_w)


def test_convert_refuses_checkpoint_without_mask_token(tmp_path, tokenizer_dirs):
    src = make_checkpoint(tmp_path / "src", "llama", tokenizer_dirs, with_mask=False)
    with pytest.raises(MissingMaskTokenError, match="mlx-mtp train mtp"):
        _convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_convert_never_overwrites(tmp_path, tokenizer_dirs):
    src = make_checkpoint(tmp_path / "src", "qwen3", tokenizer_dirs)
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(InvalidArgumentError, match="--overwrite"):
        _convert(src, dst)
    assert (dst / "keep.txt").read_text() == "mine"
    _convert(src, dst, overwrite=True)
    assert not (dst / "keep.txt").exists() and read_metadata(dst) is not None


def test_convert_corrupt_or_missing_shard(tmp_path, tokenizer_dirs):
    from mlx_mtp.converters.confadapt_import import MTPCheckpointError

    src = make_checkpoint(tmp_path / "src", "llama", tokenizer_dirs)
    shard = src / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])  # truncated download
    with pytest.raises(MTPCheckpointError):
        _convert(src, tmp_path / "out")
    shard.unlink()
    with pytest.raises(MTPCheckpointError, match="missing"):
        _convert(src, tmp_path / "out")
    # nothing that loads is left behind: no DST, no partial sibling with a config.json
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if (p / "config.json").exists() and p != src]


def test_convert_interrupted_leaves_nothing_loadable(tmp_path, tokenizer_dirs, monkeypatch):
    import mlx_lm.utils

    src = make_checkpoint(tmp_path / "src", "qwen3", tokenizer_dirs)

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(mlx_lm.utils, "save_config", boom)
    with pytest.raises(KeyboardInterrupt):
        _convert(src, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_convert_hub_offline_error(tmp_path, monkeypatch):
    import mlx_mtp.loading

    def offline(*a, **k):
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(mlx_mtp.loading, "snapshot_download", offline)
    with pytest.raises(ModelNotFoundError, match="offline"):
        _convert("jwkirchenbauer/Qwen3-4B-Inst-2507-MTP", tmp_path / "out")


# ------------------------------------------------------------------ training
def _trainer(src, out, **cfg):
    from mlx_mtp.loading import load_model
    from mlx_mtp.training.mtp import TrainConfig, Trainer

    lm = load_model(str(src), dtype="float32")
    base = dict(steps=2, gen_tokens=6, regions=2, k_max=4, save_every=1, warmup=1)
    base.update(cfg)
    prompts = ["What is two plus two?", "Name a colour.", "Count to three."]
    return lm, Trainer(lm, prompts, out, TrainConfig(**base))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_train_lora_adapter_adds_mask_token(tmp_path, tokenizer_dirs, family):
    """LoRA adaptation of a model without the mask token (untied llama head,
    tied qwen3 embeddings): the adapter decodes through --method confadapt,
    only for its base model, and a run resumes from its checkpoint."""
    import mlx_mtp
    from mlx_mtp.fingerprint import model_fingerprint

    src = make_checkpoint(tmp_path / "src", family, tokenizer_dirs, with_mask=False)
    lm, tr = _trainer(src, tmp_path / "adapter")
    _, n_tok = tokenizer_dirs[False]
    assert tr.mask_id == n_tok  # first unused row of the padded vocabulary
    before = mx.array(tr.student.model.embed_tokens.mask_embedding)
    out = tr.run()
    cfg = json.loads((out / "mtp_adapter.json").read_text())
    assert cfg["base_fingerprint"] == model_fingerprint(lm.model)
    w = mx.load(str(out / "adapter.safetensors"))
    assert not mx.array_equal(w["mask_embedding"], before)  # the new row is trained too
    assert any(float(mx.abs(v).max()) > 0 for k, v in w.items() if k.endswith("lora_b"))
    m = mlx_mtp.load(str(src), method="confadapt", adapter=str(out), k=4, tau=0.0)
    assert m.method.mask_id == n_tok
    assert m.generate("Hello", max_tokens=8).stats.generated_tokens >= 1
    # another base model is refused
    other = make_checkpoint(tmp_path / "other", family, tokenizer_dirs, with_mask=False, seed=3)
    with pytest.raises(CheckpointMismatchError, match="trained for"):
        mlx_mtp.load(str(other), method="confadapt", adapter=str(out))
    # the held-out check: a gated adapter keeps next-token prediction the
    # base model's (agreement 1.0 on its greedy tokens); scored against other
    # tokens it is not
    from mlx_mtp.training.mtp_check import heldout_check, trainer_check

    res = trainer_check(tr, tokens=8)
    assert res["ntp_agreement"] == 1.0 and res["positions"] > 0
    assert len(res["mask_accuracy"]) == 15 and set(res["taus"]) == {"0.9", "0.6"}
    prompt = tr._prompt_ids(0)
    wrong = heldout_check(tr.student, tr.mask_id, [prompt], [[1, 2, 3, 4, 5, 6]], k=4, stride=2)
    assert wrong["ntp_agreement"] < 1.0
    # resume: a new trainer with the same settings starts at the saved step
    _, tr2 = _trainer(src, tmp_path / "adapter")
    assert tr2.resume() and tr2.step == 2
    _, tr3 = _trainer(src, tmp_path / "adapter", steps=5)
    with pytest.raises(InvalidArgumentError, match="other settings.*steps: 2 there, 5 now"):
        tr3.resume()
    # a checkpoint from before `forcing` existed was student-forced: it
    # resumes with --forcing student, and the default (teacher) refuses it
    state = tmp_path / ".adapter.ckpt" / "state.json"
    info = json.loads(state.read_text())
    del info["config"]["forcing"]
    state.write_text(json.dumps(info))
    _, tr4 = _trainer(src, tmp_path / "adapter", forcing="student")
    assert tr4.resume() and tr4.step == 2
    _, tr5 = _trainer(src, tmp_path / "adapter")
    with pytest.raises(InvalidArgumentError, match="forcing: 'student' there, 'teacher' now"):
        tr5.resume()
    _, tr5 = _trainer(src, tmp_path / "adapter", forcing="teacher")
    with pytest.raises(InvalidArgumentError, match="forcing: 'student' there, 'teacher' now"):
        tr5.resume()


def test_qlora_on_a_quantized_base_lowers_held_out_loss(tmp_path, tokenizer_dirs):
    """train mtp on the stored 4-bit weights (issue 18): mlx-lm's LoRA over the
    frozen quantized linears (QLoRA), no float copy of the base. The
    self-distillation loss on held-out prompts drops, the adapter decodes on
    the quantized base and full fine-tuning is refused with the way out."""
    import mlx.nn as nn

    import mlx_mtp
    from mlx_mtp.loading import load_model
    from mlx_mtp.training.mtp import TrainConfig, Trainer, self_distillation_loss

    src = make_checkpoint(tmp_path / "src", "qwen3", tokenizer_dirs)
    q4 = _convert(src, tmp_path / "q4", quantize=4)
    lm = load_model(str(q4), dtype="auto")
    cfg = dict(steps=6, gen_tokens=8, regions=3, k_max=4, save_every=100, warmup=1)
    cfg.update(lr=5e-3, forcing="teacher")
    train = [f"Question {i}: what is {i} plus {2 * i}?" for i in range(4)]
    held = ["Name three colours.", "Count to five, please."]
    tr = Trainer(lm, train, tmp_path / "adapter", TrainConfig(**cfg))
    ho = Trainer(lm, held, tmp_path / "unused", TrainConfig(**cfg))  # held-out samples
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in tr.student.named_modules())

    def held_out_loss():
        total = 0.0
        for step in range(4):
            real, gen_start, layout = ho.sample(step)
            loss, _ = self_distillation_loss(
                tr.student, tr.teacher, real, gen_start, layout, tr.mask_id, tr.vocab,
                ntp_term=False, forcing="teacher",
            )  # fmt: skip
            total += float(loss.item())
        return total / 4

    before = held_out_loss()
    out = tr.run()
    after = held_out_loss()
    assert after < 0.5 * before, (before, after)
    m = mlx_mtp.load(str(q4), method="confadapt", dtype="auto", adapter=str(out), k=4, tau=0.0)
    assert m.generate("Hello", max_tokens=8).stats.generated_tokens >= 1
    with pytest.raises(InvalidArgumentError, match="--lora"):
        Trainer(lm, train, tmp_path / "full", TrainConfig(**cfg, lora=False))


def _close(a, b, rel=1e-2):
    """Equal up to float16 rounding of the stored LoRA: the largest difference is
    within ``rel`` of the largest logit."""
    return float(mx.abs(a - b).max()) <= rel * (1.0 + float(mx.abs(b).max()))


def _slot_logits(models, mask_id):
    """Logits of each model on 12 real tokens plus two mask regions (k = 4, 3)."""
    from mlx_mtp.training.mtp import forward_layout, region_layout

    real = list(range(3, 15))
    lay = region_layout(len(real), [5, 9], [4, 3])
    ids = mx.array(real + [mask_id] * lay.n_slots)
    return lay.n_real, [forward_layout(m, ids, lay) for m in models]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_gated_adapter_keeps_next_token_prediction(tmp_path, tokenizer_dirs, family):
    """The default LoRA adapter is gated: real tokens are computed by the base
    model bit for bit, so ConfAdapt with tau > 1 is the base model's greedy
    decoding; the mask slots do change; and the loaded adapter computes what
    the trained student computed (LoRA stored in float16)."""
    import mlx_mtp
    from mlx_mtp.methods.confadapt import (
        GatedLoRALinear,
        MaskedEmbedding,
        apply_adapter,
        clone_modules,
        read_adapter_config,
    )

    src = make_checkpoint(tmp_path / "src", family, tokenizer_dirs, with_mask=False)
    lm, tr = _trainer(src, tmp_path / "adapter", steps=3, lr=5e-2)
    out = tr.run()
    cfg = read_adapter_config(out)
    assert cfg["lora"]["gated"] is True
    adapted = apply_adapter(lm.model, out, cfg)
    assert isinstance(adapted.model.layers[0].self_attn.q_proj, GatedLoRALinear)
    plain = clone_modules(lm.model)  # the base model with the same mask-token row, no LoRA
    plain.model.embed_tokens = MaskedEmbedding(
        plain.model.embed_tokens, tr.mask_id, adapted.model.embed_tokens.mask_embedding
    )
    n, (a, p, s) = _slot_logits([adapted, plain, tr.student], tr.mask_id)
    assert mx.array_equal(a[:n], p[:n])
    assert not mx.allclose(a[n:], p[n:], atol=1e-3)
    assert _close(a, s)  # round trip, LoRA stored in float16

    base = mlx_mtp.load(str(src), method="ntp", dtype="float32")
    slow = mlx_mtp.load(
        str(src), method="confadapt", adapter=str(out), k=4, tau=1.01, dtype="float32"
    )
    for prompt in ["Hello", "What is two plus two?", "Count to three.", "Name a colour."]:
        ref = base.generate(prompt, max_tokens=12).tokens
        assert slow.generate(prompt, max_tokens=12).tokens == ref


def test_ungated_adapter_is_fused_and_moves_real_tokens(tmp_path, tokenizer_dirs):
    """``gated=False``: plain LoRA (mlx-lm), fused into the linears on load; it
    changes real tokens too, which the next-token loss term only holds near."""
    from mlx_mtp.methods.confadapt import (
        GatedLoRALinear,
        MaskedEmbedding,
        apply_adapter,
        clone_modules,
        read_adapter_config,
    )

    src = make_checkpoint(tmp_path / "src", "llama", tokenizer_dirs, with_mask=False)
    lm, tr = _trainer(src, tmp_path / "adapter", steps=2, lr=5e-2, gated=False)
    out = tr.run()
    cfg = read_adapter_config(out)
    assert cfg["lora"]["gated"] is False
    adapted = apply_adapter(lm.model, out, cfg)
    q = adapted.model.layers[0].self_attn.q_proj
    assert type(q).__name__ == "Linear" and not isinstance(q, GatedLoRALinear)
    plain = clone_modules(lm.model)
    plain.model.embed_tokens = MaskedEmbedding(
        plain.model.embed_tokens, tr.mask_id, adapted.model.embed_tokens.mask_embedding
    )
    n, (a, p, s) = _slot_logits([adapted, plain, tr.student], tr.mask_id)
    assert not mx.allclose(a[:n], p[:n], atol=1e-3)
    assert _close(a, s)  # round trip, LoRA stored in float16
    # adapters written before gating existed have no "gated" key: fused, as before
    del cfg["lora"]["gated"]
    old = apply_adapter(lm.model, out, cfg)
    _, (o,) = _slot_logits([old], tr.mask_id)
    assert mx.array_equal(o, a)


def test_teacher_forcing_targets_are_the_continuation(tmp_path, tokenizer_dirs):
    """``forcing="teacher"``: each mask slot's target is the continuation token
    after its position; slots past the continuation's end are left out."""
    import mlx.nn as nn

    from mlx_mtp.training.mtp import forward_layout, region_layout, self_distillation_loss

    src = make_checkpoint(tmp_path / "src", "llama", tokenizer_dirs, with_mask=False)
    lm, tr = _trainer(src, tmp_path / "adapter", forcing="teacher")
    real = list(range(3, 19))  # 16 tokens, the continuation starts at index 8
    lay = region_layout(len(real), [8, 13], [4, 5])  # slots at positions 9-11 and 14-17
    args = (tr.student, tr.teacher, real, 8, lay, tr.mask_id, tr.vocab)
    loss, _ = self_distillation_loss(*args, ntp_term=False, forcing="teacher")
    logits = forward_layout(tr.student, mx.array(real + [tr.mask_id] * lay.n_slots), lay)
    logits = logits[:, : tr.vocab].astype(mx.float32)
    n = len(real)
    rows, targets = [n, n + 1, n + 2, n + 3], [real[10], real[11], real[12], real[15]]
    want = nn.losses.cross_entropy(logits[mx.array(rows)], mx.array(targets), reduction="mean")
    assert mx.allclose(loss, want, atol=1e-5)
    with_ntp, _ = self_distillation_loss(*args, forcing="teacher")
    ntp = nn.losses.cross_entropy(logits[7:15], mx.array(real[8:16]), reduction="mean")
    assert mx.allclose(with_ntp, want + ntp, atol=1e-5)
    # a continuation too short for any slot's target: a zero loss, not NaN
    late = region_layout(len(real), [14], [4])
    args_late = (tr.student, tr.teacher, real, 8, late, tr.mask_id, tr.vocab)
    empty, _ = self_distillation_loss(*args_late, ntp_term=False, forcing="teacher")
    assert float(empty) == 0.0
    assert tr.run().is_dir()
    with pytest.raises(InvalidArgumentError, match="forcing"):
        self_distillation_loss(*args, forcing="both")
    with pytest.raises(InvalidArgumentError, match="forcing"):
        _trainer(src, tmp_path / "other", forcing="both")


def test_train_full_writes_loadable_folder(tmp_path, tokenizer_dirs):
    import mlx_mtp

    src = make_checkpoint(tmp_path / "src", "llama", tokenizer_dirs, with_mask=False)
    _, tr = _trainer(src, tmp_path / "full", lora=False, steps=1)
    out = tr.run()
    meta = read_metadata(out)
    m = mlx_mtp.load(str(out), method="confadapt", k=3, tau=0.0)
    assert m.method.mask_id == meta.mask_token_id
    assert m.generate("Hello", max_tokens=6).stats.generated_tokens >= 1


def test_region_layout_mask_and_positions():
    from mlx_mtp.training.mtp import region_layout, region_rows

    lay = region_layout(5, [1, 3], [3, 2])
    assert lay.n_slots == 3
    assert lay.positions.tolist() == [0, 1, 2, 3, 4, 2, 3, 4]
    m = lay.mask
    assert m[:5, :5].tolist() == np.tril(np.ones((5, 5), bool)).tolist()
    assert not m[:5, 5:].any()  # real tokens never see a mask
    assert m[5].tolist() == [1, 1, 0, 0, 0, 1, 0, 0]
    assert m[6].tolist() == [1, 1, 0, 0, 0, 1, 1, 0]
    assert m[7].tolist() == [1, 1, 1, 1, 0, 0, 0, 1]
    pred, src = region_rows(lay)
    assert pred.tolist() == [1, 5, 6, 3, 7] and src.tolist() == [1, 5, 3]


def test_cli_convert_and_train(tmp_path, tokenizer_dirs):
    """``mlx-mtp convert mtp-checkpoint`` and ``mlx-mtp train mtp`` end to end;
    bad input raises MTPError subclasses (printed without traceback by cli.main)."""
    from typer.testing import CliRunner

    from mlx_mtp.cli import app

    runner = CliRunner()
    src = make_checkpoint(tmp_path / "src", "qwen3", tokenizer_dirs)
    r = runner.invoke(app, ["convert", "mtp-checkpoint", str(src), str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    assert read_metadata(tmp_path / "out").prompt_format == "plain"
    r = runner.invoke(app, ["convert", "mtp-checkpoint", str(src), str(tmp_path / "out")])
    assert isinstance(r.exception, InvalidArgumentError) and "--overwrite" in str(r.exception)
    plain = make_checkpoint(tmp_path / "plain", "llama", tokenizer_dirs, with_mask=False)
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"question": "What is 3 + 4?"}\n"Say hi."\n')
    args = ["train", "mtp", "--model", str(plain), "--data", str(data), "--steps", "1"]
    args += ["--gen-tokens", "4", "--regions", "1", "--out", str(tmp_path / "ad")]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "--opt adapter=" in r.output and (tmp_path / "ad" / "mtp_adapter.json").is_file()
    # the held-out check at the end: six Spec-Bench prompts, never trained on
    assert "held-out check (6 Spec-Bench prompts" in r.output, r.output
    assert "mask accuracy slot 1 / 2 / 3" in r.output and "tau 0.9: Eff. k" in r.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nothing": 1}\n')
    r = runner.invoke(app, ["train", "mtp", "--model", str(plain), "--data", str(bad)])
    assert isinstance(r.exception, InvalidArgumentError) and "has no prompt" in str(r.exception)
