"""Horovod's own calls on record: ``hvd.*`` collectives, whoever makes them, on a :class:`CallLog`.

When onedist initialises Horovod (``backend="horovod"``) with recording on (``ONEDIST_RECORD``,
:func:`~onedist.backends.recorded.calls.enabled`), every collective of ``horovod.torch`` is logged
where all of them pass: the private functions of ``horovod.torch.mpi_ops`` that hand a tensor to
Horovod's C++ core (``_allreduce_async``, ``_grouped_allreduce_async``, ``_allgather_async``,
``_grouped_allgather_async``, ``_broadcast_async``, ``_alltoall_async``, ``_reducescatter_async``,
``_grouped_reducescatter_async``: every public variant, synchronous, asynchronous, in place or
grouped, ``hvd.DistributedOptimizer``'s gradient exchange, ``broadcast_parameters``,
``SyncBatchNorm`` and onedist's own Horovod calls go through one of them), and the C functions
``horovod_torch_barrier`` and ``horovod_torch_join`` of Horovod's extension module (``hvd.barrier``
and ``hvd.join`` call them directly). A call is pending until its handle is synchronised (the
extension's ``horovod_torch_wait_and_clear``, wrapped too: it marks the call done, and its failure
raises the stall verdict or a failed peer's error when onedist knows one) or Horovod's ``poll``
says it is done.

One log per process set (its members' ranks), numbered in call order on this rank; the failure
watcher's stall check compares the calls the ranks are blocked in (:mod:`onedist.failures.stall`)
and its stall reports name them. The comparison of *completed* calls (:mod:`onedist.failures.history`)
is left out on Horovod: Horovod matches calls by name, so named calls (the optimizer's, one per
parameter) may legally be issued in a different order on each rank, and a call the ranks disagree on
never completes silently (its coordinator checks same-named calls' shapes and dtypes and raises
``HorovodInternalError``; differently named calls wait for each other). :meth:`HorovodCallLog.recent`
is empty for that reason. ``hvd.join`` is no numbered call (a joined rank takes part in its peers'
calls with zeros, so the counts legitimately differ): it waits in a log of its own (the stall report
shows it), and every log starts again, under a new key, once this rank has called it.

A function missing from another Horovod version (or whose parameters differ) stays as it is, so its
calls are not on record; :func:`install` returns the names it wrapped. :func:`uninstall` puts every
function back (``finalize``). Cost per call: a dictionary lookup, a short frame walk to the user's
line and :meth:`CallLog.begin`'s bookkeeping (a few microseconds; Horovod's own round takes a cycle,
1 ms by default; docs/performance.md has the measurements).
"""

from __future__ import annotations

import inspect
import os
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, NamedTuple, Optional

import torch

from . import calls
from .calls import CallLog, Entry, describe, enabled, logs, signature, user_site

__all__ = ["HorovodCallLog", "install", "installed_names", "uninstall"]


class _Spec(NamedTuple):
    """How one private function of ``horovod.torch.mpi_ops`` is read: the kind of call it makes and
    the names of its parameters holding the tensor(s), the reduction, the root."""

    kind: str
    tensors: str
    op: str = ""
    root: str = ""
    sized: bool = True  # allgather and alltoall take different first dimensions per rank
    grouped: bool = False


_SPECS = {
    "_allreduce_async": _Spec("all_reduce", "tensor", op="op"),
    "_grouped_allreduce_async": _Spec("all_reduce_coalesced", "tensors", op="op", grouped=True),
    "_allgather_async": _Spec("all_gather", "tensor", sized=False),
    "_grouped_allgather_async": _Spec("all_gather_coalesced", "tensors", sized=False, grouped=True),
    "_broadcast_async": _Spec("broadcast", "tensor", root="root_rank"),
    "_alltoall_async": _Spec("all_to_all", "tensor", sized=False),
    "_reducescatter_async": _Spec("reduce_scatter", "tensor", op="op"),
    "_grouped_reducescatter_async": _Spec("reduce_scatter_coalesced", "tensors", op="op", grouped=True),
}

