"""Failure modes of backend "mpi" under mpirun: ``python mpi_failures.py hang|raise``.

hang: rank 1 never calls the barrier the others wait in (it sleeps), so their MPI call cannot
return; the group's 3 s timeout must end the job with a message naming the collective.
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
    if mode == "hang":
        time.sleep(60)
    else:
        raise ValueError("boom on rank 1")
od.all_reduce(torch.ones(4)) if mode == "raise" else od.barrier()
print("unreachable: rank", od.get_rank(), "passed the collective", flush=True)
