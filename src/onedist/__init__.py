"""onedist: one PyTorch training script, every distributed backend and launcher.

The API of ``ignite.distributed`` (``import onedist as idist`` works for its users), detectron2's
``comm`` helpers, and more: collectives on any value with exact results, uneven gathers, groups
as rank lists, spawn with failure propagation.

Example:
    >>> import onedist as od
    >>> def main(local_rank):
    ...     total = od.all_reduce(1)            # number of processes
    ...     names = od.all_gather(od.hostname())
    ...     return total, names
    >>> with od.Parallel(backend=None) as parallel:   # serial; "gloo" + nproc_per_node=N to spawn
    ...     parallel.run(main)
    (1, [...])
"""

from __future__ import annotations

from typing import Any

import torch.distributed as _dist

from ._version import __version__
from .backends import available_backends
from .collectives import (
    AsyncResult,
    all_gather,
    all_gather_object,
    all_reduce,
    barrier,
    broadcast,
    gather,
    irecv,
    isend,
    new_group,
    recv,
    reduce,
    scatter,
    send,
)
from .context import (
    backend,
    device,
    finalize,
    get_local_process_group,
    get_local_rank,
    get_local_size,
    get_nnodes,
    get_node_rank,
    get_nproc_per_node,
    get_rank,
    get_world_size,
    hostname,
    initialize,
    is_main_process,
    model_name,
    set_local_rank,
    show_config,
    sync,
)
from .errors import (
    BackendUnavailableError,
    CollectiveMismatchError,
    OnedistError,
    OnedistRuntimeError,
    OnedistTimeoutError,
    OnedistTypeError,
    OnedistValueError,
    RemoteRankError,
    WorkerFailedError,
)
from .helpers import one_rank_first, one_rank_only, reduce_dict, shared_random_seed, synchronize
from .launch import Parallel, spawn
from .log import setup_logger

#: True when this torch build has torch.distributed (ignite's name).
has_native_dist_support: bool = _dist.is_available()

__all__ = [
    "AsyncResult",
    "BackendUnavailableError",
    "CollectiveMismatchError",
    "OnedistError",
    "OnedistRuntimeError",
    "OnedistTimeoutError",
    "OnedistTypeError",
    "OnedistValueError",
    "Parallel",
    "RemoteRankError",
    "WorkerFailedError",
    "__version__",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "available_backends",
    "backend",
    "barrier",
    "broadcast",
    "device",
    "finalize",
    "gather",
    "get_local_process_group",
    "get_local_rank",
    "get_local_size",
    "get_nnodes",
    "get_node_rank",
    "get_nproc_per_node",
    "get_rank",
    "get_world_size",
    "has_hvd_support",
    "has_native_dist_support",
    "has_xla_support",
    "hostname",
    "initialize",
    "irecv",
    "is_main_process",
    "isend",
    "model_name",
    "new_group",
    "one_rank_first",
    "one_rank_only",
    "recv",
    "reduce",
    "reduce_dict",
    "scatter",
    "send",
    "set_local_rank",
    "setup_logger",
    "shared_random_seed",
    "show_config",
    "spawn",
    "sync",
    "synchronize",
]


def __getattr__(name: str) -> Any:
    # computed on first access so `import onedist` does not search the disk for optional backends
    if name in ("has_hvd_support", "has_xla_support"):
        import importlib.util

        module = "horovod" if name == "has_hvd_support" else "torch_xla"
        value = importlib.util.find_spec(module) is not None
        globals()[name] = value
        return value
    raise AttributeError(f"module 'onedist' has no attribute {name!r}")
