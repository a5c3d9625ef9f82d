"""From one root to every rank: :func:`broadcast`, :func:`broadcast_object`, :func:`scatter`."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from pathlib import PurePath
from typing import Any, Optional

import torch

from ..backends import Backend, Work
from ..backends.interface import NATIVE_REDUCE_DTYPES
from ..context import current
from ..errors import OnedistTypeError, bad_type, bad_value
from . import wire as W
from .base import CPU, U8, AsyncResult, GroupLike, check_peer, done, resolve_group
from .exchange import Channels, decode, my_blocks, obj_len, pack_or_error, remote_error, slot_message
from .guard import guarded


@guarded("broadcast", 3, src=(1, 0))
def broadcast(
    tensor: Any,
    src: int = 0,
    safe_mode: bool = False,
    group: GroupLike = None,
    *,
    async_op: bool = False,
) -> Any:
    """Send a tensor, number, string or path from global rank ``src`` to every rank (ignite's call).

    Args:
        tensor: on ``src``, the value: a tensor, a number, a ``str`` or a ``pathlib`` path.
            Elsewhere, without ``safe_mode``, a value of the same kind (for a tensor: of the same
            shape and dtype; one collective, no negotiation); with ``safe_mode``, anything, None
            included (it is ignored). For other values (dicts, lists, any picklable object), use
            :func:`broadcast_object`.
        src: global rank that sends.
        safe_mode: let non-source ranks pass None (or anything); the kind, shape and dtype then
            travel with the data (one collective more for large tensors).
        group: None (every rank), a list of global ranks, or a group handle.
        async_op: return an :class:`AsyncResult` (tensor path without ``safe_mode`` only waits
            on nothing else; other paths negotiate before returning).

    Returns:
        The source's value. On ``src`` it is the input itself; received tensors are placed on the
        device of the tensor this rank passed, else on :func:`onedist.device`.

    Raises:
        OnedistTypeError: ``tensor`` is of another kind ("Unhandled input type", as in ignite).
        OnedistValueError: ``tensor`` is None on ``src``, or elsewhere without ``safe_mode``.

    Example:
        >>> import onedist as od
        >>> od.broadcast(torch.tensor([1.0, 2.0]), src=0)
        tensor([1., 2.])
        >>> od.broadcast("config.yaml" if od.get_rank() == 0 else None, src=0, safe_mode=True)
        'config.yaml'
    """
    is_src = current().rank == src
    if tensor is None:
        if is_src:
            raise bad_value(
                "broadcast", "tensor", None, "a value on the source rank", says="Source data can not be None"
            )
        if safe_mode is not True:
            raise bad_value(
                "broadcast",
                "tensor",
                None,
                "a placeholder of the source's kind, or None with safe_mode=True",
                says="Argument safe_mode should be True if None is passed for non src rank",
            )
    elif (is_src or safe_mode is not True) and not isinstance(tensor, _BROADCAST_KINDS):
        raise bad_type(
            "broadcast",
            "tensor",
            tensor,
            "a tensor, a number, a str or a pathlib path",
            hint="od.broadcast_object(value, src) sends any picklable value",
            says="Unhandled input type",
        )
    return _broadcast(tensor, src, safe_mode, group, async_op)


@guarded("broadcast_object", 2, src=(1, 0))
def broadcast_object(obj: Any, src: int = 0, group: GroupLike = None, *, async_op: bool = False) -> Any:
    """Send any picklable value from global rank ``src`` to every rank (onedist's).

    Like torch's ``broadcast_object_list`` for one value, with small values inline in one
    collective; tensors inside travel as raw bytes and land on this rank's device.

    Args:
        obj: on ``src``, the value (a dict, list, tensor, any picklable object); ignored elsewhere
            (pass None).
        src: global rank that sends.
        group: None (every rank), a list of global ranks, or a group handle.
        async_op: return an :class:`AsyncResult`.

    Returns:
        The source's value (on ``src``: ``obj`` itself).

    Example:
        >>> import onedist as od
        >>> od.broadcast_object({"lr": 0.1} if od.get_rank() == 0 else None, src=0)
        {'lr': 0.1}
    """
    return _broadcast(obj, src, True, group, async_op, func="broadcast_object")


_BROADCAST_KINDS = (torch.Tensor, numbers.Number, str, PurePath)


def _broadcast(
    tensor: Any, src: int, safe_mode: bool, group: GroupLike, async_op: bool, func: str = "broadcast"
) -> Any:
    b = current()
    g, me, ranks = resolve_group(func, b, group)
    if not isinstance(safe_mode, bool):
        raise bad_type("broadcast", "safe_mode", safe_mode, "bool")
    check_peer(func, "src", src, b, ranks)
    if me < 0:
        return done(tensor, async_op)
    is_src = b.rank == src
    if isinstance(tensor, torch.Tensor) and not safe_mode:
        dev = b.comm_device(tensor.device, "broadcast")
        if is_src:
            src_t = tensor.resolve_conj().resolve_neg() if tensor.is_conj() or tensor.is_neg() else tensor
            buf = src_t if (src_t.device == dev and src_t.is_contiguous()) else src_t.to(dev).contiguous()
        else:
            buf = torch.empty(tensor.shape, dtype=tensor.dtype, device=dev)
        wire = buf
        if buf.dtype not in NATIVE_REDUCE_DTYPES and buf.numel():
            # a copy needs no arithmetic: dtypes the library lacks (int16, uint32, float8...) go as bytes
            wire = buf.reshape(-1).view(torch.uint8)
        work = b.broadcast_(wire, src, g, async_op)

        def finish_tensor() -> Any:
            if is_src:
                return tensor
            return buf if buf.device == tensor.device else buf.to(tensor.device)

        return AsyncResult([work], finish_tensor) if async_op else finish_tensor()
    size = len(ranks)
    ch = Channels(b, g, "broadcast", size)
    slot = torch.empty(ch.slot, dtype=U8)
    packed: Optional[W.Packed] = None
    inline, err = W.INLINE_NONE, ""
    if is_src:
        packed, inline, err = pack_or_error(func, tensor, ch, slot)
    b.broadcast_(slot, src, ch.og, False)
    h = W.parse_headers(slot, 1)[0]
    if h.status != 0:
        if is_src:
            raise OnedistTypeError(err)
        raise remote_error(func, src, slot_message(slot, h))
    if is_src:
        n_obj = obj_len(h, ch.merged)
        obj, tens = my_blocks(packed, inline, ch, n_obj)
    else:
        obj = torch.empty(obj_len(h, ch.merged), dtype=U8)
        tens = torch.empty(0 if ch.merged else h.tensor_len, dtype=U8, device=ch.tdev)
    works: list[Optional[Work]] = []
    if obj.numel():
        works.append(b.broadcast_(obj, src, ch.og, async_op))
    if tens.numel():
        works.append(b.broadcast_(tens, src, g, async_op))

    def finish() -> Any:
        if is_src:
            return tensor
        _, _, tensors, rest = decode(ch, h, slot, obj if obj.numel() else None, tens)
        value = W.unpack(h.kind, rest, tensors)
        if isinstance(value, torch.Tensor):
            target = tensor.device if isinstance(tensor, torch.Tensor) else b.device()
            if value.device != target:
                value = value.to(target)
        return value

    return AsyncResult(works, finish) if async_op else finish()


@guarded("scatter", 2, src=(1, 0))
def scatter(data: Optional[Sequence[Any]], src: int = 0, group: GroupLike = None) -> Any:
    """Send item ``i`` of a list on global rank ``src`` to the group's ``i``-th rank.

    Args:
        data: on ``src``, a list/tuple with one value (tensor, number, string, picklable object)
            per rank of the group; ignored elsewhere (pass None).
        src: global rank that sends.
        group: None (every rank), a list of global ranks, or a group handle.

    Returns:
        This rank's item (on ``src``, its own item itself); None on ranks outside ``group``.

    Example:
        >>> import onedist as od
        >>> shards = [list(range(i, 10, od.get_world_size())) for i in range(od.get_world_size())]
        >>> od.scatter(shards if od.get_rank() == 0 else None, src=0)
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    """
    b = current()
    g, me, ranks = resolve_group("scatter", b, group)
    check_peer("scatter", "src", src, b, ranks)
    if me < 0:
        return None
    size = len(ranks)
    ch = Channels(b, g, "scatter", size)
    src_i = ranks.index(src)
    is_src = me == src_i
    S = ch.slot
    packs: list[tuple[Optional[W.Packed], int]] = []
    local_error: Optional[Exception] = None
    if is_src:
        slots_in = torch.empty(size * S, dtype=U8)
        packs, local_error = _pack_items(data, ch, slots_in.view(size, S))
        in_splits = [S] * size
    else:
        slots_in = torch.empty(0, dtype=U8)
        in_splits = [0] * size
    out_splits = [S if i == src_i else 0 for i in range(size)]
    slot = torch.empty(S, dtype=U8)
    b.all_to_all_single_(slot, slots_in, out_splits, in_splits, ch.og, False)
    h = W.parse_headers(slot, 1)[0]
    if h.status != 0:
        if local_error is not None:
            raise local_error
        raise remote_error("scatter", src, slot_message(slot, h))
    # round 2: each rank's bytes from src only
    if is_src:
        headers = [W.parse_headers(slots_in.view(size, S)[i], 1)[0] for i in range(size)]
        blocks = [my_blocks(p, inline, ch, obj_len(hh, ch.merged)) for (p, inline), hh in zip(packs, headers)]
        obj_in = torch.cat([blk[0] for blk in blocks]) if blocks else torch.empty(0, dtype=U8)
        obj_splits = [blk[0].numel() for blk in blocks]
        t_in = torch.cat([blk[1] for blk in blocks]) if blocks else torch.empty(0, dtype=U8, device=ch.tdev)
        t_splits = [blk[1].numel() for blk in blocks]
    else:
        obj_in, obj_splits = torch.empty(0, dtype=U8), [0] * size
        t_in, t_splits = torch.empty(0, dtype=U8, device=ch.tdev), [0] * size
    my_obj_len = obj_len(h, ch.merged)
    my_t_len = 0 if ch.merged else h.tensor_len
    obj = _from_one(b, ch.og, CPU, obj_in, obj_splits, my_obj_len, src_i)
    tens = None if ch.merged else _from_one(b, g, ch.tdev, t_in, t_splits, my_t_len, src_i)
    if is_src:
        return data[me]  # type: ignore[index]
    _, _, tensors, rest = decode(ch, h, slot, obj, tens)
    return W.unpack(h.kind, rest, tensors)


def _pack_items(
    data: Optional[Sequence[Any]], ch: Channels, views: torch.Tensor
) -> tuple[list[tuple[Optional[W.Packed], int]], Optional[Exception]]:
    """On scatter's source: pack item ``i`` of ``data`` into slot ``views[i]``. On an error every
    slot carries it, so every rank learns it, not only the failing item's rank."""
    size = len(views)
    packs: list[tuple[Optional[W.Packed], int]] = []
    local_error: Optional[Exception] = None
    if not isinstance(data, (list, tuple)) or len(data) != size:
        local_error = bad_value(
            "scatter", "data", _short(data), f"a list or tuple of {size} values (one per rank of the group)"
        )
    else:
        for i in range(size):
            p, inline, err = pack_or_error("scatter", data[i], ch, views[i])
            packs.append((p, inline))
            if p is None and local_error is None:
                local_error = OnedistTypeError(f"{err} (item {i})")
    if local_error is not None:
        for i in range(size):
            W.error_slot(views[i], str(local_error))
    return packs, local_error


def _from_one(
    b: Backend,
    group: Any,
    dev: torch.device,
    inp: torch.Tensor,
    in_splits: list[int],
    my_len: int,
    src_i: int,
) -> Optional[torch.Tensor]:
    """This rank's block, sent by group rank ``src_i`` only (exact sizes)."""
    out_splits = [my_len if i == src_i else 0 for i in range(len(in_splits))]
    out = torch.empty(my_len, dtype=U8, device=dev)
    b.all_to_all_single_(out, inp, out_splits, in_splits, group, False)
    return out


def _short(value: Any) -> Any:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
