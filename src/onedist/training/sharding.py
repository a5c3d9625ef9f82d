"""``auto_model(model, sharding="fsdp")``: FSDP2 (``fully_shard``) over a DeviceMesh of the world.

Each rank keeps 1/N of every sharded parameter, its gradient and (through the optimizer, which
sees the shards) its optimizer state; the full parameters of a unit are gathered for its forward
and backward pass and freed after. Which modules are units of their own (gathered one at a time)
is the policy's:

* default: every block of every ``nn.ModuleList`` in the model (the repeated layers: a
  transformer's blocks, as torchtitan shards them), then the root for the rest; a model without
  a ModuleList is one unit (the root);
* ``policy=``: a set of module classes (every instance is a unit), or a function
  ``(module) -> bool`` asked for every submodule.

``sharding="hsdp"`` shards within each node and replicates across nodes (FSDP2 over a 2-D
DeviceMesh of ``(nnodes, nproc_per_node)`` built from the launcher's layout: the gradients are
reduce-scattered within a node, then all-reduced between the nodes' copies of each shard); on one
node it is ``"fsdp"`` (one replica).

Works where torch.distributed runs the training (gloo, nccl, shm, mpi); with one process there is
nothing to shard and the model is returned as DDP would be (itself). ``precision="bf16-mixed"``
becomes FSDP2's mixed-precision policy (parameters gathered in bfloat16, gradients reduced in
float32, outputs float32); ``"bf16-true"`` shards parameters that are bfloat16 already (their
gradients are reduced in bfloat16). ``cpu_offload=True`` is FSDP2's ``CPUOffloadPolicy`` on CUDA
(the shards, their gradients and the optimizer step on the CPU) and does nothing on the CPU, where
everything is there already (a warning says so, once). On the CPU, glibc's heap is set to keep
each step's gathered buffers warm (:mod:`.cpu_heap`; ``ONEDIST_CPU_HEAP=0``). A model built under
``od.init_module(empty_init=True)`` is sharded on the meta device and then allocated shard by
shard (:mod:`onedist.training.meta_init`).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Optional

import torch

from ..errors import bad_type, bad_value
from .cpu_heap import keep_freed_buffers, unit_bytes
from .versions import require_torch

__all__ = [
    "SHARDINGS",
    "check_sharding",
    "hsdp_shape",
    "full_state_dict",
    "gather_state_dict",
    "is_sharded",
    "is_sharded_optimizer",
    "shard",
    "units_of",
]

#: what ``auto_model(sharding=...)`` accepts
SHARDINGS = (None, "fsdp", "hsdp")
#: auto_model's keyword arguments with ``sharding="fsdp"`` (or ``"hsdp"``)
_FSDP_OPTIONS = ("policy", "reshard_after_forward", "mesh", "cpu_offload")
_warned_offload = False  # cpu_offload=True on the CPU: said once per process


def check_sharding(
    sharding: Any, backend: Any, precision: str, sync_bn: bool, options: dict[str, Any]
) -> Optional[str]:
    """``sharding`` checked against the backend, the precision and the other options."""
    if sharding is not None and not isinstance(sharding, str):
        raise bad_type("auto_model", "sharding", sharding, "None, 'fsdp' or 'hsdp'")
    if sharding in (None, "none"):
        return None
    if sharding not in SHARDINGS:
        raise bad_value("auto_model", "sharding", sharding, SHARDINGS)
    require_torch("auto_model", "sharding", sharding, (2, 6))  # fully_shard, get_total_norm
    if backend.model_parallelism != "ddp":
        raise bad_value(
            "auto_model",
            "sharding",
            sharding,
            f"None with backend {backend.backend!r} (FSDP runs on torch.distributed: gloo, nccl, shm, mpi)",
        )
    if precision == "16-mixed":
        raise bad_value(
            "auto_model",
            "precision",
            precision,
            f"'32', 'bf16-mixed' or 'bf16-true' with sharding={sharding!r}",
            hint=None,
        )
    if sync_bn:
        raise bad_value(
            "auto_model",
            "sync_bn",
            sync_bn,
            f"False with sharding={sharding!r}",
            hint="od.convert_sync_batchnorm(model) before auto_model gives onedist's SyncBatchNorm",
        )
    for name, value in options.items():
        if name not in _FSDP_OPTIONS:
            raise bad_value(
                "auto_model", name, value, f"with sharding={sharding!r}: " + ", ".join(_FSDP_OPTIONS)
            )
    if not isinstance(options.get("cpu_offload", False), bool):
        raise bad_type("auto_model", "cpu_offload", options["cpu_offload"], "a bool")
    return str(sharding)


def shard(
    model: torch.nn.Module,
    precision: str,
    options: dict[str, Any],
    device: torch.device,
    materialize: Optional[Callable[[torch.nn.Module, torch.device, Any], None]] = None,
    sharding: str = "fsdp",
) -> torch.nn.Module:
    """FSDP2 units of ``model`` (the policy's, then the root) over the world's mesh (``"hsdp"``:
    the 2-D mesh of nodes and their ranks). A meta model is sharded as it is, then
    ``materialize(model, device, group)`` allocates (and initialises) each rank's shards; any other
    model starts from rank 0's weights."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = options.get("mesh") or (_hsdp_mesh(device) if sharding == "hsdp" else _world_mesh(device))
    whole = mesh.get_group() if mesh.ndim == 1 else dist.group.WORLD  # every rank of the mesh
    kwargs: dict[str, Any] = {"mesh": mesh}
    if "reshard_after_forward" in options:
        kwargs["reshard_after_forward"] = options["reshard_after_forward"]
    kwargs.update(_offload(options.get("cpu_offload", False), device))
    if materialize is None:
        _from_rank_0(model)
    units = units_of(model, options.get("policy"))
    largest = unit_bytes(model, units)
    root_kwargs = dict(kwargs)
    if precision == "bf16-mixed":
        # bf16 between units (a root's own layer after a unit takes its bf16 output, as under
        # autocast); float32 only out of the root, so the loss is computed in float32
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        root_kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
        )
        units = _float32_batch_norms(model, units, kwargs)
    for unit in reversed(units):  # inner units first: an outer unit then skips their parameters
        fully_shard(unit, **kwargs)
    fully_shard(model, **root_kwargs)
    if materialize is not None and "offload_policy" in kwargs:  # the shards live on the CPU
        materialize(model, torch.device("cpu"), whole)
        for module in model.modules():  # the buffers (not sharded, not offloaded) on the GPU
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(device)
    elif materialize is not None:
        materialize(model, device, whole)
    if any(True for _ in model.buffers()):
        model.register_forward_pre_hook(lambda module, args: _buffers_from_rank_0(module, whole))
    if device.type == "cpu":  # each step's gathers reuse warm memory (:mod:`.cpu_heap`)
        keep_freed_buffers(2 * largest)
    return model


