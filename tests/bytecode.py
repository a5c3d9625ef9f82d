"""Bytecode for this checkout's modules, written once before the test runs start processes.

Where ``PYTHONDONTWRITEBYTECODE`` is set (the machines this project is developed and checked on
set it), no process writes the ``__pycache__`` of onedist's sources (an editable install) or of
the tests, so every process the suites start compiles them again: about 65 modules, 0.15 CPU-s
of a worker's ~1.8 (tests/test_crash.py, measured 2026-11-28: 2.6 of 47 CPU-s went to compiling),
and the suites start several hundred such processes. Written here once, every process reads
them; Python checks each file's size and time stamp, so an edited source is compiled afresh.
"""

from __future__ import annotations

import compileall
from pathlib import Path


def write_bytecode(*folders: Path) -> None:
    """Compile every ``.py`` file under ``folders`` into its ``__pycache__`` (files whose bytecode
    is current are skipped: ~0.05 s for the whole tree then). Silent: a folder that cannot be
    written (a read-only checkout) only loses the saving, and a file that does not compile fails
    where it is imported."""
    for folder in folders:
        compileall.compile_dir(str(folder), quiet=2)
