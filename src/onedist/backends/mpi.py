"""MPI collectives on stock PyTorch wheels: a process group backed by mpi4py.

PyTorch's own ``mpi`` process group exists only in builds compiled against MPI; the wheels on
PyPI have none. torch lets Python register a process group backend, so onedist registers this
one (under torch's name ``"mpi4py"``; ``"mpi"`` is reserved for the built-in, see
:mod:`onedist._torch_plugin`) and, when mpi4py is installed, every ``dist.*`` call,
``DistributedDataParallel`` included, runs on real MPI calls of the MPI library mpi4py was
built against (Open MPI, MPICH, Intel MPI).

* **Communicators.** The world group is ``MPI_COMM_WORLD`` split in torch's rank order, so a
  launcher whose ranks differ from MPI's still works; a subgroup is ``MPI_Comm_create_group``
  over its members only (torch creates a group on its members only).
* **Calls.** Blocking MPI collectives on the tensors' memory (no copy for contiguous tensors),
  in call order, large ones on the group's thread (:class:`~._pygroup.OrderedGroup`) so that DDP
  overlaps them with backward. Blocking calls were 1.8-2.5× faster than MPI's nonblocking ones
  with Open MPI 4.1 on 1-128 MB here.
* **Types.** Every dtype moves (as bytes). Reductions use MPI's typed ops; float16 and
  bfloat16, which MPI lacks, reduce in float32 and round once; bool reduces as bytes (SUM is or,
  PRODUCT is and, as in gloo).
* **Mismatches.** When the stall check finds the ranks blocked in different calls, a rank in a
  blocking MPI call can only leave it if MPI lets it: with Open MPI 5's fault tolerance (ULFM,
  switched on here before MPI starts: ``OMPI_MCA_mpi_ft_enable=1``) the watcher revokes the
  group's communicators (``MPI_Comm_revoke``), the pending call returns on every rank, and each
  raises :class:`~onedist.CollectiveMismatchError`. Other MPI libraries (Open MPI 4 has no ULFM)
  cannot be revoked: a rank blocked there is ended with the report printed (see
  :mod:`onedist.failures.watcher`).
* **Timeouts.** A blocking MPI call cannot be interrupted, so a watchdog thread checks the call
  in flight: when one runs past the group's timeout, it prints which collective, on which group
  and rank, and calls ``MPI_Abort``, which ends every rank of the job (the launcher reports it).
  Nothing hangs silently. A barrier, where a rank that never comes is most often waited for, is
  ``MPI_Ibarrier`` waited on until the timeout: it raises "Timed out" on that rank as gloo's does,
  and the group refuses every later call (its barrier is still pending).
* **Sparse tensors.** A sparse all_reduce (SUM, as gloo) gathers every rank's indices and values
  and adds them up; the input becomes the coalesced sum.
* **CUDA tensors** are not accepted (registered for ``cpu``); onedist's collectives move them
  to the CPU first.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from functools import cache, partial
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..errors import BackendUnavailableError, CollectiveMismatchError
from ._mpi_wire import (
    SCRATCH,
    WIDEN,
    MpiError,
    as_bytes,
    buf,
    datatypes,
    displacements,
    mpi,
    mpi_op,
    on_wire,
)
from ._pygroup import ArgCheck, OrderedGroup, PyWork, all_cpu, averages, for_each, op_name
from .recorded import calls as recorded, steps
from .recorded.calls import RECV, SEND, CallLog, RecordedWork, signature

#: torch.distributed's name of this backend (``dist.get_backend()`` reports it)
NAME = "mpi4py"


@cache
def installed() -> bool:
    """True when mpi4py and an MPI library are installed (found, not imported: importing
    ``mpi4py.MPI`` initialises MPI)."""
    if importlib.util.find_spec("mpi4py") is None:
        return False
    import ctypes.util

    return any(ctypes.util.find_library(name) for name in ("mpi", "mpich", "mpi_ibm", "impi"))


#: Open MPI 5's run-time switch for ULFM (MPI_Comm_revoke); read once, when MPI starts
FT_ENV = "OMPI_MCA_mpi_ft_enable"


def prepare_environment() -> None:
    """Settings that must be in the environment before MPI starts (``import mpi4py.MPI``): ULFM
    on, so that a mismatch can be broken (see the module doc; Open MPI 4 and MPICH ignore it, a
    user's own value is kept), and no warning about the processes onedist forks."""
    os.environ.setdefault(FT_ENV, "1")
    os.environ.setdefault("OMPI_MCA_mpi_warn_on_fork", "0")


@cache
def _revocable() -> bool:
    """True when MPI_Comm_revoke works here: Open MPI 5 or later with ULFM switched on. (Elsewhere
    it raises, or, with Open MPI 5's ULFM off, blocks forever.)"""
    MPI = mpi()
    words = MPI.Get_library_version().split()
    if len(words) < 3 or words[:2] != ["Open", "MPI"] or os.environ.get(FT_ENV) != "1":
        return False
    try:
        return int(words[2].lstrip("v").split(".")[0]) >= 5 and hasattr(MPI.Comm, "Revoke")
    except ValueError:
        return False


_live_groups: weakref.WeakSet[MpiProcessGroup] = weakref.WeakSet()


def revoke_all() -> bool:
    """Revoke the communicator of every mpi4py group of this process (ULFM), so that a call
    blocked in one returns ``MPI_ERR_REVOKED`` here and on every peer; False when MPI cannot."""
    if "mpi4py.MPI" not in sys.modules or not _revocable():
        return False
    revoked = False
    for group in list(_live_groups):
        revoked = group.revoke() or revoked
    return revoked


class MpiRevokedError(MpiError, CollectiveMismatchError):
    """A call broken off by ``MPI_Comm_revoke`` (ULFM), which onedist calls on a mismatch only.
    onedist's collectives replace it with the stall check's verdict, which names every rank's call."""

    #: read by onedist's guard: the mismatch was found on another rank or by the watcher
    found_elsewhere = True


# ---------------------------------------------------------------------------- watchdog
class _Watchdog:
    """Aborts the MPI job when a call runs past its group's timeout (see the module doc)."""

    def __init__(self) -> None:
        self._calls: dict[int, tuple[float, str]] = {}  # id -> (deadline, description)
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._next = 0

    def enter(self, timeout: float, what: str) -> int:
        with self._lock:
            self._next += 1
            key = self._next
            self._calls[key] = (time.monotonic() + timeout, what)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="onedist-mpi-watchdog", daemon=True)
                self._thread.start()
        return key

    def leave(self, key: int) -> None:
        with self._lock:
            self._calls.pop(key, None)

    def _watch(self) -> None:
        while True:
            time.sleep(1.0)
            now = time.monotonic()
            with self._lock:
                late = [what for deadline, what in self._calls.values() if deadline < now]
            if late:
                sys.stderr.write(
                    f"onedist mpi: {late[0]} did not complete within its timeout: a rank of the group never "
                    "called it, or called another collective, or died. MPI cannot interrupt a call, so this "
                    "rank aborts the MPI job (MPI_Abort): every rank ends.\n"
                    "HINT: set ONEDIST_DEBUG=1 to compare each rank's collectives, or pass a longer "
                    "timeout to onedist.initialize\n"
                )
                sys.stderr.flush()
                mpi().COMM_WORLD.Abort(1)


