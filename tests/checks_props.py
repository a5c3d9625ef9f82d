"""Value model for the property tests and the soak: picklable *specs* and what collectives must return.

A spec describes one value per rank (up to 4 ranks). Every rank builds its own value from the spec
with :func:`build`, and can build every other rank's value too, so the result of any collective
can be computed locally: :func:`gathered` (all_gather), :func:`reduced` (all_reduce / reduce), and
``build(spec, src)`` for broadcast, gather and scatter. :func:`diff` compares a result with its
expectation exactly: tensors by dtype, shape and bytes (NaN payloads and -0.0 included), Python
values by exact type and value.

Spec grammar (tuples, so that hypothesis prints them and they pickle to the pool)::

    ("t", dtype_name, rows | None, trailing, layout, seeds, domain)  tensor; rows[r] is rank r's
                                                   first dimension, None for a 0-d tensor
    ("i", values) ("f", values) ("b", values)      Python int / float / bool, one per rank
    ("n", values)                                  Python numbers of mixed types across ranks
    ("s", values) ("o", values) ("none",)          str, Obj(payload), None
    ("d", ((key, child), ...))                     dict; each rank inserts its keys in its own order
    ("l", children) ("tu", children) ("nt", (a, b))  list, tuple, Pair namedtuple
"""

from __future__ import annotations

import enum
import itertools
import math
import operator
import struct
import warnings
from functools import reduce as fold
from typing import Any, NamedTuple, Optional

import pytest
import torch

import onedist as od

warnings.filterwarnings("ignore", "ComplexHalf support is experimental")

# ============================================================================ dtypes
_MOVE_NAMES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex32",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
)
#: every dtype all_gather / broadcast / gather / scatter must carry (the wire format's list)
MOVE_DTYPES = tuple(n for n in _MOVE_NAMES if hasattr(torch, n))
#: dtypes gloo reduces (int16/uint16/uint32 widened by onedist): every movable one but uint64,
#: complex32 and the float8 types, which are not reducible there
REDUCE_DTYPES = tuple(
    n for n in MOVE_DTYPES if n not in ("uint64", "complex32") and not n.startswith("float8")
)
#: dtypes the wire format does not know: all_gather/broadcast raise "tensors of dtype ... cannot be sent"
UNSENDABLE_DTYPES = tuple(
    n for n in ("float8_e8m0fnu", "float4_e2m1fn_x2", "bits8", "bits16", "uint4", "int4") if hasattr(torch, n)
)
#: dtypes the plain tensor broadcast (no safe_mode) hands to gloo as they are, and gloo rejects with a
#: raw "RuntimeError: Invalid scalar type" (a bug: test_properties.test_bug_plain_broadcast_dtypes)
_PLAIN_BROKEN = ["int16", "uint16", "uint32", "uint64"]
_PLAIN_BROKEN += ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]
PLAIN_BROADCAST_BROKEN = tuple(n for n in _PLAIN_BROKEN if hasattr(torch, n))
OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AND", "OR", "MEAN")
LAYOUTS = ("contig", "T", "step", "step_last", "expand", "offset", "strided")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


def ops_for(dtype_name: str) -> tuple[str, ...]:
    """The ops all_reduce supports for this dtype (others raise OnedistTypeError)."""
    dt = dtype_of(dtype_name)
    if dt.is_complex:
        return ("SUM", "MEAN")
    if dt.is_floating_point:
        return ("SUM", "PRODUCT", "MIN", "MAX", "MEAN")
    return OPS


def domain_for(dtype_name: str, op: str) -> str:
    """Input values whose all_reduce result is exact in the dtype (see :func:`_values`)."""
    dt = dtype_of(dtype_name)
    if not (dt.is_floating_point or dt.is_complex):
        return "sum" if op == "MEAN" else "wide"  # integers wrap like the dtype does, except in MEAN
    return {"PRODUCT": "prod", "MIN": "wide", "MAX": "wide"}.get(op, "sum")