def _offload(cpu_offload: bool, device: torch.device) -> dict[str, Any]:
    """fully_shard's ``offload_policy`` for ``cpu_offload`` on ``device``."""
    global _warned_offload
    if not cpu_offload:
        return {}
    if device.type == "cpu":
        if not _warned_offload:
            _warned_offload = True
            warnings.warn(
                "onedist.auto_model: cpu_offload=True does nothing on the CPU: the shards, their gradients "
                "and the optimizer state are in CPU memory already (it moves them off a GPU)",
                stacklevel=4,
            )
        return {}
    from torch.distributed.fsdp import CPUOffloadPolicy

    return {"offload_policy": CPUOffloadPolicy()}


def _buffers_from_rank_0(model: torch.nn.Module, group: Any) -> None:
    """Before a training forward, rank 0's buffers on every rank, as DDP does by default
    (broadcast_buffers=True). FSDP2 leaves buffers alone: BatchNorm's running statistics would drift
    apart per rank, evaluation would differ per rank, and a sharded checkpoint, which keeps one
    copy of a replicated tensor (rank 0's), would not give a resumed rank its own back. Inside
    od.join once a rank has left its loop: from the lowest rank still in its loop, as DDP's."""
    import torch.distributed as dist

    from ..collectives.joined import JoinedRanks
    from ..state import world

    if not (model.training and torch.is_grad_enabled()):
        return
    ranks = world.join if isinstance(world.join, JoinedRanks) else None
    # a finished rank's shadow step (od.join) takes the same source
    src = dist.get_group_rank(group, ranks.active[0]) if ranks is not None and ranks.left else 0
    kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for buffer in model.buffers():
        kinds.setdefault((buffer.dtype, buffer.device), []).append(buffer)
    with torch.no_grad():
        for buffers in kinds.values():  # one broadcast per dtype, as DDP coalesces them
            flat = torch.cat([b.reshape(-1) for b in buffers])
            dist.broadcast(flat, group=group, group_src=src)
            for b, part in zip(buffers, torch.split(flat, [b.numel() for b in buffers])):
                b.copy_(part.view_as(b))


