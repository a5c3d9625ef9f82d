"""Gathering to every rank or to one: :func:`all_gather` and its variants, :func:`gather`."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any, Optional

import torch

from ..backends import Backend
from ..context import current
from ..errors import CollectiveMismatchError, bad_type
from . import wire as W
from .base import CPU, U8, GroupLike, check_peer, resolve_group
from .exchange import (
    Channels,
    decode,
    gather_values,
    localize,
    my_blocks,
    obj_len,
    pack_or_error,
    raise_slot_errors,
    slices,
)
from .guard import guarded


@guarded("all_gather", 1)
def all_gather(tensor: Any, group: GroupLike = None, *, async_op: bool = False, nested: bool = False) -> Any:
    """Gather a value from every rank.

    Args:
        tensor: a tensor, number, string or any picklable object.
        group: None (every rank), a list of global ranks, or a group handle.
        async_op: return an :class:`AsyncResult`; the size negotiation happens before it returns.
        nested: gather a dict/list/tuple leaf by leaf into one value of the same structure
            (onedist's; each leaf as below, numbers as a tensor of one entry per rank), instead of
            one entry per rank.

    Returns:
        By the type of ``tensor``, as in ignite:

        - tensor: the ranks' tensors concatenated on dim 0 (0-dim tensors are stacked). The first
            dimension may differ per rank (ignite and torch need it equal); the other dimensions
            and the dtype must match, else every rank raises
            :class:`~onedist.CollectiveMismatchError` listing each rank's shape.
        - number, string or any other object: a list with one entry per rank, in rank order.

        Ranks outside ``group`` get their input back.

    Example:
        >>> import onedist as od
        >>> od.all_gather(torch.arange(2))
        tensor([0, 1])
        >>> od.all_gather("hello")
        ['hello']
        >>> od.all_gather({"n": 3})
        [{'n': 3}]
        >>> od.all_gather({"n": 3}, nested=True)
        {'n': tensor([3])}
    """
    merge = nested or isinstance(tensor, torch.Tensor)
    return gather_values("all_gather", tensor, group, async_op, merge=merge)


@guarded("all_gather_object", 1)
def all_gather_object(obj: Any, group: GroupLike = None, *, async_op: bool = False) -> list[Any]:
    """Gather any picklable value from every rank as a list, one entry per rank (no merging).

    Like torch's ``all_gather_object`` and detectron2's ``comm.all_gather``, with the size
    negotiation and inline small values of :func:`all_gather` (one collective for small values).

    Args:
        obj: any picklable value; tensors inside travel as raw bytes.
        group: None (every rank), a list of global ranks, or a group handle.
        async_op: return an :class:`AsyncResult`.

    Returns:
        The values of the group's ranks, in rank order. Ranks outside ``group`` get ``[obj]``.

    Example:
        >>> import onedist as od
        >>> od.all_gather_object({"rank": od.get_rank()})
        [{'rank': 0}]
    """
    return gather_values("all_gather_object", obj, group, async_op, merge=False)  # type: ignore[no-any-return]


def all_gather_tensors_with_shapes(
    tensor: torch.Tensor, shapes: Sequence[Sequence[int]], group: GroupLike = None
) -> list[torch.Tensor]:
    """Gather tensors whose shapes differ per rank, given every rank's shape (ignite's helper).

    One :func:`all_gather` of the flattened tensors (no padding), split and reshaped with ``shapes``.

    Args:
        tensor: this rank's tensor; its shape must be ``shapes[i]``, ``i`` this rank's index in
            the group.
        shapes: the shape of each participating rank's tensor, in group rank order.
        group: None (every rank), a list of global ranks, or a group handle.

    Returns:
        One tensor per participating rank, in rank order. Ranks outside ``group`` get ``[tensor]``.

    Example:
        >>> import torch, onedist as od
        >>> rank, ws = od.get_rank(), od.get_world_size()
        >>> shapes = [[r + 1, 2] for r in range(ws)]              # rank r sends r + 1 rows
        >>> parts = od.all_gather_tensors_with_shapes(torch.ones(rank + 1, 2), shapes)
        >>> [tuple(p.shape) for p in parts]
        [(1, 2)]
    """
    func = "all_gather_tensors_with_shapes"
    if not isinstance(tensor, torch.Tensor):
        raise bad_type(func, "tensor", tensor, "a torch.Tensor")
    _, me, _ = resolve_group(func, current(), group)
    if me < 0:
        return [tensor]
    # the real shapes travel with the data (same collective), so a wrong ``shapes`` on any rank
    # is reported on every rank after it instead of leaving the others waiting
    dims = torch.tensor(tensor.shape, dtype=torch.int64)
    flat, all_dims, ndims = all_gather((tensor.reshape(-1), dims, tensor.dim()), group, nested=True)
    offsets = [0, *torch.cumsum(ndims, 0).tolist()]
    actual = [tuple(all_dims[a:b].tolist()) for a, b in pairwise(offsets)]
    wanted = [tuple(int(d) for d in s) for s in shapes]
    if wanted != actual:
        raise CollectiveMismatchError(
            f"onedist.{func}: shapes={wanted} is not what the ranks sent: {actual} (in group rank order)"
        )
    sizes = [torch.Size(s).numel() for s in actual]
    return [part.view(s) for part, s in zip(flat.split(sizes), actual)]


@guarded("gather", 2, dst=(1, 0))
def gather(data: Any, dst: int = 0, group: GroupLike = None) -> list[Any]:
    """Collect every rank's value on global rank ``dst`` (detectron2's ``comm.gather``).

    Args:
        data: a tensor, number, string or any picklable object (shapes may differ per rank).
        dst: global rank that receives.
        group: None (every rank), a list of global ranks, or a group handle.

    Returns:
        On ``dst``, a list with one value per rank of the group, in rank order; elsewhere ``[]``.

    Example:
        >>> import onedist as od
        >>> od.gather({"rank": od.get_rank()}, dst=0)
        [{'rank': 0}]
    """
    b = current()
    g, me, ranks = resolve_group("gather", b, group)
    check_peer("gather", "dst", dst, b, ranks)
    if me < 0:
        return []
    size = len(ranks)
    ch = Channels(b, g, "gather", size)
    slot = torch.empty(ch.slot, dtype=U8)
    packed, inline, err = pack_or_error("gather", data, ch, slot)
    slots = torch.empty(size * ch.slot, dtype=U8)
    b.all_gather_into_(slots, slot, ch.og, False)
    headers = W.parse_headers(slots, size)
    raise_slot_errors("gather", slots, headers, ranks, me, err)
    obj_sizes = [obj_len(h, ch.merged) for h in headers]
    t_sizes = [0 if ch.merged else h.tensor_len for h in headers]
    my_obj, my_t = my_blocks(packed, inline, ch, obj_sizes[me])
    dst_i = ranks.index(dst)
    is_dst = me == dst_i
    obj_buf = _to_one(b, ch.og, CPU, my_obj, obj_sizes, dst_i, is_dst)
    t_buf = None if ch.merged else _to_one(b, g, ch.tdev, my_t, t_sizes, dst_i, is_dst)
    if not is_dst:
        return []
    slot_views = slots.view(size, ch.slot)
    objs, tens = slices(obj_buf, obj_sizes), slices(t_buf, t_sizes)
    out = []
    for i, h in enumerate(headers):
        kind, _, tensors, rest = decode(ch, h, slot_views[i], objs[i], tens[i])
        out.append(localize(W.unpack(kind, rest, tensors), data))
    return out


def _to_one(
    b: Backend, group: Any, dev: torch.device, block: torch.Tensor, sizes: list[int], dst_i: int, is_dst: bool
) -> Optional[torch.Tensor]:
    """Every rank's block delivered to group rank ``dst_i`` only (exact sizes)."""
    if sum(sizes) == 0:
        return None
    n = len(sizes)
    in_splits = [block.numel() if i == dst_i else 0 for i in range(n)]
    out_splits = sizes if is_dst else [0] * n
    out = torch.empty(sum(out_splits), dtype=U8, device=dev)
    b.all_to_all_single_(out, block, out_splits, in_splits, group, False)
    return out
