"""``mlx-mtp doctor`` (issue 36): the report's lines, a self-check that passes
on a correct forward pass and fails on a broken one, and the rollback check
of a hybrid recurrent model, on tiny random models (float32); the command's
exit status on a tiny model folder; the command on the embedded model with a
short cost curve (``-m slow``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tiny_models import make_tiny_model, tiny_config, write_tiny_hybrid
from typer.testing import CliRunner

from mlx_mtp import cli
from mlx_mtp.commands.doctor import CHECK_SIZES, PIPELINE_METHODS, pipeline_check, run_doctor
from mlx_mtp.loading import LoadedModel

LABELS = (
    "platform",
    "mlx",
    "blas",
    "tf32",
    "memory",
    "model",
    "cost curve",
    "self-check",
    "pipelined",
    "decoded",
)


def _doctor(lm, **kwargs):
    lines: list[str] = []
    ok = run_doctor(lm, echo=lines.append, **kwargs)
    return ok, lines


def _tiny(family="llama"):
    model = make_tiny_model(family)
    return LoadedModel(model, None, Path("tiny"), tiny_config(family), f"tiny-{family}", "float32")


def _checks(lines, name):
    """{n: (rel err, status)} of the self-check lines of kind ``name``."""
    pat = re.compile(rf"^  {name}\s+n=(\d+).*rel err (\S+)\s+argmax \d+/\d+\s+(ok|FAILED)$")
    return {int(m[1]): (float(m[2]), m[3]) for m in map(pat.match, lines) if m}


def test_doctor_reports_the_machine_the_curve_and_a_passing_self_check():
    ok, lines = _doctor(_tiny(), max_size=10, repeats=1)
    assert ok
    for label in LABELS:
        assert any(line.startswith(label) for line in lines), label
    assert any(
        "tf32" in line and "MLX_ENABLE_TF32=0: float32 matmuls in full float32" in line
        for line in lines
    )  # conftest
    # the curve: every size 1..10, 8 a line
    assert [line.split()[1] for line in lines if line.startswith("  n ")] == ["1-8", "9-10"]
    check = next(line for line in lines if line.startswith("self-check"))
    assert "tree forward vs one-token decoding, float32, TF32 off: rel err <= 1e-04" in check
    tree = _checks(lines, "tree")
    assert sorted(tree) == sorted(CHECK_SIZES)
    assert all(status == "ok" and err < 1e-5 for err, status in tree.values()), tree
    total = len(CHECK_SIZES) + 3 + len(PIPELINE_METHODS)  # tree, pipelined passes, decoded
    assert lines[-1].startswith("result") and f"all {total} checks passed" in lines[-1]


def test_doctor_saves_the_curve_auto_plans_with():
    """A curve measured to every size ``auto`` plans with is saved as the
    device's curve for the model (loaded as ``auto`` loads it); a shorter one
    is not, and says so."""
    from mlx_mtp.costs import CURVE_SIZES, curve_key, curve_path, load_curve
    from mlx_mtp.engine import Engine

    lm = _tiny()
    path = curve_path(curve_key(Engine(lm.model)))
    if path.exists():
        path.unlink()
    _, lines = _doctor(lm, max_size=10, repeats=1, pipeline_tokens=0)
    assert any(line.split()[:2] == ["saved", "no:"] and "--max-size 10" in line for line in lines)
    assert not path.exists()
    top = max(CURVE_SIZES)
    _, lines = _doctor(lm, max_size=top, repeats=1, pipeline_tokens=0)
    assert any(line.split()[:2] == ["saved", str(path)] for line in lines), lines
    curves = load_curve(curve_key(Engine(lm.model)))
    assert curves is not None and list(curves.curves[0].sizes) == list(range(1, top + 1))


def test_doctor_self_check_fails_on_a_wrong_tree_position(monkeypatch):
    """RoPE one position off in the tree pass (as a broken per-row RoPE kernel
    would give): every size fails and the report says so."""
    from mlx_mtp.cache_view import TreeCacheView

    monkeypatch.setattr(TreeCacheView, "offset", property(lambda self: self._positions + 1))
    ok, lines = _doctor(_tiny(), max_size=2, repeats=1)
    assert not ok
    tree = _checks(lines, "tree")
    assert sorted(tree) == sorted(CHECK_SIZES)
    assert all(status == "FAILED" and err > 1e-3 for err, status in tree.values()), tree
    # every tree pass, and the tree pass the pipelined one is compared with
    total = len(CHECK_SIZES) + 3 + len(PIPELINE_METHODS)
    assert f"{len(CHECK_SIZES) + 1} of {total} checks FAILED" in lines[-1]


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_doctor_checks_chain_and_rollback_on_a_hybrid_recurrent_model(tmp_path, family):
    """qwen3_5 takes input embeddings (the chain runs through forward_tree),
    qwen3_next does not (forward_chain); both keep half of a chain pass and
    decode on."""
    from mlx_lm.utils import load_model

    write_tiny_hybrid(tmp_path, family, seed=1)
    model, config = load_model(tmp_path)
    ok, lines = _doctor(LoadedModel(model, None, tmp_path, config, family, "float32"), max_size=3)
    assert ok, "\n".join(lines)
    assert any("recurrent layers (rollback check below)" in line for line in lines)
    chain, rollback = _checks(lines, "chain"), _checks(lines, "rollback")
    assert sorted(chain) == sorted(rollback) == sorted(CHECK_SIZES)
    assert all(s == "ok" and e < 1e-5 for e, s in [*chain.values(), *rollback.values()])


def test_doctor_checks_the_chain_forward_of_a_model_without_tree_support():
    """GPT-2 places learned positions by ``cache.offset`` (chain methods only,
    mlx_mtp.families): the report says so and checks the causal chain forward."""
    from tiny_models import family_config

    model = make_tiny_model("gpt2", seed=1)
    lm = LoadedModel(model, None, Path("tiny"), family_config("gpt2"), "tiny-gpt2", "float32")
    ok, lines = _doctor(lm, max_size=2, repeats=1, sizes=(1, 5, 9))
    assert ok, "\n".join(lines)
    assert any("'gpt2' has no draft-tree forward here" in line for line in lines)
    chain = _checks(lines, "chain")
    assert sorted(chain) == [1, 5, 9] and not _checks(lines, "tree")
    assert all(s == "ok" and e < 1e-5 for e, s in chain.values())


def _tiny_folder(dest: Path) -> Path:
    """A tiny llama saved as a model folder with the embedded model's
    tokenizer files (what ``--model FOLDER`` loads)."""
    import json
    import shutil

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_mtp.loading import resolve_model

    dest.mkdir()
    model = make_tiny_model("llama", vocab_size=49152)
    mx.save_safetensors(str(dest / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (dest / "config.json").write_text(json.dumps(tiny_config("llama", vocab_size=49152)))
    for f in resolve_model("smollm2-135m").iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.suffix == ".jinja":
            shutil.copy(f, dest / f.name)
    return dest


def test_doctor_command_exit_status(tmp_path, monkeypatch):
    """``mlx-mtp doctor --model FOLDER``: the report on stdout and exit status
    0; with a failing self-check (RoPE one position off) exit status 1."""
    from mlx_mtp.cache_view import TreeCacheView

    folder = str(_tiny_folder(tmp_path / "tiny"))
    args = ["doctor", "--model", folder, "--max-size", "3", "--repeats", "1"]
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.stdout + str(result.exception)
    lines = result.stdout.splitlines()
    # the tree checks, the pipelined passes of the tiny model (3) and the
    # pipelined decoding of each method
    total = len(CHECK_SIZES) + 3 + len(PIPELINE_METHODS)
    assert lines[0].startswith("platform") and f"all {total} checks passed" in lines[-1]
    assert any(line.startswith("model") and folder in line for line in lines)
    monkeypatch.setattr(TreeCacheView, "offset", property(lambda self: self._positions + 1))
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 1
    # every tree pass, and the tree pass the pipelined one is compared with
    failed = len(CHECK_SIZES) + 1
    assert f"{failed} of {total} checks FAILED" in result.stdout.splitlines()[-1]


@pytest.mark.slow
def test_doctor_command_on_the_embedded_model():
    """The CLI on the embedded model (float32 here): a curve up to 4 slots,
    the self-check at every size (136 one-token passes of SmolLM2: 20-70 s on
    this 2-core machine, hence slow); exit status 0."""
    result = CliRunner().invoke(cli.app, ["doctor", "--max-size", "4", "--repeats", "1"])
    out = result.stdout
    assert result.exit_code == 0, out + str(result.exception)
    assert "smollm2-135m" in out and "llama, 30 layers" in out
    lines = out.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("  n ")] == ["1-4"]
    tree = _checks(lines, "tree")
    assert sorted(tree) == sorted(CHECK_SIZES)
    assert all(status == "ok" for _, status in tree.values()), tree
    assert "all 12 checks passed" in lines[-1]


# ---------------------------------------------------------- pipelined path
def _pipelined(lines):
    """{name: status} of the pipelined-pass lines and {method: (agreement, status)}
    of the decoded ones."""
    passes = re.compile(r"^  (at-tree|at-chain|settled)\s+n=\d+.*rel err (\S+).*\s(ok|FAILED)$")
    decoded = re.compile(r"^  (\w+)\s+\d+ tokens  agreement (\d+)%.*\s(ok|FAILED)$")
    got = {m[1]: (float(m[2]), m[3]) for m in map(passes.match, lines) if m}
    runs = {m[1]: (int(m[2]), m[3]) for m in map(decoded.match, lines) if m}
    return got, runs


def test_doctor_checks_the_pipelined_path():
    """The pipelined passes of a tiny model of the family (built by the
    package, not the tests) match the engine's passes at a known length in
    float32, a settled cache decodes as a fresh one, and pipelined decoding
    of every checked method gives plain decoding's tokens."""
    lines: list[str] = []
    checks = pipeline_check(_tiny("qwen3"), tokens=8, echo=lines.append)
    passes, runs = _pipelined(lines)
    assert sorted(passes) == ["at-chain", "at-tree", "settled"], lines
    assert all(s == "ok" and e < 1e-5 for e, s in passes.values()), passes
    assert runs == {m: (100, "ok") for m in PIPELINE_METHODS}, lines
    assert len(checks) == 3 + len(PIPELINE_METHODS) and all(c.ok for c in checks)
    assert any("identical" in line and line.startswith("decoded") for line in lines)


