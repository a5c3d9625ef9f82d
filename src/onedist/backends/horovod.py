"""The Horovod backend (``backend="horovod"``): onedist's primitives on Horovod's own operations.

Processes come from ``horovodrun`` (or from :func:`onedist.spawn` / :class:`onedist.Parallel`
with ``backend="horovod"``, which start them through ``horovod.run``); ``initialize("horovod")``
calls ``hvd.init()``. Everything Horovod-specific lives here and in the two modules beside it
(``_horovod_store.py``: the side store and send / recv; ``_horovod_training.py``: ``auto_model``
and ``auto_optim``):

* Collectives are Horovod's allreduce / allgather / broadcast / alltoall / barrier. Horovod
  matches operations across ranks by *name*, so onedist names each one from what every member
  knows: the group, the operation, dtype and size (a synchronous call: the same name next time,
  answered from Horovod's response cache), plus a per-group number for asynchronous ones.
  Horovod's own unnamed counter differs between ranks as soon as they did different things.
* dtypes: Horovod reduces float16/32/64 and int32/64 only; bool, int8, uint8, int16, uint16 are
  reduced in int32, uint32 in int64, bfloat16 in float32 (:meth:`reduce_dtype`; the cast back
  gives the result the narrow type would give). Data movement of the dtypes Horovod cannot move
  (bool, bfloat16, complex, unsigned > 8 bits) travels as the tensor's raw bytes.
* AND / OR (bitwise, as torch.distributed's BAND / BOR): Horovod has no bitwise reduction, so
  the values are all-gathered and combined locally (exact; N times the data of the tensor).
* Groups are Horovod process sets. ``hvd.add_process_set`` is a collective of *every* rank, so
  on Horovod a group must be created on all ranks (``od.new_group(ranks)`` before any
  ``if rank in ranks:``). onedist enables dynamic process sets (HOROVOD_DYNAMIC_PROCESS_SETS=1)
  at ``initialize``.
* send / recv: Horovod has no point-to-point operation. onedist carries them through the small
  key-value store it starts beside Horovod (rank 0 hosts it; it also carries failure reports):
  exact, with tags and ``src=None``, fine for control messages and small tensors; bulk data
  belongs in collectives.
* ``auto_model`` broadcasts parameters and buffers from rank 0 (no DDP wrapper); ``auto_optim``
  wraps the optimizer in ``hvd.DistributedOptimizer`` and broadcasts rank 0's state.
* ``timeout``: Horovod waits forever for a rank that never joins a collective; with a timeout,
  onedist polls the operation and raises after that long, naming the ranks that did not arrive.
* Every Horovod call of the process (the user's ``hvd.*``, ``hvd.DistributedOptimizer``'s,
  onedist's) is on record while onedist's context lives (``recorded/horovod_calls.py``;
  ``ONEDIST_RECORD=0``: none), so the failure watcher names ranks blocked in different calls.

Example (``horovodrun -np 2 -H localhost:2 --gloo python train.py``; tests/test_horovod.py runs
such scripts)::

    import onedist as od
    od.initialize("horovod")
    od.all_reduce(od.get_rank())                                # 1 (0 + 1) on both ranks
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import sys
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional

import torch

from ..errors import (
    OnedistRuntimeError,
    OnedistTypeError,
    OnedistValueError,
    bad_type,
    bad_value,
)
from ._environ import restore_env, set_env
from ._horovod_store import StoreMessages, start_side_store
from ._horovod_training import HorovodTraining
from .interface import Backend, Layout, Work
from .recorded import horovod_calls as recorded_horovod

__all__ = ["HorovodBackend"]

logger = logging.getLogger("onedist")

_NAME = "horovod"
_CPU = torch.device("cpu")

# Horovod's ops and the dtypes its CPU (and GPU) kernels take, read from its torch extension:
# allreduce: Half/Float/Double/Int/Long; allgather, broadcast, alltoall: also Byte/Char/Short
_REDUCE_DTYPES = frozenset({torch.float16, torch.float32, torch.float64, torch.int32, torch.int64})
_MOVE_DTYPES = _REDUCE_DTYPES | {torch.uint8, torch.int8, torch.int16}
# a wider type that Horovod reduces, giving the same result after the cast back (two's-complement
# sums and products wrap identically; MIN/MAX keep their order; bfloat16 -> float32 is exact)
_WIDEN = {
    torch.bool: torch.int32,
    torch.int8: torch.int32,
    torch.uint8: torch.int32,
    torch.int16: torch.int32,
    torch.uint16: torch.int32,
    torch.uint32: torch.int64,
    torch.bfloat16: torch.float32,
}
_HVD_OPS = {"SUM": "Sum", "PRODUCT": "Product", "MIN": "Min", "MAX": "Max"}
_BITWISE = {"AND": torch.bitwise_and, "OR": torch.bitwise_or}


# ============================================================================ installation
@functools.cache
def installed() -> bool:
    """True when Horovod's PyTorch extension is installed (no import: ``horovod`` imports its runner)."""
    from importlib.util import find_spec

    try:
        spec = find_spec("horovod")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    for location in spec.submodule_search_locations:
        torch_dir = os.path.join(location, "torch")
        try:
            names = os.listdir(torch_dir)
        except OSError:
            continue
        if "__init__.py" in names and any(n.startswith("mpi_lib_v2") for n in names):
            return True
    return False


