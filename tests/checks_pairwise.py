"""Checks of onedist's gloo group's all-gather and reduce-scatter of large tensors, which it sends
as point-to-point exchanges (onedist.backends.recorded.pairwise): run on every rank of a pool."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

from onedist.backends.recorded import pairwise
from onedist.backends.recorded.gloo import RecordedGloo

_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX")


def _rows(n: int) -> int:
    """Rows per rank of a whole of a little more than MIN_BYTES float32s: an exchange's size."""
    return pairwise.MIN_BYTES // 4 // n + 5


def check_large_calls_equal_plain_gloos() -> dict[str, Any]:
    """On the default (recorded) group and on a plain gloo group in the same processes, with
    tensors above the exchange's threshold: all_gather_into_tensor equal bit for bit (float32,
    bfloat16, int64; synchronous and asynchronous), reduce_scatter_tensor with every elementwise
    reduction equal within float32's rounding of a different summation order, and each call on
    the record as one collective."""
    warnings.filterwarnings("ignore", category=FutureWarning)  # reduce_scatter_tensor's old name
    group = dist.distributed_c10d._get_default_group()
    assert isinstance(group, RecordedGloo), type(group)
    plain = dist.new_group(backend="gloo")
    n, rank = dist.get_world_size(), dist.get_rank()
    rows = _rows(n)
    g = torch.Generator().manual_seed(rank)
    used = 0
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        mine = (torch.randn(rows, 2, generator=g) * 100).to(dtype)
        got, want = torch.empty((n * rows, 2), dtype=dtype), torch.empty((n * rows, 2), dtype=dtype)
        before = group.calls.seq
        dist.all_gather_into_tensor(got, mine)
        assert group.calls.seq == before + 1
        used += pairwise.fits_all_gather(n, got, mine)
        dist.all_gather_into_tensor(want, mine, group=plain)
        assert torch.equal(got, want), dtype
        got.zero_()
        dist.all_gather_into_tensor(got, mine + 1, async_op=True).wait()
        assert torch.equal(got, want + 1), dtype
    whole = torch.rand(n * rows, 2, generator=g) + 0.5  # products of n of them stay finite
    for name in _OPS:
        op = getattr(dist.ReduceOp, name)
        got, want = torch.empty(rows, 2), torch.empty(rows, 2)
        work = dist.reduce_scatter_tensor(got, whole, op=op, async_op=True)
        used += pairwise.fits_reduce_scatter(n, got, whole, op)
        work.wait()
        work.wait()  # waited again: the output is not reduced twice
        dist.reduce_scatter_tensor(want, whole, op=op, group=plain)
        worst = float((got - want).abs().max())
        assert worst <= 1e-6, (name, worst)
    assert used == 3 + len(_OPS), used
    return {"calls": used}