# ============================================================================ values
class Obj:
    """An arbitrary picklable object (not a number, string or container)."""

    def __init__(self, payload: Any) -> None:
        self.payload = payload

    def __eq__(self, other: object) -> bool:
        return type(other) is Obj and other.payload == self.payload

    def __hash__(self) -> int:
        return hash(("Obj", repr(self.payload)))

    def __repr__(self) -> str:
        return f"Obj({self.payload!r})"


class Pair(NamedTuple):
    a: Any
    b: Any


def _layout_plan(shape: tuple[int, ...], layout: str) -> tuple[tuple[int, ...], Any]:
    """(the shape to generate, the function that turns it into a view of ``shape``)."""
    nd = len(shape)
    if layout == "T" and nd >= 2:
        perm = tuple(reversed(range(nd)))
        return tuple(shape[i] for i in perm), lambda t: t.permute(perm)
    if layout == "step" and nd >= 1:
        return (2 * shape[0] + 1, *shape[1:]), lambda t: t[1::2]
    if layout == "step_last" and nd >= 1:
        return (*shape[:-1], 3 * shape[-1]), lambda t: t[..., ::3]
    if layout == "expand" and nd >= 1:
        return (*shape[:-1], 1), lambda t: t.expand(shape)
    if layout == "offset":
        return (math.prod(shape) + 3,), lambda t: t[3:].view(shape)
    if layout == "strided":  # every other element: a 1-element result is "contiguous" with stride 2
        return (2 * math.prod(shape),), lambda t: t[::2].view(shape)
    return shape, lambda t: t


def _values(dtype: torch.dtype, n: int, seed: int, domain: str) -> torch.Tensor:
    """``n`` values of ``dtype``, 1-D.

    domain "bits": any bit pattern (NaN payloads, infinities, -0.0, subnormals; bool stays 0/1);
    "sum": small values whose sums over 3 ranks are exact in every dtype (and do not overflow);
    "prod": values in [-3, 3], products exact; "wide": the full range of integer dtypes, and
    finite floats of any magnitude (for MIN/MAX).
    """
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    floating = dtype.is_floating_point or dtype.is_complex
    if domain == "bits" or (domain == "wide" and not floating):
        return torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g).view(dtype)
    if domain == "wide":  # finite floats of any magnitude
        t = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g).view(dtype)
        return torch.where(torch.isfinite(t), t, torch.zeros((), dtype=dtype))
    signed = floating or dtype in (torch.int8, torch.int16, torch.int32, torch.int64)
    lo, hi = (-40, 40) if domain == "sum" else (-3, 3)
    if not signed:
        lo, hi = 0, hi - lo
    k = torch.randint(lo, hi + 1, (2 * n if dtype.is_complex else n,), generator=g)
    if not floating:
        return k.to(dtype)
    x = k.double() / 4 if domain == "sum" else k.double()
    if dtype.is_complex:
        return torch.complex(x[:n], x[n:]).to(dtype)
    return x.to(dtype)


def make_tensor(dtype_name: str, shape: tuple[int, ...], layout: str, seed: int, domain: str) -> torch.Tensor:
    gen_shape, view = _layout_plan(tuple(shape), layout)
    t = _values(dtype_of(dtype_name), math.prod(gen_shape), seed, domain).view(gen_shape)
    out = view(t)
    assert out.shape == tuple(shape), (out.shape, shape, layout)
    return out


def build(spec: tuple[Any, ...], rank: int) -> Any:
    """Rank ``rank``'s value for ``spec``."""
    kind = spec[0]
    if kind == "t":
        _, dtype, rows, trailing, layout, seeds, domain = spec
        shape = () if rows is None else (rows[rank], *trailing)
        return make_tensor(dtype, shape, layout, seeds[rank], domain)
    if kind in ("i", "f", "b", "n", "s"):
        return spec[1][rank]
    if kind == "o":
        return Obj(spec[1][rank])
    if kind == "none":
        return None
    if kind == "d":
        items = [(k, build(c, rank)) for k, c in spec[1]]
        if items:  # every rank inserts its keys in another order
            shift = rank % len(items)
            items = items[shift:] + items[:shift]
        return dict(items)
    children = [build(c, rank) for c in spec[1]]
    if kind == "l":
        return children
    if kind == "tu":
        return tuple(children)
    if kind == "nt":
        return Pair(*children)
    raise AssertionError(f"unknown spec kind {kind!r}")


