"""Distributed checks, each written once and run on every rank of every world (serial, 1..4).

A check asserts on its own rank and returns something small for the test to compare across
ranks. Expected values are computed from the rank and world size.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

import onedist as od
from onedist.context import current

PRIMITIVES = (
    "all_reduce_",
    "reduce_",
    "broadcast_",
    "all_gather_into_",
    "all_to_all_single_",
    "all_gather_uneven_",  # None (no call made) where the backend has none of its own
    "barrier_",
    "send_",
    "recv_",
)


@contextmanager
def count_primitives() -> Iterator[collections.Counter[str]]:
    """Count the backend primitive calls (= collectives) made inside the block, by name."""
    b = current()
    counts: collections.Counter[str] = collections.Counter()
    for name in PRIMITIVES:
        original = getattr(b, name)

        def wrapper(*args: Any, _orig: Any = original, _name: str = name, **kwargs: Any) -> Any:
            result = _orig(*args, **kwargs)
            if result is not None or _name != "all_gather_uneven_":
                counts[_name] += 1
            return result

        setattr(b, name, wrapper)
    try:
        yield counts
    finally:
        for name in PRIMITIVES:
            delattr(b, name)


@contextmanager
def onedist_log(level: int) -> Iterator[list[logging.LogRecord]]:
    """The records the "onedist" logger takes at ``level`` or above inside the block (its own
    level lowered to ``level`` meanwhile, so an INFO line is seen in a worker left at WARNING)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("onedist")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(min(level, logger.getEffectiveLevel()))
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def rounds(counts: collections.Counter[str]) -> int:
    """Communication rounds: each collective is one; concurrent isend/irecv with peers is one more."""
    p2p = 1 if counts["send_"] or counts["recv_"] else 0
    return sum(v for k, v in counts.items() if k not in ("send_", "recv_")) + p2p


def rw() -> tuple[int, int]:
    return od.get_rank(), od.get_world_size()


# ============================================================================ queries
def check_queries(backend: str = "gloo") -> dict[str, Any]:
    r, w = rw()
    serial = od.model_name() == "serial"
    assert od.backend() == (None if serial else backend)
    assert od.model_name() in ("serial", "native-dist", "horovod-dist", "xla-dist")
    assert od.device() == torch.device("cpu")
    assert od.get_local_rank() == r
    assert od.get_nproc_per_node() == w
    assert od.get_local_size() == w
    assert od.get_nnodes() == 1
    assert od.get_node_rank() == 0
    assert od.hostname() == socket.gethostname()
    assert od.is_main_process() == (r == 0)
    assert "gloo" in od.available_backends()
    config = od.show_config()
    assert config["rank"] == r and config["world_size"] == w and config["local_rank"] == r
    return {"rank": r, "world_size": w}


# ============================================================================ all_reduce
def _expected(op: str, values: list[Any]) -> Any:
    if op == "SUM":
        return sum(values)
    if op == "PRODUCT":
        return math.prod(values)
    if op == "MIN":
        return min(values)
    if op == "MAX":
        return max(values)
    if op == "MEAN":
        return sum(values) / len(values)
    if op == "AND":
        out = values[0]
        for v in values[1:]:
            out = out & v
        return out
    out = values[0]
    for v in values[1:]:
        out = out | v
    return out


def check_all_reduce_ops_and_dtypes() -> None:
    r, w = rw()
    for op in ("SUM", "PRODUCT", "MIN", "MAX", "MEAN"):
        for dtype in (
            torch.float32,
            torch.float64,
            torch.float16,
            torch.bfloat16,
            torch.int8,
            torch.int16,
            torch.int32,
            torch.int64,
            torch.uint8,
        ):
            base = torch.tensor([1, 2, 3], dtype=dtype) + r
            x = base.clone()
            kept = od.all_reduce(x, op=op, inplace=False)
            assert torch.equal(x, base), f"inplace=False modified the input: {op} {dtype}"
            out = od.all_reduce(x, op=op)
            assert torch.equal(kept, out), (op, dtype, kept, out)
            if op == "MEAN" and not dtype.is_floating_point:  # a float result: a new tensor
                assert out is not x and torch.equal(x, base), f"input modified by {op} {dtype}"
            else:  # in place, as ignite and torch.distributed
                assert out is x, f"not in place: {op} {dtype}"
            per_rank = [[1 + q, 2 + q, 3 + q] for q in range(w)]
            expected = [_expected(op, [per_rank[q][i] for q in range(w)]) for i in range(3)]
            if op == "MEAN" and not dtype.is_floating_point:
                assert out.is_floating_point(), (op, dtype, out.dtype)
            else:
                assert out.dtype == dtype, (op, dtype, out.dtype)
                expected = torch.tensor(expected).to(dtype).tolist()  # wraps like the dtype does
            assert torch.allclose(out.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-2), (
                op,
                dtype,
                out,
                expected,
            )
    for op in ("AND", "OR"):
        for dtype in (torch.int32, torch.int64, torch.uint8, torch.bool, torch.int16):
            values = [(0b1011 >> q) & 0xF or 1 for q in range(w)]
            x = torch.tensor([values[r]], dtype=dtype) if dtype != torch.bool else torch.tensor([r % 2 == 0])
            out = od.all_reduce(x, op=op)
            if dtype == torch.bool:
                bools = [q % 2 == 0 for q in range(w)]
                assert out.item() == (all(bools) if op == "AND" else any(bools))
            else:
                assert out.item() == _expected(op, values), (op, dtype, out, values)
    # op spellings
    for spelling in ("sum", "Sum", "AVERAGE", "avg", torch.distributed.ReduceOp.MAX):
        od.all_reduce(torch.ones(1), op=spelling)
    z = od.all_reduce(torch.tensor([1 + 1j]) * (r + 1))
    assert z.item() == complex(sum(q + 1 for q in range(w)), sum(q + 1 for q in range(w)))


