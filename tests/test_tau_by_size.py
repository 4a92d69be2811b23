"""examples/tau_by_size.py: one row per model, tau pooled over the folders
of a run split by task (generated tokens over forward passes)."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "tau_by_size.py"
SETTINGS = {"max_tokens": 64, "temp": 0.0, "dtype": None, "turns": 1, "mode": "specbench"}


def _script():
    spec = importlib.util.spec_from_file_location("tau_by_size", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _folder(root: Path, name: str, model: str, runs: dict, **settings) -> Path:
    """A bench folder: ``runs`` maps a method label to (qid, generated
    tokens, forward passes) records."""
    folder = root / name
    folder.mkdir()
    s = {**SETTINGS, **settings, "model": f"/cache/{model}"}
    (folder / "results.json").write_text(json.dumps({"settings": s, "methods": []}))
    lines = [
        json.dumps(
            {
                "method": m,
                "qid": q,
                "turn": 1,
                "repeat": 0,
                "generated_tokens": t,
                "forward_passes": f,
            }
        )
        for m, recs in runs.items()
        for q, t, f in recs
    ]
    (folder / "records.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_folders_of_one_model_pool_into_one_row(tmp_path):
    mod = _script()
    ntp = [("1", 64, 64)]
    a = _folder(tmp_path, "a", "qwen2.5-coder-1.5b", {"ntp": ntp, "pld": [("1", 60, 40)]})
    b = _folder(
        tmp_path,
        "b",
        "qwen2.5-coder-1.5b",
        {"ntp": [("2", 64, 64)], "pld": [("2", 64, 16)], "hybrid:bc=30,recycle=1": [("2", 64, 8)]},
    )
    c = _folder(tmp_path, "c", "smollm2-135m", {"ntp": ntp, "probe": [("1", 10, 5)]})
    runs = mod.merge([a, b, c])
    assert [r[0] for r in runs] == ["smollm2-135m", "qwen2.5-coder-1.5b"]  # smallest first
    model, taus, prompts, max_tokens = runs[1]
    assert taus["pld"] == pytest.approx(124 / 56)  # pooled, not the mean of 1.5 and 4.0
    assert prompts == {"pld": 2, "hybrid:bc=30,recycle=1": 1} and max_tokens == 64
    # a label with a comma is one method; a cell over fewer prompts says how many
    labels = mod.split_labels("pld,hybrid:bc=30,recycle=1")
    assert labels == ["pld", "hybrid:bc=30,recycle=1"]
    row = mod.table(runs, labels)[3]
    assert row == "| qwen2.5-coder-1.5b | 2 x 64 | 2.21 | 8.00 (1) |"


def test_what_cannot_be_pooled_is_refused(tmp_path):
    mod = _script()
    a = _folder(tmp_path, "a", "smollm2-135m", {"ntp": [("1", 64, 64)], "pld": [("1", 64, 32)]})
    b = _folder(tmp_path, "b", "smollm2-135m", {"ntp": [("2", 32, 32)]}, max_tokens=32)
    with pytest.raises(SystemExit, match="max_tokens=32"):
        mod.merge([a, b])
    with pytest.raises(SystemExit, match="pld on prompt 1 .* also in"):
        mod.merge([a, a])  # the same run twice would count its prompts twice
    with pytest.raises(SystemExit, match="not a bench folder"):
        mod.merge([tmp_path])