def _hvd() -> Any:
    """``horovod.torch``, imported on first use, with the fix when it does not import."""
    module = sys.modules.get("horovod.torch")
    if module is not None:
        return module
    try:
        import horovod.torch as hvd
    except ImportError as e:
        raise OnedistRuntimeError(
            f"onedist: backend='horovod' needs horovod.torch, which does not import here ({e})\n"
            "HINT: build Horovod against this torch as docs/launchers/horovodrun.md shows "
            "(.ci/install_horovod.sh; `pip install horovod` alone fails to compile against torch 2.x)"
        ) from e
    return hvd


# ============================================================================ work handles
class HorovodTimeoutError(RuntimeError):
    """A Horovod operation did not complete within the context's timeout (a RuntimeError, like
    the library's own errors, so that onedist's guard reports which ranks never arrived)."""


class _HorovodWork:
    """The handle of an asynchronous primitive: ``wait()`` synchronises Horovod's handles, then
    finishes the primitive (copies an allgather's result into its output, ...).

    With a timeout, the handles are polled (Horovod's own wait has none): Horovod keeps waiting
    for a rank that never joins, with a timeout the caller gets an error instead.
    """

    __slots__ = ("_finish", "_handles", "_hvd", "_name", "_timeout")

    def __init__(
        self,
        hvd: Any,
        handles: list[int],
        finish: Optional[Callable[[list[Any]], None]],
        timeout: Optional[float],
        name: str,
    ) -> None:
        self._hvd = hvd
        self._handles: Optional[list[int]] = handles
        self._finish = finish
        self._timeout = timeout
        self._name = name

    def wait(self) -> bool:
        if self._handles is not None:
            handles, self._handles = self._handles, None
            if self._timeout is not None:
                self._poll(handles, self._timeout)
            outputs = [self._hvd.synchronize(h) for h in handles]
            if self._finish is not None:
                self._finish(outputs)
        return True

    def _poll(self, handles: list[int], limit: float) -> None:
        poll = self._hvd.poll
        deadline = time.monotonic() + limit
        pause = 1e-5
        for h in handles:
            while not poll(h):
                if time.monotonic() > deadline:
                    raise HorovodTimeoutError(
                        f"Timed out after {limit:.0f} s waiting for Horovod operation {self._name}: a rank "
                        "of its group has not joined it"
                    )
                time.sleep(pause)
                pause = min(pause * 2, 0.001)

    def is_completed(self) -> bool:
        return self._handles is None or all(self._hvd.poll(h) for h in self._handles)


def _movable(t: torch.Tensor) -> torch.Tensor:
    """``t`` flat, as a dtype Horovod moves: itself, or a view of its bytes."""
    flat = t.reshape(-1)
    return flat if flat.dtype in _MOVE_DTYPES else flat.view(torch.uint8)


