"""How tensors travel through mpi4py (:mod:`.mpi`): MPI datatypes and reduce ops for torch's,
buffers over a tensor's memory, and the widening of types MPI cannot reduce as they are."""

from __future__ import annotations

from functools import cache
from itertools import accumulate
from typing import Any, Optional

import torch
import torch.distributed as dist

from ._pygroup import flat as _flat, op_name


def mpi() -> Any:
    from mpi4py import MPI

    return MPI


class MpiError(RuntimeError):
    """An argument MPI cannot take (an unsupported reduce op or dtype), or a barrier that timed out."""


@cache
def datatypes() -> dict[torch.dtype, Any]:
    MPI = mpi()
    return {
        torch.float32: MPI.FLOAT,
        torch.float64: MPI.DOUBLE,
        torch.int8: MPI.INT8_T,
        torch.int16: MPI.INT16_T,
        torch.int32: MPI.INT32_T,
        torch.int64: MPI.INT64_T,
        torch.uint8: MPI.UINT8_T,
        torch.uint16: MPI.UINT16_T,
        torch.uint32: MPI.UINT32_T,
        torch.uint64: MPI.UINT64_T,
        torch.complex64: MPI.C_FLOAT_COMPLEX,
        torch.complex128: MPI.C_DOUBLE_COMPLEX,
    }


WIDEN = {torch.float16: torch.float32, torch.bfloat16: torch.float32}
# Open MPI 4.1's AVX reduction kernels saturate 8- and 16-bit integer sums (255 + 1 = 255), where
# torch and gloo wrap: these reduce in a wider type (the low bits of a wrapped sum or product are
# the same) and are cast back
WIDEN_ARITH = {
    torch.int8: torch.int32,
    torch.uint8: torch.int32,
    torch.int16: torch.int64,
    torch.uint16: torch.int64,
}


#: (torch's reduce op, dtype) -> the MPI op found for it (looked up on every reduction)
_FOUND: dict[tuple[Any, torch.dtype], Any] = {}


def mpi_op(op: Any, dtype: torch.dtype) -> Any:
    """The MPI reduce op of torch's ``op`` for ``dtype`` (bool travels as uint8)."""
    kind = getattr(op, "op", op)  # a ReduceOp (options) or its RedOpType
    try:
        return _FOUND[(kind, dtype)]
    except (KeyError, TypeError):
        pass
    found = _find_mpi_op(kind, dtype)
    _FOUND[(kind, dtype)] = found
    return found


def _find_mpi_op(kind: Any, dtype: torch.dtype) -> Any:
    MPI = mpi()
    R = dist.ReduceOp
    if kind == R.AVG:  # MPI has no average: a SUM, divided by the group size after it (_pygroup.averages)
        if not (dtype.is_floating_point or dtype.is_complex):
            raise MpiError(
                f"onedist mpi: reduce op AVG needs a floating-point or complex tensor; got dtype {dtype} "
                "(an integer average is not an integer: use SUM and divide)"
            )
        kind = R.SUM
    if dtype == torch.bool:
        table = {R.SUM: MPI.MAX, R.MAX: MPI.MAX, R.BOR: MPI.BOR, R.PRODUCT: MPI.MIN, R.MIN: MPI.MIN}
        table[R.BAND] = MPI.BAND
        table[R.BXOR] = MPI.BXOR
    else:
        table = {
            R.SUM: MPI.SUM,
            R.PRODUCT: MPI.PROD,
            R.MIN: MPI.MIN,
            R.MAX: MPI.MAX,
            R.BAND: MPI.BAND,
            R.BOR: MPI.BOR,
            R.BXOR: MPI.BXOR,
        }
    try:
        found = table[kind]
    except (KeyError, TypeError):
        raise MpiError(
            f"onedist mpi: reduce op {op_name(kind)} is not supported; SUM, AVG, PRODUCT, MIN, MAX, BAND, "
            "BOR, BXOR are"
        ) from None
    if dtype.is_complex and kind in (R.MIN, R.MAX):
        raise MpiError(f"onedist mpi: reduce op {op_name(kind)} is not defined for complex dtype {dtype}")
    if dtype.is_floating_point and kind in (R.BAND, R.BOR, R.BXOR):
        raise MpiError(
            f"onedist mpi: reduce op {op_name(kind)} needs an integer or bool tensor; got dtype {dtype}"
        )
    return found


def on_wire(t: torch.Tensor, op: Any = None) -> tuple[torch.Tensor, Any, bool]:
    """``(tensor for MPI, its MPI datatype, True when it is a copy to write back)`` for reduction ``op``."""
    wide = WIDEN.get(t.dtype)
    R = dist.ReduceOp
    if wide is None and getattr(op, "op", op) in (R.SUM, R.PRODUCT, R.AVG):
        wide = WIDEN_ARITH.get(t.dtype)
    if wide is not None:
        return t.reshape(-1).to(wide), datatypes()[wide], True
    if t.dtype == torch.bool:
        flat, copied = _flat(t)
        return flat.view(torch.uint8), mpi().UINT8_T, copied
    try:
        dt = datatypes()[t.dtype]
    except KeyError:
        raise MpiError(f"onedist mpi: dtype {t.dtype} cannot be reduced") from None
    flat, copied = _flat(t)
    return flat, dt, copied


SCRATCH = torch.zeros(8, dtype=torch.uint8)  # the address of a zero-length buffer


def buf(t: torch.Tensor, count: Optional[int] = None, datatype: Any = None) -> list[Any]:
    """An MPI buffer spec over ``t``'s memory: ``[memory, count, datatype]`` (bytes by default)."""
    MPI = mpi()
    nbytes = t.numel() * t.element_size()
    base = t if nbytes else SCRATCH
    mem = MPI.buffer.fromaddress(base.data_ptr(), nbytes)
    if datatype is None:
        return [mem, nbytes, MPI.BYTE]
    return [mem, t.numel() if count is None else count, datatype]


def displacements(counts: list[int]) -> list[int]:
    """Where each rank's part starts in a v-collective's buffer (the running sum of ``counts``)."""
    return list(accumulate(counts, initial=0))[:-1]


def as_bytes(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A contiguous uint8 view of ``t`` (or of a contiguous copy: then True)."""
    flat, copied = _flat(t)
    return flat.view(torch.uint8), copied