# ============================================================================ expectations
class OneOf(NamedTuple):
    """Any of these values is right (float sums over 3+ ranks depend on the reduction order)."""

    options: tuple[Any, ...]


def _number_dtype(values: list[Any]) -> torch.dtype:
    if all(isinstance(v, bool) for v in values):
        return torch.bool
    if all(isinstance(v, int) for v in values):
        return torch.int64
    return torch.float64


def gathered(spec: tuple[Any, ...], ranks: list[int]) -> Any:
    """What ``all_gather`` of ``spec`` over ``ranks`` returns (documented rules, leaf by leaf)."""
    kind = spec[0]
    if kind == "t":
        values = [build(spec, q) for q in ranks]
        return torch.stack(values) if spec[2] is None else torch.cat(values)
    if kind in ("i", "f", "b", "n"):
        values = [spec[1][q] for q in ranks]
        return torch.tensor(values, dtype=_number_dtype(values))
    if kind in ("s", "o", "none"):
        return [build(spec, q) for q in ranks]
    if kind == "d":
        return {k: gathered(c, ranks) for k, c in spec[1]}
    children = [gathered(c, ranks) for c in spec[1]]
    return {"l": list, "tu": tuple, "nt": lambda c: Pair(*c)}[kind](children)


def _wrap(v: int, dtype: torch.dtype) -> int:
    bits = 8 * dtype.itemsize
    if dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64):
        return v % (1 << bits)
    return (v + (1 << (bits - 1))) % (1 << bits) - (1 << (bits - 1))


_INT_FOLDS = {
    "SUM": sum,
    "PRODUCT": math.prod,
    "MIN": min,
    "MAX": max,
    "AND": lambda vs: fold(operator.and_, vs),
    "OR": lambda vs: fold(operator.or_, vs),
}


