"""Adapt a model, an optimizer and a dataset to whatever distributed configuration is active.

Three calls, one training loop for serial, gloo, nccl, shm, mpi, Horovod and XLA runs::

    model = od.auto_model(model)            # device, then DDP / DataParallel / backend's own wrapping
    optimizer = od.auto_optim(optimizer)    # backend's distributed optimizer where it needs one
    loader = od.auto_dataloader(dataset, batch_size=256, shuffle=True)  # global batch size

This module checks the arguments, wraps models in DDP for the torch.distributed backends
(:mod:`onedist.training.ddp`) and splits the data; what a backend does its own way lives in the
backend (``Backend.prepare_model`` where ``model_parallelism`` is "own", ``wrap_optimizer``,
``wrap_dataloader``).
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any, Optional

import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler as _TorchDistributedSampler,
    IterableDataset,
    Sampler,
)

from ..backends.interface import Backend
from ..errors import bad_type, bad_value
from .activation_checkpointing import check_activation_checkpointing, checkpoint_blocks
from .ddp import averager_for, check_options, wrap_ddp
from .meta_init import is_meta, materialize, original_dtypes
from .precision import apply_precision, cast_parameters, check_precision, scaled_optimizer
from .samplers import DistributedEvalSampler, DistributedProxySampler, DistributedSampler
from .sharding import check_sharding, shard, units_of
from .wrappers import WRAPPERS, unwrap

__all__ = ["auto_dataloader", "auto_model", "auto_optim", "unwrap"]

logger = logging.getLogger("onedist")


def auto_model(
    model: torch.nn.Module,
    sync_bn: bool = False,
    *,
    precision: str = "32",
    sharding: Optional[str] = None,
    activation_checkpointing: Any = None,
    init_weights: bool = True,
    **kwargs: Any,
) -> torch.nn.Module:
    """Put ``model`` on :func:`onedist.device` and wrap it for the active backend.

    * world size > 1 with torch.distributed: ``DistributedDataParallel`` (``device_ids`` set from
      the local rank on CUDA, none on CPU), after ``SyncBatchNorm`` conversion if ``sync_bn``;
    * one process that drives several GPUs: ``DataParallel``;
    * Horovod and XLA: no wrapper; rank 0's parameters and buffers are broadcast to every rank
      (gradients are averaged by :func:`auto_optim`'s optimizer);
    * otherwise the model itself, on the device.

    Args:
        model: the model; one built under :func:`onedist.init_module` (``empty_init=True``) is
            allocated here (with ``sharding="fsdp"``, only each rank's shards) and initialised
            by its modules' ``reset_parameters()`` (torch.distributed backends and one process).
        sync_bn: convert BatchNorm layers to torch's ``SyncBatchNorm`` (CUDA only: on CPU a
            ``ValueError``, as in ignite; ``od.convert_sync_batchnorm(model)`` before gives
            onedist's :class:`~onedist.SyncBatchNorm`, which works on any device).
        precision: ``"32"`` (default), ``"bf16-mixed"`` (forward under bfloat16 autocast: CPU,
            CUDA, XLA), ``"16-mixed"`` (float16 autocast, CUDA; :func:`onedist.backward` scales
            the loss, :func:`auto_optim`'s optimizer unscales and skips inf/NaN steps; state stays
            float32) or ``"bf16-true"`` (parameters, gradients and optimizer state bfloat16;
            inputs cast to bfloat16). Outputs come back float32; what the device cannot do raises.
        sharding: None (default: DDP), ``"fsdp"``: FSDP2 (``fully_shard``) over the world, each
            rank holding 1/N of the parameters, gradients and optimizer state; units: the blocks
            of every ``nn.ModuleList``, then the root. Its keyword arguments: ``policy`` (a set of
            module classes, or a function ``(module) -> bool``, choosing the units),
            ``reshard_after_forward``, ``mesh`` (a DeviceMesh), ``cpu_offload`` (FSDP2's
            ``CPUOffloadPolicy`` on CUDA; nothing on the CPU). ``"hsdp"``: the same, sharded in
            each node, replicated across nodes (one node: ``"fsdp"``). torch.distributed backends only
            (gloo, nccl, shm, mpi); with one process the model is returned as is.
        activation_checkpointing: None (default); True (the blocks ``sharding`` makes units), a
            module class (or a set of them) or a function ``(module) -> bool``: those blocks
            recompute their activations in the backward pass instead of keeping them.
        init_weights: False: a meta model's memory is left for :func:`onedist.load_checkpoint`.
        **kwargs: ``DistributedDataParallel`` keyword arguments, passed through (checked, unused
            with one process), and ``comm_hook`` (``"fp16"`` / ``"bf16"``, ``"powersgd"`` /
            ``"batched_powersgd"``, ``"post_localsgd"``, or a hook function),
            ``comm_hook_kwargs`` (the hook state's arguments), ``comm_hook_state`` (for a hook
            function), ``comm_wrapper`` (``"fp16"`` / ``"bf16"`` around the hook) and
            ``model_averaging_period`` (with ``"post_localsgd"``).

    Returns:
        The wrapped model (:func:`unwrap` gives the inner module back).

    Example:
        >>> import torch, onedist as od
        >>> model = od.auto_model(torch.nn.Linear(4, 2))          # serial: the model, on the device
        >>> isinstance(model, torch.nn.Linear)
        True
        >>> # 4 gloo processes: od.auto_model(net, comm_hook="fp16") is a DDP sending fp16 gradients
    """
    from ..context import current

    _check_model(model, sync_bn)
    b = current()
    precision = check_precision(precision, b.device(), b.backend)
    checkpointing = check_activation_checkpointing(activation_checkpointing)
    meta = is_meta(model, init_weights)
    _check_backend_carries(b, model, meta, activation_checkpointing)
    sharded = check_sharding(sharding, b, precision, sync_bn, kwargs) is not None
    hooks, ddp_kwargs = check_options(kwargs) if not sharded else ({}, {})
    dtypes = _prepare(model, b.device(), precision, checkpointing, meta, kwargs.get("policy"))
    if sharded and b.world_size > 1:
        init = (lambda m, dev, group: materialize(m, dev, init_weights, dtypes, group)) if meta else None
        model = shard(model, precision, kwargs, b.device(), init, sharding=str(sharding))
        return apply_precision(model, precision, b.device()) if precision == "bf16-true" else model
    if meta:
        materialize(model, b.device(), init_weights, dtypes)
    if not sharded:
        model = _wrap(model, b, sync_bn, hooks, ddp_kwargs)
    return apply_precision(model, precision, b.device())


def _prepare(
    model: torch.nn.Module, device: torch.device, precision: str, checkpointing: Any, meta: bool, policy: Any
) -> dict[str, torch.dtype]:
    """Before wrapping or sharding: the blocks under activation checkpointing, the parameters in
    ``precision``'s dtype, the model on ``device`` (a meta one stays there: the caller allocates
    it); the dtypes a meta model was built with."""
    dtypes = original_dtypes(model) if meta else {}
    if checkpointing is not None:
        checkpoint_blocks(model, checkpointing, lambda m: units_of(m, policy))
    cast_parameters(model, precision)
    if not meta:
        model.to(device)
    return dtypes


def _check_backend_carries(b: Backend, model: torch.nn.Module, meta: bool, checkpointing: Any) -> None:
    """A meta model and activation checkpointing are built for torch.distributed and one process."""
    if b.model_parallelism == "ddp":
        return
    where = f"with backend {b.backend!r} (built for torch.distributed: gloo, nccl, shm, mpi; and one process)"
    if meta:
        raise bad_value(
            "auto_model",
            "model",
            f"{type(model).__name__} on the meta device",
            f"an allocated model {where}",
            hint="build the model without od.init_module(empty_init=True) on this backend",
        )
    if checkpointing is not None:
        raise bad_value("auto_model", "activation_checkpointing", checkpointing, f"None {where}")


def _check_model(model: Any, sync_bn: Any) -> None:
    if not isinstance(model, torch.nn.Module):
        raise bad_type("auto_model", "model", model, "a torch.nn.Module")
    if isinstance(model, WRAPPERS):
        raise bad_type(
            "auto_model",
            "model",
            model,
            "an unwrapped torch.nn.Module",
            hint="pass the model itself; auto_model wraps it (onedist.unwrap(model) gives it back)",
        )
    if not isinstance(sync_bn, bool):
        raise bad_type("auto_model", "sync_bn", sync_bn, "a bool")


def _wrap(
    model: torch.nn.Module, b: Backend, sync_bn: bool, hooks: dict[str, Any], ddp_kwargs: dict[str, Any]
) -> torch.nn.Module:
    """auto_model's wrapping of ``model`` (on its device) for backend ``b``."""
    if sync_bn and b.sync_bn_by_onedist:
        from .syncbn import convert_sync_batchnorm

        model = convert_sync_batchnorm(model)
    if b.model_parallelism == "own":
        prepared: torch.nn.Module = b.prepare_model(model, sync_bn, hooks, ddp_kwargs)
        return prepared
    if b.world_size == 1:  # the options were checked, and do nothing: the script runs unchanged
        if sync_bn:
            logger.info(
                "onedist.auto_model: sync_bn ignored with world size 1 (BatchNorm already sees the batch)"
            )
        if b.device().type == "cuda" and torch.cuda.device_count() > 1:
            return torch.nn.DataParallel(model)
        return model
    return wrap_ddp(model, b.device(), sync_bn, hooks, ddp_kwargs, b.local_group)


def auto_optim(optimizer: torch.optim.Optimizer, **kwargs: Any) -> torch.optim.Optimizer:
    """Adapt ``optimizer`` to the active backend.

    torch.distributed: unchanged, except after ``auto_model(..., comm_hook="post_localsgd")``,
    where it is wrapped in ``PostLocalSGDOptimizer`` so the model is averaged every
    ``model_averaging_period`` steps. Horovod: ``hvd.DistributedOptimizer`` (its keyword
    arguments pass through: ``compression``, ``backward_passes_per_step``, ``op``, ...), with rank
    0's state broadcast. XLA: a subclass of the optimizer's own class whose ``step()`` averages the
    gradients over devices first (``xm.optimizer_step``'s semantics). ``state_dict()`` /
    ``load_state_dict()`` round-trip.

    Example:
        >>> import torch, onedist as od
        >>> model = od.auto_model(torch.nn.Linear(4, 2))
        >>> opt = od.auto_optim(torch.optim.SGD(model.parameters(), lr=0.1))
        >>> isinstance(opt, torch.optim.Optimizer)
        True
    """
    from ..context import current

    if not isinstance(optimizer, torch.optim.Optimizer):
        raise bad_type("auto_optim", "optimizer", optimizer, "a torch.optim.Optimizer")
    b = current()
    optimizer = b.wrap_optimizer(optimizer, **kwargs)
    averager = averager_for(optimizer) if b.model_parallelism == "ddp" else None
    if averager is not None:
        from torch.distributed.optim import PostLocalSGDOptimizer

        optimizer = PostLocalSGDOptimizer(optimizer, averager)
    return scaled_optimizer(optimizer)


def auto_dataloader(dataset: Any, *, evaluation: bool = False, **kwargs: Any) -> Any:
    """A ``DataLoader`` that gives this rank its share of ``dataset``; ``batch_size`` is global.

    With world size N > 1:

    * ``batch_size`` is split: each rank loads ``batch_size // N`` (a warning says the effective
      global batch when N does not divide it); one smaller than N is not split, as in ignite
      (a warning says so);
    * ``num_workers`` is per node, split over the node's processes (rounded up) when there are
      at least as many workers as processes, else kept, as in ignite;
    * no ``sampler``: a :class:`onedist.DistributedSampler` with your ``shuffle`` (default True,
      as ignite's), which reshuffles every epoch by itself (``set_epoch`` optional);
    * your own ``sampler``: wrapped in :class:`onedist.DistributedProxySampler` (one shared draw,
      each rank its share); an already distributed sampler is kept as is (a warning says when its
      rank or num_replicas is not this process's);
    * ``evaluation=True``: :class:`onedist.DistributedEvalSampler`, no padding, every sample once;
      gather the results with :func:`onedist.all_gather_eval`;
    * an ``IterableDataset`` gets no sampler (a warning says how to shard it); a ``batch_sampler``
      is kept as given (a warning says it is not split).

    On CUDA ``pin_memory`` defaults to True. With one process the loader is a plain ``DataLoader``
    with your arguments (and ``evaluation`` changes nothing). A backend may wrap the loader: XLA
    wraps it in torch_xla's ``MpDeviceLoader`` (``len()``, ``.sampler`` and ``.dataset`` pass through).

    Example:
        >>> import torch, onedist as od
        >>> data = torch.utils.data.TensorDataset(torch.arange(10.0))
        >>> loader = od.auto_dataloader(data, batch_size=4, shuffle=True)
        >>> sum(len(b[0]) for b in loader)
        10
    """
    from ..context import current, device, get_nproc_per_node, get_rank, get_world_size

    if not isinstance(dataset, (Dataset, IterableDataset)) and not hasattr(dataset, "__getitem__"):
        raise bad_type(
            "auto_dataloader", "dataset", dataset, "a torch Dataset (or anything with __getitem__)"
        )
    if not isinstance(evaluation, bool):
        raise bad_type("auto_dataloader", "evaluation", evaluation, "a bool")
    world = get_world_size()
    rank = get_rank()
    iterable = isinstance(dataset, IterableDataset)
    if world > 1:
        _split_batch(kwargs, world)
        if "num_workers" in kwargs:
            nw, nproc = kwargs["num_workers"], get_nproc_per_node()
            if not isinstance(nw, int) or isinstance(nw, bool) or nw < 0:
                raise bad_value("auto_dataloader", "num_workers", nw, "an int >= 0")
            kwargs["num_workers"] = math.ceil(nw / nproc) if nw >= nproc else nw
        if "batch_sampler" in kwargs and kwargs["batch_sampler"] is not None:
            warnings.warn(
                "onedist.auto_dataloader: Found batch_sampler in provided kwargs: it is used as given, "
                f"not split over the {world} ranks; every rank loads what it yields. Make sure that it is "
                "compatible with distributed configuration, or pass a sampler instead to have it split.",
                stacklevel=2,
            )
        elif iterable:
            warnings.warn(
                f"onedist.auto_dataloader: {type(dataset).__name__} is an IterableDataset, so no sampler can "
                "split it; every rank reads all of it unless it shards itself: read onedist.get_rank() and "
                "get_world_size() in its __init__ (loader workers may be fresh processes without the "
                "group), and in __iter__ keep items i with i % (world_size * workers) == rank * workers + "
                "worker, where (workers, worker) is (info.num_workers, info.id) for info = "
                "torch.utils.data.get_worker_info(), or (1, 0) when that is None (num_workers=0)",
                stacklevel=2,
            )
        else:
            kwargs["sampler"] = _distributed_sampler(dataset, kwargs, world, rank, evaluation)
    if device().type == "cuda" and "pin_memory" not in kwargs:
        kwargs["pin_memory"] = True
    try:
        loader = DataLoader(dataset, **kwargs)
    except TypeError as e:
        raise bad_value(
            "auto_dataloader", "kwargs", sorted(kwargs), f"DataLoader's keyword arguments ({e})"
        ) from e
    return current().wrap_dataloader(loader)


def _split_batch(kwargs: dict[str, Any], world: int) -> None:
    if "batch_size" not in kwargs or kwargs["batch_size"] is None:
        return
    bs = kwargs["batch_size"]
    if not isinstance(bs, int) or isinstance(bs, bool) or bs < 1:
        raise bad_value("auto_dataloader", "batch_size", bs, "an int >= 1 (the global batch size)")
    if bs < world:
        warnings.warn(
            f"onedist.auto_dataloader: batch_size={bs} is smaller than the world size {world}, so it is "
            f"not split (as in ignite): each rank loads {bs}, a global batch of {bs * world}. batch_size "
            f"is global: pass at least {world} to have it split.",
            stacklevel=3,
        )
        return
    if bs % world:
        warnings.warn(
            f"onedist.auto_dataloader: batch_size={bs} is global and not divisible by the world size "
            f"{world}: each rank loads {bs // world}, so the global batch is {bs // world * world}. "
            f"Use a multiple of {world} (e.g. {bs // world * world} or {(bs // world + 1) * world}) "
            "to keep it exact.",
            stacklevel=3,
        )
    kwargs["batch_size"] = bs // world


def _distributed_sampler(
    dataset: Any, kwargs: dict[str, Any], world: int, rank: int, evaluation: bool
) -> Sampler[Any]:
    sampler: Optional[Sampler[Any]] = kwargs.get("sampler")
    shuffle = kwargs.pop("shuffle", None)
    if evaluation:
        if sampler is not None or shuffle:
            given = "sampler" if sampler is not None else "shuffle"
            raise bad_value(
                "auto_dataloader",
                given,
                sampler if sampler is not None else shuffle,
                "not given with evaluation=True (every sample once, in dataset order)",
            )
        return DistributedEvalSampler(dataset, num_replicas=world, rank=rank)
    if sampler is not None:
        if shuffle:
            raise bad_value(
                "auto_dataloader",
                "shuffle",
                shuffle,
                "False or not given when a sampler is given (DataLoader's rule)",
            )
        if isinstance(sampler, (_TorchDistributedSampler, DistributedEvalSampler, DistributedProxySampler)):
            _warn_if_not_ours(sampler, world, rank)
            return sampler
        return DistributedProxySampler(sampler, num_replicas=world, rank=rank)
    shuffle = True if shuffle is None else shuffle  # ignite's default when it adds the sampler
    if not isinstance(shuffle, bool):
        raise bad_type("auto_dataloader", "shuffle", shuffle, "a bool")
    return DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=shuffle)


def _warn_if_not_ours(sampler: Any, world: int, rank: int) -> None:
    """A distributed sampler the user made for another rank or world size gives this rank the
    wrong share (duplicated or missing samples): say so, in ignite's words."""
    if sampler.rank != rank:
        warnings.warn(
            f"onedist.auto_dataloader: Found distributed sampler with rank={sampler.rank}, but process rank "
            f"is {rank}: this rank loads rank {sampler.rank}'s share. Pass rank=onedist.get_rank(), or "
            "no sampler (auto_dataloader then adds one)",
            stacklevel=4,
        )
    if sampler.num_replicas != world:
        warnings.warn(
            f"onedist.auto_dataloader: Found distributed sampler with num_replicas={sampler.num_replicas}, "
            f"but world size is {world}: samples are missed or repeated. Pass "
            "num_replicas=onedist.get_world_size(), or no sampler",
            stacklevel=4,
        )
