"""Models larger than one rank: build without memory, then allocate only what each rank keeps.

``with od.init_module(empty_init=True):`` builds a module on torch's ``meta`` device: its
parameters and buffers have shapes and dtypes but no memory, and building draws no random numbers.
:func:`~onedist.auto_model` then materialises it:

* sharded (``sharding="fsdp"``, several ranks): ``fully_shard`` on the meta module, then
  ``to_empty`` allocates each rank's shards only; then each module, children before their parent
  (the order in which their constructors ran), gets full-size temporary tensors of its own,
  runs its ``reset_parameters()`` on them, and each rank copies its chunk out of them. Every rank
  draws what one process building the model would draw, from rank 0's generator state, so each
  rank's shards are the chunks of the serial init; the peak is the shards plus the largest
  module's own tensors, whole;
* unsharded (DDP, one process): ``to_empty`` on :func:`~onedist.device`, then the same
  ``reset_parameters()`` calls (DDP then starts every rank from rank 0's weights, as always).

``init_weights=False`` skips the ``reset_parameters()`` calls: the memory is allocated and left as
it is, for :func:`~onedist.load_checkpoint` to fill.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch

from ..errors import bad_type, bad_value

__all__ = ["chunk_of", "init_module", "is_meta", "materialize", "original_dtypes"]


@contextlib.contextmanager
def init_module(empty_init: bool = False) -> Iterator[None]:
    """Build modules inside this block without memory (``empty_init=True``), or on the device.

    ``empty_init=True`` builds on torch's ``meta`` device (Lightning Fabric's
    ``init_module(empty_init=True)``): no parameter is allocated and no random number is drawn.
    :func:`~onedist.auto_model` allocates it: with ``sharding="fsdp"`` only each rank's shards,
    initialised as ``reset_parameters()`` in one process would (see ``init_weights``). With
    ``empty_init=False`` modules are built on :func:`~onedist.device` directly, with no copy from
    the CPU.

    Args:
        empty_init: True: the meta device; False (default): ``od.device()``.

    Example:
        >>> import torch, onedist as od
        >>> with od.init_module(empty_init=True):
        ...     net = torch.nn.Linear(1024, 1024)   # 4 MiB of parameters, none allocated
        >>> net.weight.is_meta
        True
        >>> torch.manual_seed(0)
        <torch._C.Generator object at ...>
        >>> model = od.auto_model(net)               # allocated, then reset_parameters()
        >>> torch.manual_seed(0)
        <torch._C.Generator object at ...>
        >>> torch.equal(model.weight.cpu(), torch.nn.Linear(1024, 1024).weight)  # the serial init
        True
    """
    if not isinstance(empty_init, bool):
        raise bad_type(
            "init_module",
            "empty_init",
            empty_init,
            "a bool (True: build on the meta device, no memory; False: build on od.device())",
        )
    from ..context import device

    with torch.device("meta" if empty_init else device()):
        yield


def is_meta(model: torch.nn.Module, init_weights: Any) -> bool:
    """Whether ``model`` was built on the meta device (every tensor of it); a model with some
    tensors on meta and some allocated, or a bad ``init_weights``, raises."""
    if not isinstance(init_weights, bool):
        raise bad_type("auto_model", "init_weights", init_weights, "a bool")
    tensors = [*model.named_parameters(), *model.named_buffers()]
    meta = [name for name, t in tensors if t.is_meta]
    if meta and len(meta) < len(tensors):
        real = [name for name, t in tensors if not t.is_meta]
        raise bad_value(
            "auto_model",
            "model",
            f"{type(model).__name__}, partly on the meta device",
            "a model whose tensors are all on the meta device, or none",
            hint=f"{meta[0]!r} is on the meta device and {real[0]!r} is not: build the whole model "
            "inside `with od.init_module(empty_init=True):`, and load weights after auto_model",
        )
    if not meta and not init_weights:
        raise bad_value(
            "auto_model",
            "init_weights",
            init_weights,
            "True, or False for a model built under od.init_module(empty_init=True)",
            hint="this model's tensors are allocated and initialised already",
        )
    if meta and init_weights:
        _check_initialisable(model)
    return bool(meta)


def _own_tensors(module: torch.nn.Module) -> list[str]:
    return [n for n, t in [*module._parameters.items(), *module._buffers.items()] if t is not None]


def _reset(module: torch.nn.Module) -> Optional[Callable[[], None]]:
    """The module's ``reset_parameters`` (torch's ``_reset_parameters`` for the modules that only
    have that, as ``nn.MultiheadAttention``), or None."""
    for name in ("reset_parameters", "_reset_parameters"):
        method = getattr(module, name, None)
        if callable(method):
            return method  # type: ignore[no-any-return]
    return None


def _check_initialisable(model: torch.nn.Module) -> None:
    for name, module in model.named_modules():
        if _own_tensors(module) and _reset(module) is None:
            raise bad_value(
                "auto_model",
                "model",
                f"{type(model).__name__} on the meta device",
                "a meta model each of whose modules that holds parameters or buffers has reset_parameters()",
                hint=f"{name or 'the model'} ({type(module).__name__}) holds {_own_tensors(module)} and has "
                "no reset_parameters() to initialise them: add one (it initialises the module's own "
                "tensors), or pass init_weights=False and fill the model with od.load_checkpoint",
            )


def original_dtypes(model: torch.nn.Module) -> dict[str, torch.dtype]:
    """The dtype of each parameter and buffer as the model was built (before a precision cast):
    the one its ``reset_parameters()`` draws in."""
    return {name: t.dtype for name, t in [*model.named_parameters(), *model.named_buffers()]}


def _children_first(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    seen: set[int] = set()

    def walk(prefix: str, module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
        if id(module) in seen:
            return
        seen.add(id(module))
        for name, child in module.named_children():
            yield from walk(f"{prefix}{name}.", child)
        yield prefix, module

    yield from walk("", model)


def materialize(
    model: torch.nn.Module,
    device: torch.device,
    init_weights: bool,
    dtypes: dict[str, torch.dtype],
    group: Any = None,
) -> None:
    """Allocate ``model``'s tensors on ``device`` (each rank's shards for an FSDP2 model) and, with
    ``init_weights``, initialise them module by module as in one process. ``group``: the group of a
    sharded model, whose ranks draw from rank 0's generator state."""
    model.to_empty(device=device)
    if not init_weights:
        return
    modules = [(prefix, m) for prefix, m in _children_first(model) if _own_tensors(m)]
    with contextlib.ExitStack() as stack:
        if group is not None:
            stack.enter_context(_rank_0s_generator(device, group))
        with torch.no_grad():
            scratch = _scratch(modules, device, dtypes)
            for prefix, module in modules:
                _reset_one(module, prefix, scratch, dtypes)


