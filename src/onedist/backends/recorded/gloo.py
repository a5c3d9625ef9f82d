"""onedist's gloo group: torch's ``ProcessGroupGloo``, with every call it carries on record.

``initialize("gloo")`` makes the default group (and onedist's sub-groups) a :class:`RecordedGloo`:
a Python process group, as torch lets Python register one, around a real ``ProcessGroupGloo`` that
does the communication. torch calls it for every collective on the group, whoever issues it:
``DistributedDataParallel``'s gradient buckets (from C++), FSDP2, ``torch.distributed``'s functions,
onedist's own, asynchronous calls and point-to-point. Each call is passed on unchanged (a large
all-gather or reduce-scatter as sends and receives, faster: :mod:`.pairwise`) and written to the
group's :class:`~onedist.backends.recorded.calls.CallLog`, which the failure watcher compares across
ranks. Measured, a back-to-back 1-float all_reduce between 2 ranks on 2 cores: 1.08-1.14x torch's
plain gloo group (the record's ~30 us of Python on cold caches), 0.79-0.84x with each rank bound to
one CPU; a DDP step 0.96-1.08x (docs/performance.md). ``ONEDIST_RECORD=0`` gives the plain gloo
group instead.

torch knows the group as ``"gloo"`` (``dist.get_backend()``); its own name for DDP's logs is
``"onedist-gloo"`` (``group.name()``), since torch's C++ would otherwise look for a gloo backend
inside it. Groups your code makes with ``dist.new_group`` (and torch's own: ``DeviceMesh``,
``new_subgroups``) without naming a backend are recorded groups too (:func:`record_new_groups`);
``backend="gloo"`` given by name gives torch's plain group.
"""

from __future__ import annotations

import functools
import os
import sys
import weakref
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..._recovery import group_prefix, joined
from .._connections import socket_fds
from .._pygroup import NamedGroup
from . import pairwise, steps
from .calls import RECV, SEND, CallLog, RecordedWork, agreed_number, enabled, signature

__all__ = ["NAME", "RecordedGloo", "connection_fds", "create", "enabled", "record_new_groups", "register"]

#: the name the group is registered under in torch (torch's own map then says "gloo")
NAME = "onedist-gloo"

_c10d: Any = dist.distributed_c10d


def register() -> None:
    """Make :data:`NAME` known to ``torch.distributed`` (idempotent)."""
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, create, extended_api=True, devices=["cpu", "cuda"])
    record_new_groups()


def record_new_groups() -> None:
    """Make ``dist.new_group`` without a backend, while the default group is a recorded one, give a
    recorded group as well (idempotent): torch would give a plain gloo group, the backend its map
    names for the default group. torch's ``new_group``, ``new_subgroups`` and ``DeviceMesh`` all
    make their groups through ``_new_group_with_tag``; a group made another way stays plain."""
    original: Any = _c10d._new_group_with_tag
    if getattr(original, "_onedist_records", False):
        return

    @functools.wraps(original)
    def _new_group_with_tag(*args: Any, **kwargs: Any) -> Any:
        named = kwargs.get("backend", args[2] if len(args) > 2 else None)
        default = _c10d._world.default_pg if hasattr(_c10d._world, "default_pg") else None
        if named or not isinstance(default, RecordedGloo):
            return original(*args, **kwargs)
        if len(args) > 2:
            args = (*args[:2], NAME, *args[3:])
        else:
            kwargs["backend"] = NAME
        group = original(*args, **kwargs)
        if isinstance(group, RecordedGloo):
            rename_in_torch(group)
        return group

    _new_group_with_tag._onedist_records = True  # type: ignore[attr-defined]
    _c10d._new_group_with_tag = _new_group_with_tag


def create(options: Any, backend_options: Any = None) -> RecordedGloo:
    """torch's constructor for :data:`NAME` (its extended form, which names the global ranks)."""
    ranks = tuple(options.global_ranks_in_group or range(options.group_size))
    return RecordedGloo(options.store, options.group_rank, options.group_size, options.timeout, ranks)


def _gloo(store: Any, rank: int, size: int, timeout: timedelta, prefix: str) -> Any:
    """torch's own gloo group, made as torch makes it (its devices from ``GLOO_SOCKET_IFNAME``)."""
    return _c10d.ProcessGroupGloo(_c10d.PrefixStore(prefix, store), rank, size, timeout)


