"""Starting worker processes from Python: :func:`spawn`, and the supervisor that watches them.

Starting processes and initialising a group are separate: :func:`spawn` starts and watches the
workers, each worker calls :func:`onedist.initialize`; :class:`onedist.Parallel` decides whether
to spawn, only initialise (an external launcher such as torchrun already started the processes),
or run serially. Backends whose workers a launcher of their own starts (mpirun, horovod.run,
xmp.spawn) go through :func:`onedist.launchers.own_launcher` instead.

Failure handling: every worker reports its exception (type, message, traceback, time) to the
parent through a pipe. When one fails, the parent collects what arrives within a short grace
period, stops the others (SIGTERM, then SIGKILL after 3 s) and raises :class:`WorkerFailedError`
with the failing rank's traceback first. Errors that are only a consequence of another rank's
death ("Connection closed by peer", ...) are never shown as the cause. Workers die with the parent
(Linux ``PR_SET_PDEATHSIG``), so a killed parent leaves no orphans.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from .._net import LOOPBACK, STORE_FD_ENV, rendezvous_port
from ..errors import OnedistRuntimeError, WorkerFailedError, bad_type, bad_value, format_user_traceback
from . import LaunchSpec, own_launcher
from .checks import check_picklable
from .report import Failure, failure_report
from .worker import call_worker_fn, exit_failed, torchrun_env, worker_threads_env

__all__ = ["spawn"]

logger = logging.getLogger("onedist")

_START_METHODS = ("spawn", "fork", "forkserver")
# failure policy of spawn and `onedist run` alike:
GRACE_S = 0.3  # wait this long after the first failure for near-simultaneous reports
INTERRUPT_S = 2.0  # on Ctrl-C, how long the workers get to say where they were
TERM_S = 3.0  # then SIGTERM, and SIGKILL whoever is left after this long


def _die_with_parent(parent_pid: Optional[int]) -> None:
    """Ask Linux to SIGKILL this worker when the process that started it dies (``parent_pid``:
    the launcher, when it is the direct parent; None under forkserver, whose server is)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent_pid is not None and os.getppid() != parent_pid:  # died before prctl took effect
        os._exit(1)


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
    _die_with_parent(cfg["parent_pid"])
    os.environ.update(cfg["env"])
    if cfg["store_socket"] is not None:
        os.environ[STORE_FD_ENV] = str(cfg["store_socket"].detach())
    if cfg["forked"] or "OMP_NUM_THREADS" in cfg["env"]:
        import torch

        # A forked child inherits the parent's OpenMP thread pool in a broken state (libgomp):
        # its first parallel region would hang if the parent ever ran one. One thread avoids
        # parallel regions; OMP_NUM_THREADS, when the user set it, is honoured. A spawned child
        # imported torch (unpickling fn re-imports the script) before OMP_NUM_THREADS=1 reached
        # its environment, so torch's pool must be resized here too.
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


# ============================================================================ parent side
@dataclass
class _Worker:
    rank: int
    local_rank: int
    process: Any
    conn: Any
    reported: bool = False
    result: Any = None
    failure: Optional[Failure] = None


def _exit_failure(w: _Worker) -> Failure:
    code = w.process.exitcode
    failure = Failure(w.rank, w.local_rank, w.process.pid, time.time(), exitcode=code)
    if code == 1:
        failure.extra.append(
            "It exited before onedist could run your function. If the script starts workers at "
            'import time, guard the start with `if __name__ == "__main__":` (start_method '
            "'spawn' re-imports the main module in every worker)."
        )
    return failure


def _read(w: _Worker) -> None:
    """Read the worker's report if one is waiting (non-blocking)."""
    if w.reported:
        return
    try:
        if not w.conn.poll():
            return
        msg = pickle.loads(w.conn.recv_bytes())
    except (EOFError, OSError):
        return
    except Exception as e:  # the result could not be unpickled here
        w.reported = True
        w.failure = Failure(
            w.rank,
            w.local_rank,
            w.process.pid,
            time.time(),
            exc_type=type(e).__name__,
            message=f"its return value could not be unpickled in the parent: {e}",
        )
        return
    w.reported = True
    if msg[0] == "ok":
        w.result = msg[1]
    else:
        _, when, exc_type, message, tb = msg
        w.failure = Failure(
            w.rank, w.local_rank, w.process.pid, when, exc_type=exc_type, message=message, traceback=tb
        )


