"""The synchronisation protocol of a shm group: barriers, the call check, failure marks.

Ranks meet at barriers made of per-rank generation counters in the segment (one writer each),
waited on with ``futex(2)`` after a short spin; beside its counter each rank writes the call it
is making (a ``CALL_RECORD``), which its peers compare after the barrier (see the package
docstring). A rank that fails inside a collective marks the segment so that its peers raise at
once (:func:`poison_on_error`).
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from ...errors import CollectiveMismatchError
from .._pygroup import OrderedGroup, op_name
from ..recorded import calls
from ..recorded.calls import CallLog, Entry, user_site
from .segment import HEADER_BYTES, LINE_BYTES, Segment

_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_WAIT_SLICE_S = 0.05  # between liveness checks while blocked in futex_wait
_MASK = 0xFFFFFFFF
_HALF = 0x80000000
#: what a rank is calling at a barrier (see ShmProcessGroup._barrier): kind, reduce op, root,
#: dtype, count (elements, or bytes where the dtype does not matter), step within the call
CALL_RECORD = struct.Struct("<iiiiqi")
_STEP = struct.Struct("<i")  # the record's last field
#: where, in a rank's counter line, its call for a barrier of even / odd generation goes: a peer
#: reads it after that barrier, and the rank cannot write the slot again before the barrier after next
_CALL_AT = (8, 8 + CALL_RECORD.size)
assert _CALL_AT[1] + CALL_RECORD.size <= 64
KIND_ALL_REDUCE, KIND_REDUCE, KIND_BROADCAST, KIND_ALL_GATHER = 1, 2, 3, 4
KIND_REDUCE_SCATTER, KIND_BARRIER = 5, 6
KIND_GATHER, KIND_SCATTER, KIND_ALL_TO_ALL = 7, 8, 9
KIND_ALL_GATHER_COALESCED = 10  # gloo runs it, after one barrier that checks the calls (_agree)
KIND_ALL_GATHER_UNEVEN = 11
KIND_NAMES = {
    KIND_ALL_REDUCE: "all_reduce",
    KIND_REDUCE: "reduce",
    KIND_BROADCAST: "broadcast",
    KIND_ALL_GATHER: "all_gather",
    KIND_REDUCE_SCATTER: "reduce_scatter",
    KIND_BARRIER: "barrier",
    KIND_GATHER: "gather",
    KIND_SCATTER: "scatter",
    KIND_ALL_TO_ALL: "all_to_all",
    KIND_ALL_GATHER_COALESCED: "all_gather_coalesced",
    KIND_ALL_GATHER_UNEVEN: "all_gather_uneven",  # onedist.all_gather of tensors whose sizes differ
}
_DTYPES: list[torch.dtype] = []  # code - 1 -> dtype: every torch dtype, sorted by name (see _dtypes)
_DTYPE_CODES: dict[torch.dtype, int] = {}


def _dtypes() -> list[torch.dtype]:
    """Every torch dtype, in an order that is the same in every process running this torch."""
    if not _DTYPES:
        _DTYPES.extend(sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str))
        _DTYPE_CODES.update({d: i + 1 for i, d in enumerate(_DTYPES)})
    return _DTYPES


def dtype_code(dtype: torch.dtype) -> int:
    """A number for ``dtype`` that is the same in every process running this torch (from 1)."""
    _dtypes()
    return _DTYPE_CODES.get(dtype, -1)


def step_root(step: int) -> int:
    """The root field of a DDP gradient bucket's record: the parity of its step (-2 even, -3 odd),
    so that buckets of steps one apart differ at the barrier (see onedist.backends.recorded.steps)."""
    return -2 - (step & 1)


def _describe(call: tuple[int, ...]) -> str:
    """One rank's call (a CALL_RECORD), as a user would write it."""
    kind, op, root, dtype, count, step = call
    name = KIND_NAMES.get(kind)
    if name is None:
        return "nothing onedist knows (its shared memory was written by something else)"
    if name == "barrier":
        return "barrier()"
    args = []
    if op >= 0:
        args.append(op_name(dist.ReduceOp.RedOpType(op)))
    if root >= 0:
        args.append(f"root={root}")
    known = 0 < dtype <= len(_dtypes())
    if count < 0:  # a call whose size may differ between ranks (all_to_all)
        what = f"{_dtypes()[dtype - 1]} tensors" if known else "tensors"
    else:
        what = f"{count} {_dtypes()[dtype - 1]} elements" if known else f"{count} bytes"
    later = f", step {step}" if step else ""
    bucket = (
        f": a DDP gradient bucket of an {'odd' if root == -3 else 'even'} step" if root in (-2, -3) else ""
    )
    return f"{name}({', '.join(args)}) of {what}{later}{bucket}"


def _site() -> str:
    """The calling script's line (the main thread's, when a collective runs on the group's thread)."""
    frame = sys._getframe(1)
    if threading.current_thread() is not threading.main_thread():
        frame = sys._current_frames().get(threading.main_thread().ident or 0, frame)
    return user_site(frame)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc: Any = None


