"""A soak of mixed collectives on 3 ranks, every result checked against a local expectation.

Every rank draws the *same* sequence of operations from one seeded generator (op, value spec,
group, src/dst, dtype, shapes, layouts, async or not); a spec (see :mod:`checks_props`) describes
each rank's input, so every rank can build every rank's input and compute the exact expected
result itself. Mismatches are counted and the first ones described, not raised, so one soak shows
them all. RSS and open file descriptors are measured after a warm-up and at the end.

Known onedist bugs are kept out of the mix (each has its own strict-xfail test in
test_properties.py or test_soak.py): MEAN of bool tensors, MEAN of Python ints/bools (float32
precision), integer MEAN overflow in the dtype, Python ints beyond int64 in all_gather,
conjugate/negative-bit views, top-level int/str subclasses, the plain tensor broadcast of dtypes
gloo lacks (int16, uint16/32/64, float8), and lazily made overlapping list groups (the soak makes
its groups up front, see checks_props.SAFE_GROUP_ORDER).
"""

from __future__ import annotations

import collections
import gc
import os
import random
import struct
import time
from collections.abc import Callable
from typing import Any, Optional

import torch

import onedist as od
from checks_props import (
    LAYOUTS,
    MOVE_DTYPES,
    OPS,
    PLAIN_BROADCAST_BROKEN,
    REDUCE_DTYPES,
    build,
    describe,
    diff,
    domain_for,
    gathered,
    key_orders,
    make_groups,
    ops_for,
    reduced,
)

Spec = tuple[Any, ...]

#: (group argument, weight); lists in any order name the same cached group
GROUPS: list[tuple[Optional[list[int]], int]] = [
    (None, 10),
    ([0, 1, 2], 1),
    ([0, 2], 3),
    ([1, 2], 3),
    ([2, 0], 1),
    ([0, 1], 2),
    ([1], 1),
    ([2], 1),
]

#: operation kinds and their weights
KINDS: dict[str, int] = {
    "all_reduce": 22,
    "all_reduce_inplace": 4,
    "reduce": 7,
    "all_gather": 22,
    "all_gather_object": 7,
    "broadcast": 12,
    "gather": 6,
    "scatter": 6,
    "barrier": 4,
    "async_pair": 4,
}