def _from_rank_0(model: torch.nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank, as DDP starts (fully_shard keeps each rank's
    own values: ranks that built the model from different seeds would train a mix of them)."""
    import torch.distributed as dist

    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0)


def _world_mesh(device: torch.device) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    world = dist.group.WORLD
    assert world is not None  # world size > 1: initialize made the default group
    return DeviceMesh.from_group(world, device.type)


def hsdp_shape(layouts: list[tuple[int, int, int, int]]) -> tuple[int, int]:
    """``(nnodes, nproc_per_node)``: the shape of ``sharding="hsdp"``'s mesh, from every rank's
    ``(rank, node_rank, local_rank, nproc_per_node)``; raises unless the ranks are laid out node by
    node, the same number on each (rank = node_rank * nproc_per_node + local_rank).

    Example:
        >>> hsdp_shape([(0, 0, 0, 2), (1, 0, 1, 2), (2, 1, 0, 2), (3, 1, 1, 2)])
        (2, 2)
    """
    per_node = {layout[3] for layout in layouts}
    nproc = per_node.pop() if len(per_node) == 1 else 0
    nnodes = len(layouts) // nproc if nproc else 0
    if not nproc or any(rank != node * nproc + local for rank, node, local, _ in layouts):
        nodes: dict[int, list[int]] = {}
        for rank, node, _, _ in layouts:
            nodes.setdefault(node, []).append(rank)
        raise bad_value(
            "auto_model",
            "sharding",
            "hsdp",
            "'fsdp' (or 'hsdp' with the same number of ranks on every node, numbered node by "
            "node: rank = node_rank * nproc_per_node + local_rank); here the nodes hold ranks "
            f"{list(nodes.values())}",
            hint="start as many processes on every node (onedist run -n N, torchrun --nproc-per-node N)",
        )
    return nnodes, nproc


def _hsdp_mesh(device: torch.device) -> Any:
    """The 2-D mesh of ``sharding="hsdp"``: a row per node (replicated between the rows, sharded
    along each); on one node the world's 1-D mesh (one replica: ``"fsdp"``)."""
    from torch.distributed.device_mesh import init_device_mesh

    from ..collectives import all_gather_object
    from ..context import current

    b = current()
    layout = b.layout()
    nnodes, nproc = hsdp_shape(
        all_gather_object((b.rank, layout.node_rank, layout.local_rank, layout.nproc_per_node))
    )
    if nnodes == 1:
        return _world_mesh(device)
    return init_device_mesh(device.type, (nnodes, nproc), mesh_dim_names=("replicate", "shard"))


def _float32_batch_norms(
    model: torch.nn.Module, units: list[torch.nn.Module], kwargs: dict[str, Any]
) -> list[torch.nn.Module]:
    """Under bf16-mixed, each BatchNorm a unit that computes in float32 (as autocast runs it, and
    FSDP1 kept it): its running statistics are float32 buffers, which FSDP2's parameter cast
    leaves alone, and batch_norm refuses bfloat16 inputs and weights against them. It takes its
    input in float32 and hands bfloat16 on. The other units, without the BatchNorms."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.modules.batchnorm import _BatchNorm

    norms = [m for m in model.modules() if m is not model and isinstance(m, _BatchNorm)]
    policy = MixedPrecisionPolicy(
        param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=torch.bfloat16
    )
    for norm in norms:  # leaves: sharded before any unit that holds them
        fully_shard(norm, **{**kwargs, "mp_policy": policy})
    return [unit for unit in units if not isinstance(unit, _BatchNorm)]


def units_of(model: torch.nn.Module, policy: Any = None) -> list[torch.nn.Module]:
    """The submodules that are units of their own, outer before inner."""
    if policy is None:  # the repeated blocks
        return [block for m in model.modules() if isinstance(m, torch.nn.ModuleList) for block in m]
    if (
        isinstance(policy, (set, frozenset, list, tuple))
        and policy
        and all(isinstance(c, type) and issubclass(c, torch.nn.Module) for c in policy)
    ):
        classes = tuple(policy)
        return [m for m in model.modules() if m is not model and isinstance(m, classes)]
    if callable(policy) and not isinstance(policy, type):
        return [m for m in model.modules() if m is not model and policy(m)]
    raise bad_type(
        "auto_model",
        "policy",
        policy,
        "None, a set of torch.nn.Module classes, or a function (module) -> bool",
    )


def is_sharded(module: Any) -> bool:
    """Whether ``module`` (or the model inside its wrappers) is an FSDP2 module."""
    from .wrappers import unwrap

    return isinstance(module, torch.nn.Module) and hasattr(unwrap(module), "set_requires_gradient_sync")


def is_sharded_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` steps a sharded model's parameters (DTensors).

    Example:
        >>> import torch
        >>> is_sharded_optimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
        False
    """
    from torch.distributed.tensor import DTensor

    return isinstance(optimizer, torch.optim.Optimizer) and any(
        isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"]
    )


def full_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The whole model's ordinary state dict, on CPU, on rank 0 (an empty dict on the other ranks):
    for exporting a model trained with ``sharding="fsdp"`` (gathered one tensor at a time:
    :func:`gather_state_dict`), or any other model (:func:`~onedist.unwrap`'s state). Every rank
    must call it.

    Example:
        >>> import torch, onedist as od
        >>> model = od.auto_model(torch.nn.Linear(4, 2), sharding="fsdp")  # one process: not sharded
        >>> sorted(od.full_state_dict(model))
        ['bias', 'weight']
    """
    from ..context import current
    from .wrappers import unwrap

    if not isinstance(model, torch.nn.Module):
        raise bad_type("full_state_dict", "model", model, "a torch.nn.Module (the model auto_model returned)")
    if is_sharded(model):
        return gather_state_dict(model, 0)
    if current().rank != 0:
        return {}
    return {k: v.detach().cpu() for k, v in unwrap(model).state_dict().items()}


def gather_state_dict(model: torch.nn.Module, dst: int) -> dict[str, Any]:
    """The sharded ``model``'s whole state dict on global rank ``dst``, on the CPU, gathered one
    tensor at a time (an empty dict on the other ranks): each sharded tensor is all-gathered into
    one buffer per dtype, allocated once for the largest tensor, and ``dst`` copies it out (on the
    CPU) before the next. ``dst`` holds the model once plus that buffer, the others the buffer.
    Every rank must call it, in the same order.

    Example:
        >>> import torch
        >>> gather_state_dict(torch.nn.Linear(2, 1), 0)   # one process: the state dict, on the CPU
        OrderedDict(...)
    """
    from torch.distributed.tensor import DTensor

    from ..context import current
    from .wrappers import unwrap

    keep = current().rank == dst
    out: dict[str, Any] = OrderedDict()
    state = unwrap(model).state_dict()
    buffers = _gather_buffers([v for v in state.values() if isinstance(v, DTensor)])
    for key, value in state.items():
        if isinstance(value, DTensor):
            whole = _gathered(value, buffers)
            if keep:
                out[key] = whole.to("cpu", copy=True)  # its own memory, its exact size
            del whole
        elif keep:
            out[key] = value.detach().cpu() if isinstance(value, torch.Tensor) else value
    return out


def _row_sharded(t: Any) -> bool:
    """Whether DTensor ``t`` is FSDP2's default: dim 0 sharded over a 1-D mesh."""
    from torch.distributed.tensor import Shard

    return (
        t.device_mesh.ndim == 1
        and type(t.placements[0]) is Shard
        and t.placements[0].dim == 0
        and t.dim() > 0
    )


def _gather_buffers(tensors: list[Any]) -> dict[tuple[torch.dtype, torch.device], torch.Tensor]:
    """One flat buffer per (dtype, device): the largest row-sharded tensor's padded shard (what
    this rank sends) and the N padded shards (what it receives)."""
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for t in tensors:
        if _row_sharded(t):
            n = t.device_mesh.size()
            per = -(-t.shape[0] // n) * (t.numel() // t.shape[0] if t.shape[0] else 0)
            kind = (t.dtype, t.to_local().device)
            sizes[kind] = max(sizes.get(kind, 0), per * (n + 1))
    return {kind: torch.empty(size, dtype=kind[0], device=kind[1]) for kind, size in sizes.items()}


def _gathered(t: Any, buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor]) -> torch.Tensor:
    """The whole of DTensor ``t`` on every rank: a view of ``buffers`` (FSDP2's row shards, as
    torch.chunk cuts them: each rank's padded to the first's rows), or DTensor's own gather."""
    import torch.distributed as dist

    if not _row_sharded(t):
        whole: torch.Tensor = t.full_tensor().detach()
        return whole.wait() if hasattr(whole, "wait") else whole  # funcol's async result
    local = t.to_local().detach()
    n, rows = t.device_mesh.size(), -(-t.shape[0] // t.device_mesh.size())
    per = rows * (t.numel() // t.shape[0])
    flat = buffers[t.dtype, local.device]
    send, received = flat[:per], flat[per : per * (n + 1)]
    send.view(rows, *t.shape[1:])[: local.shape[0]].copy_(local)
    # all_gather_single: all_gather_into_tensor's name from torch 2.10 (the old one warns there)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(received, send, group=t.device_mesh.get_group())
    return received.view(n * rows, *t.shape[1:])[: t.shape[0]]
