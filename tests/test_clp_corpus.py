"""``train clp --corpus``: teacher-forced targets over text, then CLP heads
(mlx_mtp/training/forced.py, train_clp_forced)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from tiny_models import make_tiny_model

from mlx_mtp.clp_format import load_heads
from mlx_mtp.errors import InvalidArgumentError
from mlx_mtp.families import model_parts
from mlx_mtp.training.clp import TrainConfig, output_rows, train_clp_corpus
from mlx_mtp.training.continuations import greedy_continuations
from mlx_mtp.training.forced import (
    ForcedTargets,
    continuation_windows,
    corpus_documents,
    forced_examples,
    merge_examples,
    pack_windows,
)


class CharTokenizer:
    """One id per character (mod 250); 255 is EOS; a chat template that
    writes ``role: content`` lines."""

    eos_token_id = 255
    chat_template = "role lines"

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 250 for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, msgs, tokenize=True, add_generation_prompt=False, **kw):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in msgs)
        return text if not tokenize else self.encode(text)


def test_corpus_documents_read_every_record_shape(tmp_path):
    f = tmp_path / "c.jsonl"
    recs = [
        {"question": "How many?", "answer": "2+2 = <<2+2=4>>4\n#### 4"},
        {"text": "plain text"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    ]
    f.write_text("\n".join(json.dumps(r) for r in recs))
    docs = corpus_documents(CharTokenizer(), [f])
    assert docs[0] == "user: How many?\nassistant: 2+2 = 4\n#### 4\n"  # no calculator marks
    assert docs[1] == "plain text" and docs[2] == "user: hi\nassistant: yo\n"
    (tmp_path / "bad.jsonl").write_text(json.dumps({"other": 1}))
    with pytest.raises(InvalidArgumentError, match="has no text"):
        corpus_documents(CharTokenizer(), [tmp_path / "bad.jsonl"])
    with pytest.raises(InvalidArgumentError, match="no such file"):
        corpus_documents(CharTokenizer(), [tmp_path / "missing.jsonl"])
    w = pack_windows(CharTokenizer(), ["ab", "cd"], window=4)
    assert w.tolist() == [[97, 98, 255, 99]]  # EOS between documents, the short tail dropped


def test_forced_targets_are_the_backbones_own_predictions(tmp_path):
    """Every stored target is the argmax of the full forward pass at that
    position, the stored states give the same logits, and each head's target
    row and decode-time consistency flag point where they should."""
    model = make_tiny_model("llama", seed=1)
    windows = np.random.default_rng(0).integers(0, 250, (3, 12)).astype(np.int32)
    targets = ForcedTargets(model, windows, tmp_path / "t", shard=2)
    assert targets.compute() == 2
    got = targets.load()
    logits = model(mx.array(windows))
    assert (np.array(mx.argmax(logits, axis=-1)) == got["argmax"]).all()
    top = np.sort(np.array(mx.argsort(-logits, axis=-1)[..., :8]), axis=-1)
    assert (np.sort(got["top"], axis=-1) == top).all()
    _, lm_head, _ = model_parts(model)
    again = lm_head(mx.array(got["hidden"].astype(np.float32)))
    assert (np.array(mx.argmax(again, axis=-1)) == got["argmax"]).mean() > 0.95  # float16 states

    ex = forced_examples(got, k=2)
    T = windows.shape[1]
    assert len(ex["H"]) == 3 * (T - 2)
    i = T - 2 + 4  # window 1, position 4
    assert ex["nxt"][i] == windows[1, 5]
    assert ex["tgt"][i].tolist() == [got["argmax"][1, 5], got["argmax"][1, 6]]
    assert ex["tgt_row"][i].tolist() == [T + 5, T + 6]
    own1 = windows[1, 5] == got["argmax"][1, 4]
    own2 = own1 and windows[1, 6] == got["argmax"][1, 5]
    assert ex["consistent"][i].tolist() == [own1, own2]


def test_continuation_windows_are_forced_windows_of_the_greedy_tokens():
    """A greedy continuation read as a window: its predictions are what a full
    forward pass over prompt + continuation predicts at those positions, the
    stored top tokens hold them, short continuations are left out, and merged
    examples keep each source's target rows."""
    model = make_tiny_model("llama", seed=2)
    prompts = [[5, 9, 13, 2], [7, 7, 1, 30, 31, 4]]
    T = 6
    seqs = greedy_continuations(model, prompts, T, eos=set(), hidden=True, progress=False)
    short = greedy_continuations(model, [[3, 4]], 3, eos=set(), hidden=True, progress=False)
    w = continuation_windows(seqs + short, model, T)
    assert w["tokens"].shape == (2, T) and w["hidden"].dtype == np.float16
    for r, (p, s) in enumerate(zip(prompts, seqs)):
        full = np.array(mx.argmax(model(mx.array([p + s.generated[: T - 1]])), axis=-1))[0]
        assert w["argmax"][r].tolist() == full[len(p) - 1 :].tolist() == s.generated[:T]
        assert w["tokens"][r].tolist() == [p[-1]] + s.generated[: T - 1]
        assert all(a in top for a, top in zip(w["argmax"][r], w["top"][r]))
    ex = forced_examples(w, k=2)
    assert ex["consistent"].all()  # every input token is the backbone's own
    both = merge_examples([ex, ex])
    assert len(both["H"]) == 2 * len(ex["H"])
    assert (both["tgt_row"][len(ex["H"]) :] == ex["tgt_row"] + len(ex["H_all"])).all()
    rows = np.concatenate([ex["H_all"][ex["tgt_row"]]] * 2)
    assert (both["H_all"][both["tgt_row"]] == rows).all()
    with pytest.raises(InvalidArgumentError, match="reached 6 tokens"):
        continuation_windows(short, model, T)


