"""The artifact store (mlx_mtp/artifacts.py) and faults at its edges: discovery
order, atomic writes, a full disk during a GGUF import, a checkpoint conversion
or a heads write (a small tmpfs), a truncated Medusa file, a read-only
``MLX_MTP_HOME``, and the training commands' checks of their output and data
before they work. A fault is one line (``error: ...``, exit 2 in the CLI, run
in this process) and leaves nothing half-written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest
from conftest import run_cli
from test_clp_converters import _loaded, _medusa_repo
from test_confadapt_checkpoint import make_checkpoint, tokenizer_dirs  # noqa: F401 (fixture)
from test_gguf import write_tiny_gguf
from tiny_models import make_tiny_model

from mlx_mtp.artifacts import atomic_folder, atomic_write, check_writable, find_artifact
from mlx_mtp.clp_format import CLPHeads, base_config, load_heads, save_heads
from mlx_mtp.errors import InvalidArgumentError, MTPError
from mlx_mtp.fingerprint import model_fingerprint


# ------------------------------------------------------------------ helpers
def _mount(folder: Path, options: str) -> None:
    """Mount a tmpfs on ``folder`` or skip (needs root and mount rights)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
        capture_output=True,
        text=True,
    )
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")


@pytest.fixture()
def full_disk(tmp_path):
    """A 64 KiB tmpfs: room for a few small files, not for a model or heads."""
    d = tmp_path / "small-disk"
    d.mkdir()
    _mount(d, "size=64k")
    yield d
    subprocess.run(["umount", str(d)], check=True)


@pytest.fixture()
def read_only(tmp_path):
    """An empty folder nothing can be written in: a read-only tmpfs as root
    (root ignores permission bits), mode 0555 otherwise."""
    d = tmp_path / "read-only"
    d.mkdir()
    if os.geteuid() == 0:
        _mount(d, "ro,size=64k")
    else:
        d.chmod(0o555)
    try:
        (d / "probe").write_text("x")
        pytest.skip("the folder is still writable here")
    except OSError:
        pass
    yield d
    if os.geteuid() == 0:
        subprocess.run(["umount", str(d)], check=True)
    else:
        d.chmod(0o755)


