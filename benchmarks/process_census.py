"""Where a test run's CPU goes: every Python interpreter the command starts, by test (issue 50).

Runs a command (by default onedist's test suite) with a hook that every Python process it starts,
at any depth, runs at interpreter start: a ``.pth`` file in site-packages that acts only where
``PYCENSUS_DIR`` names this run's folder (not ``ONEDIST_``: the tests strip those from the
processes they start). Each process writes one line when it starts and one at
exit: its pid, the pytest test that was running when it was started (``PYTEST_CURRENT_TEST``, which
children inherit), its command line, whether it imported torch, and its own CPU time (children
excluded). A process ended by a signal or ``os._exit`` has no exit line: it is counted, its CPU
time is not. Forked children (multiprocessing's "fork") are no new interpreter and not counted.

    python3 benchmarks/process_census.py                          # the whole suite
    python3 benchmarks/process_census.py -- python3 -m pytest tests/test_misuse.py
    python3 benchmarks/process_census.py --top 30 -- python3 tests/foreign/ignite_suite.py

It prints the interpreters started, their CPU time (and the CPU time of importing torch alone,
measured here, times the number that imported it: what a process that forks from one with torch
imported would save), by test file and for the slowest tests. The hook is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections import defaultdict
from pathlib import Path

PTH = Path(sysconfig.get_paths()["purelib"]) / "onedist-census.pth"
PTH_LINE = (
    'import os; os.environ.get("PYCENSUS_DIR") and '
    'exec(open(os.path.join(os.environ["PYCENSUS_DIR"], "hook.py")).read(), {})\n'
)
# run in every Python process of the command, at interpreter start (before the program)
HOOK = """
import atexit as _a, json as _j, os as _o, resource as _r, sys as _s, time as _t
def _census_line(kind, _start=_t.monotonic()):
    row = {"kind": kind, "pid": _o.getpid(), "test": _o.environ.get("PYTEST_CURRENT_TEST", ""),
           "argv": " ".join(_s.argv[:3])[:160]}
    if kind == "exit":
        use = _r.getrusage(_r.RUSAGE_SELF)
        row.update(cpu=use.ru_utime + use.ru_stime, wall=_t.monotonic() - _start,
                   torch="torch" in _s.modules)
    with open(_o.path.join(_o.environ["PYCENSUS_DIR"], "rows.jsonl"), "a") as f:
        f.write(_j.dumps(row) + "\\n")
_census_line("start")
_a.register(_census_line, "exit")
"""


def torch_import_cpu() -> float:
    """CPU seconds of ``import torch`` in a fresh interpreter (the median of three)."""
    cpu = "import resource; u = resource.getrusage(resource.RUSAGE_SELF); print(u.ru_utime + u.ru_stime)"

    def cpu_of(code: str) -> float:
        return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout)

    runs = [cpu_of("import torch; " + cpu) - cpu_of(cpu) for _ in range(3)]
    return sorted(runs)[1]


def summarize(rows: list[dict], top: int, torch_cpu: float) -> None:
    """Print the census: in all, by test file, the ``top`` tests."""
    starts = [r for r in rows if r["kind"] == "start"]
    exits = [r for r in rows if r["kind"] == "exit"]
    by_file: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])  # starts, cpu, torch imports
    by_test: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])
    for r in starts:
        test = r["test"].rsplit(" ", 1)[0] or "(outside a test)"
        by_file[test.split("::", 1)[0]][0] += 1
        by_test[test][0] += 1
    for r in exits:
        test = r["test"].rsplit(" ", 1)[0] or "(outside a test)"
        for into in (by_file[test.split("::", 1)[0]], by_test[test]):
            into[1] += r["cpu"]
            into[2] += int(r["torch"])
    cpu = sum(r["cpu"] for r in exits)
    imports = sum(int(r["torch"]) for r in exits)
    unended = len(starts) - len(exits)
    print(f"{len(starts)} Python interpreters started ({unended} without an exit line: a signal, os._exit)")
    print(f"their CPU time {cpu:.0f} s; {imports} imported torch (import torch alone: {torch_cpu:.2f} s CPU")
    print(f"here, so {imports * torch_cpu:.0f} s of the {cpu:.0f} s is importing torch)")
    print(f"\n{'by file':60s} {'starts':>7s} {'CPU s':>8s} {'torch':>6s}")
    for name, (n, c, t) in sorted(by_file.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{name[-60:]:60s} {n:7d} {c:8.1f} {t:6d}")
    print(f"\n{'by test':100s} {'starts':>7s} {'CPU s':>8s}")
    for name, (n, c, _t) in sorted(by_test.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{name[-100:]:100s} {n:7d} {c:8.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--top", type=int, default=20, help="rows of each table (default 20)")
    parser.add_argument("command", nargs="*", help="the command (default: python3 -m pytest)")
    opts = parser.parse_args()
    command = opts.command or [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    folder = Path(tempfile.mkdtemp(prefix="census-"))
    (folder / "hook.py").write_text(HOOK, encoding="utf-8")
    env = {**os.environ, "PYCENSUS_DIR": str(folder)}
    PTH.write_text(PTH_LINE, encoding="utf-8")
    start = time.monotonic()
    try:
        rc = subprocess.run(command, env=env).returncode
    finally:
        PTH.unlink(missing_ok=True)
    took = time.monotonic() - start
    print(f"\ncensus of {' '.join(command)} (exit {rc}, {took:.0f} s wall), rows in {folder}")
    lines = (folder / "rows.jsonl").read_text(encoding="utf-8").splitlines()
    summarize([json.loads(line) for line in lines if line.strip()], opts.top, torch_import_cpu())
    return rc


if __name__ == "__main__":
    sys.exit(main())
