"""Bounded load test of ``mlx-mtp serve`` on this machine (loopback only).

Starts ``mlx-mtp serve`` on 127.0.0.1 at a free port in a child process, runs
``--clients`` concurrent clients that each send ``--requests`` requests (chat
and text completions, streamed or not, methods ntp / pld / probe in turn, all
at temperature 0), stops the server, then checks every answer against the same
generation through the Python API (``mlx_mtp.load(...).generate``): none may be
lost or differ. Prints p50/p95 latency (client side, request sent to last
byte) and queue wait (the ``mtp.queue_wait_s`` the server reports), and exits
with status 1 if anything was wrong. Requests refused with 429 are retried
after ``Retry-After`` and counted (their latency includes those waits).

    OPENBLAS_NUM_THREADS=1 .venv/bin/python examples/serve_load.py [--clients 8]
        [--requests 4] [--max-tokens 16] [--method ntp] [--json out.json]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time

import numpy as np
from tqdm import tqdm

HOST = "127.0.0.1"  # never any other address
MODEL = "smollm2-135m"
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
METHODS = [None, {"method": "pld"}, {"method": "probe", "bc": 10}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def request(port: int, i: int, max_tokens: int) -> dict:
    """The i-th request of the run: its path, body and settings."""
    kind = "chat" if i % 2 == 0 else "completion"
    text = PROMPTS[i % len(PROMPTS)]
    body: dict = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    mtp = METHODS[(i // 2) % len(METHODS)]
    if mtp:
        body["mtp"] = mtp
    body["stream"] = (i // 3) % 2 == 1
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    return {"i": i, "kind": kind, "text": text, "mtp": mtp, "path": path, "body": body}


def send(port: int, req: dict) -> dict:
    """Send one request (retrying after 429); returns text, latency, queue wait."""
    retries, t0 = 0, time.perf_counter()  # latency includes waits after 429
    while True:
        conn = http.client.HTTPConnection(HOST, port, timeout=600)
        conn.request(
            "POST",
            req["path"],
            body=json.dumps(req["body"]).encode(),
            headers={"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        if resp.status == 429:
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
        return {
            "text": text,
            "latency_s": time.perf_counter() - t0,
            "queue_wait_s": mtp["queue_wait_s"],
            "tau": mtp["tau"],
            "retries": retries,
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=4, help="per client")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--method", default="ntp", help="the server's default method")
    ap.add_argument("--queue-size", type=int, default=8)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()

    port = free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "mlx-mtp")
    cmd = [
        exe, "serve", "--model", MODEL, "--method", args.method,
        "--dtype", "float32", "--host", HOST, "--port", str(port),
        "--queue-size", str(args.queue_size), "--log-level", "warning",
    ]  # fmt: skip
    server = subprocess.Popen(cmd)
    try:
        deadline = time.time() + 300
        while True:
            try:
                conn = http.client.HTTPConnection(HOST, port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            if server.poll() is not None or time.time() > deadline:
                print("server did not start", file=sys.stderr)
                return 1
            time.sleep(0.5)

        n = args.clients * args.requests
        reqs = [request(port, i, args.max_tokens) for i in range(n)]
        results: dict[int, dict] = {}
        bar = tqdm(total=n, desc="requests", unit="req")
        lock = threading.Lock()

        def client(c: int) -> None:
            for r in reqs[c :: args.clients]:
                try:
                    out = send(port, r)
                except Exception as e:  # a lost request is reported, not raised
                    out = {"error": f"{type(e).__name__}: {e}"}
                with lock:
                    results[r["i"]] = out
                    bar.update(1)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        bar.close()
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()

    # the same generations through the Python API, one by one
    import mlx_mtp

    models: dict = {}
    wrong, errors = [], []
    for r in tqdm(reqs, desc="checking", unit="req"):
        out = results.get(r["i"])
        if out is None or "error" in out:
            errors.append((r["i"], None if out is None else out["error"]))
            continue
        opts = dict(r["mtp"] or {"method": args.method})
        method = opts.pop("method")
        key = (method, tuple(sorted(opts.items())))
        if key not in models:
            models[key] = mlx_mtp.load(MODEL, method, dtype="float32", **opts)
        prompt = [{"role": "user", "content": r["text"]}] if r["kind"] == "chat" else r["text"]
        want = (
            models[key]
            .generate(
                prompt, max_tokens=args.max_tokens, temp=0.0, chat_template=r["kind"] == "chat"
            )
            .text
        )
        if out["text"] != want:
            wrong.append((r["i"], out["text"], want))

    ok = [results[i] for i in sorted(results) if "error" not in results[i]]
    lat = np.array([o["latency_s"] for o in ok]) if ok else np.zeros(1)
    qw = np.array([o["queue_wait_s"] for o in ok]) if ok else np.zeros(1)
    figures = {
        "command": " ".join(["examples/serve_load.py", *sys.argv[1:]]),
        "hardware": f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs",
        "model": f"{MODEL} float32",
        "server_method": args.method,
        "requests": n,
        "clients": args.clients,
        "answered": len(ok),
        "correct": len(ok) - len(wrong),
        "lost_or_failed": len(errors),
        "retried_429": sum(o["retries"] for o in ok),
        "wall_s": round(wall, 2),
        "latency_p50_s": round(float(np.percentile(lat, 50)), 3),
        "latency_p95_s": round(float(np.percentile(lat, 95)), 3),
        "queue_wait_p50_s": round(float(np.percentile(qw, 50)), 3),
        "queue_wait_p95_s": round(float(np.percentile(qw, 95)), 3),
        "requests_per_s": round(len(ok) / wall, 3),
    }
    for k, v in figures.items():
        print(f"{k:18s} {v}")
    for i, got, want in wrong[:5]:
        print(f"WRONG request {i}: got {got!r}, want {want!r}", file=sys.stderr)
    for i, e in errors[:5]:
        print(f"FAILED request {i}: {e}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0 if not wrong and not errors and len(ok) == n else 1


if __name__ == "__main__":
    sys.exit(main())
