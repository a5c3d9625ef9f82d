"""Checks run on every rank of a ``backend="shm"`` pool (64 KiB slots, so chunking is exercised).

The reference is the gloo group each shm group keeps beside it (``pg._gloo``), in the same
processes, on the same inputs: integer results must be equal bit for bit, floating-point results
equal within summation-order tolerance, and every rank must hold the same bits.
"""

from __future__ import annotations

import hashlib
import os

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
}
TOL = {torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float32: 1e-5, torch.float64: 1e-12}


def _pg():
    pg = dist.group.WORLD
    assert type(pg).__name__ == "ShmProcessGroup" and pg.uses_shared_memory, type(pg)
    return pg


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
    """Every dtype gloo reduces x SUM/MAX/MIN/PRODUCT x sizes from 0 to several slots."""
    pg, rank = _pg(), od.get_rank()
    done = 0
    for dtype in INT_DTYPES + FLOAT_DTYPES:
        for name, op in OPS.items():
            if name == "PRODUCT" and dtype.is_floating_point:
                continue  # float products of randn overflow/underflow alike; covered by ints
            for n in _sizes(dtype):
                x = _data(n, dtype, name, seed=1000 * rank + n)
                ours, ref = x.clone(), x.clone()
                dist.all_reduce(ours, op)
                opts = _c10d.AllreduceOptions()
                opts.reduceOp = op
                pg._gloo.allreduce([ref], opts).wait()
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
            pg._gloo._allgather_base(
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
    for dtype in [torch.int32, torch.float32]:
        for n in [0, 1, _slot() // 4 // world + 3]:
            x = _data(world * n, dtype, "SUM", seed=rank)
            out = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(out, x)
            full = x.clone()
            pg._gloo.allreduce([full]).wait()
            _compare(out, full[rank * n : (rank + 1) * n], f"reduce_scatter {dtype} n={n}")


def check_reduce_and_barrier_and_gloo_ops() -> None:
    rank, world = od.get_rank(), od.get_world_size()
    for root in range(world):
        t = torch.full((_slot() // 4 + 9,), float(rank + 1))
        dist.reduce(t, dst=root)
        if rank == root:
            assert torch.all(t == world * (world + 1) / 2)
    for _ in range(50):
        dist.barrier()
    # delegated to the gloo group: gather, scatter, all_to_all, send/recv
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


def check_sub_groups() -> None:
    """Groups of a subset of ranks get their own segment; ranks outside a group skip it."""
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
    """DDP over the shm group and DDP over a gloo group, same start and data: same parameters."""

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
    info = {"diff": diff, "spread shm": float(spread_ours.max()), "spread gloo": float(spread_ref.max())}
    assert diff < 1e-5 and info["spread shm"] == 0.0, info
    return diff
