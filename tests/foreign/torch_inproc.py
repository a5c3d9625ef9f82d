"""One rank of torch's distributed tests run in-process under ``mpirun`` (see torch_suite.py).

Every rank runs the same tests in the same order, each in this process (the group is formed and
destroyed per test, as torch's harness does per process), and appends one JSON line per test to
``<out>/rank<R>.jsonl``: ``{"index", "test", "outcome", "text"}``, after a ``"start"`` line, so
that the runner sees which test a hung or crashed world was in and can start again after it.

    mpirun -np 2 python3 torch_inproc.py --tests FILE --start K --out DIR --run-id ID
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from torch_dist_cases import dt, run_in_process

# consecutive tests' file barriers start this far apart, so that a test that failed on one rank
# between two barriers cannot leave the ranks' barrier counts out of step for the next test
BARRIER_STRIDE = 100_000


def launcher_rank() -> tuple[int, int]:
    """This process's rank and the world size, from Open MPI's or a PMI launcher's variables."""
    for rank_var, size_var in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE")):
        if rank_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    raise SystemExit("torch_inproc.py runs under mpirun (no OMPI_COMM_WORLD_RANK or PMI_RANK)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tests", required=True, help="file with one test name per line")
    parser.add_argument("--start", type=int, default=0, help="index of the first test to run")
    parser.add_argument("--out", required=True, help="folder for rank<R>.jsonl")
    parser.add_argument("--run-id", required=True, help="names this attempt's init files")
    opts = parser.parse_args()
    rank, world_size = launcher_rank()
    names = Path(opts.tests).read_text(encoding="utf-8").split()
    temp_dir = os.environ["TEMP_DIR"]  # torch's Barrier and init files live there
    with open(Path(opts.out) / f"rank{rank}.jsonl", "a", encoding="utf-8") as log:
        for index in range(opts.start, len(names)):
            name = names[index]
            log.write(json.dumps({"index": index, "test": name, "outcome": "start"}) + "\n")
            log.flush()
            dt.Barrier.barrier_id = index * BARRIER_STRIDE
            dt.Barrier.sync(wait_for=world_size, timeout=120)  # every rank is at this test
            init_file = os.path.join(temp_dir, f"init-{opts.run_id}-{index}")
            outcome, text = run_in_process(name, rank, world_size, init_file)
            line = {"index": index, "test": name, "outcome": outcome, "text": text[-4000:]}
            log.write(json.dumps(line) + "\n")
            log.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
