"""Host milliseconds per decoding step of lossless methods, for one or more
source trees of mlx-mtp side by side (before / after a refactor).

Each tree runs in its own subprocess (``PYTHONPATH=TREE``, and the tree's
own ``.venv`` where it has one), in rounds that
alternate the trees (A B A B ...), so that both see the same load on a shared
machine. Every round decodes the same prompts (Spec-Bench, one per task under
``--max-prompt`` tokens, chat formatted) with each method and reports
``GenerationStats.host_ms_per_step``
(decode wall time minus device time: forward passes and the vocabulary-wide
argmax / top-k / sampling, see :mod:`mlx_mtp.decoding`), tau, and whether the
output equals plain greedy decoding token for token.

    OPENBLAS_NUM_THREADS=1 python examples/host_overhead.py \\
        --trees /tmp/base . --methods "probe:bc=30;hybrid:bc=30" --rounds 3

Prints one line per (tree, method): the median over rounds of the per-round
host ms/step (steps of all prompts pooled) and decode tok/s; under
``MLX_MTP_SIMULATE_DEVICE`` also the simulated device's idle ms per step,
the host work on the critical path (for a tree that does not count it, the
worker counts the gaps before each simulated pass itself).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

WORKER = r"""
import json, sys
import mlx_mtp  # first: preloads OpenBLAS before mlx on Linux
from mlx_mtp.api import MTPModel
from mlx_mtp.data import TASKS, load_questions
from mlx_mtp.loading import load_model
from mlx_mtp.methods import make_method

args = json.loads(sys.argv[1])
from mlx_mtp import timing
try:  # a tree whose simulated device is the bench's, installed by the front end
    from mlx_mtp.bench import simulate
    simulate.install()
    Sim = simulate.SimulatedClock
except ImportError:  # an older tree: its engines read MLX_MTP_SIMULATE_DEVICE themselves
    Sim = timing.SimulatedClock
IDLE = [0.0]
if not hasattr(Sim, "start_idle_count"):  # a tree that does not count it
    _launch = Sim.launch

    def _counted(self, outputs, slots, *rest):
        free = self.free
        done = _launch(self, outputs, slots, *rest)
        if free:  # the gap since the device's last pass ended
            IDLE[0] += max(done - self.seconds_per_token * self.curve(slots) - free, 0.0)
        return done

    Sim.launch = _counted
lm = load_model(args["model"], dtype="float32")
tok = lm.tokenizer
qs = load_questions()
prompts = []
for t in TASKS:  # the first questions of each task under max_prompt tokens
    ids = [tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}],
                                   add_generation_prompt=True) for q in qs if q["task"] == t]
    short = [p for p in ids if len(p) < args["max_prompt"]] or sorted(ids, key=len)
    prompts.append(short[min(args["index"], len(short) - 1)])

def run(name, opts, ids):
    # MTPModel(loaded, method): the same public call in every tree compared
    IDLE[0] = 0.0
    r = MTPModel(lm, make_method(name, **opts)).generate(ids, max_tokens=args["max_tokens"])
    if getattr(r.stats, "idle_time", None) is None:
        r.stats.idle_time = IDLE[0]
    return r.tokens, r.stats

run("ntp", {}, prompts[0][:20])  # warm-up
refs = [run("ntp", {}, p)[0] for p in prompts]
res = {}
for spec in args["methods"]:
    name, _, rest = spec.partition(":")
    opts = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    run(name, opts, prompts[0][:20])  # warm-up
    host = dec = steps = toks = fw = idle = 0.0
    exact = True
    for p, ref in zip(prompts, refs):
        out, s = run(name, opts, p)
        host += s.decode_time - s.forward_time
        idle += s.idle_time or 0.0
        dec += s.decode_time
        steps += s.steps
        toks += s.generated_tokens
        fw += s.forward_passes
        exact &= out == ref
    res[spec] = {"host_ms": 1000 * host / steps, "idle_ms": 1000 * idle / steps,
                 "tau": toks / fw, "tok_s": toks / dec, "exact": exact}
print("RESULT " + json.dumps(res))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", nargs="+", required=True, help="mlx-mtp source trees")
    for flag, default, what in (
        ("--methods", "probe:bc=30;hybrid:bc=30", "';'-separated method specs"),
        ("--model", "smollm2-135m", "model spec"),
        ("--rounds", 3, "rounds over the trees"),
        ("--max-tokens", 64, "new tokens per prompt"),
        ("--index", 0, "which question of each task"),
        ("--max-prompt", 400, "prompt tokens, at most"),
    ):
        ap.add_argument(flag, type=type(default), default=default, help=what)
    args = ap.parse_args()
    job = {
        "model": args.model,
        "methods": [m for m in args.methods.split(";") if m],
        "max_tokens": args.max_tokens,
        "index": args.index,
        "max_prompt": args.max_prompt,
    }
    got: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in range(args.rounds):
        for tree in args.trees:
            env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()))
            # the tree's own virtual environment where it has one (an editable
            # install maps the package's subpackages to its own tree)
            own = Path(tree).resolve() / ".venv" / "bin" / "python"
            p = subprocess.run(
                [str(own) if own.exists() else sys.executable, "-c", WORKER, json.dumps(job)],
                env=env,
                cwd=str(Path(tree).resolve()),  # python -c puts the cwd first on sys.path
                capture_output=True,
                text=True,
            )
            if p.returncode:
                sys.exit(f"{tree}: the worker failed:\n{p.stderr[-3000:]}")
            line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))
            for spec, v in json.loads(line[7:]).items():
                got[(tree, spec)].append(v)
                print(f"round {r + 1}/{args.rounds} {tree} {spec} {v}", file=sys.stderr, flush=True)
    print(
        f"model {args.model} float32, 6 Spec-Bench prompts (one per task, < {args.max_prompt} "
        f"tokens), {args.max_tokens} new tokens, CPU"
    )
    sim = os.environ.get("MLX_MTP_SIMULATE_DEVICE")
    for (tree, spec), vs in got.items():
        ms = [v["host_ms"] for v in vs]
        tps = statistics.median(v["tok_s"] for v in vs)
        # on a simulated device: the device's idle time per step, the host
        # work on the critical path (graph building included where the step
        # does not hide it); the older trees do not report it
        idle = [v.get("idle_ms", 0.0) for v in vs]
        crit = f"critical {statistics.median(idle):6.2f} ms/step " if sim else ""
        print(
            f"{tree:30s} {spec:16s} host {statistics.median(ms):6.2f} ms/step "
            f"(rounds {', '.join(f'{x:.2f}' for x in ms)}) {crit}tau {vs[0]['tau']:.2f} "
            f"{tps:.2f} tok/s "
            f"exact {all(v['exact'] for v in vs)}"
        )


if __name__ == "__main__":
    main()
