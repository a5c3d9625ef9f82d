"""How non-reduction collectives put Python values on the wire (used only by the collectives package).

Every rank turns its value into a *packed* form: a kind, a small ``meta`` byte string (a tensor's
dtype and shape, a number's 8 bytes, a string's UTF-8, or a pickle in which tensors are replaced
by references) and a list of tensors sent as raw bytes.

Round 1 exchanges one fixed-size **slot** per rank (all_gather, or broadcast from the source):
a header with every size the receivers need, and, when they fit, the meta and the tensor bytes
themselves. Most metric-sized values therefore cost **one** collective. Whatever did not fit goes
in round 2, with exact sizes (no padding to the largest rank). A rank that cannot pack its value
(e.g. unpicklable) sends an error slot instead, so every rank raises the same error instead of
waiting for data that never comes.

Slot layout (little-endian int64 header, then the inline area, 16-byte aligned)::

    [MAGIC, status, kind, meta_len, tensor_len, inline] [meta | pad | tensor bytes]

``inline``: 0 nothing inline, 1 meta inline, 2 meta and tensor bytes inline.
"""

from __future__ import annotations

import ctypes
import io
import pickle
import struct
import threading
from typing import Any, NamedTuple, Optional, Union

import torch

from ..errors import CollectiveMismatchError

__all__ = [
    "HEADER",
    "HEADER_BYTES",
    "INLINE_ALL",
    "INLINE_META",
    "INLINE_NONE",
    "PackError",
    "Packed",
    "SlotBuffers",
    "SlotPlan",
    "Header",
    "align",
    "error_slot",
    "fill_slot",
    "pack",
    "parse_headers",
    "slot_bytes",
    "slot_size",
    "split_meta",
    "block_view",
    "release",
    "tensor_slot",
    "unpack",
    "view_tensor",
]

MAGIC = 0x6F6E656469737401  # "onedist" + format version 1
HEADER_FIELDS = 6
HEADER_BYTES = 8 * HEADER_FIELDS
HEADER = struct.Struct(f"<{HEADER_FIELDS}q")
ALIGN = 16

INLINE_NONE, INLINE_META, INLINE_ALL = 0, 1, 2
STATUS_OK, STATUS_ERROR = 0, 1

K_TENSOR, K_FLOAT, K_INT, K_BOOL, K_STR, K_NONE, K_PICKLE = 1, 2, 3, 4, 5, 6, 7

_DTYPES: list[torch.dtype] = [
    getattr(torch, name)
    for name in (
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "bool",
        "complex64",
        "complex128",
        "uint16",
        "uint32",
        "uint64",
        "complex32",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
    )
    if hasattr(torch, name)
]
_DTYPE_CODE = {dt: i for i, dt in enumerate(_DTYPES)}

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

Buffer = Union[bytes, memoryview]  #: a meta: bytes, or a view of a pickle's or a received block's memory


class PackError(Exception):
    """This rank's value cannot be sent (reported to every rank through the error slot)."""


class Packed(NamedTuple):
    """A value ready for the wire: kind, meta bytes, and the tensors (contiguous, on the channel)."""

    kind: int
    meta: Buffer
    tensors: list[torch.Tensor]
    #: each tensor's padded byte length, in order
    sizes: list[int]
    #: the meta padded to the wire alignment, in memory round 2 may send as it is (a large pickle:
    #: its only copy), or None
    block: Optional[memoryview] = None

    @property
    def tensor_len(self) -> int:
        return sum(self.sizes)


class Header(NamedTuple):
    """One rank's slot header."""

    status: int
    kind: int
    meta_len: int
    tensor_len: int
    inline: int


