"""Bounded soak of ``mlx-mtp serve`` on this machine (loopback only).

Starts ``mlx-mtp serve`` (with an API key) on 127.0.0.1 at a free port in a
child process and runs ``--clients`` concurrent clients for ``--duration``
seconds (or ``--requests`` each). Each request is drawn from a seeded mix:

- **valid** (chat and text completions, streamed or not; methods ntp, pld,
  probe bc=10 or the server's default; greedy, or sampled with a seed):
  every answer is checked afterwards against the same generation through the
  Python API (``mlx_mtp.load(...).generate``) and must be equal;
- **invalid** (malformed JSON, unknown fields, bounds exceeded, files named,
  browser-style requests, ...): each must get its expected status;
- **abandoned**: a stream closed after its first event, or a request closed
  before its answer: the server must cancel it and go on.

While it runs, the server's memory (RSS) and ``/health`` are sampled every few
seconds. Afterwards the server is stopped with SIGINT (it must exit 130). The
figures: requests of each kind, answers wrong or lost, latency, queue wait
against the queue bound (``--queue-timeout``), memory in the first and last
minutes. Exit status 1 if anything was wrong.

    taskset -c 1 env OPENBLAS_NUM_THREADS=1 nice -n 10 .venv/bin/python \\
        examples/serve_load.py --clients 8 --duration 600 [--json out.json]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np

HOST = "127.0.0.1"  # never any other address
MODEL = "smollm2-135m"
KEY = "soak-key"
PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
    "What is 12 times 12?",
    "Give a synonym for 'happy'.",
    "What language is spoken in Brazil?",
    "Name a planet in the solar system.",
    "What do bees make?",
]
METHODS = [None, {"method": "pld"}, {"method": "probe", "bc": 10}, {"method": "ntp"}]
#: share of valid, invalid and abandoned requests
MIX = (0.6, 0.25, 0.15)
CHAT = "/v1/chat/completions"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def valid_request(rng: random.Random, max_tokens: int) -> dict:
    """A valid request: its path, body and what the API needs to redo it."""
    kind = rng.choice(["chat", "completion"])
    text = rng.choice(PROMPTS)
    body: dict = {"model": MODEL, "max_tokens": max_tokens}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    mtp = rng.choice(METHODS)
    if mtp:
        body["mtp"] = mtp
    sampling = {"temp": 0.0}
    if rng.random() < 0.25:  # seeded sampling: the same text whatever the method
        sampling = {"temp": 0.8, "top_p": 0.95, "seed": rng.randrange(1000)}
        body.update(temperature=0.8, top_p=0.95, seed=sampling["seed"])
    else:
        body["temperature"] = 0
    body["stream"] = rng.random() < 0.5
    path = CHAT if kind == "chat" else "/v1/completions"
    return {"kind": kind, "text": text, "mtp": mtp, "sampling": sampling, "path": path,
            "body": body}  # fmt: skip


M = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
#: (label, body or raw bytes, extra headers, expected status)
INVALID: list[tuple[str, object, dict, int]] = [
    ("not json", b"{not json", {}, 400),
    ("nested", b"[" * 50_000, {}, 400),
    ("unknown field", dict(M, colour="red"), {}, 400),
    ("unknown model", dict(M, model="gpt-4o"), {}, 404),
    ("n=2", dict(M, n=2), {}, 400),
    ("temperature -1", dict(M, temperature=-1), {}, 400),
    ("max_tokens over the bound", dict(M, max_tokens=10**6), {}, 400),
    ("bc 7000", dict(M, mtp={"method": "probe", "bc": 7000}), {}, 400),
    ("a file", dict(M, mtp={"method": "clp", "heads": "/etc/shadow"}), {}, 400),
    ("a repo", dict(M, mtp={"method": "mtp", "heads": "org/name"}), {}, 400),
    ("option not taken", dict(M, mtp={"method": "pld", "colour": 1}), {}, 400),
    ("prompt over the context", dict(M, messages=[{"role": "user", "content": "w " * 9000}]),
     {}, 400),
    ("text/plain", M, {"Content-Type": "text/plain"}, 415),
    ("cross-origin", M, {"Origin": "http://evil.example"}, 403),
    ("rebinding Host", M, {"Host": "evil.example"}, 400),
    ("no key", M, {"Authorization": None}, 401),
]  # fmt: skip


def connect(port: int, method: str, path: str, body: object, headers: dict | None = None):
    conn = http.client.HTTPConnection(HOST, port, timeout=900)
    hdrs = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}",
            **(headers or {})}  # fmt: skip
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.putrequest(method, path, skip_host="Host" in hdrs, skip_accept_encoding=True)
    for k, v in hdrs.items():
        if v is not None:
            conn.putheader(k, v)
    conn.putheader("Content-Length", str(len(data)))
    conn.endheaders(data)
    return conn


def send_valid(port: int, req: dict) -> dict:
    """Send one valid request (retrying after 429/503); returns text and timings."""
    retries, t0 = 0, time.perf_counter()
    while True:
        conn = connect(port, "POST", req["path"], req["body"])
        resp = conn.getresponse()
        if resp.status in (429, 503):
            wait = float(resp.headers.get("Retry-After", "1"))
            resp.read()
            conn.close()
            retries += 1
            time.sleep(wait)
            continue
        if resp.status != 200:
            out = {"error": f"HTTP {resp.status}: {resp.read()[:300]!r}"}
            conn.close()
            return out
        if req["body"]["stream"]:
            text, mtp, done = [], None, False
            for line in resp:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                ev = json.loads(data)
                if "error" in ev:
                    return {"error": ev["error"]["message"]}
                for c in ev["choices"]:
                    piece = c["delta"].get("content") if req["kind"] == "chat" else c["text"]
                    text.append(piece or "")
                mtp = ev.get("mtp", mtp)
            if not done:
                return {"error": "stream ended without [DONE]"}
            text = "".join(text)
        else:
            obj = json.loads(resp.read())
            c = obj["choices"][0]
            text = c["message"]["content"] if req["kind"] == "chat" else c["text"]
            mtp = obj["mtp"]
        conn.close()
        return {"text": text, "latency_s": time.perf_counter() - t0,
                "queue_wait_s": mtp["queue_wait_s"], "retries": retries}  # fmt: skip


def send_invalid(port: int, case: tuple) -> dict:
    """Send one invalid request (retrying after 429/503: a request that needs
    the model to be refused, such as a prompt over the context, waits its
    turn); returns its status and whether it was the expected one."""
    label, body, headers, want = case
    while True:
        conn = connect(port, "POST", CHAT, body, headers)
        resp = conn.getresponse()
        payload = resp.read()
        conn.close()
        if resp.status not in (429, 503) or want in (429, 503):
            break
        time.sleep(float(resp.headers.get("Retry-After", "1")))
    ok = resp.status == want and b'"error"' in payload  # an OpenAI-shaped error
    return {"label": label, "status": resp.status, "want": want, "ok": ok}


def send_abandoned(port: int, rng: random.Random, max_tokens: int) -> dict:
    """A long request given up part way: a stream after its first event, or a
    non-streamed request a moment after sending it."""
    body = {"model": MODEL, "max_tokens": 400, "temperature": 0,
            "messages": [{"role": "user", "content": "Count from 1 to 300."}]}  # fmt: skip
    if rng.random() < 0.5:
        body["stream"] = True
        conn = connect(port, "POST", CHAT, body)
        resp = conn.getresponse()
        if resp.status == 200:
            resp.fp.readline()
        resp.close()
    else:
        conn = connect(port, "POST", CHAT, body)
        time.sleep(rng.uniform(0.05, 1.0))
    conn.close()
    return {"abandoned": True}


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def health(port: int) -> dict:
    conn = connect(port, "GET", "/health", b"")
    resp = conn.getresponse()
    out = json.loads(resp.read())
    conn.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    ap.add_argument("--requests", type=int, default=None, help="per client (instead)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--method", default="ntp", help="the server's default method")
    ap.add_argument("--queue-size", type=int, default=8)
    ap.add_argument("--max-batch", type=int, default=1, help="the server's --max-batch")
    ap.add_argument("--queue-timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()

    port = free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "mlx-mtp")
    cmd = [
        exe, "serve", "--model", MODEL, "--method", args.method, "--dtype", "float32",
        "--host", HOST, "--port", str(port), "--api-key", KEY, "--queue-size",
        str(args.queue_size), "--queue-timeout", str(args.queue_timeout),
        "--log-level", "warning", "--max-batch", str(args.max_batch),
    ]  # fmt: skip
    server = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    results: list[dict] = []
    samples: list[tuple[float, float, str]] = []  # (seconds, RSS MB, health status)
    lock = threading.Lock()
    try:
        deadline = time.time() + 600
        while True:
            try:
                if health(port)["status"] == "ok":
                    break
            except OSError:
                pass
            if server.poll() is not None or time.time() > deadline:
                print("server did not start:", server.stderr.read(), file=sys.stderr)
                return 1
            time.sleep(0.5)

        t0 = time.perf_counter()
        end = t0 + args.duration
        stop = threading.Event()

        def client(c: int) -> None:
            rng = random.Random(args.seed * 1000 + c)
            n = 0
            while not stop.is_set():
                if args.requests is not None and n >= args.requests:
                    return
                if args.requests is None and time.perf_counter() >= end:
                    return
                n += 1
                r = rng.random()
                try:
                    if r < MIX[0]:
                        req = valid_request(rng, args.max_tokens)
                        out = {"type": "valid", "req": req, **send_valid(port, req)}
                    elif r < MIX[0] + MIX[1]:
                        out = {"type": "invalid", **send_invalid(port, rng.choice(INVALID))}
                    else:
                        out = {"type": "abandoned", **send_abandoned(port, rng, args.max_tokens)}
                except Exception as e:  # a lost request is reported, not raised
                    out = {"type": "lost", "error": f"{type(e).__name__}: {e}"}
                with lock:
                    results.append(out)

        def sampler() -> None:
            while not stop.is_set():
                try:
                    status = health(port)["status"]
                except Exception as e:
                    status = f"{type(e).__name__}"
                samples.append((time.perf_counter() - t0, rss_mb(server.pid), status))
                stop.wait(5.0)

        threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
        mon = threading.Thread(target=sampler)
        mon.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        settle = time.time() + 60  # the last jobs' bookkeeping ends after their answers
        while True:
            final_health = health(port)
            if not final_health["busy"] and not final_health["queue"]["waiting"]:
                break
            if time.time() > settle:
                break
            time.sleep(0.2)
        time.sleep(0.5)
        final_health = health(port)
        stop.set()
        mon.join()
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            server.kill()
    server_err = server.stderr.read()

    # every valid answer through the Python API, one by one
    import mlx_mtp

    models: dict = {}
    memo: dict = {}
    wrong, failed = [], []
    for out in results:
        if out["type"] != "valid":
            continue
        if "error" in out:
            failed.append(out["error"])
            continue
        r = out["req"]
        opts = dict(r["mtp"] or {"method": args.method})
        method = opts.pop("method")
        key = (method, tuple(sorted(opts.items())))
        if key not in models:
            models[key] = mlx_mtp.load(MODEL, method, dtype="float32", **opts)
        prompt = [{"role": "user", "content": r["text"]}] if r["kind"] == "chat" else r["text"]
        mkey = (key, r["kind"], r["text"], tuple(sorted(r["sampling"].items())))
        if mkey not in memo:
            memo[mkey] = (
                models[key]
                .generate(
                    prompt,
                    max_tokens=args.max_tokens,
                    chat_template=r["kind"] == "chat",
                    **r["sampling"],
                )
                .text
            )
        if out["text"] != memo[mkey]:
            wrong.append((r["body"], out["text"], memo[mkey]))

    valid = [o for o in results if o["type"] == "valid" and "error" not in o]
    invalid = [o for o in results if o["type"] == "invalid"]
    bad_status = [o for o in invalid if not o["ok"]]
    lost = [o for o in results if o["type"] == "lost"]
    lat = np.array([o["latency_s"] for o in valid]) if valid else np.zeros(1)
    qw = np.array([o["queue_wait_s"] for o in valid]) if valid else np.zeros(1)
    first = [m for s, m, _ in samples if s <= 60]
    last = [m for s, m, _ in samples if s >= samples[-1][0] - 60] if samples else []
    unhealthy = [(round(s), h) for s, _, h in samples if h != "ok"]
    figures = {
        "command": " ".join(["examples/serve_load.py", *sys.argv[1:]]),
        "hardware": f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs"
        + (
            f", on CPUs {sorted(os.sched_getaffinity(0))}"
            if hasattr(os, "sched_getaffinity")
            else ""
        ),
        "model": f"{MODEL} float32, server method {args.method}",
        "clients": args.clients,
        "wall_s": round(wall, 1),
        "requests": len(results),
        "valid": sum(o["type"] == "valid" for o in results),
        "valid_answered": len(valid),
        "valid_correct": len(valid) - len(wrong),
        "valid_failed": len(failed),
        "invalid": len(invalid),
        "invalid_wrong_status": len(bad_status),
        "abandoned": sum(o["type"] == "abandoned" for o in results),
        "lost": len(lost),
        "retried_429_503": sum(o["retries"] for o in valid),
        "latency_p50_s": round(float(np.percentile(lat, 50)), 3),
        "latency_p95_s": round(float(np.percentile(lat, 95)), 3),
        "latency_max_s": round(float(lat.max()), 3),
        "queue_wait_p50_s": round(float(np.percentile(qw, 50)), 3),
        "queue_wait_max_s": round(float(qw.max()), 3),
        "queue_bound_s": args.queue_timeout,
        "rss_first_min_mb": round(float(np.median(first)), 1) if first else None,
        "rss_last_min_mb": round(float(np.median(last)), 1) if last else None,
        "rss_max_mb": round(max(m for _, m, _ in samples), 1) if samples else None,
        "health_samples": len(samples),
        "unhealthy_samples": len(unhealthy),
        "server_jobs": final_health.get("jobs"),
        "server_exit": server.returncode,
    }
    for k, v in figures.items():
        print(f"{k:22s} {v}")
    for body, got, want in wrong[:5]:
        print(f"WRONG {json.dumps(body)[:200]}: got {got!r}, want {want!r}", file=sys.stderr)
    for e in (failed + [o["error"] for o in lost])[:5]:
        print(f"FAILED: {e}", file=sys.stderr)
    for o in bad_status[:5]:
        print(f"BAD STATUS {o['label']}: {o['status']}, want {o['want']}", file=sys.stderr)
    for s in unhealthy[:5]:
        print(f"UNHEALTHY at {s[0]} s: {s[1]}", file=sys.stderr)
    if "Traceback" in server_err or "terminate called" in server_err:
        print("server stderr:\n" + server_err[-3000:], file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    grew = (
        figures["rss_first_min_mb"] is not None
        and figures["rss_last_min_mb"] > 1.10 * figures["rss_first_min_mb"] + 50
    )
    ok = not (wrong or failed or lost or bad_status or unhealthy or grew)
    ok = ok and server.returncode == 130 and figures["queue_wait_max_s"] <= args.queue_timeout
    ok = ok and "Traceback" not in server_err and "terminate called" not in server_err
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