def test_output_rows_is_the_projection_when_logits_are_plain():
    model = make_tiny_model("llama", seed=0)
    W = output_rows(model)
    _, lm_head, _ = model_parts(model)
    h = mx.random.normal((3, W.shape[1]))
    assert mx.allclose(lm_head(h), h @ W.T, atol=1e-4).item()


def test_train_clp_corpus_end_to_end_and_resumed(tmp_path):
    """Targets, heads with a held-out curve, predictor and gate; a rerun with
    ``resume`` reuses the targets and the head checkpoint; a zero target budget
    is a one-line error."""
    corpus = tmp_path / "c.jsonl"
    rng = np.random.default_rng(0)
    corpus.write_text(
        "\n".join(
            json.dumps({"text": "".join(chr(97 + x) for x in rng.integers(0, 8, 40))})
            for _ in range(20)
        )
    )
    held = tmp_path / "held.jsonl"
    held.write_text("\n".join(json.dumps({"text": "abcdefgh" * 8}) for _ in range(4)))
    model = make_tiny_model("llama", seed=0)
    loaded = SimpleNamespace(model=model, tokenizer=CharTokenizer(), name="tiny")
    cfg = TrainConfig(
        k=2, bottleneck=8, epochs=2, batch_size=32, predictor_epochs=1, checkpoint_every=5,
        eval_every=5, corpus=[str(corpus)], window=16, windows=40, predictor_positions=200,
    )  # fmt: skip
    out, logged = tmp_path / "heads", []
    res = train_clp_corpus(loaded, out, cfg, [str(held)], log=logged.append)
    name = f"{tmp_path.name}-held"  # the held-out file's folder and stem
    top1 = res[f"{name}_top1"]
    assert len(top1["all"]) == 2 and all(0.0 <= a <= 1.0 for a in top1["all"])
    assert res["curve"] and res["curve"][-1][name] and res["train_positions"] == 40 * 14
    heads = load_heads(out, model)
    assert heads.k == 2 and hasattr(heads, "gate")
    assert heads.config["training"]["targets"] == "teacher-forced"
    ck = tmp_path / ".heads.train"
    assert len(list((ck / "forced-train").glob("forced-*.npz"))) == 10
    stamp = {f: f.stat().st_mtime_ns for f in (ck / "forced-train").glob("forced-*.npz")}
    again = train_clp_corpus(loaded, out, cfg, [str(held)], resume=True, log=logged.append)
    assert {f: f.stat().st_mtime_ns for f in stamp} == stamp  # targets not made again
    assert any("resumed head training" in line for line in logged)
    assert again["train_positions"] == res["train_positions"]
    with pytest.raises(InvalidArgumentError, match="--target-minutes"):
        train_clp_corpus(loaded, tmp_path / "other", cfg, [str(held)], target_minutes=0.0)
    with pytest.raises(InvalidArgumentError, match="give a corpus"):
        train_clp_corpus(loaded, tmp_path / "none", TrainConfig(), [str(held)])


def test_train_clp_corpus_with_greedy_continuations(tmp_path):
    """--data with --corpus: the prompts' greedy continuations join the
    corpus windows as training positions, and are kept for a rerun."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": "abcdefgh" * 5}) for _ in range(6)))
    data = tmp_path / "p.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"question {i}?"}) for i in range(5)))
    model = make_tiny_model("llama", seed=0)
    loaded = SimpleNamespace(model=model, tokenizer=CharTokenizer(), name="tiny")
    cfg = TrainConfig(
        k=2, bottleneck=8, epochs=1, batch_size=32, predictor_epochs=1, eval_every=50,
        corpus=[str(corpus)], data=[str(data)], window=16, windows=10, max_new_tokens=8,
        gen_batch=4, predictor_positions=100,
    )  # fmt: skip
    res = train_clp_corpus(loaded, tmp_path / "heads", cfg, [str(corpus)], log=lambda s: None)
    assert res["train_positions"] == 10 * 14 + 5 * 6  # corpus windows + continuations
    heads = load_heads(tmp_path / "heads", model)
    assert heads.config["training"]["data"] == ["p.jsonl"]
    kept = tmp_path / ".heads.train" / "continuations.jsonl"
    assert len(kept.read_text().splitlines()) == 1 + 5
    logged: list[str] = []
    train_clp_corpus(loaded, tmp_path / "heads", cfg, [str(corpus)], log=logged.append)
    assert any("resumed 5 generated continuations" in line for line in logged)


def test_train_clp_needs_data_or_corpus_before_loading(tmp_path):
    """Neither --data nor --corpus, or a missing corpus file: one
    line naming the problem, exit code 2, before any model loads."""
    import subprocess
    import sys
    from pathlib import Path

    exe = str(Path(sys.executable).parent / "mlx-mtp")
    r = subprocess.run(
        [exe, "train", "clp", "--out", str(tmp_path / "h")], capture_output=True, text=True
    )
    assert r.returncode == 2 and "give --data" in r.stderr and "Traceback" not in r.stderr
    missing = str(tmp_path / "none.jsonl")
    r = subprocess.run([exe, "train", "clp", "--corpus", missing], capture_output=True, text=True)
    assert r.returncode == 2 and "no such file" in r.stderr
    assert not (tmp_path / "h").exists()
