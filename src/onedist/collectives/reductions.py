"""Reductions: :func:`all_reduce` and :func:`reduce`, on tensors, numbers and nested containers."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..backends import Backend, Work
from ..context import current
from ..errors import OnedistTypeError, bad_value
from .base import (
    CHECKED_OPS,
    OP_NAMES,
    PLAIN_OPS,
    AsyncResult,
    GroupLike,
    check_op_dtype,
    check_peer,
    done,
    op_name,
    resolve_group,
)
from .guard import guarded
from .packing import FlatDict, buckets, fill, flat_dict, flatten, int_mean_wire, unfill, unflatten


# ============================================================================ reductions
@guarded("all_reduce", 2, op=(1, "SUM"))
def all_reduce(
    tensor: Any,
    op: Any = "SUM",
    group: GroupLike = None,
    *,
    async_op: bool = False,
    inplace: Optional[bool] = None,
) -> Any:
    """Reduce a value across ranks; every rank gets the result.

    Args:
        tensor: a tensor, a Python number, or a dict/list/tuple (nested) of those. A nested value
            costs one collective per (device, dtype), whatever the number of leaves. Dict keys are
            taken in sorted order, so ranks may build their dicts in any order.
        op: "SUM", "PRODUCT", "MIN", "MAX", "AND", "OR", "MEAN" (alias "AVERAGE"), case-insensitive,
            or a ``torch.distributed.ReduceOp``. MEAN of integers returns floats.
        group: None (every rank), a list of global ranks, or a group handle.
        async_op: return an :class:`AsyncResult` instead of waiting.
        inplace: where the result goes. None (default): a tensor is reduced in place and
            returned, as in ignite and torch.distributed (but for MEAN of an integer tensor,
            whose float result is a new tensor); tensors in a nested value get new tensors.
            True: write into the input tensors, nested ones too. False: leave every input as
            it is and return new tensors. Numbers are returned, never written.

    Returns:
        The reduced value, of the input's structure, types, devices and dtypes. Ranks outside
        ``group`` get their input back.

    Example:
        >>> import onedist as od
        >>> t = torch.tensor([1.0, 2.0])
        >>> od.all_reduce(t) is t                           # in place, as in ignite
        True
        >>> od.all_reduce(t, inplace=False) is t            # a new tensor; t is left as it is
        False
        >>> od.all_reduce({"loss": 0.5, "correct": 3}, op="MEAN")
        {'loss': 0.5, 'correct': 3.0}
    """
    b = current()
    opn = OP_NAMES.get(op) if op.__class__ is str else None
    if opn is None:
        opn = op_name("all_reduce", op)
    if group is None:
        # a CPU tensor the backend reduces as it is, synchronously, with a plain op: _reduce_tensor
        # takes 1.11x this path's time for a 4-byte tensor (gloo, 2 ranks; 5 interleaved runs of
        # bench_handwritten's timing with the path on and off, 2026-11-28)
        if (
            tensor.__class__ is torch.Tensor
            and not async_op
            and opn in PLAIN_OPS
            and tensor.is_cpu
            and tensor.dtype in b.cpu_reduce_dtypes
        ):
            if inplace is False:
                buf = tensor.detach().clone(memory_format=torch.contiguous_format)
                b.all_reduce_(buf, opn, None, False)
                return buf
            if tensor.is_contiguous():
                if tensor.requires_grad:  # into it all the same, as torch's c10d (off the hot path)
                    with torch.no_grad():
                        b.all_reduce_(tensor, opn, None, False)
                else:
                    b.all_reduce_(tensor, opn, None, False)
                return tensor
        cls = tensor.__class__
        # _reduce_tree takes 1.41x _reduce_number's time for a Python float (the same runs)
        if (cls is float or cls is int) and not async_op and opn in _NUMBER_OPS:
            number = _reduce_number(b, tensor, opn)
            if number is not None:
                return number
        g, size = None, b.world_size
    else:
        g, me, ranks = resolve_group("all_reduce", b, group)
        if me < 0:
            return done(tensor, async_op)
        size = len(ranks)
    return _reduce(b, "all_reduce", tensor, opn, g, size, None, async_op, inplace)


_NUMBER_OPS = PLAIN_OPS | {"MEAN"}


def _reduce_number(b: Backend, x: Any, op: str) -> Any:
    """A Python float or int (a logged ``loss.item()``) as a torch user reduces one by hand: a
    one-element float64 (int64) tensor, one all_reduce, ``item()``. The general way issues that
    same collective (ranks may take either way) after its flatten and bucket work, a quarter of
    the call's time on gloo (issue 40). None: the general way takes it (an int beyond int64,
    which it refuses by name; a backend that reduces off the CPU)."""
    dtype = torch.float64 if x.__class__ is float else torch.int64
    if dtype not in b.cpu_reduce_dtypes:
        return None
    try:
        buf = torch.tensor([x], dtype=dtype)
    except (OverflowError, RuntimeError, ValueError):  # beyond int64, as packing's fill finds
        return None
    b.all_reduce_(buf, "SUM" if op == "MEAN" else op, None, False)
    value = buf.item()
    return float(value) / b.world_size if op == "MEAN" else value  # the general way's float64 division


@guarded("reduce", 3, dst=(1, 0), op=(2, "SUM"))
def reduce(
    tensor: Any,
    dst: int = 0,
    op: Any = "SUM",
    group: GroupLike = None,
    *,
    async_op: bool = False,
) -> Any:
    """Reduce a value across ranks onto global rank ``dst``.

    Args:
        tensor: as for :func:`all_reduce`.
        dst: global rank that receives the result.
        op: as for :func:`all_reduce`.
        group: as for :func:`all_reduce`.
        async_op: return an :class:`AsyncResult` instead of waiting.

    Returns:
        On ``dst`` the reduced value; on the other ranks their input, unchanged.

    Example:
        >>> import onedist as od
        >>> total = od.reduce(torch.tensor(3), dst=0)   # the sum on rank 0
    """
    b = current()
    opn = op_name("reduce", op)
    g, me, ranks = resolve_group("reduce", b, group)
    check_peer("reduce", "dst", dst, b, ranks)
    if me < 0:
        return done(tensor, async_op)
    return _reduce(b, "reduce", tensor, opn, g, len(ranks), dst, async_op, False)


def _reduce(
    b: Backend,
    func: str,
    x: Any,
    op: str,
    g: Any,
    size: int,
    dst: Optional[int],
    async_op: bool,
    inplace: Optional[bool],
) -> Any:
    """all_reduce (``dst`` None) or reduce of a tensor or of a nested value; ``inplace`` None:
    a tensor in place when its result fits it, a nested value's tensors not."""
    if isinstance(x, torch.Tensor):
        if inplace is None:  # in place when the result fits: a float mean of integers does not,
            # nor an expanded tensor whose elements share memory (one write would hit several)
            fits = op != "MEAN" or x.dtype.is_floating_point or x.dtype.is_complex
            inplace = fits and (x.is_contiguous() or not _overlaps(x))
        return _reduce_tensor(b, func, x, op, g, size, dst, async_op, inplace)
    # two dicts of metrics skip _reduce_tree's per-leaf work: it takes 1.32x _reduce_numbers' time
    # for 100 Python floats and 1.19x _reduce_stacked's for 100 0-dim tensors (the same runs)
    if not async_op and op in _DICT_OPS and not inplace:
        flat = flat_dict(x)
        if flat is not None and flat.dtype is not None:
            return _reduce_numbers(b, func, x, flat, op, g, size, dst)
        if flat is not None:
            stacked = _reduce_stacked(b, func, x, flat, op, g, size, dst)
            if stacked is not None:
                return stacked
    return _reduce_tree(b, func, x, op, g, size, dst, async_op, bool(inplace))


