"""Failure modes of backend "mpi" under mpirun: ``python mpi_failures.py hang|hang_in_all_reduce|raise``.

hang: rank 1 never calls the barrier the others wait in (it sleeps); the barrier (MPI_Ibarrier,
waited on) must raise on them at the group's 3 s timeout, naming rank 1.
hang_in_all_reduce: the same in an all_reduce, a blocking MPI call that cannot be interrupted:
the timeout must end the job (MPI_Abort) with a message naming the collective.
raise: rank 1 raises while the others wait in an all_reduce; the job must end with its error.
"""

from __future__ import annotations

import sys
import time

import torch

import onedist as od

mode = sys.argv[1]
od.initialize("mpi", timeout=3)
od.barrier()
if od.get_rank() == 1:
    if mode.startswith("hang"):
        time.sleep(60)
    else:
        raise ValueError("boom on rank 1")
od.barrier() if mode == "hang" else od.all_reduce(torch.ones(4))
print("unreachable: rank", od.get_rank(), "passed the collective", flush=True)