def check_all_reduce_layout_device_inplace_async() -> None:
    r, w = rw()
    base = torch.arange(12, dtype=torch.float32).view(3, 4) + r
    x = base.t()  # non-contiguous
    out = od.all_reduce(x, inplace=False)
    assert out.shape == (4, 3) and torch.equal(x, base.t())
    assert torch.equal(out, (torch.arange(12.0).view(3, 4) * w + sum(range(w))).t())
    assert od.all_reduce(x) is x and torch.equal(x, out)  # non-contiguous, in place
    y = torch.full((5,), float(r))
    same = od.all_reduce(y, op="MEAN", inplace=True)
    assert same is y and torch.allclose(y, torch.full((5,), (w - 1) / 2))
    handle = od.all_reduce(torch.ones(4), async_op=True)
    assert isinstance(handle, od.AsyncResult)
    assert torch.equal(handle.wait(), torch.full((4,), float(w)))
    assert handle.is_completed()
    h2 = od.all_reduce({"a": 1.0, "b": torch.ones(2)}, async_op=True)
    res = h2.wait()
    assert res["a"] == float(w) and torch.equal(res["b"], torch.full((2,), float(w)))
    empty = od.all_reduce(torch.empty(0, 3))
    assert empty.shape == (0, 3)
    requires = torch.ones(2, requires_grad=True)
    assert not od.all_reduce(requires * 1, inplace=False).requires_grad
    leaf = torch.ones(2, requires_grad=True)  # in place into a leaf that requires grad, as torch does
    assert od.all_reduce(leaf) is leaf and torch.equal(leaf.detach(), torch.full((2,), float(w)))


def check_all_reduce_numbers_exact() -> None:
    r, w = rw()
    f = 1.0 + r * 2.0**-40  # not representable in float32
    out = od.all_reduce(f)
    assert isinstance(out, float) and out == w + sum(range(w)) * 2.0**-40
    big = 2**60 + r  # beyond float64's exact integers
    out_i = od.all_reduce(big)
    assert isinstance(out_i, int) and out_i == w * 2**60 + sum(range(w))
    assert od.all_reduce(r, op="MAX") == w - 1
    mean = od.all_reduce(r, op="MEAN")
    assert isinstance(mean, float) and mean == (w - 1) / 2
    assert od.all_reduce(r % 2 == 0, op="AND") is (w == 1)
    assert od.all_reduce(r == w - 1, op="OR") is True
    assert od.all_reduce(True) == w  # SUM of bools counts
    assert od.all_reduce(3, op="PRODUCT") == 3**w


def check_python_numbers_take_either_way_alike() -> None:
    """A Python float or int alone takes all_reduce's number path (one float64/int64 element), the
    same number in a list the general way: the same value and type for every op, and ranks that
    mix the two ways in one call still meet (both send that one element)."""
    r, _ = rw()
    for x in (0.1 * (r + 1), 1.0 + r * 2.0**-40, r + 3, -(2**62) + r, 2**53 + 1 + r):
        for op in ("SUM", "MEAN", "MIN", "MAX", "PRODUCT"):
            if op == "PRODUCT" and isinstance(x, int) and abs(x) > 2**20:
                continue  # int64 wraps alike on both ways, but the value says nothing then
            alone, listed = od.all_reduce(x, op), od.all_reduce([x], op)[0]
            assert type(alone) is type(listed) and alone == listed, (x, op, alone, listed)
    mixed = od.all_reduce(2.5 if r % 2 else [2.5], "MEAN")
    assert (mixed if r % 2 else mixed[0]) == 2.5, mixed
    try:  # beyond int64: the general way's error, raised on every rank before any communication
        od.all_reduce(2**70)
    except od.OnedistValueError as e:
        assert "numbers that fit in int64 / float64" in str(e), e
    else:
        raise AssertionError("2**70 was reduced")


def check_large_objects_travel_whole() -> dict[str, Any]:
    """Objects of 1 MiB and more, which go as their pickle's own memory (no copy on either side):
    bytes, a str, a dict with a tensor inside, equal and uneven sizes, broadcast and all_gather,
    and what comes back is the receiver's own (a bytearray changed afterwards does not change
    what was received)."""
    r, w = rw()
    big = bytes([r + 1]) * (2**20 + 7 * r)  # uneven sizes: 1 MiB + 7 r bytes
    assert od.all_gather_object(big) == [bytes([i + 1]) * (2**20 + 7 * i) for i in range(w)]
    text = "é" * (2**19 + r)
    assert od.all_gather_object(text) == ["é" * (2**19 + i) for i in range(w)]
    sent = bytearray(b"x" * 2**21)
    got = od.broadcast_object(sent if r == 0 else None)
    if r == 0:
        assert got is sent
    else:
        assert got == sent and isinstance(got, bytearray)
        got[0] = ord("y")
    state = {"vocab": [f"word{i}" for i in range(30000)], "w": torch.full((64, 64), float(r))}
    gathered = od.all_gather_object(state)
    assert [g["vocab"] == state["vocab"] for g in gathered] == [True] * w
    assert [float(g["w"][0, 0]) for g in gathered] == [float(i) for i in range(w)]
    one = od.broadcast_object(big if r == 0 else None)
    assert one == bytes([1]) * 2**20
    return {"sent_intact": bytes(sent[:1]) == b"x"}


