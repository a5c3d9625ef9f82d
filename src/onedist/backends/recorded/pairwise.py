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

Between ranks of one machine (one kernel, one pid namespace: :class:`Links`) the bytes do not go
through a socket at all: each rank reads what it needs straight out of its peer's tensor
(:mod:`onedist.backends.cma`, one copy by the reader where loopback TCP costs two and the sender's
CPU). The two ranks first tell each other where their bytes are (pid, address: a 16-byte gloo
message each way), then each reads and says it is done, so that no rank's tensor is let go before
its peers have read it; where the kernel refuses a read (a seccomp filter, Yama), the reader asks
for the bytes instead and they come through gloo as above. A thread per group does the reads and
answers of each exchange in call order (the same on every rank), so a rank's exchange never waits
on a peer's ``wait()``, only on the peer having made the call, as with gloo's own. A 50
M-parameter FSDP2 step on 2 ranks: see docs/performance.md; ``ONEDIST_CMA=0`` turns the reads off.

Used for contiguous CPU tensors of one dtype of at least :data:`MIN_BYTES`, and the reductions gloo
computes elementwise (sum, average: FSDP2's for float32 gradients, product, min, max); anything else
goes to gloo's own call.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import cma

__all__ = [
    "MIN_BYTES",
    "TAG",
    "Exchange",
    "Links",
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
#: their own tags, 0 by default, and never match these); the messages between ranks that read each
#: other use the tags above it, four per exchange (:meth:`Links.next`)
TAG = 0x6F64_6578  # "odex"
_NUMBERS = 1 << 24  # exchanges numbered apart in the tags: TAG + 4 * 2**24 stays a C int

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


class Links:
    """How one group's exchanges reach each peer: the peers it may read directly (same kernel and
    pid namespace: :func:`onedist.backends.cma.identity`, which each rank writes into the group's
    store before its gloo group connects) and those whose reads the kernel refused; the
    exchanges' numbers, which give each exchange tags of its own; and the thread that does the
    reads of every exchange in call order (:class:`_Reads`)."""

    #: the gloo group that moves the data (set once made, after the constructor)
    inner: Any = None

    def __init__(self, store: Any, rank: int, size: int) -> None:
        self._store, self._rank, self._size = store, rank, size
        self._readable: Optional[frozenset[int]] = None  # asked of the store at the first exchange
        self.refused: set[int] = set()  # peers whose bytes the kernel would not let this rank read
        self._count = 0
        self._queue: Optional[queue.SimpleQueue[Optional[_Reads]]] = None  # the reads thread's, once started
        self._failed: Optional[BaseException] = None  # what ended the reads thread
        cma.let_siblings_read()
        store.set(f"cma/{rank}", cma.identity())

    def next(self) -> tuple[frozenset[int], int]:
        """The peers the next exchange reads directly, and the first of its four tags."""
        if self._readable is None:  # every peer wrote its identity before the group connected
            ids = [v.decode() for v in self._store.multi_get([f"cma/{r}" for r in range(self._size)])]
            mine = ids[self._rank]
            self._readable = frozenset(r for r, i in enumerate(ids) if r != self._rank and mine and i == mine)
        self._count += 1
        return self._readable, TAG + 4 * (1 + self._count % _NUMBERS)

    def submit(self, reads: _Reads) -> None:
        """Hand ``reads`` to the reads thread (started on first use)."""
        if self._failed is not None:
            reads.end(self._failed)
            return
        if self._queue is None:
            self._queue = queue.SimpleQueue()
            threading.Thread(
                target=self._serve, args=(self._queue,), name="onedist-reads", daemon=True
            ).start()
        self._queue.put(reads)

    def close(self) -> None:
        """End the reads thread once the exchanges handed to it are done (the group is made again
        under a live recovery's new generation, or shut down)."""
        if self._queue is not None:
            self._queue.put(None)

    def _serve(self, todo: queue.SimpleQueue[Optional[_Reads]]) -> None:
        """The reads of each exchange, in call order: the order of every rank, so that two ranks
        never wait on each other's answers for different exchanges (the callers may wait on their
        works in any order). After a failure every exchange ends with it (the thread stays, so
        that none submitted meanwhile is left waiting); ends once :meth:`close` was called."""
        while True:
            reads = todo.get()
            if reads is None:  # closed
                return
            if self._failed is not None:
                reads.end(self._failed)
                continue
            try:
                reads.run()
            except BaseException as error:  # a peer gone, the group aborted: gloo's error
                self._failed = error
                reads.end(error)


def all_gather(links: Links, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Exchange:
    """``links.inner``'s all_gather_into_tensor as sends and receives, or reads (where
    :func:`fits_all_gather`)."""
    inner = links.inner
    n, rank = inner.size(), inner.rank()
    parts = output.view(n, -1)
    mine = input.view(-1)
    if parts[rank].data_ptr() != mine.data_ptr():  # FSDP2 gathers in place: its input is that row
        parts[rank].copy_(mine)
    readable, tag = links.next()
    into = {p: parts[p] for p in range(n) if p != rank}
    works = _through_sockets(inner, readable, lambda p: mine, into)
    reads = _Reads(links, tag, lambda p: mine, into, readable) if readable else None
    return Exchange(works, reads=reads)


def reduce_scatter(links: Links, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Exchange:
    """``links.inner``'s reduce_scatter_tensor as sends and receives, or reads (where
    :func:`fits_reduce_scatter`): the work's ``wait()`` reduces this rank's chunk into ``output``."""
    inner = links.inner
    n, rank = inner.size(), inner.rank()
    reduce = _reducer(opts.reduceOp)
    assert reduce is not None  # fits_reduce_scatter said so
    kind = _kind(opts.reduceOp)
    chunks = input.view(n, -1)
    out = output.view(-1)
    readable, tag = links.next()
    # two ranks that add: the peer's chunk read straight into the output, then this rank's added
    # (a + b and b + a are the same bits: the rank order below, without a buffer)
    into_output = n == 2 and bool(readable) and kind in (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
    received = None if into_output else torch.empty((n, out.numel()), dtype=input.dtype)  # row r unused
    into = {p: out if received is None else received[p] for p in range(n) if p != rank}
    works = _through_sockets(inner, readable, lambda p: chunks[p], into)
    reads = _Reads(links, tag, lambda p: chunks[p], into, readable) if readable else None

    def finish() -> None:
        if received is None:
            reduce(out, chunks[rank], out=out)
        else:
            parts = [chunks[rank] if r == rank else received[r] for r in range(n)]
            reduce(parts[0], parts[1], out=out)  # rank order: every rank adds in the same order
            for part in parts[2:]:
                reduce(out, part, out=out)
        if kind == dist.ReduceOp.AVG:  # as gloo's AVG: the sum, then divided
            out.div_(n)

    return Exchange(works, finish, reads)


def _through_sockets(
    inner: Any,
    readable: frozenset[int],
    part_for: Callable[[int], torch.Tensor],
    into: dict[int, torch.Tensor],
) -> list[Any]:
    """The gloo sends of ``part_for(peer)`` and receives into ``into[peer]`` with the peers this
    rank does not read (and that do not read it), peer r+1 first: every pair's two directions at
    once."""
    n, rank = inner.size(), inner.rank()
    works = []
    for k in range(1, n):
        to, sender = (rank + k) % n, (rank - k) % n
        if to not in readable:
            works.append(inner.send([part_for(to)], to, TAG))
        if sender not in readable:
            works.append(inner.recv([into[sender]], sender, TAG))
    return works


class _Reads:
    """One exchange's part between ranks that read each other (see the module doc). Issued (the
    caller's thread): each rank sends each such peer where the bytes that peer needs are (pid,
    address of ``part_for(peer)``), and the exchange goes to the reads thread. :meth:`run` (that
    thread): read each of ``peers``' bytes into ``into[peer]``, tell each "read" or "send them",
    send or receive what was asked. It ends once every peer has read this rank's bytes, which
    stay untouched till then."""

    def __init__(
        self,
        links: Links,
        tag: int,
        part_for: Callable[[int], torch.Tensor],
        into: dict[int, torch.Tensor],
        peers: frozenset[int],
    ) -> None:
        self.links, self.tag, self.part_for = links, tag, part_for
        self.into = {p: into[p] for p in sorted(peers)}  # the peers read, in rank order
        self._here = {
            p: torch.tensor([os.getpid(), part_for(p).data_ptr()], dtype=torch.int64) for p in self.into
        }
        self._where = {p: torch.empty(2, dtype=torch.int64) for p in self.into}
        inner, self._told = links.inner, []
        for p in self.into:
            self._told += [inner.send([self._here[p]], p, tag), inner.recv([self._where[p]], p, tag)]
        self.done = threading.Event()
        self.error: Optional[BaseException] = None
        links.submit(self)

    def run(self) -> None:
        """Read, answer, and move what a peer could not read."""
        inner, tag = self.links.inner, self.tag
        for work in self._told:
            work.wait()
        asks = {p: torch.tensor([0 if self._read(p) else 1], dtype=torch.int64) for p in self.into}
        answers = {p: torch.empty(1, dtype=torch.int64) for p in self.into}
        works = [inner.send([asks[p]], p, tag + 1) for p in self.into]
        works += [inner.recv([answers[p]], p, tag + 1) for p in self.into]
        for work in works:
            work.wait()
        moves = []
        for p, into in self.into.items():
            if int(answers[p]) == 1:  # p could not read its bytes here: sent
                moves.append(inner.send([self.part_for(p)], p, tag + 2))
            if int(asks[p]) == 1:
                moves.append(inner.recv([into], p, tag + 2))
        for work in moves:
            work.wait()
        self.end(None)

    def end(self, error: Optional[BaseException]) -> None:
        self.error, self._told, self.part_for = error, [], _gone  # the tensors are let go
        self.done.set()

    def wait(self, timeout: Optional[timedelta]) -> None:
        """Until :meth:`run` ended (in short waits: the caller stays interruptible); its error."""
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        while not self.done.wait(0.05):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"onedist: the exchange's reads did not end within {timeout}")
        if self.error is not None:
            raise self.error

    def _read(self, peer: int) -> bool:
        """Read ``peer``'s bytes for this rank into ``into[peer]``; False where the kernel refused
        (that peer is not tried again)."""
        if peer in self.links.refused:
            return False
        pid, address = (int(v) for v in self._where[peer])
        into = self.into[peer]
        if cma.read(pid, into.data_ptr(), address, into.numel() * into.element_size()):
            return True
        self.links.refused.add(peer)
        return False


def _gone(peer: int) -> torch.Tensor:
    raise AssertionError("an ended exchange's bytes were asked for")


class Exchange(_c10d.Work):  # type: ignore[misc]
    """The sends and receives, and the reads, of one exchange; ``wait()`` waits for them all, then
    runs ``finish`` once (whichever thread waits first: the caller, or the failure watcher asking
    whether it succeeded)."""

    def __init__(
        self, works: list[Any], finish: Optional[Callable[[], None]] = None, reads: Optional[_Reads] = None
    ) -> None:
        super().__init__()
        self._works, self._finish, self._reads = works, finish, reads
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
            if self._reads is not None:
                self._reads.wait(timeout)
            if self._finish is not None:
                self._finish()
            self._done = True
            self._works, self._reads = [], None  # the tensors are let go
            return True

    def is_completed(self) -> bool:
        if self._done:
            return True
        reads = self._reads
        return (reads is None or reads.done.is_set()) and all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        reads = self._reads
        return self.is_completed() and (reads is None or reads.error is None)

    def exception(self) -> Any:
        reads = self._reads
        return None if reads is None else reads.error

    def get_future(self) -> Any:
        future: Any = torch.futures.Future()
        future.set_result(None)
        if not self._done:  # torch's functional collectives chain on it after waiting
            self.wait()
        return future
