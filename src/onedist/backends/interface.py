"""The interface every backend implements: a few primitives on ready, flat tensors.

A backend never sees a Python number, string or dict: :mod:`onedist.collectives` turns those
into contiguous tensors on :meth:`Backend.comm_device` first, and back afterwards. Primitives work
in place, like torch.distributed's, and return a work handle when ``async_op`` is true.

Groups: ``group=None`` is the whole world; anything else is the handle that
:meth:`Backend.new_group` returned. ``src``/``dst`` ranks are global ranks.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Any, ClassVar, NamedTuple, Optional, Protocol

import torch

__all__ = ["NATIVE_REDUCE_DTYPES", "Backend", "Layout", "Work"]

#: dtypes every CPU communication library here reduces without conversion (gloo's set)
NATIVE_REDUCE_DTYPES = frozenset(
    {
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.uint8,
        torch.int8,
        torch.int32,
        torch.int64,
        torch.bool,
    }
)


class Work(Protocol):
    """What an asynchronous primitive returns (torch.distributed's ``Work`` fits)."""

    def wait(self) -> Any: ...


class Layout(NamedTuple):
    """Where a process sits: its local rank, its node's size, its node, and the node count."""

    local_rank: int
    nproc_per_node: int
    node_rank: int
    nnodes: int


class Backend(ABC):
    """One computation model (serial, torch.distributed, Horovod, XLA).

    Subclasses set :attr:`model_name` and implement the abstract methods. The class methods are
    the registry's entry points; instances are created only through them.
    """

    #: the name :func:`onedist.model_name` reports ("serial", "native-dist", ...)
    model_name: ClassVar[str]
    #: a local rank given by :func:`onedist.set_local_rank`; wins over every other source
    local_rank_hint: ClassVar[Optional[int]] = None
    #: CPU tensors of these dtypes reduce as they are (no move, no widening): the collectives'
    #: fast path skips every routing question for them
    cpu_reduce_dtypes: frozenset[torch.dtype] = frozenset()
    #: send/recv carry bulk data well: large uneven gathers then go over concurrent isend/irecv
    #: with every peer (False where point-to-point is emulated, e.g. Horovod's: all_to_all instead)
    p2p_bulk: ClassVar[bool] = True
    #: who made a context this class wraps but onedist did not create (for error messages)
    external_origin: ClassVar[str] = "your code"

    def __init__(self, backend: Optional[str], rank: int, world_size: int) -> None:
        #: the backend name :func:`onedist.backend` reports (``None`` when serial)
        self.backend = backend
        self.rank = rank
        self.world_size = world_size

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    @abstractmethod
    def available_backends(cls) -> tuple[str, ...]:
        """Backend names this class can initialise on this machine."""

    @classmethod
    @abstractmethod
    def context_active(cls) -> bool:
        """Cheap check (no collective, no import) for a context created outside onedist."""

    @classmethod
    @abstractmethod
    def create_from_context(cls) -> Optional[Backend]:
        """Wrap a context created outside onedist, or return None when there is none."""

    @classmethod
    @abstractmethod
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
        """Create the context (e.g. ``init_process_group``) and wrap it."""

    @abstractmethod
    def is_stale(self) -> bool:
        """True when the context this object wraps is gone or replaced (cheap)."""

    @abstractmethod
    def finalize(self) -> None:
        """Destroy the context and every group created through this object."""

    # ------------------------------------------------------------------ queries
    @abstractmethod
    def layout(self) -> Layout:
        """Local rank, processes on this node, node rank and node count."""

    @abstractmethod
    def device(self) -> torch.device:
        """The device this process computes on."""

    def reset_layout(self) -> None:
        """Forget a cached layout and device (after :func:`onedist.set_local_rank`)."""

    # ------------------------------------------------------------------ groups
    @abstractmethod
    def new_group(self, ranks: tuple[int, ...], **kwargs: Any) -> Any:
        """The group of these (validated, sorted, unique) global ranks; cached per ranks and kwargs."""

    @abstractmethod
    def group_ranks(self, group: Any) -> tuple[int, ...]:
        """Global ranks of ``group`` in group-rank order (``group=None``: the world)."""

    @abstractmethod
    def group_rank(self, group: Any) -> int:
        """This process's rank in ``group``, or -1 when it is not a member."""

    def break_pending(self) -> bool:
        """Make the collective this process waits in fail at once, on this rank and its peers,
        losing the group (onedist calls it only once the ranks are known to wait in different
        collectives). False when the backend cannot: the caller then ends the process instead."""
        return False

    def break_tells_peers(self) -> bool:
        """True when :meth:`break_pending` makes the peers' pending calls raise an error that says
        why (mpi4py's revoked communicator), so the watcher breaks first and explains after."""
        return False

    @abstractmethod
    def object_group(self, group: Any) -> Any:
        """The group to send CPU byte tensors on (a gloo side group when the backend is GPU-only)."""

    @abstractmethod
    def local_group(self) -> Any:
        """The group of the ranks on this node."""

    # ------------------------------------------------------------------ training objects
    #: how auto_model makes the ranks' models one: "ddp", DistributedDataParallel over this
    #: backend's default process group (built by the training layer, onedist.training.ddp);
    #: "own", this backend's :meth:`prepare_model` (e.g. rank 0's weights broadcast, and the
    #: optimizer of :meth:`wrap_optimizer` averaging the gradients)
    model_parallelism = "ddp"
    #: True when ``auto_model(sync_bn=True)`` should convert BatchNorm layers to onedist's
    #: SyncBatchNorm before :meth:`prepare_model` (a backend without a SyncBatchNorm of its own)
    sync_bn_by_onedist = False

    def prepare_model(
        self, model: torch.nn.Module, sync_bn: bool, hooks: dict[str, Any], ddp_kwargs: dict[str, Any]
    ) -> torch.nn.Module:
        """auto_model's backend part when :attr:`model_parallelism` is "own", for a model already on
        :meth:`device`. ``hooks`` (onedist's DDP hook options) and ``ddp_kwargs`` (DDP's keyword
        arguments) are auto_model's, checked: the backend refuses or ignores them."""
        raise NotImplementedError(f"{type(self).__name__} makes models one with DDP (model_parallelism)")

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> torch.optim.Optimizer:
        """Adapt an optimizer to this backend (auto_optim's backend part). Default: unchanged."""
        if kwargs:
            from ..errors import bad_value

            name = sorted(kwargs)[0]
            raise bad_value(
                "auto_optim", name, kwargs[name], f"no keyword arguments with backend {self.backend!r}"
            )
        return optimizer

    def skip_gradient_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        """A context in which backward passes through ``model`` exchange no gradients
        (:func:`onedist.no_sync` for a model that is neither DDP nor FSDP). Default: nothing to
        skip (one process, an unwrapped model, or a backend that exchanges at ``step()``)."""
        return contextlib.nullcontext()

    def side_store(self) -> Any:
        """A key-value store every rank reaches outside the collectives (failure reports), or None."""
        return None

    def call_log(self) -> Any:
        """The default group's :class:`~onedist.backends.recorded.calls.CallLog` when its calls are
        on record (onedist's gloo, shm and mpi4py groups), else None."""
        return None

    def wrap_dataloader(self, loader: Any) -> Any:
        """Adapt a DataLoader to this backend (XLA: a device loader). Default: unchanged."""
        return loader

    # ------------------------------------------------------------------ primitives
    @abstractmethod
    def comm_device(self, device: torch.device, op: str) -> torch.device:
        """Where a tensor living on ``device`` must be for collective ``op`` on this backend.

        ``op`` is the primitive's name without the trailing underscore ("all_reduce", ...).
        """

    def reduce_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a reduction of ``dtype`` travels in (a wider one where the library lacks it)."""
        return dtype

    @abstractmethod
    def all_reduce_(self, t: torch.Tensor, op: str, group: Any, async_op: bool) -> Optional[Work]:
        """In-place all-reduce; ``op`` is one of SUM, PRODUCT, MIN, MAX, AND, OR."""

    @abstractmethod
    def reduce_(self, t: torch.Tensor, dst: int, op: str, group: Any, async_op: bool) -> Optional[Work]:
        """In-place reduce to ``dst``; other ranks' buffers are left undefined."""

    @abstractmethod
    def broadcast_(self, t: torch.Tensor, src: int, group: Any, async_op: bool) -> Optional[Work]:
        """In-place broadcast from ``src``."""

    @abstractmethod
    def all_gather_into_(
        self, out: torch.Tensor, t: torch.Tensor, group: Any, async_op: bool
    ) -> Optional[Work]:
        """``out`` (group size × ``t.numel()``) receives every rank's ``t`` in group-rank order."""

    @abstractmethod
    def all_to_all_single_(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: Any,
        async_op: bool,
    ) -> Optional[Work]:
        """1-D exchange: slice ``i`` of ``inp`` (``in_splits[i]`` long) goes to group rank ``i``;
        slice ``i`` of ``out`` comes from group rank ``i``. Splits may differ and be zero."""

    def all_gather_uneven_(
        self, out: torch.Tensor, block: torch.Tensor, sizes: list[int], group: Any, async_op: bool
    ) -> Optional[list[Work]]:
        """``out`` receives every rank's byte ``block`` (``sizes[i]`` bytes from group rank ``i``,
        known to every rank) in group-rank order, in one call of the backend's own; the works to
        wait for (none when not ``async_op``), or None when the backend has no such call and the
        caller uses all_to_all or send/recv."""
        return None

    @abstractmethod
    def barrier_(self, group: Any, async_op: bool) -> Optional[Work]:
        """Wait until every rank of the group arrives."""

    @abstractmethod
    def send_(self, t: torch.Tensor, dst: int, group: Any, tag: int, async_op: bool) -> Optional[Work]:
        """Send ``t`` to global rank ``dst``."""

    @abstractmethod
    def recv_(self, t: torch.Tensor, src: Optional[int], group: Any, tag: int, async_op: bool) -> Any:
        """Receive into ``t`` from ``src`` (any rank when None); returns the sender or a work."""
