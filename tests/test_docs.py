"""The guide's code runs as written: docs/contributing.md's "Adding a method"
example is extracted, executed, registered and decoded with."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import re
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"


def python_blocks(markdown: str, section: str) -> list[str]:
    """The ```python blocks of one ``## section`` of a Markdown text."""
    start = markdown.index(f"## {section}\n")
    end = markdown.find("\n## ", start + 1)
    body = markdown[start : end if end >= 0 else None]
    return re.findall(r"```python\n(.*?)```", body, flags=re.S)


@pytest.fixture
def bigram_module(monkeypatch):
    """The example's code as a module, registered as method ``bigram``."""
    from mlx_mtp import methods

    blocks = python_blocks((DOCS / "contributing.md").read_text(), "Adding a method")
    assert len(blocks) == 1, "the section holds one python example"
    name = "mlx_mtp_docs_bigram"
    module = importlib.util.module_from_spec(importlib.machinery.ModuleSpec(name, None))
    exec(compile(blocks[0], "docs/contributing.md", "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(methods.METHODS, "bigram", f"{name}:Bigram")
    monkeypatch.setitem(methods.DESCRIPTIONS, "bigram", "the contributing guide's example")
    return module


@pytest.mark.parametrize("depth", ["auto", 4])
def test_contributing_example_decodes_exactly(smollm, greedy_reference, bigram_module, depth):
    """Registered by name, the guide's method decodes ``ntp``'s tokens, and
    on a prompt that repeats itself it drafts and gets drafts accepted."""
    from mlx_mtp.errors import InvalidArgumentError
    from mlx_mtp.methods import make_method

    assert isinstance(make_method("bigram"), bigram_module.Bigram)
    prompt = smollm.tokenizer.encode("Repeat: the cat sat on the mat. " * 6)
    m = smollm.bind("bigram", depth=depth)
    r = m.generate(prompt, max_tokens=24, chat_template=False)
    assert r.tokens == greedy_reference(prompt, 24)
    assert "bigram" in r.stats.method
    if depth == 4:  # fixed settings: every step sends its chain
        assert r.stats.accepted > 0
    assert r.stats.runner == "synchronous"  # no device drafter: the planner's steps
    with pytest.raises(InvalidArgumentError, match="no device drafter"):
        smollm.bind("bigram", depth=depth, runner="pipelined").generate(
            prompt, max_tokens=4, chat_template=False
        )
