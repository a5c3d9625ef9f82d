"""onedist's own launcher: one multiprocessing process per local rank (:class:`ProcessLauncher`).

Every worker reports its exception (type, message, traceback, time) to the parent through a
pipe. When one fails, the parent's :class:`~.supervisor.Supervisor` collects what arrives within a
short grace period, stops the others (SIGTERM, then SIGKILL after 3 s) and the launch raises
:class:`WorkerFailedError` with the failing rank's traceback first. Errors that are only a
consequence of another rank's death ("Connection closed by peer", ...) are never shown as the
cause. Workers die with the parent (Linux ``PR_SET_PDEATHSIG``), so a killed parent leaves no
orphans.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from .._net import STORE_FD_ENV, rendezvous_port
from ..errors import OnedistRuntimeError, format_user_traceback
from .checks import check_picklable
from .launcher import Launcher
from .report import Failure
from .spec import LaunchSpec
from .supervisor import ProcessWorker, Supervisor
from .worker import call_worker_fn, die_with_parent, exit_failed, torchrun_env, worker_threads_env

__all__ = ["ProcessLauncher"]

logger = logging.getLogger("onedist")

# added to the report of a worker that exited with status 1 before it could report anything
_EXIT_HINT = (
    "It exited before onedist could run your function. If the script starts workers at "
    'import time, guard the start with `if __name__ == "__main__":` (start_method '
    "'spawn' re-imports the main module in every worker)."
)


#: what start method "forkserver"'s server imports before it forks any worker: a worker then starts
#: in ~0.02 s instead of importing torch itself (~1 CPU-s; docs/performance.md, "Start-up")
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "onedist")


def _report(conn: Any, message: tuple[Any, ...]) -> None:
    try:
        conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:
        pass


def _worker_main(
    local_rank: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    cfg: dict[str, Any],
    conn: Any,
) -> None:
    """Entry point of every worker: initialise, run ``fn``, report, finalise."""
    die_with_parent(cfg["parent_pid"])
    if cfg["environ"] is not None:  # forkserver: the caller's environment now, not the server's
        os.environ.clear()
        os.environ.update(cfg["environ"])
    os.environ.update(cfg["env"])
    if cfg["store_socket"] is not None:
        os.environ[STORE_FD_ENV] = str(cfg["store_socket"].detach())
    if (
        cfg["forked"]
        or "OMP_NUM_THREADS" in cfg["env"]
        or (cfg["environ"] and "OMP_NUM_THREADS" in os.environ)
    ):
        import torch

        # A forked child inherits the parent's OpenMP thread pool in a broken state (libgomp):
        # its first parallel region would hang if the parent ever ran one. One thread avoids
        # parallel regions; OMP_NUM_THREADS, when the user set it, is honoured. A spawned child
        # imported torch (unpickling fn re-imports the script) before OMP_NUM_THREADS=1 reached
        # its environment, so torch's pool must be resized here too; so must a child of the fork
        # server, whose torch read the server's environment.
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from ..context import finalize, initialize

    try:
        initialize(
            cfg["backend"],
            timeout=cfg["timeout"],
            init_method=cfg["init_method"],
            rank=cfg["rank"],
            world_size=cfg["world_size"],
        )
        result = call_worker_fn(fn, local_rank, args, kwargs)
        finalize()
    except BaseException as e:
        from ..failures import publish_failure

        if isinstance(e, KeyboardInterrupt):  # a second SIGINT (see _interrupted) must not cut the report
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        publish_failure(e)  # the other ranks' collectives raise with this error, not "connection closed"
        _report(conn, ("error", time.time(), type(e).__name__, str(e), format_user_traceback(e)))
        exit_failed()
    try:
        payload = pickle.dumps(("ok", result), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        logger.warning(
            "onedist.spawn: the return value of local rank %d cannot be pickled (%s); returning None",
            local_rank,
            e,
        )
        payload = pickle.dumps(("ok", None))
    conn.send_bytes(payload)
    conn.close()


class ProcessLauncher(Launcher):
    """Start ``spec.nproc_per_node`` processes (its start method), each initialising the backend
    and running ``spec.fn``; restarted as a whole while ``spec.max_restarts`` allows."""

    name = "onedist.spawn"

    def __init__(self, spec: LaunchSpec) -> None:
        super().__init__(spec.max_restarts)
        spec.check_rendezvous_port()
        self.spec = _with_start_method(spec)
        self._supervisor = Supervisor[ProcessWorker]()

    def attempt(self, number: int) -> list[Failure]:
        self._supervisor = Supervisor[ProcessWorker]()
        return _run_attempt(self.spec, number, self._supervisor)

    def results(self) -> list[Any]:
        return [w.result for w in self._supervisor.workers]


def _interactive_main(fn: Callable[..., Any]) -> bool:
    main = sys.modules.get("__main__")
    return getattr(fn, "__module__", None) == "__main__" and not hasattr(main, "__file__")


def _with_start_method(spec: LaunchSpec) -> LaunchSpec:
    """``spec`` with the start method that can start its ``fn`` ("fork" for a function defined in
    a notebook), or the error that says why none can."""
    if spec.start_method == "spawn" and _interactive_main(spec.fn):
        import torch

        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            raise OnedistRuntimeError(
                "onedist.spawn: fn is defined in an interactive session, so 'spawn' cannot import it "
                "in the workers, and 'fork' is unsafe because CUDA is already initialised here.\n"
                "HINT: move fn to a .py module and import it, or restart the kernel and call spawn "
                "before any CUDA call"
            )
        logger.info("onedist.spawn: fn is defined interactively; starting workers with 'fork'")
        spec = dataclasses.replace(spec, start_method="fork")
    if spec.start_method != "fork":
        check_picklable(spec.fn, f"start_method={spec.start_method!r}")
    return spec


def _run_attempt(spec: LaunchSpec, attempt: int, supervisor: Supervisor[ProcessWorker]) -> list[Failure]:
    """One attempt: start the workers (rank 0's store socket bound first) and watch them; their
    failures (none: each worker's result is in ``supervisor``). Every worker has ended on return."""
    # Rank 0's store listens on a socket bound here, before any worker starts: no other program can
    # take the port in between, a port in use fails now with the fix, and one node listens on
    # loopback only. Only the env:// rendezvous (the default) can use it. A restart binds again:
    # a fresh port (or the same given one), so no key of the failed attempt's store is read.
    host_store = spec.node_rank == 0 and spec.init_method in (None, "env://")
    try:
        port, store_sock = rendezvous_port(
            spec.master_addr, spec.master_port, host_store=host_store, what="master_port"
        )
    except OSError as e:
        raise OnedistRuntimeError(f"onedist.spawn: {e.strerror or e}") from e
    terminated = _TerminateHandler()
    try:
        _start_workers(spec, port, store_sock, supervisor, attempt)
        return supervisor.watch()
    except KeyboardInterrupt as e:  # never restarted
        supervisor.interrupted()
        _print_where_workers_were(supervisor)
        raise e.with_traceback(None) from None  # the workers' tracebacks tell where it was
    except _Terminated:  # the workers print where they were (onedist.failures.signals), then end
        terminated.ignore()  # a second SIGTERM (to the whole process group) must not cut it short
        supervisor.signal_all(signal.SIGTERM)
        supervisor.interrupted()
        terminated.die()
        raise
    except BaseException:
        supervisor.stop()
        raise
    finally:
        terminated.restore()
        supervisor.close()


class _Terminated(BaseException):
    """SIGTERM to the launching process while its workers run."""


class _TerminateHandler:
    """While workers run, SIGTERM (when nothing else handles it) stops them as Ctrl-C does, giving
    each the time to print where it was, and then ends this process by SIGTERM as it would have."""

    def __init__(self) -> None:
        self.installed = False
        try:
            if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
                signal.signal(signal.SIGTERM, self._raise)
                self.installed = True
        except ValueError:  # not the main thread: nothing to install
            pass

    @staticmethod
    def _raise(signum: int, frame: Any) -> None:
        raise _Terminated()

    def ignore(self) -> None:
        if self.installed:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def restore(self) -> None:
        if self.installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            self.installed = False

    def die(self) -> None:
        self.restore()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGTERM)


def _start_workers(
    spec: LaunchSpec, port: int, store_sock: Any, supervisor: Supervisor[ProcessWorker], attempt: int = 0
) -> None:
    """Start one process per local rank, each added to ``supervisor`` as it starts; rank 0 gets
    ``store_sock`` (closed here once it has its copy)."""
    ctx = multiprocessing.get_context(spec.start_method)
    forkserver = spec.start_method == "forkserver"
    if forkserver:
        # the server imports them once (when it starts); each worker forks with them loaded
        ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    # a forked server keeps the environment it started with: the caller's goes along
    caller_environ = dict(os.environ) if forkserver else None
    threads = worker_threads_env(spec.nproc_per_node)
    # torchrun's names for the attempt, read by od.restart_count()
    restarts = {
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
    }
    try:
        for local_rank in range(spec.nproc_per_node):
            env = {
                **torchrun_env(
                    local_rank, spec.nproc_per_node, spec.node_rank, spec.nnodes, spec.master_addr, port
                ),
                **threads,
                **restarts,
            }
            cfg = {
                "backend": spec.backend,
                "env": env,
                "init_method": spec.init_method,
                "timeout": spec.timeout,
                "rank": None if spec.env_rendezvous else spec.rank(local_rank),
                "world_size": None if spec.env_rendezvous else spec.world_size,
                "parent_pid": None if forkserver else os.getpid(),
                "forked": spec.start_method == "fork",
                "environ": caller_environ,
                "store_socket": store_sock if local_rank == 0 else None,
            }
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(  # type: ignore[attr-defined]
                target=_worker_main,
                args=(local_rank, spec.fn, spec.args, spec.kwargs, cfg, writer),
                name=f"onedist-rank{spec.rank(local_rank)}",
                daemon=False,
            )
            proc.start()
            writer.close()
            supervisor.workers.append(
                ProcessWorker(spec.rank(local_rank), local_rank, proc, reader, exit_hint=_EXIT_HINT)
            )
            if store_sock is not None:  # rank 0 has its copy; later workers must not inherit one
                store_sock.close()
                store_sock = None
    finally:
        if store_sock is not None:
            store_sock.close()


def _print_where_workers_were(supervisor: Supervisor[ProcessWorker]) -> None:
    """After Ctrl-C: each worker's traceback, prefixed with its rank, as ``onedist run`` shows it
    (to see where a job hung, Ctrl-C it)."""
    lines: list[str] = []
    for w in supervisor.workers:
        f = w.failure
        if f is not None and f.traceback:
            lines += [f"[rank{w.rank}]: {line}" for line in f.traceback.rstrip().splitlines()]
        elif w.failure is None and not w.reported:
            lines.append(f"[rank{w.rank}]: (no traceback: busy outside Python, stopped)")
    if lines:
        sys.stderr.write("onedist.spawn: interrupted; where each worker was:\n" + "\n".join(lines) + "\n")
        sys.stderr.flush()
