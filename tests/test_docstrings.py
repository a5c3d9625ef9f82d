"""Every docstring example of onedist's modules runs, as a user would paste it into a notebook.

Each module's examples run with doctest in a module installed as ``__main__`` without a file, as
Jupyter's is: ``if __name__ == "__main__":`` blocks run, and ``spawn``/``Parallel`` start the
functions defined there by fork, as they do in a notebook. Examples that need what this machine
lacks (horovodrun, a TPU) or that would change this test process for good (ignite's import alias,
the re-exec start method, which re-runs the current command) are written as plain code, not as
``>>>`` examples.
"""

from __future__ import annotations

import doctest
import importlib
import io
import pkgutil
import sys
import types

import pytest

import onedist

MODULES = sorted(info.name for info in pkgutil.walk_packages(onedist.__path__, "onedist."))
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _examples(name: str) -> list[doctest.DocTest]:
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder()
    return [t for t in finder.find(module, name, extraglobs={"__name__": "__main__"}) if t.examples]


def test_the_modules_have_examples_and_none_is_skipped():
    examples = [(t.name, e) for name in MODULES for t in _examples(name) for e in t.examples]
    assert len(examples) > 150, len(examples)  # a guard against a finder that finds nothing
    skipped = [name for name, example in examples if example.options.get(doctest.SKIP)]
    assert not skipped, f"examples marked +SKIP never run: {skipped}"


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    report = io.StringIO()
    saved = sys.modules["__main__"]
    try:
        for test in _examples(name):
            notebook = types.ModuleType("__main__")  # no __file__: an interactive session's main
            notebook.__dict__.update(test.globs)  # the module's names, which its examples may use
            for where in ("__file__", "__cached__", "__spec__", "__loader__"):
                notebook.__dict__.pop(where, None)
            notebook.__name__ = "__main__"
            test.globs = notebook.__dict__
            sys.modules["__main__"] = notebook
            runner.run(test, out=report.write)
    finally:
        sys.modules["__main__"] = saved
    assert runner.failures == 0, report.getvalue()
