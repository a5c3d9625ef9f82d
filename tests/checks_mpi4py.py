"""Checks of onedist's mpi4py process group alone (``mpi`` over mpi4py), run on every rank under
mpirun: every dtype and reduction op torch defines, beyond gloo's set, against values computed
here, and the exchanges (all_to_all, gather/scatter, point to point, a sub-group), exact. The checks
both Python groups share, against gloo in the same processes, are in checks_pg.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import onedist as od


def _expect_all(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    acc = xs[0].clone()
    for x in xs[1:]:
        if op in ("SUM", "AVG"):
            acc = acc | x if acc.dtype == torch.bool else acc + x
        elif op == "PRODUCT":
            acc = acc & x if acc.dtype == torch.bool else acc * x
        elif op == "MIN":
            acc = torch.minimum(acc, x)
        elif op == "MAX":
            acc = torch.maximum(acc, x)
        elif op == "BAND":
            acc = acc & x
        elif op == "BOR":
            acc = acc | x
        elif op == "BXOR":
            acc = acc ^ x
    return acc / len(xs) if op == "AVG" else acc


def _rank_data(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(n, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(0, 7, (n,), generator=g).to(dtype)


def check_mpi_every_dtype_and_op_exact() -> int:
    """dist.all_reduce on the mpi4py group, every dtype torch has (beyond gloo's set: int16,
    uint16/32/64, complex) x every op it defines, against the values computed here."""
    rank, world = od.get_rank(), od.get_world_size()
    bitwise = ["BAND", "BOR", "BXOR"]
    cases = {
        torch.bool: ["SUM", "PRODUCT", "MIN", "MAX", *bitwise],
        torch.complex64: ["SUM", "AVG"],  # torch refuses the other ops on complex tensors
        torch.complex128: ["SUM", "AVG"],
        torch.float16: ["SUM", "AVG", "MIN", "MAX"],
        torch.bfloat16: ["SUM", "AVG", "MIN", "MAX"],
        torch.float32: ["SUM", "AVG", "PRODUCT", "MIN", "MAX"],
        torch.float64: ["SUM", "AVG", "MIN", "MAX"],
    }
    for dtype in (torch.int8, torch.int16, torch.int32, torch.int64):
        cases[dtype] = ["SUM", "PRODUCT", "MIN", "MAX", *bitwise]
    for dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64):
        cases[dtype] = ["SUM", "PRODUCT", "MIN", "MAX", *bitwise]
    # torch has no add/mul kernels for uint16/32/64 on CPU: the expected values are computed in int64
    wider = {torch.uint16: torch.int64, torch.uint32: torch.int64, torch.uint64: torch.int64}
    done = 0
    for dtype, ops in cases.items():
        for op in ops:
            for n in (0, 1, 1000, 300_000):
                xs = [_rank_data(r, n, dtype) for r in range(world)]
                ours = xs[rank].clone()
                dist.all_reduce(ours, getattr(dist.ReduceOp, op))
                wide = wider.get(dtype)
                expect = (
                    _expect_all([x.to(wide) for x in xs], op).to(dtype)
                    if wide is not None
                    else _expect_all(xs, op)
                )
                if dtype.is_floating_point or dtype.is_complex:
                    tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(dtype, 1e-5)
                    assert torch.allclose(ours, expect, rtol=tol, atol=tol * 4), (dtype, op, n)
                else:
                    assert torch.equal(ours, expect), (dtype, op, n)
                done += 1
    return done


def check_mpi_exchanges() -> None:
    """all_to_all with uneven splits, gather/scatter, list forms, concurrent isend/irecv, recv from
    any source, a sub-group: exact."""
    rank, world = od.get_rank(), od.get_world_size()
    # uneven all_to_all_single: rank r sends (q + r + 1) rows to rank q (zero rows allowed)
    in_splits = [(q + rank) % 3 for q in range(world)]
    out_splits = [(rank + q) % 3 for q in range(world)]
    inp = torch.cat([torch.full((s, 2), float(10 * rank + q)) for q, s in enumerate(in_splits)])
    out = torch.empty(sum(out_splits), 2)
    dist.all_to_all_single(out, inp, out_splits, in_splits)
    expect = torch.cat([torch.full((s, 2), float(10 * q + rank)) for q, s in enumerate(out_splits)])
    assert torch.equal(out, expect)
    outs = [torch.empty(3, dtype=torch.int16) for _ in range(world)]
    dist.all_to_all(outs, [torch.full((3,), 100 * rank + q, dtype=torch.int16) for q in range(world)])
    assert [o[0].item() for o in outs] == [100 * q + rank for q in range(world)]
    for root in range(world):
        g = [torch.empty(2, dtype=torch.bfloat16) for _ in range(world)] if rank == root else None
        dist.gather(torch.full((2,), float(rank), dtype=torch.bfloat16), g, dst=root)
        if rank == root:
            assert [v[1].item() for v in g] == list(range(world))
        got = torch.empty(4, dtype=torch.int64)
        pieces = [torch.full((4,), q * q, dtype=torch.int64) for q in range(world)] if rank == root else None
        dist.scatter(got, pieces, src=root)
        assert got.tolist() == [rank * rank] * 4
    parts = [torch.empty(2, 2) for _ in range(world)]
    dist.all_gather(parts, torch.full((2, 2), float(rank)).t())
    assert [p[0, 0].item() for p in parts] == list(range(world))
    red = torch.empty(3)
    dist.reduce_scatter(red, [torch.full((3,), float(rank + q)) for q in range(world)])
    assert red.tolist() == [float(sum(r + rank for r in range(world)))] * 3
    # every rank sends 1 MB to every other at once: blocking sends would deadlock
    big = {q: torch.full((1 << 18,), float(rank)) for q in range(world) if q != rank}
    recv = {q: torch.empty(1 << 18) for q in range(world) if q != rank}
    works = [dist.isend(t, q) for q, t in big.items()] + [dist.irecv(t, q) for q, t in recv.items()]
    for w in works:
        w.wait()
    assert all(torch.all(t == float(q)) for q, t in recv.items())
    if world > 1:
        if rank == world - 1:
            dist.send(torch.tensor([7, rank]), dst=0, tag=5)
        elif rank == 0:
            buf = torch.zeros(2, dtype=torch.int64)
            assert dist.recv(buf, tag=5) == world - 1  # any source: the sender's rank
            assert buf.tolist() == [7, world - 1]
    members = list(range(1, world)) or [0]
    sub = dist.new_group(members, use_local_synchronization=True) if rank in members else None
    if rank in members:
        t = torch.tensor([rank])
        dist.all_reduce(t, group=sub)
        assert t.item() == sum(members)
