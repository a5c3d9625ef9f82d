"""The torch.distributed backend: gloo, nccl and mpi process groups.

Everything gloo/nccl-specific lives here: which device a collective runs on (the
torch.distributed capability table), which dtypes gloo cannot reduce, the gloo side group that
carries objects when the backend is nccl, NCCL's ``device_ids`` for barriers.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from .._net import discard_store_fd
from .._torch_plugin import register_torch_backends
from ..environments import PartialLayout, gpu_index, layout_from_environ
from ..errors import OnedistRuntimeError, bad_value
from . import _gloo_threads
from ._connections import break_connections, socket_fds
from ._environ import restore_env
from ._rendezvous import check_tcp_host, env_store, prepare_env_rendezvous, rank_world_from_env
from .interface import NATIVE_REDUCE_DTYPES, Backend, Layout, Work
from .mpi import installed as mpi4py_installed
from .recorded import gloo as recorded_gloo
from .recorded.calls import CallLog

__all__ = ["NativeBackend"]

logger = logging.getLogger("onedist")

_REDUCE_OPS = {
    "SUM": dist.ReduceOp.SUM,
    "PRODUCT": dist.ReduceOp.PRODUCT,
    "MIN": dist.ReduceOp.MIN,
    "MAX": dist.ReduceOp.MAX,
    "AND": dist.ReduceOp.BAND,
    "OR": dist.ReduceOp.BOR,
}

# gloo has no reduction kernels for these; a wider type gives the same result after the cast back
# (two's-complement sums/products wrap identically; order is preserved for MIN/MAX).
_GLOO_REDUCE_DTYPES = {
    torch.int16: torch.int32,
    torch.uint16: torch.int32,
    torch.uint32: torch.int64,
}


# ops whose CUDA tensors gloo accepts (torch.distributed capability table); others go through CPU
_GLOO_CUDA_OPS = frozenset({"all_reduce", "broadcast"})

_MPI4PY = "mpi4py"  # torch's name of onedist's mpi4py process group (backends/mpi.py)

_NODE_KEY = "onedist/node/{}"
_NODE_WAIT_WARN_S = 10.0
_INIT_SCHEMES = ("env://", "tcp://", "file://")


def _default_store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # MPI groups have no store; private API may move
        return None


def _store_port() -> int:
    """The port of the TCP store under the default group's (prefix) store, whatever made it
    (``env://``, ``tcp://``, a launcher's agent store, the user's own); else ``MASTER_PORT``'s."""
    store = _default_store()
    while store is not None and hasattr(store, "underlying_store"):  # PrefixStore(s) around it
        store = store.underlying_store
    port = getattr(store, "port", None)
    return port if isinstance(port, int) else int(os.environ.get("MASTER_PORT", "-1") or -1)


class NativeBackend(Backend):
    """A torch.distributed default process group (created by onedist or by the user)."""

    model_name = "native-dist"
    external_origin = "your code (torch.distributed.init_process_group)"

    def __init__(self, owned: bool, env_set: Optional[dict[str, Optional[str]]] = None) -> None:
        world = dist.distributed_c10d._get_default_group()
        name = str(dist.get_backend())
        # onedist's mpi4py process group is torch's "mpi4py" ("mpi" is the built-in's name); users
        # asked for, and onedist.backend() reports, "mpi"
        super().__init__("mpi" if name == _MPI4PY else name, dist.get_rank(), dist.get_world_size())
        self.name = name  # torch's backend string, never None here
        self._world = world
        #: True when onedist created the default group (initialize / spawn)
        self.owned = owned
        #: environment variables onedist set, with their previous values, restored by finalize
        self._env_set = env_set or {}
        #: the init_method onedist initialised with (None for a group made outside onedist)
        self.init_method: Optional[str] = None
        #: the sockets made with the default group, which break_pending shuts down (none known
        #: for a group made outside onedist)
        self._group_fds: frozenset[int] = frozenset()
        self._groups: dict[Any, Any] = {}
        self._object_groups: dict[Any, Any] = {}
        self._group_ranks: dict[Any, tuple[int, ...]] = {}
        self._layout: Optional[Layout] = None
        self._nodes: Optional[list[str]] = None
        self._device: Optional[torch.device] = None
        self._local_group: Any = None
        self._local_group_made = False
        self._nccl = "nccl" in name and "gloo" not in name
        if not self._nccl:
            self.cpu_reduce_dtypes = NATIVE_REDUCE_DTYPES
        self._env_layout = layout_from_environ(os.environ, self.rank, self.world_size)
        log = getattr(world, "calls", None)
        if isinstance(log, CallLog):
            log.default = True
        _gloo_threads.install_exit_hook()  # gloo threads go idle before the interpreter finalizes
        self._publish_node_key()
        dev = self.device()
        if dev.type == "cuda":
            torch.cuda.set_device(dev)

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def available_backends(cls) -> tuple[str, ...]:
        if not dist.is_available():
            return ()
        names = []
        if dist.is_gloo_available():
            names.append("gloo")
        if dist.is_nccl_available() and torch.cuda.is_available():
            names.append("nccl")
        if dist.is_mpi_available() or mpi4py_installed():
            names.append("mpi")
        if dist.is_gloo_available():
            from .shm import supported

            if supported():
                names.append("shm")
        return tuple(names)

    @classmethod
    def context_active(cls) -> bool:
        return dist.is_available() and dist.is_initialized()

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
        init_method = init_method or "env://"
        if not isinstance(init_method, str) or not init_method.startswith(_INIT_SCHEMES):
            raise bad_value(
                "initialize", "init_method", init_method, "a URL starting with " + ", ".join(_INIT_SCHEMES)
            )
        env_set: dict[str, Optional[str]] = {}
        if init_method.startswith("env://"):
            prepare_env_rendezvous(rank, world_size, env_set)
        else:
            rank, world_size = rank_world_from_env(rank, world_size)
            if init_method.startswith("tcp://") and rank == 0:
                check_tcp_host(init_method)
        if backend == "mpi" and not dist.is_mpi_available():
            from .mpi import prepare_environment

            prepare_environment()  # before anything starts MPI
            backend = _MPI4PY  # stock wheels: onedist's process group over mpi4py
        if backend in ("shm", _MPI4PY):
            register_torch_backends()  # torch did at import, unless TORCH_DEVICE_BACKEND_AUTOLOAD=0
        torch_name = backend
        if backend == "gloo" and recorded_gloo.enabled():  # every call on record (recorded/gloo.py)
            recorded_gloo.register()
            torch_name = recorded_gloo.NAME
        try:
            store = None
            fds_before = socket_fds()
            if init_method == "env://" and "store" not in kwargs and backend != "mpi":
                store, rank, world_size = env_store(backend, timeout, rank, world_size, env_set)
            if store is not None:
                assert rank is not None and world_size is not None
                dist.init_process_group(
                    torch_name, store=store, timeout=timeout, rank=rank, world_size=world_size, **kwargs
                )
            else:
                dist.init_process_group(
                    torch_name,
                    init_method=init_method,
                    timeout=timeout,
                    rank=-1 if rank is None else rank,
                    world_size=-1 if world_size is None else world_size,
                    **kwargs,
                )
        except BaseException:
            restore_env(env_set)
            discard_store_fd(os.environ)
            raise
        if torch_name != backend:
            recorded_gloo.rename_in_torch()
        made = cls(owned=True, env_set=env_set)
        made.init_method = init_method
        made._group_fds = socket_fds() - fds_before  # the store's client and gloo's connections
        return made

    def is_stale(self) -> bool:
        return dist.distributed_c10d.GroupMember.WORLD is not self._world

    def break_pending(self) -> bool:
        if self.name == _MPI4PY:  # MPI's own connections: only ULFM can break its calls
            from .mpi import revoke_all

            return revoke_all()
        # the store's connections stay: the verdict that explains the break travels there
        fds = self._group_fds | recorded_gloo.connection_fds()  # the groups made with dist.new_group too
        broken = break_connections(fds, keep_port=_store_port()) > 0
        if self.name == "shm":  # shared memory has no connection: the group's mark ends the waits
            self._world.abort()
            broken = True
        return broken

    def break_tells_peers(self) -> bool:
        return self.name == _MPI4PY

    def finalize(self) -> None:
        try:
            if dist.is_initialized() and dist.distributed_c10d._get_default_group() is self._world:
                dist.destroy_process_group()
        finally:
            self._groups.clear()
            self._object_groups.clear()
            self._group_ranks.clear()
            restore_env(self._env_set)
        _gloo_threads.settle()  # threads of groups that DDP still holds (see _gloo_threads)

    # ------------------------------------------------------------------ queries
    def layout(self) -> Layout:
        if self._layout is None:
            part = self._env_layout
            hint = Backend.local_rank_hint
            if hint is not None:
                part = PartialLayout(hint, part.nproc_per_node, part.node_rank, part.nnodes)
            if part.complete():
                self._layout = Layout(part.local_rank, part.nproc_per_node, part.node_rank, part.nnodes)  # type: ignore[arg-type]
            else:
                self._layout = self._layout_from_nodes(part)
        return self._layout

    def reset_layout(self) -> None:
        self._layout = None
        self._device = None

    def _layout_from_nodes(self, part: PartialLayout) -> Layout:
        nodes = self._node_list()
        mine = nodes[self.rank]
        order = list(dict.fromkeys(nodes))  # node keys in order of their first rank
        from_nodes = Layout(
            local_rank=nodes[: self.rank].count(mine),
            nproc_per_node=nodes.count(mine),
            node_rank=order.index(mine),
            nnodes=len(order),
        )
        return Layout(
            from_nodes.local_rank if part.local_rank is None else part.local_rank,
            from_nodes.nproc_per_node if part.nproc_per_node is None else part.nproc_per_node,
            from_nodes.node_rank if part.node_rank is None else part.node_rank,
            from_nodes.nnodes if part.nnodes is None else part.nnodes,
        )

    def _node_key(self) -> str:
        if self._env_layout.node_rank is not None:
            return f"node-rank:{self._env_layout.node_rank}"
        return f"host:{socket.gethostname()}"

    def _publish_node_key(self) -> None:
        store = _default_store()
        if store is not None:
            store.set(_NODE_KEY.format(self.rank), self._node_key())

    def _node_list(self) -> list[str]:
        """Every rank's node key, published by each rank when its backend object was created.

        Reading them needs no collective: a rank that asks for its local rank alone does not
        block the others. Only ranks that never touched onedist are waited for.
        """
        if self._nodes is None:
            store = _default_store()
            if store is None:
                gathered: list[Any] = [None] * self.world_size
                dist.all_gather_object(gathered, self._node_key())
                self._nodes = [str(g) for g in gathered]
            else:
                keys = [_NODE_KEY.format(r) for r in range(self.world_size)]
                self._wait_keys(store, keys)
                self._nodes = [v.decode() for v in store.multi_get(keys)]
        return self._nodes

    def _wait_keys(self, store: Any, keys: list[str]) -> None:
        try:
            store.wait(keys, timedelta(seconds=_NODE_WAIT_WARN_S))
            return
        except Exception:
            pass
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        logger.warning(
            "onedist: rank %d is waiting for ranks %s to publish their node; a rank publishes it "
            "on its first onedist call after the process group exists. Call onedist.sync() on every "
            "rank, or set LOCAL_RANK/LOCAL_WORLD_SIZE/GROUP_RANK/GROUP_WORLD_SIZE.",
            self.rank,
            missing,
        )
        start = time.monotonic()
        timeout = store.timeout
        try:
            store.wait(keys, timeout)
        except Exception as e:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            raise OnedistRuntimeError(
                f"onedist: ranks {missing} did not publish their node within "
                f"{time.monotonic() - start + _NODE_WAIT_WARN_S:.0f} s, so the local rank / node "
                "layout of this process cannot be computed.\n"
                "HINT: call any onedist function (e.g. onedist.sync()) on every rank after "
                "init_process_group, or set LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK and "
                "GROUP_WORLD_SIZE (torchrun and onedist.spawn do)."
            ) from e

    def device(self) -> torch.device:
        if self._device is None:
            self._device = torch.device("cpu")
            uses_cuda = "nccl" in self.name or (self.name == "gloo" and torch.cuda.is_available())
            if uses_cuda and torch.cuda.is_available():
                count = torch.cuda.device_count()
                layout = self.layout()
                local_rank = layout.local_rank
                # Without CUDA_VISIBLE_DEVICES every process of the node sees the same GPUs;
                # with it, each may see its own (per-task binding)
                sharing = 1 if os.environ.get("CUDA_VISIBLE_DEVICES") else layout.nproc_per_node
                index = gpu_index(local_rank, count, exclusive=self._nccl, sharing=sharing)
                if index is None:
                    raise OnedistRuntimeError(
                        f"onedist: local rank {local_rank} has no GPU of its own: this node shows "
                        f"{count} GPU(s) to {layout.nproc_per_node} processes, and NCCL cannot put two "
                        "ranks on one GPU.\n"
                        "HINT: start at most one process per GPU (nproc_per_node <= GPUs), give each "
                        "process its own GPU (CUDA_VISIBLE_DEVICES per task, srun --gpus-per-task=1), "
                        "or use backend 'gloo'."
                    )
                if local_rank >= count > 1:
                    logger.warning(
                        "onedist: local rank %d shares cuda:%d (%d GPUs visible)", local_rank, index, count
                    )
                self._device = torch.device("cuda", index)
        return self._device

    # ------------------------------------------------------------------ groups
    def side_store(self) -> Any:
        return _default_store()

    def call_log(self) -> Any:
        return getattr(self._world, "calls", None) if self.owned else None

    def new_group(self, ranks: tuple[int, ...], **kwargs: Any) -> Any:
        key = (ranks, tuple(sorted(kwargs.items())))
        if key in self._groups:
            return self._groups[key]
        if not kwargs and ranks == tuple(range(self.world_size)):
            group = None
        elif self.rank not in ranks and (
            kwargs.get("use_local_synchronization", True) and self.name != "mpi"
        ):
            # torch returns None to non-members here, which would read as "the whole world"
            group = dist.GroupMember.NON_GROUP_MEMBER
        else:
            if "use_local_synchronization" not in kwargs and self.name != "mpi":
                # only members take part in creating it, so a group used by its members only
                # (e.g. a collective inside `if rank in ranks`) does not deadlock
                kwargs = {**kwargs, "use_local_synchronization": True}
            fds_before = socket_fds()
            recorded = isinstance(self._world, recorded_gloo.RecordedGloo) and "backend" not in kwargs
            if recorded:  # onedist's sub-groups are on record too
                kwargs = {**kwargs, "backend": recorded_gloo.NAME}
            if kwargs.get("use_local_synchronization"):
                group = _new_local_group(ranks, kwargs)
            else:
                group = dist.new_group(list(ranks), **kwargs)
            if recorded:
                recorded_gloo.rename_in_torch(group)
            self._group_fds |= socket_fds() - fds_before  # its connections, for break_pending
        self._groups[key] = group
        return group

    def group_ranks(self, group: Any) -> tuple[int, ...]:
        if group is None:
            return tuple(range(self.world_size))
        ranks = self._group_ranks.get(group)
        if ranks is None:
            if group is dist.GroupMember.NON_GROUP_MEMBER:
                return ()
            ranks = tuple(dist.get_process_group_ranks(group))
            self._group_ranks[group] = ranks
        return ranks

    def group_rank(self, group: Any) -> int:
        if group is None:
            return self.rank
        if group is dist.GroupMember.NON_GROUP_MEMBER:
            return -1
        return dist.get_rank(group)

    def object_group(self, group: Any) -> Any:
        if not self._nccl:
            return group
        if group not in self._object_groups:
            kwargs: dict[str, Any] = {"backend": "gloo"}
            if group is not None:
                kwargs["use_local_synchronization"] = True
            ranks = list(self.group_ranks(group))
            self._object_groups[group] = dist.new_group(ranks, **kwargs)
        return self._object_groups[group]

    def local_group(self) -> Any:
        if not self._local_group_made:
            nodes = self._node_list()
            mine = nodes[self.rank]
            ranks = tuple(r for r, n in enumerate(nodes) if n == mine)
            # a group object even when it is every rank (detectron2's callers pass it to torch)
            self._local_group = self.new_group(ranks) or dist.group.WORLD
            self._local_group_made = True
        return self._local_group

    # ------------------------------------------------------------------ primitives
    def comm_device(self, device: torch.device, op: str) -> torch.device:
        if self._nccl:
            return device if device.type == "cuda" else self.device()
        if (
            device.type == "cpu"
            or self.name == _MPI4PY
            or (self.backend == "gloo" and op not in _GLOO_CUDA_OPS)
        ):
            return _CPU
        return device

    def reduce_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if self._nccl:
            return dtype
        wire = _GLOO_REDUCE_DTYPES.get(dtype, dtype)
        if wire not in NATIVE_REDUCE_DTYPES and not wire.is_complex:
            from ..errors import OnedistTypeError

            raise OnedistTypeError(
                f"onedist: gloo cannot reduce tensors of dtype {dtype} (it reduces "
                f"{', '.join(sorted(str(d) for d in NATIVE_REDUCE_DTYPES))}, and onedist widens int16, "
                "uint16 and uint32)\nHINT: convert first, e.g. t.to(torch.int64) or t.float()"
            )
        return wire

    # A synchronous all_reduce_, broadcast_ or all_gather_into_ on the default group of a real (not
    # complex) tensor calls the process group's own method (options made once): what
    # torch.distributed's function does after its checks, which onedist has made. That function's
    # Python (a new options object included) is ~16 us of a world-1 gloo all_reduce (60 -> 44 us),
    # and counts several times over between two ranks on busy cores. Every other call takes
    # torch.distributed's function.
    def all_reduce_(self, t: torch.Tensor, op: str, group: Any, async_op: bool) -> Optional[Work]:
        # dist.all_reduce takes 1.08x this call's time for od.all_reduce of 1 float32 and of a Python
        # float (gloo, 2 ranks, 5 interleaved runs of bench_handwritten's timing, 2026-11-28)
        if group is None and not t.is_complex():
            work = self._world.allreduce([t], _reduce_options(op, async_op))
            if async_op:  # its wait() comes later, outside onedist's guard (a group on record
                return work  # gives one that explains a failure: the options say asynchronous)
            work.wait()
            return None
        return dist.all_reduce(t, op=_REDUCE_OPS[op], group=group, async_op=async_op)  # type: ignore[no-any-return]

    def reduce_(self, t: torch.Tensor, dst: int, op: str, group: Any, async_op: bool) -> Optional[Work]:
        return dist.reduce(t, dst, op=_REDUCE_OPS[op], group=group, async_op=async_op)  # type: ignore[no-any-return]

    def broadcast_(self, t: torch.Tensor, src: int, group: Any, async_op: bool) -> Optional[Work]:
        # dist.broadcast takes 1.06x this call's time for od.broadcast_object of a small dict (11
        # interleaved runs of 60-150 rounds, 2026-11-28: 0.94-1.18 each, the A/A pair 1.00)
        if group is None and not async_op and not t.is_complex():
            self._world.broadcast([t], _broadcast_options(src)).wait()
            return None
        return dist.broadcast(t, src, group=group, async_op=async_op)  # type: ignore[no-any-return]

    def all_gather_into_(
        self, out: torch.Tensor, t: torch.Tensor, group: Any, async_op: bool
    ) -> Optional[Work]:
        # dist.all_gather_single takes 1.04x this call's time for od.all_gather of 1 float32, 1.02x
        # for a small object's (10 and 7 interleaved runs, 2026-11-28). The process group's public
        # all_gather_single with its default options took 1.07x in bench_handwritten (two runs
        # each: 1.07/1.07x raw against 1.02/1.01x), so the private name of torch's own call stays
        if group is None and not async_op and not t.is_complex():
            self._world._allgather_base(out, t, _allgather_options()).wait()
            return None
        return _all_gather_single(out, t, group=group, async_op=async_op)  # type: ignore[no-any-return]

    def all_to_all_single_(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: Any,
        async_op: bool,
    ) -> Optional[Work]:
        return dist.all_to_all_single(  # type: ignore[no-any-return]
            out,
            inp,
            output_split_sizes=out_splits,
            input_split_sizes=in_splits,
            group=group,
            async_op=async_op,
        )

    def all_gather_uneven_(
        self, out: torch.Tensor, block: torch.Tensor, sizes: list[int], group: Any, async_op: bool
    ) -> Optional[list[Work]]:
        # the shm backend has one: its slots take blocks of any size (all_to_all needs each block
        # once per peer; send/recv go through its gloo group)
        pg = dist.group.WORLD if group is None else group
        gather = getattr(pg, "all_gather_uneven", None)
        work = gather(out, block, sizes) if gather is not None else None
        if work is None:
            return None
        if async_op:
            return [work]
        work.wait()
        return []

    def barrier_(self, group: Any, async_op: bool) -> Optional[Work]:
        if self._nccl:
            dev = self.device()
            return dist.barrier(group=group, async_op=async_op, device_ids=[dev.index])  # type: ignore[no-any-return]
        return dist.barrier(group=group, async_op=async_op)  # type: ignore[no-any-return]

    def send_(self, t: torch.Tensor, dst: int, group: Any, tag: int, async_op: bool) -> Optional[Work]:
        if async_op:
            return dist.isend(t, dst, group=group, tag=tag)
        dist.send(t, dst, group=group, tag=tag)
        return None

    def recv_(self, t: torch.Tensor, src: Optional[int], group: Any, tag: int, async_op: bool) -> Any:
        if async_op:
            return dist.irecv(t, src, group=group, tag=tag)
        return dist.recv(t, src, group=group, tag=tag)


_CPU = torch.device("cpu")
# torch >= 2.13 renamed all_gather_into_tensor (which now warns) to all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@functools.cache
def _reduce_options(op: str, async_op: bool = False) -> Any:
    opts = dist.AllreduceOptions()
    opts.reduceOp = _REDUCE_OPS[op]  # type: ignore[assignment]  # a RedOpType, as torch's own
    return _synchronous(opts, async_op)


def _synchronous(opts: Any, async_op: bool = False) -> Any:
    """``opts`` saying whether the caller waits at once (torch >= 2.7's ``asyncOp``, as torch's
    functions set it): a group on record then returns gloo's own work, not one that explains."""
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = async_op
    return opts


@functools.cache
def _broadcast_options(src: int) -> Any:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = src, 0  # the default group: group rank == global rank
    return _synchronous(opts)


@functools.cache
def _allgather_options() -> Any:
    from torch._C._distributed_c10d import AllgatherOptions  # not re-exported by torch.distributed

    return _synchronous(AllgatherOptions())


def _new_local_group(ranks: tuple[int, ...], kwargs: dict[str, Any]) -> Any:
    """``dist.new_group(ranks, use_local_synchronization=True)`` with a name every member agrees on.

    torch names such a group sha1(ranks + the number of groups *this process* has), so members that
    made different groups before ([0,1] on ranks 0-1, then [0,2]: rank 0 has seen 2 groups, rank 2
    one) pick different names, rendezvous under different store keys and wait forever. The name here
    depends only on the ranks and options (what every member passes), and on how many groups with
    exactly these ranks and options this process made before (the same on every member).
    """
    c10d: Any = dist.distributed_c10d
    original = getattr(c10d, "_process_group_name", None)
    if original is None:  # a torch without the hook: its own naming
        return dist.new_group(list(ranks), **kwargs)
    prefix = _group_prefix(ranks, kwargs)
    same = sum(1 for name in c10d._world.pg_names.values() if str(name).startswith(prefix))
    name = f"{prefix}{same}"

    def fixed_name(ranks_: Any, use_hashed_name: bool) -> Any:
        return name if use_hashed_name else original(ranks_, use_hashed_name)

    c10d._process_group_name = fixed_name
    try:
        return dist.new_group(list(ranks), **kwargs)
    finally:
        c10d._process_group_name = original


def _group_prefix(ranks: tuple[int, ...], kwargs: dict[str, Any]) -> str:
    import hashlib

    options = repr(sorted((k, repr(v)) for k, v in kwargs.items()))
    digest = hashlib.sha1(f"{ranks}|{options}".encode(), usedforsecurity=False).hexdigest()[:16]
    return f"onedist-{digest}-"
