"""The one active backend, its lifecycle (initialize / finalize / sync) and the queries.

A context created outside onedist (the user called ``dist.init_process_group``) is picked up by
the first query that runs after it, with a pointer check and no collective, so a query made on
one rank only never blocks. A context the user destroyed is dropped the same way.
"""

from __future__ import annotations

import logging
import numbers
import os
import socket
import sys
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Optional, Union

import torch

from . import failures
from ._recovery import generation
from .backends import Backend, SerialBackend, announce_init_failure, available_backends, class_for_backend
from .errors import BackendUnavailableError, CollectiveMismatchError, OnedistRuntimeError, bad_type, bad_value
from .failures import injection
from .state import current, world

__all__ = [
    "available_backends",
    "backend",
    "current",
    "device",
    "finalize",
    "get_local_process_group",
    "get_local_rank",
    "get_local_size",
    "get_nnodes",
    "get_node_rank",
    "get_nproc_per_node",
    "get_rank",
    "get_world_size",
    "hostname",
    "initialize",
    "is_main_process",
    "model_name",
    "regrouped",
    "set_local_rank",
    "show_config",
    "sync",
]

logger = logging.getLogger("onedist")

# every backend name onedist knows, with what to install when it is missing here
_KNOWN_BACKENDS = {
    "gloo": "a PyTorch build with distributed support (pip install torch)",
    "nccl": "a CUDA build of PyTorch and an NVIDIA GPU",
    "mpi": "mpi4py and an MPI library (pip install 'onedist[mpi]', and e.g. apt-get install "
    "openmpi-bin), or a PyTorch built from source against MPI",
    "shm": "Linux on x86-64 and a PyTorch build with gloo",
    # these need builds that match the installed torch: say how
    "horovod": "Horovod 0.28 built with PyTorch and Gloo against this torch; `pip install horovod` fails "
    "to compile against torch 2.x (it forces C++14), so build it as the docs page launchers/horovodrun.md "
    "shows (.ci/install_horovod.sh in onedist's repository). Under horovodrun without Horovod's PyTorch "
    "extension, backend='gloo' works too: onedist reads horovodrun's environment",
    "xla-tpu": "torch_xla built for this torch release (torch_xla X.Y needs torch X.Y.*; a torch_xla "
    "whose version does not match torch's is not counted as available), e.g. `pip install torch==2.9.1 "
    "torch-xla==2.9.0` in a virtual environment of its own (docs: launchers/xla.md)",
}

TimeoutLike = Union[timedelta, float, int, None]


def sync(temporary: bool = False) -> None:
    """Re-detect the distributed context now.

    onedist notices a context created or destroyed outside it on its own, without running any
    collective; call this to make the detection explicit (e.g. right after your own
    ``dist.init_process_group`` on every rank, which also publishes this rank's node for
    :func:`get_local_rank`).

    Args:
        temporary: accepted for ignite compatibility; has no effect (detection is always cheap).

    Example:
        >>> import onedist as od
        >>> od.sync()
        >>> od.model_name()
        'serial'
    """
    current()


def regrouped() -> None:
    """The default group's connections were made again (live recovery, ``onedist.training.live_steps``):
    the ranks count their collectives afresh, as after :func:`initialize`.

    Example:
        >>> regrouped()
    """
    world.world_calls, world.group_calls = 0, {}
    world.routes = {}


def resolve_backend_name(name: Any, nnodes: Optional[int] = None, nprocs: Optional[int] = None) -> str:
    """The backend ``name`` stands for: "auto" is ``ONEDIST_BACKEND`` (set by ``onedist run
    --backend``), else nccl when it is available, else shm for several processes known to share
    one host, else gloo. ``nnodes``/``nprocs``: the run a launcher is about to start; None reads the
    launcher's variables of this process."""
    if not isinstance(name, str):
        raise bad_type("initialize", "backend", name, "str, e.g. 'gloo', 'nccl' or 'auto'")
    if name != "auto":
        return name
    chosen = os.environ.get("ONEDIST_BACKEND")
    if chosen and chosen != "auto":
        return chosen
    here = available_backends()
    if "nccl" in here:
        return "nccl"
    if "shm" in here and _one_host_several_processes(nnodes, nprocs):
        return "shm"
    return "gloo"


