"""Collectives on tensors, Python numbers, strings, any picklable object, and nested containers.

This is the only place where Python values become tensors and back: a backend only sees
contiguous tensors on its communication device.

* Reductions (:func:`all_reduce`, :func:`reduce`) take tensors, numbers and dicts/lists/tuples of
  those. A nested value is reduced in **one collective per (device, dtype)**, not one per leaf.
  Python floats travel as float64 and ints as int64, so they come back exact.
* Data movement (:func:`all_gather`, :func:`broadcast`, :func:`gather`, :func:`scatter`) takes
  anything picklable; tensors inside travel as raw bytes. Sizes are negotiated in a fixed-size
  first round that also carries small values, so an object, a string, a number or a small tensor
  costs one collective, and tensors whose first dimension differs per rank need no padding
  (see :mod:`onedist._wire`).
* Inputs are never modified unless the function says in-place; results come back on the
  caller's device and dtype.
* ``group`` is None (every rank), a list of global ranks (the group is created once and cached)
  or a group handle. Ranks outside the group get their input back unchanged.
"""

from __future__ import annotations

import copy
import numbers
import pickle
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from itertools import islice, pairwise
from operator import attrgetter
from pathlib import PurePath
from typing import Any, Optional, Union

import torch

from . import _wire as W
from ._guard import guarded
from .backends import Backend, Work
from .backends.base import NATIVE_REDUCE_DTYPES
from .context import _state, current
from .errors import (
    CollectiveMismatchError,
    OnedistTypeError,
    RemoteRankError,
    bad_type,
    bad_value,
)

__all__ = [
    "AsyncResult",
    "all_gather",
    "all_gather_object",
    "all_gather_tensors_with_shapes",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_object",
    "gather",
    "irecv",
    "isend",
    "new_group",
    "recv",
    "reduce",
    "scatter",
    "send",
]

_CPU = torch.device("cpu")
_U8 = torch.uint8

_OP_NAMES = {
    "SUM": "SUM",
    "PRODUCT": "PRODUCT",
    "PROD": "PRODUCT",
    "MIN": "MIN",
    "MAX": "MAX",
    "AND": "AND",
    "BAND": "AND",
    "OR": "OR",
    "BOR": "OR",
    "MEAN": "MEAN",
    "AVERAGE": "MEAN",
    "AVG": "MEAN",
}
_ALLOWED_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AND", "OR", "MEAN")
_CHECKED_OPS = frozenset({"AND", "OR"})
_PLAIN_OPS = frozenset({"SUM", "PRODUCT", "MIN", "MAX"})  # ops with dtype restrictions beyond complex numbers

GroupLike = Union[None, Sequence[int], Any]


# ============================================================================ arguments
def _op_name(func: str, op: Any) -> str:
    name = _OP_NAMES.get(op) if isinstance(op, str) else None
    if name is None:
        if isinstance(op, str):
            name = _OP_NAMES.get(op.upper())
        elif op is not None:  # torch.distributed.ReduceOp / RedOpType
            name = _OP_NAMES.get(str(getattr(op, "name", op)).rsplit(".", 1)[-1].upper())
        if name is None:
            raise bad_value(
                func, "op", op, (*_ALLOWED_OPS, "AVERAGE"), says="Unsupported reduction operation"
            )
    return name


def _check_op_dtype(func: str, op: str, dtype: torch.dtype, where: str = "") -> None:
    if op in ("AND", "OR") and (dtype.is_floating_point or dtype.is_complex):
        raise OnedistTypeError(
            f"onedist.{func}: op={op!r} needs bool or integer values, got dtype {dtype}{where}\n"
            "HINT: use MIN/MAX for a logical AND/OR of 0./1. floats, or convert with .bool()"
        )
    if dtype.is_complex and op not in ("SUM", "MEAN"):
        raise OnedistTypeError(f"onedist.{func}: op={op!r} is not defined for complex dtype {dtype}{where}")


# ignite's words for a group argument that is not one, which its users' code may match on
_IGNITE_BAD_RANKS = {
    "ranks": "Argument ranks should be list of int",
    "group": "Argument group should be list of int or ProcessGroup",
}


def _check_ranks(func: str, arg: str, ranks: Any, world_size: int, empty: bool = False) -> tuple[int, ...]:
    """The sorted, distinct global ranks of ``ranks``; ``empty``: [] is allowed (it stays ())."""
    says = _IGNITE_BAD_RANKS[arg]
    if not isinstance(ranks, (list, tuple, range)) or (len(ranks) == 0 and not empty):
        raise bad_value(func, arg, ranks, "a non-empty list of global ranks", says=says)
    seen = set()
    for r in ranks:
        if not isinstance(r, int) or isinstance(r, bool):
            raise bad_value(func, arg, list(ranks), f"ints in 0..{world_size - 1} ({r!r} is not)", says=says)
        if not 0 <= r < world_size:
            raise bad_value(
                func, arg, list(ranks), f"ranks in 0..{world_size - 1} (rank {r} is out of range)"
            )
        if r in seen:
            raise bad_value(func, arg, list(ranks), f"distinct ranks (rank {r} appears twice)")
        seen.add(r)
    return tuple(sorted(seen))


