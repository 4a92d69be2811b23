"""Bad input gets a one-line error naming the problem (issue 16).

Table-driven: every option of ``generate``/``chat``/``bench`` and every
argument of ``load()``/``generate()`` with its bad values. The CLI cases run
``mlx_mtp.cli.main`` in-process (they fail before any model is loaded); the
cases that need the model (a block complexity too large for memory) run the
real console script in a subprocess under an address-space limit, so that a
regression fails the test instead of taking the machine.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli

from mlx_mtp.errors import (
    InvalidArgumentError,
    ModelNotFoundError,
    MTPError,
    UnknownMethodError,
)

HI = ["-p", "hi"]

#: (argv after the command, text the error must contain); every case must exit
#: 2 with one error line and no traceback, before anything is loaded or written
CLI_CASES: list[tuple[list[str], str]] = [
    ([], "--prompt"),
    ([*HI, "-n", "abc"], "--max-tokens"),
    ([*HI, "-n", "0"], "--max-tokens"),
    ([*HI, "-n", "-5"], "--max-tokens"),
    ([*HI, "--foo", "1"], "--foo"),
    ([*HI, "--opt", "foo"], "--opt"),
    ([*HI, "--opt", "=3"], "--opt"),
    ([*HI, "--opt", "bc=10", "--bc", "10"], "bc"),
    ([*HI, "--temp", "-0.1"], "--temp"),
    ([*HI, "--temp", "nan"], "--temp"),
    ([*HI, "--temp", "inf"], "--temp"),
    ([*HI, "--temp", "hot"], "--temp"),
    ([*HI, "--top-p", "2"], "--top-p"),
    ([*HI, "--top-p", "-1"], "--top-p"),
    ([*HI, "--top-k", "-1"], "--top-k"),
    ([*HI, "--top-k", "2.5"], "--top-k"),
    ([*HI, "--min-p", "1.5"], "--min-p"),
    ([*HI, "--temp", "0.5", "--seed", "-1"], "--seed"),
    ([*HI, "--seed", str(2**64)], "--seed"),
    ([*HI, "--seed", "x"], "--seed"),
    ([*HI, "--max-kv-size", "0"], "--max-kv-size"),
    ([*HI, "--max-kv-size", "-1"], "--max-kv-size"),
    ([*HI, "--max-kv-size", "8"], "--max-kv-size"),
    ([*HI, "--dtype", "float8"], "float8"),
    ([*HI, "--dtype", ""], "dtype"),
    (["-p", "  "], "--prompt"),
    ([*HI, "--model", "~no_such_user_zz/m"], "No such model"),
    ([*HI, "--method", "probe", "--tree", "14", "--bc", "10"], "--bc 10"),
    ([*HI, "--model", "no-such-model"], "no-such-model"),
    ([*HI, "--method", "nope"], "nope"),
    ([*HI, "--method", "ntp", "--bc", "10"], "bc"),
    ([*HI, "--method", "ntp", "--opt", "foo=1"], "foo"),
    ([*HI, "--method", "pld", "--opt", "foo=1"], "foo"),
    ([*HI, "--method", "pld", "--bc", "10"], "bc"),
    ([*HI, "--method", "pld", "--opt", "max_draft=0"], "max_draft"),
    ([*HI, "--method", "pld", "--opt", "window=x"], "window"),
    ([*HI, "--method", "probe", "--opt", "foo=1"], "foo"),
    ([*HI, "--method", "probe", "--bc", "abc"], "bc"),
    ([*HI, "--method", "probe", "--bc", "1"], "bc"),
    ([*HI, "--method", "probe", "--masks", "0"], "masks"),
    ([*HI, "--method", "probe", "--masks", "x"], "--masks"),
    ([*HI, "--method", "probe", "--tree", "0"], "--tree"),
    ([*HI, "--method", "probe", "--opt", "lam=2"], "lam"),
    ([*HI, "--method", "probe", "--opt", "mask_init=zeros"], "mask_init"),
    ([*HI, "--method", "probe", "--bc", "auto", "--opt", "max_bc=1"], "max_bc"),
    ([*HI, "--method", "probe", "--k", "2"], " k"),
    ([*HI, "--method", "hybrid", "--opt", "foo=1"], "foo"),
    ([*HI, "--method", "hybrid", "--tree", "14"], "--tree"),
    ([*HI, "--method", "hybrid", "--opt", "matches=99"], "matches"),
    ([*HI, "--method", "lookahead", "--opt", "foo=1"], "foo"),
    ([*HI, "--method", "lookahead", "--opt", "level=1"], "level"),
    ([*HI, "--method", "lookahead", "--bc", "10"], "bc"),
    ([*HI, "--method", "clp", "--opt", "foo=1"], "foo"),
    ([*HI, "--method", "clp", "--k", "0"], " k"),
    ([*HI, "--method", "clp", "--opt", "mode=fast"], "mode"),
    ([*HI, "--method", "clp", "--tau", "0.5"], "tau"),
    ([*HI, "--method", "confadapt", "--opt", "foo=1"], "foo"),
    ([*HI, "--method", "confadapt", "--tau", "-1"], "tau"),
    ([*HI, "--method", "confadapt", "--tau", "x"], "--tau"),
    ([*HI, "--method", "confadapt", "--k", "100"], " k"),
]

#: options that ``chat`` shares with ``generate``
CHAT_CASES: list[tuple[list[str], str]] = [
    (["-n", "0"], "--max-tokens"),
    (["--top-p", "2"], "--top-p"),
    (["--temp", "-1"], "--temp"),
    (["--seed", "-1"], "--seed"),
    (["--max-kv-size", "0"], "--max-kv-size"),
    (["--method", "pld", "--opt", "foo=1"], "foo"),
    (["--method", "probe", "--opt", "bar"], "--opt"),
    (["--bogus"], "--bogus"),
]

BENCH_CASES: list[tuple[list[str], str]] = [
    (["--limit", "0"], "--limit"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--turns", "3"], "--turns"),
    (["--temp", "-1"], "--temp"),
    (["--seed", "-1"], "--seed"),
    (["--repeats", "0"], "--repeats"),
    (["--mode", "mmlu"], "--mode"),
    (["--methods", "ntp,pld:foo=1"], "foo"),
    (["--methods", "ntp,nope"], "nope"),
    (["--methods", ""], "--methods"),
    (["--temp", "inf"], "--temp"),
    (["--model", "no-such-model-zz"], "no-such-model-zz"),
    (["--dtype", "int8"], "int8"),
]


#: ``serve``: every choice checked, and nothing loaded, before the port is bound
SERVE_CASES: list[tuple[list[str], str]] = [
    (["--log-level", "loud"], "--log-level"),
    (["--port", "0"], "--port"),
    (["--port", "70000"], "--port"),
    (["--host", "no-such-host.invalid"], "does not resolve"),
    (["--queue-size", "0"], "--queue-size"),
    (["--max-methods", "0"], "--max-methods"),
    (["--queue-timeout", "0"], "--queue-timeout"),
    (["--max-bc", "0"], "--max-bc"),
    (["--max-tokens-limit", "0"], "--max-tokens-limit"),
    (["--max-forward-s", "0"], "--max-forward-s"),
    (["--max-forward-s", "inf"], "--max-forward-s"),
    (["--allow-artifacts", "/no/such/folder"], "--allow-artifacts"),
    (["--max-bc", "50", "--method", "probe", "--bc", "60"], "--max-bc"),
    (["--top-k", "-1"], "--top-k"),
    (["--min-p", "2"], "--min-p"),
    (["--seed", "-1"], "--seed"),
    (["--temp", "nan"], "--temp"),
    (["--dtype", "float8"], "float8"),
    (["--method", "nope"], "nope"),
    (["--method", "pld", "--opt", "foo=1"], "foo"),
    (["-n", "0"], "--max-tokens"),
]

#: training and conversion commands (full argv)
OTHER_CASES: list[tuple[list[str], str]] = [
    (["train", "masks", "--data", "p.jsonl", "--slots", "0"], "--slots"),
    (["train", "masks", "--data", "p.jsonl", "--steps", "0"], "--steps"),
    (["train", "masks", "--data", "p.jsonl", "--val-fraction", "2"], "--val-fraction"),
    (["train", "masks", "--data", "p.jsonl", "--lr", "-1"], "--lr"),
    (["train", "clp", "--data", "p.jsonl", "--k", "0"], "--k"),
    (["train", "clp", "--data", "p.jsonl", "--epochs", "0"], "--epochs"),
    (["train", "mtp", "--data", "gsm8k-train", "--steps", "0"], "--steps"),
    (["train", "mtp", "--data", "gsm8k-train", "--rank", "0"], "--rank"),
    (["train", "mtp", "--data", "gsm8k-train", "--forcing", "x"], "forcing"),
    (["train", "clp", "--data", "p.jsonl", "--seed", str(2**70)], "--seed"),
    (["convert", "mtp-checkpoint", "no-such-dir", "out", "--quantize", "3"], "--quantize"),
    (["convert", "clp-heads"], "'src'"),
    (["train", "masks", "--data", "p.jsonl", "--lr", "nan"], "nan is not a number"),
    (["train", "masks", "--data", "p.jsonl", "--lr", "inf"], "inf is not a finite number"),
    (["train", "masks", "--data", "p.jsonl", "--val-fraction", "nan"], "nan is not a number"),
    (["train", "masks", "--data", "p.jsonl", "--val-fraction", "0"], "--val-fraction"),
    (["train", "clp", "--data", "p.jsonl", "--lr", "nan"], "nan is not a number"),
    (["train", "clp", "--data", "p.jsonl", "--lr", "inf"], "inf is not a finite number"),
    (["train", "mtp", "--data", "gsm8k-train", "--lr", "inf"], "inf is not a finite number"),
    (["train", "mtp", "--data", "gsm8k-train", "--lr", "-1"], "--lr"),
    (["serve", "--queue-timeout", "nan"], "nan is not a number"),
    (["serve", "--client-timeout", "0"], "--client-timeout"),
    (["train", "clp", "--data", "p.jsonl", "--bogus"], "No such option: --bogus"),
]


def snapshot(*roots: Path) -> set[str]:
    return {str(p) for r in roots for p in r.rglob("*")}


def check_error(code: int, err: str, needle: str) -> None:
    """Exit status 2 and one ``error:`` line naming ``needle``: a usage error
    too, without click's usage and "Try ... --help" lines."""
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    assert needle in lines[0], (needle, err)
    assert not any(ln.startswith(("Usage:", "Try ", "Error:")) for ln in err.splitlines()), err


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--bogus"],
        ["generate"],
        ["generate", "-p", "hi", "-n", "x"],
        ["train", "masks", "--data", "p.jsonl", "--lr", "nan"],
        ["bench", "--methods"],
    ],
    ids=" ".join,
)
def test_a_usage_error_is_one_line(argv, capsys, tmp_path, monkeypatch):
    """An unknown or missing option, or a value that does not parse: the whole
    of stderr is one ``error:`` line, exit status 2."""
    monkeypatch.chdir(tmp_path)
    code, err = run_cli(argv, capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), err


