"""How well the CLP span predictor says whether the heads' drafts will be accepted.

    python scripts/clp_span_signal.py --model qwen2.5-coder-0.5b --per-task 4 --tokens 64

Decodes ``--per-task`` Spec-Bench prompts of each task greedily (``ntp``),
then teacher-forces each prompt and reply through the backbone and runs the
model's CLP heads (the shipped ones, or ``--heads``) and span predictor at
every reply position. Prints, per task and over all positions, how often
the first head's token is accepted (P1) and the second given the first
(P2|1), grouped by the span predicted at the same position and one or two
positions earlier (what a pipelined step that launches the next pass before
reading the last knows). docs/methods.md ("clp") quotes its figures.
"""

from __future__ import annotations

import argparse
import collections

import numpy as np

from mlx_mtp.api import load
from mlx_mtp.data import TASKS, load_questions
from mlx_mtp.engine import common_prefix
from mlx_mtp.families import model_parts


def positions(model: str, heads: str | None, per_task: int, tokens: int) -> list[tuple]:
    """``(task, position, span, accepted heads)`` at every reply position."""
    import mlx.core as mx  # after mlx_mtp, which sets MLX up

    m = load(model, "clp", **({"heads": heads} if heads else {}))
    method, engine = m.method, m.engine
    backbone, lm_head, _ = model_parts(m.model)
    qs = load_questions()
    rows = []
    for task in TASKS:
        for q in [q for q in qs if q["task"] == task][:per_task]:
            ids = m.encode(q["turns"][0])
            out = list(m.generate(ids, max_tokens=tokens, temp=0.0).tokens)
            h = backbone(mx.array([ids + out]))[0]
            at = slice(len(ids) - 1, len(ids) + len(out) - 1)  # rows whose next token is out[j]
            nxt = mx.argmax(lm_head(h[None])[0], axis=-1)
            toks, span = method._heads(engine, h[at], nxt[at])
            toks, span = np.array(toks), np.array(span)
            k = toks.shape[1]
            for j in range(len(out) - k):
                rows.append((task, j, int(span[j]), common_prefix(out[j + 1 : j + 1 + k], toks[j])))
            print(f"{task} {q['question_id']}: {len(out)} tokens", flush=True)
    return rows


def table(rows: list[tuple], key) -> None:
    groups = collections.defaultdict(list)
    for i, r in enumerate(rows):
        g = key(i, r)
        if g is not None:
            groups[g].append(r[3])
    for g in sorted(groups):
        m = groups[g]
        p1 = sum(x >= 1 for x in m)
        p2 = sum(x >= 2 for x in m)
        print(f"  {g!s:>24}  n={len(m):4d}  P1={p1 / len(m):.2f}  P2|1={p2 / max(p1, 1):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--heads", default=None)
    ap.add_argument("--per-task", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    rows = positions(a.model, a.heads, a.per_task, a.tokens)

    def lag(n):
        def key(i, r):
            if i >= n and rows[i - n][0] == r[0] and rows[i - n][1] == r[1] - n:
                return f"span {n} earlier = {rows[i - n][2]}"
            return None

        return key

    print("per task and span at the same position:")
    table(rows, lambda i, r: (r[0], r[2]))
    for n in (0, 1, 2):
        print(f"all tasks, span {n} position(s) earlier:")
        table(rows, lag(n) if n else (lambda i, r: f"span = {r[2]}"))


if __name__ == "__main__":
    main()
