"""Write a JSONL corpus of permissively licensed English text for `train clp --corpus`.

Sources (both ship with every install of the package's dependencies; no download):
- numpy's docstrings (numpy wheel from PyPI, BSD-3-Clause), one record per docstring
  of at least 200 characters;
- the Python reference's topic pages (`pydoc_data.topics`, Python standard library,
  PSF License), cut into records of about 2,000 characters at paragraph breaks.

Usage: python scripts/make_corpus.py OUT.jsonl
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path


def numpy_docstrings() -> list[str]:
    import numpy

    out = []
    for f in sorted(Path(numpy.__file__).parent.rglob("*.py")):
        if "tests" in f.parts:
            continue
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 200:
                    out.append(doc)
    return out


def pydoc_topics(size: int = 2000) -> list[str]:
    from pydoc_data.topics import topics

    out = []
    for _, text in sorted(topics.items()):
        chunk = ""
        for para in text.split("\n\n"):
            if chunk and len(chunk) + len(para) > size:
                out.append(chunk)
                chunk = ""
            chunk += para + "\n\n"
        if chunk.strip():
            out.append(chunk)
    return out


def main(path: str) -> None:
    recs = [("numpy", t) for t in numpy_docstrings()] + [("python-docs", t) for t in pydoc_topics()]
    with open(path, "w", encoding="utf-8") as f:
        for src, text in recs:
            f.write(json.dumps({"text": text, "source": src}) + "\n")
    chars = sum(len(t) for _, t in recs)
    print(f"{path}: {len(recs)} records, {chars / 1e6:.1f} M characters")


if __name__ == "__main__":
    main(sys.argv[1])
