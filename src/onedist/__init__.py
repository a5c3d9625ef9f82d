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

from importlib import import_module
from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:  # the names below are imported on first use (see __getattr__)
    from ._guard import is_debug as is_debug
    from ._guard import set_debug as set_debug
    from .auto import auto_dataloader as auto_dataloader
    from .auto import auto_model as auto_model
    from .auto import auto_optim as auto_optim
    from .auto import unwrap as unwrap
    from .backends import (
        available_backends as available_backends,
    )
    from .checkpoint import CheckpointNotFoundError as CheckpointNotFoundError
    from .checkpoint import load_checkpoint as load_checkpoint
    from .checkpoint import save_checkpoint as save_checkpoint
    from .collectives import (
        AsyncResult as AsyncResult,
    )
    from .collectives import (
        all_gather as all_gather,
    )
    from .collectives import (
        all_gather_object as all_gather_object,
    )
    from .collectives import (
        all_gather_tensors_with_shapes as all_gather_tensors_with_shapes,
    )
    from .collectives import (
        all_reduce as all_reduce,
    )
    from .collectives import (
        barrier as barrier,
    )
    from .collectives import (
        broadcast as broadcast,
    )
    from .collectives import (
        broadcast_object as broadcast_object,
    )
    from .collectives import (
        gather as gather,
    )
    from .collectives import (
        irecv as irecv,
    )
    from .collectives import (
        isend as isend,
    )
    from .collectives import (
        new_group as new_group,
    )
    from .collectives import (
        recv as recv,
    )
    from .collectives import (
        reduce as reduce,
    )
    from .collectives import (
        scatter as scatter,
    )
    from .collectives import (
        send as send,
    )
    from .context import (
        backend as backend,
    )
    from .context import (
        device as device,
    )
    from .context import (
        finalize as finalize,
    )
    from .context import (
        get_local_process_group as get_local_process_group,
    )
    from .context import (
        get_local_rank as get_local_rank,
    )
    from .context import (
        get_local_size as get_local_size,
    )
    from .context import (
        get_nnodes as get_nnodes,
    )
    from .context import (
        get_node_rank as get_node_rank,
    )
    from .context import (
        get_nproc_per_node as get_nproc_per_node,
    )
    from .context import (
        get_rank as get_rank,
    )
    from .context import (
        get_world_size as get_world_size,
    )
    from .context import (
        hostname as hostname,
    )
    from .context import (
        initialize as initialize,
    )
    from .context import (
        is_main_process as is_main_process,
    )
    from .context import (
        model_name as model_name,
    )
    from .context import (
        set_local_rank as set_local_rank,
    )
    from .context import (
        show_config as show_config,
    )
    from .context import (
        sync as sync,
    )
    from .errors import (
        BackendUnavailableError as BackendUnavailableError,
    )
    from .errors import (
        CollectiveMismatchError as CollectiveMismatchError,
    )
    from .errors import (
        LaunchArgumentError as LaunchArgumentError,
    )
    from .errors import (
        OnedistError as OnedistError,
    )
    from .errors import (
        OnedistRuntimeError as OnedistRuntimeError,
    )
    from .errors import (
        OnedistTimeoutError as OnedistTimeoutError,
    )
    from .errors import (
        OnedistTypeError as OnedistTypeError,
    )
    from .errors import (
        OnedistValueError as OnedistValueError,
    )
    from .errors import (
        RemoteRankError as RemoteRankError,
    )
    from .errors import (
        WorkerFailedError as WorkerFailedError,
    )
    from .evaluation import all_gather_eval as all_gather_eval
    from .helpers import (
        one_rank_first as one_rank_first,
    )
    from .helpers import (
        one_rank_only as one_rank_only,
    )
    from .helpers import (
        reduce_dict as reduce_dict,
    )
    from .helpers import (
        shared_random_seed as shared_random_seed,
    )
    from .helpers import (
        synchronize as synchronize,
    )
    from .launchers.spawn import (
        spawn as spawn,
    )
    from .log import (
        setup_logger as setup_logger,
    )
    from .parallel import (
        Parallel as Parallel,
    )
    from .samplers import DistributedEvalSampler as DistributedEvalSampler
    from .samplers import DistributedProxySampler as DistributedProxySampler
    from .samplers import DistributedSampler as DistributedSampler
    from .syncbn import SyncBatchNorm as SyncBatchNorm
    from .syncbn import convert_sync_batchnorm as convert_sync_batchnorm

    has_native_dist_support: bool
    has_hvd_support: bool
    has_xla_support: bool

