"""Shared-memory collectives for the ranks of one host: the ``shm`` torch.distributed backend.

A process group written in Python (torch lets Python register a backend, and
``DistributedDataParallel`` calls it like any other) that moves CPU tensors through one
shared-memory segment per group instead of loopback TCP:

* **all_reduce**: every rank copies its chunk into its own slot; after a barrier, rank ``r``
  reduces slice ``r`` of the chunk over all slots, in rank order, into the result area; after the
  next barrier every rank copies the result out. Each element is reduced by exactly one rank,
  always in rank order, so every rank gets the same bits, run after run.
* **all_gather / broadcast / reduce_scatter / reduce / barrier / gather / scatter**: the same
  slots and barriers.
* **all_to_all**: each rank writes a head (where its parts start, what it expects from each rank)
  and, when they fit, its parts into its slot; after a barrier every rank reads every head and
  takes its parts; larger ones go in rounds of a slot per rank (``_exchange``).
* everything else (send/recv, the deprecated all_gather_coalesced, CUDA tensors) goes to a gloo
  group made beside it on the same store, so the backend is complete.

Tensors larger than a slot go in chunks. The segment has two banks (slots and result area each)
and two small mailboxes: a broadcast alternates chunks between the banks, the root writing one
while the others read the other; a collective hands the next one the other bank (or mailbox)
where that saves a barrier at its end (``ShmProcessGroup._phases`` gives the schedule and the
rules that make it safe).

The segment is a ``memfd`` (never a file in ``/dev/shm``): rank 0 of the group creates it, the
other ranks open it through ``/proc/<pid>/fd/<fd>`` (same user only, like the mode 0600 of a
file), and rank 0 closes its descriptor once all have mapped it. The memory is the kernel's to
free when the last rank unmaps it or dies, whatever the way it dies: nothing can leak.

Ordering: barriers are per-rank generation counters (one writer each) in the segment, waited on
with ``futex(2)`` after a short spin. Beside its counter, in the same cache line, each rank writes
what it is calling (collective, reduce op, root, dtype, size, step) before every barrier, and
reads its peers' after it: ranks that called different collectives, or the same one on different
sizes, dtypes, ops or roots, all raise :class:`~onedist.errors.CollectiveMismatchError` at that
barrier, naming each rank's call, and the group stays usable. With gloo such a program hangs, or
silently returns garbage; here it costs about a microsecond per collective, so it is always on.

x86-64 keeps stores in order (TSO), which the protocol needs between the data a rank writes and
the counter it bumps after it: :func:`supported` is False on other architectures and
``backend="shm"`` is refused there.

A group whose ranks are not all on one host, or whose ranks cannot open each other's memfd
(different PID namespaces), runs every collective on its gloo group: ``shm`` is never wrong, at
worst it is gloo.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import platform
import socket
import struct
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from functools import partial
from itertools import accumulate
from typing import Any, Optional

import torch
import torch._C._distributed_c10d as _c10d
import torch.distributed as dist

from ..errors import CollectiveMismatchError
from . import _pygroup
from ._pygroup import ArgCheck, OrderedGroup, PyWork, all_cpu, averages, for_each, op_name, opts_or
from ._pygroup import flat as _flat

logger = logging.getLogger("onedist")

#: torch.distributed's name of the backend (``init_process_group("shm")``, ``dist.get_backend()``)
NAME = "shm"
#: bytes per rank's slot; a collective larger than this goes in chunks (``ONEDIST_SHM_CHUNK_MB``;
#: less on many ranks with a small L3 cache, see _chunk_bytes)
DEFAULT_CHUNK = 4 << 20
_MIN_CHUNK = 256 << 10
_LINE = 64  # one cache line per rank's counter: no false sharing between writers
_HEADER = 4096
_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_WAIT_SLICE_S = 0.05  # between liveness checks while blocked in futex_wait
_MASK = 0xFFFFFFFF
_HALF = 0x80000000
#: what a rank is calling at a barrier (see ShmProcessGroup._barrier): kind, reduce op, root,
#: dtype, count (elements, or bytes where the dtype does not matter), step within the call
_CALL = struct.Struct("<iiiiqi")
_STEP = struct.Struct("<i")  # the record's last field
#: where, in a rank's counter line, its call for a barrier of even / odd generation goes: a peer
#: reads it after that barrier, and the rank cannot write the slot again before the barrier after next
_CALL_AT = (8, 8 + _CALL.size)
assert _CALL_AT[1] + _CALL.size <= 64
_KIND_ALL_REDUCE, _KIND_REDUCE, _KIND_BROADCAST, _KIND_ALL_GATHER = 1, 2, 3, 4
_KIND_REDUCE_SCATTER, _KIND_BARRIER = 5, 6
_KIND_GATHER, _KIND_SCATTER, _KIND_ALL_TO_ALL = 7, 8, 9
_KIND_ALL_GATHER_COALESCED = 10  # gloo runs it, after one barrier that checks the calls (_agree)
_KIND_ALL_GATHER_UNEVEN = 11
_KINDS = {
    _KIND_ALL_REDUCE: "all_reduce",
    _KIND_REDUCE: "reduce",
    _KIND_BROADCAST: "broadcast",
    _KIND_ALL_GATHER: "all_gather",
    _KIND_REDUCE_SCATTER: "reduce_scatter",
    _KIND_BARRIER: "barrier",
    _KIND_GATHER: "gather",
    _KIND_SCATTER: "scatter",
    _KIND_ALL_TO_ALL: "all_to_all",
    _KIND_ALL_GATHER_COALESCED: "all_gather_coalesced",
    _KIND_ALL_GATHER_UNEVEN: "all_gather_uneven",  # onedist.all_gather of tensors whose sizes differ
}
_DTYPES: list[torch.dtype] = []  # code - 1 -> dtype: every torch dtype, sorted by name (see _dtypes)
_DTYPE_CODES: dict[torch.dtype, int] = {}


def _dtypes() -> list[torch.dtype]:
    """Every torch dtype, in an order that is the same in every process running this torch."""
    if not _DTYPES:
        _DTYPES.extend(sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str))
        _DTYPE_CODES.update({d: i + 1 for i, d in enumerate(_DTYPES)})
    return _DTYPES


def _dtype_code(dtype: torch.dtype) -> int:
    """A number for ``dtype`` that is the same in every process running this torch (from 1)."""
    _dtypes()
    return _DTYPE_CODES.get(dtype, -1)


def _describe(call: tuple[int, ...]) -> str:
    """One rank's call (a _CALL record), as a user would write it."""
    kind, op, root, dtype, count, step = call
    name = _KINDS.get(kind)
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
    return f"{name}({', '.join(args)}) of {what}{later}"


#: collectives of at least this many bytes run on the group's thread (see ShmProcessGroup._run)
_ASYNC_BYTES = 1 << 20
#: an all_reduce of at most this many bytes is one step (every rank reduces all of it, after one
#: barrier, not two): a small collective's time is its barriers and torch calls, not its bytes
_SMALL_BYTES = 16 << 10
#: copies and reductions are split over the helper threads in parts of at least this many bytes
_SPLIT_BYTES = 512 << 10


