"""Prompts: the sets shipped with the package, named data sets
(:func:`resolve_data`), prompt files (:func:`read_prompts`), and the one
prompt renderer of the API, the benchmark and the trainers
(:func:`render_prompt`).

Spec-Bench (Xia et al. 2024; Apache-2.0, see ``assets/spec_bench/LICENSE.spec_bench``): 480
questions, 80 per task. The six tasks are ``mt_bench`` (the MT-bench categories
writing, roleplay, reasoning, math, coding, extraction, stem, humanities),
``translation``, ``summarization``, ``qa``, ``math_reasoning`` and ``rag``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .errors import InvalidArgumentError

DATA_DIR = Path(__file__).parent / "assets" / "spec_bench"
#: named data sets that are not shipped (size): name -> path under
#: :func:`shared_data_dirs`
DATA_SETS = {
    "gsm8k-train": "gsm8k/train.jsonl",
    "gsm8k-test": "gsm8k/test.jsonl",
}
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


def shared_data_dirs() -> list[Path]:
    """Folders searched for the named data sets: ``$MLX_MTP_DATA`` when it is
    set (the folder that holds ``gsm8k/train.jsonl`` and ``gsm8k/test.jsonl``),
    else none: these sets are not shipped, a command names the file instead."""
    return [Path(os.environ["MLX_MTP_DATA"])] if os.environ.get("MLX_MTP_DATA") else []


def data_set_path(name: str) -> Path | None:
    """The file of a named data set (:data:`DATA_SETS`), the first found in
    :func:`shared_data_dirs`; None when none has it."""
    rel = DATA_SETS[name]
    return next((d / rel for d in shared_data_dirs() if (d / rel).is_file()), None)


def resolve_data(data: str) -> Path:
    """A prompts file given as a JSONL path or a data-set name (:data:`DATA_SETS`).

    Raises:
        InvalidArgumentError: neither an existing file nor a known name whose
            file is found (the message says where it was looked for).
    """
    if data in DATA_SETS:
        path = data_set_path(data)
        if path is None:
            raise InvalidArgumentError(
                f"--data {data}: the file {DATA_SETS[data]} was not found; set MLX_MTP_DATA to "
                "the folder that holds it, or pass a JSONL file."
            )
        return path
    p = Path(data).expanduser()
    if not p.is_file():
        raise InvalidArgumentError(f"--data {data}: no such file (expected prompts as JSONL).")
    return p


#: prompt formats: ``chat`` (the tokenizer's chat template) or ``plain`` (BOS +
#: each message + a blank line: the format of the released Qwen3 MTP checkpoint,
#: Kirchenbauer et al., arXiv 2602.06019)
PROMPT_FORMATS = ("plain", "chat")


def render_prompt(
    tokenizer: Any,
    messages: list[dict[str, str]],
    *,
    prompt_format: str = "chat",
    thinking: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of a conversation for generation: the one prompt renderer of
    the API, the benchmark and the trainers.

    Args:
        tokenizer: an mlx-lm/HF tokenizer.
        messages: ``{"role", "content"}`` dicts.
        prompt_format: ``chat``: the tokenizer's chat template with the
            generation prompt (without a template: :func:`role_lines`);
            ``plain``: BOS + each message's content + "\n\n".
        thinking: ``enable_thinking`` of hybrid-thinking chat templates
            (Qwen3): off by default (the template then opens and closes an
            empty think block); templates without the switch ignore it.
        tools: function definitions passed to the chat template as its
            ``tools`` (``chat`` format with a template only; None or empty:
            the template is called without them).

    Raises:
        InvalidArgumentError: unknown ``prompt_format``.
    """
    if prompt_format not in PROMPT_FORMATS:
        raise InvalidArgumentError(
            f"prompt format must be one of {', '.join(PROMPT_FORMATS)}, not {prompt_format!r}."
        )
    if prompt_format == "plain":
        text = "".join(m["content"] + "\n\n" for m in messages)
        ids = tokenizer.encode(text, add_special_tokens=False)
        bos = getattr(tokenizer, "bos_token_id", None)
        return ([bos] if bos is not None else []) + [int(t) for t in ids]
    if getattr(tokenizer, "chat_template", None):
        extra = {"tools": tools} if tools else {}
        return list(
            tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, enable_thinking=bool(thinking), **extra
            )
        )
    return list(tokenizer.encode(role_lines(messages)))


