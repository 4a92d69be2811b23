"""``mlx-mtp serve``: the OpenAI-compatible server, checked with the real
``openai`` client against a server on a free loopback port in this process
(SmolLM2-135M float32, a few tokens per request). Raw HTTP (malformed bodies,
abusive requests, browser-style requests, disconnects) goes through the
standard library's ``http.client``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.client
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai  # the dev extra installs it, with starlette and uvicorn (a missing one fails)
import pytest

from mlx_mtp.server.protocol import OpenAIError, StopCutter, parse_json, parse_request

MODEL = "smollm2-135m"
KEY = "test-key-123"
QUEUE = 2
N = 12  # new tokens per request


@contextlib.contextmanager
def serving(worker, **kw) -> Iterator[tuple[str, object]]:
    """Serve ``worker`` on 127.0.0.1 at a free port from a thread: yields
    (base_url, the uvicorn server); ``kw`` goes to ``make_server``."""
    from mlx_mtp.server import make_server
    from mlx_mtp.server.app import bind_socket

    sock = bind_socket("127.0.0.1", _free_port())
    port = sock.getsockname()[1]
    srv = make_server(worker, "127.0.0.1", port, log_level="warning", **kw)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started:
        assert time.time() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", srv
    finally:
        srv.should_exit = True
        thread.join(15)
        sock.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    """(base_url, worker): a server with the embedded model, default method ntp,
    an API key and a queue of QUEUE, on 127.0.0.1 at a free port; one request
    at a time (the batching tests raise ``worker.max_batch``)."""
    from mlx_mtp.server import Worker

    worker = Worker(MODEL, "ntp", dtype="float32", max_tokens=N, queue_size=QUEUE, max_batch=1)
    worker.start()
    with serving(worker, api_key=KEY) as (base, srv):
        worker.http = srv  # for the tests that look at open connections
        yield base, worker
    worker.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ref(smollm):
    """``ref(prompt, method="ntp", chat=True, n=N, **options) -> Result``: the same
    generation through ``mlx_mtp``'s Python API (temperature 0)."""
    from mlx_mtp.api import MTPModel
    from mlx_mtp.methods import make_method

    models: dict = {}

    def run(prompt, method="ntp", chat=True, n=N, sampling=None, **options):
        key = (method, tuple(sorted(options.items())))
        if key not in models:
            models[key] = MTPModel(smollm, make_method(method, **options))
        kw = sampling or {"temp": 0.0}
        return models[key].generate(prompt, max_tokens=n, chat_template=chat, **kw)

    return run