_DICT_OPS = frozenset({"SUM", "MEAN", "MIN", "MAX", "PRODUCT"})


def _reduce_stacked(
    b: Backend,
    func: str,
    d: dict[Any, Any],
    flat: FlatDict,
    op: str,
    g: Any,
    size: int,
    dst: Optional[int],
) -> Any:
    """A dict of CPU tensors of one dtype and shape (0-dim metrics), stacked into one buffer, as
    :func:`_reduce_tree` does it but for its flatten and bucket bookkeeping (100 metrics: ~30 us
    of ~110). None when the general path must take it (shapes differ, an integer MEAN)."""
    values = flat.values
    dtype = values[0].dtype
    if op == "MEAN" and not (dtype.is_floating_point or dtype.is_complex):
        return None  # a float result of integers: the general path's conversions
    check_op_dtype(func, op, dtype, " (leaf 0)")  # every leaf has that dtype
    try:
        buf = torch.stack(values)
    except RuntimeError:  # shapes or devices differ
        return None
    if not buf.is_cpu:
        return None
    if buf.requires_grad:  # results are not differentiable, as in torch.distributed (a detach
        buf = buf.detach()  # here, not no_grad around it all: ~2 us a call on the common path)
    reduced = _reduce_on_wire(b, buf, op, g, dst)
    if reduced is None:
        return d
    if op == "MEAN":
        reduced.div_(size)
    if reduced is not buf and (reduced.device != buf.device or reduced.dtype != dtype):
        reduced = reduced.to(device=buf.device, dtype=dtype)
    return _in_dict_order(d, flat, reduced.unbind(0))


