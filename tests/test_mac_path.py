"""What a new Mac user meets first (issue 36), checked on this machine:
``scripts/setup.sh`` refusing a Python older than 3.10 without leaving
anything behind, model downloads with mlx-lm's file patterns and a cached
snapshot used without the network, the wired memory limit entered before the
prefill, and the native MTP layer in the backbone's compute dtype.

The set-up tests run a copy of ``scripts/setup.sh`` in a temporary folder
with fake interpreters (shell scripts that answer the version question and
imitate ``-m venv``), so the real ``.venv`` is never touched. The download
tests use no network: each runs ``resolve_model`` in a subprocess (the hub
library reads its settings when imported) with ``HF_HOME`` in a temporary
folder laid out like the hub cache and ``HF_ENDPOINT`` at a local socket that
counts the connections made to it, or at a closed port, or with
``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import decode
from mlx.utils import tree_flatten
from tiny_models import make_tiny_model, write_tiny_hybrid

from mlx_mtp import decoding
from mlx_mtp.context import Context
from mlx_mtp.engine import Engine
from mlx_mtp.methods.ntp import NTP

REPO_ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------- setup.sh
def _fake_python(path: Path, version: str, log: Path, venv_fails: bool = False) -> None:
    """A stand-in interpreter at ``path`` that reports ``version`` to any
    ``-c`` and, for ``-m venv DIR``, makes DIR/bin/python (a fake of the same
    version), or with ``venv_fails`` makes DIR half-way and fails as a
    Python without ensurepip does; every call is appended to ``log``."""
    venv = (
        'mkdir -p "$3/lib"; echo "Error: ensurepip is not available" >&2; exit 1'
        if venv_fails
        else 'mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; chmod +x "$3/bin/python"; exit 0'
    )
    path.write_text(
        f"""#!/bin/sh
echo "$0 $*" >> "{log}"
if [ "$1" = "-c" ]; then echo "{version}"; exit 0; fi
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then {venv}; fi
exit 0
"""
    )
    path.chmod(0o755)


def _setup_copy(tmp_path: Path, pythons: dict[str, str]) -> tuple[Path, Path, dict[str, str]]:
    """A copy of scripts/setup.sh in ``tmp_path/repo``, a bin folder holding
    fake interpreters (name -> version) and the tools the script calls, and an
    environment whose PATH is that folder only (no apt-get, no real Python)."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(REPO_ROOT / "scripts" / "setup.sh", repo / "scripts" / "setup.sh")
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    log = tmp_path / "calls.log"
    for tool in ("uname", "dirname", "id", "ls", "rm", "mkdir", "cp", "chmod", "sh"):
        found = shutil.which(tool)
        assert found, tool
        (fake_bin / tool).symlink_to(found)
    for name, version in pythons.items():
        _fake_python(fake_bin / name, version, log)
    return repo, log, {"PATH": str(fake_bin), "HOME": str(tmp_path)}