def _check_peer(func: str, arg: str, value: Any, b: Backend, ranks: Optional[Sequence[int]]) -> None:
    """Validate a global ``src``/``dst``; ``ranks``: the group's ranks (None: the world, (): unknown)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad_type(func, arg, value, "int (a global rank)")
    if not 0 <= value < b.world_size:
        raise bad_value(func, arg, value, f"a global rank in 0..{b.world_size - 1}")
    if ranks and value not in ranks:
        raise bad_value(func, arg, value, f"a rank of the group {list(ranks)}")


# ============================================================================ async results
class AsyncResult:
    """What a collective called with ``async_op=True`` returns.

    :meth:`wait` blocks until the communication is done and returns the same value the
    synchronous call would have returned.

    Example:
        >>> import onedist as od
        >>> handle = od.all_reduce(torch.ones(3), async_op=True)
        >>> # ... overlap computation here ...
        >>> handle.wait()
        tensor([1., 1., 1.])
    """

    __slots__ = ("_done", "_finish", "_result", "_works")

    def __init__(self, works: list[Optional[Work]], finish: Callable[[], Any]) -> None:
        self._works = [w for w in works if w is not None]
        self._finish = finish
        self._done = False
        self._result: Any = None

    def is_completed(self) -> bool:
        """True when :meth:`wait` would not block."""
        return self._done or all(w.is_completed() for w in self._works)  # type: ignore[attr-defined]

    def wait(self) -> Any:
        """Wait for the communication and return the collective's result."""
        if not self._done:
            with torch.no_grad():  # a backend may copy into the caller's tensors here
                for w in self._works:
                    w.wait()
                self._result = self._finish()
            self._done = True
            self._works = []
        return self._result


