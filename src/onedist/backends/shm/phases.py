"""How a shm collective moves its bytes: copies split over helper threads, and chunks through the
segment's banks in phases with a barrier between them (:meth:`ChunkMover._phases`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import torch

from .._pygroup import flat as _flat
from .protocol import SegmentSync
from .reduce_ops import reduce_into
from .segment import Bank

#: copies and reductions are split over the helper threads in parts of at least this many bytes
SPLIT_BYTES = 512 << 10


class ChunkMover(SegmentSync):
    """The memory work of :class:`~.group.ShmProcessGroup`: copies and reductions over the helper
    threads, and the schedule of a collective's chunks through the two banks."""

    _helpers: Optional[ThreadPoolExecutor]
    _parts: int
    _bank: int

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._split(lambda d, s: d.copy_(s), dst, src)

    def _reduce(self, fn: Callable[..., Any], dst: torch.Tensor, sources: list[torch.Tensor]) -> None:
        self._split(lambda d, *srcs: reduce_into(fn, d, list(srcs)), dst, *sources)

    def _split(self, work: Callable[..., Any], *tensors: torch.Tensor) -> None:
        """``work(*tensors)``, split over the helper threads when there are idle cores for them
        (one core's memory bandwidth is what bounds a rank; torch's kernels release the GIL)."""
        pool = self._helpers
        n = tensors[0].shape[0]
        parts = min(self._parts, n * tensors[0].element_size() // SPLIT_BYTES)
        if pool is None or parts < 2:
            work(*tensors)
            return
        edges = [n * i // parts for i in range(parts + 1)]
        futures = [pool.submit(work, *(t[edges[i] : edges[i + 1]] for t in tensors)) for i in range(1, parts)]
        work(*(t[: edges[1]] for t in tensors))
        for f in futures:
            f.result()

    def _phases(
        self,
        n: int,
        stages: Sequence[Optional[Callable[[int, Bank], None]]],
        what: str,
        overlap: bool = False,
        ends_in_result: bool = False,
    ) -> None:
        """Chunks ``0 .. n-1`` of one collective through its ``stages``, with a barrier between
        phases and none after the last.

        Stage ``s`` of chunk ``k`` runs in phase ``2k + s`` (one chunk at a time, all in bank
        ``self._bank``), or with ``overlap`` in phase ``k + s``, chunk ``k`` in bank
        ``(self._bank + k) % 2``: the stages of consecutive chunks then run side by side in
        the two banks, one barrier per chunk. ``None``: nothing to do on this rank (the phase
        still counts). Measured on 2 ranks, overlap makes a broadcast 1.2-1.7x faster (the root
        writes while the others read) but an all_reduce or all_gather 0.8-0.9x slower (two banks
        are twice the cache footprint), so only broadcast and the rounds of a large all_to_all
        (where barriers, not the cache, cost most when ranks outnumber cores) use it.

        Safety: a stage reads only what an earlier stage wrote in an earlier phase, and in one
        phase the ranks write and read different areas (stage 0 writes a rank's own slot, or the
        root's slots area for broadcast; the reduce writes this rank's slice of the result area
        while the others read slots; a last stage reads into the rank's own tensors). The last
        phase has no barrier behind it, so the next collective's first phase, which writes only
        slots, must not touch what it reads. A collective that ends reading the result area
        (``ends_in_result``: all_reduce, reduce) keeps its bank. One that ends reading slots
        hands the next the other bank when it was one chunk (a barrier saved), and ends with a
        barrier when it was several: a large collective stays in one bank, whose footprint
        stays in the cache (two banks in turn made a 128 MB all_gather 0.6-0.8x here). A
        broadcast moves through both banks anyway and hands on the one after its last chunk's.
        """
        seg = self._seg
        assert seg is not None and n >= 0
        if n == 0:  # nothing moves, but the ranks meet: a peer's non-empty call fails here, not later
            self._barrier(what)
            return
        first, depth = self._bank, len(stages)
        stride = 1 if overlap else 2
        for p in range(stride * (n - 1) + depth):
            if p:
                self._barrier(what)
            for s, stage in enumerate(stages):
                k, rem = divmod(p - s, stride)
                if stage is not None and rem == 0 and 0 <= k < n:
                    stage(k, seg.banks[(first + k) % 2 if overlap else first])
        if overlap:
            self._bank = (first + n) % 2
        elif not ends_in_result:
            if n == 1:
                self._bank = first ^ 1
            else:
                self._barrier(what)


def helper_pool(size: int) -> Optional[ThreadPoolExecutor]:
    """Threads that share a rank's copies and reductions: as many as leave a core per rank
    (``ONEDIST_SHM_THREADS`` sets the count per rank, helpers included), at most 4 per rank."""
    raw = os.environ.get("ONEDIST_SHM_THREADS")
    if raw:
        if not raw.isdigit() or not 1 <= int(raw) <= 64:
            from ...errors import bad_value

            raise bad_value("ONEDIST_SHM_THREADS", "ONEDIST_SHM_THREADS", raw, "an int from 1 to 64")
        threads = int(raw)
    else:
        threads = max(1, min(4, (os.cpu_count() or 1) // max(size, 1)))
    if threads <= 1:
        return None
    return ThreadPoolExecutor(threads - 1, thread_name_prefix="onedist-shm-copy")


def bytes_of(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``t`` as flat bytes: (the bytes, the flat tensor they view, whether that is a copy to write
    back into ``t``)."""
    flat, writeback = _flat(t)
    return flat.view(torch.uint8), flat, writeback