def supported() -> bool:
    """True where the shm backend can run: Linux on x86-64 (TSO ordering, memfd, futex)."""
    return (
        sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64") and hasattr(os, "memfd_create")
    )


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


def _host_id() -> str:
    """This host's identity: hostname and boot id (two containers on one kernel share memory).

    ``ONEDIST_SHM_HOST`` replaces it: containers that share memory but not a hostname can say so,
    and tests split one machine into "hosts" with it.
    """
    given = os.environ.get("ONEDIST_SHM_HOST")
    if given:
        return given
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


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


_REDUCE: dict[Any, Callable[..., Any]] = {}


def _reduce_fn(op: Any, dtype: torch.dtype) -> Callable[..., Any]:
    """The elementwise function of reduce op ``op`` on ``dtype`` (see :func:`_reduction`)."""
    return _reduction(op, dtype)[0]


def _reduction(op: Any, dtype: torch.dtype) -> tuple[Callable[..., Any], int, bool, int]:
    """Reduce op ``op`` on ``dtype``: its elementwise function (for bool tensors: SUM is or,
    PRODUCT is and; AVG is SUM, divided by the group size afterwards, see
    :func:`._pygroup.averages`), the op's number and the dtype's (for the call check, see
    ShmProcessGroup._begin), and whether it averages.

    Raises ValueError for an op the backend lacks, or one ``dtype`` cannot take (a bitwise op on
    floats, AVG on integers: gloo refuses both too). Every rank checks before anything moves, so
    the group stays usable after the error, as gloo's does. Answers are cached, and one lookup
    serves the whole call: a small collective's time is its Python calls (reading ``op.op`` off
    torch's ReduceOp alone takes 0.3 µs)."""
    kind = getattr(op, "op", op)  # a ReduceOp (options) or its RedOpType
    try:
        return _FNS[(kind, dtype)]
    except (KeyError, TypeError):
        pass
    fn = _reduce_op(kind)
    integral = dtype == torch.bool or not (dtype.is_floating_point or dtype.is_complex)
    if fn in (torch.bitwise_and, torch.bitwise_or, torch.bitwise_xor) and not integral:
        raise ValueError(
            f"onedist shm: reduce op {op_name(kind)} needs an integer or bool tensor; got dtype "
            f"{dtype} (gloo refuses it too)"
        )
    if averages(kind) and integral:
        raise ValueError(
            f"onedist shm: reduce op AVG needs a floating-point or complex tensor; got dtype {dtype} "
            "(an integer average is not an integer: use SUM and divide)"
        )
    if dtype == torch.bool and fn in (torch.add, torch.mul):
        fn = torch.logical_or if fn is torch.add else torch.logical_and
    answer = _FNS[(kind, dtype)] = (fn, int(kind), averages(kind), _dtype_code(dtype))
    return answer


_FNS: dict[tuple[Any, torch.dtype], tuple[Callable[..., Any], int, bool, int]] = {}


def _check_op(op: Any, tensors: Sequence[torch.Tensor]) -> None:
    """Raise, on every rank and before anything moves, when ``op`` cannot reduce one of
    ``tensors`` (see :func:`_reduce_fn`)."""
    for t in tensors:
        _reduce_fn(op, t.dtype)


def _reduce_into(fn: Callable[..., Any], dst: torch.Tensor, sources: list[torch.Tensor]) -> None:
    """``dst = sources[0] fn sources[1] fn ...``, in that order (the same bits on every rank)."""
    if len(sources) == 1:
        dst.copy_(sources[0])
        return
    fn(sources[0], sources[1], out=dst)
    for src in sources[2:]:
        fn(dst, src, out=dst)


def _reduce_op(op: Any) -> Callable[..., Any]:
    if not _REDUCE:
        R = dist.ReduceOp
        _REDUCE.update(
            {
                R.SUM: torch.add,
                R.AVG: torch.add,
                R.PRODUCT: torch.mul,
                R.MIN: torch.minimum,
                R.MAX: torch.maximum,
                R.BAND: torch.bitwise_and,
                R.BOR: torch.bitwise_or,
                R.BXOR: torch.bitwise_xor,
            }
        )
    try:
        return _REDUCE[getattr(op, "op", op)]  # a ReduceOp (options) or its RedOpType
    except (KeyError, TypeError):
        raise ValueError(
            f"onedist shm: reduce op {op_name(op)} is not supported; SUM, AVG, PRODUCT, MIN, "
            "MAX, BAND, BOR, BXOR are"
        ) from None


