"""Cross-memory attach: a rank copies a peer's bytes straight out of the peer's memory with
``process_vm_readv(2)``, one copy where the segment's slots take two (the sender's into its slot,
the receiver's out of it) and a barrier per slot-full.

The kernel allows it between processes of one user unless something forbids it (Yama's
``ptrace_scope`` >= 2, a seccomp filter such as Docker's default, a non-dumpable peer without
``CAP_SYS_PTRACE``); a refused or failed read returns False and the caller moves the bytes through
the slots instead. ``ONEDIST_SHM_CMA=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from typing import Any, Optional

__all__ = ["enabled", "read_pieces"]


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_readv: Any = None  # libc's process_vm_readv, loaded on first use; False where there is none


def enabled() -> bool:
    """Whether ranks may read each other's memory (``ONEDIST_SHM_CMA``: "1", the default, or "0")."""
    raw = os.environ.get("ONEDIST_SHM_CMA", "1")
    if raw not in ("0", "1"):
        from ...errors import bad_value

        raise bad_value("ONEDIST_SHM_CMA", "ONEDIST_SHM_CMA", raw, '"1" (the default) or "0"')
    return raw == "1"


def _function() -> Any:
    global _readv
    if _readv is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
        except (AttributeError, OSError):
            _readv = False
        else:
            fn.restype = ctypes.c_ssize_t
            fn.argtypes = [
                ctypes.c_int,
                ctypes.POINTER(_IoVec),
                ctypes.c_ulong,
                ctypes.POINTER(_IoVec),
                ctypes.c_ulong,
                ctypes.c_ulong,
            ]
            _readv = fn
    return _readv


def read(pid: int, dst: int, src: int, n: int) -> bool:
    """Copy ``n`` bytes at address ``src`` of process ``pid`` to address ``dst`` of this one
    (ctypes releases the GIL for the call); False when the kernel refuses or falls short."""
    fn = _function()
    if not fn:
        return False
    done = 0
    while done < n:  # the kernel may stop early (a partial read), never mid-page on success
        local, remote = _IoVec(dst + done, n - done), _IoVec(src + done, n - done)
        got = fn(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            return False
        done += got
    return True


def read_pieces(
    pieces: Sequence[tuple[int, int, int, int]], pool: Optional[ThreadPoolExecutor], parts: int, split: int
) -> bool:
    """:func:`read` each ``(pid, dst, src, n)``; with helper threads, pieces of more than
    ``2 * split`` bytes are cut in up to ``parts`` and read side by side (one core's copy
    bandwidth is what bounds a rank). True when every read succeeded."""
    if pool is None or parts < 2:
        return all(read(*p) for p in pieces)
    jobs = []
    for pid, dst, src, n in pieces:
        k = max(1, min(parts, n // split))
        edges = [n * i // k for i in range(k + 1)]
        jobs += [(pid, dst + a, src + a, b - a) for a, b in pairwise(edges)]
    futures = [pool.submit(read, *j) for j in jobs[1:]]
    ok = read(*jobs[0]) if jobs else True
    return all([f.result() for f in futures]) and ok  # waits for every thread: none writes after