def _run_setup(repo: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    bash = shutil.which("bash")
    assert bash
    return subprocess.run(
        [bash, str(repo / "scripts" / "setup.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=repo,
    )


def test_setup_refuses_a_python_older_than_3_10_and_makes_nothing(tmp_path):
    repo, log, env = _setup_copy(tmp_path, {"python3": "3.9.6"})
    old = tmp_path / "bin" / "python3.9"
    _fake_python(old, "3.9.6", log)
    proc = _run_setup(repo, {**env, "PYTHON": str(old)})
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "needs Python >= 3.10" in lines[0] and "3.9.6" in lines[0]
    assert "python.org" in lines[0]  # how to get one
    assert proc.stdout == ""
    assert sorted(p.name for p in repo.iterdir()) == ["scripts"]  # no .venv, nothing else
    assert "venv" not in log.read_text()


def test_setup_searches_for_a_new_enough_python_before_python3(tmp_path):
    """Without PYTHON: python3 (3.9, a stock Mac's) is passed over for
    python3.12, which makes the venv; with none new enough: one line, nothing made."""
    repo, log, env = _setup_copy(tmp_path, {"python3": "3.9.6", "python3.12": "3.12.4"})
    proc = _run_setup(repo, env)
    assert proc.returncode == 0, proc.stderr
    assert "setup: done (.venv ready, 3.12.4)" in proc.stdout
    calls = log.read_text().splitlines()
    venv = [c for c in calls if " -m venv " in c]
    assert len(venv) == 1 and venv[0].split()[0].endswith("/python3.12"), calls
    assert any(c.startswith(".venv/bin/python -m pip install") for c in calls), calls

    repo2, log2, env2 = _setup_copy(tmp_path / "none", {"python3": "3.9.6", "python3.10": "3.8.1"})
    proc = _run_setup(repo2, env2)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "found none on the PATH" in lines[0]
    assert "python3 is 3.9.6" in lines[0] and "python3.10 is 3.8.1" in lines[0]
    assert sorted(p.name for p in repo2.iterdir()) == ["scripts"]
    assert "venv" not in log2.read_text()


def test_setup_refuses_a_venv_made_by_an_old_python_and_keeps_it(tmp_path):
    """A .venv an earlier run made with Python 3.9 is reported, not deleted
    and not built on."""
    repo, log, env = _setup_copy(tmp_path, {"python3.12": "3.12.4"})
    (repo / ".venv" / "bin").mkdir(parents=True)
    _fake_python(repo / ".venv" / "bin" / "python", "3.9.6", log)
    proc = _run_setup(repo, env)
    assert proc.returncode != 0
    assert len(proc.stderr.strip().splitlines()) == 1
    assert ".venv holds Python 3.9.6" in proc.stderr and "rm -rf .venv" in proc.stderr
    assert (repo / ".venv" / "bin" / "python").exists()
    assert "pip" not in log.read_text()


# ------------------------------------------------------------- downloads
REPO = "mlx-community/tiny-test-model"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
RESOLVE = """
import sys
from mlx_mtp.loading import resolve_model
try:
    print(resolve_model(sys.argv[1]))
except Exception as e:
    print(f"{type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(2)
"""


def _hub_cache(hf_home: Path, files: dict[str, bytes]) -> Path:
    """``files`` as the hub cache keeps a snapshot of :data:`REPO` at
    :data:`COMMIT` (refs/main, blobs named by hash, snapshot links to them);
    returns the snapshot folder."""
    root = hf_home / "hub" / ("models--" + REPO.replace("/", "--"))
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    (root / "blobs").mkdir()
    snap = root / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    for name, data in files.items():
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / name).parent.mkdir(parents=True, exist_ok=True)
        (snap / name).symlink_to(os.path.relpath(blob, (snap / name).parent))
    return snap


@contextlib.contextmanager
def _counting_hub():
    """A local endpoint that answers every HTTP request with 503 (the hub is
    down) and counts the connections: yields (url, counter list)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.2)
    hits: list[int] = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            hits.append(1)
            with conn:
                conn.settimeout(2)
                with contextlib.suppress(OSError):
                    conn.recv(65536)
                    conn.sendall(
                        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
                        b"Connection: close\r\n\r\n"
                    )

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}", hits
    finally:
        stop.set()
        t.join(5)
        srv.close()


def _resolve(hf_home: Path, endpoint: str | None = None, offline: bool = False):
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HF_", "HUGGINGFACE_")) and k not in ("http_proxy", "https_proxy")
    }
    env.update(HF_HOME=str(hf_home), HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_ETAG_TIMEOUT="3")
    env["HF_HUB_DOWNLOAD_TIMEOUT"] = "3"
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run(
        [sys.executable, "-c", RESOLVE, REPO], capture_output=True, text=True, timeout=120, env=env
    )


#: an mlx-lm-made snapshot: sharded weights, a tiktoken tokenizer, a jsonl file
WHOLE = {
    "config.json": b'{"model_type": "llama"}',
    "model.safetensors.index.json": json.dumps(
        {
            "weight_map": {
                "a": "model-00001-of-00002.safetensors",
                "b": "model-00002-of-00002.safetensors",
            }
        }
    ).encode(),
    "model-00001-of-00002.safetensors": b"shard one",
    "model-00002-of-00002.safetensors": b"shard two",
    "tiktoken.model": b"tokens",
    "chat_template.jsonl": b"{}",
}


def test_download_patterns_are_mlx_lms():
    """The files fetched are mlx-lm's: sharded ``model*.safetensors``, not a
    repo's other safetensors (``consolidated.safetensors``: a second copy of
    the weights), and the tiktoken / jsonl files mlx-lm needs."""
    import mlx_lm.utils

    from mlx_mtp.loading import DOWNLOAD_PATTERNS

    if hasattr(mlx_lm.utils, "DEFAULT_ALLOW_PATTERNS"):
        assert DOWNLOAD_PATTERNS == list(mlx_lm.utils.DEFAULT_ALLOW_PATTERNS)

    def fetched(name):
        return any(fnmatch.fnmatch(name, p) for p in DOWNLOAD_PATTERNS)

    assert all(fetched(n) for n in WHOLE)
    assert fetched("chat_template.jinja") and fetched("tokenizer.model")
    assert not fetched("consolidated.safetensors") and not fetched("pytorch_model.bin")


def test_a_whole_cached_snapshot_is_used_without_contacting_the_hub(tmp_path):
    snap = _hub_cache(tmp_path / "hf", WHOLE)
    with _counting_hub() as (url, hits):
        proc = _resolve(tmp_path / "hf", endpoint=url)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == snap
    assert hits == []  # no request at all


def test_a_partial_cached_snapshot_goes_to_the_hub_and_fails_in_one_line(tmp_path):
    """One shard missing (an interrupted download): the hub is asked (here it
    answers 503), and the error says what is wrong instead of handing mlx-lm
    a folder without its weights."""
    files = {k: v for k, v in WHOLE.items() if k != "model-00002-of-00002.safetensors"}
    _hub_cache(tmp_path / "hf", files)
    with _counting_hub() as (url, hits):
        proc = _resolve(tmp_path / "hf", endpoint=url)
    assert proc.returncode == 2
    assert len(hits) >= 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ModelNotFoundError: ")
    assert REPO in lines[0] and "lacks config.json, weights or a tokenizer" in lines[0]


@pytest.mark.parametrize("how", ["offline", "closed-port"])
def test_unreachable_hub_and_nothing_cached_is_one_clear_line(tmp_path, how):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    proc = _resolve(tmp_path / "hf", endpoint=closed, offline=how == "offline")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    why = "HF_HUB_OFFLINE is set" if how == "offline" else "no connection"
    assert lines[0].startswith(f"ModelNotFoundError: Cannot reach the Hugging Face hub ({why})")
    assert REPO in lines[0] and str(tmp_path / "hf" / "hub") in lines[0]
    assert "smollm2-135m" in lines[0]


# ------------------------------------------------------------- wired memory
def test_wired_limit_is_entered_before_the_prefill_and_left_after_a_failed_one(monkeypatch):
    """mlx-lm wires the model's memory before the prompt's prefill; so does
    the decoding loop, and it restores the limit when the prefill fails."""
    events: list[str] = []

    @contextlib.contextmanager
    def recording_wired_limit(model, streams=None):
        events.append("wire")
        try:
            yield
        finally:
            events.append("unwire")

    monkeypatch.setattr(decoding, "wired_limit", recording_wired_limit)
    engine = Engine(make_tiny_model("llama"))
    real_sync = engine.sync

    def sync(tokens, *args, **kwargs):
        events.append("prefill")
        return real_sync(tokens, *args, **kwargs)

    engine.sync = sync
    method = NTP()
    method.prepare(Context(engine))
    out, _ = decode(engine, method, [1, 2, 3, 4, 5], 3)
    assert len(out) == 3
    assert events == ["wire", "prefill", "unwire"]

    def failing_sync(tokens, *args, **kwargs):
        events.append("prefill")
        raise RuntimeError("prefill failed")

    events.clear()
    engine.sync = failing_sync
    with pytest.raises(RuntimeError, match="prefill failed"):
        decode(engine, method, [1, 2, 3], 2)
    assert events == ["wire", "prefill", "unwire"]


# ------------------------------------------------------- native MTP dtype
def _quantize_backbone(model: nn.Module, dtype: mx.Dtype) -> None:
    """``model`` in ``dtype`` with every layer whose input width allows it
    quantized to 4 bits (group 32), as an mlx-community checkpoint."""
    model.set_dtype(dtype)
    nn.quantize(
        model,
        group_size=32,
        bits=4,
        class_predicate=lambda p, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0,
    )
    mx.eval(model.parameters())


def test_native_mtp_layer_computes_in_the_quantized_backbones_dtype(tmp_path):
    """On a bfloat16 4-bit backbone the MTP layer is bfloat16 (not a float32
    copy: half the memory, no upcast of every draft) and agrees with the
    float32 layer to bfloat16 precision; a float32 backbone keeps float32."""
    from mlx_lm.utils import load_model

    from mlx_mtp.native_mtp import compute_dtype, load_native_mtp

    config = write_tiny_hybrid(tmp_path, "qwen3_5", seed=4)
    model32, _ = load_model(tmp_path)
    layer32 = load_native_mtp(tmp_path, model32, config)
    assert compute_dtype(model32) == mx.float32
    assert layer32.fc.weight.dtype == mx.float32

    qmodel, _ = load_model(tmp_path)
    _quantize_backbone(qmodel, mx.bfloat16)
    assert not mx.issubdtype(qmodel.model.embed_tokens.weight.dtype, mx.floating)
    assert compute_dtype(qmodel) == mx.bfloat16
    layer = load_native_mtp(tmp_path, qmodel, config)
    dtypes = {v.dtype for _, v in tree_flatten(layer.parameters())}
    assert dtypes == {mx.bfloat16}, dtypes

    mx.random.seed(0)
    h = mx.random.normal((1, 3, 64))
    e = Engine(model32).embed_tokens([4, 5, 6])[None]
    got = layer(h.astype(mx.bfloat16), e.astype(mx.bfloat16), layer.make_cache())
    ref = layer32(h, e, layer32.make_cache())
    assert got.dtype == mx.bfloat16
    err = float(mx.max(mx.abs(got.astype(mx.float32) - ref))) / float(mx.max(mx.abs(ref)))
    assert err < 3e-2, err


def test_setup_removes_a_venv_that_failed_half_way(tmp_path):
    repo, log, env = _setup_copy(tmp_path, {"python3": "3.11.2"})
    _fake_python(tmp_path / "bin" / "python3", "3.11.2", log, venv_fails=True)
    proc = _run_setup(repo, env)
    assert proc.returncode != 0
    assert "ensurepip is not available" in proc.stderr
    assert "-m venv .venv failed" in proc.stderr.strip().splitlines()[-1]
    assert not (repo / ".venv").exists()