# ============================================================================ the backend
class HorovodBackend(HorovodTraining, StoreMessages):
    """A Horovod context (``hvd.init()``), created by onedist or by the user.

    Example (under ``horovodrun``)::

        import onedist as od
        od.initialize("horovod")
        od.model_name(), od.backend()                           # ('horovod-dist', 'horovod')
    """

    model_name = "horovod-dist"
    sync_bn_by_onedist = True  # onedist's SyncBatchNorm, which runs on this backend's collectives
    external_origin = "your code (hvd.init())"
    cpu_reduce_dtypes = _REDUCE_DTYPES
    p2p_bulk = False  # send/recv go through the side store: large gathers use Horovod's alltoall

    def __init__(
        self,
        owned: bool,
        env_set: Optional[dict[str, Optional[str]]] = None,
        store: Any = None,
        timeout: Optional[timedelta] = None,
    ) -> None:
        hvd = _hvd()
        super().__init__(_NAME, int(hvd.rank()), int(hvd.size()))
        self._hvd = hvd
        #: True when onedist called hvd.init() (initialize / spawn)
        self.owned = owned
        self._env_set = env_set or {}
        self._store = store
        self._timeout = None if timeout is None else timeout.total_seconds()
        self._last_name = ""
        self._threads: Optional[int] = None  # torch's thread count before onedist lowered it
        self._groups: dict[tuple[int, ...], Any] = {}
        self._seq: dict[int, int] = {}
        self._sent: dict[tuple[str, int, int], int] = {}
        self._received: dict[tuple[str, int, int], int] = {}
        self._layout: Optional[Layout] = None
        self._device: Optional[torch.device] = None
        self._local_group: Any = None
        self._local_group_made = False
        self._gpu_ops = torch.cuda.is_available() and bool(hvd.nccl_built())
        #: the hvd.DistributedOptimizers auto_optim made: their hooks exchange the gradients
        self.exchangers: weakref.WeakSet[Any] = weakref.WeakSet()
        dev = self.device()
        if dev.type == "cuda":
            torch.cuda.set_device(dev)

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def available_backends(cls) -> tuple[str, ...]:
        return (_NAME,) if installed() else ()

    @classmethod
    def context_active(cls) -> bool:
        module = sys.modules.get("horovod.torch")  # never imports horovod
        if module is None:
            return False
        try:
            return bool(module.is_initialized())
        except Exception:
            return False

    @classmethod
    def create_from_context(cls) -> Optional[Backend]:
        if not cls.context_active():
            return None
        return cls(owned=False)

    @classmethod
    def create_from_backend(
        cls,
        backend: str,
        *,
        timeout: Optional[timedelta],
        init_method: Optional[str],
        rank: Optional[int],
        world_size: Optional[int],
        **kwargs: Any,
    ) -> Backend:
        if kwargs:
            name = sorted(kwargs)[0]
            raise bad_value(
                "initialize",
                name,
                kwargs[name],
                "no keyword arguments beyond timeout, init_method, rank and world_size with "
                "backend 'horovod'",
            )
        if init_method not in (None, "env://"):
            raise bad_value(
                "initialize",
                "init_method",
                init_method,
                "None or 'env://' with backend 'horovod'",
                hint="horovodrun (or onedist.spawn('horovod', ...)) sets up Horovod's rendezvous itself",
            )
        expected_rank, expected_size = _launcher_rank_size()
        for arg, given, expected in (
            ("rank", rank, expected_rank),
            ("world_size", world_size, expected_size),
        ):
            if given is not None and given != expected:
                raise bad_value(
                    "initialize",
                    arg,
                    given,
                    f"None or {expected}, the value horovodrun gave this process",
                    hint="Horovod takes rank and world size from horovodrun; start N processes with "
                    "`horovodrun -np N ...` or onedist.spawn('horovod', fn, nproc_per_node=N)",
                )
        hvd = _hvd()
        env_set: dict[str, Optional[str]] = {}
        # process sets (groups) made after hvd.init(), by every rank
        if "HOROVOD_DYNAMIC_PROCESS_SETS" not in os.environ:
            set_env("HOROVOD_DYNAMIC_PROCESS_SETS", "1", env_set)
        try:
            hvd.init()
        except BaseException:
            restore_env(env_set)
            raise
        store = None
        try:
            if hvd.size() > 1:
                store = start_side_store(hvd, timeout)
            backend_ = cls(owned=True, env_set=env_set, store=store, timeout=timeout)
            backend_._share_cores()
            recorded_horovod.install(hvd)  # every hvd.* call on record (ONEDIST_RECORD=0: none)
            return backend_
        except BaseException:
            recorded_horovod.uninstall()
            hvd.shutdown()
            restore_env(env_set)
            raise

    def _share_cores(self) -> None:
        """Several ranks on this node and no OMP_NUM_THREADS (horovodrun sets none, unlike torchrun):
        give each rank its share of the cores. Each would otherwise use them all, beside Horovod's
        polling thread (on 2 cores with 2 ranks, the digits example trains 10x slower)."""
        ranks_here = self.layout().nproc_per_node
        cores = os.cpu_count() or 1
        if ranks_here < 2 or "OMP_NUM_THREADS" in os.environ or torch.get_num_threads() * ranks_here <= cores:
            return
        share = max(1, cores // ranks_here)
        self._threads = torch.get_num_threads()
        torch.set_num_threads(share)
        logger.info(
            "onedist: %d ranks on this node and no OMP_NUM_THREADS: torch uses %d thread(s) per rank "
            "(set OMP_NUM_THREADS to choose)",
            ranks_here,
            share,
        )

    def is_stale(self) -> bool:
        return not self.context_active()

    def finalize(self) -> None:
        try:
            if self._store is not None:
                self._keep_store_for_others()
            if self.owned:
                recorded_horovod.uninstall()
            if self._hvd.is_initialized():
                self._hvd.shutdown()
        finally:
            self._groups.clear()
            self._seq.clear()
            self._local_group, self._local_group_made = None, False
            self._store = None
            restore_env(self._env_set)
            if self._threads is not None:
                torch.set_num_threads(self._threads)
                self._threads = None

    # ------------------------------------------------------------------ queries
    def layout(self) -> Layout:
        if self._layout is None:
            hvd = self._hvd
            hint = Backend.local_rank_hint
            local_rank = int(hvd.local_rank()) if hint is None else hint
            self._layout = Layout(
                local_rank, int(hvd.local_size()), int(hvd.cross_rank()), int(hvd.cross_size())
            )
        return self._layout

    def reset_layout(self) -> None:
        self._layout = None
        self._device = None

    def device(self) -> torch.device:
        if self._device is None:
            self._device = _CPU
            if self._gpu_ops:
                from ..environments import gpu_index

                index = gpu_index(self.layout().local_rank, torch.cuda.device_count(), exclusive=False)
                if index is not None:
                    self._device = torch.device("cuda", index)
        return self._device

    def side_store(self) -> Any:
        return self._store

    # ------------------------------------------------------------------ groups
    def new_group(self, ranks: tuple[int, ...], **kwargs: Any) -> Any:
        if kwargs:
            name = sorted(kwargs)[0]
            raise bad_value("new_group", name, kwargs[name], "no keyword arguments with backend 'horovod'")
        if ranks == tuple(range(self.world_size)):
            return None
        group = self._groups.get(ranks)
        if group is None:
            group = self._groups[ranks] = self._add_process_set(ranks)
        return group

    def _add_process_set(self, ranks: tuple[int, ...]) -> Any:
        hvd = self._hvd
        if os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "0") in ("", "0"):
            raise OnedistRuntimeError(
                f"onedist.new_group: Horovod was initialised without dynamic process sets, so the group "
                f"{list(ranks)} cannot be created now\nHINT: let onedist initialise Horovod "
                "(onedist.initialize('horovod')), or call hvd.init(process_sets='dynamic') yourself"
            )
        try:
            return hvd.add_process_set(list(ranks))
        except ValueError:  # the user made a process set of these ranks already: use it
            from horovod.common.process_sets import ProcessSet, _basics

            for ps_id, ps_ranks in _basics._get_process_set_ids_and_ranks().items():
                if tuple(ps_ranks) == ranks:
                    ps = ProcessSet(list(ranks))
                    ps.process_set_id = ps_id
                    return ps
            raise

    def _check_group(self, group: Any) -> Any:
        from horovod.common.process_sets import ProcessSet

        if not isinstance(group, ProcessSet):
            raise bad_type(
                "collective",
                "group",
                group,
                "None, a list of global ranks, or a group from onedist.new_group (a horovod ProcessSet)",
            )
        return group

    def group_ranks(self, group: Any) -> tuple[int, ...]:
        if group is None:
            return tuple(range(self.world_size))
        return tuple(self._check_group(group).ranks)

    def group_rank(self, group: Any) -> int:
        if group is None:
            return self.rank
        ranks = self.group_ranks(group)
        return ranks.index(self.rank) if self.rank in ranks else -1

    def object_group(self, group: Any) -> Any:
        return group

    def local_group(self) -> Any:
        """Every rank must call it (it creates one process set per node, on every rank)."""
        if not self._local_group_made:
            layout = self.layout()
            if layout.nproc_per_node == self.world_size:
                self._local_group = self._hvd.global_process_set  # a group object, never None
            else:
                import hashlib

                digest = hashlib.blake2b(socket.gethostname().encode(), digest_size=7).digest()
                keys = torch.tensor([int.from_bytes(digest, "little")], dtype=torch.int64)
                gathered = torch.empty(self.world_size, dtype=torch.int64)
                self.all_gather_into_(gathered, keys, None, False)
                nodes = gathered.tolist()
                order = list(dict.fromkeys(nodes))  # nodes in the order of their first rank
                for node in order:  # the same process sets, in the same order, on every rank
                    group = self.new_group(tuple(r for r, n in enumerate(nodes) if n == node))
                    if node == nodes[self.rank]:
                        self._local_group = group
            self._local_group_made = True
        return self._local_group

    # ------------------------------------------------------------------ primitives
    def comm_device(self, device: torch.device, op: str) -> torch.device:
        if device.type == "cuda" and self._gpu_ops and op not in ("send", "recv"):
            return device
        return _CPU

    def reduce_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if dtype in _REDUCE_DTYPES or dtype.is_complex:
            return dtype
        wire = _WIDEN.get(dtype)
        if wire is None:
            raise OnedistTypeError(
                f"onedist: Horovod cannot reduce tensors of dtype {dtype} (it reduces "
                f"{', '.join(sorted(str(d) for d in _REDUCE_DTYPES))}; onedist widens "
                f"{', '.join(str(d) for d in _WIDEN)})\n"
                "HINT: convert first, e.g. t.to(torch.int64) or t.float()"
            )
        return wire

    def _ps(self, group: Any) -> Any:
        if group is None:
            return self._hvd.global_process_set
        return self._check_group(group)

    def _name(self, ps: Any, what: str, async_op: bool) -> str:
        """The name every member gives this operation (Horovod matches operations by name).

        A synchronous operation is named after what it does (``what``: kind, dtype, size, op,
        root): the same name on every member, and the same name for the same operation next time,
        which Horovod's response cache then answers without a negotiation round (about 4x faster
        here). No two of this rank's operations with one name are in flight at once: a synchronous
        one is done before the next starts. Asynchronous ones may overlap, so they are numbered
        per group (every member issues the same sequence).
        """
        ps_id = int(ps.process_set_id)
        if async_op:
            n = self._seq.get(ps_id, 0)
            self._seq[ps_id] = n + 1
            self._last_name = f"onedist.{ps_id}.{what}#{n}"
        else:
            self._last_name = f"onedist.{ps_id}.{what}"
        return self._last_name

    def _done(
        self, handles: list[int], finish: Optional[Callable[[list[Any]], None]], async_op: bool
    ) -> Optional[Work]:
        work = _HorovodWork(self._hvd, handles, finish, self._timeout, self._last_name)
        if async_op:
            return work
        work.wait()
        return None

    def all_reduce_(self, t: torch.Tensor, op: str, group: Any, async_op: bool) -> Optional[Work]:
        if op in _BITWISE:
            return self._bitwise_all_reduce(t, op, group, async_op)
        ps = self._ps(group)
        buf = torch.view_as_real(t) if t.is_complex() else t
        if buf.dtype not in _REDUCE_DTYPES:
            self.reduce_dtype(buf.dtype)  # raises for dtypes nothing can widen
            raise OnedistTypeError(
                f"onedist: Horovod reduces {buf.dtype} as {self.reduce_dtype(buf.dtype)}; convert before the "
                "primitive (onedist.all_reduce does)"
            )
        hvd = self._hvd
        name = self._name(ps, f"ar.{op}.{buf.dtype}.{buf.numel()}", async_op)
        handle = hvd.allreduce_async_(buf, name=name, op=getattr(hvd, _HVD_OPS[op]), process_set=ps)
        return self._done([handle], None, async_op)

    def _bitwise_all_reduce(self, t: torch.Tensor, op: str, group: Any, async_op: bool) -> Optional[Work]:
        """AND / OR: gather every rank's values, combine them here (Horovod has no bitwise reduction)."""
        ps = self._ps(group)
        size = len(self.group_ranks(group))
        src = _movable(t).reshape(1, -1)
        width = src.shape[1]
        name = self._name(ps, f"ag.{src.dtype}.{width}", async_op)
        handle = self._hvd.allgather_async(src, name=name, process_set=ps)
        combine = _BITWISE[op]

        def finish(outputs: list[Any]) -> None:
            rows = outputs[0].view(size, width)
            if rows.dtype != t.dtype:
                rows = rows.view(t.dtype)
            out = rows[0].clone()
            for row in rows[1:]:
                combine(out, row, out=out)
            t.view(-1).copy_(out)

        return self._done([handle], finish, async_op)

    def reduce_(self, t: torch.Tensor, dst: int, op: str, group: Any, async_op: bool) -> Optional[Work]:
        # every rank gets the result; the API leaves the other ranks' buffers undefined
        return self.all_reduce_(t, op, group, async_op)

    def broadcast_(self, t: torch.Tensor, src: int, group: Any, async_op: bool) -> Optional[Work]:
        ps = self._ps(group)
        buf = _movable(t)
        name = self._name(ps, f"bc.{src}.{buf.dtype}.{buf.numel()}", async_op)
        handle = self._hvd.broadcast_async_(buf, root_rank=src, name=name, process_set=ps)
        return self._done([handle], None, async_op)

    def all_gather_into_(
        self, out: torch.Tensor, t: torch.Tensor, group: Any, async_op: bool
    ) -> Optional[Work]:
        ps = self._ps(group)
        buf = _movable(t)
        name = self._name(ps, f"ag.{buf.dtype}.{buf.numel()}", async_op)
        handle = self._hvd.allgather_async(buf, name=name, process_set=ps)

        def finish(outputs: list[Any]) -> None:
            _movable(out).copy_(outputs[0])

        return self._done([handle], finish, async_op)

    def all_to_all_single_(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: Any,
        async_op: bool,
    ) -> Optional[Work]:
        ps = self._ps(group)
        src = _movable(inp)
        scale = 1 if inp.dtype in _MOVE_DTYPES else inp.element_size()  # byte view: splits in bytes
        splits = torch.tensor([s * scale for s in in_splits], dtype=torch.int32)
        # sizes differ per rank: the name must not depend on them
        name = self._name(ps, f"a2a.{src.dtype}", async_op)
        handle = self._hvd.alltoall_async(src, splits=splits, name=name, process_set=ps)

        def finish(outputs: list[Any]) -> None:
            received = outputs[0][0]
            _movable(out).copy_(received)

        return self._done([handle], finish, async_op)

    def barrier_(self, group: Any, async_op: bool) -> Optional[Work]:
        ps = self._ps(group)
        if not async_op and self._timeout is None:
            self._hvd.barrier(process_set=ps)
            return None
        token = torch.zeros(1, dtype=torch.int32)
        name = self._name(ps, "barrier", async_op)
        handle = self._hvd.allreduce_async_(token, name=name, op=self._hvd.Sum, process_set=ps)
        return self._done([handle], None, async_op)


