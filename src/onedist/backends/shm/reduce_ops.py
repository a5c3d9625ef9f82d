"""What each reduce op computes on each dtype, for the shm group's reductions.

Every rank reduces in rank order (the same bits everywhere) with the functions here, and checks
an op against the dtypes before anything moves, so that a refused op leaves the group usable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._pygroup import averages, op_name
from .protocol import dtype_code

_REDUCE: dict[Any, Callable[..., Any]] = {}


def reduce_fn(op: Any, dtype: torch.dtype) -> Callable[..., Any]:
    """The elementwise function of reduce op ``op`` on ``dtype`` (see :func:`reduction`)."""
    return reduction(op, dtype)[0]


def reduction(op: Any, dtype: torch.dtype) -> tuple[Callable[..., Any], int, bool, int]:
    """Reduce op ``op`` on ``dtype``: its elementwise function (for bool tensors: SUM is or,
    PRODUCT is and; AVG is SUM, divided by the group size afterwards, see
    :func:`._pygroup.averages`), the op's number and the dtype's (for the call check, see
    ShmProcessGroup._begin), and whether it averages.

    Raises ValueError for an op the backend lacks, or one ``dtype`` cannot take (a bitwise op on
    floats, AVG on integers: gloo refuses both too). Every rank checks before anything moves, so
    the group stays usable after the error, as gloo's does. Answers are cached, and one lookup
    serves the whole call: a small collective's time is its Python calls (reading ``op.op`` off
    torch's ReduceOp alone takes 0.3 µs)."""
    kind = getattr(op, "op", op)  # a ReduceOp (options) or its RedOpType
    try:
        return _FNS[(kind, dtype)]
    except (KeyError, TypeError):
        pass
    fn = _reduce_op(kind)
    integral = dtype == torch.bool or not (dtype.is_floating_point or dtype.is_complex)
    if fn in (torch.bitwise_and, torch.bitwise_or, torch.bitwise_xor) and not integral:
        raise ValueError(
            f"onedist shm: reduce op {op_name(kind)} needs an integer or bool tensor; got dtype "
            f"{dtype} (gloo refuses it too)"
        )
    if averages(kind) and integral:
        raise ValueError(
            f"onedist shm: reduce op AVG needs a floating-point or complex tensor; got dtype {dtype} "
            "(an integer average is not an integer: use SUM and divide)"
        )
    if dtype == torch.bool and fn in (torch.add, torch.mul):
        fn = torch.logical_or if fn is torch.add else torch.logical_and
    answer = _FNS[(kind, dtype)] = (fn, int(kind), averages(kind), dtype_code(dtype))
    return answer


_FNS: dict[tuple[Any, torch.dtype], tuple[Callable[..., Any], int, bool, int]] = {}


def check_op(op: Any, tensors: Sequence[torch.Tensor]) -> None:
    """Raise, on every rank and before anything moves, when ``op`` cannot reduce one of
    ``tensors`` (see :func:`reduce_fn`)."""
    for t in tensors:
        reduce_fn(op, t.dtype)


def reduce_into(fn: Callable[..., Any], dst: torch.Tensor, sources: list[torch.Tensor]) -> None:
    """``dst = sources[0] fn sources[1] fn ...``, in that order (the same bits on every rank)."""
    if len(sources) == 1:
        dst.copy_(sources[0])
        return
    fn(sources[0], sources[1], out=dst)
    for src in sources[2:]:
        fn(dst, src, out=dst)


def _reduce_op(op: Any) -> Callable[..., Any]:
    if not _REDUCE:
        R = dist.ReduceOp
        _REDUCE.update(
            {
                R.SUM: torch.add,
                R.AVG: torch.add,
                R.PRODUCT: torch.mul,
                R.MIN: torch.minimum,
                R.MAX: torch.maximum,
                R.BAND: torch.bitwise_and,
                R.BOR: torch.bitwise_or,
                R.BXOR: torch.bitwise_xor,
            }
        )
    try:
        return _REDUCE[getattr(op, "op", op)]  # a ReduceOp (options) or its RedOpType
    except (KeyError, TypeError):
        raise ValueError(
            f"onedist shm: reduce op {op_name(op)} is not supported; SUM, AVG, PRODUCT, MIN, "
            "MAX, BAND, BOR, BXOR are"
        ) from None
