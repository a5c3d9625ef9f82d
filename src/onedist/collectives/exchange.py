"""The value exchange under every data-moving collective: any value, from every rank, to every rank.

Round 1 gathers one fixed-size slot per rank (its header, and the value itself when it is small);
round 2 moves the rest, exact sizes and no padding, over the object channel (CPU bytes) and the
tensor channel (the backend's device). A rank that cannot pack its value sends an error slot, so
every rank raises instead of hanging. The wire format is in :mod:`onedist.collectives.wire`.
"""

from __future__ import annotations

import copy
import numbers
import struct
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any, NamedTuple, Optional

import torch

from ..backends import Backend, Work
from ..context import current
from ..errors import CollectiveMismatchError, OnedistTypeError, RemoteRankError
from ..state import world
from . import wire as W
from .base import CPU, U8, AsyncResult, GroupLike, done, resolve_group
from .packing import sorted_keys


# ============================================================================ data movement
class Channels:
    """Where packed bytes travel: the object channel (CPU bytes, gloo-capable group) and the
    tensor channel (the backend's device). On gloo they are one and the same.

    ``slot``: round 1's bytes per rank. The all_gather of a group (:func:`channels`) sizes it from
    the calls before (:meth:`fit`): the full slot, or a small one after a run of small values (a
    4 KiB slot costs a one-element gather ~5% more than 256 bytes on gloo, measured).
    """

    __slots__ = ("b", "full_slot", "g", "merged", "og", "size", "slot", "small_calls", "tdev")

    def __init__(self, b: Backend, g: Any, op: str, size: int) -> None:
        self.b, self.g, self.size = b, g, size
        self.og = b.object_group(g)
        self.tdev = b.comm_device(CPU, op)
        self.merged = self.tdev.type == "cpu" and self.og is g
        self.slot = self.full_slot = W.slot_size(size)
        self.small_calls = 0

    def fit(self, need: int) -> None:
        """Size the next call's slot from the bytes this call's largest value needed inline.

        Every rank of the group computes the same: ``need`` is read from the gathered slots. One
        value beyond the small slot brings the full one back at once (so a loop that alternates
        small and larger values keeps one collective per call); only a run of small ones shrinks it.
        """
        if need > SMALL_SLOT:
            self.slot, self.small_calls = self.full_slot, 0
        elif self.slot != SMALL_SLOT:
            self.small_calls += 1
            if self.small_calls >= SHRINK_AFTER_CALLS:
                self.slot = min(SMALL_SLOT, self.full_slot)


SMALL_SLOT = 256  # a header, a tensor's meta and 44 floats
SHRINK_AFTER_CALLS = 4


def channels(b: Backend, g: Any, op: str, size: int) -> Channels:
    """``g``'s :class:`Channels` for ``op``, made once per backend (their questions to the backend
    cost more than a small collective's own Python; the cache empties when the backend changes).
    One per rank: XLA's device threads are ranks of one process, and each sizes its own slot."""
    key = (g, op, b.rank)
    try:
        ch: Optional[Channels] = world.routes.get(key)
    except TypeError:  # a handle that does not hash
        return Channels(b, g, op, size)
    if ch is None:
        ch = world.routes[key] = Channels(b, g, op, size)
    return ch


def pack_or_error(
    func: str, value: Any, ch: Channels, slot: torch.Tensor
) -> tuple[Optional[W.Packed], int, str]:
    """Pack ``value`` into ``slot``; on failure write an error slot and return the message."""
    try:
        packed = W.pack(value, ch.tdev)
        return packed, W.fill_slot(slot, packed, ch.merged), ""
    except Exception as e:  # anything: the other ranks must get an error slot, never a hang
        msg = (
            f"onedist.{func}: {e}"
            if isinstance(e, W.PackError)
            else f"onedist.{func}: {type(e).__name__}: {e}"
        )
        slot.zero_()
        W.error_slot(slot, msg)
        return None, W.INLINE_META, msg