def send(base, method, path, body=None, headers=None, key=KEY) -> http.client.HTTPConnection:
    """Send one request (``body``: bytes, None or JSON-able) on a connection of
    its own; returns the connection, the answer not yet read."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    if key:
        hdrs["Authorization"] = f"Bearer {key}"
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    skip_host = "Host" in hdrs
    conn.putrequest(method, path, skip_host=skip_host, skip_accept_encoding=True)
    for k, v in hdrs.items():
        if v is not None:  # None: leave the header out
            conn.putheader(k, v)
    conn.putheader("Content-Length", str(len(data or b"")))
    conn.endheaders(data)
    return conn


def raw(base, method, path, body=None, headers=None, key=KEY):
    """(status, headers, parsed JSON) of one request through http.client."""
    conn = send(base, method, path, body, headers, key)
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    try:
        return resp.status, resp.headers, json.loads(payload) if payload else None
    except ValueError:  # not JSON: h11's own answer to a malformed request
        return resp.status, resp.headers, {"raw": payload}


def wait_idle(worker, timeout=60.0) -> float:
    """Seconds until the worker has no running or queued job."""
    t0 = time.perf_counter()
    while worker.running is not None or worker.health()["queue"]["waiting"]:
        assert time.perf_counter() - t0 < timeout, "worker still busy"
        time.sleep(0.02)
    return time.perf_counter() - t0


Q = [{"role": "user", "content": "What is the capital of France?"}]


# --------------------------------------------------------------- protocol units
def test_stop_cutter_never_emits_a_stop_string_split_across_pieces():
    c = StopCutter(["END", "xyz"])
    out = [c.feed(p) for p in ["abc E", "N", "D more"]]
    assert "".join(out) == "abc " and c.stopped and c.flush() == ""
    c = StopCutter(["\n\n"])
    assert c.feed("one\n") == "one" and c.feed("two") == "\ntwo" and c.flush() == ""
    c = StopCutter(["bb", "ab"])  # the earliest match wins
    assert c.feed("xab") == "x" and c.stopped
    c = StopCutter(["zz"])
    assert c.feed("az") == "a" and c.flush() == "z"  # held back, then released at the end


def test_parse_request_shape_errors():
    ok = {"model": MODEL, "messages": Q}
    assert parse_request(dict(ok, stop="x"), "chat").stop == ["x"]
    bad = [
        (dict(ok, n=2), "n"),
        (dict(ok, stop=[1]), "stop"),
        (dict(ok, temperature="hot"), "temperature"),
        (dict(ok, max_tokens=1.5), "max_tokens"),
        (dict(ok, messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
        (dict(ok, mtp="pld"), "mtp"),
        (dict(ok, mtp={"bc": 3}), "mtp.method"),
        ({"messages": Q}, "model"),
    ]
    for body, param in bad:
        with pytest.raises(OpenAIError) as e:
            parse_request(body, "chat")
        assert e.value.status == 400 and e.value.param == param, body
    with pytest.raises(OpenAIError):
        parse_request({"model": MODEL, "prompt": ["a", "b"]}, "completion")


def test_missing_extra_is_a_clear_error(monkeypatch, capsys):
    import importlib.util

    from mlx_mtp.errors import MTPError
    from mlx_mtp.server import require_server_extra

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "uvicorn" else real(n, *a)
    )
    with pytest.raises(MTPError, match=r"pip install 'mlx-mtp\[server\]'"):
        require_server_extra()
    # through the command line: the message, exit status 2, no model loaded
    from mlx_mtp import cli

    monkeypatch.setattr(sys, "argv", ["mlx-mtp", "serve", "--model", "no-such-model"])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 2
    assert "pip install 'mlx-mtp[server]'" in capsys.readouterr().err


def test_is_loopback_and_other_hosts_warn(monkeypatch, capsys):
    from mlx_mtp import cli
    from mlx_mtp.commands.serve import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2")
    # the warning comes before anything is loaded (the model is missing here)
    argv = ["mlx-mtp", "serve", "--host", "0.0.0.0", "--port", str(_free_port())]
    monkeypatch.setattr(sys, "argv", [*argv, "--model", "/no/such/model"])
    with pytest.raises(SystemExit) as e:
        cli.main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and "WARNING: binding 0.0.0.0" in err and "no --api-key" in err
    assert "No such model" in err


def test_unknown_fields_are_refused_and_top_k_min_p_honoured():
    ok = {"model": MODEL, "messages": Q}
    r = parse_request(dict(ok, top_k=5, min_p=0.1, user="u1", metadata={"a": "b"}), "chat")
    assert (r.top_k, r.min_p) == (5, 0.1)
    for field in ("colour", "repetition_penalty", "best_of", "echo"):  # chat has no best_of/echo
        with pytest.raises(OpenAIError) as e:
            parse_request(dict(ok, **{field: 1}), "chat")
        assert e.value.code == "unknown_field" and e.value.param == field
    comp = {"model": MODEL, "prompt": "hi"}
    assert parse_request(dict(comp, best_of=1, echo=False), "completion").prompt == "hi"
    with pytest.raises(OpenAIError, match="'messages'"):
        parse_request(dict(comp, messages=Q), "completion")


@pytest.mark.parametrize(
    "raw_body",
    [b"[" * 100_000, b'{"a":' * 100_000, b'{"model": NaN}', b'{"x": Infinity}', b"\xff\xfe"],
    ids=["nested-lists", "nested-objects", "NaN", "Infinity", "not-utf8"],
)
def test_parse_json_refuses_what_is_not_json(raw_body):
    with pytest.raises(OpenAIError) as e:
        parse_json(raw_body)
    assert e.value.status == 400 and e.value.code == "invalid_json"


# ------------------------------------------------------------------ end to end
def test_models_and_health(server, client):
    base, worker = server
    assert [m.id for m in client.models.list().data] == [MODEL]
    # with a key set, /health tells a client without it only whether it is alive
    status, _, body = raw(base, "GET", "/health", key=None)
    assert status == 200 and body == {"status": "ok"}
    status, _, body = raw(base, "GET", "/health", key="wrong")
    assert status == 200 and body == {"status": "ok"}
    status, _, body = raw(base, "GET", "/health")
    assert status == 200 and body["status"] == "ok" and body["model"] == MODEL
    assert body["limits"]["max_slots_per_forward"] == worker.limits.slots
    assert raw(base, "GET", f"/v1/models/{MODEL}")[2]["id"] == MODEL
    status, _, body = raw(base, "GET", "/v1/models/gpt-4o")
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_worker_events_are_typed(server):
    from mlx_mtp.server.events import Delta, Done, Started, Taken
    from mlx_mtp.server.worker import Job

    _, worker = server
    wait_idle(worker)
    events: list = []
    req = parse_request({"model": MODEL, "messages": Q, "max_tokens": 4}, "chat")
    job = Job(req, emit=events.append)
    worker.submit(job)
    deadline = time.time() + 120
    while job.finished is None:
        assert time.time() < deadline
        time.sleep(0.02)
    kinds = [type(e) for e in events]
    assert kinds[:2] == [Taken, Started] and kinds[-1] is Done
    assert set(kinds[2:-1]) == {Delta} and "".join(e.text for e in events[2:-1])
    done = events[-1]
    assert done.finish_reason == "length" and done.usage["completion_tokens"] == 4
    assert done.mtp["max_slots"] == 1 and done.mtp["plain_steps"] == 0


def test_chat_equals_generate(client, ref):
    r = client.chat.completions.create(model=MODEL, messages=Q, max_tokens=N, temperature=0)
    want = ref(Q)
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.completion_tokens == len(want.tokens)
    assert r.usage.prompt_tokens == want.stats.prompt_tokens
    assert r.model_extra["mtp"]["method"] == "ntp"
    assert r.model_extra["mtp"]["runner"] == "plain"


def test_seeded_sampling_equals_generate(client, ref):
    kw = dict(model=MODEL, messages=Q, max_tokens=6, temperature=1.5, top_p=0.95, seed=7)
    a, b = (client.chat.completions.create(**kw) for _ in range(2))
    want = ref(Q, n=6, sampling={"temp": 1.5, "top_p": 0.95, "seed": 7}).text
    assert a.choices[0].message.content == b.choices[0].message.content == want


def test_chat_stream_with_method_equals_generate(client, ref):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=Q,
            max_tokens=N,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"mtp": {"method": "probe", "bc": 10}},
        )
    )
    want = ref(Q, "probe", bc=10)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == want.finish_reason
    assert finals[0].model_extra["mtp"]["method"].startswith("probe(bc=10")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.tokens)
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_completions_equal_generate(client, ref):
    prompt = "The three primary colors are"
    want = ref(prompt, "pld", chat=False)
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=N,
        temperature=0,
        extra_body={"mtp": {"method": "pld"}},
    )
    assert r.choices[0].text == want.text and r.object == "text_completion"
    assert r.model_extra["mtp"]["method"].startswith("pld")
    assert r.model_extra["mtp"]["runner"] == want.stats.runner == "synchronous"  # a CPU
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=N, temperature=0, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == want.text  # ntp: same greedy text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


def test_one_token_prompts_on_the_pipelined_step_equal_ntp(client, monkeypatch):
    """A one-token prompt (ids and text), then a two-token one, through
    pipelined probe and hybrid steps give ntp's text: nothing cached before
    the first step, and nothing left behind for the next request."""
    monkeypatch.setenv("MLX_MTP_PIPELINE", "1")

    def text(prompt, **method):
        extra = {"mtp": method} if method else {}
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body=extra
        )
        return r.choices[0].text

    for prompt in ([42], "K", [1, 2]):
        want = text(prompt)
        assert text(prompt, method="probe", bc=30) == want, prompt
        assert text(prompt, method="hybrid", bc=10) == want, prompt


def test_stop_strings(client, ref):
    want = ref(Q, n=N).text
    stop = want[8:12]  # four characters from the middle, spanning tokens in general
    cut = want[: want.find(stop)]
    r = client.chat.completions.create(
        model=MODEL, messages=Q, max_tokens=N, temperature=0, stop=[stop, "never-seen"]
    )
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=Q, max_tokens=N, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_stop_string_counts_the_tokens_up_to_it_whatever_the_method_drafted(client, ref, smollm):
    """A request that ends at a stop string reports as completion_tokens the
    tokens up to the one that completes it, whether its method drafted and
    accepted tokens past it in the same step (``pld`` on a copy, alone) or
    not (``ntp``): the same count for the same text, as a batched row
    reports."""
    copy = [{"role": "user", "content": "Repeat exactly: alpha beta gamma delta epsilon zeta "
             "eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau."}]  # fmt: skip
    want = ref(copy, n=40)
    stop = "omicron"
    assert stop in want.text
    toks = want.tokens
    count = next(k for k in range(1, len(toks) + 1) if stop in smollm.tokenizer.decode(toks[:k]))
    drafted = ref(copy, "pld", n=40).stats
    assert drafted.accepted > 0
    for method in (None, "pld"):
        extra = {"mtp": {"method": method}} if method else None
        r = client.chat.completions.create(
            model=MODEL, messages=copy, max_tokens=40, temperature=0, stop=[stop],
            extra_body=extra,
        )  # fmt: skip
        assert r.choices[0].message.content == want.text[: want.text.find(stop)]
        assert r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens == count, (method, r.usage.completion_tokens, count)


def test_multi_turn_reuses_the_cache(client, ref):
    first = client.chat.completions.create(model=MODEL, messages=Q, max_tokens=N, temperature=0)
    msgs = [
        *Q,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And of Italy?"},
    ]
    second = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=N, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    assert second.choices[0].message.content == ref(msgs).text


def test_api_key(server):
    base = server[0]
    for key in (None, "wrong"):
        status, _, body = raw(base, "GET", "/v1/models", key=key)
        assert status == 401 and body["error"]["type"] == "authentication_error"
    bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=Q, max_tokens=2)


M = {"model": MODEL, "messages": Q, "max_tokens": 2}
WORDS = [{"role": "user", "content": "word " * 9000}]  # past the 8192-token context
FITS = [{"role": "user", "content": "word " * 6000}]  # within it, but not with 4000 more


def mtp(**options):
    return dict(M, mtp=options)


#: one function tool (SmolLM2's chat template has no tool format)
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
AA, HA, OA = "artifact_not_allowed", "host_not_allowed", "origin_not_allowed"
CHAT = "/v1/chat/completions"
EVIL = {"Origin": "http://evil.example"}
PREFLIGHT = "Access-Control-Request-Method"

#: (label, method, path, body, extra headers, expected status, expected code or None):
#: every one answered with an OpenAI-shaped JSON error, and the server healthy after it
ABUSE: list[tuple] = [
    # bodies that are not a request
    ("not json", b"{not json", 400, "invalid_json"),
    ("a json list", b"[1, 2]", 400, "invalid_json"),
    ("100k nested [", b"[" * 100_000, 400, "invalid_json"),
    ("100k nested {", b'{"a":' * 100_000, 400, "invalid_json"),
    ("NaN", b'{"model": "smollm2-135m", "temperature": NaN}', 400, "invalid_json"),
    ("not utf-8", b'{"model": "\xff\xfe"}', 400, "invalid_json"),
    ("over 8 MB", b"x" * (9 << 20), 413, None),
    ("text/plain", M, {"Content-Type": "text/plain"}, 415, "unsupported_media_type"),
    ("form", M, {"Content-Type": "application/x-www-form-urlencoded"}, 415, None),
    ("no content type", M, {"Content-Type": None}, 415, "unsupported_media_type"),
    # fields
    ("unknown model", dict(M, model="gpt-4o"), 404, "model_not_found"),
    ("unknown field", dict(M, colour="red"), 400, "unknown_field"),
    ("repetition_penalty", dict(M, repetition_penalty=1.1), 400, "unknown_field"),
    ("stream_options extra", dict(M, stream=True, stream_options={"x": 1}), 400, None),
    ("n=3", dict(M, n=3), 400, None),
    ("tools", dict(M, tools=[{"type": "function"}]), 400, None),
    ("tools on a model without a tool format", dict(M, tools=TOOLS), 400, "tools_not_supported"),
    ("tool_choice without tools", dict(M, tool_choice="required"), 400, None),
    ("logprobs not a boolean", dict(M, logprobs="yes"), 400, None),
    ("top_logprobs without logprobs", dict(M, top_logprobs=3), 400, None),
    ("top_logprobs 21", dict(M, logprobs=True, top_logprobs=21), 400, None),
    ("response_format json", dict(M, response_format={"type": "json_object"}), 400,
     "response_format_not_supported"),
    ("empty messages", dict(M, messages=[]), 400, None),
    ("message not an object", dict(M, messages=["hi"]), 400, None),
    ("empty stop", dict(M, stop=[""]), 400, None),
    ("17 stop strings", dict(M, stop=[f"s{i}" for i in range(17)]), 400, None),
    ("temperature -1", dict(M, temperature=-1), 400, None),
    ("top_p 2", dict(M, top_p=2), 400, None),
    ("top_k -1", dict(M, top_k=-1), 400, None),
    ("min_p 2", dict(M, min_p=2), 400, None),
    ("seed -1", dict(M, seed=-1), 400, None),
    ("seed 2**64", dict(M, seed=2**64), 400, None),
    ("max_tokens 0", dict(M, max_tokens=0), 400, None),
    ("max_tokens 1.5", dict(M, max_tokens=1.5), 400, None),
    ("max_tokens true", dict(M, max_tokens=True), 400, None),
    ("max_tokens 1e400", b'{"model": "smollm2-135m", "max_tokens": 1e400}', 400, None),
    ("max_tokens 10**7", dict(M, max_tokens=10**7), 400, "max_tokens_limit"),
    ("prompt over the context", dict(M, messages=WORDS), 400, "context_length_exceeded"),
    (
        "prompt + max_tokens over the context",
        dict(M, max_tokens=4000, messages=[{"role": "user", "content": "word " * 5000}]),
        400,
        "context_length_exceeded",
    ),
    ("token ids outside the vocabulary", None, 400, None),  # /v1/completions, below
    # methods and their options
    ("unknown method", mtp(method="no-such-method"), 400, None),
    ("probe bc 7000", mtp(method="probe", bc=7000), 400, "bc_limit"),
    ("probe max_bc 7000", mtp(method="probe", bc="auto", max_bc=7000), 400, "bc_limit"),
    ("hybrid bc 100", mtp(method="hybrid", bc=100), 400, "bc_limit"),
    ("pld max_draft 500", mtp(method="pld", max_draft=500), 400, "bc_limit"),
    ("lookahead 16/64/64", mtp(method="lookahead", level=16, window=64, guess=64), 400, "bc_limit"),
    ("probe masks 9", mtp(method="probe", masks=9), 400, None),
    ("probe bc abc", mtp(method="probe", bc="abc"), 400, None),
    ("pld window 0", mtp(method="pld", window=0), 400, None),
    ("option an object", mtp(method="pld", window={"a": 1}), 400, None),
    ("option null", mtp(method="pld", window=None), 400, None),
    ("options without a method", dict(M, mtp={"bc": 3}), 400, None),
    # files and hub repos named by a request
    ("clp heads /etc/shadow", mtp(method="clp", heads="/etc/shadow"), 400, AA),
    ("clp heads a repo", mtp(method="clp", heads="org/name"), 400, AA),
    ("confadapt adapter /etc", mtp(method="confadapt", adapter="/etc"), 400, AA),
    ("hybrid heads /etc/shadow", mtp(method="hybrid", heads="/etc/shadow"), 400, AA),
    ("mtp heads .", mtp(method="mtp", heads="."), 400, AA),
    ("mtp heads missing", mtp(method="mtp", heads="/no/such/dir"), 400, AA),
    # routes
    ("GET on a POST route", "GET", "/v1/chat/completions", None, 405, None),
    ("unknown route", "GET", "/v1/nothing-here", None, 404, None),
    ("POST on /health", "POST", "/health", b"{}", 405, None),
]  # fmt: skip
#: an option no method takes, for every method: refused by name (never ignored)
ABUSE += [(f"{name} colour", mtp(method=name, colour="red"), 400, None) for name in
          ("ntp", "pld", "probe", "clp", "confadapt", "lookahead", "hybrid", "mtp")]  # fmt: skip


def _abuse_case(case: tuple) -> tuple[str, str, object, dict, int, str | None]:
    """(method, path, body, headers, status, code) of an ABUSE row."""
    label, *rest = case
    if label == "token ids outside the vocabulary":
        body = {"model": MODEL, "prompt": [1, 2, 10**9], "max_tokens": 2}
        return "POST", "/v1/completions", body, {}, 400, None
    if len(rest) == 5:
        return rest[0], rest[1], rest[2], {}, rest[3], rest[4]
    if len(rest) == 4:
        body, headers, status, code = rest
        return "POST", "/v1/chat/completions", body, headers, status, code
    body, status, code = rest
    return "POST", "/v1/chat/completions", body, {}, status, code


def assert_healthy(base, worker) -> None:
    wait_idle(worker)
    status, _, body = raw(base, "GET", "/health")
    assert status == 200 and body["status"] == "ok" and not body["busy"], body
    assert worker.alive


@pytest.mark.parametrize("case", ABUSE, ids=[c[0] for c in ABUSE])
def test_abusive_requests_get_json_errors_and_the_server_stays_healthy(server, case):
    base, worker = server
    method, path, body, headers, status, code = _abuse_case(case)
    t0 = time.perf_counter()
    got, _, err = raw(base, method, path, body, headers)
    took = time.perf_counter() - t0
    assert got == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
    if code:
        assert err["error"]["code"] == code, err
    assert took < 60, took  # refused up front, not after a long run
    assert_healthy(base, worker)


def test_after_the_abuse_the_server_answers_correctly(server, client, ref):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=Q, n=2)
    r = client.chat.completions.create(model=MODEL, messages=Q, max_tokens=N, temperature=0)
    assert r.choices[0].message.content == ref(Q).text
    r = client.chat.completions.create(
        model=MODEL, messages=Q, max_tokens=6, temperature=0.8, top_p=0.9, seed=3,
        extra_body={"top_k": 5, "min_p": 0.05},
    )  # fmt: skip
    want = ref(Q, n=6, sampling={"temp": 0.8, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "seed": 3})
    assert r.choices[0].message.content == want.text


def test_refused_paths_say_the_same_whether_they_exist_or_not(server):
    base, _ = server
    messages = set()
    for path in ("/etc/shadow", "/etc", "/no/such/path", "/root", "org/name"):
        _, _, err = raw(base, "POST", "/v1/chat/completions", mtp(method="clp", heads=path))
        messages.add(err["error"]["message"])
    assert len(messages) == 1 and "/etc" not in messages.pop()


# ------------------------------------------------------------- browser safety
BROWSER: list[tuple[str, str, str, dict, int, str | None]] = [
    ("DNS rebinding: another Host", "GET", "/v1/models", {"Host": "evil.example:8080"}, 400, HA),
    ("another Host on a POST", "POST", CHAT, {"Host": "evil.example"}, 400, HA),
    ("no Host (refused by the HTTP parser)", "GET", "/v1/models", {"Host": None}, 400, None),
    ("cross-origin text/plain POST", "POST", CHAT, {**EVIL, "Content-Type": "text/plain"}, 403, OA),
    ("cross-origin JSON POST", "POST", CHAT, EVIL, 403, OA),
    ("cross-origin GET", "GET", "/v1/models", {"Origin": "https://evil.example"}, 403, OA),
    ("cross-origin preflight", "OPTIONS", CHAT, {**EVIL, PREFLIGHT: "POST"}, 403, OA),
    ("null origin (sandboxed page)", "POST", CHAT, {"Origin": "null"}, 403, OA),
    ("a localhost page", "GET", "/v1/models", {"Origin": "http://localhost:3000"}, 403, OA),
    ("Host localhost", "GET", "/v1/models", {"Host": "localhost:1"}, 200, None),
    ("Host [::1]", "GET", "/v1/models", {"Host": "[::1]:1"}, 200, None),
    ("Host 127.0.0.1.", "GET", "/v1/models", {"Host": "127.0.0.1."}, 200, None),
]  # fmt: skip


@pytest.mark.parametrize("case", BROWSER, ids=[c[0] for c in BROWSER])
def test_browser_style_requests_are_refused(server, case):
    base, worker = server
    _, method, path, headers, status, code = case
    body = M if method == "POST" else None
    got, hdrs, err = raw(base, method, path, body, headers)
    assert got == status, err
    if code:
        assert err["error"]["code"] == code
        assert "access-control-allow-origin" not in {k.lower() for k in hdrs}
    assert_healthy(base, worker)


def _asgi(app, method: str, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str]]:
    """Call an ASGI app once (no body): (status, response headers)."""
    scope = {
        "type": "http", "method": method, "path": path, "raw_path": path.encode(),
        "query_string": b"", "root_path": "", "scheme": "http", "http_version": "1.1",
        "server": ("127.0.0.1", 8080), "client": ("127.0.0.1", 5000),
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }  # fmt: skip
    out: dict = {}

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
            out["headers"] = {k.decode(): v.decode() for k, v in message["headers"]}

    asyncio.run(app(scope, receive, send))
    return out["status"], out["headers"]


def test_allowed_origins_get_cors_and_others_do_not():
    from starlette.responses import PlainTextResponse

    from mlx_mtp.server.app import BrowserGuard

    async def inner(scope, receive, send):
        await PlainTextResponse("ok")(scope, receive, send)

    guard = BrowserGuard(inner, {"localhost", "127.0.0.1"}, ["http://localhost:3000"], False)
    ok = {"Host": "127.0.0.1:8080", "Origin": "http://localhost:3000"}
    status, h = _asgi(guard, "GET", "/v1/models", ok)
    assert status == 200 and h["access-control-allow-origin"] == "http://localhost:3000"
    status, h = _asgi(
        guard, "OPTIONS", "/v1/chat/completions", {**ok, "Access-Control-Request-Method": "POST"}
    )
    assert status == 204 and "Authorization" in h["access-control-allow-headers"]
    status, _ = _asgi(guard, "GET", "/v1/models", {**ok, "Origin": "http://localhost:4000"})
    assert status == 403
    status, _ = _asgi(guard, "GET", "/", {"Host": "10.0.0.5:8080"})
    assert status == 400  # an IP literal only on a wildcard bind
    wild = BrowserGuard(inner, {"localhost"}, ["*"], any_ip=True)
    assert _asgi(wild, "GET", "/", {"Host": "10.0.0.5:8080", "Origin": "http://a.b"})[0] == 200
    assert _asgi(wild, "GET", "/", {"Host": "rebind.example:8080"})[0] == 400


# ------------------------------------------------------------------- limits
def test_a_forward_pass_bound_below_the_bc_is_named(server, monkeypatch):
    """A device on which a pass over 12 slots takes longer than --max-forward-s:
    a request for more is refused naming that bound, fewer are served."""
    base, worker = server
    lim = worker.limits
    monkeypatch.setattr(lim, "forward", dataclasses.replace(lim.forward, slots=12))
    status, _, err = raw(base, "POST", "/v1/chat/completions", mtp(method="probe", bc=30))
    assert status == 400 and err["error"]["code"] == "bc_limit"
    assert "12 slots" in err["error"]["message"] and "--max-forward-s" in err["error"]["message"]
    status, _, body = raw(base, "POST", "/v1/chat/completions", mtp(method="probe", bc=10))
    assert status == 200 and body["mtp"]["max_slots"] <= 10


def test_artifacts_inside_an_allowed_folder_pass(server, monkeypatch, tmp_path):
    base, worker = server
    root = tmp_path / "allowed"
    (root / "heads").mkdir(parents=True)
    (root / "escape").symlink_to("/etc")
    monkeypatch.setattr(worker.limits, "allow_artifacts", (Path(os.path.realpath(root)),))
    refused = [str(root / "escape"), "escape", "../../../etc", "/etc", "org/name", "missing"]
    for value in refused:
        _, _, err = raw(base, "POST", "/v1/chat/completions", mtp(method="mtp", heads=value))
        assert err["error"]["code"] == "artifact_not_allowed", value
    for value in (str(root / "heads"), "heads"):  # past the check: the method's own error
        status, _, err = raw(base, "POST", "/v1/chat/completions", mtp(method="mtp", heads=value))
        assert status == 400 and err["error"]["code"] != "artifact_not_allowed", err
    assert_healthy(base, worker)


def test_queue_timeout_answers_503_and_drops_the_job(server):
    base, worker = server
    with serving(worker, api_key=KEY, queue_timeout=1.0) as (quick, _):
        conn, resp = _open_stream(base, LONG)  # keeps the worker busy
        try:
            before = worker.counts["cancelled"]
            t0 = time.perf_counter()
            status, headers, err = raw(quick, "POST", "/v1/chat/completions", M)
            waited = time.perf_counter() - t0
            assert status == 503 and err["error"]["code"] == "queue_timeout", err
            assert 1.0 <= waited < 10 and int(headers["Retry-After"]) >= 1
        finally:
            resp.close()
            conn.close()
        deadline = time.time() + 60  # the stream and the expired job both end cancelled
        while worker.counts["cancelled"] < before + 2:
            assert time.time() < deadline, worker.counts
            time.sleep(0.02)
        assert worker.recent[-1].generated_tokens == 0  # the expired job never ran


def test_a_cancel_during_a_long_prefill_frees_the_worker(server, ref):
    """The client leaves while its long prompt is being prefilled: the worker
    stops between prefill passes instead of prefilling all of it."""
    base, worker = server
    words = [{"role": "user", "content": "the cat sat on the mat. " * 700}]  # ~4900 tokens
    m = worker._models[worker.default_key]
    step = m.prefill_step
    m.prefill_step = 64  # many passes, whatever the device's speed
    try:
        conn = send(base, "POST", "/v1/chat/completions", dict(M, messages=words, stream=True))
        deadline = time.time() + 60
        while worker.running is None:  # the worker has taken it: the prefill begins
            assert time.time() < deadline
            time.sleep(0.005)
        conn.close()
        wait_idle(worker, timeout=120)
    finally:
        m.prefill_step = step
    job = worker.recent[-1]
    assert job.status == "cancelled" and job.generated_tokens == 0
    assert m.engine.offset < 4800  # stopped part way: the rest was never prefilled
    assert_healthy(base, worker)


def _open_stream(base, body):
    """Start a streaming request and read until its first content event;
    returns the open connection."""
    conn = send(base, "POST", "/v1/chat/completions", dict(body, stream=True))
    resp = conn.getresponse()
    assert resp.status == 200
    events = 0
    while events < 2:  # the role chunk, then some text
        line = resp.fp.readline()
        assert line, "stream ended early"
        events += line.startswith(b"data: ")
    return conn, resp


LONG = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Count from 1 to 500, separated by commas."}],
    "max_tokens": 2000,
    "temperature": 0,
}


def test_disconnect_mid_stream_frees_the_worker(server, client, ref):
    base, worker = server
    before = worker.counts["cancelled"]
    conn, resp = _open_stream(base, LONG)
    resp.close()
    conn.close()  # the client goes away mid-stream
    idle_s = wait_idle(worker, timeout=60)
    job = worker.recent[-1]
    assert worker.counts["cancelled"] == before + 1 and job.status == "cancelled"
    assert job.generated_tokens < 100, job.generated_tokens  # stopped, not run to 2000
    # the next request is served, from a consistent cache (same prompt prefix)
    r = client.chat.completions.create(
        model=MODEL, messages=LONG["messages"], max_tokens=6, temperature=0
    )
    assert r.choices[0].message.content == ref(LONG["messages"], n=6).text
    assert r.usage.prompt_tokens_details.cached_tokens > 0
    print(f"worker idle {idle_s:.2f} s after the disconnect")


def test_full_queue_gets_429_and_nothing_is_lost(server, ref):
    base, worker = server
    conn, resp = _open_stream(base, LONG)  # keeps the worker busy
    results = {}

    def small(i):
        body = {"model": MODEL, "messages": Q, "max_tokens": 4, "temperature": 0}
        results[i] = raw(base, "POST", "/v1/chat/completions", body)

    before = worker.counts["cancelled"]
    threads = [threading.Thread(target=small, args=(i,)) for i in range(QUEUE - 1)]
    try:
        for t in threads:
            t.start()
        # one more that waits in the queue and then leaves
        leaver = send(base, "POST", "/v1/chat/completions", dict(LONG, stream=False))
        deadline = time.time() + 30
        while worker.health()["queue"]["waiting"] < QUEUE:
            assert time.time() < deadline, worker.health()
            time.sleep(0.02)
        status, headers, err = raw(base, "POST", "/v1/chat/completions", dict(LONG, max_tokens=2))
        assert status == 429 and int(headers["Retry-After"]) >= 1
        assert err["error"]["type"] == "rate_limit_error"
        # a request over a bound or with a bad setting is refused at once, not told to wait
        for bad, code in (
            (dict(M, max_tokens=10**7), "max_tokens_limit"),
            (dict(M, temperature=-1), "invalid_argument_error"),
            (mtp(method="probe", bc=7000), "bc_limit"),
            (mtp(method="pld", colour=1), "invalid_argument_error"),
            (mtp(method="clp", heads="/etc"), "artifact_not_allowed"),
        ):
            status, _, err = raw(base, "POST", "/v1/chat/completions", bad)
            assert status == 400 and err["error"]["code"] == code, err
        leaver.close()
    finally:
        resp.close()
        conn.close()
    for t in threads:
        t.join(120)
    want = ref(Q, n=4).text
    assert len(results) == QUEUE - 1
    for status, _, body in results.values():
        assert status == 200 and body["choices"][0]["message"]["content"] == want
    wait_idle(worker)
    assert worker.counts["cancelled"] == before + 2  # the stream and the queued leaver
    assert [j.generated_tokens for j in worker.recent if j.status == "cancelled"][-1] == 0
    # no request handler is left waiting for a job that will never run
    deadline = time.time() + 10
    while worker.http.server_state.tasks:
        assert time.time() < deadline, f"{len(worker.http.server_state.tasks)} handlers left"
        time.sleep(0.05)


def test_method_models_are_bounded_and_keep_the_default(server, client, monkeypatch):
    base, worker = server
    monkeypatch.setattr(worker, "max_methods", 2)
    for window in (1, 2, 3):
        client.chat.completions.create(
            model=MODEL,
            messages=Q,
            max_tokens=2,
            temperature=0,
            extra_body={"mtp": {"method": "pld", "window": window}},
        )
    loaded = raw(base, "GET", "/health")[2]["methods_loaded"]
    assert sorted(loaded) == ["ntp", "pld,window=3"], loaded


# ------------------------------------------------------- a hostile client's faults
@contextlib.contextmanager
def server_log() -> Iterator[list]:
    """The records of warning level and above that the server logs meanwhile
    (uvicorn's loggers do not reach pytest's root handler)."""
    import logging

    got: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record)

    handler = Keep(logging.WARNING)
    loggers = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.error", "mlx_mtp")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield got
    finally:
        for lg in loggers:
            lg.removeHandler(handler)


def _handlers_done(srv, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while srv.server_state.tasks:
        assert time.time() < deadline, f"{len(srv.server_state.tasks)} handlers left"
        time.sleep(0.02)


def _connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _head(path: str, **headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Authorization: Bearer {KEY}"]
    lines += ["Content-Type: application/json", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _read_all(s: socket.socket) -> bytes:
    out = b""
    while True:
        piece = s.recv(65536)
        if not piece:
            return out
        out += piece


def test_a_client_that_drops_mid_upload_leaves_no_traceback(server):
    """Headers, a few bytes of the body, then the client closes: a dropped
    upload is normal, so nothing of warning level or above is logged (it used
    to log ``ClientDisconnect`` twice, with tracebacks)."""
    base, worker = server
    with server_log() as records:
        for _ in range(3):
            s = _connect(base)
            s.sendall(_head(CHAT, **{"Content-Length": "1000"}) + b'{"model": "smol')
            time.sleep(0.2)
            s.close()
        time.sleep(0.3)
        _handlers_done(worker.http)
    assert not records, [r.getMessage() for r in records]
    assert_healthy(base, worker)


@pytest.mark.parametrize("how", ["content-length", "chunked"])
def test_a_large_body_sent_in_full_gets_413_not_a_reset(server, how):
    """9 MB sent in full (declared, or chunked with no length), asking the
    server to close after the answer: the client finishes sending and reads
    a 413 (it used to get a connection reset while still sending)."""
    base, worker = server
    n = 9 << 20
    s = _connect(base)
    if how == "chunked":
        s.sendall(_head(CHAT, **{"Transfer-Encoding": "chunked", "Connection": "close"}))
        piece = b"x" * 65536
        for _ in range(n // len(piece)):
            s.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
        s.sendall(b"0\r\n\r\n")
    else:
        s.sendall(_head(CHAT, **{"Content-Length": str(n), "Connection": "close"}))
        s.sendall(b"x" * n)  # a reset would raise here
    answer = _read_all(s)
    s.close()
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "body_too_large"
    # a client that waits for "100 Continue" is answered at once and sends nothing
    s = _connect(base)
    t0 = time.perf_counter()
    s.sendall(_head(CHAT, **{"Content-Length": str(n), "Expect": "100-continue"}))
    assert s.recv(64).startswith(b"HTTP/1.1 413 ") and time.perf_counter() - t0 < 10
    s.close()
    assert_healthy(base, worker)


def test_slow_clients_are_disconnected_after_the_client_timeout(server, ref):
    """Sockets that send only a request line, headers without their body, or
    half of a second request on a kept-alive connection are closed after
    ``client_timeout`` (the body: with a 408); a stream that runs longer than
    that is not cut."""
    base, worker = server
    with serving(worker, api_key=KEY, client_timeout=1.0) as (quick, srv):
        lines = [_connect(quick) for _ in range(5)]
        for s in lines:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")
        body = _connect(quick)
        body.sendall(_head(CHAT, **{"Content-Length": "100"}) + b'{"mo')
        kept = _connect(quick)
        kept.sendall(_head("/v1/models").replace(b"POST", b"GET"))
        first = b""
        while b"\r\n\r\n" not in first or not first.endswith(b"}"):  # one JSON answer
            first += kept.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 ")
        kept.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 12")
        t0 = time.perf_counter()
        got = []
        for s in [*lines, body, kept]:
            got.append(_read_all(s))
            s.close()
        took = time.perf_counter() - t0
        assert 0.5 < took < 10, took
        assert got[:5] == [b""] * 5 and got[6] == b""
        assert got[5].startswith(b"HTTP/1.1 408 ") and b"request_timeout" in got[5]
        # a stream longer than the client timeout runs to its end
        want = ref(LONG["messages"], n=24)
        t0 = time.perf_counter()
        chunks = list(
            openai.OpenAI(
                base_url=quick + "/v1", api_key=KEY, max_retries=0
            ).chat.completions.create(
                model=MODEL, messages=LONG["messages"], max_tokens=24, temperature=0, stream=True
            )
        )
        assert time.perf_counter() - t0 > 1.0  # (else this proves nothing)
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert_healthy(base, worker)


@pytest.mark.parametrize("max_batch", [1, 4], ids=["alone", "batched"])
def test_shutdown_ends_open_streams_with_a_final_chunk(server, ref, monkeypatch, max_batch):
    """The server shuts down while a stream is open: the pass under way
    finishes, the stream gets a final chunk (``finish_reason: "cancelled"``,
    with the usage asked for) and ``[DONE]``, and the server stops at once,
    nothing logged above info (it used to cut the stream after its 5 s
    graceful-shutdown time, with a ``CancelledError`` traceback). The other
    server on the same worker goes on."""
    base, worker = server
    monkeypatch.setattr(worker, "max_batch", max_batch)
    with server_log() as records, serving(worker, api_key=KEY) as (other, srv):
        conn, resp = _open_stream(other, dict(LONG, stream_options={"include_usage": True}))
        t0 = time.perf_counter()
        srv.should_exit = True
        rest = resp.fp.read().decode()  # raw, as _open_stream read: to the connection's end
        took = time.perf_counter() - t0
        conn.close()
    events = [line[6:] for line in rest.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    final, usage_chunk = json.loads(events[-3]), json.loads(events[-2])
    assert final["choices"][0]["finish_reason"] == "cancelled"
    assert final["mtp"]["method"] == ("ntp(batch)" if max_batch > 1 else "ntp")
    assert usage_chunk["usage"]["completion_tokens"] < 100
    assert took < 5 + worker.limits.max_forward_s, took
    assert not records, [r.getMessage() for r in records]
    assert worker.recent[-1].status == "cancelled"
    assert_healthy(base, worker)
    r = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model=MODEL, messages=Q, max_tokens=N, temperature=0
    )
    assert r.choices[0].message.content == ref(Q).text


#: (request, text its 400 message must hold): none may speak of a CLI flag
API_WORDS = [
    (dict(M, max_tokens=0), "max_tokens must be >= 1"),
    (dict(M, seed=2**64), "seed must be in [0, 18446744073709551615]"),
    (dict(M, temperature=-1), "temperature must be >= 0"),
    (dict(M, top_k=-1), "top_k must be >= 0"),
    (mtp(method="pld", colour=1), "does not take the option mtp.colour"),
    (mtp(method="draft"), "needs the option mtp.draft_model"),
    (mtp(method="probe", bc="abc"), "mtp.bc must be"),
    (mtp(method="probe", tree="6,3", masks=1), "mtp.tree 6,3 has depth 2 but mtp.masks 1"),
    (dict(M, max_tokens=4000, messages=FITS), "lower max_tokens."),
    (dict(M, max_tokens=4000, messages=WORDS), "Shorten the prompt to fewer than"),
]


@pytest.mark.parametrize("body,words", API_WORDS, ids=[w for _, w in API_WORDS])
def test_400_messages_speak_the_apis_language(server, body, words):
    base, worker = server
    status, _, err = raw(base, "POST", CHAT, body)
    message = err["error"]["message"]
    assert status == 400 and words in message, message
    assert "--" not in message and "e+" not in message, message
    assert_healthy(base, worker)


def test_the_cli_keeps_its_own_words():
    """The same checks, outside the server, still name the CLI's flags."""
    from mlx_mtp.errors import InvalidArgumentError
    from mlx_mtp.methods import make_method
    from mlx_mtp.validation import check_generation_args

    with pytest.raises(InvalidArgumentError, match=r"max_tokens \(--max-tokens\) must be >= 1"):
        check_generation_args(max_tokens=0, temp=0.0)
    with pytest.raises(InvalidArgumentError, match=r"seed \(--seed\) must be in \[0, 1844674"):
        check_generation_args(max_tokens=1, temp=0.0, seed=2**64)
    with pytest.raises(InvalidArgumentError, match="given as a flag or --opt key=value"):
        make_method("pld", colour=1)
    with pytest.raises(InvalidArgumentError, match="--draft-model MODEL"):
        make_method("draft")