@pytest.mark.parametrize(
    "command,argv,needle",
    [("generate", a, n) for a, n in CLI_CASES]
    + [("chat", a, n) for a, n in CHAT_CASES]
    + [("bench", [*a, "--out", "bench-bad"], n) for a, n in BENCH_CASES]
    + [("bench", ["--out", "", "--report-only"], "--out")]
    + [("bench", ["--out", "never-run", "--report-only"], "no finished generations")]
    + [("serve", a, n) for a, n in SERVE_CASES]
    + [(a[0], a[1:], n) for a, n in OTHER_CASES],
    ids=lambda v: " ".join(v) if isinstance(v, list) else str(v),
)
def test_cli_bad_input(command, argv, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    home = Path(os.environ["MLX_MTP_HOME"])
    before = snapshot(tmp_path, home)
    code, err = run_cli([command, *argv], capsys)
    check_error(code, err, needle)
    assert snapshot(tmp_path, home) == before  # nothing written to disk
    if not any(s in err for s in ("No such model", "not a known alias")):
        assert "loading" not in err  # refused before the model load


def test_serve_refuses_a_taken_port_before_loading(capsys, tmp_path, monkeypatch):
    import socket

    monkeypatch.chdir(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.perf_counter()
        code, err = run_cli(["serve", "--port", str(port)], capsys)
    check_error(code, err, f"--port {port}")
    assert "already in use" in err and "loading" not in err
    assert time.perf_counter() - t0 < 10  # no model was loaded


def test_cli_lists_the_options_a_method_takes(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = run_cli(["generate", *HI, "--method", "pld", "--opt", "foo=1"], capsys)
    assert code == 2 and "It takes: window, max_draft." in err


# ----------------------------------------- checked before anything is loaded or written
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: (argv, text of the one error line): a source, a destination or a value that
#: is refused before the model is imported or loaded and before anything is
#: written (a fresh MLX_MTP_HOME stays empty)
CHECKED_FIRST: list[tuple[list[str], str]] = [
    (["convert", "clp-heads", "/etc/passwd", "heads"], "not a folder"),
    (["convert", "clp-heads", "no-such-folder", "heads"], "not a folder"),
    (["train", "clp", "--data", "missing.jsonl", "--out", "heads"], "missing.jsonl"),
    (["bench", "--methods", "ntp", "--limit", "1", "--out", "a-file"], "is a file"),
    (["generate", *HI, "--temp", "nan"], "nan is not a number"),
    (["generate", *HI, "--min-p", "nan"], "nan is not a number"),
    (["generate", *HI, "--top-p", "inf"], "inf is not a finite number"),
    (["chat", "--temp", "nan"], "nan is not a number"),
    (["bench", "--temp", "nan", "--out", "b"], "nan is not a number"),
    (["serve", "--temp", "nan"], "nan is not a number"),
    (["serve", "--min-p", "nan"], "nan is not a number"),
    (["serve", "--host", "8.8.8.8", "--port", str(_free_port())], "--host 8.8.8.8"),
]


@pytest.mark.parametrize(
    "argv,needle",
    CHECKED_FIRST,
    # the free port is left out of the id: ids must not change between the
    # collections of pytest-xdist's processes
    ids=lambda v: (
        " ".join("PORT" if i and v[i - 1] == "--port" else a for i, a in enumerate(v))
        if isinstance(v, list)
        else v
    ),
)
def test_sources_destinations_and_values_are_checked_before_any_work(
    argv, needle, capsys, tmp_path, monkeypatch
):
    """Exit status 2 means nothing was loaded or written: one error line, no
    model imported into a fresh MLX_MTP_HOME, no file made or changed, and no
    warning about a server that never started."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("MLX_MTP_HOME", str(home))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("keep me")
    before = snapshot(tmp_path)
    code, err = run_cli(argv, capsys)
    check_error(code, err, needle)
    assert "loading" not in err and "WARNING" not in err, err
    assert snapshot(tmp_path) == before and (tmp_path / "a-file").read_text() == "keep me"


def test_convert_gguf_onto_an_existing_folder_names_the_flag(capsys, tmp_path, monkeypatch):
    """The CLI's one line names --overwrite, the flag a user can pass."""
    from test_exit_codes import _embedded_gguf

    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep me")
    before = snapshot(tmp_path)
    code, err = run_cli(["convert", "gguf", str(_embedded_gguf()), "out"], capsys)
    check_error(code, err, "pass --overwrite")
    assert snapshot(tmp_path) == before


def test_a_draft_model_equal_to_the_target_shares_its_weights(smollm, caplog, monkeypatch):
    """``--draft-model`` naming the target itself drafts with the target's
    weights (one copy in memory, not two) and says so in one line."""
    import logging

    from mlx_mtp import loading

    monkeypatch.setattr(loading, "_SHARED", set())  # not yet said in this process
    with caplog.at_level(logging.WARNING, logger="mlx_mtp"):
        m = smollm.bind("draft", draft_model="smollm2-135m", num_draft_tokens=2)
    assert m.method.source.loaded is smollm
    lines = [
        r.getMessage() for r in caplog.records if "is the target model itself" in r.getMessage()
    ]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert m.generate("List three colours.", max_tokens=8).stats.accepted > 0


# ------------------------------------------------------------------ Python API
LOAD_CASES: list[tuple[dict, type[MTPError], str]] = [
    ({"method": "pld", "foo": 1}, InvalidArgumentError, "foo"),
    ({"method": "probe", "bc": 10, "k": 2}, InvalidArgumentError, "k"),
    ({"method": "probe", "bc": 2.5}, InvalidArgumentError, "bc"),
    ({"method": "probe", "tree": "14", "bc": 10}, InvalidArgumentError, "bc 10"),
    ({"method": "probe", "lam": None}, InvalidArgumentError, "lam"),
    ({"method": "pld", "max_draft": float("inf")}, InvalidArgumentError, "max_draft"),
    ({"method": "pld", "window": 2.7}, InvalidArgumentError, "window"),
    ({"method": "pld", "window": True}, InvalidArgumentError, "window"),
    ({"dtype": ["x"]}, InvalidArgumentError, "dtype"),
    ({"model": "~no_such_user_zz/m"}, ModelNotFoundError, "No such model"),
    ({"method": "probe", "bc": "big"}, InvalidArgumentError, "bc"),
    ({"method": "nope"}, UnknownMethodError, "nope"),
    ({"method": 3}, InvalidArgumentError, "method"),
    ({"model": 3}, InvalidArgumentError, "model"),
    ({"max_kv_size": 0}, InvalidArgumentError, "max_kv_size"),
    ({"max_kv_size": "x"}, InvalidArgumentError, "max_kv_size"),
    ({"dtype": "int4"}, InvalidArgumentError, "int4"),
]


@pytest.mark.parametrize("kwargs,error,needle", LOAD_CASES, ids=str)
def test_load_bad_arguments(kwargs, error, needle):
    import mlx_mtp

    kwargs = dict(kwargs)
    model = kwargs.pop("model", "smollm2-135m")
    with pytest.raises(error, match=needle):
        mlx_mtp.load(model, **kwargs)


GENERATE_CASES: list[tuple[dict, str]] = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_tokens": "8"}, "max_tokens"),
    ({"temp": -1}, "temp"),
    ({"temp": float("nan")}, "temp"),
    ({"temp": "hot"}, "temp"),
    ({"top_p": 2}, "top_p"),
    ({"top_p": -0.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"min_p": 3}, "min_p"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"seed": "x"}, "seed"),
    ({"prompt": ""}, "empty"),
    ({"prompt": []}, "empty"),
    ({"prompt": 5}, "wrong type"),
    ({"prompt": [10**9]}, "vocabulary"),
    ({"prompt": [-1]}, "vocabulary"),
    ({"prompt": [{"role": "user"}]}, "content"),
    ({"prompt": "hi \udcff there"}, "UTF-8"),
    ({"prompt": [{"role": "user", "content": "a \ud800"}]}, "UTF-8"),
    ({"foo": 1}, "foo"),
    ({"should_stop": 1}, "should_stop must be a function"),
    ({"should_stop": True}, "should_stop must be a function"),
    ({"prompt": [{"role": "robot", "content": "hi"}]}, r"prompt\[0\]\['role'\] must be one of"),
    ({"prompt": [{"role": "User", "content": "hi"}]}, "role"),
    ({"chat_template": "no"}, "chat_template must be True or False"),
    ({"chat_template": 0}, "chat_template"),
    ({"fit_context": "yes"}, "fit_context must be True or False"),
    ({"prompt": np.array([[1, 2]])}, "1-D array of integers"),
    ({"prompt": np.array([1.0, 2.0])}, "1-D array of integers"),
    ({"prompt": np.array([], dtype=np.int64)}, "empty"),
    ({"prompt": np.array([10**9])}, "vocabulary"),
]


@pytest.fixture(scope="module")
def ntp_model(smollm):
    from mlx_mtp.api import MTPModel
    from mlx_mtp.methods import make_method

    return MTPModel(smollm, make_method("ntp"))


@pytest.mark.parametrize("kwargs,needle", GENERATE_CASES, ids=str)
def test_generate_bad_arguments(ntp_model, kwargs, needle):
    kwargs = dict(kwargs)
    prompt = kwargs.pop("prompt", "hi")
    with pytest.raises(InvalidArgumentError, match=needle) as e:
        ntp_model.generate(prompt, **kwargs)
    assert "\n" not in str(e.value)


def test_the_api_takes_the_roles_the_server_takes(ntp_model):
    """The roles come from one table (validation.ROLES) for the API and the
    server: "developer" is rendered as "system", an unknown role is refused
    by both with the same words."""
    from mlx_mtp.server.protocol import OpenAIError, parse_request
    from mlx_mtp.validation import ROLES

    assert ROLES == {"system", "developer", "user", "assistant", "tool"}
    sys_msg = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    dev_msg = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert ntp_model.encode(dev_msg) == ntp_model.encode(sys_msg)
    for role in ROLES:
        ntp_model.encode([{"role": role, "content": "hi"}])
    with pytest.raises(InvalidArgumentError) as api:
        ntp_model.encode([{"role": "robot", "content": "hi"}])
    with pytest.raises(OpenAIError) as server:
        parse_request({"model": "m", "messages": [{"role": "robot", "content": "hi"}]}, "chat")
    tail = 'must be one of assistant, developer, system, tool, user, got "robot".'
    assert str(api.value).endswith(tail) and server.value.message.endswith(tail)


def test_a_numpy_array_of_token_ids_is_a_prompt(ntp_model):
    ids = ntp_model.encode("List three colours.")
    want = ntp_model.generate(ids, max_tokens=3).tokens
    for dtype in (np.int64, np.int32, np.uint32):
        assert ntp_model.generate(np.array(ids, dtype=dtype), max_tokens=3).tokens == want


def test_should_stop_a_function_is_asked(ntp_model):
    out = ntp_model.generate("hi", max_tokens=8, should_stop=lambda: True)
    assert out.finish_reason == "cancelled"


def test_chat_bad_arguments_leave_history_unchanged(ntp_model):
    chat = ntp_model.chat()
    with pytest.raises(InvalidArgumentError, match="top_p"):
        list(chat.send("hello", top_p=5))
    with pytest.raises(InvalidArgumentError, match="foo"):
        list(chat.send("hello", foo=1))
    with pytest.raises(InvalidArgumentError, match="must be a string"):
        list(chat.send(["hello"]))
    assert chat.messages == []


def test_numpy_integers_are_numbers(ntp_model):
    ids = np.array(ntp_model.encode("hi"), dtype=np.int64)
    out = ntp_model.generate(list(ids), max_tokens=np.int64(2), seed=np.int64(3), temp=0.5)
    assert len(out.tokens) == 2


def test_a_window_smaller_than_the_block_is_fine(smollm):
    """--max-kv-size 20 with BC 30: the window keeps room for the block (it is
    built with window + 30 rows), so nothing is refused; the method's
    engine knows its slots."""
    from mlx_mtp.api import MTPModel
    from mlx_mtp.cache_view import SlidingKVCache
    from mlx_mtp.methods import make_method

    m = MTPModel(smollm, make_method("probe", bc=30), max_kv_size=20)
    c = m.engine.cache[0]
    assert isinstance(c, SlidingKVCache) and (c.keep, c.window, c.room) == (4, 16, 30)
    ids = m.encode("Count from one to twenty: one, two, three,")
    ref = MTPModel(smollm, make_method("ntp"), max_kv_size=20).generate(ids, max_tokens=12)
    assert m.generate(ids, max_tokens=12).tokens == ref.tokens


# ------------------------------------------------------- memory-bounded options
def _limit_address_space():  # in the child, before exec
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))


