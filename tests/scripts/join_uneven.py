"""checks_join's uneven loop under a real launcher: ``python join_uneven.py BACKEND N`` spawns N
workers through od.Parallel (mpirun for "mpi"); under ``onedist run`` pass N = 0 and Parallel
adopts the launcher's workers. Prints ``RESULT`` and a JSON list (rank 0): each rank's steps and the
largest weight difference from torch's Join replayed in one process."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: checks_join

import checks_join
import onedist as od


def uneven(local_rank: int) -> Any:
    out = checks_join.check_uneven_loop_equals_torch_join(sync_bn=True, divide_by_world=True)
    return od.all_gather_object({"steps": out["steps"], "difference": out["difference"]})


def main() -> None:
    backend, n = sys.argv[1], int(sys.argv[2])
    with od.Parallel(backend=backend, nproc_per_node=n or None) as parallel:
        result = parallel.run(uneven)
    if os.environ.get("RANK", "0") == "0":  # one line, also under onedist run (which prefixes it)
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