def _one_host_several_processes(nnodes: Optional[int], nprocs: Optional[int]) -> bool:
    """True when the run has several processes, all on this host (as far as anyone can tell)."""
    if nnodes is not None and nprocs is not None:
        return nnodes == 1 and nprocs > 1
    from .environments import detect_cluster as launcher_env

    env = launcher_env(os.environ)
    if env is None:
        return False
    layout = env.layout
    if layout.nnodes is not None:
        return layout.nnodes == 1 and env.world_size > 1
    return layout.nproc_per_node is not None and layout.nproc_per_node == env.world_size > 1


def check_timeout(func: str, timeout: TimeoutLike) -> Optional[timedelta]:
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise bad_type(func, "timeout", timeout, "datetime.timedelta, seconds as a number, or None")
    if not seconds > 0:
        raise bad_value(func, "timeout", timeout, "a positive duration")
    return timedelta(seconds=seconds)


def _check_rank_world(func: str, rank: Optional[int], world_size: Optional[int]) -> None:
    for arg, value in (("rank", rank), ("world_size", world_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise bad_type(func, arg, value, "int or None")
    if world_size is not None and world_size < 1:
        raise bad_value(func, "world_size", world_size, "an int >= 1")
    if rank is not None and (rank < 0 or (world_size is not None and rank >= world_size)):
        upper = "world_size - 1" if world_size is None else str(world_size - 1)
        raise bad_value(func, "rank", rank, f"0..{upper}")


def backend_class(name: str) -> type[Backend]:
    """The class of backend ``name`` (resolved, see :func:`resolve_backend_name`); raises
    :class:`~onedist.BackendUnavailableError` for a name unknown or not installed here (initialize's
    message, which ``spawn`` and ``Parallel`` raise before starting anything)."""
    cls = class_for_backend(name)
    if cls is not None:
        return cls
    here = available_backends()
    ignite_words = f"Backend should be one of '{here}'"  # what ignite's users match on
    if name in _KNOWN_BACKENDS:
        raise BackendUnavailableError(
            f"onedist.initialize: {ignite_words}: backend={name!r} is not available on this machine; "
            f"available here: {', '.join(repr(b) for b in here) or 'none'}\n"
            f"HINT: {name!r} needs {_KNOWN_BACKENDS[name]}"
        )
    raise BackendUnavailableError(
        f"onedist.initialize: {ignite_words}: backend={name!r} is not a known backend; allowed: "
        f"{', '.join(repr(b) for b in ('auto', *here))}"
    )


def initialize(
    backend: str,
    timeout: TimeoutLike = None,
    init_method: Optional[str] = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    **kwargs: Any,
) -> None:
    """Create the distributed context of this process.

    Args:
        backend: "gloo", "nccl", "mpi" (when available, see :func:`available_backends`) or
            "auto": the backend ``onedist run --backend`` chose (``ONEDIST_BACKEND``), else nccl when
            CUDA is available, else "shm" when the launcher's variables say that several
            processes share this one host, else gloo.
        timeout: timeout of the rendezvous and of collectives (``timedelta`` or seconds);
            None keeps torch's default.
        init_method: "env://" (default; RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the
            environment, as torchrun sets them), "tcp://host:port" or "file:///path"
            (both need ``rank`` and ``world_size``). Under ``env://`` in a process that no launcher
            started, a group of one process is made on 127.0.0.1 and a free port; the variables
            onedist sets are logged and restored by :func:`finalize`.
        rank: rank of this process (default: from the environment).
        world_size: number of processes (default: from the environment).
        **kwargs: passed to ``torch.distributed.init_process_group`` (e.g. ``pg_options``).

    Raises:
        BackendUnavailableError: unknown backend or not installed here.
        OnedistRuntimeError: a context exists already (call :func:`finalize` first).
        OnedistValueError: bad timeout, rank, world_size or init_method.

    Example:
        >>> import onedist as od
        >>> od.initialize("gloo")          # a lone process: world size 1
        >>> od.get_world_size(), od.backend()
        (1, 'gloo')
        >>> od.finalize()
    """
    fresh = isinstance(current(), SerialBackend)
    try:
        world.backend = _create(backend, timeout, init_method, rank, world_size, kwargs)
    except Exception as e:
        if fresh and init_method in (None, "env://"):
            announce_init_failure(e)  # the peers waiting for this rank to join raise it too
        raise
    world.world_calls, world.group_calls = 0, {}  # a new group: the stall check counts afresh
    world.routes = {}
    if world.backend.world_size > 1:
        failures.install()  # an uncaught exception here is reported to the other ranks
        failures.start_watch()  # and a failure of another rank ends this one, even outside collectives
    if not generation(os.environ):  # a live recovery's replacement: injected once already
        injection.install(world.backend.rank, restart_count())  # ONEDIST_INJECT_FAILURE, when set


def _create(
    backend: str,
    timeout: TimeoutLike,
    init_method: Optional[str],
    rank: Optional[int],
    world_size: Optional[int],
    kwargs: dict[str, Any],
) -> Backend:
    """initialize's checks, then the backend's constructor."""
    name = resolve_backend_name(backend)
    td = check_timeout("initialize", timeout)
    _check_rank_world("initialize", rank, world_size)
    cls = backend_class(name)
    active = current()
    if not isinstance(active, SerialBackend):
        origin = "onedist" if getattr(active, "owned", True) else active.external_origin
        raise OnedistRuntimeError(
            f"onedist.initialize: a distributed context ({active.backend}, world size "
            f"{active.world_size}) is already initialized by {origin}\n"
            "HINT: call onedist.finalize() before initializing again"
        )
    return cls.create_from_backend(
        name, timeout=td, init_method=init_method, rank=rank, world_size=world_size, **kwargs
    )


def finalize() -> None:
    """Destroy the distributed context and return to serial; safe to call twice.

    Restores every environment variable :func:`initialize` set and forgets a local rank given to
    :func:`set_local_rank`. Raises :class:`~onedist.CollectiveMismatchError` (after the cleanup)
    when a peer is still blocked in a collective this rank returned from (gloo returns an
    all_reduce early, with a wrong result, on the rank with fewer elements); waiting for that
    takes at most the stall check's time after the last collective began (``ONEDIST_STALL_S``,
    3 s), and nothing when every rank reaches finalize together.

    Called while an exception propagates (``try: train() finally: od.finalize()``), it first
    reports that exception to the other ranks, as the process's end would: a peer waiting for this
    rank (in DDP's backward, in a collective) raises :class:`~onedist.RemoteRankError` with it now,
    not once this process has exited.

    Example:
        >>> import onedist as od
        >>> od.finalize()   # nothing to do: no context
        >>> od.get_world_size()
        1
    """
    failing = sys.exc_info()[1]
    if failing is not None and not isinstance(world.backend, SerialBackend):
        failures.publish_failure(failing)
    finalize_context(check_last_call=failing is None)


def finalize_context(check_last_call: bool) -> None:
    """``finalize``; ``check_last_call=False`` when leaving on an error already (Parallel)."""
    b = world.backend
    # a peer still blocked in a call this rank returned from (gloo returns early on a smaller
    # tensor): raised here, after the cleanup, rather than exiting 0 with a wrong result
    mismatch = failures.check_at_finalize() if check_last_call and not isinstance(b, SerialBackend) else None
    world.backend, world.routes = SerialBackend(), {}
    Backend.local_rank_hint = None  # a hint describes one context
    injection.remove()
    if not isinstance(b, SerialBackend):
        failures.stop_watch()
        b.finalize()
    if mismatch is not None:
        raise CollectiveMismatchError(mismatch)


def backend() -> Optional[str]:
    """The backend name of the active context: "gloo", "nccl", "mpi", ..., or None when serial.

    Example:
        >>> import onedist as od
        >>> od.backend() is None
        True
    """
    return current().backend


def model_name() -> str:
    """The computation model: "serial", "native-dist" (torch.distributed), ...

    Example:
        >>> import onedist as od
        >>> od.model_name()
        'serial'
    """
    return current().model_name


def device() -> torch.device:
    """The device this process should compute on.

    ``cuda:<local rank>`` on nccl and on gloo when CUDA is available (``cuda:0`` when the process
    sees one GPU), ``cpu`` on gloo without CUDA, the current CUDA device or cpu when serial.

    Example:
        >>> import onedist as od
        >>> model = torch.nn.Linear(2, 2).to(od.device())
    """
    return current().device()


def get_world_size() -> int:
    """Number of processes (1 when serial).

    Example:
        >>> import onedist as od
        >>> od.get_world_size()
        1
    """
    return current().world_size


def get_rank() -> int:
    """Global rank of this process (0 when serial). Never runs a collective.

    Example:
        >>> import onedist as od
        >>> od.get_rank()
        0
    """
    return current().rank


def get_local_rank() -> int:
    """Rank of this process on its node.

    From the launcher's environment (LOCAL_RANK, ...) or :func:`set_local_rank` when present,
    else from the node every rank published when its context was created (no collective).

    Example:
        >>> import onedist as od
        >>> od.get_local_rank()
        0
    """
    return current().layout().local_rank


def get_nproc_per_node() -> int:
    """Number of processes on this node (uneven layouts are exact per node).

    Example:
        >>> import onedist as od
        >>> od.get_nproc_per_node()
        1
    """
    return current().layout().nproc_per_node


def get_local_size() -> int:
    """Alias of :func:`get_nproc_per_node` (detectron2's name).

    Example:
        >>> import onedist as od
        >>> od.get_local_size()
        1
    """
    return current().layout().nproc_per_node


def get_nnodes() -> int:
    """Number of nodes.

    Example:
        >>> import onedist as od
        >>> od.get_nnodes()
        1
    """
    return current().layout().nnodes


def get_node_rank() -> int:
    """Index of this process's node (nodes are ordered by their lowest rank).

    Example:
        >>> import onedist as od
        >>> od.get_node_rank()
        0
    """
    return current().layout().node_rank


def hostname() -> str:
    """Host name of this process.

    Example:
        >>> import onedist as od
        >>> isinstance(od.hostname(), str)
        True
    """
    return socket.gethostname()


def is_main_process() -> bool:
    """True on global rank 0.

    Example:
        >>> import onedist as od
        >>> if od.is_main_process():
        ...     print("only once")
        only once
    """
    return current().rank == 0


def restart_count(environ: Optional[Mapping[str, str]] = None) -> int:
    """How many times the launcher restarted this job's workers: 0 on the first run.

    Read from ``TORCHELASTIC_RESTART_COUNT``, which ``onedist run --max-restarts N`` and torchrun
    set (0 when unset: no launcher that restarts). Pair it with :func:`onedist.resume`.

    Args:
        environ: the variables to read (default ``os.environ``).

    Example:
        >>> import onedist as od
        >>> od.restart_count({"TORCHELASTIC_RESTART_COUNT": "2"}), od.restart_count({})
        (2, 0)
    """
    env = os.environ if environ is None else environ
    text = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    try:
        count = int(text)
    except ValueError:
        count = -1
    if count < 0:
        raise bad_value(
            "restart_count", "TORCHELASTIC_RESTART_COUNT", text, "an int >= 0 (set by the launcher)"
        )
    return count


def set_local_rank(index: int) -> None:
    """Tell onedist this process's local rank, for a context you create yourself.

    Wins over every other source (environment, published nodes) until :func:`finalize`.

    Args:
        index: local rank, e.g. the process index ``torch.multiprocessing.spawn`` passes.

    Example:
        >>> import onedist as od
        >>> def worker(local_rank):
        ...     od.set_local_rank(local_rank)
        ...     # dist.init_process_group(...)
    """
    if not isinstance(index, int) or isinstance(index, bool):
        raise bad_type("set_local_rank", "index", index, "int >= 0")
    if index < 0:
        raise bad_value("set_local_rank", "index", index, "an int >= 0")
    Backend.local_rank_hint = index
    world.backend.reset_layout()


def get_local_process_group() -> Any:
    """The group of the ranks on this node (for per-node SyncBatchNorm, local reductions, ...).

    Created on first use by the ranks of each node (only they take part); the default group
    (``torch.distributed.group.WORLD``) when every rank is on this node; ``[0]`` when serial (a
    group of the serial backend). Never None, as in detectron2.

    Example:
        >>> import onedist as od
        >>> group = od.get_local_process_group()
        >>> od.all_reduce(1, group=group) == od.get_local_size()
        True
    """
    return current().local_group()


def show_config() -> dict[str, Any]:
    """Log the distributed configuration (on rank 0, logger "onedist") and return it.

    Example:
        >>> import onedist as od
        >>> od.show_config()["world_size"]
        1
    """
    from .log import setup_logger

    b = current()
    lay = b.layout()
    config = {
        "model_name": b.model_name,
        "backend": b.backend,
        "device": str(b.device()),
        "hostname": hostname(),
        "world_size": b.world_size,
        "rank": b.rank,
        "local_rank": lay.local_rank,
        "nproc_per_node": lay.nproc_per_node,
        "nnodes": lay.nnodes,
        "node_rank": lay.node_rank,
    }
    log = setup_logger("onedist.config")
    log.info("distributed configuration: %s", config["model_name"])
    for key, value in config.items():
        if key != "model_name":
            log.info("%s: %s", key.replace("_", " "), value)
    return config