def _done(value: Any, async_op: bool) -> Any:
    return AsyncResult([], lambda: value) if async_op else value


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
    b = _state.backend
    if b.is_stale():
        b = current()
    opn = _OP_NAMES.get(op) if op.__class__ is str else None
    if opn is None:
        opn = _op_name("all_reduce", op)
    if group is None:
        # fast path: a CPU tensor the backend reduces as it is, synchronously, with a plain op
        if (
            tensor.__class__ is torch.Tensor
            and not async_op
            and opn in _PLAIN_OPS
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
        g, size = None, b.world_size
    else:
        g, me, ranks = _members("all_reduce", b, group)
        if me < 0:
            return _done(tensor, async_op)
        size = len(ranks)
    return _reduce(b, "all_reduce", tensor, opn, g, size, None, async_op, inplace)


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
    opn = _op_name("reduce", op)
    g, me, ranks = _members("reduce", b, group)
    _check_peer("reduce", "dst", dst, b, ranks)
    if me < 0:
        return _done(tensor, async_op)
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
    return _reduce_tree(b, func, x, op, g, size, dst, async_op, bool(inplace))


def _overlaps(x: torch.Tensor) -> bool:
    """Whether elements of ``x`` share memory (an ``expand``ed view)."""
    return any(stride == 0 and n > 1 for stride, n in zip(x.stride(), x.shape))


def _issue(
    b: Backend, buf: torch.Tensor, op: str, g: Any, dst: Optional[int], async_op: bool
) -> Optional[Work]:
    op = "SUM" if op == "MEAN" else op
    with torch.no_grad():  # a reduction into a tensor that requires grad, as torch's c10d allows
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
    if op in _CHECKED_OPS or dtype.is_complex:
        _check_op_dtype(func, op, dtype)
    dev = b.comm_device(device, "all_reduce")
    mean_int = op == "MEAN" and not (dtype.is_floating_point or dtype.is_complex)
    # the mean of integers/bools: sum in int64 (no wrap-around, no bool saturation), divide in float64
    wire = torch.int64 if mean_int else b.reduce_dtype(dtype)
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


# ---------------------------------------------------------------------------- nested reductions
_KEY_ORDERS: dict[tuple[Any, ...], list[Any]] = {}  # a dict's keys (insertion order) -> sorted


def _sorted_keys(m: Mapping[Any, Any]) -> list[Any]:
    """The keys in sorted order (insertion order if they cannot be sorted), cached per key set:
    metric dicts come back with the same keys on every step."""
    keys = tuple(m)
    keys = (*keys, *map(type, keys))  # True == 1 == 1.0: the types keep such key sets apart
    try:
        order = _KEY_ORDERS.get(keys)
    except TypeError:  # unhashable key tuple
        order = None
    if order is None:
        names = keys[: len(keys) // 2]
        try:
            order = sorted(names)
        except TypeError:
            order = list(names)
        if len(_KEY_ORDERS) >= 256:
            _KEY_ORDERS.clear()
        try:
            _KEY_ORDERS[keys] = order
        except TypeError:
            pass
    return order


_LEAF_TYPES = (torch.Tensor, float, int)  # bool is an int
_EXACT_LEAF_TYPES = frozenset({torch.Tensor, float, int, bool})
_get_dtype, _get_device, _is_cpu = attrgetter("dtype"), attrgetter("device"), attrgetter("is_cpu")


def _is_leaf(v: Any) -> bool:
    return isinstance(v, _LEAF_TYPES) or (isinstance(v, numbers.Number) and not isinstance(v, complex))


def _flatten(func: str, obj: Any, leaves: list[Any], path: tuple[Any, ...]) -> Any:
    """Append the leaves of ``obj`` (tensors and numbers) to ``leaves``; return its spec.

    A spec is None for a leaf, ("m", mapping, keys, children) or ("s", sequence, children);
    ``children`` is None when every child is a leaf (the common flat dict of metrics).
    """
    if _is_leaf(obj):
        leaves.append(obj)
        return None
    if isinstance(obj, Mapping):
        keys = _sorted_keys(obj)
        values = [obj[k] for k in keys]
        if set(map(type, values)) <= _EXACT_LEAF_TYPES:
            leaves.extend(values)
            return ("m", obj, keys, None)
        return ("m", obj, keys, [_flatten(func, v, leaves, (*path, k)) for k, v in zip(keys, values)])
    if isinstance(obj, (list, tuple)):
        if set(map(type, obj)) <= _EXACT_LEAF_TYPES:
            leaves.extend(obj)
            return ("s", obj, None)
        return ("s", obj, [_flatten(func, v, leaves, (*path, i)) for i, v in enumerate(obj)])
    where = "tensor" + "".join(f"[{p!r}]" for p in path)
    raise bad_type(
        func,
        where,
        obj,
        "a tensor, a number, or a dict/list/tuple of those",
        hint="strings and other objects cannot be reduced; use all_gather or broadcast_object for them",
        says="Unhandled input type",
    )


def _unflatten(spec: Any, values: Iterator[Any]) -> Any:
    if spec is None:
        return next(values)
    if spec[0] == "m":
        _, orig, keys, children = spec
        if children is None:
            by_key = dict(zip(keys, islice(values, len(keys))))
        else:
            by_key = {k: _unflatten(c, values) for k, c in zip(keys, children)}
        if type(orig) is dict:
            return by_key if keys == list(orig) else {k: by_key[k] for k in orig}
        new = copy.copy(orig)
        for k in orig:
            new[k] = by_key[k]
        return new
    _, orig, children = spec
    if children is None:
        items = list(islice(values, len(orig)))
    else:
        items = [_unflatten(c, values) for c in children]
    if type(orig) is list:
        return items
    if type(orig) is tuple:
        return tuple(items)
    if hasattr(orig, "_fields"):  # namedtuple
        return type(orig)._make(items)
    if isinstance(orig, list):
        new = copy.copy(orig)
        new[:] = items
        return new
    return type(orig)(items)


class _Bucket:
    """Leaves reduced in one buffer: tensors of one (device, dtype), and Python numbers of that kind.

    Buckets are keyed by the leaves' own device and dtype, so the buffer is built with one
    ``torch.stack`` (leaves of one shape, e.g. scalar metrics) or one ``torch.cat``, and results go
    back to the leaves' dtype and device with one conversion per bucket.
    """

    __slots__ = ("buf", "device", "dtype", "leaf_ids", "py_ids", "py_kind", "stacked", "tensors")

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        self.tensors: list[torch.Tensor] = []
        self.leaf_ids: list[int] = []
        self.py_ids: list[int] = []  # leaf indices of the Python numbers, first in the buffer
        self.py_kind = ""
        self.stacked = False
        self.buf: Optional[torch.Tensor] = None


_PY_DTYPES = {"f": torch.float64, "i": torch.int64, "b": torch.bool}


def _buckets(func: str, leaves: list[Any], op: str) -> list[_Bucket]:
    buckets: dict[tuple[torch.device, torch.dtype], _Bucket] = {}
    # comprehensions rather than one loop: this runs per call on every leaf (100 metrics: ~10 us)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    if set(map(type, leaves)) == {torch.Tensor}:
        t_ids = list(range(len(leaves)))
        dtypes = set(map(_get_dtype, leaves))
        if len(dtypes) == 1 and (all(map(_is_cpu, leaves)) or len(set(map(_get_device, leaves))) == 1):
            groups = {(leaves[0].device, dtypes.pop()): t_ids}
    else:
        t_ids = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    if t_ids and not groups:
        keys = [(leaves[i].device, leaves[i].dtype) for i in t_ids]
        if keys.count(keys[0]) == len(keys):
            groups = {keys[0]: t_ids}
        else:
            groups = {}
            for i, key in zip(t_ids, keys):
                groups.setdefault(key, []).append(i)
    for key, ids in groups.items():
        _check_op_dtype(func, op, key[1], f" (leaf {ids[0]})")
        bucket = buckets[key] = _Bucket(*key)
        bucket.leaf_ids = ids
        bucket.tensors = leaves if len(ids) == len(leaves) else [leaves[i] for i in ids]
    if len(t_ids) == len(leaves):
        return list(buckets.values())
    py: dict[str, list[int]] = {}
    logical = op in ("AND", "OR", "MIN", "MAX")
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            continue
        if isinstance(leaf, bool):
            py.setdefault("b" if logical else "i", []).append(i)
        elif isinstance(leaf, numbers.Integral):
            py.setdefault("i", []).append(i)
        else:
            if op in ("AND", "OR"):
                raise OnedistTypeError(
                    f"onedist.{func}: op={op!r} needs bool or int values, got the float {leaf!r} (leaf {i})"
                )
            py.setdefault("f", []).append(i)
    for kind, ids in py.items():
        key = (_CPU, _PY_DTYPES[kind])
        if key not in buckets:
            buckets[key] = _Bucket(*key)
        buckets[key].py_kind, buckets[key].py_ids = kind, ids
    return list(buckets.values())


def _fill(func: str, b: Backend, bucket: _Bucket, leaves: list[Any], op: str = "SUM") -> torch.Tensor:
    """The bucket's reduction buffer: a new contiguous 1-D tensor on the communication device."""
    parts: list[torch.Tensor] = []
    if bucket.py_ids:
        values = [leaves[i] for i in bucket.py_ids]
        try:
            parts.append(torch.tensor(values, dtype=bucket.dtype))
        except (OverflowError, RuntimeError, ValueError) as e:
            raise bad_value(func, "tensor", values, "numbers that fit in int64 / float64") from e
    tensors = bucket.tensors
    if tensors:
        if not parts:
            try:  # one shape (scalar metrics, same-size tensors): one C call, no Python loop
                parts.append(torch.stack(tensors).view(-1))
                bucket.stacked = True
            except RuntimeError:  # shapes differ
                pass
        if not bucket.stacked:
            parts.extend(t.reshape(-1) for t in tensors)
    buf = parts[0] if len(parts) == 1 and (bucket.stacked or not tensors) else torch.cat(parts)
    dev = b.comm_device(bucket.device, "all_reduce")
    integral = not (bucket.dtype.is_floating_point or bucket.dtype.is_complex)
    wire = torch.int64 if op == "MEAN" and integral else b.reduce_dtype(bucket.dtype)
    if buf.device != dev or buf.dtype != wire:
        buf = buf.to(device=dev, dtype=wire)
    return buf


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
    spec = _flatten(func, obj, leaves, ())
    buckets = _buckets(func, leaves, op)
    if inplace and op == "MEAN":
        for bucket in buckets:
            if bucket.tensors and not (bucket.dtype.is_floating_point or bucket.dtype.is_complex):
                raise OnedistTypeError(
                    f"onedist.{func}: op='MEAN' with inplace=True needs floating-point tensors, got "
                    f"{bucket.dtype} (leaf {bucket.leaf_ids[0]})\n"
                    "HINT: drop inplace=True to get float results"
                )
    works: list[Optional[Work]] = []
    with torch.no_grad():  # results are not differentiable, as in torch.distributed
        for bucket in buckets:
            bucket.buf = _fill(func, b, bucket, leaves, op)
            works.append(_issue(b, bucket.buf, op, g, dst, async_op))
    is_dst = dst is None or dst == b.rank

    def finish() -> Any:
        if not is_dst:
            return obj
        results: list[Any] = [None] * len(leaves)
        for bucket in buckets:
            _unfill(bucket, leaves, results, op, size, inplace)
        return _unflatten(spec, iter(results))

    if async_op:
        return AsyncResult(works, finish)
    return finish()


def _unfill(
    bucket: _Bucket, leaves: list[Any], results: list[Any], op: str, size: int, inplace: bool
) -> None:
    """Put the reduced values of one bucket into ``results`` (in leaf order)."""
    out = bucket.buf
    assert out is not None
    integral = not (bucket.dtype.is_floating_point or bucket.dtype.is_complex)
    mean_int = op == "MEAN" and integral
    if op == "MEAN":
        if mean_int:  # Python numbers stay float64; tensors get torch's default float dtype
            out = out.double() / size
            if bucket.tensors and not bucket.py_ids:
                out = out.to(torch.get_default_dtype())
        else:
            out = out.div_(size)
    if out.device != bucket.device or (out.dtype != bucket.dtype and not mean_int):
        out = out.to(device=bucket.device, dtype=out.dtype if mean_int else bucket.dtype)
    offset = len(bucket.py_ids)
    if offset:
        values = out[:offset].tolist()
        if bucket.py_kind == "b":
            values = [bool(v) for v in values]
        for i, v in zip(bucket.py_ids, values):
            results[i] = v
    if not bucket.tensors:
        return
    if bucket.stacked:
        pieces: Any = out.view(len(bucket.tensors), *bucket.tensors[0].shape).unbind(0)
    else:
        numels = [t.numel() for t in bucket.tensors]
        pieces = [p.view(t.shape) for p, t in zip(torch.split(out[offset:], numels), bucket.tensors)]
    if inplace:
        with torch.no_grad():
            for leaf, piece in zip(bucket.tensors, pieces):
                leaf.copy_(piece)
        pieces = bucket.tensors
    if len(bucket.leaf_ids) == len(results):  # the only bucket: leaves in order
        results[:] = pieces
        return
    for i, piece in zip(bucket.leaf_ids, pieces):
        results[i] = piece


# ============================================================================ data movement
class _Channels:
    """Where packed bytes travel: the object channel (CPU bytes, gloo-capable group) and the
    tensor channel (the backend's device). On gloo they are one and the same."""

    __slots__ = ("b", "g", "merged", "og", "size", "slot", "tdev")

    def __init__(self, b: Backend, g: Any, op: str, size: int) -> None:
        self.b, self.g, self.size = b, g, size
        self.og = b.object_group(g)
        self.tdev = b.comm_device(_CPU, op)
        self.merged = self.tdev.type == "cpu" and self.og is g
        self.slot = W.slot_size(size)


def _pack_or_error(
    func: str, value: Any, ch: _Channels, slot: torch.Tensor
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


def _slot_message(slot: torch.Tensor, h: W.Header) -> str:
    return bytes(slot[W.HEADER_BYTES : W.HEADER_BYTES + h.meta_len].numpy()).decode("utf-8", "replace")


def _remote_error(func: str, rank: int, message: str) -> RemoteRankError:
    return RemoteRankError(
        f"onedist.{func}: rank {rank} could not send its value, so this collective was abandoned "
        f"on every rank. Its error:\n{message}",
        rank=rank,
    )


def _raise_slot_errors(
    func: str,
    ch: _Channels,
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
    raise _remote_error(
        func, ranks[first], _slot_message(slots.view(len(headers), ch.slot)[first], headers[first])
    )


def _obj_len(h: W.Header, merged: bool) -> int:
    n = W.align(h.meta_len) if h.inline == W.INLINE_NONE else 0
    if merged and h.inline != W.INLINE_ALL:
        n += h.tensor_len
    return n


def _my_blocks(
    packed: Optional[W.Packed], inline: int, ch: _Channels, obj_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's round-2 bytes: (object channel block, tensor channel block)."""
    empty = torch.empty(0, dtype=_U8)
    if packed is None:
        return empty, torch.empty(0, dtype=_U8, device=ch.tdev)
    meta_part = W.align(len(packed.meta)) if inline == W.INLINE_NONE else 0
    tensors_here = packed.tensor_len if inline != W.INLINE_ALL else 0
    if not ch.merged:
        tblock = torch.empty(packed.tensor_len, dtype=_U8, device=ch.tdev)
        W.copy_tensors_into(packed, tblock)
        tensors_here = 0
    else:
        tblock = torch.empty(0, dtype=_U8)
    if obj_len == 0:
        return empty, tblock
    if meta_part == 0 and packed.kind == W.K_TENSOR:
        return W.tensor_bytes(packed.tensors[0]), tblock  # the tensor's own memory: no copy
    block = torch.empty(obj_len, dtype=_U8)
    if meta_part:
        block[: len(packed.meta)].copy_(torch.frombuffer(bytearray(packed.meta), dtype=_U8))
    if tensors_here:
        W.copy_tensors_into(packed, block[meta_part:])
    return block, tblock


# Uneven round 2 with blocks this large goes over concurrent isend/irecv with every peer: no
# repeated input (all_to_all_single needs the block once per peer) and, on gloo, about 2x faster at
# 4 MB+ (benchmarks/bench_collectives.py). The tag keeps it apart from the user's own p2p traffic.
_P2P_MIN_BYTES = 256 * 1024
_EXCHANGE_TAG = 0x6F6E64


def _gather_bytes(
    b: Backend,
    group: Any,
    ranks: Sequence[int],
    me: int,
    dev: torch.device,
    block: torch.Tensor,
    sizes: list[int],
    async_op: bool,
) -> tuple[Optional[torch.Tensor], list[Optional[Work]]]:
    """Every rank's block, concatenated in group-rank order; exact sizes, no padding."""
    total = sum(sizes)
    if total == 0:
        return None, []
    out = torch.empty(total, dtype=_U8, device=dev)
    if all(s == sizes[0] for s in sizes):
        return out, [b.all_gather_into_(out, block, group, async_op)]
    own = b.all_gather_uneven_(out, block, sizes, group, async_op)
    if own is not None:
        return out, list(own)
    if max(sizes) >= _P2P_MIN_BYTES and b.p2p_bulk:
        views = _slices(out, sizes)
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


def _decode(
    ch: _Channels,
    h: W.Header,
    slot: torch.Tensor,
    obj: Optional[torch.Tensor],
    tens: Optional[torch.Tensor],
) -> tuple[int, list[W.TensorSpec], list[torch.Tensor], bytes]:
    """One rank's value parts from its slot and its round-2 bytes (``obj``/``tens`` may be None)."""
    obj_rest: Optional[torch.Tensor]
    if h.inline == W.INLINE_NONE:
        assert obj is not None
        meta = bytes(obj[: h.meta_len].numpy())  # the object channel is on the CPU
        obj_rest = obj[W.align(h.meta_len) :]
    else:
        meta = bytes(slot[W.HEADER_BYTES : W.HEADER_BYTES + h.meta_len].numpy())
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


def _slices(buf: Optional[torch.Tensor], sizes: list[int]) -> list[Optional[torch.Tensor]]:
    if buf is None:
        return [None] * len(sizes)
    out: list[Optional[torch.Tensor]] = []
    off = 0
    for s in sizes:
        out.append(buf[off : off + s])
        off += s
    return out


def _members(func: str, b: Backend, group: GroupLike) -> tuple[Any, int, tuple[int, ...]]:
    """(group handle, my group rank or -1, the group's global ranks; () when unknown here)."""
    if group is None:
        return None, b.rank, tuple(range(b.world_size))
    if isinstance(group, (list, tuple, range)):
        ranks = _check_ranks(func, "group", group, b.world_size)
        g = b.new_group(ranks)
        return g, (ranks.index(b.rank) if b.rank in ranks else -1), ranks
    try:
        me = b.group_rank(group)
    except (TypeError, ValueError, AttributeError, RuntimeError):
        raise bad_value(
            func,
            "group",
            group,
            "None, a list of global ranks, or a group from new_group",
            says=_IGNITE_BAD_RANKS["group"],
        ) from None
    return group, me, (b.group_ranks(group) if me >= 0 else ())


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
    return _all_gather("all_gather", tensor, group, async_op, merge=merge)


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
    return _all_gather("all_gather_object", obj, group, async_op, merge=False)  # type: ignore[no-any-return]


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
    _, me, _ = _members(func, current(), group)
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


def _all_gather(func: str, value: Any, group: GroupLike, async_op: bool, merge: bool) -> Any:
    b = current()
    g, me, ranks = _members(func, b, group)
    if me < 0:  # all_gather gives its input back (as ignite); all_gather_object a list, as torch
        return _done(value if func == "all_gather" else [value], async_op)
    size = len(ranks)
    ch = _Channels(b, g, "all_gather", size)
    slot = torch.empty(ch.slot, dtype=_U8)
    packed, inline, err = _pack_or_error(func, value, ch, slot)
    slots = torch.empty(size * ch.slot, dtype=_U8)
    b.all_gather_into_(slots, slot, ch.og, False)
    headers = W.parse_headers(slots, size)
    _raise_slot_errors(func, ch, slots, headers, ranks, me, err)
    obj_sizes = [_obj_len(h, ch.merged) for h in headers]
    my_obj, my_t = _my_blocks(packed, inline, ch, obj_sizes[me])
    obj_buf, w1 = _gather_bytes(b, ch.og, ranks, me, _CPU, my_obj, obj_sizes, async_op)
    t_sizes = [0 if ch.merged else h.tensor_len for h in headers]
    t_buf, w2 = (
        _gather_bytes(b, g, ranks, me, ch.tdev, my_t, t_sizes, async_op) if not ch.merged else (None, [])
    )

    def finish() -> Any:
        slot_views = slots.view(size, ch.slot)
        objs, tens = _slices(obj_buf, obj_sizes), _slices(t_buf, t_sizes)
        parts = [_decode(ch, h, slot_views[i], objs[i], tens[i]) for i, h in enumerate(headers)]
        if merge:
            return _merge_gathered(value, parts, headers, obj_buf, obj_sizes, ch)
        return [_localize(W.unpack(kind, rest, tensors), value) for kind, _, tensors, rest in parts]

    if async_op:
        return AsyncResult(w1 + w2, finish)
    return finish()


def _localize(value: Any, local: Any) -> Any:
    """A received tensor goes to the device of the tensor this rank passed (if it passed one)."""
    if isinstance(value, torch.Tensor) and isinstance(local, torch.Tensor) and value.device != local.device:
        return value.to(local.device)
    return value


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)} {value.dtype}"
    if isinstance(value, Mapping):
        return f"{type(value).__name__} with keys {_sorted_keys(value)}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of length {len(value)}"
    return type(value).__name__


def _mismatch(func: str, what: str, values: Sequence[Any], path: str) -> CollectiveMismatchError:
    lines = "\n".join(f"  rank {i}: {_describe(v)}" for i, v in enumerate(values))
    where = f" at {path}" if path else ""
    return CollectiveMismatchError(f"onedist.{func}: the ranks passed {what}{where}:\n{lines}")


def _merge_gathered(
    local: Any,
    parts: list[tuple[int, list[W.TensorSpec], list[torch.Tensor], bytes]],
    headers: list[W.Header],
    obj_buf: Optional[torch.Tensor],
    obj_sizes: list[int],
    ch: _Channels,
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
    ch: _Channels,
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
    return _broadcast(obj, src, True, group, async_op)


_BROADCAST_KINDS = (torch.Tensor, numbers.Number, str, PurePath)


def _broadcast(tensor: Any, src: int, safe_mode: bool, group: GroupLike, async_op: bool) -> Any:
    b = current()
    g, me, ranks = _members("broadcast", b, group)
    if not isinstance(safe_mode, bool):
        raise bad_type("broadcast", "safe_mode", safe_mode, "bool")
    _check_peer("broadcast", "src", src, b, ranks)
    if me < 0:
        return _done(tensor, async_op)
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
    ch = _Channels(b, g, "broadcast", size)
    slot = torch.empty(ch.slot, dtype=_U8)
    packed: Optional[W.Packed] = None
    inline, err = W.INLINE_NONE, ""
    if is_src:
        packed, inline, err = _pack_or_error("broadcast", tensor, ch, slot)
    b.broadcast_(slot, src, ch.og, False)
    h = W.parse_headers(slot, 1)[0]
    if h.status != 0:
        if is_src:
            raise OnedistTypeError(err)
        raise _remote_error("broadcast", src, _slot_message(slot, h))
    if is_src:
        obj_len = _obj_len(h, ch.merged)
        obj, tens = _my_blocks(packed, inline, ch, obj_len)
    else:
        obj = torch.empty(_obj_len(h, ch.merged), dtype=_U8)
        tens = torch.empty(0 if ch.merged else h.tensor_len, dtype=_U8, device=ch.tdev)
    works: list[Optional[Work]] = []
    if obj.numel():
        works.append(b.broadcast_(obj, src, ch.og, async_op))
    if tens.numel():
        works.append(b.broadcast_(tens, src, g, async_op))

    def finish() -> Any:
        if is_src:
            return tensor
        _, _, tensors, rest = _decode(ch, h, slot, obj if obj.numel() else None, tens)
        value = W.unpack(h.kind, rest, tensors)
        if isinstance(value, torch.Tensor):
            target = tensor.device if isinstance(tensor, torch.Tensor) else b.device()
            if value.device != target:
                value = value.to(target)
        return value

    return AsyncResult(works, finish) if async_op else finish()


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
    g, me, ranks = _members("gather", b, group)
    _check_peer("gather", "dst", dst, b, ranks)
    if me < 0:
        return []
    size = len(ranks)
    ch = _Channels(b, g, "gather", size)
    slot = torch.empty(ch.slot, dtype=_U8)
    packed, inline, err = _pack_or_error("gather", data, ch, slot)
    slots = torch.empty(size * ch.slot, dtype=_U8)
    b.all_gather_into_(slots, slot, ch.og, False)
    headers = W.parse_headers(slots, size)
    _raise_slot_errors("gather", ch, slots, headers, ranks, me, err)
    obj_sizes = [_obj_len(h, ch.merged) for h in headers]
    t_sizes = [0 if ch.merged else h.tensor_len for h in headers]
    my_obj, my_t = _my_blocks(packed, inline, ch, obj_sizes[me])
    dst_i = ranks.index(dst)
    is_dst = me == dst_i
    obj_buf = _to_one(b, ch.og, _CPU, my_obj, obj_sizes, dst_i, is_dst)
    t_buf = None if ch.merged else _to_one(b, g, ch.tdev, my_t, t_sizes, dst_i, is_dst)
    if not is_dst:
        return []
    slot_views = slots.view(size, ch.slot)
    objs, tens = _slices(obj_buf, obj_sizes), _slices(t_buf, t_sizes)
    out = []
    for i, h in enumerate(headers):
        kind, _, tensors, rest = _decode(ch, h, slot_views[i], objs[i], tens[i])
        out.append(_localize(W.unpack(kind, rest, tensors), data))
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
    out = torch.empty(sum(out_splits), dtype=_U8, device=dev)
    b.all_to_all_single_(out, block, out_splits, in_splits, group, False)
    return out


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
    g, me, ranks = _members("scatter", b, group)
    _check_peer("scatter", "src", src, b, ranks)
    if me < 0:
        return None
    size = len(ranks)
    ch = _Channels(b, g, "scatter", size)
    src_i = ranks.index(src)
    is_src = me == src_i
    S = ch.slot
    packs: list[tuple[Optional[W.Packed], int]] = []
    local_error: Optional[Exception] = None
    if is_src:
        slots_in = torch.empty(size * S, dtype=_U8)
        views = slots_in.view(size, S)
        if not isinstance(data, (list, tuple)) or len(data) != size:
            local_error = bad_value(
                "scatter",
                "data",
                _short(data),
                f"a list or tuple of {size} values (one per rank of the group)",
            )
        else:
            for i in range(size):
                p, inline, err = _pack_or_error("scatter", data[i], ch, views[i])
                packs.append((p, inline))
                if p is None and local_error is None:
                    local_error = OnedistTypeError(f"{err} (item {i})")
        if local_error is not None:  # every rank learns it, not only the failing item's rank
            for i in range(size):
                W.error_slot(views[i], str(local_error))
        in_splits = [S] * size
    else:
        slots_in = torch.empty(0, dtype=_U8)
        in_splits = [0] * size
    out_splits = [S if i == src_i else 0 for i in range(size)]
    slot = torch.empty(S, dtype=_U8)
    b.all_to_all_single_(slot, slots_in, out_splits, in_splits, ch.og, False)
    h = W.parse_headers(slot, 1)[0]
    if h.status != 0:
        if local_error is not None:
            raise local_error
        raise _remote_error("scatter", src, _slot_message(slot, h))
    # round 2: each rank's bytes from src only
    if is_src:
        headers = [W.parse_headers(slots_in.view(size, S)[i], 1)[0] for i in range(size)]
        blocks = [
            _my_blocks(p, inline, ch, _obj_len(hh, ch.merged)) for (p, inline), hh in zip(packs, headers)
        ]
        obj_in = torch.cat([blk[0] for blk in blocks]) if blocks else torch.empty(0, dtype=_U8)
        obj_splits = [blk[0].numel() for blk in blocks]
        t_in = torch.cat([blk[1] for blk in blocks]) if blocks else torch.empty(0, dtype=_U8, device=ch.tdev)
        t_splits = [blk[1].numel() for blk in blocks]
    else:
        obj_in, obj_splits = torch.empty(0, dtype=_U8), [0] * size
        t_in, t_splits = torch.empty(0, dtype=_U8, device=ch.tdev), [0] * size
    my_obj_len = _obj_len(h, ch.merged)
    my_t_len = 0 if ch.merged else h.tensor_len
    obj = _from_one(b, ch.og, _CPU, obj_in, obj_splits, my_obj_len, src_i)
    tens = None if ch.merged else _from_one(b, g, ch.tdev, t_in, t_splits, my_t_len, src_i)
    if is_src:
        return data[me]  # type: ignore[index]
    _, _, tensors, rest = _decode(ch, h, slot, obj, tens)
    return W.unpack(h.kind, rest, tensors)


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
    out = torch.empty(my_len, dtype=_U8, device=dev)
    b.all_to_all_single_(out, inp, out_splits, in_splits, group, False)
    return out


def _short(value: Any) -> Any:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ============================================================================ sync and groups
@guarded("barrier", 0)
def barrier(group: GroupLike = None, *, async_op: bool = False) -> Any:
    """Wait until every rank of the group arrives (NCCL: on this rank's GPU).

    Example:
        >>> import onedist as od
        >>> od.barrier()
    """
    b = current()
    g, me, _ = _members("barrier", b, group)
    if me < 0:
        return _done(None, async_op)
    work = b.barrier_(g, async_op)
    return AsyncResult([work], lambda: None) if async_op else None


def new_group(ranks: Sequence[int], **kwargs: Any) -> Any:
    """The group of these global ranks, created once and cached.

    Only the members take part in creating it (torch's local synchronization), so a group can be
    made and used inside ``if rank in ranks:``. The same list (in any order) returns the same
    group; the list of every rank returns None (the default group).

    Args:
        ranks: distinct global ranks.
        **kwargs: passed to ``torch.distributed.new_group`` (``backend``, ``timeout``, ...).

    Example:
        >>> import onedist as od
        >>> group = od.new_group([0])
        >>> od.all_reduce(1, group=group)
        1
    """
    b = current()
    members = _check_ranks("new_group", "ranks", ranks, b.world_size, empty=True)
    if not members and b.model_name != "serial":
        members = tuple(range(b.world_size))  # torch's (so ignite's) meaning of []: every rank
    return b.new_group(members, **kwargs)


# ============================================================================ point to point
def send(tensor: Any, dst: int, group: GroupLike = None, tag: int = 0) -> None:
    """Send a tensor or any picklable object to global rank ``dst`` (blocking).

    The receiver calls :func:`recv` with a tensor of the same shape and dtype for a tensor, or
    without one for an object.

    Example:
        >>> import onedist as od
        >>> def handover(local_rank):
        ...     if od.get_rank() == 0:
        ...         od.send({"step": 10}, dst=1)
        ...     else:
        ...         return od.recv(src=0)
        >>> if __name__ == "__main__":
        ...     print(od.spawn("gloo", handover, nproc_per_node=2, start_method="fork"))
        [None, {'step': 10}]
    """
    b = current()
    g, _, ranks = _members("send", b, group)
    _check_peer("send", "dst", dst, b, ranks)
    if dst == b.rank:
        raise bad_value("send", "dst", dst, "a rank other than this process's own")
    if isinstance(tensor, torch.Tensor):
        dev = b.comm_device(tensor.device, "send")
        buf = tensor if (tensor.device == dev and tensor.is_contiguous()) else tensor.to(dev).contiguous()
        b.send_(buf, dst, g, tag, False)
        return
    try:
        data = pickle.dumps(tensor, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise bad_type(
            "send", "tensor", tensor, "a tensor or a picklable object", hint=f"pickling failed: {e}"
        ) from e
    dev = b.comm_device(_CPU, "send")
    og = b.object_group(g)
    b.send_(torch.tensor([len(data)], dtype=torch.int64, device=dev), dst, og, tag, False)
    b.send_(torch.frombuffer(bytearray(data), dtype=_U8).to(dev), dst, og, tag, False)


def recv(
    tensor: Optional[torch.Tensor] = None, src: Optional[int] = None, group: GroupLike = None, tag: int = 0
) -> Any:
    """Receive what :func:`send` sent.

    Args:
        tensor: for a tensor, the buffer to receive into (filled in place and returned); None to
            receive an object.
        src: global rank to receive from; None for any rank.
        group: None, a list of global ranks, or a group handle.
        tag: matches the sender's tag.

    Returns:
        The filled ``tensor``, or the received object.

    Example:
        >>> import torch
        >>> import onedist as od
        >>> def handover(local_rank):
        ...     if od.get_rank() == 0:
        ...         od.send(torch.arange(3.0), dst=1)
        ...     else:
        ...         return od.recv(torch.empty(3), src=0).tolist()
        >>> if __name__ == "__main__":
        ...     print(od.spawn("gloo", handover, nproc_per_node=2, start_method="fork"))
        [None, [0.0, 1.0, 2.0]]
    """
    b = current()
    g, _, ranks = _members("recv", b, group)
    if src is not None:
        _check_peer("recv", "src", src, b, ranks)
    if tensor is not None and not isinstance(tensor, torch.Tensor):
        raise bad_type("recv", "tensor", tensor, "a tensor to receive into, or None to receive an object")
    if tensor is not None:
        dev = b.comm_device(tensor.device, "recv")
        direct = tensor.device == dev and tensor.is_contiguous()
        buf = tensor if direct else torch.empty(tensor.shape, dtype=tensor.dtype, device=dev)
        b.recv_(buf, src, g, tag, False)
        if not direct:
            tensor.copy_(buf)
        return tensor
    dev = b.comm_device(_CPU, "recv")
    og = b.object_group(g)
    n = torch.empty(1, dtype=torch.int64, device=dev)
    sender = b.recv_(n, src, og, tag, False)
    data = torch.empty(int(n.item()), dtype=_U8, device=dev)
    b.recv_(data, src if src is not None else int(sender), og, tag, False)
    return pickle.loads(bytes(data.cpu().numpy()))


def isend(tensor: torch.Tensor, dst: int, group: GroupLike = None, tag: int = 0) -> AsyncResult:
    """Start sending a tensor to global rank ``dst``; ``.wait()`` on the result.

    Example:
        >>> import torch
        >>> import onedist as od
        >>> def exchange(local_rank):
        ...     peer = 1 - od.get_rank()
        ...     sending = od.isend(torch.full((2,), float(od.get_rank())), dst=peer)
        ...     received = od.irecv(torch.empty(2), src=peer)       # both in flight at once
        ...     sending.wait()
        ...     return received.wait().tolist()
        >>> if __name__ == "__main__":
        ...     print(od.spawn("gloo", exchange, nproc_per_node=2, start_method="fork"))
        [[1.0, 1.0], [0.0, 0.0]]
    """
    b = current()
    g, _, ranks = _members("isend", b, group)
    _check_peer("isend", "dst", dst, b, ranks)
    if not isinstance(tensor, torch.Tensor):
        raise bad_type("isend", "tensor", tensor, "a tensor (use send for objects)")
    dev = b.comm_device(tensor.device, "send")
    buf = tensor if (tensor.device == dev and tensor.is_contiguous()) else tensor.to(dev).contiguous()
    work = b.send_(buf, dst, g, tag, True)
    return AsyncResult([work], lambda: None)


def irecv(
    tensor: torch.Tensor, src: Optional[int] = None, group: GroupLike = None, tag: int = 0
) -> AsyncResult:
    """Start receiving into ``tensor``; ``.wait()`` returns the filled tensor.

    Example:
        >>> import torch
        >>> import onedist as od
        >>> def receive(local_rank):
        ...     if od.get_rank() == 0:
        ...         od.isend(torch.ones(2), dst=1).wait()
        ...     else:
        ...         return od.irecv(torch.empty(2), src=0).wait().tolist()
        >>> if __name__ == "__main__":
        ...     print(od.spawn("gloo", receive, nproc_per_node=2, start_method="fork"))
        [None, [1.0, 1.0]]
    """
    b = current()
    g, _, ranks = _members("irecv", b, group)
    if src is not None:
        _check_peer("irecv", "src", src, b, ranks)
    if not isinstance(tensor, torch.Tensor):
        raise bad_type("irecv", "tensor", tensor, "a tensor to receive into")
    dev = b.comm_device(tensor.device, "recv")
    direct = tensor.device == dev and tensor.is_contiguous()
    buf = tensor if direct else torch.empty(tensor.shape, dtype=tensor.dtype, device=dev)
    work = b.recv_(buf, src, g, tag, True)

    def finish() -> torch.Tensor:
        if not direct:
            tensor.copy_(buf)
        return tensor

    return AsyncResult([work], finish)
