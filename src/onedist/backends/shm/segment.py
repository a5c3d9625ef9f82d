"""The shared-memory segment of a shm group: where it can be made, its layout, and how ranks map it.

One ``memfd`` per group (see the package docstring): per-rank counter lines (see
:mod:`.protocol`), then two banks of a slot per rank and a result area, then two small mailboxes.
Rank 0 creates it and publishes it on the store; the others open it through ``/proc``.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import platform
import struct
import sys
from typing import Any, Optional

import torch

logger = logging.getLogger("onedist")

#: torch.distributed's name of the backend (``init_process_group("shm")``, ``dist.get_backend()``)
NAME = "shm"
#: bytes per rank's slot; a collective larger than this goes in chunks (``ONEDIST_SHM_CHUNK_MB``;
#: less on many ranks with a small L3 cache, see _chunk_bytes)
DEFAULT_CHUNK = 4 << 20
_MIN_CHUNK = 256 << 10
LINE_BYTES = 64  # one cache line per rank's counter: no false sharing between writers
HEADER_BYTES = 4096  # pids, abort flag and culprit, before the counter lines
#: an all_reduce of at most this many bytes is one step (every rank reduces all of it, after one
#: barrier, not two): a small collective's time is its barriers and torch calls, not its bytes
SMALL_BYTES = 16 << 10


def supported() -> bool:
    """True where the shm backend can run: Linux on x86-64 (TSO ordering, memfd, futex)."""
    return (
        sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64") and hasattr(os, "memfd_create")
    )


class Bank:
    """One of the segment's two banks: a slot per rank, then the result area, ``chunk`` bytes each
    (contiguous: a broadcast moves ``slot_area``, all the slots, at a time)."""

    def __init__(self, data: torch.Tensor, size: int, chunk: int) -> None:
        self.slot_area = data[: size * chunk]
        self.slots = [data[i * chunk : (i + 1) * chunk] for i in range(size)]
        self.out = data[size * chunk : (size + 1) * chunk]  # empty in a mailbox
        self.at: list[int] = []  # each slot's offset in the segment (see Segment)
        self._typed: dict[torch.dtype, list[torch.Tensor]] = {}

    def typed_slots(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """The slots as tensors of ``dtype`` (made once per dtype: small collectives are bound by
        the cost of each torch call)."""
        views = self._typed.get(dtype)
        if views is None:
            views = self._typed[dtype] = [s.view(dtype) for s in self.slots]
        return views


class Segment:
    """The mapped segment: per-rank counters, then two banks (see ShmProcessGroup._phases)."""

    def __init__(self, mm: mmap.mmap, size: int, chunk: int) -> None:
        self.chunk = chunk
        self.mm = mm
        self.data = torch.frombuffer(mm, dtype=torch.uint8)  # shares the mapping
        ctrl = HEADER_BYTES
        self.counters = (ctypes.c_int32 * (size * LINE_BYTES // 4)).from_buffer(mm, ctrl)
        self.base = ctypes.addressof(self.counters)
        self.pids = (ctypes.c_int64 * size).from_buffer(mm, 64)
        self.abort = ctypes.c_int32.from_buffer(mm, 16)  # 1 + the rank at fault, 0 while healthy
        self.abort_exited = ctypes.c_int32.from_buffer(mm, 20)  # 1: that rank died, 0: it raised
        data0 = ctrl + round_up(size * LINE_BYTES)
        bank = (size + 1) * chunk
        self.banks = [Bank(self.data[data0 + i * bank : data0 + (i + 1) * bank], size, chunk) for i in (0, 1)]
        # two mailboxes for small all_reduces (a slot of SMALL_BYTES per rank each), which they
        # alternate between; nothing else uses them, so they never move the banks
        mail0, box = data0 + 2 * bank, size * SMALL_BYTES
        self.mailboxes = [
            Bank(self.data[mail0 + i * box : mail0 + (i + 1) * box], size, SMALL_BYTES) for i in (0, 1)
        ]
        for b in self.banks + self.mailboxes:
            b.at = [s.data_ptr() - self.data.data_ptr() for s in b.slots]

    @staticmethod
    def nbytes(size: int, chunk: int) -> int:
        return HEADER_BYTES + round_up(size * LINE_BYTES) + 2 * (size + 1) * chunk + 2 * size * SMALL_BYTES


def round_up(n: int, to: int = 4096) -> int:
    return (n + to - 1) // to * to


def _l3_bytes() -> Optional[int]:
    """The size of the last-level (L3) cache of CPU 0, from sysfs; None when it is not known."""
    root = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for index in sorted(os.listdir(root)):
            with open(f"{root}/{index}/level") as f:
                if f.read().strip() != "3":
                    continue
            with open(f"{root}/{index}/size") as f:
                text = f.read().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            return int(text.rstrip("KMG")) * scale
    except (OSError, ValueError):
        pass
    return None


def _chunk_bytes(size: int) -> int:
    """Bytes per slot: ``ONEDIST_SHM_CHUNK_MB``, else 4 MiB, less where one bank (``size + 1``
    slots) would fill more than half the L3 cache. A bank that does not stay in the cache costs
    a trip to memory for every slot written and read: with 2 ranks on a 32 MiB L3, 16 MiB slots
    (48 MiB banks) made a 128 MB all_reduce 1.4x slower than 4 MiB slots (12 MiB banks;
    1 MiB slots were as fast as 4 MiB)."""
    raw = os.environ.get("ONEDIST_SHM_CHUNK_MB")
    if not raw:
        l3 = _l3_bytes()
        if l3 is None:
            return DEFAULT_CHUNK
        fit = l3 // (2 * (size + 1)) // _MIN_CHUNK * _MIN_CHUNK
        return max(_MIN_CHUNK, min(DEFAULT_CHUNK, fit))
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if not 0.0625 <= mb <= 1024:
        from ...errors import bad_value

        raise bad_value(
            "ONEDIST_SHM_CHUNK_MB", "ONEDIST_SHM_CHUNK_MB", raw, "a number of MiB from 0.0625 to 1024"
        )
    return round_up(int(mb * (1 << 20)), 4096)


def attach(store: Any, rank: int, size: int) -> Optional[Segment]:
    """Create (rank 0) or open the group's segment; None on every rank when any rank cannot.

    Every rank checks its own ``ONEDIST_SHM_CHUNK_MB`` (a bad value raises on each), but the slot
    size is rank 0's, published with the segment: the layout must be the same everywhere."""
    chunk = _chunk_bytes(size)
    fd = -1
    mm: Optional[mmap.mmap] = None
    error = ""
    try:
        if rank == 0:
            fd = os.memfd_create("onedist-shm", os.MFD_CLOEXEC)
            os.ftruncate(fd, Segment.nbytes(size, chunk))
            store.set("onedist-shm/segment", f"{os.getpid()}:{fd}:{chunk}")
        else:
            pid, rfd, published = store.get("onedist-shm/segment").decode().split(":")
            chunk = int(published)
            fd = os.open(f"/proc/{pid}/fd/{rfd}", os.O_RDWR)
        nbytes = Segment.nbytes(size, chunk)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        struct.pack_into("q", mm, 64 + 8 * rank, os.getpid())  # for the peers' liveness checks
    except OSError as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        if fd >= 0 and rank != 0:
            os.close(fd)
    store.set(f"onedist-shm/ok/{rank}", error or "ok")
    failures = {r: store.get(f"onedist-shm/ok/{r}").decode() for r in range(size)}
    if rank == 0 and fd >= 0:
        os.close(fd)  # every rank has mapped it (or given up): the mappings keep the memory
    bad = {r: v for r, v in failures.items() if v != "ok"}
    if bad or mm is None:
        logger.warning("onedist shm: shared memory unavailable (%s); collectives run on gloo", bad)
        if mm is not None:
            mm.close()
        return None
    return Segment(mm, size, chunk)
