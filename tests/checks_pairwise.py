"""Checks of onedist's gloo group's all-gather and reduce-scatter of large tensors, which it sends
as point-to-point exchanges (onedist.backends.recorded.pairwise): run on every rank of a pool."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from onedist.backends.recorded import pairwise
from onedist.backends.recorded.gloo import RecordedGloo

_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX")


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
    rows = pairwise.MIN_BYTES // 4 // n + 5  # a whole of a little more than MIN_BYTES float32s
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