def _one_error_line(rc: int, stderr: str, *words: str) -> str:
    """The CLI ended with exit 2 and exactly one ``error:`` line containing
    ``words`` (progress bars may also be on stderr), and no traceback."""
    assert rc == 2, stderr
    assert "Traceback" not in stderr, stderr
    errors = [ln for ln in stderr.replace("\r", "\n").splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, stderr
    for w in words:
        assert w in errors[0], errors[0]
    return errors[0]


def _heads(model, gate_hidden=None) -> CLPHeads:
    cfg = base_config(model, "tiny", 2, "resblock", bottleneck=8, gate_hidden=gate_hidden)
    heads = CLPHeads(cfg)
    mx.eval(heads.parameters())
    return heads


# ------------------------------------------------------------------ the store
def test_find_artifact_order_and_matching(tmp_path):
    """First root first, entries by name; other models, corrupt metadata and
    entries refused by ``accept`` are skipped; a fingerprint string matches
    exactly."""
    model, other = make_tiny_model("llama", seed=0), make_tiny_model("llama", seed=1)
    fp = model_fingerprint(model)
    user, shipped = tmp_path / "user", tmp_path / "shipped"

    def put(root, name, **meta):
        (root / name).mkdir(parents=True)
        (root / name / "config.json").write_text(json.dumps(meta))

    put(user, "a-other", fingerprint=model_fingerprint(other))
    put(user, "b-mine", fingerprint=fp, kind="x")
    put(user, "c-mine", fingerprint=fp)
    put(shipped, "a-mine", fingerprint=fp)
    (user / "0-corrupt").mkdir()
    (user / "0-corrupt" / "config.json").write_text("{not json")
    roots = [user, tmp_path / "missing", shipped]
    assert find_artifact(model, roots, "*/config.json") == user / "b-mine"
    assert find_artifact(fp, roots, "*/config.json") == user / "b-mine"
    no_x = find_artifact(model, roots, "*/config.json", accept=lambda p, m: "kind" not in m)
    assert no_x == user / "c-mine"
    assert find_artifact(model, [shipped, user], "*/config.json") == shipped / "a-mine"
    assert find_artifact(make_tiny_model("llama", seed=2), roots, "*/config.json") is None


def test_atomic_writes_keep_what_was_there(tmp_path):
    f = tmp_path / "f.json"
    f.write_text("old")

    def fail(p):
        p.write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(f, fail)
    assert f.read_text() == "old" and sorted(tmp_path.iterdir()) == [f]
    d = tmp_path / "d"
    with atomic_folder(d) as tmp:
        (tmp / "x").write_text("1")
    with pytest.raises(ValueError), atomic_folder(d) as tmp:
        (tmp / "x").write_text("2")
        raise ValueError
    assert (d / "x").read_text() == "1" and sorted(tmp_path.iterdir()) == [d, f]


def test_mlx_write_failures_are_oserrors(tmp_path, monkeypatch):
    """MLX's RuntimeError for a failed write becomes an OSError naming the
    file; its other errors pass unchanged."""

    def raising(message):
        def save(*a, **k):
            raise RuntimeError(message)

        return save

    target = tmp_path / "w.safetensors"
    monkeypatch.setattr(mx, "save_safetensors", raising("[write] Unable to write 8 bytes to file."))
    with pytest.raises(OSError, match=f"cannot write {target}.*disk full"):
        atomic_write(target, lambda p: mx.save_safetensors(str(p), {}))
    monkeypatch.setattr(mx, "save_safetensors", raising("[load_safetensors] corrupt source"))
    with pytest.raises(RuntimeError, match="corrupt source"):
        atomic_write(target, lambda p: mx.save_safetensors(str(p), {}))
    assert list(tmp_path.iterdir()) == []


def test_check_writable(tmp_path, read_only):
    check_writable(tmp_path / "new" / "deeper")  # made later: fine, nothing made now
    assert sorted(p.name for p in tmp_path.iterdir()) == ["read-only"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(InvalidArgumentError, match="--out: .* is a file"):
        check_writable(tmp_path / "file" / "sub")
    with pytest.raises(InvalidArgumentError, match="MLX_MTP_HOME"):
        check_writable(read_only / "masks", "MLX_MTP_HOME")


# ------------------------------------------------------------------ full disk
def test_full_disk_during_a_gguf_import(tmp_path, full_disk, capsys):
    from mlx_mtp.converters.gguf import convert_gguf

    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src, {})
    with pytest.raises(OSError, match="cannot write") as e:
        convert_gguf(src, full_disk / "model")
    assert "\n" not in str(e.value)
    assert list(full_disk.iterdir()) == []
    rc, err = run_cli(["convert", "gguf", str(src), str(full_disk / "model")], capsys)
    _one_error_line(rc, err, "cannot write", str(full_disk / "model"))
    assert list(full_disk.iterdir()) == []


def test_full_disk_during_a_checkpoint_conversion(tmp_path, full_disk, tokenizer_dirs):  # noqa: F811
    from mlx_mtp.converters.confadapt_import import convert_mtp_checkpoint

    src = make_checkpoint(tmp_path / "src", "qwen3", tokenizer_dirs)
    with pytest.raises(OSError, match="cannot write|No space") as e:
        convert_mtp_checkpoint(src, full_disk / "out")
    assert not isinstance(e.value, MTPError)  # not reported as a corrupt checkpoint
    assert list(full_disk.iterdir()) == []


def test_full_disk_keeps_the_heads_there(full_disk):
    """Heads that fit stay loadable when larger ones (a ~1M-value gate) fail
    to replace them."""
    model = make_tiny_model("llama", seed=0)
    save_heads(_heads(model), full_disk / "heads")
    with pytest.raises(OSError, match="cannot write"):
        save_heads(_heads(model, gate_hidden=1024), full_disk / "heads")
    assert [p.name for p in full_disk.iterdir()] == ["heads"]
    assert load_heads(full_disk / "heads", model).k == 2


# ------------------------------------------------------------------ truncated
@pytest.mark.parametrize("keep", [4, 100, 0.5])
def test_truncated_medusa_file_is_one_clear_error(tmp_path, keep):
    from mlx_mtp.converters.clp_import import MEDUSA_FILE, HeadConversionError, convert

    repo, _ = _medusa_repo(tmp_path)
    f = repo / MEDUSA_FILE
    data = f.read_bytes()
    f.write_bytes(data[: int(keep * len(data)) if keep < 1 else keep])
    with pytest.raises(HeadConversionError, match="truncated or corrupt") as e:
        convert(repo, tmp_path / "out", _loaded(make_tiny_model("llama", seed=0)))
    assert str(f) in str(e.value) and "\n" not in str(e.value)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".out", "out"))]


def test_truncated_medusa_file_in_the_cli(tmp_path, capsys):
    from mlx_mtp.converters.clp_import import MEDUSA_FILE

    repo, _ = _medusa_repo(tmp_path)
    (repo / MEDUSA_FILE).write_bytes((repo / MEDUSA_FILE).read_bytes()[:200])
    rc, err = run_cli(["convert", "clp-heads", str(repo), str(tmp_path / "out")], capsys)
    _one_error_line(rc, err, MEDUSA_FILE, "truncated")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ read-only home