_SPECIAL_FLOATS = (
    0.0,
    -0.0,
    0.1,
    0.2,
    1 / 3,
    float("inf"),
    float("-inf"),
    float("nan"),
    5e-324,
    1.7976931348623157e308,
    2.0**-40,
)
_ALPHABET = "abcXYZ019 _-é日本語😀ß\x00\n\t" + "".join(chr(c) for c in range(0x370, 0x380))


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class Soak:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)  # the same on every rank: every rank draws the same operations
        self.r = od.get_rank()
        self.w = od.get_world_size()
        self.calls: collections.Counter[str] = collections.Counter()
        self.member_calls = 0
        self.checked = 0
        self.mismatches = 0
        self.examples: list[str] = []
        self._groups = [g for g, _ in GROUPS]
        self._group_weights = [wt for _, wt in GROUPS]
        self._kinds = list(KINDS)
        self._kind_weights = list(KINDS.values())

    # ------------------------------------------------------------------ random specs (shared rng)
    def group(self) -> tuple[Any, list[int]]:
        """(the group argument: None, a list of ranks or, at times, its handle; the members)."""
        g = self.rng.choices(self._groups, self._group_weights)[0]
        as_handle = self.rng.random() < 0.2
        members = list(range(self.w)) if g is None else sorted(g)
        return (od.new_group(g) if as_handle and g is not None else g), members

    def seeds(self) -> tuple[int, int, int]:
        rng = self.rng
        return rng.randrange(2**31), rng.randrange(2**31), rng.randrange(2**31)

    def tensor_spec(self, dtypes: Any, *, uneven: bool, domain: str = "bits", layouts: Any = LAYOUTS) -> Spec:
        rng = self.rng
        dtype = rng.choice(dtypes)
        layout = rng.choice(layouts)
        if rng.random() < 0.12:
            return ("t", dtype, None, (), layout, self.seeds(), domain)  # 0-d on every rank
        trailing = tuple(rng.randint(0, 3) for _ in range(rng.choice((0, 1, 1, 2))))
        if not uneven:
            rows: tuple[int, ...] = (rng.randint(0, 4),) * 3
        else:
            rows = tuple(rng.choice((0, 0, 1, 2, 3, 5)) for _ in range(3))
            x = rng.random()
            if x < 0.004:  # uneven and >= 256 KiB: the concurrent isend/irecv exchange
                dtype, trailing = "float64", ()
                rows = (rng.choice((0, 1, 40_000)), rng.choice((0, 1, 40_000)), 36_000)
            elif x < 0.05:  # beyond the 4 KiB inline slot on some rank: the second round
                big = list(rows)
                big[rng.randrange(3)] = rng.randint(300, 900)
                rows = tuple(big)
                trailing = trailing[:1]
        return ("t", dtype, rows, trailing, layout, self.seeds(), domain)

    def py_int(self, bound: int = 2**63) -> int:
        rng = self.rng
        if rng.random() < 0.5:
            return rng.randint(-50, 50)
        return rng.randint(-bound, bound - 1)

    def py_float(self, finite: bool = False) -> float:
        rng = self.rng
        x = rng.random()
        if x < 0.3:
            v = rng.choice(_SPECIAL_FLOATS)
        elif x < 0.55:
            v = rng.randint(-400, 400) / 8
        elif x < 0.8:
            v = round(rng.uniform(-10, 10), rng.randint(0, 3))
        else:
            v = struct.unpack("<d", rng.randbytes(8))[0]
        if finite and (v != v or v in (float("inf"), float("-inf"))):
            v = 1.5
        return v

    def text(self) -> str:
        rng = self.rng
        n = rng.choice((0, 1, 3, 10)) if rng.random() < 0.95 else rng.randint(4000, 9000)
        s = "".join(rng.choice(_ALPHABET) for _ in range(min(n, 50)))
        s = (s * (n // max(len(s), 1) + 1))[:n] if n > 50 else s
        return s + ("\ud800" if rng.random() < 0.05 else "")  # a lone surrogate travels too

    def move_leaf(self, uneven: bool) -> Spec:
        rng = self.rng
        x = rng.random()
        if x < 0.45:
            return self.tensor_spec(MOVE_DTYPES, uneven=uneven)
        if x < 0.55:
            return ("i", tuple(self.py_int() for _ in range(3)))
        if x < 0.63:
            return ("f", tuple(self.py_float() for _ in range(3)))
        if x < 0.67:
            return ("b", tuple(rng.random() < 0.5 for _ in range(3)))
        if x < 0.72:  # int on one rank, float or bool on another: int64 / float64 by the rules
            pick: list[Callable[[], Any]] = [self.py_int, self.py_float, lambda: rng.random() < 0.5]
            return ("n", tuple(rng.choice(pick)() for _ in range(3)))
        if x < 0.84:
            return ("s", tuple(self.text() for _ in range(3)))
        if x < 0.88:
            return ("none",)
        payloads = (rng.randint(0, 9), self.text(), (1, "x", None), frozenset({1, 2}), b"\x00\xff")
        return ("o", tuple(rng.choice(payloads) for _ in range(3)))

    def move_spec(self, uneven: bool = True, depth: int = 0) -> Spec:
        return self._nested(lambda: self.move_leaf(uneven), 0.7, 0, "k", depth)

    def _nested(self, leaf: Callable[[], Spec], p_leaf: float, fewest: int, prefix: str, depth: int) -> Spec:
        """A leaf (with probability ``p_leaf``, always at depth 2), or a dict / list / tuple /
        namedtuple of ``fewest``..4 such specs (dict keys ``prefix0``, ``prefix1``, ...)."""
        rng = self.rng
        if depth >= 2 or rng.random() < p_leaf:
            return leaf()
        kind = rng.choice(("d", "d", "l", "tu", "nt"))

        def child() -> Spec:
            return self._nested(leaf, p_leaf, fewest, prefix, depth + 1)

        if kind == "nt":
            return ("nt", (child(), child()))
        children = tuple(child() for _ in range(rng.randint(fewest, 4)))
        if kind == "d":
            return ("d", tuple((f"{prefix}{i}", c) for i, c in enumerate(children)))
        return (kind, children)

    def reduce_leaf(self, op: str) -> Spec:
        rng = self.rng
        if rng.random() < 0.5:
            dtypes = [d for d in REDUCE_DTYPES if op in ops_for(d) and not (d == "bool" and op == "MEAN")]
            dtype = rng.choice(dtypes)
            return self.tensor_spec([dtype], uneven=False, domain=domain_for(dtype, op))
        kinds = ["f"] if op == "MEAN" else (["i", "b"] if op in ("AND", "OR") else ["i", "f", "b"])
        kind = rng.choice(kinds)
        if kind == "i":
            bound = {"SUM": 2**61, "PRODUCT": 2**20}.get(op, 2**63)
            return ("i", tuple(self.py_int(bound) for _ in range(3)))
        if kind == "f":
            return ("f", tuple(self.py_float(finite=True) for _ in range(3)))
        return ("b", tuple(rng.random() < 0.5 for _ in range(3)))

    def reduce_spec(self, op: str, depth: int = 0) -> Spec:
        return self._nested(lambda: self.reduce_leaf(op), 0.6, 1, "m", depth)

    # ------------------------------------------------------------------ bookkeeping
    def record(self, kind: str, member: bool, problems: list[str], context: str) -> None:
        self.calls[kind] += 1
        self.member_calls += member
        self.checked += 1
        if problems:
            self.mismatches += 1
            if len(self.examples) < 30:
                self.examples.append(f"{context}: " + "; ".join(problems[:3]))

    def step(self, step: int) -> None:
        kind = self.rng.choices(self._kinds, self._kind_weights)[0]
        try:
            getattr(self, f"op_{kind}")(step)
        except Exception as e:
            raise AssertionError(f"rank {self.r}, step {step} ({kind}): {type(e).__name__}: {e}") from e

    # ------------------------------------------------------------------ operations
    def op_all_reduce(self, step: int) -> None:
        op = self.rng.choice(OPS)
        spec = self.reduce_spec(op)
        group, members = self.group()
        is_async = self.rng.random() < 0.1
        value = build(spec, self.r)
        out = od.all_reduce(value, op=op, group=group, async_op=is_async, inplace=False)
        got = out.wait() if is_async else out
        if self.r in members:
            problems = diff(got, reduced(spec, op, members, self.r), "result", bits=False)
            problems += key_orders(got, value, "result")
        else:
            problems = [] if got is value else ["a non-member must get its input back"]
        problems += diff(value, build(spec, self.r), "input afterwards")
        self.record(
            "all_reduce", self.r in members, problems, f"step {step} all_reduce {op} {members} {spec!r:.300}"
        )

    def op_all_reduce_inplace(self, step: int) -> None:
        rng = self.rng
        op = rng.choice(("SUM", "PRODUCT", "MIN", "MAX", "MEAN"))
        floats = ("float16", "bfloat16", "float32", "float64")
        dtypes = floats if op == "MEAN" else (*floats, "int8", "int32", "int64", "uint8", "int16")
        layouts = [x for x in LAYOUTS if x != "expand"]  # in-place into overlapping memory is invalid
        group, members = self.group()
        nested = rng.random() < 0.3
        leaves = [self.tensor_spec(dtypes, uneven=False, layouts=layouts) for _ in range(3 if nested else 1)]
        leaves = [(s[0], s[1], s[2], s[3], s[4], s[5], domain_for(s[1], op)) for s in leaves]
        spec: Spec = ("d", tuple((f"x{i}", s) for i, s in enumerate(leaves))) if nested else leaves[0]
        value = build(spec, self.r)
        got = od.all_reduce(value, op=op, group=group, inplace=True)
        tensors = list(value.values()) if nested else [value]
        outs = list(got.values()) if nested else [got]
        problems = [] if all(a is b for a, b in zip(outs, tensors)) else ["inplace must return the inputs"]
        if self.r in members:
            problems += diff(value, reduced(spec, op, members, self.r), "input", bits=False)
        else:
            problems += diff(value, build(spec, self.r), "non-member input")
        self.record(
            "all_reduce_inplace",
            self.r in members,
            problems,
            f"step {step} inplace {op} {members} {spec!r:.300}",
        )

    def op_reduce(self, step: int) -> None:
        op = self.rng.choice(OPS)
        spec = self.reduce_spec(op)
        group, members = self.group()
        dst = self.rng.choice(members)
        value = build(spec, self.r)
        got = od.reduce(value, dst=dst, op=op, group=group)
        if self.r == dst:
            problems = diff(got, reduced(spec, op, members, self.r), "result", bits=False)
        else:
            problems = [] if got is value else ["a rank other than dst must get its input back"]
        problems += diff(value, build(spec, self.r), "input afterwards")
        ctx = f"step {step} reduce {op} dst={dst} {members} {spec!r:.300}"
        self.record("reduce", self.r in members, problems, ctx)

    def op_all_gather(self, step: int) -> None:
        spec = self.move_spec()
        group, members = self.group()
        is_async = self.rng.random() < 0.1
        value = build(spec, self.r)
        out = od.all_gather(value, group=group, async_op=is_async, nested=True)
        got = out.wait() if is_async else out
        if self.r in members:
            problems = diff(got, gathered(spec, members), "result")
        else:
            problems = [] if got is value else ["a non-member must get its input back"]
        problems += diff(value, build(spec, self.r), "input afterwards")
        self.record(
            "all_gather", self.r in members, problems, f"step {step} all_gather {members} {spec!r:.300}"
        )

    def op_all_gather_object(self, step: int) -> None:
        spec = self.move_spec()
        group, members = self.group()
        value = build(spec, self.r)
        got = od.all_gather_object(value, group=group)
        if self.r in members:
            problems = diff(got, [build(spec, q) for q in members], "result")
        else:
            problems = (
                [] if type(got) is list and len(got) == 1 and got[0] is value else ["non-member: [input]"]
            )
        self.record(
            "all_gather_object",
            self.r in members,
            problems,
            f"step {step} all_gather_object {members} {spec!r:.300}",
        )

    def op_broadcast(self, step: int) -> None:
        rng = self.rng
        spec = self.move_spec()
        group, members = self.group()
        src = rng.choice(members)
        plain = rng.random() < 0.6 and spec[0] == "t" and spec[1] not in PLAIN_BROADCAST_BROKEN
        is_async = rng.random() < 0.1
        junk = rng.choice((None, "ignored", 0))  # drawn on every rank: the draws must stay in step
        exp = build(spec, src)
        if self.r == src:
            mine = build(spec, self.r)
        elif plain:  # receivers pass a tensor of the source's shape and dtype
            mine = torch.empty(exp.shape, dtype=exp.dtype)
        else:  # ignored on non-source ranks: anything goes
            mine = junk
        if plain:
            out = od.broadcast(mine, src=src, group=group, async_op=is_async)
        else:  # any value: onedist's broadcast_object (broadcast with safe_mode for ignite's kinds)
            out = od.broadcast_object(mine, src=src, group=group, async_op=is_async)
        got = out.wait() if is_async else out
        if self.r == src or self.r not in members:
            problems = [] if got is mine else ["the source / a non-member must get its input back"]
        else:
            problems = diff(got, exp, "result")
        ctx = f"step {step} broadcast src={src} {members} {spec!r:.300}"
        self.record("broadcast", self.r in members, problems, ctx)

    def op_gather(self, step: int) -> None:
        spec = self.move_spec()
        group, members = self.group()
        dst = self.rng.choice(members)
        value = build(spec, self.r)
        got = od.gather(value, dst=dst, group=group)
        if self.r == dst:
            problems = diff(got, [build(spec, q) for q in members], "result")
        else:
            problems = [] if type(got) is list and not got else [f"not dst: got {describe(got)}, expected []"]
        self.record(
            "gather", self.r in members, problems, f"step {step} gather dst={dst} {members} {spec!r:.300}"
        )

    def op_scatter(self, step: int) -> None:
        spec = self.move_spec()
        group, members = self.group()
        src = self.rng.choice(members)
        items = [build(spec, q) for q in members] if self.r == src else None
        got = od.scatter(items, src=src, group=group)
        if self.r not in members:
            problems = [] if got is None else ["a non-member must get None"]
        elif items is not None:
            problems = [] if got is items[members.index(self.r)] else ["the source must get its own item"]
        else:
            problems = diff(got, build(spec, self.r), "result")
        self.record(
            "scatter", self.r in members, problems, f"step {step} scatter src={src} {members} {spec!r:.300}"
        )

    def op_barrier(self, step: int) -> None:
        group, members = self.group()
        if self.rng.random() < 0.3:
            got = od.barrier(group=group, async_op=True).wait()
        else:
            got = od.barrier(group=group)
        self.record(
            "barrier",
            self.r in members,
            [] if got is None else [f"got {got!r}"],
            f"step {step} barrier {members}",
        )

    def op_async_pair(self, step: int) -> None:
        """Two collectives in flight at once (possibly on different groups), waited in order."""
        op = self.rng.choice(OPS)
        spec1 = self.reduce_spec(op)
        group1, members1 = self.group()
        spec2 = self.move_spec()
        group2, members2 = self.group()
        v1, v2 = build(spec1, self.r), build(spec2, self.r)
        h1 = od.all_reduce(v1, op=op, group=group1, async_op=True, inplace=False)
        h2 = od.all_gather(v2, group=group2, async_op=True, nested=True)
        got1, got2 = h1.wait(), h2.wait()
        if self.r in members1:
            p1 = diff(got1, reduced(spec1, op, members1, self.r), "all_reduce", bits=False)
        else:
            p1 = [] if got1 is v1 else ["all_reduce: a non-member must get its input back"]
        if self.r in members2:
            p2 = diff(got2, gathered(spec2, members2), "all_gather")
        else:
            p2 = [] if got2 is v2 else ["all_gather: a non-member must get its input back"]
        ctx = f"step {step} async {op} {members1} {spec1!r:.200} / {members2} {spec2!r:.200}"
        self.record("async_all_reduce", self.r in members1, p1, ctx)
        self.record("async_all_gather", self.r in members2, p2, ctx)


def check_soak(seed: int, steps: int, warmup: int) -> dict[str, Any]:
    """``warmup`` steps, then RSS/fds, then ``steps`` steps timed, then RSS/fds again."""
    assert od.get_world_size() == 3, "the soak is written for 3 ranks"
    make_groups(3)  # every group the soak uses, in an order that cannot deadlock
    soak = Soak(seed)
    for step in range(warmup):
        soak.step(step)
    od.barrier()
    gc.collect()
    rss0, fds0 = rss_kb(), open_fds()
    checked0 = soak.checked
    t0 = time.perf_counter()
    for step in range(warmup, warmup + steps):
        soak.step(step)
    od.barrier()
    seconds = time.perf_counter() - t0
    gc.collect()
    rss1, fds1 = rss_kb(), open_fds()
    timed = soak.checked - checked0
    return {
        "rank": soak.r,
        "collectives": soak.checked,
        "timed_collectives": timed,
        "member_collectives": soak.member_calls,
        "by_kind": dict(soak.calls),
        "mismatches": soak.mismatches,
        "examples": soak.examples,
        "seconds": seconds,
        "ops_per_s": timed / seconds,
        "rss_kb": (rss0, rss1),
        "fds": (fds0, fds1),
    }


def check_overlapping_list_groups() -> list[int]:
    """Two list groups sharing rank 0, used by every rank (non-members get their input back)."""
    r = od.get_rank()
    out = [od.all_reduce(1, group=[0, 1]), od.all_reduce(1, group=[0, 2])]
    assert out == [2 if r in (0, 1) else 1, 2 if r in (0, 2) else 1], out
    return out
