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

from ._version import __version__ as __version__

if TYPE_CHECKING:  # for type checkers; at run time each name is imported on first use (__getattr__)
    from ._torch_plugin import (
        register_torch_backends as register_torch_backends,
    )
    from .backends import (
        available_backends as available_backends,
    )
    from .collectives import (
        AsyncResult as AsyncResult,
        all_gather as all_gather,
        all_gather_object as all_gather_object,
        all_gather_tensors_with_shapes as all_gather_tensors_with_shapes,
        all_reduce as all_reduce,
        barrier as barrier,
        broadcast as broadcast,
        broadcast_object as broadcast_object,
        gather as gather,
        irecv as irecv,
        isend as isend,
        new_group as new_group,
        recv as recv,
        reduce as reduce,
        scatter as scatter,
        send as send,
    )
    from .collectives.debug import (
        is_debug as is_debug,
        set_debug as set_debug,
    )
    from .collectives.differentiable import (
        differentiable_all_gather as differentiable_all_gather,
        differentiable_all_reduce as differentiable_all_reduce,
    )
    from .collectives.helpers import (
        create_local_process_group as create_local_process_group,
        one_rank_first as one_rank_first,
        one_rank_only as one_rank_only,
        reduce_dict as reduce_dict,
        shared_random_seed as shared_random_seed,
        synchronize as synchronize,
    )
    from .context import (
        backend as backend,
        device as device,
        finalize as finalize,
        get_local_process_group as get_local_process_group,
        get_local_rank as get_local_rank,
        get_local_size as get_local_size,
        get_nnodes as get_nnodes,
        get_node_rank as get_node_rank,
        get_nproc_per_node as get_nproc_per_node,
        get_rank as get_rank,
        get_world_size as get_world_size,
        hostname as hostname,
        initialize as initialize,
        is_main_process as is_main_process,
        model_name as model_name,
        restart_count as restart_count,
        set_local_rank as set_local_rank,
        show_config as show_config,
        sync as sync,
    )
    from .errors import (
        BackendUnavailableError as BackendUnavailableError,
        CheckpointCorruptError as CheckpointCorruptError,
        CollectiveMismatchError as CollectiveMismatchError,
        JoinedRankError as JoinedRankError,
        LaunchArgumentError as LaunchArgumentError,
        OnedistError as OnedistError,
        OnedistRuntimeError as OnedistRuntimeError,
        OnedistTimeoutError as OnedistTimeoutError,
        OnedistTypeError as OnedistTypeError,
        OnedistValueError as OnedistValueError,
        RemoteRankError as RemoteRankError,
        WorkerFailedError as WorkerFailedError,
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
    from .training.accumulation import (
        Window as Window,
        accumulate as accumulate,
        no_sync as no_sync,
    )
    from .training.auto import (
        auto_dataloader as auto_dataloader,
        auto_model as auto_model,
        auto_optim as auto_optim,
        unwrap as unwrap,
    )
    from .training.checkpoint import (
        CheckpointNotFoundError as CheckpointNotFoundError,
        load_checkpoint as load_checkpoint,
        save_checkpoint as save_checkpoint,
    )
    from .training.clipping import (
        clip_grad_norm_ as clip_grad_norm_,
    )
    from .training.evaluation import (
        all_gather_eval as all_gather_eval,
    )
    from .training.join import (
        Join as Join,
        join as join,
    )
    from .training.live_steps import Step as Step, steps as steps
    from .training.loggers import (
        CSVLogger as CSVLogger,
        TensorBoardLogger as TensorBoardLogger,
        log_metrics as log_metrics,
        loggers as loggers,
    )
    from .training.meta_init import (
        init_module as init_module,
    )
    from .training.peak_flops import (
        peak_flops as peak_flops,
    )
    from .training.precision import (
        backward as backward,
    )
    from .training.progress import (
        progress as progress,
    )
    from .training.resume import (
        Resumed as Resumed,
        checkpoint_path as checkpoint_path,
        resume as resume,
        save_training_state as save_training_state,
    )
    from .training.samplers import (
        DistributedEvalSampler as DistributedEvalSampler,
        DistributedProxySampler as DistributedProxySampler,
        DistributedSampler as DistributedSampler,
    )
    from .training.sharding import (
        full_state_dict as full_state_dict,
    )
    from .training.syncbn import (
        SyncBatchNorm as SyncBatchNorm,
        convert_sync_batchnorm as convert_sync_batchnorm,
    )
    from .training.throughput import (
        Rates as Rates,
        Throughput as Throughput,
        measure_flops as measure_flops,
    )

# public name -> submodule that defines it. `import onedist` imports none of them (nor torch):
# the launcher (`onedist run`) starts workers without paying for torch in its own process.
_LAZY = {
    "register_torch_backends": "_torch_plugin",
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
    "is_debug": "collectives.debug",
    "set_debug": "collectives.debug",
    "one_rank_first": "collectives.helpers",
    "one_rank_only": "collectives.helpers",
    "reduce_dict": "collectives.helpers",
    "create_local_process_group": "collectives.helpers",
    "differentiable_all_reduce": "collectives.differentiable",
    "differentiable_all_gather": "collectives.differentiable",
    "shared_random_seed": "collectives.helpers",
    "synchronize": "collectives.helpers",
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
    "restart_count": "context",
    "set_local_rank": "context",
    "show_config": "context",
    "sync": "context",
    "BackendUnavailableError": "errors",
    "CheckpointCorruptError": "errors",
    "CollectiveMismatchError": "errors",
    "JoinedRankError": "errors",
    "LaunchArgumentError": "errors",
    "OnedistError": "errors",
    "OnedistRuntimeError": "errors",
    "OnedistTimeoutError": "errors",
    "OnedistTypeError": "errors",
    "OnedistValueError": "errors",
    "RemoteRankError": "errors",
    "WorkerFailedError": "errors",
    "spawn": "launchers.spawn",
    "setup_logger": "log",
    "Parallel": "parallel",
    "Window": "training.accumulation",
    "accumulate": "training.accumulation",
    "no_sync": "training.accumulation",
    "steps": "training.live_steps",
    "Step": "training.live_steps",
    "Join": "training.join",
    "join": "training.join",
    "init_module": "training.meta_init",
    "backward": "training.precision",
    "auto_dataloader": "training.auto",
    "auto_model": "training.auto",
    "auto_optim": "training.auto",
    "unwrap": "training.auto",
    "CheckpointNotFoundError": "training.checkpoint",
    "load_checkpoint": "training.checkpoint",
    "save_checkpoint": "training.checkpoint",
    "checkpoint_path": "training.resume",
    "resume": "training.resume",
    "Resumed": "training.resume",
    "save_training_state": "training.resume",
    "clip_grad_norm_": "training.clipping",
    "full_state_dict": "training.sharding",
    "all_gather_eval": "training.evaluation",
    "DistributedEvalSampler": "training.samplers",
    "DistributedProxySampler": "training.samplers",
    "DistributedSampler": "training.samplers",
    "SyncBatchNorm": "training.syncbn",
    "convert_sync_batchnorm": "training.syncbn",
    "CSVLogger": "training.loggers",
    "TensorBoardLogger": "training.loggers",
    "log_metrics": "training.loggers",
    "loggers": "training.loggers",
    "peak_flops": "training.peak_flops",
    "progress": "training.progress",
    "Rates": "training.throughput",
    "Throughput": "training.throughput",
    "measure_flops": "training.throughput",
}
_COMPUTED = ("has_hvd_support", "has_native_dist_support", "has_xla_support")

__all__ = sorted(["__version__", *_LAZY, *_COMPUTED])


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