class Point(NamedTuple):
    x: float
    y: torch.Tensor


def check_all_reduce_nested_one_collective_per_dtype() -> None:
    r, w = rw()
    keys = [f"m{i:03d}" for i in range(100)]
    order = keys if r % 2 == 0 else list(reversed(keys))  # ranks insert keys in different orders
    metrics = {k: float(i + r) for k, i in ((k, keys.index(k)) for k in order)}
    with count_primitives() as counts:
        out = od.all_reduce(metrics, op="MEAN")
    assert counts["all_reduce_"] == 1, counts
    assert list(out) == order  # the caller's key order is kept
    for i, k in enumerate(keys):
        assert out[k] == i + (w - 1) / 2
    counts_by_key = {"seen": 10 + r, "right": r}  # a dict of ints: ints back, floats for MEAN
    assert od.all_reduce(counts_by_key) == {"seen": 10 * w + sum(range(w)), "right": sum(range(w))}
    assert all(type(v) is int for v in od.all_reduce(counts_by_key).values())
    assert od.all_reduce(counts_by_key, op="MEAN") == {"seen": 10 + (w - 1) / 2, "right": (w - 1) / 2}
    assert od.all_reduce({"top": float(r)}, op="MAX") == {"top": float(w - 1)}
    on_root = od.reduce({"n": 1 + r}, dst=0)
    assert on_root == ({"n": w + sum(range(w))} if r == 0 else {"n": 1 + r})
    tensor_metrics = {k: torch.tensor(float(keys.index(k) + r)) for k in order}
    with count_primitives() as counts:
        out = od.all_reduce(tensor_metrics)
    assert counts["all_reduce_"] == 1, counts
    assert list(out) == order
    assert all(torch.equal(out[k], torch.tensor(float(i * w + sum(range(w))))) for i, k in enumerate(keys))
    grads = {k: torch.tensor(float(r), requires_grad=True) for k in ("b", "a")}  # stacked in one buffer
    out = od.all_reduce(grads, op="MEAN")
    assert list(out) == ["b", "a"]
    assert all(v.item() == (w - 1) / 2 and not v.requires_grad for v in out.values())
    ints = od.all_reduce({"n": torch.tensor(r), "m": torch.tensor(1)}, op="MEAN")  # floats, as ever
    assert ints["n"].dtype == torch.get_default_dtype() and ints["n"].item() == (w - 1) / 2
    uneven = od.all_reduce({"v": torch.ones(2) * r, "s": torch.tensor(float(r))}, op="MAX")
    assert uneven["v"].shape == (2,) and uneven["s"].shape == () and uneven["s"].item() == w - 1
    on_root = od.reduce({"t": torch.tensor([1.0, r])}, dst=0)["t"]
    assert on_root.tolist() == ([float(w), float(sum(range(w)))] if r == 0 else [1.0, float(r)])
    mixed_shapes = [torch.ones(2) * r, torch.ones(3, 1) * r, torch.tensor(float(r))]
    out = od.all_reduce(mixed_shapes, op="MAX")
    assert [t.shape for t in out] == [(2,), (3, 1), ()] and all(torch.all(t == w - 1) for t in out)
    nested = {
        "loss": torch.tensor(float(r)),
        "counts": [r, 2 * r, torch.tensor([r, r], dtype=torch.int64)],
        "pair": (1.5, torch.ones(2, 2, dtype=torch.float64)),
        "point": Point(0.5, torch.full((3,), float(r))),
        "deep": {"a": {"b": torch.tensor([r], dtype=torch.int32)}},
        "flag": True,
    }
    with count_primitives() as counts:
        out = od.all_reduce(nested)
    # float32 tensors, int64 (tensor + Python ints + the bool), float64 (tensor + Python floats), int32
    assert counts["all_reduce_"] == 4, counts
    s = sum(range(w))
    assert torch.equal(out["loss"], torch.tensor(float(s)))
    assert out["counts"][0] == s and out["counts"][1] == 2 * s and isinstance(out["counts"][0], int)
    assert torch.equal(out["counts"][2], torch.tensor([s, s]))
    assert out["pair"][0] == 1.5 * w and isinstance(out["pair"], tuple)
    assert isinstance(out["point"], Point) and out["point"].x == 0.5 * w
    assert out["deep"]["a"]["b"].dtype == torch.int32 and out["deep"]["a"]["b"].item() == s
    assert out["flag"] == w
    assert torch.equal(nested["loss"], torch.tensor(float(r)))  # input untouched
    t = {"a": torch.ones(3), "b": torch.zeros(2)}
    a, b = t["a"], t["b"]
    res = od.all_reduce(t, inplace=True)
    assert res["a"] is a and res["b"] is b and torch.equal(a, torch.full((3,), float(w)))
    with pytest.raises(od.OnedistTypeError, match=r"tensor\['name'\]"):
        od.all_reduce({"name": "abc"})


