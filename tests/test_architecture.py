"""The rules docs/architecture.md states that import-linter does not check (it checks the layers).

Each rule is read from the source tree itself, so a file or function that outgrows it, or a module
the page names that no longer exists, fails here with its name.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "onedist"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 80


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_source_file_over_800_lines() -> None:
    too_long = {
        str(p.relative_to(PACKAGE)): n
        for p in _sources()
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert too_long == {}


def test_no_function_over_80_lines() -> None:
    too_long = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long[f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}"] = n
    assert too_long == {}


def _named_paths() -> list[str]:
    """The source paths docs/architecture.md names: ``onedist/x/y.py`` and ``x/`` folders."""
    text = ARCHITECTURE.read_text()
    return sorted(
        set(re.findall(r"\bonedist/[\w/]*\w(?:\.py|/)(?!<)", text))
    )  # not store keys (onedist/x/<rank>)


def test_architecture_page_names_modules() -> None:
    assert len(_named_paths()) > 30  # the page lists the modules; a regex that finds none proves nothing


@pytest.mark.parametrize("named", _named_paths())
def test_every_module_the_architecture_page_names_exists(named: str) -> None:
    assert (PACKAGE.parent / named).exists(), f"docs/architecture.md names {named}, which does not exist"


def test_every_module_is_on_the_architecture_page() -> None:
    named = set(_named_paths())
    missing = [
        str(p.relative_to(PACKAGE.parent))
        for p in _sources()
        if p.name not in ("__init__.py", "__main__.py", "_version.py")
        and str(p.relative_to(PACKAGE.parent)) not in named
    ]
    assert missing == []


def _from_module(node: ast.ImportFrom, package: str) -> str:
    """The absolute name of the module a ``from ... import`` statement in ``package`` reads from."""
    base = node.module or ""
    if node.level:
        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
    return base


def _imports(path: Path) -> set[str]:
    """The onedist modules ``path`` imports, anywhere in it (function-level imports too)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    if path.name == "__init__.py":
        module = package
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("onedist")}
        elif isinstance(node, ast.ImportFrom):
            base = _from_module(node, package)
            if base.startswith("onedist"):
                found |= {f"{base}.{a.name}" for a in node.names} | {base}
    return found - {module}


def test_no_import_circle() -> None:
    """No module reaches itself through the imports of the modules it imports (Tarjan's SCCs)."""
    modules = {}
    for p in _sources():
        name = ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = p
    graph = {m: {i for i in _imports(p) if i in modules} for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    assert len(graph) > 60 and sum(map(len, graph.values())) > 150  # the graph is really read
    assert circles == []


def _module_names() -> set[str]:
    """Every module and package of onedist, dotted (``onedist.backends._pygroup``)."""
    return {
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        for p in _sources()
    }


def _private_names_imported() -> tuple[list[str], int]:
    """Every ``from X import _name`` in onedist where X is a onedist module (relative or absolute)
    and ``_name`` is not a module (``from . import _gloo_threads`` imports a private module, which
    is fine), as ``file:line: from X import _name``; and how many names from onedist modules were read."""
    modules = _module_names()
    found, read = [], 0
    for path in _sources():
        dotted = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        package = dotted.removesuffix(".__init__") if path.name == "__init__.py" else dotted.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = _from_module(node, package)
            if base != "onedist" and not base.startswith("onedist."):
                continue
            for alias in node.names:
                read += 1
                name = alias.name
                if name.startswith("_") and not name.startswith("__") and f"{base}.{name}" not in modules:
                    where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
                    found.append(f"{where}: from {base} import {name}")
    return found, read


def test_no_underscore_name_imported_across_modules() -> None:
    """A name another module imports is part of the package's inner API: it has a plain name (or
    the two modules are one). Private modules (``_pygroup``) and their public names are fine."""
    found, read = _private_names_imported()
    assert read > 300  # the imports are really read
    assert found == []
