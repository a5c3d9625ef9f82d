"""torch's backend-generic distributed tests (``DistributedTest._DistTestBase``) on any backend.

torch's own ``test/distributed/test_distributed_spawn.py`` runs ``_DistTestBase`` with one process
per rank for each test, the backend named by ``BACKEND``. This module does the same for a backend
named by ``ONEDIST_TORCH_SUITE_BACKEND`` (``gloo``, ``shm`` or ``mpi4py``), with two differences:

* torch's skip decorators are evaluated as for gloo (``BACKEND=gloo`` while torch's module is
  imported), because torch gates many CPU features to gloo by name (``all_reduce_coalesced``,
  ``get_future``, ``batch_isend_irecv``, ``no_sync``...) and a CPU backend that has them must pass
  them. The test bodies see ``BACKEND == "gloo"`` too; only the process group differs.
* the ranks are forked from the pytest process (torch's former ``test_distributed_fork.py``)
  instead of spawned: the same ``_run``, a fifth of the start-up time on two cores.

:func:`run_in_process` runs one test on this rank of a world whose processes were all started by
an outside launcher (``mpirun``), as torch's old ``TestMPI`` did: onedist's ``mpi4py`` group needs
every rank to be an MPI process.
"""

from __future__ import annotations

import os
import sys
import unittest
from datetime import timedelta
from typing import Any

import sabotage

SUBJECT = os.environ.get("ONEDIST_TORCH_SUITE_BACKEND", "gloo")
os.environ["BACKEND"] = "gloo"  # read once, when torch's module is imported: its skips see gloo

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as torch_mp  # noqa: E402
from torch.testing._internal import common_utils  # noqa: E402
from torch.testing._internal.common_distributed import TEST_SKIPS  # noqa: E402
from torch.testing._internal.distributed import distributed_test as dt  # noqa: E402

SKIP_CODES = {skip.exit_code: skip.message for skip in TEST_SKIPS.values()}
#: tests whose bodies compare ``dist.get_backend()`` or ``dist.Backend(...)`` with ``BACKEND``
NAME_TESTS = frozenset({"test_get_backend", "test_Backend_enum_class"})


def register_subject() -> None:
    """Make the backend under test known to torch.distributed (gloo is built in)."""
    if SUBJECT in ("shm", "mpi4py"):
        from onedist import register_torch_backends

        register_torch_backends()
        if SUBJECT == "shm" and os.environ.get(sabotage.ENV_VAR) == "1":  # torch_suite.py's self-check
            sabotage.break_shm_group()
    elif SUBJECT != "gloo":
        raise ValueError(f"ONEDIST_TORCH_SUITE_BACKEND={SUBJECT!r}: allowed gloo, shm, mpi4py")


def init_group(test_name: str, rank: int, world_size: int, init_method: str) -> None:
    """Form the default group for one test, with the timeout torch's harness gives it."""
    register_subject()
    dt.BACKEND = SUBJECT if test_name in NAME_TESTS else "gloo"
    seconds = dt.CUSTOM_PG_TIMEOUT.get(test_name, dt.default_pg_timeout)
    dist.init_process_group(
        init_method=init_method,
        backend=SUBJECT,
        world_size=world_size,
        rank=rank,
        timeout=timedelta(seconds=seconds),
    )


class TestDistBackendOnedist(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
    """torch's spawn harness with forked ranks and the backend under test (see the module doc)."""

    def setUp(self) -> None:
        super().setUp()
        self._start_processes(torch_mp.get_context("fork").Process)

    @classmethod
    def _run(cls, rank: int, test_name: str, file_name: str, pipe: Any, **kwargs: Any) -> None:
        # torch's TestDistBackend._run, with the group of the backend under test
        self = cls(test_name)
        self.rank = rank
        self.file_name = file_name
        init_group(test_name, rank, int(self.world_size), self.init_method)
        self._barrier()
        self.run_test(test_name, pipe)
        self._barrier()
        dist.destroy_process_group()
        sys.exit(0)


def run_in_process(test_name: str, rank: int, world_size: int, init_file: str) -> tuple[str, str]:
    """Run ``test_name`` on this rank, in this process: ``(outcome, text)``, outcome one of
    ``passed``, ``skipped``, ``failed``. Every rank of the world calls it with the same test."""
    import traceback

    case = TestDistBackendOnedist(test_name)
    case.rank, case.file_name = rank, init_file
    os.environ["WORLD_SIZE"] = str(world_size)
    test = getattr(type(case), test_name)
    if getattr(test, "__unittest_skip__", False):  # torch's skip decorators mark, unittest skips
        return "skipped", test.__unittest_skip_why__
    common_utils.set_rng_seed()  # as torch's run_test does in each rank's process
    try:
        init_group(test_name, rank, world_size, case.init_method)
        try:
            case._barrier()
            getattr(case, test_name)()
            case._barrier()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    except unittest.SkipTest as skip:
        return "skipped", str(skip)
    except SystemExit as leave:  # torch's GPU/world-size skips leave the process with a code
        if leave.code in SKIP_CODES:
            return "skipped", SKIP_CODES[leave.code]
        return "failed", f"SystemExit({leave.code})\n{traceback.format_exc()}"
    except BaseException:
        return "failed", traceback.format_exc()
    return "passed", ""