def check_reduce() -> None:
    r, w = rw()
    dst = w - 1
    x = torch.tensor([float(r), 1.0])
    out = od.reduce(x, dst=dst)
    if r == dst:
        assert torch.equal(out, torch.tensor([float(sum(range(w))), float(w)]))
    else:
        assert out is x and torch.equal(x, torch.tensor([float(r), 1.0]))
    d = od.reduce({"a": r, "b": torch.tensor(2.0)}, dst=0, op="MEAN")
    if r == 0:
        assert d["a"] == (w - 1) / 2 and torch.equal(d["b"], torch.tensor(2.0))
    h = od.reduce(torch.ones(1), dst=0, async_op=True)
    v = h.wait()
    assert v.item() == (w if r == 0 else 1)


# ============================================================================ all_gather
class Blob:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.payload = torch.full((2,), rank)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Blob) and other.rank == self.rank and torch.equal(other.payload, self.payload)
        )


def check_all_gather_tensors() -> None:
    r, w = rw()
    x = torch.full((2, 3), float(r))
    with count_primitives() as counts:
        out = od.all_gather(x)
    assert sum(counts.values()) == 1, counts  # small: one collective, data inside the size round
    assert out.shape == (2 * w, 3)
    assert torch.equal(out, torch.cat([torch.full((2, 3), float(q)) for q in range(w)]))
    # first dim differs per rank (rank q sends q+1 rows; some may send 0 rows)
    uneven = torch.arange((r + 1) * 3, dtype=torch.int64).view(r + 1, 3) + 100 * r
    out = od.all_gather(uneven)
    expected = torch.cat([torch.arange((q + 1) * 3).view(q + 1, 3) + 100 * q for q in range(w)])
    assert torch.equal(out, expected)
    zero_rows = torch.ones(0 if r == 0 else 2, 4)
    assert od.all_gather(zero_rows).shape == (2 * (w - 1), 4)
    # large, beyond the inline slot: equal sizes and uneven, in at most 2 collectives
    big = torch.full((100_000,), float(r))
    with count_primitives() as counts:
        out = od.all_gather(big)
    assert sum(counts.values()) == 2, counts
    assert torch.equal(out, torch.cat([torch.full((100_000,), float(q)) for q in range(w)]))

    def ramp(q: int) -> torch.Tensor:  # rank q's block: values that show a part out of place
        return (torch.arange(50_000 * (q + 1)) % 1000 + 1000 * q).to(torch.int16)

    with count_primitives() as counts:
        out = od.all_gather(ramp(r))
    assert rounds(counts) == 2, counts
    assert torch.equal(out, torch.cat([ramp(q) for q in range(w)]))
    assert torch.equal(od.all_gather(ramp(r), async_op=True).wait(), torch.cat([ramp(q) for q in range(w)]))
    # 0-dim tensors stack; dtypes kept; non-contiguous
    assert torch.equal(od.all_gather(torch.tensor(r)), torch.arange(w))
    for dtype in (torch.bool, torch.bfloat16, torch.complex64, torch.uint8, torch.float16):
        v = od.all_gather(torch.ones(2, dtype=dtype))
        assert v.dtype == dtype and v.shape == (2 * w,)
    nc = torch.arange(6.0).view(2, 3).t() + r
    assert torch.equal(od.all_gather(nc), torch.cat([torch.arange(6.0).view(2, 3).t() + q for q in range(w)]))
    h = od.all_gather(torch.tensor([r]), async_op=True)
    assert torch.equal(h.wait(), torch.arange(w))


def check_all_gather_tensor_fast_paths() -> str:
    """The tensor paths of issue 24 (slot built without tensor ops, result read from the slots or
    received into itself): what the general path gives, in as few collectives, errors alike."""
    r, w = rw()
    one = torch.tensor([float(r)], requires_grad=True)
    with count_primitives() as counts:
        out = od.all_gather(one)
    assert sum(counts.values()) == 1, counts
    assert torch.equal(out, torch.arange(w, dtype=torch.float32)) and not out.requires_grad
    assert out.is_contiguous() and out.data_ptr() != one.data_ptr()
    for dtype in (torch.bfloat16, torch.complex128, torch.bool, torch.int8, torch.float64):
        x = (torch.arange(6) + r).view(3, 2).to(dtype)
        got = od.all_gather(x)
        assert got.dtype == dtype and torch.equal(
            got, torch.cat([(torch.arange(6) + q).view(3, 2).to(dtype) for q in range(w)])
        )
    assert torch.equal(od.all_gather(torch.tensor(r, dtype=torch.int16)), torch.arange(w, dtype=torch.int16))
    assert od.all_gather(torch.ones(0, 5)).shape == (0, 5)

    # uneven first dimension beyond the slot: the size round and one exchange, straight into the result
    def rows(q: int) -> torch.Tensor:
        return torch.arange((1000 + 37 * q) * 16, dtype=torch.float32).view(-1, 16) + q

    with count_primitives() as counts:
        out = od.all_gather(rows(r))
    assert rounds(counts) == 2, counts
    assert torch.equal(out, torch.cat([rows(q) for q in range(w)]))
    assert torch.equal(od.all_gather(rows(r), async_op=True).wait(), torch.cat([rows(q) for q in range(w)]))
    # some ranks inline in the slot, others not
    mixed = torch.full((3 if r == 0 else 5000, 2), float(r))
    assert torch.equal(
        od.all_gather(mixed), torch.cat([torch.full((3 if q == 0 else 5000, 2), float(q)) for q in range(w)])
    )
    if w == 1:
        return "ok"
    # what cannot be concatenated still raises on every rank, small or beyond the slot
    for n in (2, 5000):
        with pytest.raises(od.CollectiveMismatchError, match="cannot be concatenated"):
            od.all_gather(torch.ones(n, 3 + r))
        with pytest.raises(od.CollectiveMismatchError, match="cannot be concatenated"):
            od.all_gather(torch.ones(n, 3, dtype=torch.float32 if r == 0 else torch.float64))
    # another rank's error slot reaches a rank that sent a tensor
    if r == 1:
        with pytest.raises(od.OnedistTypeError, match="cannot pickle"):
            od.all_gather(lambda: 0)
    else:
        with pytest.raises(od.RemoteRankError, match="rank 1 could not send"):
            od.all_gather(torch.ones(2))
    assert torch.equal(od.all_gather(torch.tensor([r])), torch.arange(w))
    return "ok"