@pytest.mark.skipif(
    sys.platform == "darwin",
    reason="setrlimit(RLIMIT_AS) raises on arm64 macOS (its address-space limit cannot be "
    "lowered), so the child cannot run under a memory cap",
)
def test_huge_block_complexity_refused_under_memory_limit(tmp_path):
    """``--bc 100000`` allocated a (98304, 98304) mask; now a clear error,
    checked under a 6 GB address-space limit so a regression fails the test
    (MemoryError / killed) instead of taking the machine."""
    exe = Path(sys.executable).parent / "mlx-mtp"
    argv = [str(exe), "generate", "-p", "hi", "--method", "probe", "--bc", "100000", "-n", "8"]
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        preexec_fn=_limit_address_space,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
    )
    check_error(proc.returncode, proc.stderr, "block complexity")
    assert "address-space limit" in proc.stderr
    assert "largest block complexity that fits" in proc.stderr


def test_check_slots_bounds_every_forward(smollm):
    from mlx_mtp.engine import Engine

    eng = Engine(smollm.model)
    top = eng.max_slots()
    assert 64 < top < 100_000
    eng.check_slots(top)
    with pytest.raises(InvalidArgumentError, match="block complexity"):
        eng.check_slots(top + 1)
    # a long context shrinks what fits
    assert eng.max_slots(context=200_000) < top