def align(n: int) -> int:
    """``n`` rounded up to the wire alignment (16 bytes)."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def slot_size(group_size: int) -> int:
    """Bytes per rank in round 1: 4 KiB for small groups, shrinking so a round stays <= 64 KiB."""
    return max(256, min(4096, align(65536 // max(group_size, 1)) - ALIGN))


# ---------------------------------------------------------------------------------------- packing
class _TensorPickler(pickle.Pickler):
    """Pickles tensors as references into a side list (their bytes travel raw, not pickled).

    ``reducer_override`` is not called for builtin containers and scalars, so plain data pickles
    at C speed.
    """

    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            self.tensors.append(obj)
            return _tensor_ref, (len(self.tensors) - 1,)
        return NotImplemented


_unpickling = threading.local()


def _tensor_ref(index: int) -> torch.Tensor:
    """Replaced at unpickling time by the tensor with this index (see :func:`unpack`)."""
    tensor: torch.Tensor = _unpickling.tensors[index]
    return tensor


def _tensor_meta(t: torch.Tensor) -> bytes:
    code = _DTYPE_CODE.get(t.dtype)
    if code is None:
        raise PackError(f"tensors of dtype {t.dtype} cannot be sent")
    return struct.pack(f"<{2 + t.dim()}q", code, t.dim(), *t.shape)


def _wire_tensor(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.layout != torch.strided:
        raise PackError(f"only dense tensors can be sent, got layout {t.layout}")
    if t.device.type == "meta":
        raise PackError("tensors on the 'meta' device have no data to send")
    t = t.detach()
    if t.is_conj() or t.is_neg():  # lazy conjugate/negative views: materialise (bytes must be plain)
        t = t.resolve_conj().resolve_neg()
    if t.device != device:
        t = t.to(device)
    return t.contiguous()


def pack(obj: Any, device: torch.device) -> Packed:
    """Pack ``obj``; tensors are moved to ``device`` (the tensor channel's device)."""
    if isinstance(obj, torch.Tensor):
        t = _wire_tensor(obj, device)
        return Packed(K_TENSOR, _tensor_meta(t), [t], [t.numel() * t.element_size()])
    if obj is None:
        return Packed(K_NONE, b"", [], [])
    kind = type(obj)  # exact types only: an IntEnum or a str subclass keeps its class (pickled)
    if kind is bool:
        return Packed(K_BOOL, struct.pack("<q", int(obj)), [], [])
    if kind is int and _INT64_MIN <= obj <= _INT64_MAX:
        return Packed(K_INT, struct.pack("<q", obj), [], [])
    if kind is float:
        return Packed(K_FLOAT, struct.pack("<d", obj), [], [])
    if kind is str:
        return Packed(K_STR, obj.encode("utf-8", "surrogatepass"), [], [])
    return _pack_pickle(obj, device)


def _pack_pickle(obj: Any, device: torch.device) -> Packed:
    """The meta: tensor count, one dtype/shape record per tensor, then the pickle. The count is
    written first and the pickle after it in one buffer: without tensors (a config, a vocabulary,
    a list of names), the buffer is the meta, padded and sent as it is, the pickle's only copy."""
    tensors: list[torch.Tensor] = []
    buf = io.BytesIO()
    buf.write(_NO_TENSORS)
    try:
        _TensorPickler(buf, tensors).dump(obj)
    except Exception as e:
        raise PackError(
            f"cannot pickle a value of type {type(obj).__qualname__}: {type(e).__name__}: {e}"
        ) from e
    if not tensors:
        meta_len = buf.tell()
        buf.write(bytes(align(meta_len) - meta_len))
        block = buf.getbuffer()
        return Packed(K_PICKLE, block[:meta_len], [], [], block)
    wired = [_wire_tensor(t, device) for t in tensors]
    sizes = [align(t.numel() * t.element_size()) for t in wired]
    records = b"".join(_tensor_meta(t) for t in wired)
    pickled = buf.getbuffer()[len(_NO_TENSORS) :]  # tensors' bytes travel raw: a small pickle
    return Packed(K_PICKLE, struct.pack("<q", len(wired)) + records + pickled, wired, sizes)


_NO_TENSORS = struct.pack("<q", 0)


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a contiguous tensor's data."""
    flat = t.view(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:
        # torch calls a 1-element tensor contiguous whatever its stride (x[r::w][:1]); a byte view needs 1
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8)


def copy_tensors_into(packed: Packed, dst: torch.Tensor) -> None:
    """Write the packed tensors' bytes, each at its padded offset, into the uint8 tensor ``dst``."""
    offset = 0
    for t, size in zip(packed.tensors, packed.sizes):
        n = t.numel() * t.element_size()
        if n:
            dst[offset : offset + n].copy_(tensor_bytes(t))
        offset += size


class SlotPlan(NamedTuple):
    """A tensor's round-1 slot for one dtype, shape and slot length (see :func:`tensor_slot`)."""

    template: bytes  #: the whole slot with header and meta written, zeros elsewhere
    meta: bytes
    head: bytes  #: header and meta: equal on every rank that sent this dtype and shape
    start: int  #: where the data goes in the slot
    nbytes: int
    inline: int


class SlotBuffers:
    """Round 1's send slot and receive buffer for one :class:`SlotPlan` and group size, with where
    each rank's header and data sit in the receive buffer; reused by the next call once this one
    is done with them (:func:`release`): on gloo, fresh buffers cost a small all_gather 20-40 us a
    call more than the same buffers again, and every op between two collectives counts several
    times on busy cores (measured, issue 24)."""

    __slots__ = ("heads", "key", "out_shape", "plan", "recv", "recv_view", "rows", "send", "send_at")

    def __init__(self, key: tuple[Any, ...], plan: SlotPlan, t: torch.Tensor, size: int) -> None:
        self.key, self.plan = key, plan
        slot, shape = len(plan.template), t.shape
        self.send = torch.frombuffer(bytearray(plan.template), dtype=torch.uint8)
        self.send_at = self.send.data_ptr() + plan.start  # where this rank's data goes
        self.recv = torch.empty(size * slot, dtype=torch.uint8)
        self.recv_view = self.recv.numpy().data
        #: rank i's header and meta in ``recv_view``
        self.heads = [slice(i * slot, i * slot + len(plan.head)) for i in range(size)]
        #: the concatenation of ``size`` tensors of ``shape`` (0-dim ones stacked)
        self.out_shape = (size,) if not shape else (size * shape[0], *shape[1:])
        #: when the data is inline, every rank's as one strided view of ``recv`` (its clone is
        #: the result: one tensor op), shaped (size, *shape) unless that is ``out_shape`` already
        self.rows: Optional[torch.Tensor] = None
        if plan.inline == INLINE_ALL:
            item, inner = t.element_size(), t.stride()
            rows, strides = (size, *shape), (slot // item, *inner)
            if shape and shape[0] == 1:
                rows, strides = (size, *shape[1:]), (slot // item, *inner[1:])
            self.rows = self.recv.view(t.dtype).as_strided(rows, strides, plan.start // item)


def tensor_slot(t: torch.Tensor, slot_len: int, size: int) -> Optional[tuple[SlotBuffers, torch.Tensor]]:
    """:func:`pack` and :func:`fill_slot` of a dense CPU tensor bound for a CPU channel, in one go.

    The slot starts as a template made once per (dtype, shape) (header and meta), into which the
    data is copied by address (``memmove``: a quarter of a numpy view's cost; on a small
    all_gather every op between two collectives counts several times on busy cores, issue 24).
    Returns the buffers (their ``send`` holds the same bytes ``fill_slot`` writes; taken out of
    the pool until :func:`release`) and the tensor as sent (detached, contiguous); None when the
    tensor needs :func:`pack`'s general handling (another device or layout, a nested tensor, a
    lazy conjugate, a dtype without a wire code).
    """
    if not t.is_cpu or t.layout != torch.strided or t.is_nested or t.is_conj() or t.is_neg():
        return None
    if t.requires_grad:
        t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    key = (t.dtype, t.shape, slot_len, size)
    bufs = _FREE_BUFFERS.pop(key, None)  # atomic: a thread calling at once makes its own
    if bufs is None:
        if t.dtype not in _DTYPE_CODE:
            return None
        bufs = SlotBuffers(key, _slot_plan(t, slot_len), t, size)
    plan = bufs.plan
    if plan.inline == INLINE_ALL and plan.nbytes:
        _memmove(bufs.send_at, t.data_ptr(), plan.nbytes)  # contiguous, plan.nbytes long
    return bufs, t


_memmove = ctypes.memmove


def release(bufs: SlotBuffers) -> None:
    """Give ``bufs`` back for the next call with the same plan (nothing may use them after)."""
    if len(_FREE_BUFFERS) >= 256:
        _FREE_BUFFERS.clear()
    _FREE_BUFFERS[bufs.key] = bufs


#: (dtype, shape, slot length, group size) -> buffers no call is using
_FREE_BUFFERS: dict[tuple[Any, ...], SlotBuffers] = {}


def _slot_plan(t: torch.Tensor, slot_len: int) -> SlotPlan:
    dim = t.dim()
    nbytes = t.numel() * t.element_size()
    meta = struct.pack(f"<{2 + dim}q", _DTYPE_CODE[t.dtype], dim, *t.shape)
    start = HEADER_BYTES + align(len(meta))
    if start + nbytes <= slot_len:
        inline = INLINE_ALL
    elif HEADER_BYTES + len(meta) <= slot_len:
        inline = INLINE_META
    else:
        inline = INLINE_NONE
    buf = bytearray(slot_len)
    HEADER.pack_into(buf, 0, MAGIC, STATUS_OK, K_TENSOR, len(meta), nbytes, inline)
    if inline != INLINE_NONE:
        buf[HEADER_BYTES : HEADER_BYTES + len(meta)] = meta
    head = bytes(buf[: HEADER_BYTES + len(meta)])
    return SlotPlan(bytes(buf), meta, head, start, nbytes, inline)


# ---------------------------------------------------------------------------------------- slots
def fill_slot(slot: torch.Tensor, packed: Packed, tensors_inline_ok: bool) -> int:
    """Write header (and whatever fits) into ``slot`` (uint8, CPU); return the inline level."""
    capacity = slot.numel() - HEADER_BYTES
    meta_len = len(packed.meta)
    tensor_len = packed.tensor_len
    if tensors_inline_ok and align(meta_len) + tensor_len <= capacity:
        inline = INLINE_ALL
    elif meta_len <= capacity:
        inline = INLINE_META
    else:
        inline = INLINE_NONE
    # header and meta go in through a memoryview of the slot's own bytes: plain Python stores,
    # where a tensor built from them and copied in cost two tensor ops (a large share of a
    # small gather's time, issue 24)
    mv = slot.numpy().data
    HEADER.pack_into(mv, 0, MAGIC, STATUS_OK, packed.kind, meta_len, tensor_len, inline)
    if inline == INLINE_NONE:
        return inline
    mv[HEADER_BYTES : HEADER_BYTES + meta_len] = packed.meta
    if inline == INLINE_ALL and tensor_len:
        start = HEADER_BYTES + align(meta_len)
        copy_tensors_into(packed, slot[start : start + tensor_len])
    return inline


def error_slot(slot: torch.Tensor, message: str) -> None:
    """Fill ``slot`` with an error status and as much of ``message`` as fits."""
    text = message.encode("utf-8", "replace")[: slot.numel() - HEADER_BYTES]
    mv = slot.numpy().data
    HEADER.pack_into(mv, 0, MAGIC, STATUS_ERROR, 0, len(text), 0, INLINE_META)
    mv[HEADER_BYTES : HEADER_BYTES + len(text)] = text


def parse_headers(slots: torch.Tensor, n: int) -> list[Header]:
    """Headers of ``n`` consecutive slots in the uint8 CPU tensor ``slots``."""
    size = slots.numel() // n
    mv = slots.numpy().data  # struct reads of the bytes themselves: no tensor ops per call
    headers = []
    for i in range(n):
        row = HEADER.unpack_from(mv, i * size)
        if row[0] != MAGIC:
            raise CollectiveMismatchError(
                "onedist: a rank sent data that is not an onedist slot: the ranks are calling "
                "different collectives here (or run different onedist versions)"
            )
        headers.append(Header._make(row[1:]))
    return headers


def slot_bytes(slot: torch.Tensor, start: int, stop: int) -> bytes:
    """Bytes ``start:stop`` of a uint8 CPU tensor (a slot, or a round-2 object block)."""
    return bytes(slot.numpy().data[start:stop])


def block_view(block: torch.Tensor, start: int, stop: int) -> memoryview:
    """Bytes ``start:stop`` of a uint8 CPU tensor, not copied: a round-2 block of this call only
    (a slot's bytes are reused by the next call: :func:`slot_bytes` copies them)."""
    view: memoryview = block.numpy().data[start:stop]
    return view


# ---------------------------------------------------------------------------------------- unpacking
class TensorSpec(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


def _read_record(meta: Buffer, offset: int) -> tuple[TensorSpec, int]:
    code, ndim = struct.unpack_from("<2q", meta, offset)
    shape = struct.unpack_from(f"<{ndim}q", meta, offset + 16)
    dtype = _DTYPES[code]
    n = 1
    for s in shape:
        n *= s
    return TensorSpec(dtype, tuple(shape), n * dtype.itemsize), offset + 16 + 8 * ndim


def split_meta(kind: int, meta: Buffer) -> tuple[list[TensorSpec], list[int], Buffer]:
    """The tensors a meta describes, their byte offsets in the tensor part, and the rest."""
    if kind == K_TENSOR:
        spec, _ = _read_record(meta, 0)
        return [spec], [0], b""
    if kind != K_PICKLE:
        return [], [], meta
    (count,) = struct.unpack_from("<q", meta, 0)
    specs, offsets = [], []
    pos, off = 8, 0
    for _ in range(count):
        spec, pos = _read_record(meta, pos)
        specs.append(spec)
        offsets.append(off)
        off += align(spec.nbytes)
    return specs, offsets, meta[pos:]


def view_tensor(data: torch.Tensor, offset: int, spec: TensorSpec) -> torch.Tensor:
    """The tensor ``spec`` describes at ``offset`` of the uint8 ``data`` (a view, no copy)."""
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=spec.dtype, device=data.device)
    return data[offset : offset + spec.nbytes].view(spec.dtype).view(spec.shape)


def unpack(kind: int, rest: Buffer, tensors: list[torch.Tensor]) -> Any:
    """Rebuild a value from its kind, the non-tensor part of its meta, and its tensors."""
    if kind == K_TENSOR:
        return tensors[0]
    if kind == K_NONE:
        return None
    if kind == K_BOOL:
        return bool(struct.unpack("<q", rest)[0])
    if kind == K_INT:
        return struct.unpack("<q", rest)[0]
    if kind == K_FLOAT:
        return struct.unpack("<d", rest)[0]
    if kind == K_STR:
        return str(rest, "utf-8", "surrogatepass")
    _unpickling.tensors = tensors
    try:
        return pickle.loads(rest)
    finally:
        _unpickling.tensors = None