def check_all_gather_slot_follows_the_values() -> list[int]:
    """Round 1's slot shrinks after a run of small values and is full again right after a larger
    one, the same on every rank; results and collective counts stay right across the changes."""
    from onedist.collectives.exchange import SHRINK_AFTER_CALLS, SMALL_SLOT, channels

    r, w = rw()
    ch = channels(current(), None, "all_gather", w)
    full = ch.full_slot
    one = torch.tensor([float(r)])
    od.all_gather("x" * 1000)  # a value beyond the small slot: the full one
    assert ch.slot == full
    for _ in range(SHRINK_AFTER_CALLS):
        with count_primitives() as counts:
            assert torch.equal(od.all_gather(one), torch.arange(w, dtype=torch.float32))
        assert sum(counts.values()) == 1, counts
    assert ch.slot == min(SMALL_SLOT, full)
    text = f"{r}" * 600  # fits the full slot, not the small one: round 2 this once
    with count_primitives() as counts:
        assert od.all_gather_object(text) == [f"{q}" * 600 for q in range(w)]
    assert sum(counts.values()) == (2 if full > SMALL_SLOT else 1), counts
    assert ch.slot == full
    with count_primitives() as counts:  # and in one collective again right after
        assert od.all_gather_object(text) == [f"{q}" * 600 for q in range(w)]
    assert sum(counts.values()) == 1, counts
    sizes = []
    for i in range(2 * SHRINK_AFTER_CALLS):  # ranks alternate kinds of small values: still agree
        value = one if (i + r) % 2 else {"step": i}
        assert len(od.all_gather_object(value)) == w
        sizes.append(ch.slot)
    return sizes


def check_all_gather_values() -> None:
    r, w = rw()
    f = od.all_gather(0.1 * r)  # numbers: one exact entry per rank, as ignite's list
    assert f == [0.1 * q for q in range(w)] and all(type(v) is float for v in f)
    i = od.all_gather(2**40 + r)
    assert i == [2**40 + q for q in range(w)] and all(type(v) is int for v in i)
    assert od.all_gather(r == 0) == [q == 0 for q in range(w)]
    assert od.all_gather(f"rank-{r}-é") == [f"rank-{q}-é" for q in range(w)]
    assert od.all_gather(None) == [None] * w
    assert od.all_gather(Blob(r)) == [Blob(q) for q in range(w)]
    long_text = "x" * (10_000 + r)  # beyond the slot
    assert od.all_gather(long_text) == ["x" * (10_000 + q) for q in range(w)]
    nested = {"preds": torch.full((r + 1,), r), "n": r, "name": f"r{r}", "pair": (1.0, torch.tensor([r]))}
    per_rank = od.all_gather(nested)  # ignite's default: one entry per rank
    assert [d["n"] for d in per_rank] == list(range(w)) and [d["name"] for d in per_rank] == [
        f"r{q}" for q in range(w)
    ]
    assert all(torch.equal(d["preds"], torch.full((q + 1,), q)) for q, d in enumerate(per_rank))
    with count_primitives() as counts:
        out = od.all_gather(nested, nested=True)  # onedist's: leaf by leaf, in one collective
    assert sum(counts.values()) == 1, counts
    assert torch.equal(out["preds"], torch.cat([torch.full((q + 1,), q) for q in range(w)]))
    assert out["n"].tolist() == list(range(w))
    assert out["name"] == [f"r{q}" for q in range(w)]
    assert out["pair"][0].tolist() == [1.0] * w and torch.equal(out["pair"][1], torch.arange(w))


def check_all_gather_mismatch_raises_everywhere() -> str:
    r, w = rw()
    bad = torch.ones(2, 3 + r)
    if w == 1:
        return "skip"
    with pytest.raises(od.CollectiveMismatchError) as e:
        od.all_gather(bad)
    assert "rank 0: tensor(2, 3)" in str(e.value) and f"rank {w - 1}: tensor(2, {2 + w})" in str(e.value)
    with pytest.raises(od.CollectiveMismatchError, match="different keys"):
        od.all_gather({f"k{r}": 1}, nested=True)
    assert od.all_gather({f"k{r}": 1}) == [{f"k{q}": 1} for q in range(w)]  # one entry per rank
    # an unpicklable value on one rank: every rank raises, nobody hangs
    value = (lambda: 0) if r == 1 else "fine"
    if r == 1:
        with pytest.raises(od.OnedistTypeError, match="cannot pickle"):
            od.all_gather(value)
    else:
        with pytest.raises(od.RemoteRankError, match="rank 1 could not send") as e2:
            od.all_gather(value)
        assert e2.value.rank == 1
    # still usable afterwards
    assert od.all_gather(r) == list(range(w))
    return "ok"