def _scratch(
    modules: list[tuple[str, torch.nn.Module]], device: torch.device, dtypes: dict[str, torch.dtype]
) -> dict[torch.dtype, torch.Tensor]:
    """One flat buffer per dtype, as large as the largest module's own tensors of that dtype: every
    module's whole temporary tensors are views of it (allocated once, so the peak is one module's
    tensors, whatever the allocator keeps of freed ones)."""
    largest: dict[torch.dtype, int] = {}
    for prefix, module in modules:
        sizes: dict[torch.dtype, int] = {}
        for name in _own_tensors(module):
            t = getattr(module, name)
            dtype = dtypes.get(prefix + name, t.dtype)
            sizes[dtype] = sizes.get(dtype, 0) + t.numel()
        for dtype, n in sizes.items():
            largest[dtype] = max(largest.get(dtype, 0), n)
    return {dtype: torch.empty(n, dtype=dtype, device=device) for dtype, n in largest.items()}


def _reset_one(
    module: torch.nn.Module,
    prefix: str,
    scratch: dict[torch.dtype, torch.Tensor],
    dtypes: dict[str, torch.dtype],
) -> None:
    """``module.reset_parameters()`` on whole temporary tensors of its own (views of ``scratch``),
    copied (each rank's chunk, for a sharded parameter) into the module's tensors after."""
    from torch.distributed.tensor import DTensor

    kept: dict[tuple[str, str], torch.Tensor] = {}
    used: dict[torch.dtype, int] = {}
    for where in ("_parameters", "_buffers"):
        tensors = getattr(module, where)
        for name, t in list(tensors.items()):
            if t is None:
                continue
            kept[where, name] = t
            dtype = dtypes.get(prefix + name, t.dtype)
            start = used.get(dtype, 0)
            used[dtype] = start + t.numel()
            whole = scratch[dtype][start : used[dtype]].view(t.shape)
            tensors[name] = torch.nn.Parameter(whole, t.requires_grad) if where == "_parameters" else whole
    try:
        reset = _reset(module)
        assert reset is not None  # checked before anything was allocated
        reset()
    finally:
        for (where, name), t in kept.items():
            whole = getattr(module, where)[name].detach()
            if isinstance(t, DTensor):
                t.to_local().copy_(chunk_of(whole, t))
            else:
                t.copy_(whole)
            getattr(module, where)[name] = t


def chunk_of(whole: torch.Tensor, like: Any) -> torch.Tensor:
    """This rank's part of ``whole`` as DTensor ``like`` places it: a view (no copy, which the
    allocator may keep; of a file's mapped tensor, only this part's pages are read when it is
    copied) for FSDP2's placements, ``Shard(dim)`` and ``Replicate()``.

    Example:
        >>> import torch
        >>> from types import SimpleNamespace
        >>> from torch.distributed.tensor import Shard
        >>> mesh = SimpleNamespace(get_coordinate=lambda: [1], size=lambda axis: 3)  # rank 1 of 3
        >>> chunk_of(torch.arange(8), SimpleNamespace(placements=[Shard(0)], device_mesh=mesh))
        tensor([3, 4, 5])
    """
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if not all(type(p) in (Shard, Replicate) for p in like.placements):  # e.g. _StridedShard: a copy
        return distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None).to_local()
    coordinate = like.device_mesh.get_coordinate()
    for axis, placement in enumerate(like.placements):
        if isinstance(placement, Shard):
            chunks = torch.chunk(whole, like.device_mesh.size(axis), dim=placement.dim)
            index = coordinate[axis]
            whole = chunks[index] if index < len(chunks) else whole.narrow(placement.dim, 0, 0)
    return whole


@contextlib.contextmanager
def _rank_0s_generator(device: torch.device, group: Any) -> Iterator[None]:
    """Inside: the generator of ``device`` in rank 0's state. Rank 0 keeps drawing from its own
    (it ends advanced, as a serial build leaves it); the other ranks draw from a copy of it and get
    their own state back after."""
    import torch.distributed as dist

    cuda = device.type == "cuda"
    state = torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state()
    nccl = dist.get_backend(group) == "nccl"  # carries CUDA tensors only
    carrier = state.to(torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu", copy=True)
    dist.broadcast(carrier, group=group, group_src=0)
    if dist.get_rank(group) == 0:
        yield
        return
    _set_state(device, carrier.cpu())
    try:
        yield
    finally:
        _set_state(device, state)


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)
