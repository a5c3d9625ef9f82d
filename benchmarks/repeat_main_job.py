"""Run README's main job N times in a row and count the clean exits (issue 21: 30 of 30).

    python3 benchmarks/repeat_main_job.py [--runs 30] [--busy]

``--busy`` keeps one core-bound process running beside the job, as a loaded CI machine would.
A run that exits non-zero, or that prints "terminate called" (a thread still running at exit),
is shown with the tail of its output. Not a test: it takes minutes and it measures luck.
"""

from __future__ import annotations

import argparse
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIGITS = str(ROOT / "examples" / "digits.py")
MAIN_JOB = [sys.executable, DIGITS, "--nproc-per-node", "2", "--backend", "gloo"]


def _spin() -> None:  # a busy neighbour
    while True:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--busy", action="store_true", help="one busy process beside the job")
    opts = parser.parse_args()
    spinner = multiprocessing.Process(target=_spin, daemon=True) if opts.busy else None
    if spinner is not None:
        spinner.start()
    bad = 0
    try:
        for i in range(1, opts.runs + 1):
            start = time.monotonic()
            done = subprocess.run(MAIN_JOB, capture_output=True, text=True, timeout=600)
            output = done.stdout + done.stderr
            clean = done.returncode == 0 and "terminate called" not in output
            bad += not clean
            print(f"run {i:3d}: exit {done.returncode}  {time.monotonic() - start:5.1f} s", flush=True)
            if not clean:
                print("    " + "\n    ".join(output.strip().splitlines()[-15:]), flush=True)
    finally:
        if spinner is not None:
            spinner.terminate()
    print(f"{opts.runs - bad} of {opts.runs} runs exited cleanly")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
