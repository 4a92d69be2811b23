"""Prompt sets shipped with the package.

Spec-Bench (Xia et al. 2024; Apache-2.0, see ``data/LICENSE.spec_bench``): 480
questions, 80 per task. The six tasks are ``mt_bench`` (the MT-bench categories
writing, roleplay, reasoning, math, coding, extraction, stem, humanities),
``translation``, ``summarization``, ``qa``, ``math_reasoning`` and ``rag``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).parent / "data"
SPEC_BENCH = DATA_DIR / "spec_bench.jsonl"
TASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
_MT_BENCH = {
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
}


def task_of(category: str) -> str:
    """Spec-Bench task of a question category (MT-bench categories -> ``mt_bench``)."""
    return "mt_bench" if category in _MT_BENCH else category


def load_questions(path: str | Path | None = None) -> list[dict[str, Any]]:
    """Read a Spec-Bench style jsonl (``question_id``, ``category``, ``turns``).

    Each record gains ``task`` (see :func:`task_of`).

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: a line is not JSON or lacks ``turns``.
    """
    path = Path(path) if path else SPEC_BENCH
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                q = json.loads(line)
                turns = q["turns"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{i}: not a Spec-Bench question ({e})") from e
            if not turns:
                raise ValueError(f"{path}:{i}: empty 'turns'")
            q["task"] = task_of(q.get("category", ""))
            out.append(q)
    return out


def spec_bench_sample(per_task: int, tasks: tuple[str, ...] = TASKS) -> list[dict[str, Any]]:
    """The first ``per_task`` questions of each task, task by task (the 48-prompt
    set of the closing notes is ``spec_bench_sample(8)``)."""
    qs = load_questions()
    out = []
    for t in tasks:
        out.extend([q for q in qs if q["task"] == t][:per_task])
    return out
