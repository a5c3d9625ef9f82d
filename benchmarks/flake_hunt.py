"""Run a pytest selection N times in a row, each in a fresh pytest, and count each test's failures.

    python3 benchmarks/flake_hunt.py --runs 20 tests/test_misuse.py -k different_collectives
    python3 benchmarks/flake_hunt.py --runs 10 --busy tests/test_crash.py

The arguments after the options go to pytest as they are. ``--busy`` keeps one core-bound process
beside the runs, as a loaded CI machine would. Prints one line per run and, at the end, every test
that failed at least once with its count and the last line of one of its failures. Not a test: it
takes minutes and it measures luck (docs/testing.md has the counts of the timing-sensitive tests).
"""

from __future__ import annotations

import argparse
import multiprocessing
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from repeat_main_job import _spin

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--busy", action="store_true", help="one busy process beside the runs")
    opts, pytest_args = parser.parse_known_args()
    spinner = multiprocessing.Process(target=_spin, daemon=True) if opts.busy else None
    if spinner is not None:
        spinner.start()
    failures: Counter[str] = Counter()
    example: dict[str, str] = {}
    clean = 0
    try:
        for i in range(1, opts.runs + 1):
            start = time.monotonic()
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", *pytest_args]
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
            failed = re.findall(r"^FAILED (\S+)(?: - (.*))?$", done.stdout, re.M)
            for test, why in failed:
                failures[test] += 1
                example.setdefault(test, (why or "")[:200])
            summary = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
            clean += done.returncode == 0
            print(f"run {i:3d}: {time.monotonic() - start:6.1f} s  {summary}", flush=True)
    finally:
        if spinner is not None:
            spinner.terminate()
    for test, count in failures.most_common():
        print(f"{count:3d}x {test}\n      {example[test]}")
    busy = " beside a busy process" if opts.busy else ""
    print(f"{clean} of {opts.runs} runs green{busy}")
    return 0 if clean == opts.runs else 1


if __name__ == "__main__":
    sys.exit(main())
