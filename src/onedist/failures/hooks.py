"""How a failing rank leaves: its error is published and printed first, peers let it exit first."""

from __future__ import annotations

import os
import socket
import sys
import time
from types import TracebackType
from typing import Any, Optional

from ..errors import RemoteRankError, format_user_traceback
from ..state import world
from .channel import publish_failure, rank_and_world
from .forced_exit import run_forced_exit_callbacks
from .stderr import release_stderr


def let_failed_rank_exit_first(exc: BaseException) -> None:
    """On a peer of a failed rank (``exc`` is the RemoteRankError naming it): wait, up to 2 s, until
    that rank's process is gone, so launchers that blame the first process to exit (mpirun, srun,
    torchrun without error files) name the rank that failed, not this one."""
    if not isinstance(exc, RemoteRankError):
        return
    wait_until_gone(getattr(exc, "report", None) or {})


def wait_until_gone(report: dict[str, Any]) -> None:
    """Wait, up to 2 s, until the process of a failure report (its pid, on this host) is gone; half
    a second for one on another host."""
    pid, host = report.get("pid"), report.get("host")
    deadline = time.monotonic() + 2.0
    if isinstance(pid, int) and host == socket.gethostname():
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            except PermissionError:
                return
            time.sleep(0.02)
    else:
        time.sleep(0.5)


def report_and_release(exc: BaseException, tb: Optional[TracebackType]) -> None:
    """A rank is leaving its distributed context because of ``exc`` (``Parallel.__exit__``).

    Publish the error, then print its traceback now, before the group is destroyed: destroying it
    releases the peers, whose errors would otherwise be printed before this rank's own. The
    excepthook then prints a one-line reminder instead of the same traceback again.
    """
    try:
        _, world_size = rank_and_world()
    except Exception:
        return
    if world_size <= 1 or isinstance(exc, (KeyboardInterrupt, RemoteRankError)):
        return
    if isinstance(exc, SystemExit):
        return
    publish_failure(exc, tb)
    try:
        sys.stderr.write(format_user_traceback(exc, tb))
        sys.stderr.flush()
        exc._onedist_printed = True  # type: ignore[attr-defined]
    except Exception:
        pass


def _excepthook(tp: type[BaseException], value: BaseException, tb: Optional[TracebackType]) -> None:
    if getattr(value, "_onedist_printed", False):
        sys.stderr.write(
            f"{tp.__name__}: {value} (traceback printed above, before the other ranks were released)\n"
        )
    else:
        publish_failure(value, tb)
        hook = world.previous_hook or sys.__excepthook__
        hook(tp, value, tb)
    _exit_without_mpi_finalize()


def _exit_without_mpi_finalize() -> None:
    """A rank dying of an exception must not enter MPI_Finalize (mpi4py's exit hook): it waits for
    the other ranks, which wait for this one to exit, and the MPI launcher then names a rank that
    only followed as the first to fail. Leave at once instead, as ``python -m mpi4py`` does."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return
    try:
        if not mpi.Is_initialized() or mpi.Is_finalized():
            return
    except Exception:
        return
    run_forced_exit_callbacks()
    sys.stdout.flush()
    sys.stderr.flush()
    release_stderr()
    os._exit(1)


def install() -> None:
    """Publish uncaught exceptions of this process to the other ranks (called by initialize)."""
    if not world.hook_installed:
        world.previous_hook = sys.excepthook
        sys.excepthook = _excepthook
        world.hook_installed = True


def uninstall() -> None:
    """Undo :func:`install` (for tests; finalize keeps the hook: an exception that made a rank
    leave its context is printed by it after finalize)."""
    if world.hook_installed:
        if sys.excepthook is _excepthook:
            sys.excepthook = world.previous_hook or sys.__excepthook__
        world.hook_installed = False
        world.previous_hook = None
