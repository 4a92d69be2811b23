"""A recorded tool-call run: an OpenAI client with ``tools`` against ``mlx-mtp serve``.

Starts ``mlx-mtp serve --model MODEL`` (no other flags) on 127.0.0.1 at a
free port and asks it, with the official ``openai`` client, chat questions
that call for a tool, each twice: whole (``message.tool_calls``) and streamed
(``delta.tool_calls``), for each ``--methods`` (the request's ``mtp.method``).
Then it answers a call with a ``tool`` message and records the model's reply
to it. Every request and answer is printed and, with ``--json``, written
down; the script exits 1 if a question that called a tool whole did not
call the same one streamed, or the server did not exit cleanly on SIGINT.

    .venv/bin/python examples/serve_tools.py --model qwen2.5-coder-0.5b \\
        --json docs/results/serve-tools-qwen-coder-0.5b-cpu/run.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import openai
from serve_batch import free_port, stop_server, wait_until_serving  # examples/ is on sys.path

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city's name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
RUN = {
    "type": "function",
    "function": {
        "name": "run_python",
        "description": "Run a Python snippet and return what it prints.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "Python source"}},
            "required": ["code"],
        },
    },
}
QUESTIONS = [
    "What is the weather in Paris right now?",
    "Use Python to compute the 20th Fibonacci number.",
    "Is it colder in Oslo or in Madrid today? Check both.",
]


def calls_of(message) -> list[dict]:
    """``[{"name", "arguments"}]`` of a whole answer's ``tool_calls``."""
    return [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in (message.tool_calls or [])
    ]


def streamed(client, model: str, messages: list, method: str, max_tokens: int) -> dict:
    """One streamed request: its text, its tool calls (joined from the
    deltas by ``index``) and its finish reason."""
    text, calls, finish = [], {}, None
    stream = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER, RUN], temperature=0,
        max_tokens=max_tokens, stream=True, extra_body={"mtp": {"method": method}},
    )  # fmt: skip
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        if choice.delta.content:
            text.append(choice.delta.content)
        for c in choice.delta.tool_calls or []:
            entry = calls.setdefault(c.index, {"name": "", "arguments": ""})
            entry["name"] += c.function.name or ""
            entry["arguments"] += c.function.arguments or ""
        finish = choice.finish_reason or finish
    return {
        "content": "".join(text),
        "tool_calls": [calls[i] for i in sorted(calls)],
        "finish_reason": finish,
    }


def main() -> None:
    """Run the questions and print (and optionally save) the record."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--methods", default="ntp,pld", help="comma-separated mtp.method values")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--json", default=None, help="also write the record here")
    args = ap.parse_args()

    port = free_port()
    exe = str(Path(sys.executable).parent / "mlx-mtp")
    cmd = [exe, "serve", "--model", args.model, "--port", str(port)]
    server = subprocess.Popen(cmd, stderr=subprocess.PIPE)
    record: list[dict] = []
    ok = True
    try:
        wait_until_serving(server, port)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        for method in args.methods.split(","):
            for q in QUESTIONS:
                messages = [{"role": "user", "content": q}]
                t0 = time.perf_counter()
                whole = client.chat.completions.create(
                    model=args.model, messages=messages, tools=[WEATHER, RUN], temperature=0,
                    max_tokens=args.max_tokens, extra_body={"mtp": {"method": method}},
                )  # fmt: skip
                wall = time.perf_counter() - t0
                msg = whole.choices[0].message
                entry = {
                    "method": method,
                    "question": q,
                    "whole": {
                        "content": msg.content,
                        "tool_calls": calls_of(msg),
                        "finish_reason": whole.choices[0].finish_reason,
                        "wall_s": round(wall, 2),
                    },
                    "streamed": streamed(client, args.model, messages, method, args.max_tokens),
                }
                same = [c["name"] for c in entry["whole"]["tool_calls"]] == [
                    c["name"] for c in entry["streamed"]["tool_calls"]
                ]
                entry["same_calls_streamed"] = same
                ok &= same
                if msg.tool_calls:  # answer the first call and record the reply
                    call = msg.tool_calls[0]
                    result = (
                        '{"temperature": 14, "unit": "celsius", "sky": "cloudy"}'
                        if call.function.name == "get_weather"
                        else "6765"
                    )
                    follow = messages + [
                        {"role": "assistant", "content": msg.content or "",
                         "tool_calls": [call.model_dump()]},
                        {"role": "tool", "tool_call_id": call.id, "content": result},
                    ]  # fmt: skip
                    reply = client.chat.completions.create(
                        model=args.model, messages=follow, tools=[WEATHER, RUN], temperature=0,
                        max_tokens=args.max_tokens, extra_body={"mtp": {"method": method}},
                    )  # fmt: skip
                    entry["tool_result"] = result
                    entry["reply"] = {
                        "content": reply.choices[0].message.content,
                        "tool_calls": calls_of(reply.choices[0].message),
                        "finish_reason": reply.choices[0].finish_reason,
                    }
                print(json.dumps(entry, indent=1), flush=True)
                record.append(entry)
    finally:
        err = stop_server(server)
    out = {
        "model": args.model,
        "command": " ".join(["mlx-mtp", *cmd[1:4]]),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
        "runs": record,
        "server_exit": server.returncode,
        "traceback_in_log": "Traceback" in err,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if not ok or server.returncode != 130 or "Traceback" in err:
        sys.exit(1)


if __name__ == "__main__":
    main()