def slot_message(slot: torch.Tensor, h: W.Header) -> str:
    return W.slot_bytes(slot, W.HEADER_BYTES, W.HEADER_BYTES + h.meta_len).decode("utf-8", "replace")


def remote_error(func: str, rank: int, message: str) -> RemoteRankError:
    return RemoteRankError(
        f"onedist.{func}: rank {rank} could not send its value, so this collective was abandoned "
        f"on every rank. Its error:\n{message}",
        rank=rank,
    )


def raise_slot_errors(
    func: str,
    slots: torch.Tensor,
    headers: list[W.Header],
    ranks: Sequence[int],
    me: int,
    own_error: str,
) -> None:
    """Raise on every rank when any rank could not pack: its own error there, a remote one elsewhere."""
    bad = [i for i, h in enumerate(headers) if h.status != 0]
    if not bad:
        return
    if me in bad:
        raise OnedistTypeError(own_error)
    first = bad[0]
    raise remote_error(func, ranks[first], slot_message(slots.view(len(headers), -1)[first], headers[first]))


def obj_len(h: W.Header, merged: bool) -> int:
    n = W.align(h.meta_len) if h.inline == W.INLINE_NONE else 0
    if merged and h.inline != W.INLINE_ALL:
        n += h.tensor_len
    return n


