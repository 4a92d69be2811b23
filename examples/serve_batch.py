"""Concurrent clients against ``mlx-mtp serve``, with and without batching.

Starts ``mlx-mtp serve`` (with ``--max-batch B`` where given, else the
server's default) on 127.0.0.1 at a free port, sends
``--clients`` greedy chat requests at once (the first Spec-Bench questions
whose chat prompt is under ``--below`` tokens, ``--max-tokens`` each), and
prints the aggregate tokens per second, the latencies, and how many answers
equal the Python API's solo answer (``MTPModel.generate``, computed after the
server has stopped). The server is stopped with SIGINT and must exit 130.

``--method pld`` asks mlx-mtp for greedy prompt lookup (drafts verified
inside the batch), ``--method recycle`` for token recycling's table beside
it, ``--method draft --draft-model M`` starts the server with a draft model
(``--mlx-lm --draft-model FOLDER`` gives mlx_lm.server one);
``--tasks summarization,rag`` draws from the tasks that copy most.
``--mlx-lm`` runs ``mlx_lm.server`` on the same model folder instead (its
continuous batching, ``--decode-concurrency`` and ``--prompt-concurrency``
B), for a side-by-side figure; its exit status is not checked. mlx-mtp
loads a quantized model dequantized to float32 on Linux (its fastest form on
a CPU) and makes MLX use OpenBLAS (``mlx_mtp._blas``); mlx_lm.server runs a
folder as stored, with MLX's reference BLAS. So it is started with
``LD_PRELOAD`` of the same OpenBLAS, and should be given a dequantized
float32 copy for a like-for-like figure:

    mlx_lm convert --hf-path MODEL_FOLDER --mlx-path smol32 -d --dtype float32
    ... examples/serve_batch.py --mlx-lm --mlx-lm-model smol32

    OPENBLAS_NUM_THREADS=1 .venv/bin/python examples/serve_batch.py \\
        --clients 8 --max-tokens 64 --max-batch 8 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from mlx_mtp.data import TASKS, load_questions


def questions(tokenizer, n: int, below: int, tasks: tuple[str, ...] = TASKS) -> list[str]:
    """The first ``n`` Spec-Bench questions (round-robin over ``tasks``)
    whose chat prompt is under ``below`` tokens."""
    qs = load_questions()
    by_task = {t: [q for q in qs if q["task"] == t] for t in tasks}
    out = []
    for i in range(80):
        for t in tasks:
            text = by_task[t][i]["turns"][0]
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True
            )
            if len(ids) < below:
                out.append(text)
            if len(out) == n:
                return out
    return out


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(server: subprocess.Popen, port: int, timeout: float = 600) -> None:
    """Return once ``server`` accepts connections on 127.0.0.1:``port``;
    AssertionError if it exits or ``timeout`` seconds pass first."""
    deadline = time.time() + timeout
    while True:
        assert server.poll() is None and time.time() < deadline, "the server did not start"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)


def stop_server(server: subprocess.Popen) -> str:
    """Stop ``server`` with SIGINT (killed if it is still up 120 s later) and
    return its stderr."""
    server.send_signal(signal.SIGINT)
    try:
        return server.communicate(timeout=120)[1].decode(errors="replace")
    except subprocess.TimeoutExpired:  # mlx_lm.server with a draft model outlived it once
        server.kill()
        return server.communicate()[1].decode(errors="replace")


def ask(port: int, model: str, text: str, max_tokens: int, method: str | None = None) -> dict:
    """One greedy chat request (with ``method``: mlx-mtp's ``mtp.method``);
    the parsed answer."""
    request = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if method is not None:
        request["mtp"] = {"method": method}
    body = json.dumps(request).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=1200) as r:
        return json.loads(r.read())


def main() -> None:
    """Run the load and print (and optionally save) the figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=None,
                    help="the server's --max-batch (default: not passed, the server's "
                    "default; mlx_lm.server: 8)")  # fmt: skip
    ap.add_argument("--below", type=int, default=120, help="prompts under this many tokens")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--mlx-lm", action="store_true", help="serve with mlx_lm.server instead")
    ap.add_argument("--mlx-lm-model", default=None, help="its model folder (default: ours)")
    ap.add_argument("--method", default="ntp", choices=("ntp", "pld", "recycle", "draft"),
                    help="mlx-mtp's method for every request (draft: the server's, "
                    "--draft-model)")  # fmt: skip
    ap.add_argument("--draft-model", default=None,
                    help="the draft model: mlx-mtp's --method draft, or mlx_lm.server's "
                    "--draft-model (a folder there)")  # fmt: skip
    ap.add_argument("--tasks", default=",".join(TASKS),
                    help="Spec-Bench tasks to draw from (comma-separated)")  # fmt: skip
    args = ap.parse_args()

    from mlx_mtp.loading import load_model

    lm = load_model(args.model, "float32")
    texts = questions(lm.tokenizer, args.clients, args.below, tuple(args.tasks.split(",")))
    method = None if args.mlx_lm or args.method == "draft" else args.method
    port = free_port()
    exe = str(Path(sys.executable).parent / "mlx-mtp")
    cmd = [exe, "serve", "--model", args.model, "--dtype", "float32", "--port", str(port),
           "--queue-size", str(args.clients), "--log-level", "warning"]  # fmt: skip
    if args.max_batch is not None:
        cmd += ["--max-batch", str(args.max_batch)]
    if args.method == "draft" and not args.mlx_lm:
        cmd += ["--method", "draft", "--draft-model", args.draft_model]
    model_id = args.model
    if args.mlx_lm:
        b = str(args.max_batch or 8)
        folder = args.mlx_lm_model or str(lm.path)
        cmd = [sys.executable, "-m", "mlx_lm.server", "--model", folder, "--port",
               str(port), "--decode-concurrency", b, "--prompt-concurrency", b,
               "--log-level", "WARNING"]  # fmt: skip
        if args.draft_model:  # mlx_lm.server then serves one request at a time
            cmd += ["--draft-model", args.draft_model]
        model_id = "default_model"
    env = dict(os.environ)
    if args.mlx_lm:
        from mlx_mtp._blas import openblas_path

        blas = openblas_path()
        if blas:  # the BLAS mlx-mtp makes MLX use, for mlx_lm.server too
            env["LD_PRELOAD"] = blas
    server = subprocess.Popen(cmd, stderr=subprocess.PIPE, env=env)
    try:
        wait_until_serving(server, port)
        ask(port, model_id, "Hi", 4)  # warm-up
        answers: dict[int, dict] = {}
        latency: dict[int, float] = {}

        def client(i: int) -> None:
            t0 = time.perf_counter()
            answers[i] = ask(port, model_id, texts[i], args.max_tokens, method)
            latency[i] = time.perf_counter() - t0

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(texts))]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
    finally:
        err = stop_server(server)
    solo = lm.bind("ntp")
    equal = sum(
        answers[i]["choices"][0]["message"]["content"]
        == solo.generate(texts[i], max_tokens=args.max_tokens).text
        for i in range(len(texts))
    )
    tokens = sum(a["usage"]["completion_tokens"] for a in answers.values())
    figures = {
        "model": args.model,
        "dtype": "float32",
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
        "clients": len(texts),
        "max_tokens": args.max_tokens,
        "server": "mlx_lm.server" if args.mlx_lm else f"mlx-mtp serve ({args.method})",
        "draft_model": args.draft_model,
        "tasks": args.tasks,
        "max_batch": args.max_batch or "default",
        "new_tokens": tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 2),
        "latency_p50_s": round(statistics.median(latency.values()), 2),
        "latency_max_s": round(max(latency.values()), 2),
        "equal_to_solo": equal,
        "server_exit": server.returncode,
        "traceback_in_log": "Traceback" in err,
    }
    print(json.dumps(figures, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    if args.mlx_lm:
        return
    if equal != len(texts) or server.returncode != 130 or "Traceback" in err:
        sys.exit(1)


if __name__ == "__main__":
    main()
