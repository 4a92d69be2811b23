"""Prompt files: the one reader every trainer uses, and the packaged Spec-Bench."""

import json

import pytest

from mlx_mtp.data import TASKS, eval_prompts, load_questions, read_prompts, spec_bench_sample
from mlx_mtp.errors import InvalidArgumentError


def _write(path, lines):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_read_prompts_accepts_every_documented_shape(tmp_path):
    f = _write(
        tmp_path / "p.jsonl",
        [
            {"turns": ["first turn", "second turn"]},
            {"question": "a GSM8K question", "answer": "#### 4"},
            {"prompt": " padded "},
            {"instruction": "do it"},
            {"text": "plain text"},
            {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]},
            json.dumps("a bare string"),
            "",
        ],
    )
    assert read_prompts(f) == [
        "first turn",
        "a GSM8K question",
        "padded",
        "do it",
        "plain text",
        "hi",
        "a bare string",
    ]
    assert read_prompts([f, f], limit=9)[7:] == ["first turn", "a GSM8K question"]
    assert read_prompts(f, exclude={"do it", "hi"})[3:5] == ["plain text", "a bare string"]


@pytest.mark.parametrize(
    "lines, match",
    [
        (["{not json"], "p.jsonl:1 is not JSON"),
        ([{"answer": "x"}], "p.jsonl:1 has no prompt"),
        ([{"turns": []}, 5], "p.jsonl:1 has no prompt"),
        ([""], "no prompts in"),
    ],
)
def test_read_prompts_names_the_bad_line(tmp_path, lines, match):
    with pytest.raises(InvalidArgumentError, match=match):
        read_prompts(_write(tmp_path / "p.jsonl", lines))


def test_read_prompts_missing_file(tmp_path):
    with pytest.raises(InvalidArgumentError, match="no such file"):
        read_prompts(tmp_path / "missing.jsonl")


def test_packaged_spec_bench_and_the_held_out_set():
    qs = load_questions()
    assert len(qs) == 480 and {q["task"] for q in qs} == set(TASKS)
    sample = spec_bench_sample(8)
    assert len(sample) == 48 and len(eval_prompts()) == 48
    # the trainers' default data leaves exactly the evaluation prompts out
    rest = read_prompts("spec-bench", exclude=eval_prompts())
    assert len(rest) == 480 - 48 and not set(rest) & eval_prompts()