def my_blocks(
    packed: Optional[W.Packed], inline: int, ch: Channels, obj_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's round-2 bytes: (object channel block, tensor channel block)."""
    empty = torch.empty(0, dtype=U8)
    if packed is None:
        return empty, torch.empty(0, dtype=U8, device=ch.tdev)
    meta_part = W.align(len(packed.meta)) if inline == W.INLINE_NONE else 0
    tensors_here = packed.tensor_len if inline != W.INLINE_ALL else 0
    if not ch.merged:
        tblock = torch.empty(packed.tensor_len, dtype=U8, device=ch.tdev)
        W.copy_tensors_into(packed, tblock)
        tensors_here = 0
    else:
        tblock = torch.empty(0, dtype=U8)
    if obj_len == 0:
        return empty, tblock
    if meta_part == 0 and packed.kind == W.K_TENSOR:
        return W.tensor_bytes(packed.tensors[0]), tblock  # the tensor's own memory: no copy
    if not tensors_here and packed.block is not None and len(packed.block) == obj_len:
        return torch.frombuffer(packed.block, dtype=U8), tblock  # the pickle's own memory: no copy
    block = torch.empty(obj_len, dtype=U8)
    if meta_part:
        block.numpy().data[: len(packed.meta)] = packed.meta
    if tensors_here:
        W.copy_tensors_into(packed, block[meta_part:])
    return block, tblock


# Uneven round 2 with blocks this large goes over concurrent isend/irecv with every peer: no
# repeated input (all_to_all_single needs the block once per peer) and, on gloo, about 2x faster at
# 4 MB+ (benchmarks/bench_collectives.py). The tag keeps it apart from the user's own p2p traffic.
_P2P_MIN_BYTES = 256 * 1024


_EXCHANGE_TAG = 0x6F6E64


def gather_bytes(
    b: Backend,
    group: Any,
    ranks: Sequence[int],
    me: int,
    dev: torch.device,
    block: torch.Tensor,
    sizes: list[int],
    async_op: bool,
    out: Optional[torch.Tensor] = None,
) -> tuple[Optional[torch.Tensor], list[Optional[Work]]]:
    """Every rank's block, concatenated in group-rank order; exact sizes, no padding.

    ``out``: where to receive (``sum(sizes)`` bytes), e.g. the result tensor's own memory.
    """
    total = sum(sizes)
    if total == 0:
        return None, []
    if out is None:
        out = torch.empty(total, dtype=U8, device=dev)
    if all(s == sizes[0] for s in sizes):
        return out, [b.all_gather_into_(out, block, group, async_op)]
    own = b.all_gather_uneven_(out, block, sizes, group, async_op)
    if own is not None:
        return out, list(own)
    if max(sizes) >= _P2P_MIN_BYTES and b.p2p_bulk:
        views = slices(out, sizes)
        mine = views[me]
        assert mine is not None
        mine.copy_(block)
        works: list[Optional[Work]] = []
        for i, peer in enumerate(ranks):
            if i != me:
                if block.numel():
                    works.append(b.send_(block, peer, group, _EXCHANGE_TAG, True))
                view = views[i]
                if view is not None and view.numel():
                    works.append(b.recv_(view, peer, group, _EXCHANGE_TAG, True))
        if not async_op:
            for w in works:
                if w is not None:
                    w.wait()
            works = []
        return out, works
    inp = block.repeat(len(sizes)) if block.numel() else block
    return out, [b.all_to_all_single_(out, inp, sizes, [block.numel()] * len(sizes), group, async_op)]


def decode(
    ch: Channels,
    h: W.Header,
    slot: torch.Tensor,
    obj: Optional[torch.Tensor],
    tens: Optional[torch.Tensor],
) -> tuple[int, list[W.TensorSpec], list[torch.Tensor], W.Buffer]:
    """One rank's value parts from its slot and its round-2 bytes (``obj``/``tens`` may be None)."""
    obj_rest: Optional[torch.Tensor]
    meta: W.Buffer
    if h.inline == W.INLINE_NONE:
        assert obj is not None
        meta = W.block_view(obj, 0, h.meta_len)  # the object channel is on the CPU; no copy
        obj_rest = obj[W.align(h.meta_len) :]
    else:
        meta = W.slot_bytes(slot, W.HEADER_BYTES, W.HEADER_BYTES + h.meta_len)
        obj_rest = obj
    specs, offsets, rest = W.split_meta(h.kind, meta)
    data: Optional[torch.Tensor]
    if h.inline == W.INLINE_ALL:
        data = slot[W.HEADER_BYTES + W.align(h.meta_len) :]
    elif ch.merged:
        data = obj_rest
    else:
        data = tens
    if not specs:
        return h.kind, specs, [], rest
    assert data is not None, "tensor bytes announced but not received"
    tensors = [W.view_tensor(data, off, spec) for spec, off in zip(specs, offsets)]
    return h.kind, specs, tensors, rest


def slices(buf: Optional[torch.Tensor], sizes: list[int]) -> list[Optional[torch.Tensor]]:
    if buf is None:
        return [None] * len(sizes)
    out: list[Optional[torch.Tensor]] = []
    off = 0
    for s in sizes:
        out.append(buf[off : off + s])
        off += s
    return out


def gather_values(func: str, value: Any, group: GroupLike, async_op: bool, merge: bool) -> Any:
    """Every rank's ``value``, on any group: the tensors concatenated or the values merged
    (``merge``), else a list, one entry per rank.

    A plain tensor on a merged channel (CPU bytes: gloo, shm, mpi) goes into its slot without
    tensor ops (:func:`W.tensor_slot`: the same bytes as :func:`pack_or_error`'s); when every rank
    sent its dtype and shape with the data inline (a metric, a small batch), the result is one
    copy out of the received slots, read before anything else is made (each microsecond between
    two small collectives costs the pair several on busy cores, issue 24). Anything else, or a
    mismatch, takes the general way from the same slots."""
    b = current()
    g, me, ranks = resolve_group(func, b, group)
    if me < 0:  # all_gather gives its input back (as ignite); all_gather_object a list, as torch
        return done(value if func == "all_gather" else [value], async_op)
    size = len(ranks)
    ch = channels(b, g, "all_gather", size)
    fast = (
        W.tensor_slot(value, ch.slot, size) if merge and ch.merged and type(value) is torch.Tensor else None
    )
    if fast is not None:
        bufs = fast[0]
        b.all_gather_into_(bufs.recv, bufs.send, ch.og, False)
        out = inline_result(bufs, ch)
        if out is not None:
            W.release(bufs)
            return AsyncResult([], lambda: out) if async_op else out
    call = _Gather(func, b, g, me, ranks, ch)
    if fast is not None:
        return _from_tensor_slots(call, value, fast, async_op)
    return _gather_packed(call, value, async_op, merge)


class _Gather(NamedTuple):
    """A gather in progress: its function's name, backend, group handle, this rank's index in
    the group, the group's global ranks and its routes."""

    func: str
    b: Backend
    g: Any
    me: int
    ranks: Sequence[int]
    ch: Channels


def _gather_packed(c: _Gather, value: Any, async_op: bool, merge: bool) -> Any:
    """The general way's round 1 (``value`` packed into a fresh slot), then :func:`_from_slots`."""
    slot = torch.empty(c.ch.slot, dtype=U8)
    packed, inline, err = pack_or_error(c.func, value, c.ch, slot)
    slots = torch.empty(len(c.ranks) * c.ch.slot, dtype=U8)
    c.b.all_gather_into_(slots, slot, c.ch.og, False)
    return _from_slots(c, value, slots, (packed, inline, err), async_op, merge)


def _from_tensor_slots(
    c: _Gather, local: torch.Tensor, fast: tuple[W.SlotBuffers, torch.Tensor], async_op: bool
) -> Any:
    """The result of a gather whose round 1 sent :func:`W.tensor_slot`'s slot."""
    bufs, sent = fast
    result = gather_tensor(c.b, c.ch, c.ranks, c.me, local, fast, async_op)  # calls ch.fit
    if result is not None:
        W.release(bufs)
        return result
    # the general way reads the same slots (and keeps the buffers)
    plan = bufs.plan
    packed = W.Packed(W.K_TENSOR, plan.meta, [sent], [plan.nbytes])
    return _from_slots(c, local, bufs.recv, (packed, plan.inline, ""), async_op, True)


def _from_slots(
    c: _Gather,
    value: Any,
    slots: torch.Tensor,
    mine: tuple[Optional[W.Packed], int, str],
    async_op: bool,
    merge: bool,
) -> Any:
    """The general way from the gathered round-1 slots: errors, round 2, decoding.

    ``mine``: this rank's packed value (None if it could not pack), how much of it went inline,
    and its packing error."""
    func, b, g, me, ranks, ch = c
    packed, inline, err = mine
    size = len(ranks)
    headers = W.parse_headers(slots, size)
    ch.fit(max(W.HEADER_BYTES + W.align(h.meta_len) + (h.tensor_len if ch.merged else 0) for h in headers))
    raise_slot_errors(func, slots, headers, ranks, me, err)
    obj_sizes = [obj_len(h, ch.merged) for h in headers]
    my_obj, my_t = my_blocks(packed, inline, ch, obj_sizes[me])
    obj_buf, w1 = gather_bytes(b, ch.og, ranks, me, CPU, my_obj, obj_sizes, async_op)
    t_sizes = [0 if ch.merged else h.tensor_len for h in headers]
    t_buf, w2 = (
        gather_bytes(b, g, ranks, me, ch.tdev, my_t, t_sizes, async_op) if not ch.merged else (None, [])
    )

    def finish() -> Any:
        slot_views = slots.view(size, -1)  # the slot this call used (fit may have resized ch's)
        objs, tens = slices(obj_buf, obj_sizes), slices(t_buf, t_sizes)
        parts = [decode(ch, h, slot_views[i], objs[i], tens[i]) for i, h in enumerate(headers)]
        if merge:
            return _merge_gathered(value, parts, headers, obj_buf, obj_sizes, ch)
        return [localize(W.unpack(kind, rest, tensors), value) for kind, _, tensors, rest in parts]

    if async_op:
        return AsyncResult(w1 + w2, finish)
    return finish()


def inline_result(bufs: W.SlotBuffers, ch: Channels) -> Optional[torch.Tensor]:
    """The concatenated result when every rank's slot holds this rank's header and meta (same
    dtype and shape) and the data inline: one copy out of the slots; None otherwise."""
    plan = bufs.plan
    if plan.inline != W.INLINE_ALL:
        return None
    mv, head = bufs.recv_view, plan.head
    for rank_head in bufs.heads:
        if mv[rank_head] != head:
            return None
    ch.fit(plan.start + plan.nbytes)
    # rank i's data sits at the same offset of its slot: one strided view over the slots (made
    # with the buffers), cloned into a contiguous result
    assert bufs.rows is not None
    out = bufs.rows.clone(memory_format=torch.contiguous_format)
    return out if out.dim() == len(bufs.out_shape) else out.view(bufs.out_shape)  # n > 1 rows per rank


def gather_tensor(
    b: Backend,
    ch: Channels,
    ranks: Sequence[int],
    me: int,
    local: torch.Tensor,
    fast: tuple[W.SlotBuffers, torch.Tensor],
    async_op: bool,
) -> Any:
    """all_gather's result when every rank sent a tensor of ``local``'s dtype and trailing shape,
    read straight from the round-1 slots; None otherwise (the general path then parses the same
    slots, and reports errors and mismatches).

    Same shape, data inline: :func:`gather_values` has read it with :func:`inline_result` (here: None).
    Data not inline (first dimensions may differ): round 2 as the general path does it, with the
    same sizes (so ranks on either path issue the same collectives), received into the result
    itself.
    """
    bufs = fast[0]
    plan = bufs.plan
    if plan.inline != W.INLINE_META or local.dim() == 0:
        return None
    mv, size, slot, head = bufs.recv_view, len(ranks), len(plan.template), plan.head
    # per rank: the header but its tensor length (bytes 32-40), and the meta but the first
    # dimension (8 bytes at dim0, after the dtype code and ndim), match this rank's
    lens, total_rows, dim0 = [], 0, W.HEADER_BYTES + 16
    for i in range(size):
        at = i * slot
        if i != me and (
            mv[at : at + 32] != head[:32]
            or mv[at + 40 : at + dim0] != head[40:dim0]
            or mv[at + dim0 + 8 : at + len(head)] != head[dim0 + 8 :]
        ):
            return None
        lens.append(_I64.unpack_from(mv, at + 32)[0])
        total_rows += _I64.unpack_from(mv, at + dim0)[0]
    ch.fit(plan.start + max(lens))
    out = torch.empty((total_rows, *local.shape[1:]), dtype=local.dtype)
    recv = W.tensor_bytes(out) if out.numel() else None
    _, works = gather_bytes(b, ch.og, ranks, me, CPU, W.tensor_bytes(fast[1]), lens, async_op, recv)
    return AsyncResult(works, lambda: out) if async_op else out


_I64 = struct.Struct("<q")


def localize(value: Any, local: Any) -> Any:
    """A received tensor goes to the device of the tensor this rank passed (if it passed one)."""
    if isinstance(value, torch.Tensor) and isinstance(local, torch.Tensor) and value.device != local.device:
        return value.to(local.device)
    return value


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)} {value.dtype}"
    if isinstance(value, Mapping):
        return f"{type(value).__name__} with keys {sorted_keys(value)}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of length {len(value)}"
    return type(value).__name__