_TIMED_RUNS = """
import mlx_mtp
from mlx_mtp import costs
from mlx_mtp.engine import Engine
from tiny_models import make_tiny_model

timed = []
measure = costs.measure_cost_curve
costs.measure_cost_curve = lambda *a, **k: timed.append(1) or measure(*a, **k)
model = make_tiny_model("llama", seed=0)
for _ in range(3):  # three engines and generations of one model in one process
    live = costs.device_curves(Engine(model))
    live.observe(2, 0.01, 0)
    live.save()
print(len(timed))
"""


def test_read_only_home_is_one_line_and_timed_once(read_only):
    """The cost curve cannot be cached: one plain line on stderr (no warning
    with a source line), naming the folder and MLX_MTP_HOME, and the curve is
    timed once in the process however many engines and generations use it."""
    env = {k: v for k, v in os.environ.items() if k != "MLX_MTP_COST_CURVE"}
    r = subprocess.run(
        [sys.executable, "-c", _TIMED_RUNS],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "MLX_MTP_HOME": str(read_only)},
        cwd=Path(__file__).parent,  # tiny_models.py
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1"]
    lines = [ln for ln in r.stderr.replace("\r", "\n").splitlines() if "cost curve" in ln]
    assert len(lines) == 1, r.stderr
    assert str(read_only / "cost_curves") in lines[0] and "MLX_MTP_HOME" in lines[0]
    assert "Warning" not in r.stderr and "Traceback" not in r.stderr, r.stderr


# ------------------------------------------------------------------ training checks
@pytest.fixture()
def prompts(tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"Question {i}?"}) + "\n" for i in range(4)))
    return f


def _no_loading(monkeypatch, *modules):
    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the output was checked")

    for m in modules:
        monkeypatch.setattr(m, "load_model", refuse)


def test_train_masks_checks_out_before_it_loads_or_trains(
    tmp_path, prompts, read_only, monkeypatch
):
    import mlx_mtp.commands.masks as masks

    _no_loading(monkeypatch, masks)
    (tmp_path / "file").write_text("x")
    for out in (tmp_path / "file" / "m.safetensors", read_only / "m.safetensors", read_only):
        with pytest.raises(InvalidArgumentError, match="--out"):
            masks.run_train_masks("smollm2-135m", [prompts], out=out)
    monkeypatch.setenv("MLX_MTP_HOME", str(read_only))
    with pytest.raises(InvalidArgumentError, match="MLX_MTP_HOME"):
        masks.run_train_masks("smollm2-135m", [prompts])  # the default: the cache's masks/


def test_train_masks_cli_unwritable_out(tmp_path, prompts, capsys):
    (tmp_path / "file").write_text("x")
    args = ["train", "masks", "--data", str(prompts), "--out", str(tmp_path / "file" / "m")]
    _one_error_line(*run_cli(args, capsys), "--out", "is a file")


def test_train_mtp_checks_out_before_it_loads(tmp_path, prompts, monkeypatch):
    import mlx_mtp.commands.confadapt as confadapt

    _no_loading(monkeypatch, confadapt)
    (tmp_path / "file").write_text("x")
    with pytest.raises(InvalidArgumentError, match="--out"):
        confadapt.run_train_mtp("smollm2-135m", str(prompts), out=tmp_path / "file" / "adapter")


def test_train_clp_writes_nothing_when_its_arguments_fail(tmp_path, prompts, read_only):
    from mlx_mtp.training.clp import TrainConfig, train_clp

    loaded = SimpleNamespace(model=make_tiny_model("llama", seed=0), tokenizer=None, name="tiny")
    missing = TrainConfig(data=[str(prompts), str(tmp_path / "missing.jsonl")])
    with pytest.raises(InvalidArgumentError, match="missing.jsonl"):
        train_clp(loaded, tmp_path / "heads" / "h", missing, log=lambda s: None)
    with pytest.raises(InvalidArgumentError, match="--out"):
        train_clp(loaded, read_only / "h", TrainConfig(data=[str(prompts)]), log=lambda s: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl", "read-only"]


def test_train_clp_cli_missing_data_leaves_nothing(tmp_path, capsys):
    out = tmp_path / "heads" / "h"
    args = ["train", "clp", "--data", str(tmp_path / "missing.jsonl"), "--out", str(out)]
    _one_error_line(*run_cli(args, capsys), "missing.jsonl")
    assert list(tmp_path.iterdir()) == []