#: frames that are not the user's line: torch's, onedist's and Horovod's
_SKIP_DIRS = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep
    for path in (
        torch.__file__,
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # onedist/backends -> onedist
    )
)
_SKIPPED: dict[str, bool] = {}  # file name -> whether its frames are skipped (asked once per file)
_entry = tuple.__new__  # an Entry from all its fields, without NamedTuple's slower constructor


class HorovodCallLog(CallLog):
    """The calls of one Horovod process set on this rank (see the module doc)."""

    def begin_at(self, sig: tuple[int, ...], frame: Optional[FrameType], text: str = "") -> Entry:
        """:meth:`CallLog.begin`, its user line found from ``frame`` outward (Horovod's frames
        skipped), with ``text`` for calls the signature cannot describe."""
        self._prune()
        self._before = (self.seq, self.chain)
        seq = self.seq = self.seq + 1
        chain = self.chain = hash((self.chain, sig))
        entry = _entry(Entry, (seq, sig, chain, _site(frame), time.monotonic(), -1, 0, text))
        self.window.append(entry)
        return entry

    def recent(self) -> list[Entry]:
        """Nothing: Horovod's completed calls are not compared (see the module doc)."""
        return []


class _Handle:
    """A Horovod handle as a call log's work: complete once synchronised (Horovod's wait, wrapped,
    says so: polling a cleared handle raises, a C++ exception that cost more than the whole record)
    or once Horovod's ``poll`` says so. Its failure is Horovod's to raise, in ``synchronize``."""

    __slots__ = ("done", "handle")

    def __init__(self, handle: int) -> None:
        self.handle, self.done = handle, False
        _state.works[handle] = self

    def is_completed(self) -> bool:
        if self.done:
            return True
        try:
            return bool(_state.poll(self.handle))
        except Exception:  # "Handle ... was not created or has been cleared": synchronised
            return True

    def wait(self) -> bool:  # never blocks: the log asks it of completed calls only
        return True


class _State:
    """What :func:`install` changed, to put back, and the logs of the process sets."""

    def __init__(self) -> None:
        self.mpi_ops: Any = None
        self.mpi_lib: Any = None
        self.originals: dict[str, Callable[..., Any]] = {}  # "mpi_ops._x" / "mpi_lib.y" -> function
        self.poll: Callable[[int], int] = lambda handle: 1
        self.rank, self.size, self.nonce, self.generation = 0, 1, 0, 0
        self.logs: dict[int, Optional[HorovodCallLog]] = {}  # process set id -> its log (None: not a member)
        self.joining: Optional[CallLog] = None  # this rank's hvd.join, while it waits
        self.works: dict[int, _Handle] = {}  # handle -> its work, until Horovod's wait clears it
        self.ops: dict[int, int] = {}  # Horovod's reduction constant -> torch's ReduceOp number
        self.skip_dirs = _SKIP_DIRS  # and Horovod's, once installed


_state = _State()


def install(hvd: Any) -> list[str]:
    """Put Horovod's calls on record in this process (after ``hvd.init()``, on every rank: it makes
    one allreduce to agree on the logs' keys). Returns what it wrapped; nothing when recording is
    off, with one rank, or when Horovod's extension lacks ``horovod_torch_poll``."""
    if _state.originals or not enabled() or int(hvd.size()) < 2:
        return []
    mpi_ops = sys.modules["horovod.torch.mpi_ops"]
    mpi_lib = getattr(mpi_ops, "mpi_lib", None)
    poll = getattr(mpi_lib, "horovod_torch_poll", None)
    if poll is None:
        return []
    mine = torch.tensor([int.from_bytes(os.urandom(7), "little")], dtype=torch.int64)
    nonce = int(hvd.allreduce(mine, op=hvd.Sum, name="onedist.record.nonce").item())
    _state.mpi_ops, _state.mpi_lib, _state.poll = mpi_ops, mpi_lib, poll
    _state.rank, _state.size, _state.nonce = int(hvd.rank()), int(hvd.size()), nonce
    _state.ops = _reductions(mpi_ops)
    horovod_dir = os.path.dirname(os.path.dirname(os.path.abspath(str(mpi_ops.__file__))))  # horovod/torch/..
    _state.skip_dirs = (*_SKIP_DIRS, horovod_dir + os.sep)
    for name, spec in _SPECS.items():
        function = getattr(mpi_ops, name, None)
        reader = _reader(function, spec)
        if function is not None and reader is not None:  # else: another Horovod; left unrecorded
            _state.originals[f"mpi_ops.{name}"] = function
            setattr(mpi_ops, name, _recording(function, reader))
    wrappers = (
        ("horovod_torch_barrier", _recording_barrier),
        ("horovod_torch_join", _recording_join),
        ("horovod_torch_wait_and_clear", _explaining_wait),
    )
    for name, wrap in wrappers:
        function = getattr(mpi_lib, name, None)
        if function is not None:
            _state.originals[f"mpi_lib.{name}"] = function
            setattr(mpi_lib, name, wrap(function))
    return installed_names()