# ============================================================================ broadcast
def check_broadcast() -> None:
    r, w = rw()
    src = w - 1
    t = torch.full((3,), float(r)) if r == src else torch.empty(3)
    out = od.broadcast(t, src=src)
    assert torch.equal(out, torch.full((3,), float(src)))
    assert od.broadcast(0.5 + r if r == src else None, src=src, safe_mode=True) == 0.5 + src
    assert od.broadcast(2**62 if r == 0 else 0) == 2**62
    assert od.broadcast("héllo" if r == 0 else "") == "héllo"
    assert od.broadcast(Path(f"/r{r}")) == Path("/r0")
    # ignite's kinds only: anything else is a TypeError in its words, raised before communicating
    with pytest.raises(od.OnedistTypeError, match=r"Unhandled input type(.|\n)*od.broadcast_object"):
        od.broadcast(Blob(r))
    if r == 0:
        with pytest.raises(od.OnedistValueError, match="Source data can not be None"):
            od.broadcast(None, src=0)
    else:
        with pytest.raises(od.OnedistValueError, match="Argument safe_mode should be True"):
            od.broadcast(None, src=0)
    assert od.broadcast_object(Blob(r)) == Blob(0)
    obj = {"cfg": {"lr": 0.1}, "w": torch.arange(4) + r, "s": "x" * 9000}  # beyond the slot
    got = od.broadcast_object(obj if r == 0 else None)
    assert got["cfg"] == {"lr": 0.1} and torch.equal(got["w"], torch.arange(4)) and len(got["s"]) == 9000
    safe = od.broadcast(torch.full((2, 2), 7.0) if r == src else None, src=src, safe_mode=True)
    assert torch.equal(safe, torch.full((2, 2), 7.0))
    big = torch.arange(300_000, dtype=torch.float64) if r == 0 else None
    with count_primitives() as counts:
        got_big = od.broadcast(big, safe_mode=True)
    assert sum(counts.values()) == 2 and torch.equal(got_big, torch.arange(300_000, dtype=torch.float64))
    with count_primitives() as counts:
        assert od.broadcast(3.25 if r == 0 else None, safe_mode=True) == 3.25
    assert sum(counts.values()) == 1
    h = od.broadcast(torch.tensor([r]), src=0, async_op=True)
    assert h.wait().item() == 0


def check_broadcast_source_error() -> None:
    r, w = rw()
    if w == 1:
        return
    value = (lambda: 1) if r == 0 else None
    if r == 0:
        with pytest.raises(od.OnedistTypeError, match="cannot pickle"):
            od.broadcast_object(value, src=0)
    else:
        with pytest.raises(od.RemoteRankError, match="rank 0 could not send"):
            od.broadcast_object(value, src=0)


# ============================================================================ gather / scatter
def check_gather() -> None:
    r, w = rw()
    dst = w // 2
    out = od.gather({"rank": r, "t": torch.arange(r + 1)}, dst=dst)
    if r == dst:
        assert [o["rank"] for o in out] == list(range(w))
        assert all(torch.equal(o["t"], torch.arange(q + 1)) for q, o in enumerate(out))
    else:
        assert out == []
    t = od.gather(torch.full((r + 1, 2), r), dst=0)
    if r == 0:
        assert [x.shape for x in t] == [(q + 1, 2) for q in range(w)]
    big = od.gather("y" * (5000 * (r + 1)), dst=0)
    if r == 0:
        assert [len(s) for s in big] == [5000 * (q + 1) for q in range(w)]


def check_scatter() -> None:
    r, w = rw()
    src = w - 1
    items = [{"i": q, "t": torch.full((q + 1,), q)} for q in range(w)] if r == src else None
    got = od.scatter(items, src=src)
    assert got["i"] == r and torch.equal(got["t"], torch.full((r + 1,), r))
    big = ["z" * (7000 + q) for q in range(w)] if r == 0 else None
    assert od.scatter(big, src=0) == "z" * (7000 + r)
    tensors = [torch.full((2, q + 1), float(q)) for q in range(w)] if r == 0 else None
    assert torch.equal(od.scatter(tensors, src=0), torch.full((2, r + 1), float(r)))
    # wrong length on the source: every rank raises
    bad = [1] * (w + 1) if r == 0 else None
    with pytest.raises((od.OnedistValueError, od.RemoteRankError), match="list or tuple of"):
        od.scatter(bad, src=0)


