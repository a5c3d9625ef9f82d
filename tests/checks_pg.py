"""Checks of onedist's Python process groups (``shm``; ``mpi`` over mpi4py), run on every rank.

The reference is gloo in the same processes, on the same inputs: the gloo group each shm group
keeps beside it (``pg._gloo``), or a gloo group made on the default store. Integer results must be
equal bit for bit, floating-point results equal within summation-order tolerance, and every rank
must hold the same bits. shm pools use 64 KiB slots, so the sizes below cross chunk boundaries.
"""

from __future__ import annotations

import hashlib
import os
import time
import warnings
from typing import Any

import torch
import torch._C._distributed_c10d as _c10d
import torch.distributed as dist

import onedist as od


def _slot() -> int:
    """This pool's slot size in bytes (read when a check runs: pools set it after importing us)."""
    return int(float(os.environ.get("ONEDIST_SHM_CHUNK_MB", "4")) * (1 << 20))


INT_DTYPES = [torch.uint8, torch.int8, torch.int32, torch.int64]  # gloo has no int16 reduction
FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
OPS = {
    "SUM": dist.ReduceOp.SUM,
    "MAX": dist.ReduceOp.MAX,
    "MIN": dist.ReduceOp.MIN,
    "PRODUCT": dist.ReduceOp.PRODUCT,
    "AVG": dist.ReduceOp.AVG,  # floating point only (gloo refuses integers)
    "BAND": dist.ReduceOp.BAND,  # the bitwise ops: integers only
    "BOR": dist.ReduceOp.BOR,
    "BXOR": dist.ReduceOp.BXOR,
}
TOL = {torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float32: 1e-5, torch.float64: 1e-12}


_GROUPS = ("ShmProcessGroup", "MpiProcessGroup")
_gloo_groups: dict[int, object] = {}


def _pg():
    pg = dist.group.WORLD
    assert type(pg).__name__ in _GROUPS, type(pg)
    # a shm group over several hosts has shared memory on each host with more than one rank
    assert getattr(pg, "uses_shared_memory", True) or len(pg._hosts) > 1, "shm fell back to gloo"
    return pg


def _gloo(pg):
    """A gloo backend over the same ranks, for reference results."""
    if type(pg).__name__ == "ShmProcessGroup":
        return pg._gloo
    key = id(pg)
    if key not in _gloo_groups:
        group = dist.new_group(backend="gloo")
        _gloo_groups[key] = group._get_backend(torch.device("cpu"))
    return _gloo_groups[key]


def _sizes(dtype: torch.dtype) -> list[int]:
    per = _slot() // torch.empty(0, dtype=dtype).element_size()  # elements in one slot
    return [0, 1, 7, 1000, per - 1, per, per + 13, 3 * per + 5]


def _data(n: int, dtype: torch.dtype, op: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    if op == "PRODUCT":
        return torch.randint(1, 3, (n,), generator=g).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -1000), min(info.max, 1000)
    return torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(dtype)


def _same_on_every_rank(t: torch.Tensor) -> None:
    digest = hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    digests = od.all_gather(digest)
    assert len(set(digests)) == 1, digests