def installed_names() -> list[str]:
    """The functions whose calls are on record now."""
    return sorted(_state.originals)


def uninstall() -> None:
    """Put back every function :func:`install` wrapped, and forget the logs."""
    for key, function in _state.originals.items():
        where, name = key.split(".", 1)
        setattr(_state.mpi_ops if where == "mpi_ops" else _state.mpi_lib, name, function)
    _state.__init__()  # type: ignore[misc]


# ---------------------------------------------------------------------------- the wrappers
_Reader = Callable[[tuple[Any, ...], dict[str, Any]], tuple[tuple[int, ...], Any]]


def _reader(function: Any, spec: _Spec) -> Optional[_Reader]:
    """A function giving a call's signature and process set from its arguments; None when the
    function's parameters are not the ones this version of onedist knows."""
    try:
        params = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return None
    wanted = [spec.tensors, "process_set", "name", *(p for p in (spec.op, spec.root) if p)]
    if not all(p in params for p in wanted):
        return None
    at = {p: params.index(p) for p in wanted}
    i_t, i_ps = at[spec.tensors], at["process_set"]
    i_op, i_root, i_name = at.get(spec.op, -1), at.get(spec.root, -1), at["name"]
    kind, sized, grouped, ops = spec.kind, spec.sized, spec.grouped, _state.ops
    # onedist's own all_gather takes one size on every rank (Horovod's allows any first dimension)
    sized_if_onedist = kind == "all_gather"

    def arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str) -> Any:
        return args[i] if i < len(args) else kwargs.get(name)

    def read(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[int, ...], Any]:
        tensors = arg(args, kwargs, i_t, spec.tensors)
        root = int(arg(args, kwargs, i_root, spec.root)) if i_root >= 0 else -1
        # the reduction as the int torch's ReduceOp has (signature() takes an int as it is)
        op = ops.get(int(arg(args, kwargs, i_op, spec.op)), 99) if i_op >= 0 else None
        same_size = sized
        if sized_if_onedist:
            name = arg(args, kwargs, i_name, "name")
            same_size = isinstance(name, str) and name.startswith("onedist.")
        sig = signature(kind, tensors if grouped else (tensors,), op, root, same_size)
        return sig, arg(args, kwargs, i_ps, "process_set")

    return read


def _recording(function: Callable[..., int], read: _Reader) -> Callable[..., int]:
    def recorded(*args: Any, **kwargs: Any) -> int:
        sig, process_set = read(args, kwargs)
        log = _log(process_set)
        if log is None:
            return function(*args, **kwargs)
        return _logged(log, sig, sys._getframe(1), function, *args, **kwargs)

    recorded.__wrapped__ = function  # type: ignore[attr-defined]
    return recorded


def _logged(
    log: Any, sig: tuple[int, ...], frame: FrameType, function: Callable[..., int], *args: Any, **kwargs: Any
) -> int:
    """Call ``function`` on record in ``log`` (made at ``frame``): its handle pending until waited."""
    entry = log.begin_at(sig, frame)
    try:
        handle = function(*args, **kwargs)
    except BaseException:
        log.abandon(entry)
        raise
    log.started(entry, _Handle(handle))
    return handle