def _mismatch(func: str, what: str, values: Sequence[Any], path: str) -> CollectiveMismatchError:
    lines = "\n".join(f"  rank {i}: {_describe(v)}" for i, v in enumerate(values))
    where = f" at {path}" if path else ""
    return CollectiveMismatchError(f"onedist.{func}: the ranks passed {what}{where}:\n{lines}")


def _merge_gathered(
    local: Any,
    parts: list[tuple[int, list[W.TensorSpec], list[torch.Tensor], W.Buffer]],
    headers: list[W.Header],
    obj_buf: Optional[torch.Tensor],
    obj_sizes: list[int],
    ch: Channels,
) -> Any:
    kinds = {p[0] for p in parts}
    if kinds == {W.K_TENSOR}:
        return _cat_tensors(local, [p[2][0] for p in parts], headers, obj_buf, obj_sizes, ch)
    values = [W.unpack(kind, rest, tensors) for kind, _, tensors, rest in parts]
    return _merge_values(local, values, "")


def _cat_tensors(
    local: torch.Tensor,
    tensors: list[torch.Tensor],
    headers: list[W.Header],
    obj_buf: Optional[torch.Tensor],
    obj_sizes: list[int],
    ch: Channels,
) -> torch.Tensor:
    first = tensors[0]
    trailing = tuple(first.shape[1:]) if first.dim() else ()
    for t in tensors:
        if t.dtype != first.dtype or t.dim() != first.dim() or tuple(t.shape[1:]) != trailing:
            raise _mismatch("all_gather", "tensors that cannot be concatenated on dim 0", tensors, "")
    contiguous = (
        ch.merged
        and obj_buf is not None
        and all(h.inline == W.INLINE_META for h in headers)
        and sum(obj_sizes) == obj_buf.numel()
    )
    if contiguous and obj_buf is not None and obj_buf.numel() % first.element_size() == 0:
        out = obj_buf.view(first.dtype).view(-1, *trailing)  # the receive buffer itself
    elif first.dim() == 0:
        out = torch.stack(tensors)
    else:
        out = torch.cat(tensors)
    if isinstance(local, torch.Tensor) and out.device != local.device:
        out = out.to(local.device)
    return out