def _interrupted(workers: list[_Worker]) -> None:
    """Ctrl-C in the parent: give the workers ``INTERRUPT_S`` to say where they were, stop those
    left, and print each one's traceback, prefixed with its rank, as ``onedist run`` does (to see
    where a job hung, Ctrl-C it).

    A terminal sends SIGINT to its whole foreground process group, workers included; a worker that
    has not reported after a moment (SIGINT sent to the parent alone) gets one from here."""
    pending = [w for w in workers if not w.reported and w.process.is_alive()]
    start = time.monotonic()
    nudged = False
    try:
        while pending and time.monotonic() < start + INTERRUPT_S:
            if not nudged and time.monotonic() >= start + INTERRUPT_S / 4:
                nudged = True
                for w in pending:
                    try:
                        os.kill(w.process.pid, signal.SIGINT)
                    except ProcessLookupError:
                        pass
            waitables = [w.conn for w in pending] + [w.process.sentinel for w in pending]
            multiprocessing.connection.wait(waitables, INTERRUPT_S / 8)
            for w in list(pending):
                _read(w)
                if w.reported or not w.process.is_alive():
                    _read(w)
                    pending.remove(w)
    finally:
        _stop(workers)
    lines: list[str] = []
    for w in workers:
        f = w.failure
        if f is not None and f.traceback:
            lines += [f"[rank{w.rank}]: {line}" for line in f.traceback.rstrip().splitlines()]
        elif w.failure is None and not w.reported:
            lines.append(f"[rank{w.rank}]: (no traceback: busy outside Python, stopped)")
    if lines:
        sys.stderr.write("onedist.spawn: interrupted; where each worker was:\n" + "\n".join(lines) + "\n")
        sys.stderr.flush()


