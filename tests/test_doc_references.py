"""The documentation names the tests that check what it says, and those tests exist.

Every page about behaviour ends with a ``## Checked by`` section: each behaviour the page states,
and the test (``tests/<file>.py::<name>``) that checks it; the API pages are rendered from
docstrings whose examples run in ``tests/test_docstrings.py``. A renamed or deleted test fails
here with the page that still names it.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# pages that state no behaviour of their own: the index, the changelog, the status log, and the
# API reference (docstrings, whose examples run as doctests)
NO_SECTION = {"index.md", "changelog.md", "status.md"}
REFERENCE = re.compile(r"\btests/[\w/]+\.py(?:::[\w:]+)?")


def _pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if p.parent.name != "api" and p.name not in NO_SECTION)


def _checked_by(page: Path) -> str:
    """The text of the page's ``## Checked by`` section ("" without one)."""
    text = page.read_text()
    found = re.search(r"^## Checked by\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    return found.group(1) if found else ""


@cache
def _names(path: Path) -> frozenset[str]:
    """``name`` and ``Class::method`` for every top-level function and class of a test file."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {f"{node.name}::{n.name}" for n in node.body if isinstance(n, ast.FunctionDef)}
    return frozenset(names)


def _resolves(reference: str) -> bool:
    path, _, name = reference.partition("::")
    file = ROOT / path
    return file.is_file() and (not name or name in _names(file))


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_every_page_names_the_tests_that_check_it(page: Path) -> None:
    section = _checked_by(page)
    assert section, f"{page.relative_to(ROOT)} has no '## Checked by' section"
    assert any("::" in r for r in REFERENCE.findall(section)), "the section names no test function"


def test_every_test_the_docs_name_exists() -> None:
    pages = [*DOCS.rglob("*.md"), ROOT / "README.md"]
    missing = sorted(
        f"{page.relative_to(ROOT)}: {ref}"
        for page in pages
        for ref in set(REFERENCE.findall(page.read_text()))
        if not _resolves(ref)
    )
    assert missing == []


def test_a_reference_to_a_test_that_does_not_exist_is_caught() -> None:
    assert _resolves("tests/test_doc_references.py::test_every_test_the_docs_name_exists")
    assert not _resolves("tests/test_doc_references.py::test_that_was_renamed")
    assert not _resolves("tests/test_gone.py")