def _merge_values(local: Any, values: list[Any], path: str) -> Any:
    first = values[0]
    if all(isinstance(v, torch.Tensor) for v in values):
        first_t: torch.Tensor = first
        trailing = tuple(first_t.shape[1:])
        if any(
            v.dtype != first_t.dtype or v.dim() != first_t.dim() or tuple(v.shape[1:]) != trailing
            for v in values
        ):
            raise _mismatch("all_gather", "tensors that cannot be concatenated on dim 0", values, path)
        out = torch.stack(values) if first_t.dim() == 0 else torch.cat(values)
        if isinstance(local, torch.Tensor) and out.device != local.device:
            out = out.to(local.device)
        return out
    if all(isinstance(v, numbers.Number) and not isinstance(v, complex) for v in values):
        if all(isinstance(v, bool) for v in values):
            dtype = torch.bool
        elif all(isinstance(v, numbers.Integral) for v in values):
            dtype = torch.int64
        else:
            dtype = torch.float64
        try:
            return torch.tensor(values, dtype=dtype)
        except (OverflowError, RuntimeError, ValueError):
            return list(values)
    if isinstance(first, Mapping) and not isinstance(first, str):
        if not all(isinstance(v, Mapping) and set(v) == set(first) for v in values):
            raise _mismatch("all_gather", "dicts with different keys", values, path)
        merged = {
            k: _merge_values(
                local.get(k) if isinstance(local, Mapping) else None, [v[k] for v in values], f"{path}[{k!r}]"
            )
            for k in first
        }
        if type(local) is dict or not isinstance(local, MutableMapping):
            return merged
        new = copy.copy(local)
        for k, v in merged.items():
            new[k] = v
        return new
    if isinstance(first, (list, tuple)):
        if not all(type(v) is type(first) and len(v) == len(first) for v in values):
            raise _mismatch("all_gather", "sequences of different types or lengths", values, path)
        loc = local if isinstance(local, (list, tuple)) and len(local) == len(first) else [None] * len(first)
        items = [_merge_values(loc[i], [v[i] for v in values], f"{path}[{i}]") for i in range(len(first))]
        if isinstance(first, tuple) and hasattr(first, "_fields"):
            return type(first)._make(items)  # type: ignore[attr-defined]
        return type(first)(items) if isinstance(first, tuple) else items
    return list(values)
