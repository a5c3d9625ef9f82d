"""Reduction packing: a nested value's leaves, packed into one buffer per (device, dtype).

A dict/list/tuple of tensors and Python numbers is flattened in a deterministic order (dict keys
sorted, so every rank agrees whatever its insertion order), its leaves are packed into one
contiguous buffer per (device, dtype) bucket, reduced in one collective per bucket, and
unpacked back into the caller's structure, devices and dtypes.
"""

from __future__ import annotations

import copy
import numbers
from collections.abc import Iterator, Mapping
from itertools import islice
from operator import attrgetter
from typing import Any, NamedTuple, Optional

import torch

from ..backends import Backend
from ..errors import OnedistTypeError, bad_type, bad_value
from .base import CPU, check_op_dtype

# ---------------------------------------------------------------------------- nested reductions


def sorted_keys(m: Mapping[Any, Any]) -> list[Any]:
    """The keys in sorted order (insertion order if they cannot be sorted). Not cached: sorting
    100 metric names (~2 us) costs less than hashing them into a cache key."""
    try:
        return sorted(m)
    except TypeError:
        return list(m)


_LEAF_TYPES = (torch.Tensor, float, int)  # bool is an int


class FlatDict(NamedTuple):
    """A plain dict of a step's metrics, as :func:`flat_dict` reads it."""

    keys: list[Any]  #: sorted (the order every rank agrees on)
    values: list[Any]  #: in that order
    dtype: Optional[torch.dtype]  #: float64 / int64 for numbers; None for tensors
    in_order: bool  #: the dict's own order is ``keys``' (a result built in it needs no reordering)


def flat_dict(obj: Any) -> Optional[FlatDict]:
    """A plain dict of a step's metrics: all floats or all ints (dtype float64 / int64), or all
    tensors of one dtype (dtype None: the caller stacks them, if they are on the CPU); None for
    anything else, packed the general way."""
    if type(obj) is not dict or not obj:
        return None
    keys, order = list(obj), sorted_keys(obj)
    in_order = keys == order
    values = list(obj.values()) if in_order else list(map(obj.__getitem__, order))
    types = set(map(type, values))
    if len(types) != 1:
        return None
    kind = types.pop()
    if kind is torch.Tensor:  # the caller checks that the stack is on the CPU
        return FlatDict(order, values, None, in_order) if len(set(map(_get_dtype, values))) == 1 else None
    dtype = _NUMBER_DTYPES.get(kind)
    return None if dtype is None else FlatDict(order, values, dtype, in_order)


_EXACT_LEAF_TYPES = frozenset({torch.Tensor, float, int, bool})
_get_dtype, _get_device, _is_cpu = attrgetter("dtype"), attrgetter("device"), attrgetter("is_cpu")


def is_leaf(v: Any) -> bool:
    return isinstance(v, _LEAF_TYPES) or (isinstance(v, numbers.Number) and not isinstance(v, complex))


def flatten(func: str, obj: Any, leaves: list[Any], path: tuple[Any, ...]) -> Any:
    """Append the leaves of ``obj`` (tensors and numbers) to ``leaves``; return its spec.

    A spec is None for a leaf, ("m", mapping, keys, children) or ("s", sequence, children);
    ``children`` is None when every child is a leaf (the common flat dict of metrics).
    """
    if is_leaf(obj):
        leaves.append(obj)
        return None
    if isinstance(obj, Mapping):
        keys = sorted_keys(obj)
        values = [obj[k] for k in keys]
        if set(map(type, values)) <= _EXACT_LEAF_TYPES:
            leaves.extend(values)
            return ("m", obj, keys, None)
        return ("m", obj, keys, [flatten(func, v, leaves, (*path, k)) for k, v in zip(keys, values)])
    if isinstance(obj, (list, tuple)):
        if set(map(type, obj)) <= _EXACT_LEAF_TYPES:
            leaves.extend(obj)
            return ("s", obj, None)
        return ("s", obj, [flatten(func, v, leaves, (*path, i)) for i, v in enumerate(obj)])
    where = "tensor" + "".join(f"[{p!r}]" for p in path)
    raise bad_type(
        func,
        where,
        obj,
        "a tensor, a number, or a dict/list/tuple of those",
        hint="strings and other objects cannot be reduced; use all_gather or broadcast_object for them",
        says="Unhandled input type",
    )


def unflatten(spec: Any, values: Iterator[Any]) -> Any:
    if spec is None:
        return next(values)
    if spec[0] == "m":
        _, orig, keys, children = spec
        if children is None:
            by_key = dict(zip(keys, islice(values, len(keys))))
        else:
            by_key = {k: unflatten(c, values) for k, c in zip(keys, children)}
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
        items = [unflatten(c, values) for c in children]
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


