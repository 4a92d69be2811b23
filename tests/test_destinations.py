"""Commands that write refuse an existing destination they did not make.

``train masks/clp/mtp``, ``convert gguf/clp-heads/mtp-checkpoint`` and
``bench`` with an existing ``--out``/DST exit 2 with one ``error:`` line that
names the path and --overwrite, before anything is loaded, and leave it byte
for byte as it was; ``--overwrite`` (or a ``--resume`` of the run that wrote
it) replaces it. The refusals cost nothing (no model is loaded); the
``--overwrite`` runs train or benchmark the embedded model on two prompts for
a step or two.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli
from test_exit_codes import _embedded_gguf

from mlx_mtp.artifacts import check_destination
from mlx_mtp.errors import InvalidArgumentError

#: tiny settings of each training command (two prompts, a step or two)
CLP = ["train", "clp", "--data", "p.jsonl", "--limit", "2", "--max-new-tokens", "4"]
CLP += ["--epochs", "1"]
MTP = ["train", "mtp", "--data", "p.jsonl", "--steps", "1", "--gen-tokens", "4", "--no-check"]
MASKS = ["train", "masks", "--data", "p.jsonl", "--steps", "1", "--max-tokens", "4"]
MASKS += ["--limit", "2", "--anchors", "2"]
BENCH = ["bench", "--methods", "ntp", "--categories", "qa", "--limit", "1", "-n", "2"]
BENCH += ["--no-plots"]


def contents(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None: a folder)."""
    return {
        str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A working folder with two prompts (``p.jsonl``), a folder of the
    user's (``mine/keep.txt``) and a file of the user's (``keep.txt``); no
    model may load."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text(
        '{"prompt": "Say hi."}\n{"prompt": "Count to three."}\n', encoding="utf-8"
    )
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_bytes(b"precious\n\x00\xff")
    (tmp_path / "keep.txt").write_bytes(b"precious file\n")
    return tmp_path


def no_loading(monkeypatch) -> None:
    """Make every model load fail the test."""
    import mlx_mtp.bench.runner as runner
    import mlx_mtp.commands.clp as clp
    import mlx_mtp.commands.confadapt as confadapt
    import mlx_mtp.commands.masks as masks

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the destination was checked")

    for module in (runner, clp, confadapt, masks):
        monkeypatch.setattr(module, "load_model", refuse)


#: (argv, the destination named in the error line)
REFUSED: list[tuple[list[str], str]] = [
    ([*CLP, "--out", "mine"], "mine"),
    ([*CLP, "--out", "keep.txt"], "keep.txt"),
    ([*CLP, "--out", "mine", "--resume"], "mine"),  # no run of its own to resume there
    ([*MTP, "--out", "mine"], "mine"),  # --resume is its default
    ([*MTP, "--out", "keep.txt"], "keep.txt"),
    ([*MASKS, "--out", "mine/keep.safetensors"], "mine/keep.safetensors"),
    ([*MASKS, "--out", "mine/other.json"], "mine/other.json"),  # the sidecar exists
    ([*BENCH, "--out", "mine"], "mine"),
    ([*BENCH, "--out", "bench"], "bench"),  # a results.json it did not write
    (["convert", "gguf", str(_embedded_gguf()), "mine"], "mine"),
    (["convert", "clp-heads", "no-such-heads", "mine"], "mine"),
    (["convert", "mtp-checkpoint", "no-such-checkpoint", "keep.txt"], "keep.txt"),
]


@pytest.mark.parametrize(
    "argv,dest", REFUSED, ids=lambda v: " ".join(v) if isinstance(v, list) else v
)
def test_an_existing_destination_is_refused_and_left_as_it_was(
    argv, dest, work, capsys, monkeypatch
):
    (work / "mine" / "keep.safetensors").write_bytes(b"not mine to replace")
    (work / "mine" / "other.json").write_text("{}")
    (work / "bench").mkdir()
    (work / "bench" / "results.json").write_text('{"someone": "else"}')
    no_loading(monkeypatch)
    before = contents(work)
    code, err = run_cli(argv, capsys)
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert f" {dest} already exists" in err and "--overwrite" in err, err
    assert "choose another" in err, err
    assert contents(work) == before


def test_check_destination_frees_what_there_is_nothing_to_lose_in(tmp_path):
    check_destination(tmp_path / "new")  # not there
    (tmp_path / "empty").mkdir()
    check_destination(tmp_path / "empty")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(InvalidArgumentError, match="full already exists"):
        check_destination(tmp_path / "full")
    check_destination(tmp_path / "full", overwrite=True)
    check_destination(tmp_path / "full", ours=True)


def test_a_resume_of_the_run_that_wrote_out_is_not_refused(work, capsys, monkeypatch):
    """``train clp --resume`` and ``train mtp`` (resume is its default) go on
    where the run's checkpoint lies beside ``--out``: they reach the model load."""
    no_loading(monkeypatch)
    (work / ".mine.train").mkdir()  # train clp's checkpoints
    with pytest.raises(AssertionError, match="a model was loaded"):
        run_cli([*CLP, "--out", "mine", "--resume"], capsys)
    (work / ".mine.ckpt").mkdir()  # train mtp's
    (work / ".mine.ckpt" / "state.json").write_text("{}")
    with pytest.raises(AssertionError, match="a model was loaded"):
        run_cli([*MTP, "--out", "mine"], capsys)
    code, err = run_cli([*MTP, "--out", "mine", "--no-resume"], capsys)
    assert code == 2 and "--overwrite" in err, err


def test_train_clp_overwrite_replaces_out(work, capsys):
    code, err = run_cli([*CLP, "--out", "mine", "--overwrite"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in (work / "mine").iterdir()) == ["config.json", "heads.safetensors"]


def test_train_mtp_overwrite_replaces_out(work, capsys):
    code, err = run_cli([*MTP, "--out", "mine", "--overwrite"], capsys)
    assert code == 0, err
    assert not (work / "mine" / "keep.txt").exists()
    assert (work / "mine" / "mtp_adapter.json").is_file()


def test_train_masks_overwrite_replaces_out(work, capsys):
    (work / "m.safetensors").write_bytes(b"old")
    code, err = run_cli([*MASKS, "--out", "m.safetensors", "--overwrite"], capsys)
    assert code == 0, err
    assert (work / "m.safetensors").read_bytes() != b"old"
    assert json.loads((work / "m.json").read_text())["format"] == "mlx-mtp-learned-masks"


def test_bench_overwrite_writes_into_a_folder_of_other_files(work, capsys):
    (work / "mine" / "results.json").write_text('{"someone": "else"}')
    code, err = run_cli([*BENCH, "--out", "mine", "--overwrite"], capsys)
    assert code == 0, err
    assert json.loads((work / "mine" / "results.json").read_text()) != {"someone": "else"}
    assert (work / "mine" / "keep.txt").read_bytes() == b"precious\n\x00\xff"
    # its own folder now: a rerun resumes without --overwrite
    code, err = run_cli([*BENCH, "--out", "mine"], capsys)
    assert code == 0, err