class _Bank:
    """One of the segment's two banks: a slot per rank, then the result area, ``chunk`` bytes each
    (contiguous: a broadcast moves ``slot_area``, all the slots, at a time)."""

    def __init__(self, data: torch.Tensor, size: int, chunk: int) -> None:
        self.slot_area = data[: size * chunk]
        self.slots = [data[i * chunk : (i + 1) * chunk] for i in range(size)]
        self.out = data[size * chunk : (size + 1) * chunk]  # empty in a mailbox
        self.at: list[int] = []  # each slot's offset in the segment (see _Segment)
        self._typed: dict[torch.dtype, list[torch.Tensor]] = {}

    def typed_slots(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """The slots as tensors of ``dtype`` (made once per dtype: small collectives are bound by
        the cost of each torch call)."""
        views = self._typed.get(dtype)
        if views is None:
            views = self._typed[dtype] = [s.view(dtype) for s in self.slots]
        return views


class _Segment:
    """The mapped segment: per-rank counters, then two banks (see ShmProcessGroup._phases)."""

    def __init__(self, mm: mmap.mmap, size: int, chunk: int) -> None:
        self.chunk = chunk
        self.mm = mm
        self.data = torch.frombuffer(mm, dtype=torch.uint8)  # shares the mapping
        ctrl = _HEADER
        self.counters = (ctypes.c_int32 * (size * _LINE // 4)).from_buffer(mm, ctrl)
        self.base = ctypes.addressof(self.counters)
        self.pids = (ctypes.c_int64 * size).from_buffer(mm, 64)
        self.abort = ctypes.c_int32.from_buffer(mm, 16)  # 1 + the rank at fault, 0 while healthy
        self.abort_exited = ctypes.c_int32.from_buffer(mm, 20)  # 1: that rank died, 0: it raised
        data0 = ctrl + _round(size * _LINE)
        bank = (size + 1) * chunk
        self.banks = [
            _Bank(self.data[data0 + i * bank : data0 + (i + 1) * bank], size, chunk) for i in (0, 1)
        ]
        # two mailboxes for small all_reduces (a slot of _SMALL_BYTES per rank each), which they
        # alternate between; nothing else uses them, so they never move the banks
        mail0, box = data0 + 2 * bank, size * _SMALL_BYTES
        self.mailboxes = [
            _Bank(self.data[mail0 + i * box : mail0 + (i + 1) * box], size, _SMALL_BYTES) for i in (0, 1)
        ]
        for b in self.banks + self.mailboxes:
            b.at = [s.data_ptr() - self.data.data_ptr() for s in b.slots]

    @staticmethod
    def nbytes(size: int, chunk: int) -> int:
        return _HEADER + _round(size * _LINE) + 2 * (size + 1) * chunk + 2 * size * _SMALL_BYTES


def _round(n: int, to: int = 4096) -> int:
    return (n + to - 1) // to * to


def _poison_on_error(method: Callable[..., Any]) -> Callable[..., Any]:
    """A rank that fails inside a shm collective marks the segment, so that its peers, waiting in
    the same collective, raise at once instead of at the timeout (the group is unusable after)."""

    def wrapper(self: ShmProcessGroup, *args: Any, **kwargs: Any) -> Any:
        return self._poisoning(method, self, *args, **kwargs)

    wrapper.__name__ = method.__name__
    wrapper.__doc__ = method.__doc__
    return wrapper


class ShmProcessGroup(OrderedGroup):
    """The process group behind ``backend="shm"`` (see the module docstring)."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._timeout = timeout.total_seconds() if timeout else 1800.0
        self._gloo: Any = dist.ProcessGroupGloo(
            _c10d.PrefixStore("onedist-shm-gloo", store), rank, size, timeout
        )
        self._seg: Optional[_Segment] = None
        self._gen = 0
        self._bank = 0  # the bank the next collective's first chunk goes through (see _phases)
        self._mail = 0  # the mailbox of the next small all_reduce (see _all_reduce_small)
        # an all_to_all's head: where a rank's parts start (and end), and what it expects from each
        self._heads = struct.Struct(f"<{2 * size + 1}q")
        self._record = _CALL.pack(_KIND_BARRIER, -1, -1, 0, 0, 0)  # what this rank calls (see _begin)
        #: this group's ranks as ranks of the group that holds it (one host's part of a group over
        #: several hosts), for errors; None: a group of its own
        self._shown_as: Optional[list[int]] = None
        self._step = 0
        self._others = [r for r in range(size) if r != rank]
        self._spin = 2000 if size <= (os.cpu_count() or 1) else 20
        self._helpers = _helper_pool(size)
        self._parts = 1 + (self._helpers._max_workers if self._helpers is not None else 0)
        #: ranks on several hosts: this host's ranks share a shm group, and one rank per host
        #: (the first) joins the others' first ranks in a gloo group (see _hierarchy)
        self._local: Optional[ShmProcessGroup] = None
        self._leaders: Any = None
        self._hosts: list[list[int]] = []
        if size > 1:
            hosts = _host_map(store, rank, size)
            if len(hosts) == 1:
                self._seg = _attach(store, rank, size)
            else:
                self._hierarchy(store, hosts, timeout)

    def _hierarchy(self, store: Any, hosts: list[list[int]], timeout: timedelta) -> None:
        """Two levels for a group over several hosts: shm among each host's ranks, gloo among one
        rank per host. all_reduce, broadcast and barrier go through both; the rest goes to gloo."""
        self._hosts = hosts
        index = next(i for i, h in enumerate(hosts) if self._rank in h)
        mine = hosts[index]
        if len(mine) > 1:
            local_store = _c10d.PrefixStore(f"onedist-shm/host-{index}", store)
            self._local = ShmProcessGroup(local_store, mine.index(self._rank), len(mine), timeout)
            self._local._shown_as = mine
        if self._rank == mine[0]:
            leader_store = _c10d.PrefixStore("onedist-shm/leaders", store)
            self._leaders = dist.ProcessGroupGloo(leader_store, index, len(hosts), timeout)
        logger.info(
            "onedist shm: the group spans %d hosts; shared memory within each, gloo across (this host: "
            "group ranks %s)",
            len(hosts),
            mine,
        )

    @property
    def _hierarchical(self) -> bool:
        return bool(self._hosts)

    def _in_local(self, method: Callable[..., Any], *args: Any) -> None:
        """One step on this host's shm group (a failure marks its segment for the host's peers)."""
        if self._local is not None:
            try:
                self._local._poisoning(method.__get__(self._local), *args)
            except ShmError as e:
                if e.culprit is not None:  # the host group's rank, as a rank of this group
                    e.culprit = self._hosts[self._host_of(self._rank)][e.culprit]
                raise

    def _host_of(self, rank: int) -> int:
        return next(i for i, h in enumerate(self._hosts) if rank in h)

    def _hier_all_reduce(self, t: torch.Tensor, op: Any) -> None:
        """Reduce to each host's first rank over shm, all_reduce among those over gloo, then
        broadcast back over shm: every rank gets the same bits."""
        flat, writeback = _flat(t)
        if flat.numel() == 0:  # the host's ranks still meet (see _all_reduce_one); nothing crosses hosts
            self._in_local(ShmProcessGroup._all_reduce_one, flat, op, None)
            return
        average = averages(op)
        if average:  # summed through both levels, divided by the whole group's size at the end
            op = dist.ReduceOp.SUM
        self._in_local(ShmProcessGroup._all_reduce_one, flat, op, 0)
        if self._leaders is not None:
            opts = _c10d.AllreduceOptions()
            opts.reduceOp = op
            self._leaders.allreduce([flat], opts).wait()
        self._in_local(ShmProcessGroup._broadcast_one, flat, 0)
        if average:
            flat.div_(self._size)
        if writeback:
            t.copy_(flat.view(t.shape))

    def _hier_broadcast(self, t: torch.Tensor, root: int) -> None:
        flat, writeback = _flat(t)
        if flat.numel() == 0:  # the host's ranks still meet (see _phases); nothing crosses hosts
            self._in_local(ShmProcessGroup._broadcast_one, flat, 0)
            return
        source_host = self._host_of(root)
        home = source_host == self._host_of(self._rank)
        if home:  # the root's host first: its first rank then holds the data
            self._in_local(ShmProcessGroup._broadcast_one, flat, self._hosts[source_host].index(root))
        if self._leaders is not None:
            opts = _c10d.BroadcastOptions()
            opts.rootRank = source_host
            self._leaders.broadcast([flat], opts).wait()
        if not home:
            self._in_local(ShmProcessGroup._broadcast_one, flat, 0)
        if writeback and self._rank != root:
            t.copy_(flat.view(t.shape))

    def _hier_barrier(self) -> None:
        self._in_local(ShmProcessGroup._barrier_call)
        if self._leaders is not None:
            self._leaders.barrier(_c10d.BarrierOptions()).wait()
        self._in_local(ShmProcessGroup._barrier_call)

    def _poisoning(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``call(*args, **kwargs)``, marking the segment when it fails (see _poison_on_error)."""
        gen = self._gen
        try:
            return call(*args, **kwargs)
        except (ValueError, TypeError):
            if self._gen != gen:  # an argument error before any barrier is every rank's: no harm
                self.abort()
            raise
        except ShmError as e:
            self._mark(e.culprit)
            raise
        except CollectiveMismatchError:  # every rank raises it at the same barrier: no harm
            raise
        except BaseException:
            self.abort()
            raise

    # ------------------------------------------------------------------ identity
    def getBackendName(self) -> str:
        return NAME

    _thread_name = "onedist-shm"

    def _execute(self, job: Callable[[], Any]) -> Any:
        return self._poisoning(job)

    @property
    def uses_shared_memory(self) -> bool:
        """False when this group runs everything on gloo (one rank per host, no shared memory)."""
        return self._seg is not None or (self._local is not None and self._local.uses_shared_memory)

    # ------------------------------------------------------------------ synchronisation
    def _begin(self, kind: int, count: int, dtype: int = 0, op: int = -1, root: int = -1) -> None:
        """What this rank calls now, for the check at each of the call's barriers (see _barrier):
        ``count`` elements of the dtype numbered ``dtype`` (see _reduction), or bytes where the
        dtype does not matter (0); ``op``, ``root``: -1 where the call has none."""
        self._record = _CALL.pack(kind, op, root, dtype, count, 0)
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
        stride = _LINE // 4
        at = _HEADER + _CALL_AT[g & 1]
        mine = self._record if not self._step else self._record[:-4] + _STEP.pack(self._step)
        mm[at + self._rank * _LINE : at + self._rank * _LINE + _CALL.size] = mine  # before the counter
        counters[self._rank * stride] = g - (1 << 32) if g >= _HALF else g
        syscall = _futex()
        syscall(
            _SYS_FUTEX, ctypes.c_void_p(seg.base + self._rank * _LINE), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0
        )
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
            if mm[at + j * _LINE : at + j * _LINE + _CALL.size] != mine:
                raise self._mismatch(at)

    def _mismatch(self, at: int) -> CollectiveMismatchError:
        """Every rank's call at this barrier (whose records start at ``at``), as an error that every
        rank raises alike. At the first barrier of their calls, the ranks have written only to the
        segment, and the group stays usable. A difference at a later step would mean ranks out of
        step since an earlier call, which the size in the record and the barrier of empty calls
        rule out; should it happen, the group is marked failed."""
        seg = self._seg
        assert seg is not None
        calls = [_CALL.unpack_from(seg.mm, at + j * _LINE) for j in range(self._size)]
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
        lines += [f"  rank {r}: {_describe(call)}" for r, call in zip(ranks, calls)]
        lines.append(
            "HINT: every rank of a group must call the same collectives, in the same order, with tensors "
            "of the same size and dtype (and the same op and root); ONEDIST_DEBUG=1 also names each "
            "rank's file:line." + (" No tensor was changed, and the group is still usable." if usable else "")
        )
        return CollectiveMismatchError("\n".join(lines))

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
        seg = self._seg
        assert seg is not None
        counters, idx = seg.counters, j * (_LINE // 4)
        addr = ctypes.c_void_p(seg.base + j * _LINE)
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

    # ------------------------------------------------------------------ memory work
    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._split(lambda d, s: d.copy_(s), dst, src)

    def _reduce(self, fn: Callable[..., Any], dst: torch.Tensor, sources: list[torch.Tensor]) -> None:
        self._split(lambda d, *srcs: _reduce_into(fn, d, list(srcs)), dst, *sources)

    def _split(self, work: Callable[..., Any], *tensors: torch.Tensor) -> None:
        """``work(*tensors)``, split over the helper threads when there are idle cores for them
        (one core's memory bandwidth is what bounds a rank; torch's kernels release the GIL)."""
        pool = self._helpers
        n = tensors[0].shape[0]
        parts = min(self._parts, n * tensors[0].element_size() // _SPLIT_BYTES)
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
        stages: Sequence[Optional[Callable[[int, _Bank], None]]],
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
        are twice the cache footprint), so only broadcast uses it.

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

    # ------------------------------------------------------------------ collectives
    @_poison_on_error
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        _check_op(op, tensors)
        if self._hierarchical and all_cpu(tensors):
            job = partial(for_each, partial(self._hier_all_reduce, op=op), tensors)
            return self._run(job, tensors, tensors)
        if self._seg is None or not all_cpu(tensors):
            return self._gloo.allreduce(tensors, opts_or(_c10d.AllreduceOptions, opts))
        return self._reduce_each(tensors, op, None)

    @_poison_on_error
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        if self._hierarchical:
            return self.allreduce(tensors, opts)
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        _check_op(op, tensors)
        if self._seg is None or not all_cpu(tensors):
            return self._gloo.allreduce_coalesced(tensors, opts or _c10d.AllreduceCoalescedOptions())
        return self._reduce_each(tensors, op, None)

    @_poison_on_error
    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        ArgCheck(NAME, "reduce", self._size).root(opts.rootRank)
        _check_op(opts.reduceOp, tensors)
        if self._seg is None or not all_cpu(tensors):
            return self._gloo.reduce(tensors, opts)
        return self._reduce_each(tensors, opts.reduceOp, opts.rootRank)

    def _reduce_each(self, tensors: list[torch.Tensor], op: Any, root: Optional[int]) -> Any:
        """all_reduce (``root`` None) or reduce to ``root`` of each tensor, in order (their ops
        and dtypes checked)."""
        return self._run(
            partial(for_each, partial(self._all_reduce_one, op=op, root=root), tensors), tensors, tensors
        )

    def _all_reduce_one(self, tensor: torch.Tensor, op: Any, root: Optional[int]) -> None:
        fn, code, average, dtype_code = _reduction(op, tensor.dtype)
        seg = self._seg
        assert seg is not None
        flat, writeback = _flat(tensor)
        n = flat.numel()
        self._begin(
            _KIND_ALL_REDUCE if root is None else _KIND_REDUCE,
            n,
            dtype_code,
            code,
            -1 if root is None else root,
        )
        if n == 0:  # nothing moves, but the ranks meet: a peer's non-empty call fails here, not later
            self._barrier("all_reduce")
            return
        if n * flat.element_size() <= _SMALL_BYTES:
            self._all_reduce_small(flat, fn, root)
            if average and root in (None, self._rank):
                flat.div_(self._size)
            if writeback and root in (None, self._rank):
                tensor.copy_(flat.view(tensor.shape))
            return
        per = seg.chunk // flat.element_size()
        size, me, dtype = self._size, self._rank, flat.dtype

        def span(k: int) -> tuple[torch.Tensor, int, int, int]:
            """Chunk ``k`` of the tensor, its length, and the slice [a, b) this rank reduces."""
            c = min(per, n - k * per)
            return flat[k * per : k * per + c], c, c * me // size, c * (me + 1) // size

        def copy_in(k: int, bank: _Bank) -> None:
            # the peers need every slice of this rank's chunk but [a, b), which this rank reduces
            # itself, straight from its own tensor
            part, c, a, b = span(k)
            slot = bank.slots[me].view(dtype)
            if a > 0:
                self._copy(slot[:a], part[:a])
            if b < c:
                self._copy(slot[b:c], part[b:c])

        def reduce(k: int, bank: _Bank) -> None:
            part, _, a, b = span(k)
            if b > a:
                sources = [part[a:b] if j == me else bank.slots[j].view(dtype)[a:b] for j in range(size)]
                self._reduce(fn, bank.out.view(dtype)[a:b], sources)

        def copy_out(k: int, bank: _Bank) -> None:
            part, c, _, _ = span(k)
            if average:  # the division on the way out, not one more pass over the tensor
                self._split(lambda d, s: torch.div(s, size, out=d), part, bank.out.view(dtype)[:c])
            else:
                self._copy(part, bank.out.view(dtype)[:c])

        copies_out = root is None or root == me
        stages = [copy_in, reduce, copy_out if copies_out else None]
        self._phases(-(-n // per), stages, "all_reduce", ends_in_result=True)
        if writeback and copies_out:
            tensor.copy_(flat.view(tensor.shape))

    def _all_reduce_small(self, flat: torch.Tensor, fn: Callable[..., Any], root: Optional[int]) -> None:
        """A small all_reduce (or reduce) in one step: every rank puts its whole tensor in its
        slot of a mailbox and, after one barrier, reduces all slots itself, in rank order (the
        same bits on every rank). Its last step reads the mailbox, with no barrier behind it, so
        the next small all_reduce uses the other one; by then every rank has left this one,
        since the other's barrier (or a collective between) needs them all."""
        seg = self._seg
        assert seg is not None
        n = flat.numel()
        slots = seg.mailboxes[self._mail].typed_slots(flat.dtype)
        slots[self._rank][:n].copy_(flat)
        self._barrier("all_reduce")
        if root is None or root == self._rank:
            _reduce_into(fn, flat, [s[:n] for s in slots])
        self._mail ^= 1

    @_poison_on_error
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = opts.rootRank if opts is not None else 0
        ArgCheck(NAME, "broadcast", self._size).root(root)
        if self._hierarchical and all_cpu(tensors):
            job = partial(for_each, partial(self._hier_broadcast, root=root), tensors)
            return self._run(job, tensors, tensors)
        if self._seg is None or not all_cpu(tensors):
            return self._gloo.broadcast(tensors, opts_or(_c10d.BroadcastOptions, opts))
        return self._run(
            partial(for_each, partial(self._broadcast_one, root=root), tensors), tensors, tensors
        )

    def _broadcast_one(self, t: torch.Tensor, root: int) -> None:
        """The root puts chunk k in one bank while the others take chunk k-1 from the other."""
        seg = self._seg
        assert seg is not None
        flat, writeback = _flat(t)
        raw = flat.view(torch.uint8)
        n, cap = raw.numel(), seg.chunk * self._size  # a broadcast chunk fills a bank's slots
        self._begin(_KIND_BROADCAST, n, root=root)

        def put(k: int, bank: _Bank) -> None:
            c = min(cap, n - k * cap)
            self._copy(bank.slot_area[:c], raw[k * cap : k * cap + c])

        def take(k: int, bank: _Bank) -> None:
            c = min(cap, n - k * cap)
            self._copy(raw[k * cap : k * cap + c], bank.slot_area[:c])

        root_here = self._rank == root
        stages = [put if root_here else None, None if root_here else take]
        self._phases(-(-n // cap), stages, "broadcast", overlap=True)
        if writeback and not root_here:
            t.copy_(flat.view(t.shape))

    @_poison_on_error
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        ArgCheck(NAME, "all_gather_into_tensor", self._size).whole(output, input, "output")
        if self._seg is None or not all_cpu([output, input]):
            return self._gloo._allgather_base(output, input, opts or _c10d.AllgatherOptions())
        n = input.numel()
        parts = [output.view(-1)[i * n : (i + 1) * n] for i in range(self._size)]
        return self._run(partial(self._gather_into, parts, input), [input], output)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self.all_gather_single(output, input, opts)

    @_poison_on_error
    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        ArgCheck(NAME, "all_gather", self._size).per_rank(outputs, inputs, "output")
        if self._seg is None or not all_cpu(inputs + [t for ts in outputs for t in ts]):
            return self._gloo.allgather(outputs, inputs, opts or _c10d.AllgatherOptions())
        return self._run(partial(for_each, self._gather_into, outputs, inputs), inputs, outputs)

    def all_gather_uneven(self, out: torch.Tensor, block: torch.Tensor, sizes: list[int]) -> Optional[PyWork]:
        """onedist's all_gather of byte blocks whose sizes differ (``sizes[r]`` bytes from rank ``r``,
        known to every rank: ``onedist.all_gather`` gathers them first) into ``out``, in rank order,
        through the slots as an all_gather: as many chunks as the largest block needs. None when
        this group has no shared memory or a tensor is not on the CPU (the caller then uses an
        all_to_all or send/recv, which need the block once per peer or a round trip through gloo).

        Called as ``pg.all_gather_uneven(out, block, sizes).wait()``.
        """
        if self._seg is None or not all_cpu([out, block]):
            return None
        return self._poisoning(self._run, partial(self._gather_uneven, out, block, sizes), [block], out)  # type: ignore[no-any-return]

    def _gather_uneven(self, out: torch.Tensor, block: torch.Tensor, sizes: list[int]) -> None:
        self._begin(_KIND_ALL_GATHER_UNEVEN, sum(sizes))  # in bytes, all of them: the same on every rank
        self._gather_chunks(_bytes_of(block)[0], list(out.split_with_sizes(sizes)), sizes, "all_gather")

    def _gather_into(self, outs: list[torch.Tensor], inp: torch.Tensor) -> None:
        raw = _bytes_of(inp)[0]
        self._begin(_KIND_ALL_GATHER, raw.numel())
        self._gather_chunks(raw, outs, [raw.numel()] * self._size, "all_gather")

    def _gather_chunks(
        self, raw: torch.Tensor, outs: list[torch.Tensor], sizes: list[int], what: str, root: int = -1
    ) -> None:
        """Every rank's bytes ``raw`` (``sizes[r]`` of them from rank ``r``) into ``outs[r]``, in
        chunks through the slots, on every rank (all_gather), or with ``root`` on the root only
        (gather: the others pass no ``outs``; the root puts nothing and takes its own part straight
        from ``raw``). The caller has recorded the call (_begin)."""
        seg, me = self._seg, self._rank
        assert seg is not None
        cap = seg.chunk
        targets = [(o, *_bytes_of(o)) for o in outs]

        def put(k: int, bank: _Bank) -> None:
            lo = k * cap
            if lo < sizes[me]:
                self._copy(bank.slots[me][: min(cap, sizes[me] - lo)], raw[lo : lo + cap])

        def take(k: int, bank: _Bank) -> None:
            # a rank that put its own part takes it back from its slot, in the cache: copying it
            # from the input instead (in put, or all at once) was 0.84x at 16 and 128 MB here
            lo = k * cap
            for j, ((_, dst, _, _), n) in enumerate(zip(targets, sizes)):
                if lo < n:
                    c = min(cap, n - lo)
                    self._copy(dst[lo : lo + c], raw[lo : lo + c] if j == root else bank.slots[j][:c])

        stages = [None if me == root else put, take if targets else None]
        self._phases(-(-max(sizes) // cap), stages, what)
        for o, _, flat, writeback in targets:
            if writeback:
                o.copy_(flat.view(o.shape))

    @_poison_on_error
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        _reduce_fn(op, input.dtype)
        ArgCheck(NAME, "reduce_scatter_tensor", self._size).whole(input, output, "input")
        if self._seg is None or not all_cpu([output, input]):
            return self._gloo._reduce_scatter_base(output, input, opts or _c10d.ReduceScatterOptions())
        rows = input.reshape(self._size, -1)
        return self._run(partial(self._reduce_scatter, output, rows, op), [input], output)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self.reduce_scatter_single(output, input, opts)

    @_poison_on_error
    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> Any:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        ArgCheck(NAME, "reduce_scatter", self._size).per_rank(inputs, outputs, "input")
        _check_op(op, outputs)
        if self._seg is None or not all_cpu(outputs + [t for ts in inputs for t in ts]):
            return self._gloo.reduce_scatter(outputs, inputs, opts or _c10d.ReduceScatterOptions())
        stacked = [torch.stack([i.reshape(-1) for i in ins]) for ins in inputs]
        return self._run(
            partial(for_each, partial(self._reduce_scatter, op=op), outputs, stacked),
            stacked,
            outputs,
        )

    def _reduce_scatter(self, output: torch.Tensor, rows: torch.Tensor, op: Any) -> None:
        """``rows`` [size, n]: row r is this rank's contribution to rank r's output."""
        fn, code, average, dtype_code = _reduction(op, rows.dtype)
        seg = self._seg
        assert seg is not None
        out_flat, writeback = _flat(output)
        n = out_flat.numel()
        size, me = self._size, self._rank
        per = seg.chunk // rows.element_size() // size
        self._begin(_KIND_REDUCE_SCATTER, n, dtype_code, code)

        def grid(bank: _Bank, j: int) -> torch.Tensor:
            return bank.slots[j].view(rows.dtype)[: per * size].view(size, per)

        def put(k: int, bank: _Bank) -> None:
            # every row but this rank's own, which it reduces straight from ``rows``
            lo, c = k * per, min(per, n - k * per)
            mine = grid(bank, me)
            if me > 0:
                mine[:me, :c].copy_(rows[:me, lo : lo + c])
            if me < size - 1:
                mine[me + 1 :, :c].copy_(rows[me + 1 :, lo : lo + c])

        def reduce(k: int, bank: _Bank) -> None:
            lo, c = k * per, min(per, n - k * per)
            sources = [rows[me, lo : lo + c] if j == me else grid(bank, j)[me, :c] for j in range(size)]
            self._reduce(fn, out_flat[lo : lo + c], sources)

        self._phases(-(-n // per), [put, reduce], "reduce_scatter")
        if average:
            out_flat.div_(size)
        if writeback:
            output.copy_(out_flat.view(output.shape))

    @_poison_on_error
    def barrier(self, opts: Any = None) -> Any:
        if self._hierarchical:
            return self._run(self._hier_barrier, [], None)
        if self._seg is None:
            return self._gloo.barrier(opts or _c10d.BarrierOptions())
        return self._run(self._barrier_call, [], None)

    def _barrier_call(self) -> None:
        self._begin(_KIND_BARRIER, 0)
        self._barrier("barrier")

    # ------------------------------------------------------------------ gather, scatter, all_to_all
    # (arguments checked first as for the others: gloo names less, hangs a peer on some wrong
    # lists, and silently drops the rest of an all_to_all_single that does not split evenly).
    # Through gloo a small one took 200-500 us here and, unchecked, hung until the timeout when
    # the ranks called different collectives.
    def _agree(self, kind: int, tensors: Sequence[torch.Tensor]) -> None:
        """Before gloo runs a collective for this group (all_gather_coalesced): check at one barrier
        that every rank calls it (see _barrier), with the same dtype and number of elements of
        ``tensors`` (bytes when their dtypes differ); gloo would wait until the timeout when one
        rank calls it and another an all_reduce. Collectives queued before this one finish first.
        Without a segment (over several hosts, or no shared memory) gloo runs it unchecked."""
        if self._seg is None:
            return
        dtypes = {t.dtype for t in tensors}
        dtype = _dtype_code(tensors[0].dtype) if len(dtypes) == 1 else 0  # 0: count in bytes
        count = sum(t.numel() * (1 if dtype else t.element_size()) for t in tensors)

        def check() -> None:
            self._begin(kind, count, dtype)
            self._barrier(_KINDS[kind])

        self._poisoning(lambda: self._run(check, [], None).wait())

    def gather(self, outputs: Any, inputs: Any, opts: Any) -> Any:
        root = opts.rootRank
        check = ArgCheck(NAME, "gather", self._size)
        bad = check.at_root(root, self._rank, outputs, inputs, "output")
        if self._seg is None or not all_cpu(inputs + [t for ts in outputs for t in ts]):
            if bad is not None:  # the peers' parts land in scratch tensors, then the root raises
                scratch = [[torch.empty_like(i) for _ in range(self._size)] for i in inputs]
                self._gloo.gather(scratch, inputs, opts).wait()
                raise bad
            return self._gloo.gather(outputs, inputs, opts)
        lists = outputs if self._rank == root and bad is None else [None] * len(inputs)
        job = partial(for_each, partial(self._gather_one, root=root), lists, inputs)
        work = self._poisoning(self._run, job, inputs, outputs)
        if bad is not None:  # the root took no part in, but the others' parts moved: all in step
            work.wait()
            raise bad
        return work

    def _gather_one(self, outs: Optional[list[torch.Tensor]], inp: torch.Tensor, root: int) -> None:
        """``inp`` of every rank into ``outs`` on the root (None: this rank takes nothing)."""
        raw = _bytes_of(inp)[0]
        self._begin(_KIND_GATHER, inp.numel(), _dtype_code(inp.dtype), root=root)
        self._gather_chunks(raw, outs or [], [raw.numel()] * self._size, "gather", root)

    def scatter(self, outputs: Any, inputs: Any, opts: Any) -> Any:
        root = opts.rootRank
        check = ArgCheck(NAME, "scatter", self._size)
        bad = check.at_root(root, self._rank, inputs, outputs, "input")
        if self._seg is None or not all_cpu(outputs + [t for ts in inputs for t in ts]):
            # the root's verdict on its inputs first, so that every rank raises or none does
            ok = torch.tensor([bad is None], dtype=torch.uint8)
            verdict = _c10d.BroadcastOptions()
            verdict.rootRank = root
            self._gloo.broadcast([ok], verdict).wait()
            if not ok.item():
                raise bad if bad is not None else check.refused(root)
            return self._gloo.scatter(outputs, inputs, opts)
        refused = [False]

        def ask() -> None:
            refused[0] = self._root_refuses(root, bad is not None, outputs[0])

        self._poisoning(self._run, ask, [], None).wait()
        if refused[0]:
            raise bad if bad is not None else check.refused(root)
        lists = inputs if self._rank == root else [None] * len(outputs)
        job = partial(for_each, partial(self._scatter_one, root=root), outputs, lists)
        return self._poisoning(self._run, job, outputs, outputs)

    def _root_refuses(self, root: int, refuses: bool, like: torch.Tensor) -> bool:
        """Whether the root of a scatter (into ``like``) refused its inputs: it says so in its
        mailbox slot before one barrier, which also compares the ranks' calls. Every rank then
        raises, and none waits for the root."""
        seg = self._seg
        assert seg is not None
        box = seg.mailboxes[self._mail]
        if self._rank == root:
            box.slots[root][0] = int(refuses)
        self._begin(_KIND_SCATTER, like.numel(), _dtype_code(like.dtype), root=root)
        self._barrier("scatter")
        self._mail ^= 1  # read after the barrier, with none behind it (see _all_reduce_small)
        return bool(box.slots[root][0])

    def _scatter_one(self, out: torch.Tensor, ins: Optional[list[torch.Tensor]], root: int) -> None:
        """Part ``r`` of the root's ``ins`` into ``out`` on rank ``r``."""
        seg, me = self._seg, self._rank
        assert seg is not None
        raw, flat, writeback = _bytes_of(out)
        n, cap = raw.numel(), seg.chunk
        self._begin(_KIND_SCATTER, out.numel(), _dtype_code(out.dtype), root=root)
        parts = [_bytes_of(i)[0] for i in ins] if ins is not None else []

        def put(k: int, bank: _Bank) -> None:  # the root: rank j's part into slot j
            lo = k * cap
            for j, part in enumerate(parts):
                if j != me:
                    self._copy(bank.slots[j][: min(cap, n - lo)], part[lo : lo + cap])

        def take(k: int, bank: _Bank) -> None:
            lo = k * cap
            self._copy(
                raw[lo : lo + cap], parts[me][lo : lo + cap] if parts else bank.slots[me][: min(cap, n - lo)]
            )

        self._phases(-(-n // cap), [put if parts else None, take], "scatter")
        if writeback:
            out.copy_(flat.view(out.shape))

    def alltoall(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        check = ArgCheck(NAME, "all_to_all", self._size)
        check.count(inputs, "input")
        check.count(outputs, "output")
        if self._seg is None or not all_cpu(list(inputs) + list(outputs)):
            return self._gloo.alltoall(outputs, inputs, opts or _c10d.AllToAllOptions())
        dtypes = {t.dtype for t in inputs}
        code = _dtype_code(inputs[0].dtype) if len(dtypes) == 1 else 0

        def job() -> None:  # one exchange of bytes: the parts may differ in size and dtype
            raws = [_flat(t)[0].view(torch.uint8) for t in inputs]
            sizes = [o.numel() * o.element_size() for o in outputs]
            got = torch.empty(sum(sizes), dtype=torch.uint8)
            self._exchange(got, sizes, torch.cat(raws), [r.numel() for r in raws], code)
            for o, part in zip(outputs, got.split_with_sizes(sizes)):
                of, writeback = _flat(o)
                of.view(torch.uint8).copy_(part)  # bytes: a part may start at any offset
                if writeback:
                    o.copy_(of.view(o.shape))

        return self._poisoning(self._run, job, list(inputs), outputs)

    def all_to_all_single(
        self, output: Any, input: Any, out_splits: Any, in_splits: Any, opts: Any = None
    ) -> Any:
        check = ArgCheck(NAME, "all_to_all_single", self._size)
        check.splits(input, in_splits, "input")
        check.splits(output, out_splits, "output")
        if self._seg is None or not all_cpu([output, input]):
            return self._gloo.alltoall_base(
                output, input, out_splits, in_splits, opts or _c10d.AllToAllOptions()
            )

        def job() -> None:
            src, _ = _flat(input)
            dst, writeback = _flat(output)
            raw_out, raw_in = dst.view(torch.uint8), src.view(torch.uint8)
            self._exchange(
                raw_out,
                _byte_sizes(raw_out, output, out_splits, self._size),
                raw_in,
                _byte_sizes(raw_in, input, in_splits, self._size),
                _dtype_code(input.dtype),
            )
            if writeback:
                output.copy_(dst.view(output.shape))

        return self._poisoning(self._run, job, [input], output)

    def alltoall_base(
        self, output: Any, input: Any, out_splits: Any, in_splits: Any, opts: Any = None
    ) -> Any:
        return self.all_to_all_single(output, input, out_splits, in_splits, opts)

    def _exchange(
        self, out: torch.Tensor, out_sizes: list[int], inp: torch.Tensor, in_sizes: list[int], dtype: int
    ) -> None:
        """all_to_all of bytes: ``inp`` holds this rank's part for each rank in rank order,
        ``in_sizes`` bytes each; ``out`` gets each rank's part for this one, ``out_sizes`` bytes each.

        Each rank writes a head in its slot (where its parts start, and the end; then what it
        expects from each rank), and its parts after it when they fit. After the barrier every rank
        reads all heads, so all make the same choices: raise CollectiveMismatchError when a rank
        sends another a size it does not expect (every rank alike, nothing changed), take their
        parts from the slots when every rank's fitted (one step), else move them in rounds (see
        _exchange_rounds)."""
        seg = self._seg
        assert seg is not None
        size, me, mm = self._size, self._rank, seg.mm
        heads = self._heads
        head = _round(heads.size, 64)
        room = seg.chunk - head
        starts = list(accumulate(in_sizes, initial=0))
        self._begin(_KIND_ALL_TO_ALL, -1, dtype)  # the ranks may send different amounts
        told: list[tuple[int, ...]] = []

        def put(k: int, bank: _Bank) -> None:
            heads.pack_into(mm, bank.at[me], *starts, *out_sizes)
            total = starts[-1]
            if not 0 < total <= room:
                return
            slot = bank.slots[me]
            if total <= _SMALL_BYTES:  # all of it in one copy, this rank's own part too
                self._copy(slot[head : head + total], inp)
                return
            for j in range(self._size):  # the peers' parts: this rank takes its own from inp
                a, b = starts[j], starts[j + 1]
                if j != me and b > a:
                    self._copy(slot[head + a : head + b], inp[a:b])

        def take(k: int, bank: _Bank) -> None:
            full = [heads.unpack_from(mm, at) for at in bank.at]
            told.extend(f[: size + 1] for f in full)
            wrong = [
                (p, q, told[p][q + 1] - told[p][q], expect)
                for q, f in enumerate(full)
                for p, expect in enumerate(f[size + 1 :])
                if told[p][q + 1] - told[p][q] != expect
            ]
            if wrong:  # every rank sees it: all raise here, in step, and hand on the bank as at the end
                self._bank ^= 1
                raise self._split_mismatch(wrong)
            if any(h[-1] > room for h in told):
                return  # in rounds, after this step
            lo = 0
            for j, h in enumerate(told):
                want = out_sizes[j]
                if want:
                    part = (
                        inp[starts[me] : starts[me + 1]]
                        if j == me
                        else bank.slots[j][head + h[me] : head + h[me + 1]]
                    )
                    self._copy(out[lo : lo + want], part)
                lo += want

        self._phases(1, [put, take], "all_to_all")
        if any(h[-1] > room for h in told):
            self._exchange_rounds(out, inp, starts, told)

    def _split_mismatch(self, wrong: list[tuple[int, int, int, int]]) -> CollectiveMismatchError:
        """The error of an all_to_all whose ranks disagree on sizes: (sender, receiver, bytes sent,
        bytes expected) for each pair that disagrees."""
        lines = ["onedist shm: all_to_all: the ranks' split sizes do not agree:"]
        lines += [
            f"  rank {p} sends rank {q} {sent} bytes; rank {q} expects {want} (its output split for rank {p})"
            for p, q, sent, want in wrong
        ]
        lines.append(
            "HINT: each rank's output_split_sizes must match what the others send it (their "
            "input_split_sizes); no tensor was changed, and the group is still usable."
        )
        return CollectiveMismatchError("\n".join(lines))

    def _exchange_rounds(
        self, out: torch.Tensor, inp: torch.Tensor, starts: list[int], told: list[tuple[int, ...]]
    ) -> None:
        """The rest of an all_to_all too large for one step (``told``: where each rank's parts
        start, ``starts`` this rank's): in round ``k`` each rank puts bytes ``[k*c, (k+1)*c)`` of its
        part for rank ``q`` at ``q*c`` in its slot (``c``: a slot over the group size), and after a
        barrier each rank takes its pieces from every slot. As many rounds as the largest part
        needs; this rank's own part goes straight from ``inp`` to ``out``."""
        seg = self._seg
        assert seg is not None
        size, me = self._size, self._rank
        c = seg.chunk // size // 64 * 64 or seg.chunk // size  # cache lines, unless ranks are very many
        lens = [[h[q + 1] - h[q] for q in range(size)] for h in told]  # lens[p][q]: p sends q
        at = list(accumulate((lens[p][me] for p in range(size)), initial=0))  # each rank's part in out
        if lens[me][me]:
            self._copy(out[at[me] : at[me + 1]], inp[starts[me] : starts[me + 1]])
        most = max(lens[p][q] for p in range(size) for q in range(size) if p != q)

        def put(k: int, bank: _Bank) -> None:
            slot = bank.slots[me]
            for q in range(size):
                n = min(c, lens[me][q] - k * c)
                if q != me and n > 0:
                    lo = starts[q] + k * c
                    self._copy(slot[q * c : q * c + n], inp[lo : lo + n])

        def take(k: int, bank: _Bank) -> None:
            for p in range(size):
                n = min(c, lens[p][me] - k * c)
                if p != me and n > 0:
                    lo = at[p] + k * c
                    self._copy(out[lo : lo + n], bank.slots[p][me * c : me * c + n])

        self._phases(-(-most // c), [put, take], "all_to_all")

    def allgather_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        self._agree(_KIND_ALL_GATHER_COALESCED, inputs)
        return self._gloo.allgather_coalesced(outputs, inputs, opts or _c10d.AllgatherOptions())

    def send(self, tensors: Any, dst: int, tag: int) -> Any:
        return self._gloo.send(tensors, dst, tag)

    def recv(self, tensors: Any, src: int, tag: int) -> Any:
        return self._gloo.recv(tensors, src, tag)

    def recv_anysource(self, tensors: Any, tag: int) -> Any:
        return self._gloo.recv_anysource(tensors, tag)

    def abort(self) -> None:
        """Mark the group failed by this rank: peers waiting in a collective raise at once."""
        self._mark(None)
        if self._local is not None:
            self._local.abort()

    def _mark(self, exited: Optional[int]) -> None:
        seg = self._seg
        if seg is not None and not seg.abort.value:
            if exited is not None:
                seg.abort_exited.value = 1
            seg.abort.value = (self._rank if exited is None else exited) + 1

    def shutdown(self) -> None:
        self._stop_thread()
        if self._helpers is not None:
            self._helpers.shutdown(wait=False)
        if self._local is not None:
            self._local.shutdown()
        # drop the inner groups now: a gloo group left for the interpreter's teardown to destroy
        # aborts the process ("terminate called without an active exception")
        self._local = self._leaders = None


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


def _helper_pool(size: int) -> Optional[ThreadPoolExecutor]:
    """Threads that share a rank's copies and reductions: as many as leave a core per rank
    (``ONEDIST_SHM_THREADS`` sets the count per rank, helpers included), at most 4 per rank."""
    raw = os.environ.get("ONEDIST_SHM_THREADS")
    if raw:
        if not raw.isdigit() or not 1 <= int(raw) <= 64:
            from ..errors import bad_value

            raise bad_value("ONEDIST_SHM_THREADS", "ONEDIST_SHM_THREADS", raw, "an int from 1 to 64")
        threads = int(raw)
    else:
        threads = max(1, min(4, (os.cpu_count() or 1) // max(size, 1)))
    if threads <= 1:
        return None
    return ThreadPoolExecutor(threads - 1, thread_name_prefix="onedist-shm-copy")


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
        from ..errors import bad_value

        raise bad_value(
            "ONEDIST_SHM_CHUNK_MB", "ONEDIST_SHM_CHUNK_MB", raw, "a number of MiB from 0.0625 to 1024"
        )
    return _round(int(mb * (1 << 20)), 4096)


def _bytes_of(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``t`` as flat bytes: (the bytes, the flat tensor they view, whether that is a copy to write
    back into ``t``)."""
    flat, writeback = _flat(t)
    return flat.view(torch.uint8), flat, writeback


def _byte_sizes(raw: torch.Tensor, t: torch.Tensor, splits: Sequence[int], size: int) -> list[int]:
    """The bytes ``raw`` of ``t`` as one part per rank, in bytes: ``splits`` rows each (of ``t``'s
    first dimension), or equal parts when there are none."""
    if not splits:
        return [raw.numel() // size] * size
    rows = t.shape[0] if t.dim() else t.numel()
    per_row = raw.numel() // rows if rows else 0
    return [s * per_row for s in splits]


def _host_map(store: Any, rank: int, size: int) -> list[list[int]]:
    """The group's ranks by host, hosts in the order of their first rank."""
    store.set(f"onedist-shm/host/{rank}", _host_id())
    ids = [store.get(f"onedist-shm/host/{r}").decode() for r in range(size)]
    hosts: dict[str, list[int]] = {}
    for r, host in enumerate(ids):
        hosts.setdefault(host, []).append(r)
    return list(hosts.values())


def _attach(store: Any, rank: int, size: int) -> Optional[_Segment]:
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
            os.ftruncate(fd, _Segment.nbytes(size, chunk))
            store.set("onedist-shm/segment", f"{os.getpid()}:{fd}:{chunk}")
        else:
            pid, rfd, published = store.get("onedist-shm/segment").decode().split(":")
            chunk = int(published)
            fd = os.open(f"/proc/{pid}/fd/{rfd}", os.O_RDWR)
        nbytes = _Segment.nbytes(size, chunk)
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
    return _Segment(mm, size, chunk)


def create(store: Any, rank: int, size: int, timeout: timedelta) -> ShmProcessGroup:
    """torch.distributed's constructor hook for ``backend="shm"``."""
    return ShmProcessGroup(store, rank, size, timeout)


def register() -> None:
    """Register ``"shm"`` with torch.distributed (called by ``initialize("shm")``)."""
    _pygroup.register(NAME, create)
