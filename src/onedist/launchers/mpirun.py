"""``spawn("mpi", fn, nproc_per_node=N)``: N MPI ranks started through the MPI launcher.

MPI processes cannot be forked or spawned into one world by Python: the MPI launcher (Open MPI's
``mpirun``, or MPICH's ``mpiexec``) starts them. So the parent writes the job to a private
directory (``multiprocessing``'s preparation data, with which each rank imports the script that
defined ``fn`` as ``__mp_main__``, as a spawned multiprocessing child does, then a pickle of ``fn``
and its arguments), runs ``mpirun -np N python -m onedist.launchers.mpirun DIR`` with its output
passing through, and reads back each rank's result, or the failure reports from which
:class:`~onedist.WorkerFailedError` is built (the failing rank's traceback first, as with every
other backend). A failing rank publishes its error to the others and leaves without
``MPI_Finalize``; mpirun then stops the job.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional

from ..errors import BackendUnavailableError, WorkerFailedError
from .checks import check_picklable
from .launcher import SingleAttemptLauncher
from .report import reported_failure_error
from .worker import call_worker_fn, exit_failed, worker_threads_env, write_failure_report, write_result

logger = logging.getLogger("onedist")

_PREPARATION = "preparation.pkl"
_JOB = "job.pkl"


def _launcher() -> tuple[str, bool]:
    """The MPI launcher on PATH and whether it is Open MPI's (which takes --oversubscribe)."""
    for name in ("mpirun", "mpiexec"):
        path = shutil.which(name)
        if path is None:
            continue
        try:
            version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
            open_mpi = "open mpi" in (version.stdout + version.stderr).lower()
        except (OSError, subprocess.SubprocessError):
            open_mpi = False
        return path, open_mpi
    raise BackendUnavailableError(
        "onedist.spawn: backend='mpi' starts its ranks with the MPI launcher, and neither mpirun nor "
        "mpiexec is on PATH\nHINT: install an MPI library (e.g. apt-get install openmpi-bin "
        "libopenmpi-dev) and mpi4py, or use backend='gloo' or 'shm'"
    )


def _run(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    nproc: int,
    timeout: Optional[timedelta],
    env: dict[str, str],
) -> list[Any]:
    """Run ``fn(local_rank, *args, **kwargs)`` on ``nproc`` MPI ranks of this host; results in rank
    order (see the module docstring)."""
    import multiprocessing.spawn

    check_picklable(fn, "spawn('mpi')")  # each rank imports fn, as a 'spawn' child would
    mpirun, open_mpi = _launcher()
    job_dir = tempfile.mkdtemp(prefix="onedist-mpi-")  # mode 0700: only this user reads the job
    try:
        preparation = multiprocessing.spawn.get_preparation_data("onedist-mpi")
        preparation.pop("authkey", None)  # multiprocessing's connection key: not needed, not picklable
        with open(os.path.join(job_dir, _PREPARATION), "wb") as f:
            pickle.dump(preparation, f)
        with open(os.path.join(job_dir, _JOB), "wb") as f:
            pickle.dump((fn, args, kwargs, {"timeout": timeout}), f)
        cmd = [mpirun, "-np", str(nproc)]
        run_env = {**os.environ, **env}
        if open_mpi:
            if nproc > (os.cpu_count() or 1):
                cmd.append("--oversubscribe")
            if hasattr(os, "geteuid") and os.geteuid() == 0:  # Open MPI refuses root without these
                run_env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
                run_env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        cmd += [sys.executable, "-m", "onedist.launchers.mpirun", job_dir]
        logger.info("onedist.spawn: %s", " ".join(cmd))
        proc = subprocess.Popen(cmd, env=run_env)
        try:
            code = proc.wait()
        except BaseException:  # Ctrl-C here: mpirun forwards the signal to the ranks
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
        reported = reported_failure_error(
            [os.path.join(job_dir, f"rank-{r}.json") for r in range(nproc)],
            finished=lambda r: os.path.exists(os.path.join(job_dir, f"result-{r}.pkl")),  # not "stopped"
        )
        if reported is not None:
            raise reported
        results = []
        for rank in range(nproc):
            path = os.path.join(job_dir, f"result-{rank}.pkl")
            if code != 0 or not os.path.exists(path):
                raise WorkerFailedError(
                    f"onedist.spawn: mpirun exited with status {code} before rank {rank} reported a "
                    "result (its output above shows why)",
                    rank,
                    rank,
                    code,
                    None,
                )
            with open(path, "rb") as result:
                results.append(pickle.load(result))
        return results
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)


class MpirunLauncher(SingleAttemptLauncher):
    """The ranks of ``spawn("mpi", ...)`` (a world of more than one), started by mpirun on this
    host: MPI's processes come from its launcher (processes spawned here would each be an MPI world
    of one). Not restarted: restart the whole job from outside."""

    name = "onedist.spawn (mpirun)"

    def run(self) -> list[Any]:
        spec = self.spec
        threads = worker_threads_env(spec.nproc_per_node)
        return _run(spec.fn, spec.args, spec.kwargs, spec.nproc_per_node, spec.timeout, threads)


def _main(job_dir: str) -> None:
    """One MPI rank: import fn's script as multiprocessing does, initialise, run, report."""
    import multiprocessing.spawn

    with open(os.path.join(job_dir, _PREPARATION), "rb") as f:
        multiprocessing.spawn.prepare(pickle.load(f))
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
    local_rank = int(
        os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", os.environ.get("MPI_LOCALRANKID", str(rank)))
    )
    from ..context import finalize, get_local_rank, initialize

    try:
        with open(os.path.join(job_dir, _JOB), "rb") as f:
            fn, args, kwargs, cfg = pickle.load(f)
        initialize("mpi", timeout=cfg["timeout"])
        result = call_worker_fn(fn, get_local_rank(), args, kwargs)
        finalize()
    except BaseException as e:
        write_failure_report(e, job_dir, rank, local_rank)
        exit_failed()  # not MPI_Finalize, which would wait for the others (see failures/hooks.py)
    write_result(os.path.join(job_dir, f"result-{rank}.pkl"), result, rank)


if __name__ == "__main__":
    _main(sys.argv[1])