def check_small_and_odd_calls_stay_on_gloos_own() -> None:
    """Below the threshold, non-contiguous, of mismatched sizes, or with a reduction gloo refuses:
    the exchange leaves the call to gloo (its result, or its error, as before)."""
    n = dist.get_world_size()
    small = torch.ones(4)
    assert not pairwise.fits_all_gather(n, torch.empty(4 * n), small)
    big = torch.ones(pairwise.MIN_BYTES // 4)
    assert not pairwise.fits_reduce_scatter(n, big[: big.numel() // n], big, dist.ReduceOp.BAND)
    assert not pairwise.fits_all_gather(n, torch.empty(2 * n * big.numel())[::2], big)
    assert not pairwise.fits_all_gather(n, torch.empty(n * big.numel() + 1), big)
    out = torch.empty(4 * n)
    dist.all_gather_into_tensor(out, small)
    assert torch.equal(out, torch.ones(4 * n))


def _gathered_and_scattered(plain: Any, seed: int) -> None:
    """A large all-gather and a large sum reduce-scatter on the default group, equal to gloo's own
    on ``plain`` (the gather bit for bit; the sum within float32's rounding of another order)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    rows = _rows(n)
    g = torch.Generator().manual_seed(seed * 10 + rank)
    mine = torch.randn(rows, 2, generator=g)
    got, want = torch.empty(n * rows, 2), torch.empty(n * rows, 2)
    dist.all_gather_into_tensor(got, mine)
    dist.all_gather_into_tensor(want, mine, group=plain)
    assert torch.equal(got, want)
    whole = torch.randn(n * rows, 2, generator=g)
    got, want = torch.empty(rows, 2), torch.empty(rows, 2)
    dist.reduce_scatter_tensor(got, whole)
    dist.reduce_scatter_tensor(want, whole, group=plain)
    assert float((got - want).abs().max()) <= 1e-6


def check_reads_between_local_ranks_and_their_fallbacks() -> dict[str, Any]:
    """3 ranks of one machine, rank 2 with ``ONEDIST_CMA=0``: ranks 0 and 1 read each other's
    bytes, every pair with rank 2 goes through gloo's sockets; once the kernel refuses rank 1's
    reads (a seccomp filter, as a container's), rank 1 asks for the bytes and gets them sent.
    Every result equals gloo's own call. Returns whom this rank read, then whom it was refused."""
    from checks_pg import forbid_cross_memory_reads

    group = dist.distributed_c10d._get_default_group()
    plain = dist.new_group(backend="gloo")
    _gathered_and_scattered(plain, seed=1)
    links = group.links
    readable = sorted(links.next()[0])
    if dist.get_rank() == 1:
        forbid_cross_memory_reads()
    _gathered_and_scattered(plain, seed=2)
    _gathered_and_scattered(plain, seed=3)  # a refused peer is not tried again
    return {"readable": readable, "refused": sorted(links.refused)}


def check_exchanges_in_flight_are_waited_on_in_any_order() -> None:
    """Three asynchronous all-gathers and reduce-scatters in flight at once, waited on in call
    order on rank 0 and in reverse on the others: each exchange's messages have tags of their
    own, so every result is the one its call asked for."""
    plain = dist.new_group(backend="gloo")
    n, rank = dist.get_world_size(), dist.get_rank()
    rows = _rows(n)
    inputs = [torch.full((rows,), float(10 * k + rank)) for k in range(3)]
    outputs = [torch.empty(n * rows) for _ in range(3)]
    wholes = [torch.arange(n * rows, dtype=torch.float32) * (k + 1) + rank for k in range(3)]
    reduced = [torch.empty(rows) for _ in range(3)]
    works = [dist.all_gather_into_tensor(o, i, async_op=True) for o, i in zip(outputs, inputs)]
    works += [dist.reduce_scatter_tensor(r, w, async_op=True) for r, w in zip(reduced, wholes)]
    for work in works if rank == 0 else works[::-1]:
        work.wait()
    for k in range(3):
        assert torch.equal(outputs[k], torch.cat([torch.full((rows,), float(10 * k + r)) for r in range(n)]))
        want = torch.empty(rows)
        dist.reduce_scatter_tensor(want, wholes[k], group=plain)
        assert torch.equal(reduced[k], want), k


class PeerGone(Exception):
    """What rank 0 of check_a_peer_gone_before_an_exchange_is_an_error raises on purpose."""


def check_a_peer_gone_before_an_exchange_is_an_error() -> None:
    """Rank 1 ends without making the call; rank 0's exchange, whose reads thread waits for rank
    1's message, fails as gloo's own call would (the connection closed), not a hang."""
    n, rank = dist.get_world_size(), dist.get_rank()
    rows = _rows(n)
    if rank == 1:
        os._exit(0)
    try:
        dist.all_gather_into_tensor(torch.empty(n * rows), torch.ones(rows))
    except Exception as error:
        raise PeerGone(f"the exchange failed: {type(error).__name__}: {error}") from error


def check_a_group_made_again_ends_its_reads_thread() -> None:
    """A group made again (a live recovery's ``rejoin``) ends the last generation's reads thread
    and reads on a new one; its exchanges stay exact."""
    import threading
    import time

    group = dist.new_group()  # a recorded group of its own: the default one stays as it is
    plain = dist.new_group(backend="gloo")

    def readers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "onedist-reads" and t.is_alive()]

    n, rank = dist.get_world_size(), dist.get_rank()
    rows = _rows(n)
    mine = torch.full((rows,), float(rank))
    dist.all_gather_into_tensor(torch.empty(n * rows), mine, group=group)
    before = set(readers())
    group.rejoin(7)
    deadline = time.monotonic() + 5.0
    while len(before & set(readers())) == len(before) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(before & set(readers())) == len(before) - 1, "the last generation's reads thread still runs"
    got, want = torch.empty(n * rows), torch.empty(n * rows)
    dist.all_gather_into_tensor(got, mine, group=group)
    dist.all_gather_into_tensor(want, mine, group=plain)
    assert torch.equal(got, want)