def _recording_barrier(function: Callable[..., int]) -> Callable[..., int]:
    def recorded(process_set_id: int = 0, *args: Any) -> int:
        log = _log_of(int(process_set_id), None)
        if log is None:
            return function(process_set_id, *args)
        return _logged(log, signature("barrier"), sys._getframe(1), function, process_set_id, *args)

    recorded.__wrapped__ = function  # type: ignore[attr-defined]
    return recorded


def _recording_join(function: Callable[..., int]) -> Callable[..., int]:
    def recorded(*args: Any) -> int:
        # the calls numbered so far end here; after the join every rank starts again from 0
        _state.generation += 1
        _state.logs.clear()
        nonce = hash((_state.nonce, -1, _state.generation))
        alone = _state.joining = HorovodCallLog(0, (_state.rank,), nonce)
        entry = alone.begin_at(signature("barrier"), sys._getframe(1), "hvd.join()")
        handle = function(*args)
        alone.started(entry, _Handle(handle))
        return handle

    recorded.__wrapped__ = function  # type: ignore[attr-defined]
    return recorded


def _explaining_wait(function: Callable[[int], Any]) -> Callable[[int], Any]:
    """Horovod's wait, whose failure says why when onedist knows: the stall verdict (a peer's
    watcher found the ranks blocked in different calls and ended its rank, which shut Horovod
    down here) or a failed peer's error, instead of "Horovod has been shut down". It stays a
    RuntimeError, which ``hvd.synchronize`` turns into ``HorovodInternalError`` as before."""

    def waited(handle: int) -> Any:
        try:
            return function(handle)
        except RuntimeError as e:
            cause = calls.known_cause(_description(handle), e)
            if isinstance(cause, RuntimeError):
                raise cause from None
            raise
        finally:  # cleared, failed or not
            work = _state.works.pop(handle, None)
            if work is not None:
                work.done = True

    waited.__wrapped__ = function  # type: ignore[attr-defined]
    return waited


def _description(handle: int) -> str:
    for log in logs():
        for entry, work in list(log.pending):
            if isinstance(work, _Handle) and work.handle == handle:
                return entry.text or describe(entry.sig)
    return "a Horovod call"


def _log(process_set: Any) -> Optional[HorovodCallLog]:
    ps_id = getattr(process_set, "process_set_id", None)
    if ps_id is None:
        return None
    logs = _state.logs
    return logs[ps_id] if ps_id in logs else _log_of(int(ps_id), process_set)


def _log_of(ps_id: int, process_set: Any) -> Optional[HorovodCallLog]:
    """The log of process set ``ps_id`` (made on its first call here), None when this rank is not
    one of its members (Horovod refuses the call)."""
    if ps_id in _state.logs:
        return _state.logs[ps_id]
    ranks = getattr(process_set, "ranks", None)
    if ranks is None:
        ranks = _process_set_ranks(ps_id)
    ranks = tuple(sorted(int(r) for r in ranks))
    log = None
    if _state.rank in ranks:
        # a number every member gives this set and no earlier set (nor this one before a join)
        nonce = hash((_state.nonce, ps_id, ranks, _state.generation))
        log = HorovodCallLog(ranks.index(_state.rank), ranks, nonce)
    _state.logs[ps_id] = log
    return log


def _process_set_ranks(ps_id: int) -> list[int]:
    if ps_id == 0:
        return list(range(_state.size))
    try:
        from horovod.common.process_sets import _basics

        return list(_basics._get_process_set_ids_and_ranks()[ps_id])
    except Exception:
        return []


def _reductions(mpi_ops: Any) -> dict[int, int]:
    """Horovod's reduction constants as the numbers of torch's ReduceOp (SUM 0, AVG 1, PRODUCT 2,
    MIN 3, MAX 4: what the reports print); Adasum has none (printed as op 99)."""
    names = {"Sum": 0, "Average": 1, "Product": 2, "Min": 3, "Max": 4}
    return {int(getattr(mpi_ops, n)): code for n, code in names.items() if hasattr(mpi_ops, n)}


def _site(frame: Optional[FrameType]) -> str:
    """``file:line`` of the first frame outside torch, onedist and Horovod from ``frame`` outward."""
    return user_site(frame, _state.skip_dirs, _SKIPPED)