def reduce_tensors(op: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """The all_reduce result of same-shape tensors, element by element in Python (exact)."""
    dtype, shape, n = tensors[0].dtype, tensors[0].shape, len(tensors)
    columns = list(zip(*(t.reshape(-1).tolist() for t in tensors)))
    if dtype == torch.bool:
        if op == "MEAN":
            return torch.tensor([sum(c) for c in columns], dtype=torch.int64).view(shape) / n
        logical = {"SUM": any, "MAX": any, "OR": any, "PRODUCT": all, "MIN": all, "AND": all}[op]
        return torch.tensor([logical(c) for c in columns], dtype=torch.bool).view(shape)
    if not (dtype.is_floating_point or dtype.is_complex):
        if op == "MEAN":  # the exact sum, divided as torch divides integers (true division, float)
            return torch.tensor([sum(c) for c in columns], dtype=torch.int64).view(shape) / n
        out = [_wrap(_INT_FOLDS[op](c), dtype) for c in columns]
        return torch.tensor(out, dtype=dtype).view(shape)
    wide = torch.complex128 if dtype.is_complex else torch.float64
    exact = [_INT_FOLDS["SUM" if op == "MEAN" else op](c) for c in columns]  # exact by construction
    out_t = torch.tensor(exact, dtype=wide).to(dtype).view(shape)
    return out_t.div_(n) if op == "MEAN" else out_t


def _float_options(op: str, values: list[float]) -> Any:
    if op in ("MIN", "MAX"):
        return min(values) if op == "MIN" else max(values)
    f = operator.mul if op == "PRODUCT" else operator.add
    outs = {struct.pack("<d", fold(f, p)): fold(f, p) for p in itertools.permutations(values)}
    if op == "MEAN":
        outs = {k: v / len(values) for k, v in outs.items()}
    options = tuple(outs.values())
    return options[0] if len(options) == 1 else OneOf(options)


def reduced(spec: tuple[Any, ...], op: str, ranks: list[int], rank: int) -> Any:
    """What ``all_reduce(build(spec, rank), op)`` over ``ranks`` returns on ``rank``."""
    kind = spec[0]
    if kind == "t":
        return reduce_tensors(op, [build(spec, q) for q in ranks])
    if kind in ("i", "b"):
        values = [spec[1][q] for q in ranks]
        if op == "MEAN":
            return sum(values) / len(values)
        if kind == "b" and op in ("AND", "OR", "MIN", "MAX"):
            return {"AND": all, "MIN": all, "OR": any, "MAX": any}[op](values)
        return int(_INT_FOLDS[op]([int(v) for v in values]))
    if kind == "f":
        return _float_options(op, [spec[1][q] for q in ranks])
    if kind == "d":
        local = build(spec, rank)  # the caller's key order is kept
        children = dict(spec[1])
        return {k: reduced(children[k], op, ranks, rank) for k in local}
    children = [reduced(c, op, ranks, rank) for c in spec[1]]
    return {"l": list, "tu": tuple, "nt": lambda c: Pair(*c)}[kind](children)


# ============================================================================ comparison
def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's values as bytes, in logical (row-major) order, whatever its layout."""
    c = torch.empty(t.shape, dtype=t.dtype)
    c.copy_(t.resolve_conj().resolve_neg())
    return c.reshape(-1).view(torch.uint8)


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        try:
            data = tensor_bytes(value)[:24].tolist()
        except Exception as e:  # pragma: no cover - only in failure messages
            data = f"<unreadable: {e}>"
        return f"tensor{tuple(value.shape)} {value.dtype} bytes={data}"
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _float_eq(a: float, b: float, exact_bits: bool) -> bool:
    if exact_bits:
        return struct.pack("<d", a) == struct.pack("<d", b)
    return a == b or (math.isnan(a) and math.isnan(b))


def diff(got: Any, exp: Any, path: str = "value", *, bits: bool = True) -> list[str]:
    """Differences between a result and its expectation (empty: equal).

    ``bits``: compare float tensors and floats bit for bit (data movement); otherwise by value
    (reductions, where -0.0 == 0.0 and the MIN of 0.0 and -0.0 is either).
    """
    if isinstance(exp, OneOf):
        if any(not diff(got, o, path, bits=bits) for o in exp.options):
            return []
        return [f"{path}: got {describe(got)}, expected one of {exp.options!r}"]
    if type(got) is not type(exp):
        return [f"{path}: got type {type(got).__name__} ({describe(got)}), expected {type(exp).__name__}"]
    if isinstance(exp, torch.Tensor):
        if got.dtype != exp.dtype or got.shape != exp.shape:
            return [f"{path}: got {describe(got)}, expected {describe(exp)}"]
        floating = exp.dtype.is_floating_point or exp.dtype.is_complex
        if bits or not floating:
            same = torch.equal(tensor_bytes(got), tensor_bytes(exp))
        else:
            wide = torch.complex128 if exp.dtype.is_complex else torch.float64
            same = torch.equal(got.to(wide), exp.to(wide))
        return [] if same else [f"{path}: got {describe(got)}, expected {describe(exp)}"]
    if isinstance(exp, float):
        return [] if _float_eq(got, exp, bits) else [f"{path}: got {got!r}, expected {exp!r}"]
    if isinstance(exp, dict):
        if set(got) != set(exp):
            return [f"{path}: got keys {sorted(map(repr, got))}, expected {sorted(map(repr, exp))}"]
        out: list[str] = []
        for k in exp:
            out += diff(got[k], exp[k], f"{path}[{k!r}]", bits=bits)
        return out
    if isinstance(exp, (list, tuple)):
        if len(got) != len(exp):
            return [f"{path}: got length {len(got)}, expected {len(exp)}"]
        out = []
        for i, (g, e) in enumerate(zip(got, exp)):
            out += diff(g, e, f"{path}[{i}]", bits=bits)
        return out
    return [] if got == exp else [f"{path}: got {describe(got)}, expected {describe(exp)}"]


def key_orders(got: Any, local: Any, path: str = "value") -> list[str]:
    """all_reduce keeps the caller's dict key order (documented): compare recursively."""
    if isinstance(local, dict) and isinstance(got, dict):
        out = [] if list(got) == list(local) else [f"{path}: key order {list(got)}, caller's {list(local)}"]
        for k in local:
            if k in got:
                out += key_orders(got[k], local[k], f"{path}[{k!r}]")
        return out
    if isinstance(local, (list, tuple)) and isinstance(got, (list, tuple)):
        return [p for i, (g, v) in enumerate(zip(got, local)) for p in key_orders(g, v, f"{path}[{i}]")]
    return []


# ============================================================================ checks run on every rank
#: groups made up front, in an order where every member of each group has made as many groups
#: before it as the others: torch names a group made with use_local_synchronization (onedist's
#: default for list groups) after that count, so lazily made overlapping groups such as [0, 2]
#: then [1, 2] deadlocked (fixed: test_soak.test_bug_overlapping_list_groups_deadlock); kept so the
#: pools' group history stays independent of test order
SAFE_GROUP_ORDER: dict[int, tuple[list[int], ...]] = {
    2: ([0], [1]),
    3: ([0, 2], [1], [1, 2], [0], [0, 1], [2]),
}


def make_groups(world_size: int) -> int:
    for ranks in SAFE_GROUP_ORDER.get(world_size, ()):
        od.new_group(ranks)
    return od.get_world_size()


def _members(group: Optional[list[int]]) -> list[int]:
    return list(range(od.get_world_size())) if group is None else sorted(group)


def _fail(problems: list[str], what: str) -> None:
    if problems:
        raise AssertionError(
            f"{what}: {len(problems)} mismatch(es) on rank {od.get_rank()}:\n" + "\n".join(problems)
        )


def check_move(spec: tuple[Any, ...], group: Optional[list[int]], root: int) -> int:
    """all_gather, all_gather_object, broadcast (safe and, for tensors, plain), gather and scatter
    of ``spec`` over ``group``, from/to the member chosen by ``root``; every result against the
    expectation, and the input left unchanged. Returns the number of collectives checked."""
    r = od.get_rank()
    members = _members(group)
    member = r in members
    src = members[root % len(members)]
    value = build(spec, r)
    problems: list[str] = []
    n = 0

    def check(got: Any, exp: Any, what: str) -> None:
        problems.extend(diff(got, exp, what))

    got = od.all_gather(value, group=group, nested=True)  # leaf by leaf (onedist's)
    n += 1
    if member:
        check(got, gathered(spec, members), "all_gather")
    elif got is not value:
        problems.append("all_gather: a non-member must get its input back")
    got = od.all_gather_object(value, group=group)
    n += 1
    if member:
        check(got, [build(spec, q) for q in members], "all_gather_object")
    elif not (type(got) is list and len(got) == 1 and got[0] is value):
        problems.append("all_gather_object: a non-member must get [input]")
    # broadcast: the source's value everywhere, the source gets its input itself
    got = od.broadcast_object(value if r == src else None, src=src, group=group)
    n += 1
    if r == src or not member:
        if got is not (value if r == src else None):
            problems.append("broadcast_object: the source / a non-member must get its input back")
    else:
        check(got, build(spec, src), "broadcast_object")
    if isinstance(value, torch.Tensor) and (
        od.get_world_size() == 1 or str(value.dtype).removeprefix("torch.") not in PLAIN_BROADCAST_BROKEN
    ):  # the plain path: receivers pass a tensor like it
        exp = build(spec, src)
        mine = value if r == src else torch.empty(exp.shape, dtype=exp.dtype)
        got = od.broadcast(mine, src=src, group=group)
        n += 1
        if r == src or not member:
            if got is not mine:
                problems.append("broadcast: the source / a non-member must get its input back")
        else:
            check(got, exp, "broadcast")
    got = od.gather(value, dst=src, group=group)
    n += 1
    if r == src:
        check(got, [build(spec, q) for q in members], "gather")
    elif not (type(got) is list and not got):
        problems.append(f"gather: a rank other than dst must get [], got {describe(got)}")
    items = [build(spec, q) for q in members] if r == src else None
    got = od.scatter(items, src=src, group=group)
    n += 1
    if not member:
        if got is not None:
            problems.append("scatter: a non-member must get None")
    elif r == src:
        if items is None or got is not items[members.index(r)]:
            problems.append("scatter: the source must get its own item itself")
    else:
        check(got, build(spec, r), "scatter")
    check(value, build(spec, r), "input after the collectives")
    _fail(problems, f"check_move({spec!r}, group={group}, src={src})")
    return n


def check_reduce(spec: tuple[Any, ...], op: str, group: Optional[list[int]], root: int) -> int:
    """all_reduce and reduce of ``spec`` with ``op`` over ``group``, against the exact expectation
    (values, Python types, containers, the caller's key order); inputs left unchanged."""
    r = od.get_rank()
    members = _members(group)
    member = r in members
    dst = members[root % len(members)]
    value = build(spec, r)
    problems: list[str] = []
    got = od.all_reduce(value, op=op, group=group, inplace=False)
    if member:
        problems += diff(got, reduced(spec, op, members, r), "all_reduce", bits=False)
        problems += key_orders(got, value, "all_reduce")
    elif got is not value:
        problems.append("all_reduce: a non-member must get its input back")
    got = od.reduce(value, dst=dst, op=op, group=group)
    if r == dst:
        problems += diff(got, reduced(spec, op, members, r), "reduce", bits=False)
    elif got is not value:
        problems.append("reduce: a rank other than dst must get its input back")
    problems += diff(value, build(spec, r), "input after the collectives")
    _fail(problems, f"check_reduce({spec!r}, op={op}, group={group}, dst={dst})")
    return 2


# ============================================================================ focused checks
def _send_bad(fn: str, mine: Any, culprit: int) -> Any:
    r = od.get_rank()
    if fn == "broadcast":  # only the source packs
        return od.broadcast_object(mine if r == culprit else None, src=culprit)
    if fn == "gather":
        return od.gather(mine, dst=0)
    if fn == "scatter":  # the source packs every item; the bad one is the culprit's own
        items = [mine] * od.get_world_size() if r == culprit else None
        return od.scatter(items, src=culprit)
    return getattr(od, fn)(mine)


def check_unsendable_dtypes() -> int:
    """Tensors of a dtype the wire format does not know: the documented OnedistTypeError on the
    rank that has one, RemoteRankError elsewhere, and nobody hangs. Same for sparse tensors."""
    r, w = od.get_rank(), od.get_world_size()
    bad_values = [
        (torch.zeros(2, dtype=dtype_of(n)), rf"tensors of dtype torch\.{n} cannot be sent")
        for n in UNSENDABLE_DTYPES
    ]
    bad_values.append((torch.zeros(3).to_sparse(), "only dense tensors can be sent"))
    n = 0
    for bad, message in bad_values:
        for culprit in range(w):
            for fn in ("all_gather", "all_gather_object", "gather", "broadcast", "scatter"):
                mine = bad if r == culprit else torch.zeros(2)
                if r == culprit:
                    with pytest.raises(od.OnedistTypeError, match=message):
                        _send_bad(fn, mine, culprit)
                else:
                    with pytest.raises(od.RemoteRankError, match=rf"rank {culprit} could not send"):
                        _send_bad(fn, mine, culprit)
                n += 1
    assert od.all_gather(r) == list(range(w))  # still in step
    return n


def check_reduce_dtype_errors() -> int:
    """Every (dtype, op) pair: the exact result, or the documented OnedistTypeError on every rank."""
    r, w = od.get_rank(), od.get_world_size()
    n = 0
    for name in REDUCE_DTYPES:
        dt = dtype_of(name)
        for op in OPS:
            if op not in ops_for(name):
                match = "needs bool or integer" if op in ("AND", "OR") else "not defined for complex"
                with pytest.raises(od.OnedistTypeError, match=match):
                    od.all_reduce(torch.ones(2, dtype=dt), op=op)
                continue
            if dt == torch.bool and op == "MEAN":
                continue  # a known bug, see test_properties.test_bug_all_reduce_mean_of_bool_tensors
            seeds = (11 * n + 1, 11 * n + 2, 11 * n + 3, 11 * n + 4)
            spec = ("t", name, (2,) * 4, (3,), "contig", seeds, domain_for(name, op))
            got = od.all_reduce(build(spec, r), op=op)
            problems = diff(got, reduced(spec, op, list(range(w)), r), f"{name} {op}", bits=False)
            assert not problems, problems
            n += 1
    return n


def check_float_exactness() -> float:
    """Python floats travel as float64: 0.1 + 0.2 (+ 0.3) is the float64 sum in some order."""
    r, w = od.get_rank(), od.get_world_size()
    values = [0.1, 0.2, 0.3, 0.4][:w]
    got = od.all_reduce(values[r])
    assert type(got) is float
    problems = diff(got, _float_options("SUM", values), "SUM", bits=False)
    mean = od.all_reduce({"x": values[r]}, op="MEAN")["x"]
    problems += diff(mean, _float_options("MEAN", values), "MEAN", bits=False)
    tiny = od.all_reduce(1.0 + r * 2.0**-50)  # below float32 resolution
    problems += diff(tiny, _float_options("SUM", [1.0 + q * 2.0**-50 for q in range(w)]), "tiny", bits=False)
    assert not problems, problems
    return got


# ============================================================================ reproductions of bugs
class Color(enum.IntEnum):
    RED = 1


class Label(str):
    """A str subclass (an enum with a str mixin, a path-like label, ...)."""


def check_bug_mean_of_python_ints_and_bools() -> tuple[float, float]:
    r = od.get_rank()
    return od.all_reduce(2**40 + 3 * r + 1, op="MEAN"), od.all_reduce(r == 0, op="MEAN")


def check_bug_mean_of_bool_tensor() -> None:
    r, w = od.get_rank(), od.get_world_size()
    got = od.all_reduce(torch.tensor([r == 0, True, False]), op="MEAN")
    assert got.tolist() == pytest.approx([1 / w, 1.0, 0.0]), f"rank {r}: got {got.tolist()}"


def check_bug_integer_mean_overflow() -> None:
    r = od.get_rank()
    got8 = od.all_reduce(torch.tensor([100], dtype=torch.int8), op="MEAN")
    gotu8 = od.all_reduce(torch.tensor([200], dtype=torch.uint8), op="MEAN")
    assert (got8.item(), gotu8.item()) == (100.0, 200.0), f"rank {r}: got {got8.item()}, {gotu8.item()}"


def check_bug_plain_broadcast(dtype_name: str) -> None:
    r = od.get_rank()
    exp = make_tensor(dtype_name, (3,), "contig", 7, "bits")
    got = od.broadcast(exp if r == 0 else torch.empty(3, dtype=exp.dtype), src=0)
    problems = diff(got, exp, "broadcast")
    assert not problems, problems


def check_bug_reduce_dtype_error(dtype_name: str) -> None:
    """errors.py: every exception onedist raises derives from OnedistError."""
    with pytest.raises(od.OnedistError):
        od.all_reduce(torch.ones(2, dtype=dtype_of(dtype_name)))


def check_bug_subclass_types() -> None:
    r = od.get_rank()
    got = od.broadcast_object(Color.RED if r == 0 else None, src=0)
    labels = od.all_gather_object(Label(f"r{r}"))
    problems = [] if type(got) is Color else [f"broadcast(Color.RED) gave {type(got).__name__} {got!r}"]
    if [type(x) for x in labels] != [Label] * len(labels):
        problems.append(f"all_gather_object(Label) gave {[type(x).__name__ for x in labels]}")
    assert not problems, f"rank {r}: {problems}"


def check_bug_conj_view_one_rank() -> None:
    """Only rank 0's tensor is a conjugate view: it should travel (resolved), and at worst every
    rank should raise; today rank 0 raises a RuntimeError before the first round and the others
    wait for it forever."""
    r, w = od.get_rank(), od.get_world_size()
    z = torch.tensor([1 + 2j, 3 - 1j])
    got = od.all_gather(z.conj() if r == 0 else z)
    assert got.tolist() == [1 - 2j, 3 + 1j] + [1 + 2j, 3 - 1j] * (w - 1)
