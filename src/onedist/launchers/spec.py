"""The arguments of one launch, checked once: :class:`LaunchSpec`.

:meth:`LaunchSpec.build` is the one place where the launch arguments of :func:`onedist.spawn` and
``Parallel(nproc_per_node=...)`` are checked; each error names the argument, the value given and
what is allowed. Every launcher then takes the spec, never the arguments one by one.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

from .._net import LOOPBACK
from ..errors import bad_type, bad_value

__all__ = ["START_METHODS", "LaunchSpec", "available_start_methods", "check_max_restarts"]

#: multiprocessing's start methods that spawn takes (those this platform has)
START_METHODS = ("spawn", "fork", "forkserver")


@dataclass(frozen=True)
class LaunchSpec:
    """What :func:`onedist.spawn` (or ``Parallel``) was asked to start, after its checks:
    ``backend`` is the name ``initialize`` will get in each worker (``"auto"`` resolved),
    ``timeout`` a timedelta or None. Build one with :meth:`build`."""

    backend: str
    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = LOOPBACK
    master_port: Optional[int] = None
    init_method: Optional[str] = None
    timeout: Optional[timedelta] = None
    start_method: str = "spawn"
    hosts: Optional[str] = None
    max_restarts: int = 0

    @classmethod
    def build(
        cls,
        backend: Any,
        fn: Any,
        args: Any = (),
        kwargs: Any = None,
        nproc_per_node: Any = 1,
        nnodes: Any = 1,
        node_rank: Any = 0,
        master_addr: Any = LOOPBACK,
        master_port: Any = None,
        init_method: Any = None,
        timeout: Any = None,
        start_method: Any = "spawn",
        hosts: Any = None,
        max_restarts: Any = 0,
        *,
        caller: str = "spawn",
    ) -> LaunchSpec:
        """Check the launch arguments and return their spec: ``"auto"`` resolved for this launch,
        the backend available here, ``timeout`` as a timedelta. ``caller``: the public function
        the timeout error names; ``"Parallel"`` also takes ``start_method="subprocess"``.

        Raises:
            OnedistValueError / OnedistTypeError: an argument is not allowed (the message names
                it, the value and what is allowed).
            BackendUnavailableError: the backend cannot run here.
        """
        _check_fn_args(backend, fn, args, kwargs)
        _check_shape(nproc_per_node, nnodes, node_rank)
        _check_rendezvous(master_addr, master_port, init_method)
        _check_start(backend, start_method, hosts, caller)
        check_max_restarts("spawn", max_restarts, nnodes=nnodes, start_method=start_method)
        from ..context import backend_class, check_timeout, resolve_backend_name

        name = resolve_backend_name(backend, nnodes, nproc_per_node)
        backend_class(name)  # initialize's error for a backend unknown or not installed here
        td = check_timeout(caller, timeout)
        args, kwargs = tuple(args), dict(kwargs or {})
        return cls(name, fn, args, kwargs, nproc_per_node, nnodes, node_rank, master_addr, master_port,
                   init_method, td, start_method, hosts, max_restarts)  # fmt: skip

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def env_rendezvous(self) -> bool:
        """The workers meet through torchrun's variables (``env://``, the default), not a URL."""
        return self.init_method is None or self.init_method.startswith("env://")

    def rank(self, local_rank: int) -> int:
        """The global rank of ``local_rank`` on this node."""
        return self.node_rank * self.nproc_per_node + local_rank

    def check_rendezvous_port(self) -> None:
        """onedist's own launcher (torch.distributed backends): several nodes meet at one fixed port."""
        if self.nnodes > 1 and self.master_port is None and self.env_rendezvous:
            raise bad_value(
                "spawn",
                "master_port",
                None,
                "a port number when nnodes > 1 (every node must use the same one)",
                hint="pass master_addr=<node 0's address> and master_port=<free port on node 0> "
                "on every node",
            )


def _check_fn_args(backend: Any, fn: Any, args: Any, kwargs: Any) -> None:
    if not isinstance(backend, str):
        raise bad_type("spawn", "backend", backend, "str, e.g. 'gloo', 'nccl' or 'auto'")
    if not callable(fn):
        raise bad_type("spawn", "fn", fn, "a callable fn(local_rank, *args, **kwargs)")
    if not isinstance(args, (tuple, list)):
        raise bad_type("spawn", "args", args, "tuple of positional arguments for fn")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise bad_type("spawn", "kwargs_dict", kwargs, "dict of keyword arguments for fn, or None")


def _check_shape(nproc_per_node: Any, nnodes: Any, node_rank: Any) -> None:
    for name, value in (("nproc_per_node", nproc_per_node), ("nnodes", nnodes), ("node_rank", node_rank)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise bad_type("spawn", name, value, "int")
    if nproc_per_node < 1:
        raise bad_value("spawn", "nproc_per_node", nproc_per_node, "an int >= 1")
    if nnodes < 1:
        raise bad_value("spawn", "nnodes", nnodes, "an int >= 1")
    if not 0 <= node_rank < nnodes:
        raise bad_value("spawn", "node_rank", node_rank, f"0..{nnodes - 1} (nnodes={nnodes})")


def _check_rendezvous(master_addr: Any, master_port: Any, init_method: Any) -> None:
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


def available_start_methods() -> list[str]:
    """The start methods of :data:`START_METHODS` this platform has."""
    return [m for m in START_METHODS if m in multiprocessing.get_all_start_methods()]


def _check_start(backend: str, start_method: Any, hosts: Any, caller: str) -> None:
    subprocess = caller == "Parallel" and start_method == "subprocess"  # Parallel's re-exec
    if not subprocess and start_method not in available_start_methods():
        raise bad_value("spawn", "start_method", start_method, available_start_methods())
    if hosts is not None and backend != "horovod":
        raise bad_value(
            "spawn",
            "hosts",
            hosts,
            f"None with backend {backend!r}",
            hint="hosts is horovod.run's host list, for backend 'horovod'; other backends run "
            "spawn once per node, with nnodes, node_rank and master_addr",
        )


def check_max_restarts(func: str, value: Any, *, nnodes: Any = 1, start_method: Any = "spawn") -> None:
    """``max_restarts`` of ``spawn`` / ``Parallel``: an int >= 0, and 0 where the workers cannot be
    restarted from here (several nodes: the nodes would have to agree; the re-exec start method:
    this process is rank 0 itself)."""
    allowed = "an int >= 0 (how many times the workers are started again after one fails)"
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad_type(func, "max_restarts", value, allowed)
    if value < 0:
        raise bad_value(func, "max_restarts", value, allowed)
    if value and nnodes != 1:
        raise bad_value(
            func,
            "max_restarts",
            value,
            f"0 with nnodes={nnodes}: restarts over several nodes must be agreed between them",
            hint="start each node with `onedist run --nnodes N --node-rank K --max-restarts N ...`, "
            "whose launchers agree on each restart",
        )
    if value and start_method == "subprocess":
        raise bad_value(
            func,
            "max_restarts",
            value,
            "0 with start_method='subprocess' (this process is rank 0 itself: it cannot restart it)",
            hint="use start_method 'spawn' or 'fork', or `onedist run --max-restarts N script.py`",
        )