def _futex() -> Any:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        _libc = libc
    return _libc.syscall


class ShmError(RuntimeError):
    """A shm collective could not complete (a peer exited, or the timeout passed).

    ``culprit``: the group rank that exited (``exited``) or failed inside a collective, when that
    is the cause (marked in the segment for the other peers, so that every rank names the rank
    that died, not the first to notice it; onedist's collectives name a rank that exited in their
    RemoteRankError).
    """

    def __init__(self, message: str, culprit: Optional[int] = None, exited: bool = False) -> None:
        super().__init__(message)
        self.culprit = culprit
        self.exited = exited


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped by its parent) is gone too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def poison_on_error(method: Callable[..., Any]) -> Callable[..., Any]:
    """A rank that fails inside a shm collective marks the segment, so that its peers, waiting in
    the same collective, raise at once instead of at the timeout (the group is unusable after)."""

    def wrapper(self: SegmentSync, *args: Any, **kwargs: Any) -> Any:
        return self._poisoning(method, self, *args, **kwargs)

    wrapper.__name__ = method.__name__
    wrapper.__doc__ = method.__doc__
    return wrapper


class SegmentSync(OrderedGroup):
    """The protocol side of :class:`~.group.ShmProcessGroup`: what a rank calls, the barriers that
    check it, and the marks that fail the group for every rank (set up by its ``__init__``)."""

    _seg: Optional[Segment]
    _rank: int
    _size: int
    _timeout: float
    _gen: int
    _record: bytes
    _step: int
    _others: list[int]
    _spin: int
    _shown_as: Optional[list[int]]
    calls: Optional[CallLog]

    def _poisoning(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``call(*args, **kwargs)``, marking the segment when it fails (see poison_on_error); a
        failure is raised as onedist explains it (a failed peer's error, the stall verdict)."""
        gen = self._gen
        try:
            return call(*args, **kwargs)
        except (ValueError, TypeError):
            if self._gen != gen:  # an argument error before any barrier is every rank's: no harm
                self.abort()
            raise
        except ShmError as e:
            self._mark(e.culprit)
            cause = (
                None
                if self.calls is None
                else calls.known_cause(f"shm {getattr(call, '__name__', 'collective')}", e)
            )
            if cause is None:
                raise
            raise cause from e
        except CollectiveMismatchError:  # every rank raises it at the same barrier: no harm
            raise
        except BaseException:
            self.abort()
            raise

    # ------------------------------------------------------------------ synchronisation
    def _begin(self, kind: int, count: int, dtype: int = 0, op: int = -1, root: int = -1) -> None:
        """What this rank calls now, for the check at each of the call's barriers (see _barrier):
        ``count`` elements of the dtype numbered ``dtype`` (see reductions.reduction), or bytes where the
        dtype does not matter (0); ``op``, ``root``: -1 where the call has none."""
        self._record = CALL_RECORD.pack(kind, op, root, dtype, count, 0)
        self._step = 0

    def _barrier(self, what: str) -> None:
        """Wait until every rank has reached this barrier; raise CollectiveMismatchError on every
        rank when they are not all at the same step of the same call (see _begin)."""
        seg = self._seg
        assert seg is not None
        if seg.abort.value:
            raise self._aborted(what)
        self._gen = g = (self._gen + 1) & _MASK
        counters, mm = seg.counters, seg.mm
        stride = LINE_BYTES // 4
        at = HEADER_BYTES + _CALL_AT[g & 1]
        mine = self._record if not self._step else self._record[:-4] + _STEP.pack(self._step)
        mine_at = at + self._rank * LINE_BYTES
        mm[mine_at : mine_at + CALL_RECORD.size] = mine  # before the counter
        counters[self._rank * stride] = g - (1 << 32) if g >= _HALF else g
        syscall = _futex()
        my_counter = ctypes.c_void_p(seg.base + self._rank * LINE_BYTES)
        syscall(_SYS_FUTEX, my_counter, _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)
        for j in self._others:
            idx = j * stride
            if (counters[idx] - g) & _MASK < _HALF:
                continue
            for _ in range(self._spin):
                if (counters[idx] - g) & _MASK < _HALF:
                    break
            else:
                self._block(j, g, what)
        self._step += 1
        for j in self._others:
            if mm[at + j * LINE_BYTES : at + j * LINE_BYTES + CALL_RECORD.size] != mine:
                raise self._mismatch(at)

    def _mismatch(self, at: int) -> CollectiveMismatchError:
        """Every rank's call at this barrier (whose records start at ``at``), as an error that every
        rank raises alike. At the first barrier of their calls, the ranks have written only to the
        segment, and the group stays usable. A difference at a later step would mean ranks out of
        step since an earlier call, which the size in the record and the barrier of empty calls
        rule out; should it happen, the group is marked failed."""
        seg = self._seg
        assert seg is not None
        calls = [CALL_RECORD.unpack_from(seg.mm, at + j * LINE_BYTES) for j in range(self._size)]
        usable = not any(c[-1] for c in calls)
        if not usable:
            self._mark(None)
        ranks = self._shown_as or list(range(self._size))
        if self._shown_as is None:
            lines = [f"onedist shm: the {self._size} ranks of the group called different collectives:"]
        else:  # one host's part of the call: the other hosts' ranks may be waiting for this one's
            lines = [
                f"onedist shm: the group's ranks {ranks} (this host) called different collectives (over "
                "several hosts, an all_reduce runs on each host as a reduce to its first rank, then a "
                "broadcast):"
            ]
            usable = False
        sites = self._sites_of_all()
        lines += [f"  rank {r}: {_describe(call)}{sites.get(r, '')}" for r, call in zip(ranks, calls)]
        lines.append(
            "HINT: every rank of a group must call the same collectives, in the same order, with tensors "
            "of the same size and dtype (and the same op and root); ONEDIST_DEBUG=1 also names each "
            "rank's file:line." + (" No tensor was changed, and the group is still usable." if usable else "")
        )
        return CollectiveMismatchError("\n".join(lines))

    def _sites_of_all(self) -> dict[int, str]:
        """Each rank's script line at a mismatch (every rank finds it at the same barrier): through
        the store, waiting at most 2 s for the peers'. Empty for one host's part of a larger group."""
        log, store = self.calls, getattr(self, "_store", None)
        if log is None or store is None:
            return {}
        key = f"onedist/shm-sites/{log.key}/{self._gen}/{{}}"
        sites = {}
        try:
            store.set(key.format(self._rank), _site())
            store.wait([key.format(r) for r in range(self._size)], timedelta(seconds=2))
            for r in range(self._size):
                sites[r] = f" at {store.get(key.format(r)).decode()}"
            # rank 0 may host the store: it leaves once every rank has read the lines
            read = store.add(key.format("read"), 1)
            deadline = time.monotonic() + 2.0
            while self._rank == 0 and read < self._size and time.monotonic() < deadline:
                time.sleep(0.01)
                read = store.add(key.format("read"), 0)
        except Exception:  # a peer that never wrote: its line stays unnamed
            pass
        return sites

    def _aborted(self, what: str) -> ShmError:
        seg = self._seg
        assert seg is not None
        j = seg.abort.value - 1
        if seg.abort_exited.value:
            cause = f"rank {j} (pid {seg.pids[j]}) exited"
        else:
            cause = f"rank {j} failed inside a collective, so the group cannot be used any more"
        return ShmError(
            f"onedist shm: {what} on rank {self._rank}: {cause} (Connection closed by peer)",
            culprit=j,
            exited=bool(seg.abort_exited.value),
        )

    def _block(self, j: int, g: int, what: str) -> None:
        """Wait (futex) until rank ``j`` reached generation ``g``; on record meanwhile, for the
        stall check and its reports."""
        log = self.calls
        if log is None or log.blocked is not None:
            return self._wait_for(j, g, what)
        text = _describe(CALL_RECORD.unpack(self._record))
        log.blocked = Entry(self.collectives, (-1, -1, -1, -1, -1), 0, _site(), time.monotonic(), -1, 0, text)
        try:
            self._wait_for(j, g, what)
        finally:
            log.blocked = None

    def _wait_for(self, j: int, g: int, what: str) -> None:
        seg = self._seg
        assert seg is not None
        counters, idx = seg.counters, j * (LINE_BYTES // 4)
        addr = ctypes.c_void_p(seg.base + j * LINE_BYTES)
        syscall = _futex()
        ts = _Timespec(0, int(_WAIT_SLICE_S * 1e9))
        deadline = time.monotonic() + self._timeout
        while True:
            seen = counters[idx]
            if (seen - g) & _MASK < _HALF:
                return
            syscall(_SYS_FUTEX, addr, _FUTEX_WAIT, seen, ctypes.byref(ts), None, 0)
            if (counters[idx] - g) & _MASK < _HALF:
                return
            if seg.abort.value:
                raise self._aborted(what)
            pid = seg.pids[j]
            if pid and not _alive(pid):
                raise ShmError(
                    f"onedist shm: {what} on rank {self._rank}: rank {j} (pid {pid}) exited "
                    "(Connection closed by peer)",
                    culprit=j,
                    exited=True,
                )
            if time.monotonic() > deadline:
                raise ShmError(  # torch's words (gloo's), which callers match: " Timed out waiting <N>ms"
                    f"onedist shm: {what} on rank {self._rank}: Timed out waiting "
                    f"{round(self._timeout * 1000)}ms for rank {j}"
                )

    def _mark(self, exited: Optional[int]) -> None:
        seg = self._seg
        if seg is not None and not seg.abort.value:
            if exited is not None:
                seg.abort_exited.value = 1
            seg.abort.value = (self._rank if exited is None else exited) + 1
