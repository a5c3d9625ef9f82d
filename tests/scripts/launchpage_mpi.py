"""Checks for backend "mpi" that tests/test_mpi.py sends to its ranks (imported by name there).

``report_with_launch`` runs under ``od.spawn("mpi", ...)``: ``workers.mpi_report``'s tuple, and
how the rank was started (the command line of the mpirun above it, and the variables that let
Open MPI run as root). ``check_rendezvous_store`` runs on a rank of a ``mpirun`` pool after
``initialize("mpi")``.
"""

from __future__ import annotations

import os
from typing import Any

import workers


def _launcher_command_line() -> list[str]:
    """The command line of the nearest ancestor process started with ``-np`` (mpirun), or []."""
    pid = os.getppid()
    for _ in range(5):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
        if "-np" in argv:
            return argv
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])  # its parent
    return []


def report_with_launch(local_rank: int, x: int) -> tuple[tuple, dict[str, Any]]:
    launch = {
        "mpirun": _launcher_command_line(),
        "allow_run_as_root": os.environ.get("OMPI_ALLOW_RUN_AS_ROOT"),
        "allow_run_as_root_confirm": os.environ.get("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"),
    }
    return workers.mpi_report(local_rank, x), launch


def check_rendezvous_store() -> dict[str, Any]:
    """The store of the default group: torch's TCPStore at MASTER_ADDR:MASTER_PORT, holding the keys
    onedist's rendezvous writes (each rank's arrival)."""
    import torch.distributed as dist

    import onedist as od

    store = dist.distributed_c10d._get_default_store()
    while not isinstance(store, dist.TCPStore) and hasattr(store, "underlying_store"):
        store = store.underlying_store
    tcp = isinstance(store, dist.TCPStore)
    return {
        "backend": od.backend(),
        "torch_backend": dist.get_backend(),
        "tcp_store": tcp,
        "address": (store.host, store.port) if tcp else None,
        "master": (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])),
        "joined": [store.check([f"onedist/joined/{r}"]) for r in range(od.get_world_size())] if tcp else [],
    }