def test_required_options_are_the_ones_methods_need():
    """REQUIRED_OPTIONS is complete: every other method builds without options."""
    from mlx_mtp.errors import InvalidArgumentError
    from mlx_mtp.methods import METHODS, make_method
    from mlx_mtp.server.worker import REQUIRED_OPTIONS

    for name in METHODS:
        if name in REQUIRED_OPTIONS:
            with pytest.raises(InvalidArgumentError):
                make_method(name)
        else:
            make_method(name)


# ------------------------------------------------------- continuous batching
def test_serve_batches_by_default():
    """`mlx-mtp serve` without --max-batch, and a Worker without max_batch,
    decode DEFAULT_MAX_BATCH (> 1) concurrent requests together."""
    import inspect

    import typer.main

    from mlx_mtp.cli import app
    from mlx_mtp.server import Worker
    from mlx_mtp.server.worker import DEFAULT_MAX_BATCH

    serve = typer.main.get_command(app).commands["serve"]
    (flag,) = [p for p in serve.params if p.name == "max_batch"]
    assert flag.default == DEFAULT_MAX_BATCH == 8
    assert inspect.signature(Worker).parameters["max_batch"].default == DEFAULT_MAX_BATCH


@contextlib.contextmanager
def batch_sizes(worker):
    """The worker's batch size sampled every 10 ms while the block runs."""
    seen: list[int] = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            seen.append(len(worker.batched()))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        yield seen
    finally:
        done.set()
        watcher.join()


