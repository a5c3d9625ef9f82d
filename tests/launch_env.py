"""A clean launcher environment for the processes a test starts (and for the test's own process).

A test suite run inside a launcher (CI under ``srun``, a torchrun'ed job, an ``mpirun`` on a
cluster node) inherits that launcher's variables: RANK, WORLD_SIZE, MASTER_ADDR, SLURM_PROCID, ...
Passed on to a process a test starts, they would make it one rank of the outer job (it waits for
ranks that never come, or joins the wrong rendezvous) instead of the plain process or the launcher
run the test means. Every test that starts a process, or initialises onedist in its own, strips
them with the helpers here, so that there is one list of what "a launcher started me" means.

Not a test module: it imports nothing but the standard library (spawned workers import the test
modules that use it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import pytest

__all__ = ["LAUNCHER_PREFIXES", "SLURM_MPI_PREFIXES", "clean_env", "strip_launcher_vars"]

#: the prefixes of the variables that make a process look started by torchrun (env://) or by a
#: launcher that sets torchrun's variables (onedist run, Kubeflow, Ray Train, ...): they cover
#: onedist.environments.TORCHRUN_VARS (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
#: GROUP_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and torchrun's TORCHELASTIC_* and ROLE_* ones
LAUNCHER_PREFIXES: tuple[str, ...] = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_",
    "GROUP_",
    "MASTER_",
    "TORCHELASTIC_",
    "ROLE_",
)

#: srun's and the MPI launchers' variables (SLURM_PROCID, OMPI_COMM_WORLD_RANK, PMI_RANK, PMIX_*):
#: pass them as ``also`` where a test must not look started by srun or mpirun either
SLURM_MPI_PREFIXES: tuple[str, ...] = ("SLURM_", "OMPI_", "PMI")


def _launched(name: str, also: tuple[str, ...]) -> bool:
    return name.startswith(LAUNCHER_PREFIXES) or (bool(also) and name.startswith(also))


def clean_env(*also: str, base: Optional[Mapping[str, str]] = None, **set: str) -> dict[str, str]:
    """A copy of ``base`` (``os.environ`` by default) for a process a test starts, without the
    variables of the launcher that may have started the test run, then with ``set`` applied.

    A test run inside a launcher (CI under ``srun``, a torchrun'ed job) must not leak its ranks into
    the processes a test starts: they would take part in the outer job instead of the one the test
    sets up. Every variable starting with one of :data:`LAUNCHER_PREFIXES`, or with one of the extra
    prefixes ``also`` (``"SLURM_"``, ``"OMPI_"``, ``"ONEDIST_"``, an exact name, ...), is left out.

    Example:
        >>> clean_env("SLURM_", base={"RANK": "1", "SLURM_PROCID": "1", "PATH": "/bin"}, X="1")
        {'PATH': '/bin', 'X': '1'}
    """
    env = {k: v for k, v in (os.environ if base is None else base).items() if not _launched(k, also)}
    env.update(set)
    return env


def strip_launcher_vars(*also: str, monkeypatch: Optional[pytest.MonkeyPatch] = None) -> None:
    """Remove from this process's ``os.environ`` what :func:`clean_env` leaves out (the same
    prefixes, and ``also``): a test that initialises onedist in its own process, or a worker a test
    forks, must not look started by the launcher that may run the test suite.

    With ``monkeypatch`` (pytest's fixture), each variable is removed through it, so that it comes
    back after the test; without it the removal lasts (tests/conftest.py restores ``os.environ``
    after each test, and a forked worker's environment ends with it)."""
    for name in [k for k in os.environ if _launched(k, also)]:
        if monkeypatch is None:
            del os.environ[name]
        else:
            monkeypatch.delenv(name)