_watchdog = _Watchdog()


# ---------------------------------------------------------------------------- the process group
class MpiProcessGroup(OrderedGroup):
    """The process group behind ``backend="mpi"`` on torch builds without MPI (see the module doc)."""

    _thread_name = "onedist-mpi"

    def __init__(self, comm: Any, rank: int, size: int, timeout: timedelta, ranks: list[int]) -> None:
        super().__init__(rank, size)
        self._comm = comm
        self._rank, self._size = rank, size
        self._timeout = timeout.total_seconds() if timeout else 1800.0
        self._label = f"group of ranks {ranks}" if ranks else "the world group"
        self._timed_out = ""  # the barrier that timed out: the group can no longer be used
        self._stale: Any = None  # that barrier's MPI request, pending for good
        self._revoked = False
        #: the calls on record (see the module doc), and the communicators of DDP's gradient
        #: buckets by the parity of their step (recorded.steps); None with ONEDIST_RECORD=0
        self.calls: Optional[CallLog] = None
        self._buckets: tuple[Any, ...] = ()
        if recorded.enabled() and size > 1:
            self._buckets = (comm.Dup(), comm.Dup())
            nonce = comm.allreduce(int.from_bytes(os.urandom(7), "little"))  # agreed by the members
            self.calls = CallLog(rank, tuple(ranks) if ranks else tuple(range(size)), nonce)
            steps.install()
        _live_groups.add(self)

    def revoke(self) -> bool:
        """Revoke this group's communicator (ULFM): its pending and later calls fail on every rank."""
        if self._revoked:
            return True
        try:
            for comm in (self._comm, *self._buckets):
                comm.Revoke()
        except (NotImplementedError, mpi().Exception):
            return False
        self._revoked = True
        return True

    def getBackendName(self) -> str:
        return NAME

    @property
    def comm(self) -> Any:
        """The mpi4py communicator of this group (ranks in the group's rank order)."""
        return self._comm

    # ------------------------------------------------------------------ plumbing
    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        if self._timed_out:
            raise MpiError(
                f"onedist mpi: {what} on rank {self._rank} of {self._label}: the group is unusable since "
                f"{self._timed_out} timed out (its MPI barrier is still pending); create a new group"
            )
        key = _watchdog.enter(self._timeout, f"{what} on rank {self._rank} of {self._label}")
        try:
            return fn(*args)
        except mpi().Exception as e:
            raise self._explained(what, e) from None
        finally:
            _watchdog.leave(key)

    def _issue(
        self,
        sig: tuple[int, ...],
        job: Callable[[], Any],
        inputs: list[torch.Tensor],
        result: Any,
        step: int = 0,
    ) -> Any:
        """Run a collective (:meth:`_run`) on record: begun before it starts, its work the group's
        once it has one (a blocking call has none until it returns)."""
        log = self.calls
        if log is None:
            return self._run(job, inputs, result)
        entry = log.begin(sig, step)
        running = _Running()
        log.started(entry, running)
        try:
            running.work = self._run(job, inputs, result)
        except BaseException:
            running.failed = True
            raise
        return running.work

    def _step_comm(self) -> tuple[int, Any]:
        """The DDP step of an all-reduce about to start (0 outside a backward), and the
        communicator it travels on: its step's, so that buckets of different steps never pair."""
        log = self.calls
        step = steps.step_of_call(log) if log is not None and log.ddp_step else 0
        return step, (self._buckets[step & 1] if step else self._comm)

    def _explained(self, what: str, e: Any) -> BaseException:
        """MPI's error, or what it means when a peer sent more than this call takes, or revoked
        the group (the stall check's verdict, which onedist's guard then raises)."""
        error_class = e.Get_error_class()
        if error_class == getattr(mpi(), "ERR_REVOKED", None):
            return MpiRevokedError(
                f"onedist mpi: {what} on rank {self._rank} of {self._label} was broken off: a rank revoked "
                "the group's communicator after it found the ranks' calls differ (ranks blocked in "
                "different collectives, or a call that received more data than it takes); the group "
                "cannot be used again"
            )
        if error_class != mpi().ERR_TRUNCATE:
            return e  # type: ignore[no-any-return]
        if _revocable():  # the peers may wait for data this rank will never send: let them go
            self.revoke()
        return CollectiveMismatchError(
            f"onedist mpi: {what} on rank {self._rank} of {self._label} received more data than it takes "
            "(MPI_ERR_TRUNCATE): the ranks called it with different sizes, or called different "
            "collectives.\nHINT: ONEDIST_DEBUG=1 names every rank's call"
        )

    @staticmethod
    def _check_cpu(what: str, tensors: list[torch.Tensor]) -> None:
        if not all_cpu(tensors):
            sparse = sorted({str(t.layout) for t in tensors if t.layout != torch.strided})
            if sparse:
                raise MpiError(
                    f"onedist mpi: {what} takes dense tensors (mpi4py moves memory), got layout "
                    f"{', '.join(sparse)}; call .to_dense() first, or use gloo, which reduces sparse tensors"
                )
            devices = sorted({str(t.device) for t in tensors})
            raise MpiError(
                f"onedist mpi: {what} takes dense CPU tensors (mpi4py moves host memory), got {devices}; "
                "onedist's collectives move CUDA tensors to the CPU for this backend"
            )

    # ------------------------------------------------------------------ reductions
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        if any(t.is_sparse for t in tensors):
            return self._sparse_all_reduce(tensors, op)
        return self._reduce_each(tensors, op, None, "all_reduce")

    def _sparse_all_reduce(self, tensors: list[torch.Tensor], op: Any) -> Any:
        if getattr(op, "op", op) != dist.ReduceOp.SUM or not all(t.is_sparse for t in tensors):
            raise MpiError(
                f"onedist mpi: a sparse all_reduce takes sparse COO tensors only and op SUM (as gloo), got "
                f"op {op_name(getattr(op, 'op', op))} and layouts {sorted({str(t.layout) for t in tensors})}"
            )
        sig = signature("all_reduce", tensors, op)
        return self._issue(sig, partial(for_each, self._sparse_sum_one, tensors), [], tensors)

    def _sparse_sum_one(self, t: torch.Tensor) -> None:
        """``t`` becomes the coalesced sum of every rank's ``t``: their indices and values gathered
        (Allgatherv, as bytes) and added up."""
        local = t.coalesce()
        indices = local.indices().t().contiguous()  # (nnz, sparse dims): one row per entry
        values = local.values().contiguous()  # (nnz, *dense dims)
        counts = self._call("all_reduce", self._comm.allgather, indices.shape[0])
        total = sum(counts)
        all_indices = indices.new_empty((total, indices.shape[1]))
        all_values = values.new_empty((total, *values.shape[1:]))
        for mine, into in ((indices, all_indices), (values, all_values)):
            row = into[0].numel() * into.element_size() if total else 0
            sizes = [n * row for n in counts]
            recv = [buf(into)[0], sizes, displacements(sizes), mpi().BYTE]
            self._call("all_reduce", self._comm.Allgatherv, buf(mine), recv)
        t.copy_(torch.sparse_coo_tensor(all_indices.t(), all_values, t.shape).coalesce())

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self._reduce_each(tensors, op, None, "all_reduce_coalesced")

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        ArgCheck("mpi", "reduce", self._size).root(opts.rootRank)
        return self._reduce_each(tensors, opts.reduceOp, opts.rootRank, "reduce")

    def _reduce_each(self, tensors: list[torch.Tensor], op: Any, root: Optional[int], kind: str) -> Any:
        self._check_cpu("all_reduce" if root is None else "reduce", tensors)
        for t in tensors:  # an unsupported op or dtype raises here, on every rank, before any call
            mpi_op(op, t.dtype)
            if t.dtype not in WIDEN and t.dtype != torch.bool and t.dtype not in datatypes():
                raise MpiError(f"onedist mpi: dtype {t.dtype} cannot be reduced")
        step, comm = self._step_comm() if root is None else (0, self._comm)
        job = partial(for_each, partial(self._reduce_one, op=op, root=root, comm=comm), tensors)
        sig = signature(kind, tensors, op, root=-1 if root is None else root)
        return self._issue(sig, job, tensors, tensors, step)

    def _reduce_one(self, t: torch.Tensor, op: Any, root: Optional[int], comm: Any) -> None:
        if t.numel() == 0:
            return
        MPI = mpi()
        wire, datatype, copied = on_wire(t, op)
        mop = mpi_op(op, t.dtype)
        spec = buf(wire, wire.numel(), datatype)
        if root is None:
            self._call("all_reduce", comm.Allreduce, MPI.IN_PLACE, spec, mop)
        elif root == self._rank:
            self._call("reduce", self._comm.Reduce, MPI.IN_PLACE, spec, mop, root)
        else:
            self._call("reduce", self._comm.Reduce, spec, None, mop, root)
        if averages(op) and (root is None or root == self._rank):
            wire.div_(self._size)  # in the wide type, when float16 travels as float32: one rounding
        if copied and (root is None or root == self._rank):
            t.copy_(wire.view(t.dtype).view(t.shape) if t.dtype == torch.bool else wire.view(t.shape))

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> Any:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        self._check_cpu("reduce_scatter", outputs + [t for ts in inputs for t in ts])
        check = ArgCheck("mpi", "reduce_scatter", self._size)
        check.per_rank(inputs, outputs, "input")
        stacked = [torch.stack([i.reshape(-1) for i in ins]) for ins in inputs]
        for out in outputs:
            mpi_op(op, out.dtype)
        job = partial(for_each, partial(self._reduce_scatter_one, op=op), outputs, stacked)
        return self._issue(signature("reduce_scatter", outputs, op), job, stacked, outputs)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        self._check_cpu("reduce_scatter", [output, input])
        ArgCheck("mpi", "reduce_scatter_tensor", self._size).whole(input, output, "input")
        mpi_op(op, output.dtype)
        sig = signature("reduce_scatter_tensor", (output,), op)
        return self._issue(sig, partial(self._reduce_scatter_one, output, input, op), [input], output)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self.reduce_scatter_single(output, input, opts)

    def _reduce_scatter_one(self, output: torch.Tensor, rows: torch.Tensor, op: Any) -> None:
        n = output.numel()
        if n == 0:
            return
        src, datatype, _ = on_wire(rows, op)
        if src.dtype == rows.dtype or rows.dtype == torch.bool:
            dst, _, copied = on_wire(output, op)
        else:  # reduced in a wider type
            dst, copied = torch.empty(n, dtype=src.dtype), True
        self._call(
            "reduce_scatter",
            self._comm.Reduce_scatter_block,
            [buf(src)[0], datatype],  # mpi4py derives the per-block count from the receive side
            buf(dst, n, datatype),
            mpi_op(op, output.dtype),
        )
        if averages(op):
            dst.div_(self._size)
        if copied:
            output.copy_(
                dst.view(output.dtype).view(output.shape)
                if output.dtype == torch.bool
                else dst.view(output.shape)
            )

    # ------------------------------------------------------------------ data movement
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = opts.rootRank if opts is not None else 0
        self._check_cpu("broadcast", tensors)
        ArgCheck("mpi", "broadcast", self._size).root(root)
        job = partial(for_each, partial(self._broadcast_one, root=root), tensors)
        return self._issue(signature("broadcast", tensors, root=root), job, tensors, tensors)

    def _broadcast_one(self, t: torch.Tensor, root: int) -> None:
        raw, copied = as_bytes(t)
        if raw.numel() == 0:
            return
        self._call("broadcast", self._comm.Bcast, buf(raw), root)
        if copied and self._rank != root:
            t.copy_(raw.view(t.dtype).view(t.shape))

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        self._check_cpu("all_gather", inputs + [t for ts in outputs for t in ts])
        check = ArgCheck("mpi", "all_gather", self._size)
        check.per_rank(outputs, inputs, "output")
        job = partial(for_each, self._gather_into_list, outputs, inputs)
        return self._issue(signature("all_gather", inputs), job, inputs, outputs)

    def allgather_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        # torch's coalesced form is rank-major (outputs[rank][i]); allgather's is input-major
        # (outputs[i][rank]): the same tensors, transposed (passed as they were, every result
        # was transposed, silently wrong when there are as many inputs as ranks)
        return self.allgather([list(per_input) for per_input in zip(*outputs)], inputs, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        self._check_cpu("all_gather", [output, input])
        ArgCheck("mpi", "all_gather_into_tensor", self._size).whole(output, input, "output")
        sig = signature("all_gather_into_tensor", (input,))
        return self._issue(sig, partial(self._gather_into, output, input), [input], output)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self.all_gather_single(output, input, opts)

    def _gather_into(self, output: torch.Tensor, input: torch.Tensor) -> None:
        src, _ = as_bytes(input)
        dst, copied = as_bytes(output)
        if src.numel() == 0:
            return
        self._call("all_gather", self._comm.Allgather, buf(src), buf(dst, src.numel(), mpi().BYTE))
        if copied:
            output.copy_(dst.view(output.dtype).view(output.shape))

    def _gather_into_list(self, outs: list[torch.Tensor], inp: torch.Tensor) -> None:
        whole = torch.empty(self._size * inp.numel(), dtype=inp.dtype)
        self._gather_into(whole, inp)
        for i, o in enumerate(outs):
            o.copy_(whole[i * inp.numel() : (i + 1) * inp.numel()].view(o.shape))

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> Any:
        root = opts.rootRank
        self._check_cpu("gather", inputs + [t for ts in outputs for t in ts])
        check = ArgCheck("mpi", "gather", self._size)
        bad = check.at_root(root, self._rank, outputs, inputs, "output")
        if bad is not None:  # the peers' parts land in scratch tensors, then the root raises
            outputs = [[torch.empty_like(inp) for _ in range(self._size)] for inp in inputs]

        def job() -> None:
            for i, inp in enumerate(inputs):
                src, _ = as_bytes(inp)
                if self._rank == root:
                    whole = torch.empty(self._size * src.numel(), dtype=torch.uint8)
                    self._call(
                        "gather", self._comm.Gather, buf(src), buf(whole, src.numel(), mpi().BYTE), root
                    )
                    for j, o in enumerate(outputs[i]):
                        o.copy_(whole[j * src.numel() : (j + 1) * src.numel()].view(o.dtype).view(o.shape))
                else:
                    self._call("gather", self._comm.Gather, buf(src), None, root)

        work = self._issue(signature("gather", inputs, root=root), job, inputs, outputs)
        if bad is not None:
            work.wait()
            raise bad
        return work

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> Any:
        root = opts.rootRank
        self._check_cpu("scatter", outputs + [t for ts in inputs for t in ts])
        check = ArgCheck("mpi", "scatter", self._size)
        bad = check.at_root(root, self._rank, inputs, outputs, "input")

        def job() -> None:
            # the root's verdict on its inputs first, so that every rank raises or none does
            ok = torch.tensor([bad is None], dtype=torch.uint8)
            self._call("scatter", self._comm.Bcast, buf(ok), root)
            if not ok.item():
                raise bad if bad is not None else check.refused(root)
            for i, out in enumerate(outputs):
                dst, copied = as_bytes(out)
                if self._rank == root:
                    whole = torch.cat([as_bytes(t)[0] for t in inputs[i]])
                    self._call(
                        "scatter", self._comm.Scatter, buf(whole, dst.numel(), mpi().BYTE), buf(dst), root
                    )
                else:
                    self._call("scatter", self._comm.Scatter, None, buf(dst), root)
                if copied:
                    out.copy_(dst.view(out.dtype).view(out.shape))

        return self._issue(signature("scatter", outputs, root=root), job, outputs, outputs)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        self._check_cpu("all_to_all", outputs + inputs)
        check = ArgCheck("mpi", "all_to_all", self._size)
        check.count(inputs, "input")
        check.count(outputs, "output")

        def job() -> None:
            send = torch.cat([as_bytes(t)[0] for t in inputs]) if inputs else SCRATCH[:0]
            counts_in = [t.numel() * t.element_size() for t in inputs]
            counts_out = [t.numel() * t.element_size() for t in outputs]
            recv = torch.empty(sum(counts_out), dtype=torch.uint8)
            self._alltoallv(recv, send, counts_out, counts_in)
            lo = 0
            for t, c in zip(outputs, counts_out):
                t.copy_(recv[lo : lo + c].view(t.dtype).view(t.shape))
                lo += c

        return self._issue(signature("all_to_all", inputs, sized=False), job, inputs, outputs)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        opts: Any = None,
    ) -> Any:
        self._check_cpu("all_to_all_single", [output, input])
        check = ArgCheck("mpi", "all_to_all_single", self._size)
        check.splits(input, in_splits, "input")
        check.splits(output, out_splits, "output")

        def counts(t: torch.Tensor, splits: list[int]) -> list[int]:
            row = (t.numel() // t.shape[0] if t.dim() and t.shape[0] else 0) * t.element_size()
            if not splits:
                return [t.numel() * t.element_size() // self._size] * self._size
            return [s * row for s in splits]

        def job() -> None:
            send, _ = as_bytes(input)
            recv, copied = as_bytes(output)
            self._alltoallv(recv, send, counts(output, out_splits), counts(input, in_splits))
            if copied:
                output.copy_(recv.view(output.dtype).view(output.shape))

        sig = signature("all_to_all_single", (input,), sized=False)  # split sizes may differ per rank
        return self._issue(sig, job, [input], output)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        opts: Any = None,
    ) -> Any:
        return self.alltoall_base(output, input, out_splits, in_splits, opts)

    def _alltoallv(
        self, recv: torch.Tensor, send: torch.Tensor, counts_out: list[int], counts_in: list[int]
    ) -> None:
        MPI = mpi()
        self._call(
            "all_to_all",
            self._comm.Alltoallv,
            [buf(send)[0], (counts_in, displacements(counts_in)), MPI.BYTE],
            [buf(recv)[0], (counts_out, displacements(counts_out)), MPI.BYTE],
        )

    def barrier(self, opts: Any = None) -> Any:
        return self._issue(signature("barrier"), self._barrier_until_timeout, [], None)

    def _tested(self, request: Any) -> bool:
        try:
            return bool(request.Test())
        except mpi().Exception as e:
            raise self._explained("barrier", e) from None

    def _barrier_until_timeout(self) -> None:
        """``MPI_Ibarrier``, tested until it completes or the group's timeout passes (see the module
        doc): short sleeps after the first 50 us, so that a waiting rank leaves the core to its peers."""
        request = self._call("barrier", self._comm.Ibarrier)
        start = time.monotonic()
        pause = 0.0
        while not self._tested(request):
            waited = time.monotonic() - start
            if waited > self._timeout:
                self._timed_out = f"a barrier on rank {self._rank}"
                self._stale = request  # MPI still owns the pending request: keep it alive
                raise MpiError(  # torch's words (gloo's), which callers match: " Timed out waiting <N>ms"
                    f"onedist mpi: barrier on rank {self._rank} of {self._label}: Timed out waiting "
                    f"{round(self._timeout * 1000)}ms: a rank of the group never called it, called another "
                    "collective, or died"
                )
            if waited > 50e-6:
                time.sleep(pause)
                pause = min(2 * pause or 1e-5, 1e-3)

    # ------------------------------------------------------------------ point to point
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        self._check_cpu("send", tensors)
        raws = [as_bytes(t)[0] for t in tensors]
        requests = [self._comm.Isend(buf(raw), dst, tag) for raw in raws]
        return self._p2p(SEND, dst, tensors, _RequestWork(self, "send", requests, keep=raws))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        return self._recv(tensors, src, tag, src)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Any:
        return self._recv(tensors, mpi().ANY_SOURCE, tag, -1)

    def _recv(self, tensors: list[torch.Tensor], src: int, tag: int, peer: int) -> Any:
        self._check_cpu("recv", tensors)
        if len(tensors) != 1:
            raise MpiError(f"onedist mpi: recv takes one tensor, got {len(tensors)}")
        t = tensors[0]
        raw, copied = as_bytes(t)
        request = self._comm.Irecv(buf(raw), src, tag)
        work = _RequestWork(self, "recv", [request], keep=[raw], into=(t, raw) if copied else None)
        return self._p2p(RECV, peer, tensors, work)

    def _p2p(self, kind: int, peer: int, tensors: list[torch.Tensor], work: _RequestWork) -> Any:
        """A send or receive on record (peer -1: any source), its wait explaining a failure."""
        log = self.calls
        return work if log is None else RecordedWork(work, log.record_p2p(kind, peer, tensors, work))

    def shutdown(self) -> None:
        self._stop_thread()


class _RequestWork(PyWork):
    """A send or receive in flight: ``wait()`` waits for the MPI requests (under the watchdog)."""

    def __init__(
        self,
        group: MpiProcessGroup,
        what: str,
        requests: list[Any],
        keep: list[torch.Tensor],
        into: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> None:
        super().__init__(torch.futures.Future())
        self._group, self._what, self._requests = group, what, requests
        self._keep = keep  # the memory MPI reads or writes stays alive until the request completes
        self._into = into
        # held while a thread waits on or tests the requests: MPI forbids two threads on one
        # request at once, and the failure watcher asks is_completed() while the caller waits
        self._busy = threading.Lock()

    def wait(self, timeout: Any = None) -> bool:
        with self._busy:
            if not self._fut.done():
                MPI = mpi()
                status = MPI.Status()
                for request in self._requests:
                    self._group._call(self._what, request.Wait, status)
                self._source = status.Get_source()
                if self._into is not None:
                    t, raw = self._into
                    t.copy_(raw.view(t.dtype).view(t.shape))
                self._fut.set_result(self._keep)
        return True

    def is_completed(self) -> bool:
        if self._fut.done():
            return True
        if not self._busy.acquire(blocking=False):
            return False  # another thread waits on it
        try:
            return all(r.Test() for r in self._requests)
        finally:
            self._busy.release()

    def _source_rank(self) -> int:
        self.wait()
        return self._source


class _Running:
    """A collective on record until the group gives its work: a blocking call (run inline) has
    none until it returns, and a call that raised is a failed one (recorded.calls asks)."""

    __slots__ = ("failed", "work")

    def __init__(self) -> None:
        self.work: Any = None
        self.failed = False

    def is_completed(self) -> bool:
        return self.failed or (self.work is not None and bool(self.work.is_completed()))

    def wait(self) -> bool:
        if self.failed:
            raise MpiError("onedist mpi: the call failed")
        return True if self.work is None else bool(self.work.wait())


# ---------------------------------------------------------------------------- creation
_world_comm: Any = None


def create(opts: Any, backend_options: Any) -> MpiProcessGroup:
    """torch.distributed's constructor hook for ``backend="mpi4py"`` (extended API: it gives the
    group's global ranks), registered by :func:`onedist.register_torch_backends`."""
    global _world_comm
    if not installed():
        raise BackendUnavailableError(
            "onedist mpi: backend 'mpi4py' needs mpi4py and an MPI library; "
            'HINT: pip install "onedist[mpi]" (and Open MPI or MPICH), then start the ranks with mpirun'
        )
    prepare_environment()  # a torch program's first MPI use may be here
    MPI = mpi()
    rank, size = opts.group_rank, opts.group_size
    if not dist.is_initialized():  # the default group, created before torch records it
        mpi_size = MPI.COMM_WORLD.Get_size()
        if mpi_size != size:
            raise MpiError(
                f"onedist mpi: the torch.distributed world has {size} ranks but MPI_COMM_WORLD has "
                f"{mpi_size}: every rank must be started by the MPI launcher (mpirun -np {size} ...), "
                "and MPI_COMM_WORLD must hold nothing else"
            )
        # MPI ranks in torch's order: a launcher whose rank numbering differs from MPI's still works
        _world_comm = MPI.COMM_WORLD.Split(0, rank)
        return MpiProcessGroup(_world_comm, rank, size, opts.timeout, [])
    ranks = [int(r) for r in opts.global_ranks_in_group]
    comm = _world_comm.Create_group(_world_comm.Get_group().Incl(ranks))  # its members only
    return MpiProcessGroup(comm, rank, size, opts.timeout, ranks)
