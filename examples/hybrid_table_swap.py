"""Whether what earlier prompts wrote into ``hybrid``'s prediction table
explains its summarization cell on the simulated device.

``hybrid`` at ``auto`` (A) and at ``bc=30`` (B), one model, decode the
bench's warm-up and the first Spec-Bench mt_bench and translation prompts x
64 tokens, as ``mlx-mtp bench --limit 1`` does before its summarization
prompt (not interleaved). Then A decodes that summarization
prompt with its own table (twice), with B's (A's learned estimates restored
before each), and with its own table but no estimates carried from the
prompts before; B decodes it. Pipelined steps draft
from the table; every verified slot writes the model's prediction after
its token into it, so B's 30-slot passes leave more rows filled.

    OPENBLAS_NUM_THREADS=1 MLX_MTP_SIMULATE_DEVICE="ms_per_token=12,curve=1:1,16:1.05,64:1.3" \\
        python examples/hybrid_table_swap.py

Prints virtual decode tok/s and tau per run, the rows each table filled,
and whether all summarization runs committed the same tokens.
"""

from __future__ import annotations

import copy

from mlx_mtp.api import MTPModel
from mlx_mtp.bench.simulate import install
from mlx_mtp.data import load_questions
from mlx_mtp.loading import load_model
from mlx_mtp.methods import make_method


def main() -> None:
    if install() is None:
        raise SystemExit("set MLX_MTP_SIMULATE_DEVICE (see the module doc)")
    loaded = load_model("smollm2-135m", dtype="float32")
    first: dict[str, dict] = {}
    for q in load_questions():
        first.setdefault(q["task"], q)
    a = MTPModel(loaded, make_method("hybrid"))
    b = MTPModel(loaded, make_method("hybrid", bc=30))
    for m in (a, b):  # the bench's warm-up, its KV cache dropped around it
        m.engine.reset()
        m.generate([{"role": "user", "content": "Say hello in three words."}], max_tokens=8)

    def run(m: MTPModel, task: str) -> tuple[float, float, list[int]]:
        m.engine.reset()  # as the bench does before each prompt
        r = m.generate([{"role": "user", "content": first[task]["turns"][0]}], max_tokens=64)
        return r.stats.decode_tps, r.stats.tau, list(r.tokens)

    for task in ("mt_bench", "translation"):
        (ta, ua, _), (tb, ub, _) = run(a, task), run(b, task)
        print(f"{task}: auto {ta:.1f} tok/s (tau {ua:.2f}), bc=30 {tb:.1f} tok/s (tau {ub:.2f})")
    own, theirs = a.method._pool_table, b.method._pool_table
    table_a, table_b = own.table.copy(), theirs.table.copy()
    learned = copy.deepcopy(a.ctx.learned)
    filled = [int((t >= 0).any(axis=1).sum()) for t in (table_a, table_b)]
    print(f"table rows filled: auto {filled[0]}, bc=30 {filled[1]}")

    def summarize(table, estimates: dict) -> tuple[float, float, list[int]]:
        """A's summarization run from ``table`` and ``estimates``."""
        own.table = table.copy()
        a.ctx.learned.clear()
        a.ctx.learned.update(copy.deepcopy(estimates))
        return run(a, "summarization")

    runs = {
        "auto, own table": [summarize(table_a, learned), summarize(table_a, learned)],
        "auto, bc=30's table": [summarize(table_b, learned)],
        "auto, own table, no estimates carried": [summarize(table_a, {})],
        "bc=30": [run(b, "summarization")],
    }
    for name, rs in runs.items():
        print(
            f"summarization, {name}: " + ", ".join(f"{t:.1f} tok/s (tau {u:.2f})" for t, u, _ in rs)
        )
    tokens = [r[2] for rs in runs.values() for r in rs]
    print("same tokens:", all(t == tokens[0] for t in tokens))


if __name__ == "__main__":
    main()