class RecordedGloo(NamedGroup):
    """A gloo process group whose calls are written to :attr:`calls` (see the module doc).

    A collective is numbered before it starts (the order the ranks must agree on is the order
    gloo gets the calls) and the rest of its record (the user's line, the entry, letting go of
    completed works) is written once it has started, while gloo's threads make it. A rank bound
    to one CPU (``mpirun``'s and ``srun``'s binding, ``taskset -c``) shares it with gloo's threads,
    which a wake-up does not preempt the caller for: there, a caller that waits for its call
    yields the CPU to them first (``os.sched_yield``). Measured, 2 ranks each bound to one CPU, a
    1-float ``dist.all_reduce`` back to back: the record before the start cost 1.5-1.7x torch's
    plain gloo group, after a yield 0.7-0.8x (docs/performance.md). Unbound, where the yield lets
    the other rank's threads in instead, the caller does not yield."""

    #: how the large exchanges reach each peer (:mod:`.pairwise`; made again by each :meth:`_connect`)
    links: pairwise.Links

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta, ranks: tuple[int, ...]) -> None:
        super().__init__(rank, size)
        self._made = (store, timeout, ranks)
        self._connect(group_prefix(joined(os.environ, store)))  # a replacement meets its peers first
        steps.install()
        _LIVE.add(self)

    def _connect(self, prefix: str) -> None:
        store, timeout, ranks = self._made
        rank, size = self.rank(), self.size()
        before = socket_fds()
        if hasattr(self, "links"):  # made again (a live recovery): the last generation's thread ends
            self.links.close()
        # the links write this rank's identity to the store before gloo connects
        self.links = pairwise.Links(_c10d.PrefixStore(prefix + "links/", store), rank, size)
        #: the group that moves the data
        self.inner = self.links.inner = _gloo(store, rank, size, timeout, prefix + "data/")
        #: the groups of DDP's gradient buckets, by the parity of their step (:mod:`.steps`)
        self.buckets = tuple(_gloo(store, rank, size, timeout, f"{prefix}steps-{k}/") for k in (0, 1))
        #: the sockets gloo connected for it (the backend shuts them down to break a pending call)
        self.fds = socket_fds() - before
        self.calls = CallLog(rank, ranks, agreed_number(self.buckets[0], size))
        #: whether a caller that waits for its call yields the CPU once the call has started
        self.yields = _bound_to_one_cpu()

    def rejoin(self, number: int) -> None:
        """Make this group's connections again, as generation ``number`` of a live recovery
        (:mod:`onedist._recovery`): the same group object (DDP and the collectives keep it), new
        gloo groups under the generation's prefix of the same store, a new call log. Every member
        of the new generation calls it (a replacement's constructor does the same)."""
        self._connect(group_prefix(number))

    def getBackendName(self) -> str:
        return NAME

    # ------------------------------------------------------------------ collectives
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts or _c10d.AllreduceOptions()
        step = steps.step_of_call(self.calls)  # DDP's buckets: on their step's group
        group = self.buckets[step & 1] if step else self.inner
        return self._issue(signature("all_reduce", tensors, opts), step, group.allreduce, tensors, opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts or _c10d.AllreduceCoalescedOptions()
        step = steps.step_of_call(self.calls)
        group = self.buckets[step & 1] if step else self.inner
        sig = signature("all_reduce_coalesced", tensors, opts)
        return self._issue(sig, step, group.allreduce_coalesced, tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts or _c10d.BroadcastOptions()
        return self._issue(
            signature("broadcast", tensors, root=opts.rootRank), 0, self.inner.broadcast, tensors, opts
        )

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts or _c10d.ReduceOptions()
        sig = signature("reduce", tensors, opts, root=opts.rootRank)
        return self._issue(sig, 0, self.inner.reduce, tensors, opts)

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        opts = opts or _c10d.AllgatherOptions()
        return self._issue(signature("all_gather", inputs), 0, self.inner.allgather, outputs, inputs, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        opts = opts or _c10d.AllgatherOptions()
        sig = signature("all_gather_into_tensor", (input,))
        if pairwise.fits_all_gather(self.size(), output, input):  # faster than gloo's (:mod:`.pairwise`)
            return self._issue(sig, 0, pairwise.all_gather, self.links, output, input, opts)
        return self._issue(sig, 0, self.inner._allgather_base, output, input, opts)

    _allgather_base = all_gather_single  # torch's name before 2.13

    def allgather_coalesced(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        opts = opts or _c10d.AllgatherOptions()
        sig = signature("all_gather_coalesced", inputs)
        return self._issue(sig, 0, self.inner.allgather_coalesced, outputs, inputs, opts)

    def all_gather_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return _each(self.all_gather_single, outputs, inputs, opts)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts or _c10d.GatherOptions()
        sig = signature("gather", inputs, root=opts.rootRank)
        return self._issue(sig, 0, self.inner.gather, outputs, inputs, opts)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        opts = opts or _c10d.ScatterOptions()
        sig = signature("scatter", outputs, root=opts.rootRank)
        return self._issue(sig, 0, self.inner.scatter, outputs, inputs, opts)

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> Any:
        opts = opts or _c10d.ReduceScatterOptions()
        sig = signature("reduce_scatter", outputs, opts)
        return self._issue(sig, 0, self.inner.reduce_scatter, outputs, inputs, opts, waited=True)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        opts = opts or _c10d.ReduceScatterOptions()
        sig = signature("reduce_scatter_tensor", (output,), opts)
        if pairwise.fits_reduce_scatter(self.size(), output, input, opts.reduceOp):  # :mod:`.pairwise`
            return self._issue(sig, 0, pairwise.reduce_scatter, self.links, output, input, opts)
        return self._issue(sig, 0, self.inner._reduce_scatter_base, output, input, opts, waited=True)

    _reduce_scatter_base = reduce_scatter_single  # torch's name before 2.13

    def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return _each(self.reduce_scatter_single, outputs, inputs, opts)

    # torch's names for the coalesced forms before 2.13
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(
        self, output: torch.Tensor, input: torch.Tensor, out_splits: Any, in_splits: Any, opts: Any = None
    ) -> Any:
        opts = opts or _c10d.AllToAllOptions()
        sig = signature("all_to_all_single", (input,), sized=False)  # the split sizes may differ per rank
        return self._issue(sig, 0, self.inner.alltoall_base, output, input, out_splits, in_splits, opts)

    alltoall_base = all_to_all_single  # torch's name before 2.13

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts or _c10d.AllToAllOptions()
        return self._issue(
            signature("all_to_all", inputs, sized=False), 0, self.inner.alltoall, outputs, inputs, opts
        )

    def barrier(self, opts: Any = None) -> Any:
        return self._issue(signature("barrier"), 0, self.inner.barrier, opts or _c10d.BarrierOptions())

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        blocking = _Blocking()
        self.calls.record(signature("monitored_barrier"), blocking)
        try:
            if timeout is None:
                self.inner.monitored_barrier(wait_all_ranks=wait_all_ranks)
            else:
                self.inner.monitored_barrier(timeout, wait_all_ranks)
            blocking.succeeded = True
        finally:
            blocking.done = True

    def _issue(self, sig: tuple[int, ...], step: int, call: Any, *args: Any, waited: bool = False) -> Any:
        """Start a collective on record: numbered before it starts, recorded after (see the
        class doc). ``waited``: gloo's work for it never says it completed, so it counts as
        complete once waited on."""
        log = self.calls
        later = _waited_later(args[-1])
        numbered = log.number(sig)
        try:
            work = call(*args)
        except BaseException:  # refused here (an argument error): it was never made
            log.unnumber(numbered[0])
            raise
        if self.yields and not later:
            os.sched_yield()  # bound to one CPU: gloo's threads, which make the call, run first
        entry = log.begin(sig, step, numbered)
        if waited:
            work = _CompleteOnceWaited(work, entry)
        log.started(entry, work, synchronous=not later)
        return RecordedWork(work, entry) if later and not waited else work

    # ------------------------------------------------------------------ point-to-point
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        work = self.inner.send(tensors, dst, tag)
        return RecordedWork(work, self.calls.record_p2p(SEND, dst, tensors, work))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        work = self.inner.recv(tensors, src, tag)
        return RecordedWork(work, self.calls.record_p2p(RECV, src, tensors, work))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Any:
        work = self.inner.recv_anysource(tensors, tag)
        return RecordedWork(work, self.calls.record_p2p(RECV, -1, tensors, work))

    # ------------------------------------------------------------------ the rest of the group's API
    def _get_backend(self, device: Any) -> Any:
        """The gloo backend that moves the data (torch's code and yours ask it for its options)."""
        return self.inner

    def _get_sequence_number_for_group(self) -> int:
        return self.calls.seq

    def _set_sequence_number_for_group(self) -> None:
        pass  # the log numbers the calls

    def abort(self) -> None:
        for group in (self.inner, *self.buckets):
            group.abort()

    def shutdown(self) -> None:
        self.links.close()
        for group in (self.inner, *self.buckets):
            group.shutdown()


class _CompleteOnceWaited(RecordedWork):
    """gloo's reduce-scatter work (torch 2.13): an all_reduce of a copy of the input, whose
    ``wait()`` waits for it and then copies this rank's chunk into the output; ``is_completed()``
    stays False and it has no future. Kept as it is, the call would look pending forever (a false
    stall report once the ranks go idle). Waited on by torch's synchronous call, by FSDP2, or by
    the caller of an asynchronous one, it is complete; one never waited on stays pending, which is
    what it is to the program. It is waited on once only: a second ``wait()`` (the failure
    watcher asking whether it succeeded) would copy the chunk again, over an output the program
    has since divided, accumulated into or reused."""

    done = False

    def wait(self, timeout: Any = None) -> bool:
        if self.done:
            return True
        succeeded = super().wait(timeout)
        self.done = True
        return succeeded

    def is_completed(self) -> bool:
        return self.done or bool(self._work.is_completed())


class _Blocking:
    """The "work" of a call that blocks in the caller (monitored_barrier): complete on return."""

    done = succeeded = False

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> bool:
        if not self.succeeded:
            raise RuntimeError("monitored_barrier failed")
        return True


_C10D = _c10d.__file__


def _bound_to_one_cpu() -> bool:
    """Whether this thread may run on one CPU only (its affinity, which threads made later get)."""
    try:
        return len(os.sched_getaffinity(0)) == 1
    except (AttributeError, OSError):  # not Linux
        return False


def _waited_later(opts: Any, depth: int = 3) -> bool:
    """Whether the work goes to code that waits on it itself later (an asynchronous call: the
    options say so, torch >= 2.7; DDP's C++ and an older torch's asynchronous ``dist.*`` call): it
    then gets one whose ``wait()`` explains a failure. A synchronous call waits inside torch's
    function, where the failure watcher's verdict reaches the main thread, or inside onedist's guard;
    and a Python Work on torch's wait path cost 1.15x a 2-rank all_reduce here: only where needed."""
    later = getattr(opts, "asyncOp", None)
    if later is not None:
        return bool(later)
    try:
        caller = sys._getframe(depth)
    except ValueError:  # called from C++ (a backward on autograd's threads): no Python caller
        return False
    return caller.f_code.co_filename == _C10D and bool(caller.f_locals.get("async_op"))


def _each(call: Any, outputs: Any, inputs: Any, opts: Any) -> Any:
    """A coalesced collective as its pairs in call order, one Work over them all (the gloo
    backend's own coalesced forms are not reachable from Python)."""
    return _AllOf([call(o, i, opts) for o, i in zip(outputs, inputs)])


class _AllOf(_c10d.Work):  # type: ignore[misc]
    """The work of several calls, waited on in order (gloo's reduce-scatter works have no future
    to collect)."""

    def __init__(self, works: list[Any]) -> None:
        super().__init__()
        self._works = works

    def wait(self, timeout: Any = None) -> bool:
        return all([w.wait() if timeout is None else w.wait(timeout) for w in self._works])

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def get_future(self) -> Any:  # where every part has one (an all-gather's)
        return torch.futures.collect_all([w.get_future() for w in self._works])


_LIVE: weakref.WeakSet[RecordedGloo] = weakref.WeakSet()


def connection_fds() -> frozenset[int]:
    """The sockets of every live recorded group of this process, those made with
    ``dist.new_group`` included (the backend knows only those it made itself)."""
    return frozenset().union(*(group.fds for group in list(_LIVE)))


def rename_in_torch(group: Optional[Any] = None) -> None:
    """Let torch's map name ``group`` (default: the default group) ``"gloo"``, the backend it
    runs: ``dist.get_backend()`` reads it (ignite's suite checks it after ``initialize("gloo")``)."""
    pg = group if group is not None else _c10d._get_default_group()
    backend, store = _c10d._world.pg_map[pg]
    if backend == NAME:
        _c10d._world.pg_map[pg] = ("gloo", store)