def _stop(workers: list[_Worker]) -> None:
    alive = [w for w in workers if w.process.is_alive()]
    for w in alive:
        try:
            os.kill(w.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + TERM_S
    for w in alive:
        w.process.join(max(0.0, deadline - time.monotonic()))
    for w in alive:
        if w.process.is_alive():
            try:
                os.kill(w.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            w.process.join()


def _failure_error(workers: list[_Worker]) -> WorkerFailedError:
    primary, message = failure_report([w.failure for w in workers if w.failure is not None])
    return WorkerFailedError(message, primary.rank, primary.local_rank, primary.exitcode, primary.traceback)


def _watch(workers: list[_Worker]) -> list[Any]:
    """Wait for every worker; on the first failure stop the rest and raise."""
    pending = {id(w): w for w in workers}
    first_failure_at: Optional[float] = None
    while pending:
        waitables: list[Any] = []
        for w in pending.values():
            waitables.append(w.process.sentinel)
            if not w.reported:
                waitables.append(w.conn)
        timeout = (
            None if first_failure_at is None else max(0.0, first_failure_at + GRACE_S - time.monotonic())
        )
        ready = multiprocessing.connection.wait(waitables, timeout)
        for w in list(pending.values()):
            if w.conn in ready or w.process.sentinel in ready:
                _read(w)
            if w.process.sentinel in ready:
                w.process.join()
                _read(w)
                if w.failure is None and (w.process.exitcode != 0 or not w.reported):
                    w.failure = _exit_failure(w)
                del pending[id(w)]
            if w.failure is not None and first_failure_at is None:
                first_failure_at = time.monotonic()
        if first_failure_at is not None and time.monotonic() >= first_failure_at + GRACE_S:
            for w in pending.values():
                _read(w)
                if w.failure is None:
                    w.failure = Failure(w.rank, w.local_rank, w.process.pid, time.time(), stopped=True)
            _stop(list(pending.values()))
            raise _failure_error(workers)
    if any(w.failure is not None for w in workers):
        raise _failure_error(workers)
    return [w.result for w in workers]


def _interactive_main(fn: Callable[..., Any]) -> bool:
    main = sys.modules.get("__main__")
    return getattr(fn, "__module__", None) == "__main__" and not hasattr(main, "__file__")


def _check_spawn_args(
    backend: Any,
    fn: Any,
    args: Any,
    kwargs_dict: Any,
    nproc_per_node: Any,
    nnodes: Any,
    node_rank: Any,
    master_addr: Any,
    master_port: Any,
    init_method: Any,
    start_method: Any,
    hosts: Any,
) -> None:
    if not isinstance(backend, str):
        raise bad_type("spawn", "backend", backend, "str, e.g. 'gloo', 'nccl' or 'auto'")
    if not callable(fn):
        raise bad_type("spawn", "fn", fn, "a callable fn(local_rank, *args, **kwargs)")
    if not isinstance(args, (tuple, list)):
        raise bad_type("spawn", "args", args, "tuple of positional arguments for fn")
    if kwargs_dict is not None and not isinstance(kwargs_dict, Mapping):
        raise bad_type("spawn", "kwargs_dict", kwargs_dict, "dict of keyword arguments for fn, or None")
    for name, value in (("nproc_per_node", nproc_per_node), ("nnodes", nnodes), ("node_rank", node_rank)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise bad_type("spawn", name, value, "int")
    if nproc_per_node < 1:
        raise bad_value("spawn", "nproc_per_node", nproc_per_node, "an int >= 1")
    if nnodes < 1:
        raise bad_value("spawn", "nnodes", nnodes, "an int >= 1")
    if not 0 <= node_rank < nnodes:
        raise bad_value("spawn", "node_rank", node_rank, f"0..{nnodes - 1} (nnodes={nnodes})")
    if not isinstance(master_addr, str) or not master_addr:
        raise bad_type("spawn", "master_addr", master_addr, "a host name or IP address (str)")
    if master_port is not None and (
        not isinstance(master_port, int) or isinstance(master_port, bool) or not 1 <= master_port <= 65535
    ):
        raise bad_value("spawn", "master_port", master_port, "None (pick a free port) or an int in 1..65535")
    if init_method is not None and (
        not isinstance(init_method, str) or not init_method.startswith(("env://", "tcp://", "file://"))
    ):
        raise bad_value(
            "spawn", "init_method", init_method, "None, 'env://', 'tcp://host:port' or 'file:///path'"
        )
    if start_method not in _START_METHODS or start_method not in multiprocessing.get_all_start_methods():
        allowed = [m for m in _START_METHODS if m in multiprocessing.get_all_start_methods()]
        raise bad_value("spawn", "start_method", start_method, allowed)
    if hosts is not None and backend != "horovod":
        raise bad_value(
            "spawn",
            "hosts",
            hosts,
            f"None with backend {backend!r}",
            hint="hosts is horovod.run's host list, for backend 'horovod'; other backends run "
            "spawn once per node, with nnodes, node_rank and master_addr",
        )


def _check_rendezvous_port(nnodes: int, master_port: Optional[int], init_method: Optional[str]) -> None:
    """onedist's own launcher (torch.distributed backends): several nodes meet at one fixed port."""
    if nnodes > 1 and master_port is None and (init_method is None or init_method.startswith("env://")):
        raise bad_value(
            "spawn",
            "master_port",
            None,
            "a port number when nnodes > 1 (every node must use the same one)",
            hint="pass master_addr=<node 0's address> and master_port=<free port on node 0> on every node",
        )


def spawn(
    backend: str,
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs_dict: Optional[Mapping[str, Any]] = None,
    nproc_per_node: int = 1,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = LOOPBACK,
    master_port: Optional[int] = None,
    init_method: Optional[str] = None,
    timeout: Any = None,
    start_method: str = "spawn",
    hosts: Optional[str] = None,
) -> list[Any]:
    """Start ``nproc_per_node`` workers on this node, each running ``fn(local_rank, *args, **kwargs_dict)``.

    Each worker initialises ``backend`` (rank ``node_rank * nproc_per_node + local_rank`` of
    ``nnodes * nproc_per_node``), runs ``fn`` and finalises. The environment variables torchrun sets
    (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) are set in each worker.

    Args:
        backend: "gloo", "nccl", "shm", "horovod", "xla-tpu" or "auto" (nccl when CUDA is
            available, else shm for several processes on one node, else gloo); "mpi" needs the
            MPI launcher (``mpirun``), not spawn.
        fn: the function; with start_method "spawn" it must be importable (defined at module top
            level). From a notebook, a function defined in it is run with "fork" automatically when
            CUDA is not initialised yet.
        args: positional arguments after ``local_rank``.
        kwargs_dict: keyword arguments.
        nproc_per_node: workers on this node (>= 1).
        nnodes: number of nodes; run the same call on each with its ``node_rank``.
        node_rank: index of this node.
        master_addr: address of node 0 (127.0.0.1 for one node).
        master_port: rendezvous port; None picks a free one (one node only).
        init_method: None / "env://" (default), "tcp://host:port" or "file:///path".
        timeout: rendezvous and collective timeout (``timedelta`` or seconds).
        start_method: "spawn" (default, safe with CUDA), "fork" (fast; no CUDA before it) or
            "forkserver".
        hosts: backend "horovod" only: ``horovod.run``'s host list ``"host1:slots,host2:slots"``,
            as ignite passes it; ``nproc_per_node`` is then the number of processes over all of
            them. Hosts other than this one are reached with ssh, as horovodrun does.

    Returns:
        Each local rank's return value, in local-rank order (values that cannot be pickled come
        back as None).

    Raises:
        WorkerFailedError: a worker raised or died. The message starts with the failing rank and
            its traceback; the other workers were stopped.

    Example:
        >>> import onedist as od
        >>> def train(local_rank, lr):
        ...     return od.all_reduce(lr, op="MEAN")
        >>> if __name__ == "__main__":
        ...     print(od.spawn("gloo", train, args=(0.1,), nproc_per_node=2))
        [0.1, 0.1]
    """
    _check_spawn_args(
        backend,
        fn,
        args,
        kwargs_dict,
        nproc_per_node,
        nnodes,
        node_rank,
        master_addr,
        master_port,
        init_method,
        start_method,
        hosts,
    )
    from ..backends import class_for_backend
    from ..context import _resolve_backend_name, _timeout

    name = _resolve_backend_name(backend, nnodes, nproc_per_node)
    cls = class_for_backend(name)
    if cls is None:
        from ..context import initialize

        initialize(name)  # raises the standard "not available" error, listing what is
        raise AssertionError("unreachable")
    td = _timeout("spawn", timeout)
    own_launch = own_launcher(name)
    if own_launch is not None:
        spec = LaunchSpec(
            name,
            fn,
            tuple(args),
            dict(kwargs_dict or {}),
            nproc_per_node=nproc_per_node,
            nnodes=nnodes,
            node_rank=node_rank,
            master_addr=master_addr,
            master_port=master_port,
            init_method=init_method,
            timeout=td,
            start_method=start_method,
            hosts=hosts,
        )
        results = own_launch(spec)
        if results is not None:
            return results
    _check_rendezvous_port(nnodes, master_port, init_method)
    if start_method == "spawn" and _interactive_main(fn):
        import torch

        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            raise OnedistRuntimeError(
                "onedist.spawn: fn is defined in an interactive session, so 'spawn' cannot import it "
                "in the workers, and 'fork' is unsafe because CUDA is already initialised here.\n"
                "HINT: move fn to a .py module and import it, or restart the kernel and call spawn "
                "before any CUDA call"
            )
        logger.info("onedist.spawn: fn is defined interactively; starting workers with 'fork'")
        start_method = "fork"
    if start_method != "fork":
        check_picklable(fn, f"start_method={start_method!r}")

    world_size = nnodes * nproc_per_node
    threads = worker_threads_env(nproc_per_node)
    # Rank 0's store listens on a socket bound here, before any worker starts: no other program can
    # take the port in between, a port in use fails now with the fix, and one node listens on
    # loopback only. Only the env:// rendezvous (the default) can use it.
    host_store = node_rank == 0 and (init_method is None or init_method == "env://")
    try:
        port, store_sock = rendezvous_port(
            master_addr, master_port, host_store=host_store, what="master_port"
        )
    except OSError as e:
        raise OnedistRuntimeError(f"onedist.spawn: {e.strerror or e}") from e
    ctx = multiprocessing.get_context(start_method)
    workers: list[_Worker] = []
    try:
        for local_rank in range(nproc_per_node):
            rank = node_rank * nproc_per_node + local_rank
            env = {
                **torchrun_env(local_rank, nproc_per_node, node_rank, nnodes, master_addr, port),
                **threads,
            }
            cfg = {
                "backend": name,
                "env": env,
                "init_method": init_method,
                "timeout": td,
                "rank": None if init_method is None or init_method.startswith("env://") else rank,
                "world_size": None if init_method is None or init_method.startswith("env://") else world_size,
                "parent_pid": None if start_method == "forkserver" else os.getpid(),
                "forked": start_method == "fork",
                "store_socket": store_sock if local_rank == 0 else None,
            }
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(  # type: ignore[attr-defined]
                target=_worker_main,
                args=(local_rank, fn, tuple(args), dict(kwargs_dict or {}), cfg, writer),
                name=f"onedist-rank{rank}",
                daemon=False,
            )
            proc.start()
            writer.close()
            workers.append(_Worker(rank, local_rank, proc, reader))
            if store_sock is not None:  # rank 0 has its copy; later workers must not inherit one
                store_sock.close()
                store_sock = None
        return _watch(workers)
    except KeyboardInterrupt as e:
        _interrupted(workers)
        raise e.with_traceback(None) from None  # the workers' tracebacks tell where it was
    except BaseException:
        _stop(workers)
        raise
    finally:
        if store_sock is not None:
            store_sock.close()
        for w in workers:
            w.conn.close()