class Bucket:
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
_NUMBER_DTYPES = {float: _PY_DTYPES["f"], int: _PY_DTYPES["i"]}  # flat_dict's plain numbers


def buckets(func: str, leaves: list[Any], op: str) -> list[Bucket]:
    buckets: dict[tuple[torch.device, torch.dtype], Bucket] = {}
    # comprehensions rather than one loop: this runs per call on every leaf (100 metrics: ~10 us)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    types = set(map(type, leaves))
    if types == {torch.Tensor}:
        t_ids = list(range(len(leaves)))
        dtypes = set(map(_get_dtype, leaves))
        if len(dtypes) == 1 and (all(map(_is_cpu, leaves)) or len(set(map(_get_device, leaves))) == 1):
            groups = {(leaves[0].device, dtypes.pop()): t_ids}
    elif any(issubclass(t, torch.Tensor) for t in types):
        t_ids = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    else:  # numbers only (a dict of metrics): no per-leaf check
        t_ids = []
    if t_ids and not groups:
        keys = [(leaves[i].device, leaves[i].dtype) for i in t_ids]
        if keys.count(keys[0]) == len(keys):
            groups = {keys[0]: t_ids}
        else:
            groups = {}
            for i, key in zip(t_ids, keys):
                groups.setdefault(key, []).append(i)
    for key, ids in groups.items():
        check_op_dtype(func, op, key[1], f" (leaf {ids[0]})")
        bucket = buckets[key] = Bucket(*key)
        bucket.leaf_ids = ids
        bucket.tensors = leaves if len(ids) == len(leaves) else [leaves[i] for i in ids]
    if len(t_ids) == len(leaves):
        return list(buckets.values())
    py = _number_kinds(func, leaves, op, t_ids)
    for kind, ids in py.items():
        key = (CPU, _PY_DTYPES[kind])
        if key not in buckets:
            buckets[key] = Bucket(*key)
        buckets[key].py_kind, buckets[key].py_ids = kind, ids
    return list(buckets.values())


def _number_kinds(func: str, leaves: list[Any], op: str, t_ids: list[int]) -> dict[str, list[int]]:
    """The Python numbers among ``leaves`` by the kind they are reduced as: "f" (float64), "i"
    (int64), "b" (bool, for the logical ops and MIN/MAX). By exact type first: an ABC check
    (``numbers.Integral``) per leaf was most of a 100-metric dict's packing time."""
    logical = op in ("AND", "OR", "MIN", "MAX")
    kinds: dict[type, str] = {float: "f", int: "i", bool: "b" if logical else "i"}
    if not t_ids:
        types = set(map(type, leaves))
        if len(types) == 1 and (kind := kinds.get(types.pop())) is not None:  # a dict of floats
            if kind == "f" and op in ("AND", "OR"):
                _not_logical(func, op, leaves[0], 0)
            return {kind: list(range(len(leaves)))}
    py: dict[str, list[int]] = {}
    for i, leaf in enumerate(leaves):
        kind = kinds.get(type(leaf))
        if kind is None:
            if isinstance(leaf, torch.Tensor):
                continue
            if isinstance(leaf, bool):
                kind = kinds[bool]
            else:
                kind = "i" if isinstance(leaf, numbers.Integral) else "f"
        if kind == "f" and op in ("AND", "OR"):
            _not_logical(func, op, leaf, i)
        py.setdefault(kind, []).append(i)
    return py


def _not_logical(func: str, op: str, leaf: Any, i: int) -> None:
    raise OnedistTypeError(
        f"onedist.{func}: op={op!r} needs bool or int values, got the float {leaf!r} (leaf {i})"
    )


def int_mean_wire(dtype: torch.dtype) -> torch.dtype:
    """What integers or bools are summed in for a MEAN: int64 (exact, no wrap-around, no bool
    saturation), but float64 for uint64, whose values from 2**63 do not fit int64 (the mean is a
    float anyway)."""
    return torch.float64 if dtype == getattr(torch, "uint64", None) else torch.int64


def fill(func: str, b: Backend, bucket: Bucket, leaves: list[Any], op: str = "SUM") -> torch.Tensor:
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
    wire = int_mean_wire(bucket.dtype) if op == "MEAN" and integral else b.reduce_dtype(bucket.dtype)
    if buf.device != dev or buf.dtype != wire:
        buf = buf.to(device=dev, dtype=wire)
    return buf


def unfill(bucket: Bucket, leaves: list[Any], results: list[Any], op: str, size: int, inplace: bool) -> None:
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