def test_doctor_pipelined_check_fails_on_a_write_at_the_wrong_row(monkeypatch):
    """Keys and values of a pipelined pass written one row past the lazy
    offset (as a slice_update that read a stale start would): both passes
    fail, and the settled cache (whose root row was never written) too; so
    does the report."""
    import mlx.core as mx

    from mlx_mtp.cache_view import LazyView, reserve

    def shifted(self, keys, values):
        c = self._cache
        reserve(c, self._rows + 1, keys, values)
        c.keys = mx.slice_update(c.keys, keys, self._at + 1, axes=(2,))
        c.values = mx.slice_update(c.values, values, self._at + 1, axes=(2,))
        self.new = (keys, values)
        return c.keys[..., : self._rows, :], c.values[..., : self._rows, :]

    monkeypatch.setattr(LazyView, "update_and_fetch", shifted)
    lines: list[str] = []
    checks = pipeline_check(_tiny(), tokens=8, echo=lines.append)
    passes, runs = _pipelined(lines)
    assert all(s == "FAILED" and e > 1e-3 for e, s in passes.values()), lines
    assert not all(c.ok for c in checks)
    ok, report = _doctor(_tiny(), max_size=2, repeats=1, pipeline_tokens=0)
    assert not ok and "3 of 10 checks FAILED" in report[-1], report[-1]