__all__ = [
    "set_debug",
    "is_debug",
    "CheckpointNotFoundError",
    "SyncBatchNorm",
    "convert_sync_batchnorm",
    "AsyncResult",
    "BackendUnavailableError",
    "CollectiveMismatchError",
    "DistributedEvalSampler",
    "DistributedProxySampler",
    "DistributedSampler",
    "LaunchArgumentError",
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
    "all_gather_eval",
    "all_gather_object",
    "all_gather_tensors_with_shapes",
    "all_reduce",
    "auto_dataloader",
    "auto_model",
    "auto_optim",
    "available_backends",
    "backend",
    "barrier",
    "broadcast",
    "broadcast_object",
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
    "load_checkpoint",
    "model_name",
    "new_group",
    "one_rank_first",
    "one_rank_only",
    "recv",
    "reduce",
    "reduce_dict",
    "save_checkpoint",
    "scatter",
    "send",
    "set_local_rank",
    "setup_logger",
    "shared_random_seed",
    "show_config",
    "spawn",
    "sync",
    "synchronize",
    "unwrap",
]

# public name -> submodule that defines it. `import onedist` imports none of them (nor torch):
# the launcher (`onedist run`) starts workers without paying for torch in its own process.
_LAZY = {
    "set_debug": "_guard",
    "is_debug": "_guard",
    "CheckpointNotFoundError": "checkpoint",
    "SyncBatchNorm": "syncbn",
    "convert_sync_batchnorm": "syncbn",
    "auto_model": "auto",
    "auto_optim": "auto",
    "auto_dataloader": "auto",
    "unwrap": "auto",
    "DistributedSampler": "samplers",
    "DistributedProxySampler": "samplers",
    "DistributedEvalSampler": "samplers",
    "all_gather_eval": "evaluation",
    "save_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "available_backends": "backends",
    "AsyncResult": "collectives",
    "all_gather": "collectives",
    "all_gather_object": "collectives",
    "all_gather_tensors_with_shapes": "collectives",
    "all_reduce": "collectives",
    "barrier": "collectives",
    "broadcast": "collectives",
    "broadcast_object": "collectives",
    "gather": "collectives",
    "irecv": "collectives",
    "isend": "collectives",
    "new_group": "collectives",
    "recv": "collectives",
    "reduce": "collectives",
    "scatter": "collectives",
    "send": "collectives",
    "backend": "context",
    "device": "context",
    "finalize": "context",
    "get_local_process_group": "context",
    "get_local_rank": "context",
    "get_local_size": "context",
    "get_nnodes": "context",
    "get_node_rank": "context",
    "get_nproc_per_node": "context",
    "get_rank": "context",
    "get_world_size": "context",
    "hostname": "context",
    "initialize": "context",
    "is_main_process": "context",
    "model_name": "context",
    "set_local_rank": "context",
    "show_config": "context",
    "sync": "context",
    "BackendUnavailableError": "errors",
    "CollectiveMismatchError": "errors",
    "LaunchArgumentError": "errors",
    "OnedistError": "errors",
    "OnedistRuntimeError": "errors",
    "OnedistTimeoutError": "errors",
    "OnedistTypeError": "errors",
    "OnedistValueError": "errors",
    "RemoteRankError": "errors",
    "WorkerFailedError": "errors",
    "one_rank_first": "helpers",
    "one_rank_only": "helpers",
    "reduce_dict": "helpers",
    "shared_random_seed": "helpers",
    "synchronize": "helpers",
    "Parallel": "parallel",
    "spawn": "launchers.spawn",
    "setup_logger": "log",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is not None:
        value = getattr(import_module(f".{module_name}", __name__), name)
    elif name == "has_native_dist_support":
        import torch.distributed

        value = torch.distributed.is_available()
    elif name in ("has_hvd_support", "has_xla_support"):
        from importlib.util import find_spec

        value = find_spec("horovod" if name == "has_hvd_support" else "torch_xla") is not None
    else:
        raise AttributeError(f"module 'onedist' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