def test_the_masks_help_states_the_ranges_the_methods_take():
    import re

    from mlx_mtp import cli_options
    from mlx_mtp.methods import make_method

    m = re.search(r"probe (\d)-(\d), hybrid (\d)-(\d)", cli_options.MASKS.help)
    assert m, cli_options.MASKS.help
    for method, lo, hi in (("probe", *m.groups()[:2]), ("hybrid", *m.groups()[2:])):
        lo, hi = int(lo), int(hi)
        for ok in (lo, hi):
            make_method(method, masks=ok)
        for bad in (lo - 1, hi + 1):
            with pytest.raises(InvalidArgumentError, match="masks"):
                make_method(method, masks=bad)


def test_the_training_functions_refuse_a_rate_that_is_not_finite(tmp_path, monkeypatch):
    """The Python functions behind ``train masks/mtp/clp`` refuse a learning
    rate (or held-out share) that is inf or nan, before the model loads,
    instead of training an all-inf result."""
    import mlx_mtp.commands.confadapt as confadapt
    import mlx_mtp.commands.masks as masks
    from mlx_mtp.training.clp import TrainConfig, train_clp

    def refuse(*a, **k):
        raise AssertionError("the model was loaded")

    for module in (masks, confadapt):
        monkeypatch.setattr(module, "load_model", refuse)
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "Say hi."}\n{"prompt": "Count to three."}\n')
    out = tmp_path / "m.safetensors"
    for kw in ({"lr": float("inf")}, {"lr": float("nan")}, {"val_fraction": float("nan")}):
        with pytest.raises(InvalidArgumentError, match="is not a finite number"):
            masks.run_train_masks("smollm2-135m", [data], out=out, **kw)
    with pytest.raises(InvalidArgumentError, match="--lr nan is not a finite number"):
        confadapt.run_train_mtp("smollm2-135m", str(data), lr=float("nan"))
    with pytest.raises(InvalidArgumentError, match="lr"):
        train_clp(None, tmp_path / "heads", TrainConfig(lr=float("inf"), data=[str(data)]))
    assert list(tmp_path.iterdir()) == [data]
