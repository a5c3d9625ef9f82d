"""Cross-memory attach: a rank copies a peer's bytes straight out of the peer's memory with
``process_vm_readv(2)``: one copy, by the reader, where a socket takes two and the sender's work
(the shm backend's slots take two as well, and a barrier per slot-full).

Used by the shm backend (a large all-to-all) and by onedist's gloo group (a large all-gather or
reduce-scatter between ranks of one machine: :mod:`onedist.backends.recorded.pairwise`). The
kernel allows it between processes of one user in one pid namespace unless something forbids it
(Yama's ``ptrace_scope`` >= 2; at 1, Ubuntu's default, a process only reads what its ancestors
let it: :func:`let_siblings_read`; a seccomp filter such as Docker's default; a non-dumpable peer
without ``CAP_SYS_PTRACE``); a refused or failed read returns False and the caller moves the bytes
another way. ``ONEDIST_CMA=0`` turns it off (``ONEDIST_SHM_CMA``, its earlier name, is read
where ``ONEDIST_CMA`` is not set).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from typing import Any, Optional

__all__ = ["enabled", "identity", "let_siblings_read", "read", "read_pieces"]


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_readv: Any = None  # libc's process_vm_readv, loaded on first use; False where there is none
_ptracer_set = False  # let_siblings_read ran
_PR_SET_PTRACER = 0x59616D61  # Yama's prctl option ("Yama")


def enabled() -> bool:
    """Whether ranks may read each other's memory (``ONEDIST_CMA``, else ``ONEDIST_SHM_CMA``: "1",
    the default, or "0")."""
    name = "ONEDIST_CMA" if "ONEDIST_CMA" in os.environ else "ONEDIST_SHM_CMA"
    raw = os.environ.get(name, "1")
    if raw not in ("0", "1"):
        from ..errors import bad_value

        raise bad_value(name, name, raw, '"1" (the default) or "0"')
    return raw == "1"


def identity() -> str:
    """Who can read this process's memory by its pid: the kernel (its boot id) and the pid
    namespace; "" where this process reads no one (turned off, or no ``process_vm_readv``).
    Two processes with the same non-empty identity may try :func:`read` on each other."""
    if not (enabled() and _function()):
        return ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pids = os.stat("/proc/self/ns/pid")
    except OSError:
        return ""
    return f"{boot}/{pids.st_dev}:{pids.st_ino}"


def let_siblings_read() -> None:
    """Under Yama's ``ptrace_scope`` 1 a process may only read its descendants: let this
    process's parent (the launcher) and its descendants (the other workers it started) read this
    one (``PR_SET_PTRACER``), as Open MPI's shared-memory transport does for its ranks. Nothing
    where Yama is absent or stricter (reads then fail and fall back). Not exercised on this
    project's machines, which have no Yama."""
    global _ptracer_set
    if _ptracer_set:
        return
    _ptracer_set = True
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            if f.read().strip() != "1":
                return
    except OSError:
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PTRACER, os.getppid(), 0, 0, 0)


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
