"""The process group behind ``backend="shm"`` (see the package docstring), and its registration.

:class:`ShmProcessGroup` holds the group's state and its dense collectives (all_reduce,
broadcast, all_gather, reduce_scatter, barrier); the rest comes from the classes it builds on:
the protocol (:mod:`.protocol`), the memory work (:mod:`.phases`), gather, scatter and all_to_all
(:mod:`.exchange`) and the two levels over several hosts (:mod:`.hosts`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import Any, Optional

import torch
import torch._C._distributed_c10d as _c10d
import torch.distributed as dist

from ..._recovery import group_prefix, joined
from .. import cma
from .._pygroup import ArgCheck, PyWork, all_cpu, flat as _flat, for_each, opts_or
from ..recorded import steps
from ..recorded.calls import RECV, SEND, CallLog, RecordedWork, agreed_number
from .hosts import TwoLevels, ranks_by_host
from .phases import bytes_of, helper_pool
from .protocol import (
    CALL_RECORD,
    KIND_ALL_GATHER,
    KIND_ALL_GATHER_UNEVEN,
    KIND_ALL_REDUCE,
    KIND_BARRIER,
    KIND_BROADCAST,
    KIND_REDUCE,
    KIND_REDUCE_SCATTER,
    poison_on_error,
    step_root,
)
from .reduce_ops import check_op, reduce_fn, reduce_into, reduction
from .scatter_gather import Exchanges, Head
from .segment import NAME, SMALL_BYTES, Bank, Segment, attach

#: collectives of at least this many bytes run on the group's thread (see ShmProcessGroup._run)
_ASYNC_BYTES = 1 << 20


class ShmProcessGroup(TwoLevels, Exchanges):
    """The process group behind ``backend="shm"`` (see the package docstring)."""

    #: the calls on record of a group torch made (not of one host's part of a group over several):
    #: point-to-point calls, where a rank waits, and the step of DDP's gradient buckets
    calls: Optional[CallLog] = None

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta, prefix: str = "") -> None:
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._made = (store, timeout)  # what rejoin makes the group again from
        self._timeout = timeout.total_seconds() if timeout else 1800.0
        self._head = Head(size)  # an all_to_all's head (see _exchange)
        self._cma = cma.enabled()
        #: this group's ranks as ranks of the group that holds it (one host's part of a group over
        #: several hosts), for errors; None: a group of its own
        self._shown_as: Optional[list[int]] = None
        self._others = [r for r in range(size) if r != rank]
        self._spin = 2000 if size <= (os.cpu_count() or 1) else 20
        self._helpers = helper_pool(size)
        self._parts = 1 + (self._helpers._max_workers if self._helpers is not None else 0)
        self._connect(prefix)

    def _connect(self, prefix: str) -> None:
        """The group's gloo group beside the memory, its segment (or its two levels over several
        hosts), and the protocol's counts from the start, all under ``prefix`` in the store (a
        live recovery's generation: :func:`onedist._recovery.group_prefix`)."""
        rank, size, timeout = self._rank, self._size, self._made[1]
        store = _c10d.PrefixStore(prefix, self._made[0]) if prefix else self._made[0]
        self._store = store  # where the ranks tell each other their script lines at a mismatch
        self._gloo: Any = dist.ProcessGroupGloo(
            _c10d.PrefixStore("onedist-shm-gloo", store), rank, size, timeout
        )
        self._seg: Optional[Segment] = None
        self._gen = 0
        self._bank = 0  # the bank the next collective's first chunk goes through (see _phases)
        self._mail = 0  # the mailbox of the next small all_reduce (see _all_reduce_small)
        self._record = CALL_RECORD.pack(KIND_BARRIER, -1, -1, 0, 0, 0)  # what this rank calls (see _begin)
        self._step = 0
        #: ranks on several hosts: this host's ranks share a shm group, and one rank per host
        #: (the first) joins the others' first ranks in a gloo group (see _hierarchy)
        self._local: Optional[ShmProcessGroup] = None
        self._leaders: Any = None
        self._hosts: list[list[int]] = []
        if size > 1:
            hosts = ranks_by_host(store, rank, size)
            if len(hosts) == 1:
                self._seg = attach(store, rank, size)
            else:
                self._hierarchy(store, hosts, timeout)

    def rejoin(self, number: int) -> None:
        """Make this group again, as generation ``number`` of a live recovery
        (:mod:`onedist._recovery`), with the same object (DDP and the collectives keep it): the
        collectives still queued end first (on the old segment, marked failed: at once), then a
        new gloo group and a new segment under the generation's prefix of the same store, and a
        new call log. Every member of the new generation calls it (a replacement's constructor,
        through :func:`create`, does the same)."""
        self._stop_thread()  # the old generation's queued calls fail on the marked segment first
        if self._local is not None:
            self._local.shutdown()
        # the old segment is unmapped once nothing holds it (torch's and ctypes' views of it
        # forbid an explicit close); the memfd's memory goes with the last mapping
        self._connect(group_prefix(number))
        if self._size > 1:
            self.calls = new_call_log(self)

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

    # ------------------------------------------------------------------ collectives
    @poison_on_error
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        check_op(op, tensors)
        if self._hierarchical and all_cpu(tensors):
            job = partial(for_each, partial(self._hier_all_reduce, op=op), tensors)
            return self._run(job, tensors, tensors)
        if self._seg is None or not all_cpu(tensors):
            return self._gloo.allreduce(tensors, opts_or(_c10d.AllreduceOptions, opts))
        return self._reduce_each(tensors, op, None, self._ddp_step())

    def _ddp_step(self) -> int:
        """The DDP step of a call inside a backward (recorded.steps): its parity goes in the call's
        record, so buckets of steps one apart differ at the barrier, like any two calls."""
        calls = self.calls
        return 0 if calls is None or not calls.ddp_step else steps.step_of_call(calls)

    @poison_on_error
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        if self._hierarchical:
            return self.allreduce(tensors, opts)
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        check_op(op, tensors)
        if self._seg is None or not all_cpu(tensors):
            return self._gloo.allreduce_coalesced(tensors, opts or _c10d.AllreduceCoalescedOptions())
        return self._reduce_each(tensors, op, None, self._ddp_step())

    @poison_on_error
    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        ArgCheck(NAME, "reduce", self._size).root(opts.rootRank)
        check_op(opts.reduceOp, tensors)
        if self._seg is None or not all_cpu(tensors):
            return self._gloo.reduce(tensors, opts)
        return self._reduce_each(tensors, opts.reduceOp, opts.rootRank)

    def _reduce_each(self, tensors: list[torch.Tensor], op: Any, root: Optional[int], step: int = 0) -> Any:
        """all_reduce (``root`` None) or reduce to ``root`` of each tensor, in order (their ops
        and dtypes checked); ``step``: the DDP step of a gradient bucket."""
        one = partial(self._all_reduce_one, op=op, root=root, step=step)
        return self._run(partial(for_each, one, tensors), tensors, tensors)

    def _all_reduce_one(self, tensor: torch.Tensor, op: Any, root: Optional[int], step: int = 0) -> None:
        fn, code, average, dtype_code = reduction(op, tensor.dtype)
        seg = self._seg
        assert seg is not None
        flat, writeback = _flat(tensor)
        n = flat.numel()
        self._begin(
            KIND_ALL_REDUCE if root is None else KIND_REDUCE,
            n,
            dtype_code,
            code,
            (-1 if root is None else root) if not step else step_root(step),
        )
        if n == 0:  # nothing moves, but the ranks meet: a peer's non-empty call fails here, not later
            self._barrier("all_reduce")
            return
        if n * flat.element_size() <= SMALL_BYTES:
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

        def copy_in(k: int, bank: Bank) -> None:
            # the peers need every slice of this rank's chunk but [a, b), which this rank reduces
            # itself, straight from its own tensor
            part, c, a, b = span(k)
            slot = bank.slots[me].view(dtype)
            if a > 0:
                self._copy(slot[:a], part[:a])
            if b < c:
                self._copy(slot[b:c], part[b:c])

        def reduce(k: int, bank: Bank) -> None:
            part, _, a, b = span(k)
            if b > a:
                sources = [part[a:b] if j == me else bank.slots[j].view(dtype)[a:b] for j in range(size)]
                self._reduce(fn, bank.out.view(dtype)[a:b], sources)

        def copy_out(k: int, bank: Bank) -> None:
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
            reduce_into(fn, flat, [s[:n] for s in slots])
        self._mail ^= 1

    @poison_on_error
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
        self._begin(KIND_BROADCAST, n, root=root)

        def put(k: int, bank: Bank) -> None:
            c = min(cap, n - k * cap)
            self._copy(bank.slot_area[:c], raw[k * cap : k * cap + c])

        def take(k: int, bank: Bank) -> None:
            c = min(cap, n - k * cap)
            self._copy(raw[k * cap : k * cap + c], bank.slot_area[:c])

        root_here = self._rank == root
        stages = [put if root_here else None, None if root_here else take]
        self._phases(-(-n // cap), stages, "broadcast", overlap=True)
        if writeback and not root_here:
            t.copy_(flat.view(t.shape))

    @poison_on_error
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        ArgCheck(NAME, "all_gather_into_tensor", self._size).whole(output, input, "output")
        if self._seg is None or not all_cpu([output, input]):
            return self._gloo._allgather_base(output, input, opts or _c10d.AllgatherOptions())
        n = input.numel()
        parts = [output.view(-1)[i * n : (i + 1) * n] for i in range(self._size)]
        return self._run(partial(self._gather_into, parts, input), [input], output)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self.all_gather_single(output, input, opts)

    @poison_on_error
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
        self._begin(KIND_ALL_GATHER_UNEVEN, sum(sizes))  # in bytes, all of them: the same on every rank
        self._gather_chunks(bytes_of(block)[0], list(out.split_with_sizes(sizes)), sizes, "all_gather")

    def _gather_into(self, outs: list[torch.Tensor], inp: torch.Tensor) -> None:
        raw = bytes_of(inp)[0]
        self._begin(KIND_ALL_GATHER, raw.numel())
        self._gather_chunks(raw, outs, [raw.numel()] * self._size, "all_gather")

    @poison_on_error
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        reduce_fn(op, input.dtype)
        ArgCheck(NAME, "reduce_scatter_tensor", self._size).whole(input, output, "input")
        if self._seg is None or not all_cpu([output, input]):
            return self._gloo._reduce_scatter_base(output, input, opts or _c10d.ReduceScatterOptions())
        rows = input.reshape(self._size, -1)
        return self._run(partial(self._reduce_scatter, output, rows, op), [input], output)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self.reduce_scatter_single(output, input, opts)

    @poison_on_error
    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> Any:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        ArgCheck(NAME, "reduce_scatter", self._size).per_rank(inputs, outputs, "input")
        check_op(op, outputs)
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
        fn, code, average, dtype_code = reduction(op, rows.dtype)
        seg = self._seg
        assert seg is not None
        out_flat, writeback = _flat(output)
        n = out_flat.numel()
        size, me = self._size, self._rank
        per = seg.chunk // rows.element_size() // size
        self._begin(KIND_REDUCE_SCATTER, n, dtype_code, code)

        def grid(bank: Bank, j: int) -> torch.Tensor:
            return bank.slots[j].view(rows.dtype)[: per * size].view(size, per)

        def put(k: int, bank: Bank) -> None:
            # every row but this rank's own, which it reduces straight from ``rows``
            lo, c = k * per, min(per, n - k * per)
            mine = grid(bank, me)
            if me > 0:
                mine[:me, :c].copy_(rows[:me, lo : lo + c])
            if me < size - 1:
                mine[me + 1 :, :c].copy_(rows[me + 1 :, lo : lo + c])

        def reduce(k: int, bank: Bank) -> None:
            lo, c = k * per, min(per, n - k * per)
            sources = [rows[me, lo : lo + c] if j == me else grid(bank, j)[me, :c] for j in range(size)]
            self._reduce(fn, out_flat[lo : lo + c], sources)

        self._phases(-(-n // per), [put, reduce], "reduce_scatter")
        if average:
            out_flat.div_(size)
        if writeback:
            output.copy_(out_flat.view(output.shape))

    @poison_on_error
    def barrier(self, opts: Any = None) -> Any:
        if self._hierarchical:
            return self._run(self._hier_barrier, [], None)
        if self._seg is None:
            return self._gloo.barrier(opts or _c10d.BarrierOptions())
        return self._run(self._barrier_call, [], None)

    def _barrier_call(self) -> None:
        self._begin(KIND_BARRIER, 0)
        self._barrier("barrier")

    def send(self, tensors: Any, dst: int, tag: int) -> Any:
        return self._p2p(SEND, dst, tensors, self._gloo.send(tensors, dst, tag))

    def recv(self, tensors: Any, src: int, tag: int) -> Any:
        return self._p2p(RECV, src, tensors, self._gloo.recv(tensors, src, tag))

    def recv_anysource(self, tensors: Any, tag: int) -> Any:
        return self._p2p(RECV, -1, tensors, self._gloo.recv_anysource(tensors, tag))

    def _p2p(self, kind: int, peer: int, tensors: Any, work: Any) -> Any:
        """A send or receive (on the gloo group beside the memory) on record, for the stall check."""
        if self.calls is None:
            return work
        return RecordedWork(work, self.calls.record_p2p(kind, peer, tensors, work))

    def abort(self) -> None:
        """Mark the group failed by this rank: peers waiting in a collective raise at once."""
        self._mark(None)
        if self._local is not None:
            self._local.abort()

    def shutdown(self) -> None:
        self._stop_thread()
        if self._helpers is not None:
            self._helpers.shutdown(wait=False)
        if self._local is not None:
            self._local.shutdown()
        # drop the inner groups now: a gloo group left for the interpreter's teardown to destroy
        # aborts the process ("terminate called without an active exception")
        self._local = self._leaders = None


def create(store: Any, rank: int, size: int, timeout: timedelta) -> ShmProcessGroup:
    """torch.distributed's constructor hook for ``backend="shm"`` (registered by
    :func:`onedist.register_torch_backends`): the group, with its calls on record."""
    # a live recovery's replacement meets its peers, then makes its generation's group (as the
    # survivors' rejoin does)
    group = ShmProcessGroup(store, rank, size, timeout, group_prefix(joined(os.environ, store)))
    if size > 1:
        group.calls = new_call_log(group)
        steps.install()
    return group


def new_call_log(group: ShmProcessGroup) -> CallLog:
    """The group's calls on record, under a number its members agree on."""
    number = agreed_number(group._gloo, group.size())
    return CallLog(group.rank(), partial(dist.get_process_group_ranks, group), number)
