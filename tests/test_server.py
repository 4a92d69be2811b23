"""``mlx-mtp serve``: the OpenAI-compatible server, checked with the real
``openai`` client against a server on a free loopback port in this process
(SmolLM2-135M float32, a few tokens per request). Raw HTTP (malformed bodies,
disconnects) goes through the standard library's ``http.client``."""

from __future__ import annotations

import http.client
import json
import socket
import sys
import threading
import time

import openai  # the dev extra installs it, with starlette and uvicorn (a missing one fails)
import pytest

from mlx_mtp.server.protocol import OpenAIError, StopCutter, parse_request

MODEL = "smollm2-135m"
KEY = "test-key-123"
QUEUE = 2
N = 12  # new tokens per request


@pytest.fixture(scope="module")
def server():
    """(base_url, worker): a server with the embedded model, default method ntp,
    an API key and a queue of QUEUE, on 127.0.0.1 at a free port."""
    from mlx_mtp.server import Worker, make_server

    worker = Worker(MODEL, "ntp", dtype="float32", max_tokens=N, queue_size=QUEUE)
    worker.start()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = make_server(worker, "127.0.0.1", port, api_key=KEY, log_level="warning")
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started:
        assert time.time() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    worker.http = srv  # for the tests that look at open connections
    yield f"http://127.0.0.1:{port}", worker
    srv.should_exit = True
    thread.join(15)
    worker.stop()
    sock.close()


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
    conn.request(method, path, body=data, headers=hdrs)
    return conn


def raw(base, method, path, body=None, headers=None, key=KEY):
    """(status, headers, parsed JSON) of one request through http.client."""
    conn = send(base, method, path, body, headers, key)
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    return resp.status, resp.headers, json.loads(payload) if payload else None


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
    # the warning comes before anything is loaded or bound (the model is missing here)
    argv = ["mlx-mtp", "serve", "--host", "0.0.0.0", "--model", "/no/such/model"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as e:
        cli.main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and "WARNING: binding 0.0.0.0" in err and "no --api-key" in err
    assert "No such model" in err


# ------------------------------------------------------------------ end to end
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    status, _, body = raw(server[0], "GET", "/health", key=None)
    assert status == 200 and body["status"] == "ok" and body["model"] == MODEL
    assert raw(server[0], "GET", f"/v1/models/{MODEL}")[2]["id"] == MODEL
    status, _, body = raw(server[0], "GET", "/v1/models/gpt-4o")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, _, body = raw(server[0], "POST", "/v1/completions", b"x" * (9 << 20))
    assert status == 413 and "error" in body


def test_chat_equals_generate(client, ref):
    r = client.chat.completions.create(model=MODEL, messages=Q, max_tokens=N, temperature=0)
    want = ref(Q)
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.completion_tokens == len(want.tokens)
    assert r.usage.prompt_tokens == want.stats.prompt_tokens
    assert r.model_extra["mtp"]["method"] == "ntp"


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
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=N, temperature=0, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == want.text  # ntp: same greedy text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


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


def test_bad_requests_get_json_errors_and_the_server_keeps_answering(server, client, ref):
    base = server[0]
    msg = {"model": MODEL, "messages": Q, "max_tokens": 2}
    cases = [
        (b"{not json", 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_json"),
        (dict(msg, model="gpt-4o"), 404, "model_not_found"),
        (dict(msg, n=3), 400, None),
        (dict(msg, temperature=-1), 400, None),
        (dict(msg, max_tokens=0), 400, None),
        (dict(msg, max_tokens=10**7), 400, "context_length_exceeded"),
        (
            dict(msg, messages=[{"role": "user", "content": "word " * 9000}]),
            400,
            "context_length_exceeded",
        ),
        (dict(msg, mtp={"method": "no-such-method"}), 400, None),
        (dict(msg, mtp={"method": "pld", "window": 0}), 400, None),
        (dict(msg, mtp={"method": "pld", "colour": "red"}), 400, None),
        (dict(msg, stop=[""]), 400, None),
    ]
    for body, status, code in cases:
        got, _, err = raw(base, "POST", "/v1/chat/completions", body)
        assert got == status, (body if isinstance(body, bytes) else str(body)[:80], err)
        assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
        if code:
            assert err["error"]["code"] == code
    got, _, err = raw(base, "POST", "/v1/completions", {"model": MODEL, "prompt": ""})
    assert got == 400 and err["error"]["param"] == "prompt"
    got, _, err = raw(base, "GET", "/v1/nothing-here")
    assert got == 404 and "error" in err
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=Q, n=2)
    # still serving, and correctly
    r = client.chat.completions.create(model=MODEL, messages=Q, max_tokens=N, temperature=0)
    assert r.choices[0].message.content == ref(Q).text


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
    loaded = raw(base, "GET", "/health", key=None)[2]["methods_loaded"]
    assert sorted(loaded) == ["ntp", "pld,window=3"], loaded