def role_lines(messages: list[dict[str, str]]) -> str:
    """Chat messages as plain text for a tokenizer without a chat template:
    one ``"role: content"`` line per message, then ``"assistant: "``. A longer
    conversation renders to an extension of a shorter one, so the KV cache of
    the previous turn is reused."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


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
    for i, q in _jsonl(path, ValueError):
        turns = q.get("turns") if isinstance(q, dict) else None
        if turns is None:
            raise ValueError(f"{path}:{i}: not a Spec-Bench question (no 'turns')")
        if not turns:
            raise ValueError(f"{path}:{i}: empty 'turns'")
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"{path}:{i}: 'turns' must be a list of strings, got {turns!r:.80}")
        if not isinstance(q.get("category", ""), str):
            raise ValueError(f"{path}:{i}: 'category' must be a string, got {q['category']!r}")
        q["task"] = task_of(q.get("category", ""))
        out.append(q)
    return out


def _jsonl(path: Path, error: type[Exception]) -> Iterator[tuple[int, Any]]:
    """(line number, decoded record) of each non-empty line; a line that is not
    JSON raises ``error`` naming the file and line."""
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield i, json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{path}:{i} is not JSON ({e})") from e


def spec_bench_sample(per_task: int, tasks: tuple[str, ...] = TASKS) -> list[dict[str, Any]]:
    """The first ``per_task`` questions of each task, task by task (the 48-prompt
    set of the closing notes is ``spec_bench_sample(8)``)."""
    qs = load_questions()
    out = []
    for t in tasks:
        out.extend([q for q in qs if q["task"] == t][:per_task])
    return out


def eval_prompts() -> set[str]:
    """First-turn texts of the 48 evaluation prompts (``spec_bench_sample(8)``),
    which the trainers leave out of their data."""
    return {q["turns"][0].strip() for q in spec_bench_sample(8)}


_PROMPT_FIELDS = ("prompt", "question", "instruction", "text")


def prompt_text(record: Any) -> str:
    """The user prompt of one jsonl record: a string, or an object with
    ``turns`` (first turn, Spec-Bench), ``prompt``, ``question`` (GSM8K),
    ``instruction``, ``text`` or ``messages`` (first user message). Empty if none."""
    if isinstance(record, str):
        return record.strip()
    if not isinstance(record, dict):
        return ""
    turns = record.get("turns")
    if isinstance(turns, list) and turns and isinstance(turns[0], str) and turns[0].strip():
        return turns[0].strip()
    for key in _PROMPT_FIELDS:
        if isinstance(record.get(key), str) and record[key].strip():
            return record[key].strip()
    for m in record.get("messages") or []:
        if isinstance(m, dict) and m.get("role") == "user":
            return str(m.get("content", "")).strip()
    return ""


def read_prompts(
    paths: str | Path | Iterable[str | Path],
    limit: int | None = None,
    exclude: Iterable[str] = (),
) -> list[str]:
    """Prompt texts from one or more jsonl files, in file order (see
    :func:`prompt_text` for the accepted line shapes). ``spec-bench`` names the
    packaged Spec-Bench questions.

    Args:
        paths: a file or a list of files.
        limit: stop after this many prompts.
        exclude: prompt texts to drop (e.g. held-out evaluation prompts).

    Raises:
        InvalidArgumentError: a missing file, a line that is not JSON or has no
            prompt, or no prompt at all.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    paths = list(paths)
    skip = {t.strip() for t in exclude}
    out: list[str] = []
    for p in paths:
        path = SPEC_BENCH if str(p) == "spec-bench" else Path(p).expanduser()
        if not path.is_file():
            raise InvalidArgumentError(f"--data {p}: no such file (expected a .jsonl of prompts)")
        for i, rec in _jsonl(path, InvalidArgumentError):
            text = prompt_text(rec)
            if not text:
                raise InvalidArgumentError(
                    f"{path}:{i} has no prompt: use a string or an object with 'turns', "
                    "'prompt', 'question', 'instruction', 'text' or 'messages'"
                )
            if text in skip:
                continue
            out.append(text)
            if limit is not None and len(out) >= limit:
                return out
    if not out:
        raise InvalidArgumentError(f"no prompts in {', '.join(map(str, paths))}")
    return out