def _compare(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, (what, ours.dtype, ours.shape, ref.shape)
    if ours.dtype.is_floating_point:
        tol = TOL[ours.dtype]
        assert torch.allclose(ours.double(), ref.double(), rtol=tol, atol=tol * 8), what
    else:
        assert torch.equal(ours, ref), what


def check_all_reduce_equals_gloo() -> int:
    """Every dtype gloo reduces x every op it takes on that dtype x sizes from 0 to several slots."""
    pg, rank = _pg(), od.get_rank()
    done = 0
    for dtype in INT_DTYPES + FLOAT_DTYPES:
        for name, op in OPS.items():
            if name == "PRODUCT" and dtype.is_floating_point:
                continue  # float products of randn overflow/underflow alike; covered by ints
            if name == "AVG" and not dtype.is_floating_point:
                continue  # gloo averages floats only
            if name in ("BAND", "BOR", "BXOR") and dtype.is_floating_point:
                continue  # and the bitwise ops take integers only
            for n in _sizes(dtype):
                x = _data(n, dtype, name, seed=1000 * rank + n)
                ours, ref = x.clone(), x.clone()
                dist.all_reduce(ours, op)
                opts = _c10d.AllreduceOptions()
                opts.reduceOp = op
                _gloo(pg).allreduce([ref], opts).wait()
                _compare(ours, ref, f"all_reduce {name} {dtype} n={n}")
                _same_on_every_rank(ours)
                done += 1
    return done


def check_non_contiguous_and_views() -> None:
    rank = od.get_rank()
    base = torch.arange(6 * 40000, dtype=torch.float64).view(6, 40000) * (rank + 1)
    t = base.t()  # non-contiguous, crosses slots
    dist.all_reduce(t)
    world = od.get_world_size()
    expect = torch.arange(6 * 40000, dtype=torch.float64).view(6, 40000).t() * (world * (world + 1) // 2)
    assert torch.equal(t, expect)
    assert torch.equal(base, expect.t())  # written back into the viewed storage
    sl = torch.zeros(10, dtype=torch.int32)
    sl[::2] = rank + 1
    dist.all_reduce(sl[::2])
    assert sl.tolist() == [world * (world + 1) // 2, 0] * 5


def check_copy_collectives_equal_gloo() -> None:
    """all_gather (list and single tensor), broadcast from every root, reduce_scatter: exact."""
    pg, rank, world = _pg(), od.get_rank(), od.get_world_size()
    for dtype in [
        torch.uint8,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.bool,
        torch.complex64,
    ]:
        for n in [0, 1, 3, _slot() // 8 + 3, _slot() + 1]:
            g = torch.Generator().manual_seed(rank * 7 + n)
            x = (
                (torch.randn(n, generator=g) * 100).to(dtype)
                if dtype != torch.bool
                else torch.rand(n, generator=g) > 0.5
            )
            out, ref = torch.empty(world * n, dtype=dtype), torch.empty(world * n, dtype=dtype)
            dist.all_gather_into_tensor(out, x)
            # gloo moves bytes of any dtype when asked to move bytes
            _gloo(pg)._allgather_base(
                ref.view(torch.uint8), x.view(torch.uint8), _c10d.AllgatherOptions()
            ).wait()
            assert torch.equal(out, ref), ("all_gather_into_tensor", dtype, n)
            parts = [torch.empty(n, dtype=dtype) for _ in range(world)]
            dist.all_gather(parts, x)
            assert torch.equal(torch.cat(parts), ref), ("all_gather", dtype, n)
            for root in range(world):
                b = x.clone()
                dist.broadcast(b, src=root)
                expect = od.broadcast(x, src=root)  # onedist's own broadcast, through the same group
                assert torch.equal(b, expect), ("broadcast", dtype, n, root)
    # all_gather_coalesced: outputs[r][i] is rank r's input i; with as many inputs as ranks a
    # transposed result has the right shapes, so check values, and one input more than ranks too
    for n_in in (world, world + 1):
        ins = [torch.full((2,), float(10 * rank + i)) for i in range(n_in)]
        outs = [[torch.empty(2) for _ in range(n_in)] for _ in range(world)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecated by torch, still a collective
            dist.all_gather_coalesced(outs, ins)
        got = [[o.tolist() for o in row] for row in outs]
        assert got == [[[float(10 * r + i)] * 2 for i in range(n_in)] for r in range(world)], got
    for dtype in [torch.int32, torch.float32]:
        for n in [0, 1, _slot() // 4 // world + 3]:
            x = _data(world * n, dtype, "SUM", seed=rank)
            out = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(out, x)
            full = x.clone()
            _gloo(pg).allreduce([full]).wait()
            _compare(out, full[rank * n : (rank + 1) * n], f"reduce_scatter {dtype} n={n}")
            if dtype.is_floating_point:
                dist.reduce_scatter_tensor(out, x, op=dist.ReduceOp.AVG)
                _compare(out, full[rank * n : (rank + 1) * n] / world, f"reduce_scatter AVG n={n}")


def _block(src: int, dst: int, rows: int, dtype: torch.dtype, width: int = 3) -> torch.Tensor:
    """What rank ``src`` sends rank ``dst`` in the exchange checks: known to both."""
    x = torch.arange(rows * width).reshape(rows, width) + 1000 * src + 100 * dst
    return (x % 2 == 1) if dtype == torch.bool else x.to(dtype)


def check_gather_scatter_all_to_all_exact() -> int:
    """gather and scatter from every root, all_to_all_single (equal and uneven splits) and the list
    all_to_all: every rank gets exactly what was sent, for sizes from nothing to several slots (a
    gather or scatter goes in chunks; an all_to_all where some rank sends more than a slot goes to
    gloo, on every rank), several dtypes, non-contiguous inputs and outputs."""
    rank, world = od.get_rank(), od.get_world_size()
    done = 0
    for dtype in [torch.uint8, torch.int64, torch.bfloat16, torch.float64, torch.bool, torch.complex64]:
        row = 3 * torch.empty(0, dtype=dtype).element_size()  # bytes per row of a block
        big = _slot() // row + 2  # rows: more than one slot
        for rows in [0, 1, 5, big, 2 * big + 1]:
            for root in range(world):
                outs = [torch.empty(rows, 3, dtype=dtype) for _ in range(world)] if rank == root else None
                dist.gather(_block(rank, root, rows, dtype).t().contiguous().t(), outs, dst=root)
                if outs is not None:
                    for q, o in enumerate(outs):
                        assert torch.equal(o, _block(q, root, rows, dtype)), ("gather", dtype, rows, root, q)
                got = torch.empty(3, rows, dtype=dtype).t()  # non-contiguous output
                pieces = [_block(root, q, rows, dtype) for q in range(world)] if rank == root else None
                dist.scatter(got, pieces, src=root)
                assert torch.equal(got, _block(root, rank, rows, dtype)), ("scatter", dtype, rows, root)
                done += 2
        # all_to_all_single, equal splits
        for rows in [0, 2, big]:
            inp = torch.cat([_block(rank, q, rows, dtype) for q in range(world)])
            out = torch.empty(world * rows, 3, dtype=dtype)
            dist.all_to_all_single(out, inp)
            assert torch.equal(out, torch.cat([_block(q, rank, rows, dtype) for q in range(world)])), (
                "all_to_all_single",
                dtype,
                rows,
            )
            done += 1
        # uneven: rank p sends rank q sizes[p][q] rows; in the last round rank 0 alone sends more
        # than a slot, so every rank goes to gloo
        for scale in [1, 7, big]:
            sizes = [
                [((q + 3 * p) % 4) * (scale if p == 0 else min(scale, 7)) for q in range(world)]
                for p in range(world)
            ]
            inp = torch.cat([_block(rank, q, sizes[rank][q], dtype) for q in range(world)])
            inp = inp.t().contiguous().t()  # non-contiguous
            out_splits = [sizes[p][rank] for p in range(world)]
            out = torch.empty(3, sum(out_splits), dtype=dtype).t()
            dist.all_to_all_single(out, inp, out_splits, sizes[rank])
            expect = torch.cat([_block(p, rank, sizes[p][rank], dtype) for p in range(world)])
            assert torch.equal(out, expect), ("all_to_all_single uneven", dtype, scale)
            outs = [torch.empty(sizes[p][rank], 3, dtype=dtype) for p in range(world)]
            dist.all_to_all(outs, [_block(rank, q, sizes[rank][q], dtype) for q in range(world)])
            for p, o in enumerate(outs):
                assert torch.equal(o, _block(p, rank, sizes[p][rank], dtype)), ("all_to_all", dtype, scale, p)
            done += 2
    return done


def check_group_thread_lets_go_of_tensors() -> bool:
    """A collective of 1 MB or more runs on the group's thread; once it is done, the thread keeps
    no reference to its tensors (it kept the last one's until the next job came, so a large result
    outlived its caller and its free landed in the next collective's time)."""
    import gc
    import weakref

    world = od.get_world_size()
    inp = torch.full((1 << 19,), float(od.get_rank()))  # 2 MB: the group's thread runs it
    out = torch.empty(world << 19)
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, inp)
    assert out[-1].item() == world - 1
    alive = weakref.ref(out)
    del out
    deadline = time.monotonic() + 5.0
    while alive() is not None and time.monotonic() < deadline:  # the thread lets go just after
        gc.collect()
        time.sleep(0.01)
    return alive() is None


def forbid_cross_memory_reads() -> None:
    """Make the kernel refuse this process's ``process_vm_readv`` (EPERM), in every thread, as
    Docker's default seccomp profile does: a real refusal, for the fallback test (x86-64 only,
    as the shm backend)."""
    import ctypes
    import struct as _struct

    ld_abs, jeq, ret = 0x20, 0x15, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET|BPF_K
    program = [(ld_abs, 0, 0, 0), (jeq, 0, 1, 310), (ret, 0, 0, 0x00050000 | 1), (ret, 0, 0, 0x7FFF0000)]
    code = ctypes.create_string_buffer(b"".join(_struct.pack("<HBBI", *op) for op in program))

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = Program(len(program), ctypes.addressof(code))
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
    # seccomp(SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC): the group's thread too
    assert libc.syscall(317, 1, 1, ctypes.byref(prog)) == 0, ctypes.get_errno()


def check_all_to_all_reads_directly_then_falls_back() -> list[bool]:
    """An all_to_all larger than a slot: each rank reads its parts straight out of the peers'
    inputs while every rank can; once the kernel refuses one rank's reads, every rank sees its
    vote, all move the parts through the slots instead (the results still exact), and the group
    stops trying. Returns this rank's read results, call by call."""
    from onedist.backends import cma

    rank, world, pg = od.get_rank(), od.get_world_size(), _pg()
    results: list[bool] = []
    real = cma.read_pieces

    def observed(*args: Any) -> bool:
        ok = real(*args)
        results.append(ok)
        return ok

    big = _slot() // 24 + 2  # rows of 3 int64: more than a slot per peer

    def exchange() -> None:
        inp = torch.cat([_block(rank, q, big + q, torch.int64) for q in range(world)])
        out = torch.empty(sum(big + rank for _ in range(world)), 3, dtype=torch.int64)
        dist.all_to_all_single(out, inp, [big + rank] * world, [big + q for q in range(world)])
        assert torch.equal(out, torch.cat([_block(p, rank, big + rank, torch.int64) for p in range(world)]))

    cma.read_pieces = observed
    try:
        exchange()
        assert pg._cma and results == [True], results
        if rank == 1:
            forbid_cross_memory_reads()
        exchange()
        assert not pg._cma, "the group still reads directly after a refused read"
        exchange()  # the rounds from the start: no read tried
    finally:
        cma.read_pieces = real
    return results


def check_all_to_all_without_direct_reads_on_one_rank() -> int:
    """A rank with ``ONEDIST_SHM_CMA=0``: no rank reads directly, every exchange goes in rounds."""
    from onedist.backends import cma

    rank, world = od.get_rank(), od.get_world_size()
    real, tried = cma.read_pieces, []
    cma.read_pieces = lambda *args: tried.append(1) or real(*args)  # type: ignore[assignment]
    try:
        done = check_gather_scatter_all_to_all_exact()
    finally:
        cma.read_pieces = real
    assert not tried, f"rank {rank} of {world} read directly"
    return done


def _step_input(step: int, rank: int, n: int) -> torch.Tensor:
    return torch.randint(-1000, 1000, (n,), generator=torch.Generator().manual_seed(step * 1009 + rank))


def check_back_to_back_collectives_under_skew(steps: int = 120) -> int:
    """Mixed collectives, back to back with no synchronisation between them but their own, while
    each rank lags at random: a collective that began writing the segment before a slow peer had
    read the previous one's result would corrupt it. Every result is checked against values each
    rank computes from every rank's inputs (int64: exact), with no communication in between."""
    rank, world = od.get_rank(), od.get_world_size()
    shared = torch.Generator().manual_seed(4242)  # the same sequence of calls on every rank
    lag = torch.Generator().manual_seed(rank)  # a different lag on each rank
    slot = _slot() // 8  # int64 elements in one slot
    bad = []
    for step in range(steps):
        kind = int(torch.randint(10, (1,), generator=shared))
        n = int(torch.randint(1, 3 * slot + 40, (1,), generator=shared))
        root = int(torch.randint(world, (1,), generator=shared))
        if float(torch.rand(1, generator=lag)) < 0.3:
            time.sleep(float(torch.rand(1, generator=lag)) * 0.003)
        xs = [_step_input(step, r, n) for r in range(world)]
        mine = xs[rank].clone()
        if kind == 0:
            dist.all_reduce(mine)
            expect = torch.stack(xs).sum(0)
        elif kind == 1:
            dist.broadcast(mine, src=root)
            expect = xs[root]
        elif kind == 2:
            out = torch.empty(world * n, dtype=torch.int64)
            dist.all_gather_into_tensor(out, mine)
            mine, expect = out, torch.cat(xs)
        elif kind == 3:
            m = n // world + 1
            ins = [_step_input(step, r, world * m) for r in range(world)]
            mine = torch.empty(m, dtype=torch.int64)
            dist.reduce_scatter_tensor(mine, ins[rank])
            expect = torch.stack(ins).sum(0)[rank * m : (rank + 1) * m]
        elif kind == 4:
            dist.reduce(mine, dst=root, op=dist.ReduceOp.MAX)
            expect = torch.stack(xs).amax(0) if rank == root else xs[rank]
        elif kind == 6:
            outs = [torch.empty(n, dtype=torch.int64) for _ in range(world)] if rank == root else None
            dist.gather(mine, outs, dst=root)
            if outs is not None:
                mine, expect = torch.cat(outs), torch.cat(xs)
            else:
                expect = xs[rank]
        elif kind == 7:
            got = torch.empty(n, dtype=torch.int64)
            dist.scatter(got, xs if rank == root else None, src=root)
            mine, expect = got, xs[rank]
        elif kind == 8:  # uneven all_to_all: rank p sends rank q sizes[p][q] elements
            sizes = [[(n * (p + 2 * q + 1)) // (3 * world) for q in range(world)] for p in range(world)]

            def part(p: int, q: int, step: int = step, sizes: list[list[int]] = sizes) -> torch.Tensor:
                return _step_input(step, 100 + p * world + q, sizes[p][q])

            got = torch.empty(sum(sizes[p][rank] for p in range(world)), dtype=torch.int64)
            dist.all_to_all_single(
                got,
                torch.cat([part(rank, q) for q in range(world)]),
                [sizes[p][rank] for p in range(world)],
                sizes[rank],
            )
            mine, expect = got, torch.cat([part(p, rank) for p in range(world)])
        elif kind == 9:  # onedist's all_gather of tensors whose sizes differ
            mine = od.all_gather(xs[rank][: max(0, n - 5 * rank)])
            expect = torch.cat([x[: max(0, n - 5 * r)] for r, x in enumerate(xs)])
        else:  # small all_reduces (one step each) back to back, the later ones lagging less
            m = n % 2000 + 1
            small = [xs[r][:m] for r in range(world)]
            outs = [small[rank].clone() + i for i in range(3)]
            for o in outs:
                dist.all_reduce(o)
                if float(torch.rand(1, generator=lag)) < 0.3:
                    time.sleep(0.001)
            mine, expect = (
                torch.cat(outs),
                torch.cat([torch.stack(small).sum(0) + world * i for i in range(3)]),
            )
        if not torch.equal(mine, expect):
            names = ["all_reduce", "broadcast", "all_gather", "reduce_scatter", "reduce"]
            names += ["gather", "scatter", "all_to_all", "od.all_gather uneven", "small all_reduces"]
            bad.append((step, names[kind], n))
    assert not bad, bad
    return steps


def check_reduce_and_barrier_and_gloo_ops() -> None:
    rank, world = od.get_rank(), od.get_world_size()
    for root in range(world):
        t = torch.full((_slot() // 4 + 9,), float(rank + 1))
        dist.reduce(t, dst=root)
        if rank == root:
            assert torch.all(t == world * (world + 1) / 2)
        t = torch.full((7,), float(rank + 1))
        dist.reduce(t, dst=root, op=dist.ReduceOp.AVG)
        if rank == root:  # the others' tensors are undefined after a reduce (gloo writes into them)
            assert torch.all(t == (world + 1) / 2), (root, t)
    for _ in range(50):
        dist.barrier()
    # shm delegates these to its gloo group: gather, scatter, all_to_all, send/recv
    g = [torch.empty(2) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank)), g, dst=0)
    if rank == 0:
        assert [v[0].item() for v in g] == list(range(world))
    out = torch.empty(world, dtype=torch.int64)
    dist.all_to_all_single(out, torch.arange(world, dtype=torch.int64) + 10 * rank)
    assert out.tolist() == [10 * r + rank for r in range(world)]
    if world > 1:
        if rank == 0:
            dist.send(torch.tensor([42]), dst=1)
        elif rank == 1:
            r = torch.zeros(1, dtype=torch.int64)
            dist.recv(r, src=0)
            assert r.item() == 42


def check_timeout_in_torchs_words() -> None:
    """A collective that times out raises in the words torch's own tests match for gloo
    (" Timed out ", "Timed out waiting <N>ms"); the other groups stay usable."""
    from datetime import timedelta

    import pytest

    rank = od.get_rank()
    group = dist.new_group(timeout=timedelta(seconds=1))  # every rank makes it; only rank 0 calls it
    if rank == 0:
        with pytest.raises(RuntimeError, match=r" (Timed out|closed|timeout) ") as e:
            dist.barrier(group=group)
        assert "Timed out waiting 1000ms" in str(e.value), str(e.value)
        if type(group).__name__ == "MpiProcessGroup":  # its barrier is still pending in MPI
            with pytest.raises(RuntimeError, match="the group is unusable since a barrier on rank 0 timed"):
                dist.all_reduce(torch.ones(1), group=group)
    dist.barrier()
    assert od.all_reduce(1) == od.get_world_size()


def check_sparse_all_reduce_sums_like_gloo() -> None:
    """A sparse COO all_reduce (SUM, as gloo's) leaves every rank's tensor the coalesced sum:
    entries that several ranks hold add up, an index repeated on one rank counts twice, values
    have a dense dimension, and one rank may contribute nothing."""
    rank, world = od.get_rank(), od.get_world_size()

    def contribution(r: int) -> torch.Tensor:
        if r == 1:  # an empty part
            return torch.sparse_coo_tensor(torch.zeros(2, 0, dtype=torch.int64), torch.zeros(0, 3), (9, 4, 3))
        indices = torch.tensor([[0, r, r, 5 + r], [1, 2, 2, 0]])  # (0, 1) on every rank, (r, 2) twice
        values = torch.arange(12, dtype=torch.float32).view(4, 3) + 10 * r
        return torch.sparse_coo_tensor(indices, values, (9, 4, 3))

    t = contribution(rank)
    dist.all_reduce(t)
    expected = sum(contribution(r).to_dense() for r in range(world))
    assert t.is_sparse and t.is_coalesced(), t
    assert torch.equal(t.to_dense(), expected)


def check_sub_groups() -> None:
    """Groups of a subset of ranks (shm: their own segment); ranks outside a group skip it."""
    rank, world = od.get_rank(), od.get_world_size()
    members = list(range(1, world))
    s = od.all_reduce(torch.tensor([rank + 1]), group=members)
    if rank in members:
        assert s.item() == sum(r + 1 for r in members)
    evens = [r for r in range(world) if r % 2 == 0]
    s = od.all_reduce(float(rank), group=evens)
    if rank in evens:
        assert s == float(sum(evens))


def _train(model: torch.nn.Module, group, steps: int = 5) -> torch.nn.Module:
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(od.get_rank())
    for _ in range(steps):
        x = torch.randn(16, 64, generator=g)
        opt.zero_grad()
        ddp(x).pow(2).mean().backward()
        opt.step()
    return ddp.module


def check_ddp_equals_gloo() -> float:
    """DDP over the group under test and DDP over a gloo group, same start and data: same parameters."""

    def net() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64))

    ours = _train(net(), None)
    gloo = dist.new_group(backend="gloo")
    ref = _train(net(), gloo)
    flat_ours = torch.cat([p.detach().flatten() for p in ours.parameters()])
    flat_ref = torch.cat([p.detach().flatten() for p in ref.parameters()])
    spread_ours = od.all_reduce(flat_ours.clone(), "MAX") - od.all_reduce(flat_ours.clone(), "MIN")
    spread_ref = od.all_reduce(flat_ref.clone(), "MAX") - od.all_reduce(flat_ref.clone(), "MIN")
    diff = float((flat_ours - flat_ref).abs().max())
    info = {"diff": diff, "spread ours": float(spread_ours.max()), "spread gloo": float(spread_ref.max())}
    assert diff < 1e-5 and info["spread ours"] == 0.0, info
    return diff


def check_fsdp2_and_functional_collectives_equal_gloo() -> float:
    """What torch's newer parallelism runs on: the group's name (DeviceMesh and the functional
    collectives find a group by it), the functional collectives, which call the coalesced forms
    from C++, and FSDP2 (fully_shard) training, against the same on a gloo group."""
    import torch.distributed._functional_collectives as fc
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    pg, rank, world = dist.group.WORLD, od.get_rank(), od.get_world_size()
    assert pg.group_name and dist.distributed_c10d._resolve_process_group(pg.group_name) is pg
    x = torch.arange(6, dtype=torch.float32) + 10 * rank
    every = torch.cat([torch.arange(6, dtype=torch.float32) + 10 * r for r in range(world)])
    assert torch.equal(fc.all_gather_tensor(x, 0, pg).wait(), every)
    assert torch.equal(fc.all_reduce(x, "sum", pg).wait(), every.view(world, 6).sum(0))
    total = torch.arange(6 * world, dtype=torch.float32) * world
    assert torch.equal(
        fc.reduce_scatter_tensor(torch.arange(6 * world, dtype=torch.float32), "sum", 0, pg).wait(),
        total[6 * rank : 6 * (rank + 1)],
    )
    pair = fc.all_gather_into_tensor_coalesced([x, x * 2], pg)
    assert torch.equal(pair[0].wait(), every) and torch.equal(pair[1].wait(), every * 2)

    def train(group) -> torch.Tensor:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 32, generator=g)).square().mean().backward()
            opt.step()
        return torch.cat([p.full_tensor().detach().flatten() for p in model.parameters()])

    diff = float((train(pg) - train(dist.new_group(backend="gloo"))).abs().max())
    assert diff < 1e-5, diff
    return diff


def check_bad_arguments_raise_and_leave_the_group_usable() -> int:
    """Each call gloo refuses raises on every rank, naming what is wrong, before anything moves:
    the next collective on the same group still gives the right result. Without the checks a
    wrong size read or wrote past a tensor's part (all_gather_into_tensor, on mpi: silently), and
    an op a dtype cannot take failed halfway and broke the shm group."""
    rank, world = od.get_rank(), od.get_world_size()
    big = _slot() // 4 + 5  # the chunked path too
    R, ones, last = dist.ReduceOp, torch.ones, world - 1
    cases = [
        ("needs an integer", lambda: dist.all_reduce(ones(4), R.BAND)),
        ("needs an integer", lambda: dist.all_reduce(ones(big), R.BXOR)),
        ("needs a floating-point", lambda: dist.all_reduce(ones(4, dtype=torch.int64), R.AVG)),
        ("needs an integer", lambda: dist.reduce(ones(4), 0, R.BOR)),
        ("needs an integer", lambda: dist.reduce_scatter_tensor(ones(2), ones(2 * world), R.BAND)),
        ("PREMUL_SUM is not supported", lambda: dist.all_reduce(ones(4), dist._make_nccl_premul_sum(2.0))),
        ("world size", lambda: dist.all_gather_into_tensor(ones(world * 2 + 1), ones(2))),
        ("one per rank", lambda: dist.all_gather([ones(2)] * (world + 1), ones(2))),
        ("tensor 0 is torch.float32 with 3 elements", lambda: dist.all_gather([ones(3)] * world, ones(2))),
        ("world size", lambda: dist.reduce_scatter_tensor(ones(3), ones(3 * world + 1))),
        (f"root rank {world + 2} is not in the group", lambda: dist.broadcast(ones(2), src=world + 2)),
        ("one per rank", lambda: dist.reduce_scatter(ones(3), [ones(3)] * (world + 1))),
        ("does not split into world size", lambda: dist.all_to_all_single(ones(world + 1), ones(world + 1))),
        ("add up to", lambda: dist.all_to_all_single(ones(world), ones(world), [2] * world, [1] * world)),
        ("one per rank", lambda: dist.all_to_all([ones(1)] * world, [ones(1)] * (world + 1))),
        ("root rank -1 is not in the group", lambda: dist.gather(ones(2), None, dst=-1)),
        # what only the root can check: it raises after its part (a gather's peers are done) or
        # tells the others first (a scatter's peers raise too): nobody is left waiting
        (
            "one per rank" if rank == last else None,
            lambda: dist.gather(ones(2), [ones(2)] * last if rank == last else None, dst=last),
        ),
        (
            "input tensor 0 is torch.float32 with 3" if rank == 0 else "the root, rank 0, refused",
            lambda: dist.scatter(ones(2), [ones(3)] * world if rank == 0 else None, src=0),
        ),
    ]
    for needle, call in cases:
        try:
            call()
        except (ValueError, RuntimeError) as e:
            assert needle is not None and needle in str(e) and "onedist" in str(e), (needle, str(e))
        else:
            assert needle is None, f"no error: {needle}"
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t)  # the group still works, and every rank is in step
        assert t.tolist() == [world * (world + 1) / 2] * 3, (needle, t)
    return len(cases)


def check_mismatched_calls_raise_on_every_rank_and_leave_the_group_usable() -> int:
    """shm: ranks that call different collectives, or one on different sizes, dtypes, ops or
    roots, raise CollectiveMismatchError at the first barrier, every rank alike, naming each
    rank's call; the next collective is right. gloo hangs on most of these, and returns garbage
    on some (an all_reduce of 1000 against 999 elements, a barrier against a small all_reduce)."""
    from onedist.errors import CollectiveMismatchError

    rank, world = od.get_rank(), od.get_world_size()
    big = _slot() // 4 * 3 + 5  # several chunks
    R, ones, odd = dist.ReduceOp, torch.ones, rank == world - 1

    def pick(last: object, others: object) -> Any:  # the last rank's argument, everyone else's
        return last if odd else others

    def gather(last: int) -> tuple[str, str, Any]:  # the last rank gathers `last` floats, the others 2
        call = lambda: dist.all_gather_into_tensor(ones(world * pick(last, 2)), ones(pick(last, 2)))  # noqa: E731
        return f"all_gather() of {4 * last} bytes", "all_gather() of 8 bytes", call

    def gathers(n: int, dst: int) -> Any:  # a gather of n floats to dst, as the rank sees it
        return dist.gather(ones(n), [ones(n) for _ in range(world)] if rank == dst else None, dst=dst)

    def to_all(dtype: torch.dtype) -> Any:
        return dist.all_to_all_single(torch.zeros(world, dtype=dtype), torch.ones(world, dtype=dtype))

    def coalesced() -> list[list[torch.Tensor]]:
        outs = [[torch.empty(2)] for _ in range(world)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecated by torch, still a collective
            dist.all_gather_coalesced(outs, [torch.full((2,), float(rank))])
        return outs

    assert [o[0].tolist() for o in coalesced()] == [[float(r)] * 2 for r in range(world)]
    f32, f64 = torch.float32, torch.float64
    cases = [
        # (what the last rank's call reads as, what the others' does, the call)
        ("all_reduce(SUM) of 999 torch.float32", "of 1000", lambda: dist.all_reduce(ones(pick(999, 1000)))),
        ("of 5 torch.float32", "of 4 torch.float32", lambda: dist.all_reduce(ones(pick(5, 4)))),
        (f"of {big + 1} torch.float32", f"of {big} torch.float32", lambda: dist.all_reduce(ones(big + odd))),
        (
            "4 torch.float64 elements",
            "4 torch.float32",
            lambda: dist.all_reduce(ones(4, dtype=pick(f64, f32))),
        ),
        ("all_reduce(MAX)", "all_reduce(SUM)", lambda: dist.all_reduce(ones(4), pick(R.MAX, R.SUM))),
        ("barrier()", "all_reduce(SUM) of 4", lambda: dist.barrier() if odd else dist.all_reduce(ones(4))),
        ("broadcast(root=1) of 16 bytes", "(root=0) of 16", lambda: dist.broadcast(ones(4), int(odd))),
        ("broadcast(root=0) of 20 bytes", "(root=0) of 16", lambda: dist.broadcast(ones(pick(5, 4)), 0)),
        gather(3),
        (
            "reduce_scatter(SUM) of 3",
            "reduce_scatter(SUM) of 2",
            lambda: dist.reduce_scatter_tensor(ones(pick(3, 2)), ones(world * pick(3, 2))),
        ),
        ("reduce(SUM, root=1)", "reduce(SUM, root=0)", lambda: dist.reduce(ones(4), int(odd))),
        # an empty tensor moves nothing, but its call still meets the others'
        ("all_reduce(SUM) of 0 torch.float32", "of 4 torch", lambda: dist.all_reduce(ones(pick(0, 4)))),
        ("broadcast(root=0) of 0 bytes", "(root=0) of 16", lambda: dist.broadcast(ones(pick(0, 4)), 0)),
        gather(0),
        (
            "broadcast(root=0)",
            "all_reduce(SUM) of",
            lambda: dist.broadcast(ones(big), 0) if odd else dist.all_reduce(ones(big)),
        ),
        # the collectives gloo runs for shm, checked at a barrier before gloo (where they hang)
        (
            "gather(root=1) of 2 torch.float32",
            "gather(root=0) of 2 torch.float32",
            lambda: gathers(2, int(odd)),
        ),
        ("gather(root=0) of 3 torch.float32", "gather(root=0) of 2", lambda: gathers(pick(3, 2), 0)),
        (
            "scatter(root=0) of 4 torch.float32",
            "all_reduce(SUM) of 4",
            lambda: dist.scatter(ones(4), None, src=0) if odd else dist.all_reduce(ones(4)),
        ),
        (
            "all_to_all() of torch.int64 tensors",
            "gather(root=0) of 2",
            lambda: to_all(torch.int64) if odd else gathers(2, 0),
        ),
        (
            "all_to_all() of torch.float64 tensors",
            "all_to_all() of torch.float32 tensors",
            lambda: to_all(pick(f64, f32)),
        ),
        (  # gloo runs it, after the ranks' calls meet at one barrier
            "all_gather_coalesced() of 2 torch.float32",
            "all_reduce(SUM) of 2",
            lambda: coalesced() if odd else dist.all_reduce(ones(2)),
        ),
    ]
    for theirs, ours, call in cases:
        try:
            call()
        except CollectiveMismatchError as e:
            text = str(e)
            last = text.split(f"rank {world - 1}: ")
            assert len(last) == 2 and theirs in last[1], (theirs, text)
            assert ours in text.split("rank 0: ")[1].split("\n")[0], (ours, text)
            assert "No tensor was changed, and the group is still usable" in text
        else:
            raise AssertionError(f"no CollectiveMismatchError: {theirs} against {ours}")
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t)  # the group still works, and every rank is in step
        assert t.tolist() == [world * (world + 1) / 2] * 3, (theirs, t)
    # an all_to_all whose ranks disagree on a split: rank 0 expects 2 rows from the last rank and
    # none from itself, every rank sends 1 row to each: all raise, naming both pairs
    for rows in (1, _slot()):  # in one step, and in rounds
        out_splits = [0] + [1] * (world - 2) + [2] if rank == 0 else [1] * world
        try:
            dist.all_to_all_single(
                torch.empty(world * rows, dtype=torch.uint8),
                torch.ones(world * rows, dtype=torch.uint8),
                [s * rows for s in out_splits],
                [rows] * world,
            )
        except CollectiveMismatchError as e:
            text = str(e)
            assert f"rank {world - 1} sends rank 0 {rows} bytes; rank 0 expects {2 * rows}" in text, text
            assert f"rank 0 sends rank 0 {rows} bytes; rank 0 expects 0" in text, text
            assert "still usable" in text and text.count("sends rank") == 2, text
        else:
            raise AssertionError("no CollectiveMismatchError for all_to_all splits that disagree")
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t)
        assert t.tolist() == [world * (world + 1) / 2] * 3, t
    # empty tensors on every rank: nothing to compare against, nothing raised
    empty = torch.ones(0)
    dist.all_reduce(empty)
    dist.broadcast(empty, 0)
    dist.all_gather_into_tensor(torch.ones(0), empty)
    dist.reduce_scatter_tensor(torch.ones(0), torch.ones(0))
    dist.all_to_all_single(torch.ones(0), torch.ones(0))
    dist.barrier()
    return len(cases)


def check_mismatch_on_one_host_names_the_group_ranks() -> str:
    """shm over several hosts: a call that differs among one host's ranks raises there, naming them
    by their ranks in the whole group, without claiming that the group is still usable (the other
    hosts' ranks may be waiting in the cross-host step)."""
    from onedist.errors import CollectiveMismatchError

    rank, pg = od.get_rank(), _pg()
    mine = next(h for h in pg._hosts if rank in h)
    try:
        dist.all_reduce(torch.ones(5 if rank == mine[-1] else 4))  # every host's last rank differs
    except CollectiveMismatchError as e:
        text = str(e)
        assert f"the group's ranks {mine} (this host) called different collectives" in text, text
        assert f"rank {mine[-1]}: reduce(SUM, root=0) of 5 torch.float32 elements" in text, text
        assert f"rank {mine[0]}: reduce(SUM, root=0) of 4 torch.float32 elements" in text, text
        assert "still usable" not in text, text
        return text.splitlines()[0]
    raise AssertionError("no CollectiveMismatchError")


def check_shm_hierarchy() -> list[list[int]]:
    """The two-level layout of a shm group over several hosts, as each rank sees it."""
    pg, rank = _pg(), od.get_rank()
    mine = next(h for h in pg._hosts if rank in h)
    assert (pg._leaders is not None) == (rank == mine[0])  # one gloo rank per host: its first
    assert (pg._local is not None) == (len(mine) > 1)
    if pg._local is not None:
        assert pg._local.uses_shared_memory and pg._local._rank == mine.index(rank)
    return pg._hosts


def check_slot_size_is_rank_0s() -> int:
    """Ranks whose ONEDIST_SHM_CHUNK_MB differ use rank 0's slot size (the segment's layout)."""
    pg, world = _pg(), od.get_world_size()
    t = torch.arange(100_000, dtype=torch.int64)  # 800 KB: chunks of either size
    dist.all_reduce(t)
    assert torch.equal(t, torch.arange(100_000, dtype=torch.int64) * world)
    return pg._seg.chunk