def _reduce_numbers(
    b: Backend,
    func: str,
    d: dict[Any, Any],
    flat: FlatDict,
    op: str,
    g: Any,
    size: int,
    dst: Optional[int],
) -> Any:
    """A dict of floats, or of ints (a step's metrics), in one buffer with no per-leaf work:
    what :func:`_reduce_tree` does for it, at half its cost (100 metrics: ~20 us less)."""
    dtype = flat.dtype
    try:
        buf = torch.tensor(flat.values, dtype=dtype)
    except (OverflowError, RuntimeError, ValueError) as e:
        raise bad_value(func, "tensor", flat.values, "numbers that fit in int64 / float64") from e
    reduced = _reduce_on_wire(b, buf, op, g, dst)
    if reduced is None:
        return d
    if op == "MEAN":  # of ints too: floats, as _reduce_tree gives
        reduced = reduced.double() / size if dtype == torch.int64 else reduced.div_(size)
    elif reduced.dtype != dtype:
        reduced = reduced.to(dtype)
    return _in_dict_order(d, flat, reduced.tolist())


def _in_dict_order(d: dict[Any, Any], flat: FlatDict, results: Any) -> dict[Any, Any]:
    """The results (in sorted key order) as a dict in ``d``'s own key order."""
    by_key = dict(zip(flat.keys, results))
    return by_key if flat.in_order else {k: by_key[k] for k in d}


def _reduce_on_wire(
    b: Backend, buf: torch.Tensor, op: str, g: Any, dst: Optional[int]
) -> Optional[torch.Tensor]:
    """``buf`` reduced on the backend's device and dtype (a new tensor when it had to move);
    None on a rank that is not ``dst``."""
    if not (buf.is_cpu and buf.dtype in b.cpu_reduce_dtypes):  # those reduce as they are
        dev, wire = b.comm_device(buf.device, "all_reduce"), b.reduce_dtype(buf.dtype)
        if buf.device != dev or wire != buf.dtype:
            buf = buf.to(device=dev, dtype=wire)
    _issue(b, buf, op, g, dst, False)
    return None if dst is not None and dst != b.rank else buf


def _overlaps(x: torch.Tensor) -> bool:
    """Whether elements of ``x`` share memory (an ``expand``ed view)."""
    return any(stride == 0 and n > 1 for stride, n in zip(x.stride(), x.shape))


def _issue(
    b: Backend, buf: torch.Tensor, op: str, g: Any, dst: Optional[int], async_op: bool
) -> Optional[Work]:
    op = "SUM" if op == "MEAN" else op
    if buf.requires_grad:  # a reduction into a tensor that requires grad, as torch's c10d allows
        with torch.no_grad():
            return _issue_now(b, buf, op, g, dst, async_op)
    return _issue_now(b, buf, op, g, dst, async_op)


