"""Native MTP drafting and recurrent-state restore on tiny hybrid models (issue 23).

For each family (tiny random ``qwen3_next`` with MoE MLPs, tiny random dense
``qwen3_5``; ``tests/tiny_models.py``'s ``write_tiny_hybrid``, float32), on random
token prompts, side by side in one process:

* ``ntp``, ``--method mtp`` at depth 1..K and at ``depth=auto`` (the default:
  the cost curve of this device, measured and cached, or ``--curve``),
  ``pld``, ``hybrid`` (chain-shaped on these recurrent models, drafting from
  prompt lookup, its prediction pool and the MTP layer) and (qwen3_5)
  ``probe --opt shape=chain --opt masks=2``: tau (tokens per target forward),
  acceptance per draft depth, and a check that every output equals ``ntp``'s
  token for token.
* The same on a tiny random ``deepseek_v3`` (61 layers, MLA, a MoE nextn layer;
  ``write_tiny_deepseek``), ``--deepseek-prompts``
  prompts (a 61-layer forward is slow on a CPU).
* The cost of the recurrent-state restore: wall time of
  :meth:`~mlx_mtp.recurrent.RecurrentRollback.rewind` per rejected step
  (snapshot restore + replay of the gated delta-net mixers over the kept
  tokens), against a one-token backbone forward, and against the alternative
  "restore, then re-run the whole backbone over the kept tokens".

The weights are random: the MTP layer was never trained to predict anything,
so its acceptance is chance level (about 1/vocab), and tau reflects that.
Figures on a real checkpoint need one (none can be downloaded here).

    OPENBLAS_NUM_THREADS=1 .venv/bin/python examples/native_mtp_bench.py \
        [--prompts 30] [--tokens 48] [--depth 3] [--deepseek-prompts 3] [--deepseek-tokens 16] \
        [--curve 1:1,2:1.24,4:1.42,8:1.66,16:1.88,32:2.97]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

# isort: off
import mlx_mtp  # noqa: F401  (first: it loads OpenBLAS before mlx on Linux)

# isort: on
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model
from tqdm import tqdm

from mlx_mtp.budget import parse_curve
from mlx_mtp.context import Context
from mlx_mtp.decoding import generate_steps
from mlx_mtp.engine import Engine
from mlx_mtp.families import check_cache_support
from mlx_mtp.methods import make_method

# the tiny checkpoint writers are test scaffolding, not part of the package:
# they live in the repository's tests/ folder (run this from a clone)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_models import HYBRID_FAMILIES, write_tiny_deepseek, write_tiny_hybrid  # noqa: E402


def run(engine, method, prompt, n):
    """(tokens, final statistics) of one generation."""
    steps = list(generate_steps(engine, method, prompt, max_tokens=n))
    return [t for s in steps for t in s.tokens], steps[-1].stats


def full_reforward_ms(model, prompt, m, repeats=5):
    """Median ms of a backbone forward over m tokens after ``prompt`` (the
    alternative restore: re-run every layer over the kept tokens)."""
    times = []
    for _ in range(repeats + 1):
        cache = make_prompt_cache(model)
        model(mx.array([prompt]), cache=cache)
        mx.eval([c.state for c in cache])
        t0 = time.perf_counter()
        mx.eval(model(mx.array([prompt[-m:]]), cache=cache))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deepseek-prompts", type=int, default=3)
    ap.add_argument("--deepseek-tokens", type=int, default=16)
    ap.add_argument("--curve", default=None, help="pin the cost curve (slots:cost,...)")
    ap.add_argument("--families", default="qwen3_next,qwen3_5,deepseek_v3")
    a = ap.parse_args()
    print(
        f"hardware: {platform.machine()} {platform.processor() or ''} CPU, mlx {mx.__version__} "
        f"({mx.default_device()}); float32; tiny random models; {a.prompts} prompts x "
        f"{a.tokens} tokens"
    )
    rng = np.random.default_rng(a.seed)
    prompts = [rng.integers(0, 256, int(rng.integers(4, 24))).tolist() for _ in range(a.prompts)]
    for family in (*HYBRID_FAMILIES, "deepseek_v3"):
        if family not in a.families.split(","):
            continue
        folder = Path(tempfile.mkdtemp(prefix=f"tiny-{family}-"))
        if family == "deepseek_v3":
            if a.deepseek_prompts < 1:
                continue
            write_tiny_deepseek(folder, seed=1)
            prompts, a.tokens = prompts[: a.deepseek_prompts], a.deepseek_tokens
        else:
            write_tiny_hybrid(folder, family, seed=1)
        model, config = load_model(folder)
        engine = Engine(model)
        curves = parse_curve(a.curve) if a.curve else None
        ctx = Context(engine, types.SimpleNamespace(path=folder, config=config), curves)
        names = ["ntp", *[f"mtp{d}" for d in range(1, a.depth + 1)], "mtpauto", "pld", "hybrid"]
        if family == "qwen3_5":  # mlx-lm's qwen3_next takes no input embeddings
            names.append("chainprobe")
        methods = {}
        for name in names:
            if name == "mtpauto":
                m = make_method("mtp")
            elif name == "hybrid":
                m = make_method("hybrid", shape="chain")
            elif name.startswith("mtp"):
                m = make_method("mtp", depth=int(name[3:]))
            elif name == "chainprobe":
                m = make_method("probe", shape="chain", masks=2)
            else:
                m = make_method(name)
            check_cache_support(engine, m)
            m.prepare(ctx)
            methods[name] = m
        acc = {n: {"tokens": 0, "forwards": 0, "rewinds": 0, "rewind_s": 0.0} for n in names}
        exact = dict.fromkeys(names, True)
        fwd_ms = []
        for prompt in tqdm(prompts, desc=family):
            ref = None
            for name in names:  # interleaved: one prompt, every method
                rb = engine.rollback or types.SimpleNamespace(rewinds=0, rewind_seconds=0.0)
                r0, s0 = rb.rewinds, rb.rewind_seconds
                out, st = run(ctx, methods[name], prompt, a.tokens)
                ref = out if name == "ntp" else ref
                exact[name] &= out == ref
                acc[name]["tokens"] += st.generated_tokens
                acc[name]["forwards"] += st.forward_passes
                acc[name]["rewinds"] += rb.rewinds - r0
                acc[name]["rewind_s"] += rb.rewind_seconds - s0
                if name == "mtpauto":
                    acc[name].setdefault("plain", 0)
                    acc[name]["plain"] += st.plain_steps
                if name == "ntp":
                    fwd_ms.append(st.forward_time / st.forward_passes * 1e3)
        t1 = statistics.median(fwd_ms)
        print(f"\n{family}: one-token forward {t1:.2f} ms (median over prompts, ntp)")
        curve = ctx.budget.curve if ctx.budget is not None else None
        print(f"cost curve: {curve}; mtp draft cost {methods['mtp1'].draft_cost:.3f} forwards")
        print("method     tau    exact  acceptance per depth        restore ms/rejected step")
        for name in names:
            s = acc[name]
            tau = s["tokens"] / max(s["forwards"], 1)
            per = ""
            if name.startswith("mtp"):
                per = " ".join(f"{x:.3f}" for x in methods[name].acceptance_per_depth())
                if name == "mtpauto":
                    per = " ".join(per.split()[:4]) + f" plain={s['plain']}"
            rest = f"{s['rewind_s'] / s['rewinds'] * 1e3:.2f}" if s["rewinds"] else "-"
            print(f"{name:10s} {tau:.3f}  {exact[name]!s:5s}  {per:27s} {rest} ({s['rewinds']})")
        if engine.rollback is None:
            continue
        kept = 1  # most rejected steps keep just the root (chance-level drafts)
        print(
            f"alternative restore (whole backbone over the kept token): "
            f"{full_reforward_ms(model, prompts[0] + [1, 2, 3], kept):.2f} ms; over 3 kept "
            f"tokens: {full_reforward_ms(model, prompts[0] + [1, 2, 3], 3):.2f} ms"
        )


if __name__ == "__main__":
    main()
