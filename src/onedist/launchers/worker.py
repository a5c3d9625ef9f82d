"""What a worker is given and what it does at its end, whichever launcher started it.

The environment a worker gets (torchrun's variables, one OpenMP thread when several share a
node), running the user's function (``sys.exit(0)`` in it is a success), writing its result or
its failure where the parent reads them (atomically), and leaving at once after a failure.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, Optional

from ..errors import format_user_traceback

__all__ = [
    "call_worker_fn",
    "die_with_parent",
    "exit_failed",
    "torchrun_env",
    "worker_threads_env",
    "write_error_file",
    "write_failure_report",
    "write_result",
]

logger = logging.getLogger("onedist")


def torchrun_env(
    local_rank: int, nproc_per_node: int, node_rank: int, nnodes: int, master_addr: str, master_port: int
) -> dict[str, str]:
    """The variables torchrun gives a worker (TORCHRUN_VARS), for local rank ``local_rank``."""
    return {
        "RANK": str(node_rank * nproc_per_node + local_rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(nnodes * nproc_per_node),
        "LOCAL_WORLD_SIZE": str(nproc_per_node),
        "GROUP_RANK": str(node_rank),
        "GROUP_WORLD_SIZE": str(nnodes),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def worker_threads_env(nproc_per_node: int) -> dict[str, str]:
    """OMP_NUM_THREADS=1 for the workers when several share a node and the user set nothing.

    As torchrun does: N processes using every core each would oversubscribe the machine. Shared by
    :func:`spawn` and ``onedist run``.
    """
    if nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        logger.info("onedist: OMP_NUM_THREADS=1 in each worker (set it to override)")
        return {"OMP_NUM_THREADS": "1"}
    return {}


def die_with_parent(parent_pid: Optional[int]) -> None:
    """Ask Linux to SIGKILL this worker when the process that started it dies (``parent_pid``:
    that process, when it is the direct parent, checked to be alive still; None under a fork
    server, whose server is the parent)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent_pid is not None and os.getppid() != parent_pid:  # died before prctl took effect
        os._exit(1)


def call_worker_fn(
    fn: Callable[..., Any], local_rank: int, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> Any:
    """``fn(local_rank, *args, **kwargs)`` in a worker; ``sys.exit(0)`` in it is a success (None)."""
    try:
        return fn(local_rank, *args, **kwargs)
    except SystemExit as e:
        if e.code not in (0, None):
            raise
        return None


def write_result(path: str, result: Any, rank: int) -> None:
    """Pickle a worker's result to ``path`` for the parent (None, with a warning, when it cannot
    be pickled), atomically: the parent never reads half a file."""
    try:
        payload = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        logger.warning(
            "onedist.spawn: the return value of rank %d cannot be pickled (%s); returning None", rank, e
        )
        payload = pickle.dumps(None)
    with open(path + ".tmp", "wb") as f:
        f.write(payload)
    os.replace(path + ".tmp", path)


def write_error_file(path: str, exc: BaseException, text: Optional[str] = None, **fields: Any) -> None:
    """Write ``exc`` to ``path`` as the JSON record that
    :func:`~onedist.launchers.report.read_failure` reads (type, message, traceback, time, and
    ``fields``), atomically. ``text``: the traceback, by default Python's. Raises OSError."""
    record = {
        **fields,
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        if text is None
        else text,
        "time": time.time(),
    }
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def write_failure_report(
    exc: BaseException, report_dir: str, rank: int, local_rank: int, name: str = "", announce: bool = True
) -> None:
    """What a worker started by a backend's own launcher does when it fails: write the JSON report
    that :func:`~onedist.launchers.report.reported_failures` reads (``name``, by default
    ``rank-<rank>.json``) and, with ``announce``, publish the error to the other ranks and print
    the traceback."""
    if announce:
        from ..failures import publish_failure

        publish_failure(exc)
    text = format_user_traceback(exc)
    try:
        path = os.path.join(report_dir, name or f"rank-{rank}.json")
        write_error_file(path, exc, text, rank=rank, local_rank=local_rank, pid=os.getpid())
    except OSError:
        pass
    if not announce:
        return
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
        sys.stdout.flush()
    except Exception:
        pass


def exit_failed() -> NoReturn:
    """End a failed worker at once, output flushed: its peers may be blocked in a collective that
    will never complete, and exiting normally would wait for them (or for MPI_Finalize)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    from ..failures import release_stderr

    release_stderr()
    os._exit(1)
