"""examples/tau_by_size.py: one row per model, tau pooled over the folders
of a run split by task (generated tokens over forward passes)."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "tau_by_size.py"


def _script():
    spec = importlib.util.spec_from_file_location("tau_by_size", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _folder(root: Path, name: str, model: str, max_tokens: int, methods: dict) -> Path:
    folder = root / name
    folder.mkdir()
    rows = [
        {
            "label": label,
            "overall": {"n": n, "generated_tokens": tok, "forward_passes": fp, "tau": 0.0},
        }
        for label, (n, tok, fp) in methods.items()
    ]
    results = {"settings": {"model": f"/cache/{model}", "max_tokens": max_tokens}, "methods": rows}
    (folder / "results.json").write_text(json.dumps(results))
    return folder


def test_folders_of_one_model_pool_into_one_row(tmp_path):
    mod = _script()
    a = _folder(
        tmp_path, "a", "qwen2.5-coder-1.5b", 64, {"ntp": (6, 300, 300), "pld": (6, 300, 200)}
    )
    b = _folder(
        tmp_path, "b", "qwen2.5-coder-1.5b", 64, {"ntp": (6, 200, 200), "pld": (6, 200, 50)}
    )
    c = _folder(tmp_path, "c", "smollm2-135m", 64, {"ntp": (2, 10, 10), "probe": (2, 10, 5)})
    rows = mod.merge([a, b, c])
    assert [r[0] for r in rows] == ["smollm2-135m", "qwen2.5-coder-1.5b"]  # smallest first
    model, taus, size = rows[1]
    assert taus["pld"] == pytest.approx(500 / 250)  # pooled, not the mean of 1.5 and 4.0
    assert taus["ntp"] == 1.0
    assert size == "12 x 64"


def test_folders_of_one_model_with_different_lengths_are_refused(tmp_path):
    mod = _script()
    a = _folder(tmp_path, "a", "smollm2-135m", 64, {"ntp": (1, 64, 64)})
    b = _folder(tmp_path, "b", "smollm2-135m", 32, {"ntp": (1, 32, 32)})
    with pytest.raises(SystemExit, match="max-tokens"):
        mod.merge([a, b])
    with pytest.raises(SystemExit, match="no results.json"):
        mod.merge([tmp_path])