def test_batched_ntp_requests_equal_their_solo_answers(server, client, ref, monkeypatch):
    """With --max-batch 4, concurrent ntp requests (chat and completion,
    streamed or not, greedy or seeded, one with a stop string) run in one
    batch, and each answer equals the Python API's solo answer; one client
    leaving mid-stream leaves the others exact; a request of another method
    waits for the batch and runs alone."""
    base, worker = server
    monkeypatch.setattr(worker, "max_batch", 4)
    monkeypatch.setattr(worker._queue, "maxsize", 8)  # six requests at once
    wait_idle(worker)
    prompts = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Write a haiku about the sea."}],
        [{"role": "user", "content": "Name three colours of the rainbow, and explain why."}],
    ]
    results: dict[str, object] = {}

    def chat(i, **kw):
        results[f"chat{i}"] = client.chat.completions.create(
            model=MODEL, messages=prompts[i], max_tokens=20, temperature=0, **kw
        )

    def stream(i):
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=prompts[i], max_tokens=20, temperature=0, stream=True
            )
        )
        results[f"stream{i}"] = "".join(c.choices[0].delta.content or "" for c in chunks)

    def sampled():
        results["sampled"] = client.chat.completions.create(
            model=MODEL, messages=prompts[2], max_tokens=10, temperature=0.9, seed=5
        )

    def completion():
        results["completion"] = client.completions.create(
            model=MODEL, prompt="The three primary colors are", max_tokens=12, temperature=0
        )

    def other_method():
        results["pld"] = client.chat.completions.create(
            model=MODEL, messages=prompts[0], max_tokens=8, temperature=0,
            extra_body={"mtp": {"method": "pld"}},
        )  # fmt: skip

    with batch_sizes(worker) as seen:
        leaver_conn, leaver = _open_stream(base, LONG)  # joins first, leaves mid-stream
        threads = [
            threading.Thread(target=chat, args=(0,)),
            threading.Thread(target=stream, args=(1,)),
            threading.Thread(target=sampled),
            threading.Thread(target=completion),
            threading.Thread(target=other_method),
        ]
        for t in threads:
            t.start()
            time.sleep(0.05)
        leaver.close()
        leaver_conn.close()
        for t in threads:
            t.join(300)
    assert max(seen) >= 2, "never batched"
    assert max(seen) <= 4
    r = results["chat0"]
    assert r.choices[0].message.content == ref(prompts[0], n=20).text
    assert r.model_extra["mtp"]["method"] == "ntp(batch)"
    assert r.model_extra["mtp"]["runner"] == "batched"
    assert r.usage.completion_tokens == len(ref(prompts[0], n=20).tokens)
    assert results["stream1"] == ref(prompts[1], n=20).text
    want = ref(prompts[2], n=10, sampling={"temp": 0.9, "seed": 5}).text
    assert results["sampled"].choices[0].message.content == want
    want = ref("The three primary colors are", chat=False, n=12).text
    assert results["completion"].choices[0].text == want
    assert results["pld"].choices[0].message.content == ref(prompts[0], "pld", n=8).text
    assert results["pld"].model_extra["mtp"]["method"].startswith("pld")
    # the leaver was cancelled, not run to its 2000 tokens
    deadline = time.time() + 60
    while worker.batched():
        assert time.time() < deadline
        time.sleep(0.05)
    left = [j for j in worker.recent if j.request.max_tokens == LONG["max_tokens"]][-1]
    assert left.status == "cancelled" and left.generated_tokens < 200
    # a stop string ends a batched request early
    want = ref(Q, n=N).text
    stop = want[8:12]
    r = client.chat.completions.create(
        model=MODEL, messages=Q, max_tokens=N, temperature=0, stop=[stop]
    )
    assert r.choices[0].message.content == want[: want.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert_healthy(base, worker)


def test_batched_ntp_requests_start_from_a_finished_requests_cache(
    server, client, ref, monkeypatch
):
    """A batched ntp request whose prompt shares a prefix with the newest
    finished one (a system prompt, a chat's history) starts from that
    prefix's KV cache: usage counts those tokens as cached, and every
    answer still equals the Python API's solo answer."""
    base, worker = server
    monkeypatch.setattr(worker, "max_batch", 4)
    monkeypatch.setattr(worker._queue, "maxsize", 8)  # three requests at once
    wait_idle(worker)
    system = {
        "role": "system",
        "content": "You are a careful assistant. Answer in one short sentence, plainly.",
    }
    first = [system, {"role": "user", "content": "What is the capital of France?"}]
    r0 = client.chat.completions.create(model=MODEL, messages=first, max_tokens=N, temperature=0)
    assert r0.model_extra["mtp"]["method"] == "ntp(batch)"
    assert r0.choices[0].message.content == ref(first, n=N).text
    results: dict[int, object] = {}
    asks = [
        [system, {"role": "user", "content": "Name a large river in Africa."}],
        [system, {"role": "user", "content": "What colour is the sky?"}],
        # the first chat's next turn: its history is cached
        [*first, {"role": "assistant", "content": r0.choices[0].message.content},
         {"role": "user", "content": "And of Spain?"}],
    ]  # fmt: skip

    def chat(i):
        results[i] = client.chat.completions.create(
            model=MODEL, messages=asks[i], max_tokens=N, temperature=0
        )

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(len(asks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for i, messages in enumerate(asks):
        r = results[i]
        assert r.choices[0].message.content == ref(messages, n=N).text, i
        cached = r.usage.prompt_tokens_details.cached_tokens
        assert 8 <= cached < r.usage.prompt_tokens, (i, cached)
        assert r.model_extra["mtp"]["prefill_tokens"] == r.usage.prompt_tokens - cached
    # the next turn shares the whole first exchange but its last token
    history = len(worker.loaded.tokenizer.apply_chat_template(first, add_generation_prompt=True))
    assert results[2].usage.prompt_tokens_details.cached_tokens > history
    assert_healthy(base, worker)


def test_a_bad_prompt_in_the_batch_is_a_400_and_the_batch_goes_on(server, monkeypatch):
    """Prompts the API refuses (over the context, token ids outside the
    vocabulary) are refused as they join the batch, as when alone."""
    base, worker = server
    monkeypatch.setattr(worker, "max_batch", 4)
    status, _, err = raw(base, "POST", CHAT, dict(M, messages=WORDS))
    assert status == 400 and err["error"]["code"] == "context_length_exceeded", err
    assert "--" not in err["error"]["message"]
    body = {"model": MODEL, "prompt": [1, 2, 10**9], "max_tokens": 2}
    status, _, err = raw(base, "POST", "/v1/completions", body)
    assert status == 400 and "vocabulary" in err["error"]["message"], err
    status, _, body = raw(base, "POST", CHAT, M)
    assert status == 200 and body["mtp"]["method"] == "ntp(batch)"
    assert_healthy(base, worker)


def test_a_failure_in_the_batch_is_a_500_and_the_server_goes_on(server, monkeypatch):
    """An exception while the batch steps (a bug, an MLX failure) answers
    its requests 500 and starts a new batch; the next request is served."""
    from mlx_mtp.server.batch import BatchRunner

    base, worker = server
    monkeypatch.setattr(worker, "max_batch", 4)
    real = BatchRunner.step
    calls = {"n": 0}

    def failing_once(self):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated MLX failure")
        return real(self)

    monkeypatch.setattr(BatchRunner, "step", failing_once)
    status, _, err = raw(base, "POST", CHAT, dict(M, max_tokens=8))
    assert status == 500 and "simulated MLX failure" in err["error"]["message"], err
    status, _, body = raw(base, "POST", CHAT, M)
    assert status == 200 and body["mtp"]["method"] == "ntp(batch)"
    assert_healthy(base, worker)


def concurrent_chats(client, worker, prompts, method, n):
    """Greedy chat requests of ``method`` (None: the server's) for every
    prompt at once (``n`` tokens each); returns the answers by index and the
    batch sizes seen."""
    results: dict[int, object] = {}

    def chat(i):
        mtp = {} if method is None else {"extra_body": {"mtp": {"method": method}}}
        results[i] = client.chat.completions.create(
            model=MODEL, messages=prompts[i], max_tokens=n, temperature=0, **mtp
        )

    with batch_sizes(worker) as seen:
        threads = [threading.Thread(target=chat, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    return results, seen


def test_batched_pld_requests_draft_in_one_pass_and_equal_their_solo_answers(
    server, client, ref, monkeypatch
):
    """With --max-batch 4, concurrent greedy pld requests run in one drafting
    batch (each row's prompt-lookup draft verified in the batch's pass) and
    each answer equals the Python API's solo pld answer; a sampled pld
    request runs alone."""
    base, worker = server
    monkeypatch.setattr(worker, "max_batch", 4)
    monkeypatch.setattr(worker._queue, "maxsize", 8)  # three requests at once
    wait_idle(worker)
    prompts = [
        [{"role": "user", "content": "Repeat exactly: one two three four five six seven."}],
        [{"role": "user", "content": "Write a haiku about the sea."}],
        [{"role": "user", "content": "What is the capital of France?"}],
    ]
    results, seen = concurrent_chats(client, worker, prompts, "pld", 20)
    assert max(seen) >= 2, "never batched"
    for i, p in enumerate(prompts):
        r = results[i]
        assert r.choices[0].message.content == ref(p, "pld", n=20).text
        assert r.model_extra["mtp"]["method"] == "pld(batch)"
    # a stop string ends a drafting row early, mid-draft or not
    want = ref(prompts[0], "pld", n=20).text
    stop = want[6:10]
    r = client.chat.completions.create(
        model=MODEL, messages=prompts[0], max_tokens=20, temperature=0, stop=[stop],
        extra_body={"mtp": {"method": "pld"}},
    )  # fmt: skip
    assert r.choices[0].message.content == want[: want.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert r.model_extra["mtp"]["method"] == "pld(batch)"
    r = client.chat.completions.create(
        model=MODEL, messages=prompts[0], max_tokens=8, temperature=0.8, seed=3,
        extra_body={"mtp": {"method": "pld"}},
    )  # fmt: skip
    assert r.model_extra["mtp"]["method"].startswith("pld(")
    assert r.model_extra["mtp"]["method"] != "pld(batch)"
    assert_healthy(base, worker)


def test_batched_requests_of_the_servers_draft_model_equal_their_solo_answers(
    server, client, ref, monkeypatch, near_draft
):
    """A server whose method is ``draft`` (its draft model given at start):
    with --max-batch 4, concurrent greedy requests of that method run in one
    batch, the draft model drafting every row's chain in batched passes of
    its own, and each answer is the solo greedy one."""
    base, worker = server
    monkeypatch.setattr(worker, "max_batch", 4)
    monkeypatch.setattr(worker._queue, "maxsize", 8)
    monkeypatch.setattr(worker, "method", "draft")
    monkeypatch.setattr(worker, "options", {"draft_model": near_draft})
    wait_idle(worker)
    prompts = [
        [{"role": "user", "content": "Write a haiku about the sea."}],
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Name three colours of the rainbow."}],
    ]
    results, seen = concurrent_chats(client, worker, prompts, None, 16)
    assert max(seen) >= 2, "never batched"
    for i, p in enumerate(prompts):
        r = results[i]
        assert r.choices[0].message.content == ref(p, "ntp", n=16).text
        assert r.model_extra["mtp"]["method"] == "draft(batch)"
    assert_healthy(base, worker)


@pytest.mark.parametrize("method", ["probe", "hybrid", "clp", "lookahead"])
def test_batched_probe_hybrid_clp_and_lookahead_requests_draft_and_equal_their_solo_answers(
    server, client, ref, monkeypatch, method
):
    """With --max-batch 4, concurrent greedy probe (or hybrid) requests run
    in one batch whose passes carry ESP's mask slots after every token slot,
    clp requests one whose heads write each row's next chain (pass times
    made flat, as a GPU's, so that the batch drafts); each answer equals
    the Python API's solo answer."""
    from mlx_mtp.batching import DraftBatch

    base, worker = server
    monkeypatch.setattr(worker, "max_batch", 4)
    monkeypatch.setattr(worker._queue, "maxsize", 8)
    monkeypatch.setattr(DraftBatch, "_cost", lambda self, slots: 1.0)
    drafted = []
    real = DraftBatch.step

    def step(self):
        out = real(self)
        drafted.append(sum(r.drafted for r in self.rows))
        return out

    monkeypatch.setattr(DraftBatch, "step", step)
    wait_idle(worker)
    prompts = [
        [{"role": "user", "content": "Write a haiku about the sea."}],
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Name three colours of the rainbow."}],
    ]
    results, seen = concurrent_chats(client, worker, prompts, method, 16)
    assert max(seen) >= 2, "never batched"
    assert max(drafted) > 0
    for i, p in enumerate(prompts):
        r = results[i]
        assert r.choices[0].message.content == ref(p, method, n=16).text
        assert r.model_extra["mtp"]["method"] == f"{method}(batch)"
    assert_healthy(base, worker)


def test_a_draft_model_that_cannot_batch_leaves_the_requests_to_run_alone(
    server, monkeypatch, near_draft, gemma
):
    """Whether the server's draft model can draft inside a batch is checked
    before a batch is made: one of another tokenizer (Gemma 3 for SmolLM2)
    cannot, so its requests are not batched (they run alone, where the
    method gives its own error); the nudged SmolLM2 can."""
    base, worker = server
    monkeypatch.setattr(worker, "method", "draft")
    monkeypatch.setattr(worker, "_draft_batchable", {})
    monkeypatch.setattr(worker, "options", {"draft_model": gemma})
    assert worker._drafts_batch("draft") is False
    monkeypatch.setattr(worker, "_draft_batchable", {})
    monkeypatch.setattr(worker, "options", {"draft_model": near_draft})
    assert worker._drafts_batch("draft") is True
    assert_healthy(base, worker)


def test_batched_recycle_requests_equal_their_solo_answers_and_keep_the_table(
    server, client, ref, monkeypatch
):
    """With --max-batch 4, concurrent greedy recycle requests run in one
    drafting batch (lookup chains, else chains from the table of the model's
    own predictions) and each answer equals the Python API's solo recycle
    answer; the table outlives the batch, and the next batch drafts from it."""
    base, worker = server
    monkeypatch.setattr(worker, "max_batch", 4)
    monkeypatch.setattr(worker._queue, "maxsize", 8)
    monkeypatch.setattr(worker, "_recycle_table", None)
    wait_idle(worker)
    prompts = [
        [{"role": "user", "content": "Write a haiku about the sea."}],
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Name three colours of the rainbow."}],
    ]
    results, seen = concurrent_chats(client, worker, prompts, "recycle", 16)
    assert max(seen) >= 2, "never batched"
    for i, p in enumerate(prompts):
        r = results[i]
        assert r.choices[0].message.content == ref(p, "recycle", n=16).text
        assert r.model_extra["mtp"]["method"] == "recycle(batch)"
    table = worker._recycle_table
    assert table is not None and int((table.table >= 0).any(axis=1).sum()) > 20
    r = client.chat.completions.create(
        model=MODEL, messages=prompts[0], max_tokens=16, temperature=0,
        extra_body={"mtp": {"method": "recycle"}},
    )  # fmt: skip
    assert r.choices[0].message.content == ref(prompts[0], "recycle", n=16).text
    assert worker._recycle_table is table  # one table across batches
    assert_healthy(base, worker)