def _issue_now(
    b: Backend, buf: torch.Tensor, op: str, g: Any, dst: Optional[int], async_op: bool
) -> Optional[Work]:
    if dst is None:
        return b.all_reduce_(buf, op, g, async_op)
    return b.reduce_(buf, dst, op, g, async_op)


def _reduce_tensor(
    b: Backend,
    func: str,
    x: torch.Tensor,
    op: str,
    g: Any,
    size: int,
    dst: Optional[int],
    async_op: bool,
    inplace: bool,
) -> Any:
    # the hot path of the library: every attribute is read once and the common case
    # (same device and dtype on the wire, synchronous) takes no detour
    dtype, device = x.dtype, x.device
    if op in CHECKED_OPS or dtype.is_complex:
        check_op_dtype(func, op, dtype)
    dev = b.comm_device(device, "all_reduce")
    mean_int = op == "MEAN" and not (dtype.is_floating_point or dtype.is_complex)
    # the mean of integers/bools: summed in int64 (or float64), divided in float64
    wire = int_mean_wire(dtype) if mean_int else b.reduce_dtype(dtype)
    same = dev == device and wire == dtype
    if inplace and mean_int:
        raise OnedistTypeError(
            f"onedist.{func}: op='MEAN' with inplace=True needs a floating-point tensor, got {dtype} "
            "(the mean of integers is not an integer)\nHINT: drop inplace=True to get a float result"
        )
    if inplace and same and x.is_contiguous():
        buf = x
    elif same:  # results are not differentiable, as in torch.distributed
        buf = x.detach().clone(memory_format=torch.contiguous_format)
    else:
        buf = x.detach().to(device=dev, dtype=wire, copy=True, memory_format=torch.contiguous_format)
    work = _issue(b, buf, op, g, dst, async_op)
    if not async_op and op != "MEAN" and same and not inplace and (dst is None or dst == b.rank):
        return buf

    def finish() -> torch.Tensor:
        if dst is not None and dst != b.rank:
            return x
        out = buf
        if op == "MEAN":
            out = (out.double() / size).to(torch.get_default_dtype()) if mean_int else out.div_(size)
        if inplace:
            if out is not x:
                with torch.no_grad():  # a leaf that requires grad takes the result, as in torch
                    x.copy_(out)
            return x
        if out.device != device or (out.dtype != dtype and not mean_int):
            out = out.to(device=device, dtype=out.dtype if mean_int else dtype)
        return out

    if async_op:
        return AsyncResult([work], finish)
    return finish()


def _reduce_tree(
    b: Backend,
    func: str,
    obj: Any,
    op: str,
    g: Any,
    size: int,
    dst: Optional[int],
    async_op: bool,
    inplace: bool,
) -> Any:
    leaves: list[Any] = []
    spec = flatten(func, obj, leaves, ())
    packed = buckets(func, leaves, op)
    if inplace and op == "MEAN":
        for bucket in packed:
            if bucket.tensors and not (bucket.dtype.is_floating_point or bucket.dtype.is_complex):
                raise OnedistTypeError(
                    f"onedist.{func}: op='MEAN' with inplace=True needs floating-point tensors, got "
                    f"{bucket.dtype} (leaf {bucket.leaf_ids[0]})\n"
                    "HINT: drop inplace=True to get float results"
                )
    works: list[Optional[Work]] = []
    with torch.no_grad():  # results are not differentiable, as in torch.distributed
        for bucket in packed:
            bucket.buf = fill(func, b, bucket, leaves, op)
            works.append(_issue(b, bucket.buf, op, g, dst, async_op))
    is_dst = dst is None or dst == b.rank

    def finish() -> Any:
        if not is_dst:
            return obj
        results: list[Any] = [None] * len(leaves)
        for bucket in packed:
            unfill(bucket, leaves, results, op, size, inplace)
        return unflatten(spec, iter(results))

    if async_op:
        return AsyncResult(works, finish)
    return finish()