# ============================================================================ helpers
def _launcher_rank_size() -> tuple[int, int]:
    """The rank and world size Horovod will have: horovodrun's, or 0 of 1 for a plain process.

    A process started by another launcher (torchrun, ``onedist run``, srun, mpirun without an MPI
    build of Horovod) cannot join a Horovod job: say so now instead of training N separate runs.
    """
    from ..environments import detect_cluster

    env = detect_cluster(os.environ)
    if env is None:
        return 0, 1
    if env.name == "horovod":
        return env.rank, env.world_size
    if env.name == "torchelastic" and not ({"TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE"} & set(os.environ)):
        # RANK/WORLD_SIZE alone: set by hand or left by other code, not a launcher's (torchrun and
        # onedist run set these two as well). Horovod ignores them, as ignite does: a world of one.
        logger.warning(
            "onedist.initialize: backend='horovod' ignores RANK=%s and WORLD_SIZE=%s (no launcher set "
            "them): this process is a Horovod world of one; horovodrun starts a Horovod job",
            env.rank,
            env.world_size,
        )
        return 0, 1
    mpi = env.name in ("openmpi", "mvapich", "mpich")
    if env.world_size > 1 and not (mpi and _hvd().mpi_built()):
        raise OnedistValueError(
            f"onedist.initialize: backend='horovod' in a process started by {env.name} (rank {env.rank} of "
            f"{env.world_size}); Horovod only joins processes that horovodrun (or horovod.run) started, so "
            "each process would train alone\nHINT: `horovodrun -np N -H localhost:N python script.py`, "
            "od.Parallel(backend='horovod', nproc_per_node=N), or backend='gloo' under this launcher"
        )
    return (env.rank, env.world_size) if mpi else (0, 1)
