"""Token recycling's table on the host or on the device, and the cost of the
top-k in plain steps: the measurements behind ``mlx_mtp.sources.recycle``.

1. ``--method recycle`` with its table as a host numpy array (the package's
   :class:`~mlx_mtp.sources.recycle.RecycleTable`) and as an ``mx.array`` on
   the device (:class:`DeviceTable` below: rows written by a lazy scatter, so
   the top-k never comes to the host, and read for drafting through gathers,
   one synchronisation per row fetched together with the rows of its
   candidates). Same drafts, same tau; what differs is the host time per
   step (``GenerationStats.host_ms_per_step``).
2. Pipelined plain steps (:class:`~mlx_mtp.plain.PlainSteps`) with and
   without the top-8 built beside the argmax: ms per token.

Rounds alternate the variants (A B A B ...) so that both see the same load:

    OPENBLAS_NUM_THREADS=1 taskset -c 1 python examples/recycle_table.py \\
        --model smollm2-135m --prompts 6 --max-tokens 64 --rounds 3

Prints the median over rounds of each variant's host ms/step and tau, and of
plain steps' ms/token. Run under ``MLX_MTP_COST_CURVE`` to pin the budget's
curve (the tree sizes then do not depend on this machine's speed).
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx_mtp  # noqa: F401  (first: preloads OpenBLAS before mlx on Linux)

# isort: split
import mlx.core as mx
import numpy as np

from mlx_mtp.allocate import Child
from mlx_mtp.context import Context
from mlx_mtp.data import TASKS, load_questions
from mlx_mtp.decoding import generate_steps
from mlx_mtp.engine import Engine
from mlx_mtp.loading import load_model
from mlx_mtp.methods import make_method
from mlx_mtp.plain import PlainSteps
from mlx_mtp.sources.recycle import SOURCE, RecycleTable


class DeviceTable(RecycleTable):
    """The table as a (V, k) int32 ``mx.array``: written lazily on the device,
    read row by row for drafting (see the module doc)."""

    def __init__(self, k: int = 8, reset: str = "never"):
        super().__init__(k, reset)
        self.dev: mx.array | None = None

    def learn(self, draft, verified, top):  # noqa: D102
        tokens, rows = self.write_order(draft, verified, top.shape[0])
        self._scatter(tokens, rows, top)

    def plain(self, result):  # noqa: D102
        if result.top is not None and result.root >= 0:
            self._scatter(np.array([result.root]), np.array([0]), mx.array(result.top)[None])

    def _scatter(self, tokens, rows, top):
        if not len(tokens):
            return
        if self.dev is None:
            self.dev = mx.full((self.rows, self.k), -1, dtype=mx.int32)
        _, first = np.unique(tokens[::-1], return_index=True)
        last = len(tokens) - 1 - first
        self.dev[mx.array(tokens[last])] = top[mx.array(rows[last])].astype(mx.int32)
        self.table = self.dev  # not None: drafting may start

    def begin(self, prompt):  # noqa: D102
        super().begin(prompt)
        if self.table is None:
            self.dev = None

    def children(self, acceptance):  # noqa: D102
        k, dev = self.k, self.dev
        qs = acceptance.qs(SOURCE, k)
        tags = [[(SOURCE, r + 1, 1.0)] for r in range(k)]
        ranks = sorted(range(k), key=lambda r: -qs[r])
        rows: dict[int, list[int]] = {}

        def kids(token):
            if dev is None or not 0 <= token < self.rows:
                return []
            if token not in rows:  # one sync: this row and its candidates' rows
                row = dev[token]
                below = dev[mx.maximum(row, 0)]
                mx.eval(row, below)
                rows[token] = row.tolist()
                for t, r in zip(rows[token], below.tolist()):
                    if t >= 0:
                        rows.setdefault(t, r)
            row = rows[token]
            return [Child(row[r], qs[r], tags[r]) for r in ranks if row[r] >= 0]

        return kids


def prompts_of(tokenizer, n: int) -> list[list[int]]:
    qs = load_questions()
    out = []
    for i in range(n):
        t = TASKS[i % len(TASKS)]
        q = [q for q in qs if q["task"] == t][i // len(TASKS)]
        msgs = [{"role": "user", "content": q["turns"][0]}]
        out.append(tokenizer.apply_chat_template(msgs, add_generation_prompt=True))
    return out


def run_recycle(lm, prompts, n, table_cls, opts):
    m = make_method("recycle", **opts)
    m.source = table_cls(m.source.k, m.source.reset)
    eng = Engine(lm.model)
    ctx = Context(eng, lm)
    m.prepare(ctx)
    list(generate_steps(ctx, m, prompts[0][:16], max_tokens=8))  # warm-up
    host = steps = toks = passes = 0.0
    outs = []
    for p in prompts:
        eng.reset()
        gen = list(generate_steps(ctx, m, p, max_tokens=n))
        out, st = [t for g in gen for t in g.tokens], gen[-1].stats
        outs.append(out)
        host += st.decode_time - st.forward_time
        steps, toks, passes = (
            steps + st.steps,
            toks + st.generated_tokens,
            passes + st.forward_passes,
        )
    return 1000 * host / steps, toks / passes, outs


def plain_ms(lm, prompt, n, topk):
    eng = Engine(lm.model)
    eng.sync(prompt[:-1])
    plain, root = PlainSteps(None, topk), prompt[-1]
    plain.step(eng, root)  # warm-up
    t0 = time.perf_counter()
    for _ in range(n):
        root = plain.step(eng, root)[0]
    return 1000 * (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--opts", default="", help="recycle options, e.g. bc=30")
    args = ap.parse_args()
    lm = load_model(args.model, dtype="float32")
    prompts = prompts_of(lm.tokenizer, args.prompts)
    opts = dict(kv.split("=", 1) for kv in args.opts.split(",") if kv)
    res: dict[str, list[tuple[float, float]]] = {"host": [], "device": []}
    plain: dict[int, list[float]] = {0: [], 8: []}
    for _ in range(args.rounds):
        got = {}
        for name, cls in (("host", RecycleTable), ("device", DeviceTable)):
            ms, tau, outs = run_recycle(lm, prompts, args.max_tokens, cls, opts)
            res[name].append((ms, tau))
            got[name] = outs
        assert got["host"] == got["device"], "the two tables drafted different text"
        for topk in plain:
            plain[topk].append(plain_ms(lm, prompts[0], args.max_tokens, topk))
    print(
        f"{args.model}, float32, {args.prompts} prompts x {args.max_tokens} tokens, recycle {opts}"
    )
    for name, rows in res.items():
        ms = statistics.median(r[0] for r in rows)
        tau = statistics.median(r[1] for r in rows)
        print(f"  table on the {name:6s}: host {ms:6.2f} ms/step, tau {tau:.3f}")
    for topk, rows in plain.items():
        what = f"top-{topk} beside the argmax" if topk else "argmax alone"
        print(f"  plain steps, {what}: {statistics.median(rows):6.2f} ms/token")


if __name__ == "__main__":
    main()
