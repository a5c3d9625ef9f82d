"""Starting worker processes from Python: :func:`spawn`, and the choice of launcher for a launch.

Starting processes and initialising a group are separate: a launcher starts and watches the
workers, each worker calls :func:`onedist.initialize`; :class:`onedist.Parallel` decides whether
to spawn, only initialise (an external launcher such as torchrun already started the processes),
or run serially. :func:`launcher_for` picks the :class:`~.launcher.Launcher` of a launch: the
backend's own (mpirun, horovod.run, xmp.spawn), the re-exec one of
``Parallel(start_method="subprocess")``, or onedist's multiprocessing one
(:class:`~.processes.ProcessLauncher`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

from .._net import LOOPBACK
from .arguments import from_keywords
from .horovodrun import HorovodrunLauncher
from .launcher import Launcher
from .mpirun import MpirunLauncher
from .processes import ProcessLauncher
from .reexec import ReexecLauncher
from .spec import LaunchSpec
from .xmp import XmpLauncher

__all__ = ["launch", "launcher_for", "spawn"]


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
    max_restarts: int = 0,
    recovery: str = "restart",
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
            "forkserver" (safe with CUDA; the server imports torch and onedist once, so every
            later ``spawn`` of the program starts its workers in a fraction of a second; each
            worker gets the caller's environment at the call).
        hosts: backend "horovod" only: ``horovod.run``'s host list ``"host1:slots,host2:slots"``,
            as ignite passes it; ``nproc_per_node`` is then the number of processes over all of
            them. Hosts other than this one are reached with ssh, as horovodrun does.
        max_restarts: after a worker fails, stop the others and start them all again, up to
            this many times (one line on stderr per restart), each attempt on a fresh port
            (the same ``master_port`` when one is given) with the attempt in
            ``TORCHELASTIC_RESTART_COUNT`` (:func:`onedist.restart_count`); an int >= 0, 0 on
            several nodes (use ``onedist run --max-restarts``). Ctrl-C is never restarted.
        recovery: "restart" (the default: what ``max_restarts`` says). "live" (a dead rank replaced
            alone, the others kept) is ``onedist run --recovery live``'s, and refused here.

    Returns:
        Each local rank's return value, in local-rank order (values that cannot be pickled come
        back as None).

    Raises:
        WorkerFailedError: a worker raised or died (on the last attempt, with ``max_restarts``).
            The message starts with the failing rank and its traceback; the others were stopped.

    Example:
        >>> import onedist as od
        >>> def train(local_rank, lr):
        ...     return od.all_reduce(lr, op="MEAN")
        >>> if __name__ == "__main__":
        ...     print(od.spawn("gloo", train, args=(0.1,), nproc_per_node=2))
        [0.1, 0.1]
    """
    # this function's parameters are the declared launch arguments (tests/test_architecture.py)
    return launch(LaunchSpec.build(from_keywords(locals())))


def launcher_for(spec: LaunchSpec) -> Launcher:
    """The launcher that starts the workers of ``spec``: the re-exec one for
    ``Parallel(start_method="subprocess")``, the backend's own launcher where its workers must come
    from it (mpirun for ``"mpi"`` beyond one process, horovod.run, xmp.spawn), else onedist's."""
    if spec.start_method == "subprocess":
        return ReexecLauncher(spec)
    if spec.own_launcher:
        own: dict[str, Callable[[LaunchSpec], Launcher]] = {
            "mpi": MpirunLauncher, "horovod": HorovodrunLauncher, "xla-tpu": XmpLauncher
        }  # fmt: skip
        return own[spec.backend](spec)
    return ProcessLauncher(spec)


def launch(spec: LaunchSpec) -> list[Any]:
    """Start the workers of ``spec`` and return their results in local-rank order; raise
    :class:`WorkerFailedError` when one fails (after the restarts ``spec.max_restarts`` allows)."""
    return launcher_for(spec).launch()
