"""The package's layout: no import circle between its modules (an AST scan, so
imports inside functions and under ``TYPE_CHECKING`` count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mlx_mtp

PACKAGE = Path(mlx_mtp.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports anywhere in its file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                if path.name != "__init__.py":
                    base = base[:-1]
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                if f"{mod}.{a.name}" in modules:
                    out.add(f"{mod}.{a.name}")
                elif mod in modules:
                    out.add(mod)
    # a package's own __init__ runs before any of its modules: not a circle
    return {m for m in out if m != name and not name.startswith(m + ".")}


def _circles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def _edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's package imports; ``mlx_mtp.cli`` imports every module of
    ``mlx_mtp.commands`` too (``_register_commands``, through importlib)."""
    edges = {m: _imports(m, p, modules) for m, p in modules.items()}
    edges["mlx_mtp.cli"] |= {m for m in modules if m.startswith("mlx_mtp.commands.")}
    return edges


def test_the_scan_finds_a_circle():
    """The scan sees a circle where there is one, an import inside a
    function, and the command modules the CLI loads by name."""
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(edges) == [frozenset({"a", "b", "c"})]
    modules = _modules()
    assert "mlx_mtp.families" in _imports("mlx_mtp.cli", modules["mlx_mtp.cli"], modules)
    edges = _edges(modules)
    assert "mlx_mtp.commands.serve" in edges["mlx_mtp.cli"]
    edges["mlx_mtp.commands.serve"].add("mlx_mtp.cli")  # serve's options from the CLI
    assert frozenset({"mlx_mtp.cli", "mlx_mtp.commands.serve"}) in _circles(edges)


def test_no_import_circle_in_the_package():
    edges = _edges(_modules())
    circles = [sorted(c) for c in _circles(edges)]
    assert circles == [], f"modules that import each other: {circles}"


def test_every_asset_folder_is_a_declared_package_with_its_data():
    """Each asset folder Python could import is in pyproject.toml's
    ``packages`` with package data (setuptools warns for one left out, and a
    wheel would miss the files of one without package data)."""
    tomllib = pytest.importorskip("tomllib")
    setuptools = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"][
        "setuptools"
    ]
    root = PACKAGE.parent
    folders = {
        ".".join(d.relative_to(root).parts)
        for d in [PACKAGE / "assets", *(PACKAGE / "assets").rglob("*")]
        if d.is_dir() and d.name != "__pycache__"
        if all(p.isidentifier() for p in d.relative_to(root).parts)
    }
    assert "mlx_mtp.assets.spec_bench" in folders
    assert folders <= set(setuptools["packages"]), folders - set(setuptools["packages"])
    assert folders <= set(setuptools["package-data"]), folders - set(setuptools["package-data"])
