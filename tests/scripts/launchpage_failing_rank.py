"""What a rank started by srun or mpirun sees, then a failing rank (tests/test_slurm.py, tests/test_mpi.py).

    srun -n 2 python launchpage_failing_rank.py OUT_DIR
    mpirun -np 2 python launchpage_failing_rank.py OUT_DIR

Rank 1 turns on the INFO log of the logger ``onedist`` before ``Parallel`` initialises, as
``mpi_env.py`` on docs/launchers/mpirun.md does. Every rank writes ``OUT_DIR/<rank>.json``: torch's
thread count before and after the group formed, ``OMP_NUM_THREADS``, ``MASTER_PORT`` and the port
derived from the launcher's variables. Then rank 1 raises while rank 0 waits in a barrier; rank 0
writes the ``RemoteRankError`` it gets there to ``OUT_DIR/remote_error.json`` as it is raised
(before the launcher, seeing rank 1 exit, may stop rank 0), and lets it propagate.
"""

import json
import logging
import os
import sys

import torch

THREADS_BEFORE = torch.get_num_threads()  # torch's own choice: onedist has not run yet

import onedist as od  # noqa: E402
from onedist.environments import detect_cluster  # noqa: E402

LAUNCHER = detect_cluster(os.environ)


def main(local_rank: int, out: str) -> None:
    facts = {
        "rank": od.get_rank(),
        "environment": LAUNCHER.name,
        "threads_before": THREADS_BEFORE,
        "threads_after": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "master_port": int(os.environ["MASTER_PORT"]),
        "derived_port": LAUNCHER.master_port,
    }
    with open(os.path.join(out, f"{od.get_rank()}.json"), "w") as f:
        json.dump(facts, f)
    od.barrier()
    if od.get_rank() == 1:
        raise ValueError("rank 1 failed on purpose")
    try:
        od.barrier()
    except od.RemoteRankError as e:
        with open(os.path.join(out, "remote_error.json"), "w") as f:
            json.dump({"rank": e.rank, "message": str(e)}, f)
        raise


if __name__ == "__main__":
    if LAUNCHER.rank == 1:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    with od.Parallel(backend="gloo") as parallel:
        parallel.run(main, sys.argv[1])