# ============================================================================ groups, barrier, p2p
def check_groups() -> None:
    r, w = rw()
    ranks = list(range(0, w, 2))  # even ranks
    member = r in ranks
    g1 = od.new_group(ranks)
    g2 = od.new_group(list(reversed(ranks)))
    assert g1 is g2  # cached
    out = od.all_reduce(torch.tensor([1.0]), group=ranks)
    if member:
        assert out.item() == len(ranks)
    else:
        assert out.item() == 1.0  # non-members get their input back
    gathered = od.all_gather(r, group=ranks)
    assert gathered == (ranks if member else r)  # non-members get their input back, as in ignite
    if member:  # only members call it: no deadlock
        assert od.all_reduce(1, group=g1) == len(ranks)
        assert od.broadcast(r, src=ranks[-1], group=ranks) == ranks[-1]
        assert od.all_gather(f"{r}", group=g1) == [str(q) for q in ranks]
        od.barrier(group=ranks)
    # the whole world is the default group (serially, as in ignite: the ranks themselves)
    assert od.new_group(list(range(w))) == ([0] if od.model_name() == "serial" else None)
    od.barrier()
    h = od.barrier(async_op=True)
    h.wait()
    for bad, match in (([0, 0], "appears twice"), ([w], "out of range"), ([], "non-empty"), (["0"], "int")):
        with pytest.raises((od.OnedistValueError, od.OnedistTypeError), match=match):
            od.all_reduce(1, group=bad)
    local = od.get_local_process_group()
    assert local is not None  # a group object, as detectron2's callers expect
    assert od.all_reduce(1, group=local) == od.get_local_size()


def check_p2p() -> None:
    r, w = rw()
    if w == 1:
        with pytest.raises(od.OnedistValueError, match="other than"):
            od.send(torch.ones(1), dst=0)
        return
    nxt, prv = (r + 1) % w, (r - 1) % w
    if r % 2 == 0:
        od.send(torch.full((3,), float(r)), dst=nxt)
        got = od.recv(torch.empty(3), src=prv)
    else:
        got = od.recv(torch.empty(3), src=prv)
        od.send(torch.full((3,), float(r)), dst=nxt)
    assert torch.equal(got, torch.full((3,), float(prv)))
    if r == 0:
        od.send({"hello": [1, 2]}, dst=w - 1, tag=3)
    elif r == w - 1:
        assert od.recv(src=0, tag=3) == {"hello": [1, 2]}
    sends = od.isend(torch.tensor([r]), dst=nxt)
    buf = torch.empty(1, dtype=torch.int64)
    recvd = od.irecv(buf, src=prv)
    sends.wait()
    assert recvd.wait() is buf and buf.item() == prv
    od.barrier()


# ============================================================================ helpers
def check_helpers(tmpdir: str) -> None:
    r, w = rw()

    @od.one_rank_only(rank=w - 1)
    def last() -> int:
        return 42

    assert last() == (42 if r == w - 1 else None)

    @od.one_rank_only(with_barrier=True)
    def first() -> str:
        return "done"

    assert first() == ("done" if r == 0 else None)
    marker = os.path.join(tmpdir, f"first-{w}")
    with od.one_rank_first():
        if r == 0:
            with open(marker, "w") as f:
                f.write("x")
        else:
            assert os.path.exists(marker)  # rank 0 finished its block before us
    with od.one_rank_first(rank=w - 1, local=True):
        pass
    seeds = od.all_gather(od.shared_random_seed())
    assert len(set(seeds)) == 1 and 0 <= seeds[0] < 2**31
    d = od.reduce_dict({"loss": torch.tensor(float(r)), "acc": float(r)})
    assert d["acc"] == (w - 1) / 2 and torch.equal(d["loss"], torch.tensor((w - 1) / 2))
    s = od.reduce_dict({"n": 1}, average=False)
    assert s["n"] == w
    od.synchronize()


def check_one_rank_first_failure() -> None:
    r, w = rw()
    if w == 1:
        return
    if r == 0:
        with pytest.raises(FileNotFoundError), od.one_rank_first():
            raise FileNotFoundError("download failed")
    else:
        with pytest.raises(od.RemoteRankError, match="download failed"), od.one_rank_first():
            raise AssertionError("must not run")


def check_logger(path: str) -> None:
    r, w = rw()
    import logging

    log = od.setup_logger(f"test-{w}", filepath=f"{path}-{r}.log", all_ranks=True, reset=True)
    log.info("hello from %d", r)
    log0 = od.setup_logger(f"test0-{w}", filepath=f"{path}-zero-{r}.log", reset=True)
    log0.info("only rank zero")
    for h in log.handlers + log0.handlers:
        h.flush()
    assert f"[rank{r}]" in Path(f"{path}-{r}.log").read_text()
    assert ("only rank zero" in Path(f"{path}-zero-{r}.log").read_text()) == (r == 0)
    logging.getLogger(f"test-{w}").handlers.clear()


def check_all_gather_object() -> None:
    r, w = rw()
    out = od.all_gather_object({"rank": r, "t": torch.arange(r + 1)})
    assert [o["rank"] for o in out] == list(range(w))
    assert all(torch.equal(o["t"], torch.arange(q + 1)) for q, o in enumerate(out))
    assert od.all_gather_object(torch.ones(r + 1))[0].shape == (1,)
    assert od.all_gather_object((r, "x")) == [(q, "x") for q in range(w)]
    # docs/migration/detectron2.md: all_gather gives detectron2's list but for a tensor (concatenated)
    for value in ({"a": r}, [r, "x"], f"s{r}", r, 0.5 * r, None):
        assert od.all_gather(value) == od.all_gather_object(value), value
    tensors = od.all_gather({"t": torch.tensor([r])})
    assert [int(d["t"]) for d in tensors] == list(range(w)), tensors
    assert torch.equal(od.all_gather(torch.tensor([r])), torch.arange(w))


