"""All-gather and reduce-scatter of one tensor on gloo as point-to-point exchanges.

FSDP2 moves every parameter through ``all_gather_into_tensor`` (twice a step) and every gradient
through ``reduce_scatter_tensor``. gloo (torch 2.13) does the first with its allgather, which took
2.5x the time of an all_reduce of the same 100 MB output between 2 ranks here, and the second as an
all_reduce of a copy of the whole input, of which each rank keeps 1/N. Here each rank sends every
peer what that peer needs and receives what it needs, all at once, as gloo's asynchronous sends and
receives: the all-gather sends its input to each peer, the reduce-scatter sends each peer its chunk
and reduces what it receives when the work is waited on (in rank order: the same on every rank).
Measured on 2 gloo ranks, 2 busy cores (medians of 9): 100 MB all-gathered in 79 ms against gloo's
257 ms, reduce-scattered in 129 ms against 226 ms; 4 MB 1.2x and 1.5x as fast, 1 MB slower (hence
:data:`MIN_BYTES`). FSDP2's step of a 50 M-parameter model: 0.68-0.72x the CPU time of the same step
on torch's plain gloo group (``benchmarks/bench_sharding.py``, docs/performance.md).

Used for contiguous CPU tensors of one dtype of at least :data:`MIN_BYTES`, and the reductions gloo
computes elementwise (sum, average: FSDP2's for float32 gradients, product, min, max); anything else
goes to gloo's own call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = [
    "MIN_BYTES",
    "TAG",
    "Exchange",
    "all_gather",
    "fits_all_gather",
    "fits_reduce_scatter",
    "reduce_scatter",
]

_c10d: Any = dist.distributed_c10d

#: the smallest call (bytes of the all-gather's output, the reduce-scatter's input) sent as an
#: exchange: 1 MB went faster through gloo's own calls here (the exchange 0.7x, 0.6x as fast), 4 MB
#: through the exchange (1.2x, 1.5x), 100 MB: 3.3x, 1.8x (2 ranks, 2 busy cores, medians of 9)
MIN_BYTES = 4 << 20

#: the tag of the exchanges' sends and receives (a user's point-to-point calls on the group use
#: their own tags, 0 by default, and never match these)
TAG = 0x6F64_6578  # "odex"

_REDUCE: dict[Any, Callable[..., Any]] = {  # (a, b, out=) each
    dist.ReduceOp.SUM: torch.add,
    dist.ReduceOp.AVG: torch.add,  # then divided by N (FSDP2's float32 gradients)
    dist.ReduceOp.PRODUCT: torch.mul,
    dist.ReduceOp.MIN: torch.minimum,
    dist.ReduceOp.MAX: torch.maximum,
}


def _fits(output: torch.Tensor, input: torch.Tensor, n: int) -> bool:
    return (
        n > 1
        and output.device.type == input.device.type == "cpu"
        and output.dtype == input.dtype
        and output.layout == input.layout == torch.strided
        and output.is_contiguous()
        and input.is_contiguous()
    )


def fits_all_gather(n: int, output: torch.Tensor, input: torch.Tensor) -> bool:
    """Whether :func:`all_gather` does this call (else gloo's own call)."""
    whole = output.numel() * output.element_size()
    return whole >= MIN_BYTES and _fits(output, input, n) and output.numel() == n * input.numel()


def fits_reduce_scatter(n: int, output: torch.Tensor, input: torch.Tensor, op: Any) -> bool:
    """Whether :func:`reduce_scatter` does this call with reduction ``op`` (else gloo's own)."""
    whole = input.numel() * input.element_size()
    return (
        whole >= MIN_BYTES
        and _reducer(op) is not None
        and (input.is_floating_point() or _kind(op) != dist.ReduceOp.AVG)  # an integer mean: gloo's
        and _fits(output, input, n)
        and input.numel() == n * output.numel()
    )


def _reducer(op: Any) -> Optional[Callable[..., Any]]:
    return _REDUCE.get(_kind(op))


def _kind(op: Any) -> Any:
    return getattr(op, "op", op)  # a ReduceOp (opts.reduceOp) or its RedOpType


def all_gather(inner: Any, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Exchange:
    """``inner``'s all_gather_into_tensor as sends and receives (where :func:`fits_all_gather`)."""
    n, rank = inner.size(), inner.rank()
    parts = output.view(n, -1)
    mine = input.view(-1)
    if parts[rank].data_ptr() != mine.data_ptr():  # FSDP2 gathers in place: its input is that row
        parts[rank].copy_(mine)
    works = []
    for k in range(1, n):  # peer r+1 first: every pair's two directions at once
        to, sender = (rank + k) % n, (rank - k) % n
        works += [inner.send([mine], to, TAG), inner.recv([parts[sender]], sender, TAG)]
    return Exchange(works)


def reduce_scatter(inner: Any, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Exchange:
    """``inner``'s reduce_scatter_tensor as sends and receives (where :func:`fits_reduce_scatter`):
    the work's ``wait()`` reduces this rank's chunk into ``output``."""
    n, rank = inner.size(), inner.rank()
    reduce = _reducer(opts.reduceOp)
    assert reduce is not None  # fits_reduce_scatter said so
    average = _kind(opts.reduceOp) == dist.ReduceOp.AVG
    chunks = input.view(n, -1)
    received = torch.empty((n, output.numel()), dtype=input.dtype)  # row r unused
    works = []
    for k in range(1, n):
        to, sender = (rank + k) % n, (rank - k) % n
        works += [inner.send([chunks[to]], to, TAG), inner.recv([received[sender]], sender, TAG)]

    def finish() -> None:
        out = output.view(-1)
        parts = [chunks[rank] if r == rank else received[r] for r in range(n)]
        reduce(parts[0], parts[1], out=out)  # rank order: every rank adds in the same order
        for part in parts[2:]:
            reduce(out, part, out=out)
        if average:  # as gloo's AVG: the sum, then divided
            out.div_(n)

    return Exchange(works, finish)


class Exchange(_c10d.Work):  # type: ignore[misc]
    """The sends and receives of one exchange; ``wait()`` waits for them all, then runs ``finish``
    once (whichever thread waits first: the caller, or the failure watcher asking whether it
    succeeded)."""

    def __init__(self, works: list[Any], finish: Optional[Callable[[], None]] = None) -> None:
        super().__init__()
        self._works, self._finish = works, finish
        self._lock = threading.Lock()
        self._done = False

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        with self._lock:
            if self._done:
                return True
            for work in self._works:
                if timeout is None:
                    work.wait()
                else:
                    work.wait(timeout)
            if self._finish is not None:
                self._finish()
            self._done = True
            self._works = []  # the tensors are let go
            return True

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return self.is_completed()

    def exception(self) -> Any:
        return None

    def get_future(self) -> Any:
        future: Any = torch.futures.Future()
        future.set_result(None)
        if not self._done:  # torch's functional collectives chain on it after waiting
            self.wait()
        return future