def check_detectron2_differentiable_collectives_and_local_group() -> None:
    """detectron2's differentiable_all_reduce / differentiable_all_gather: values and the gradient
    each rank's input gets from every rank's outputs; create_local_process_group checks its count."""
    r, w = rw()
    total = float(sum(range(1, w + 1)))  # sum over the ranks q of (q + 1)
    x = (torch.tensor([1.0, 2.0]) * (r + 1)).requires_grad_(True)
    y = od.differentiable_all_reduce(x)
    assert torch.equal(y.detach(), torch.tensor([1.0, 2.0]) * total)
    (y * (r + 1)).sum().backward()  # rank q weights its output by q + 1: x's gradient sums them
    assert torch.equal(x.grad, torch.full((2,), total)), x.grad
    x2 = torch.full((3,), float(r), requires_grad=True)
    parts = od.differentiable_all_gather(x2)
    assert [p.tolist() for p in parts] == [[float(q)] * 3 for q in range(w)]
    loss = sum((q + 1) * (r + 1) * p.sum() for q, p in enumerate(parts))
    loss.backward()  # rank s gives entry r the weight (r + 1)(s + 1): summed over s
    assert torch.equal(x2.grad, torch.full((3,), (r + 1) * total)), x2.grad
    with pytest.raises(od.OnedistTypeError, match="input has type list"):
        od.differentiable_all_reduce([1.0])
    assert od.create_local_process_group(od.get_local_size()) is od.get_local_process_group()
    with pytest.raises(od.OnedistValueError, match=f"num_workers_per_machine={w + 1} is not allowed"):
        od.create_local_process_group(w + 1)


def check_argument_errors() -> None:
    _, w = rw()
    x = torch.ones(2)
    # onedist's "given; allowed" after the words ignite's users match on
    with pytest.raises(
        od.OnedistValueError,
        match=r"Unsupported reduction operation: op='FOO' is not allowed; allowed: 'SUM', 'PRODUCT'",
    ):
        od.all_reduce(x, op="FOO")
    with pytest.raises(od.OnedistTypeError, match="op='AND' needs bool or integer"):
        od.all_reduce(x, op="AND")
    with pytest.raises(od.OnedistTypeError, match="op='AND' needs bool or int values, got the float"):
        od.all_reduce(0.5, op="AND")
    with pytest.raises(od.OnedistTypeError, match="complex"):
        od.all_reduce(torch.ones(1, dtype=torch.complex64), op="MAX")
    with pytest.raises(od.OnedistTypeError, match="inplace=True needs a floating-point"):
        od.all_reduce(torch.ones(1, dtype=torch.int64), op="MEAN", inplace=True)
    with pytest.raises(od.OnedistTypeError, match=r"Unhandled input type: tensor has type str"):
        od.all_reduce("text")
    with pytest.raises(
        od.OnedistValueError, match=r"Argument group should be list of int or ProcessGroup: group='abc'"
    ):
        od.all_reduce(x, group="abc")
    for fn, kw in ((od.broadcast, "src"), (od.reduce, "dst"), (od.gather, "dst"), (od.scatter, "src")):
        with pytest.raises(
            od.OnedistValueError, match=rf"{kw}={w} is not allowed; allowed: a global rank in 0..{w - 1}"
        ):
            fn(x, **{kw: w})
        with pytest.raises(od.OnedistTypeError, match=rf"{kw} has type str"):
            fn(x, **{kw: "0"})
    if w > 1:
        with pytest.raises(
            od.OnedistValueError, match=r"src=1 is not allowed; allowed: a rank of the group \[0\]"
        ):
            od.broadcast(x, src=1, group=[0])
    with pytest.raises(od.OnedistTypeError, match="safe_mode has type int"):
        od.broadcast(x, safe_mode=1)
    with pytest.raises(od.OnedistTypeError, match="recv: tensor has type list"):
        od.recv([1])
    with pytest.raises(od.OnedistTypeError, match="isend: tensor has type dict"):
        od.isend({}, dst=0)
    with pytest.raises(od.OnedistValueError, match=r"Argument ranks should be list of int: ranks=\['a'\]"):
        od.new_group(["a"])
    with pytest.raises(od.OnedistValueError, match=r"Argument ranks should be list of int: ranks=1 "):
        od.new_group(1)
    # [] is every rank, as in torch (ignite's serial model gives the list back)
    assert od.new_group([]) == ([] if od.model_name() == "serial" else od.new_group(list(range(w))))


def check_one_element_strided_tensors() -> None:
    """x[r::w][:1] is 'contiguous' with stride 2: it must still travel (byte views need stride 1)."""
    rank, world = od.get_rank(), od.get_world_size()
    t = torch.arange(8)[rank + 1 :: 2][:1]
    assert t.stride() == (2,)
    assert od.all_gather(t).tolist() == [r + 1 for r in range(world)]
    assert od.broadcast(t, src=0).tolist() == [1]
    assert [x.tolist() for x in od.all_gather_object(t)] == [[r + 1] for r in range(world)]
    assert od.all_gather({"a": t}, nested=True)["a"].tolist() == [r + 1 for r in range(world)]
