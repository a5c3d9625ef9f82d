"""The XLA backend (``backend="xla-tpu"``, ignite's name): onedist on torch_xla's replicas.

A rank is an XLA device (a *replica*): a TPU core or chip, or one of the PJRT CPU devices. The
replicas come from ``xmp.spawn`` (through :func:`onedist.spawn` / :class:`onedist.Parallel` with
``backend="xla-tpu"``, or the user's own call), or ``initialize("xla-tpu")`` makes a world of the
one device of this process. Everything torch_xla-specific lives here; ``import onedist`` never
imports torch_xla (each method imports it when it runs).

* Ranks, sizes and devices come from ``torch_xla.runtime`` (``global_ordinal``, ``world_size``,
  ``local_ordinal``, ``local_device_count``, ``host_index``) at every query, never from
  ``torch.distributed``: ``xmp.spawn`` on some devices (PJRT CPU, TPU v2/v3) runs one *thread*
  per device in one process, and those threads share one process and its torch.distributed
  state. The backend object is shared by the threads; only torch_xla's per-thread device
  tells them apart, so ``od.get_rank()`` is right in each thread.
* Collectives are ``xm.all_reduce`` (SUM / PRODUCT / MIN / MAX), ``xm.all_gather`` and
  ``xm.all_to_all``. AND / OR (which XLA's CPU collectives lack) are an all_gather combined
  locally; bfloat16 is reduced in float32 (XLA's CPU collectives lack it; exact after the cast
  back); broadcast is an all_reduce of the tensor's bytes, zero on every rank but the source
  (bit-exact for every dtype); barrier is a one-element all_reduce that is waited for
  (``xm.rendezvous`` fails on the CPU devices).
* Reductions of tensors already on the XLA device stay lazy (the result joins the graph, as with
  ``xm.all_reduce``). Everything else -- broadcasts and gathers of device tensors, and every
  Python number, string and object -- travels through the host: it is moved to the device and
  the result is read back at once, which runs the graph pending in this thread first
  (``torch_xla.sync()``).
* Groups: the whole world or one rank. XLA runs a collective on every replica (replica groups
  that partition the world), while onedist lets only a group's members call it; a group of some
  of the ranks is refused with an error rather than risk a hang.
* send / recv: XLA has no point-to-point transfer between replicas outside a compiled graph;
  they raise.
* ``auto_model`` keeps the model on the device and broadcasts rank 0's parameters and buffers
  (no DDP wrapper); ``auto_optim`` returns the optimizer as an instance of a subclass whose
  ``step()`` all-reduces the gradients first (``xm.reduce_gradients``, the mean over replicas)
  and cuts the graph after (``xm.optimizer_step(..., barrier=True)``); ``auto_dataloader``
  wraps the loader in torch_xla's ``MpDeviceLoader``.

Example (on a TPU v3-8, which CI has not; tests/test_xla.py runs the PJRT CPU device)::

    import onedist as od

    def train(local_rank):
        x = torch.ones(2, device=od.device())                   # on xla:<local_rank>
        return od.all_reduce(float(od.get_rank()))

    if __name__ == "__main__":
        print(od.spawn("xla-tpu", train, nproc_per_node=8))     # [28.0] * 8: 0 + 1 + ... + 7
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, NamedTuple, Optional

import torch

from ..errors import (
    BackendUnavailableError,
    OnedistRuntimeError,
    OnedistTypeError,
    bad_value,
)
from .interface import Backend, Layout, Work

__all__ = ["XlaBackend", "device_count_env", "import_torch_xla", "launched_worker"]

logger = logging.getLogger("onedist")

_NAME = "xla-tpu"
_CPU = torch.device("cpu")
_XM_OPS = {"SUM": "REDUCE_SUM", "PRODUCT": "REDUCE_MUL", "MIN": "REDUCE_MIN", "MAX": "REDUCE_MAX"}
# dtypes XLA's collectives carry; bfloat16 is reduced in float32 (see reduce_dtype)
_XLA_DTYPES = frozenset(
    {
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint16,
        torch.uint32,
        torch.bool,
        torch.complex64,
    }
)
_INSTALL_HINT = (
    "install torch_xla built for this torch release (torch_xla X.Y needs torch X.Y.*), e.g. "
    "`pip install torch==2.9.1 torch-xla==2.9.0` in a virtual environment of its own"
)

# this thread runs a worker that onedist's launch started (an XLA context even at world size 1)
_tls = threading.local()


@contextlib.contextmanager
def launched_worker() -> Iterator[None]:
    """While it lasts, this thread is a worker onedist's launch (``launchers/xmp.py``) started:
    ``initialize`` finds an XLA context here even at world size 1."""
    _tls.launched = True
    try:
        yield
    finally:
        _tls.launched = False


@functools.cache
def _unavailable_reason() -> Optional[str]:
    """Why torch_xla cannot be used with this torch, or None when it can (no import: cheap)."""
    if importlib.util.find_spec("torch_xla") is None:
        return "torch_xla is not installed"
    try:
        xla_version = importlib.metadata.version("torch_xla")
    except importlib.metadata.PackageNotFoundError:  # a source build without metadata: trust it
        return None
    torch_version = torch.__version__.split("+")[0]
    if xla_version.split(".")[:2] != torch_version.split(".")[:2]:
        return (
            f"torch_xla {xla_version} is installed, which needs torch "
            f"{'.'.join(xla_version.split('.')[:2])}.*, and this torch is {torch.__version__}"
        )
    return None


def _xm() -> Any:
    import torch_xla.core.xla_model as xm

    return xm


def _sync() -> None:
    """Run the graph pending in this thread (``torch_xla.sync``, looked up at each call)."""
    import torch_xla

    torch_xla.sync()


class _Group(NamedTuple):
    """A group handle: the (sorted) global ranks of the group."""

    ranks: tuple[int, ...]


class XlaBackend(Backend):
    """The replicas of an XLA program (``xmp.spawn``), or the one XLA device of this process.

    Example (with torch_xla installed, ``PJRT_DEVICE=CPU``)::

        import onedist as od
        od.initialize("xla-tpu")
        od.model_name(), od.backend(), od.device(), od.get_world_size()
        # ('xla-dist', 'xla-tpu', device(type='xla', index=0), 1)
        od.finalize()
    """

    model_name = "xla-dist"
    external_origin = "xmp.spawn (yours, or onedist.spawn's)"
    #: no send/recv at all: onedist's large uneven gathers go through all_to_all
    p2p_bulk = False

    def __init__(self, owned: bool) -> None:
        # no Backend.__init__: rank and world_size are read from torch_xla at each query
        self.backend = _NAME
        #: True when initialize("xla-tpu") made this context (False: found inside xmp.spawn)
        self.owned = owned
        self._groups: dict[tuple[int, ...], Any] = {}
        self._lock = threading.Lock()

    # rank and world_size differ per thread under xmp.spawn: properties, not attributes
    @property
    def rank(self) -> int:
        import torch_xla.runtime as xr

        return int(xr.global_ordinal())

    @rank.setter
    def rank(self, value: int) -> None:
        raise AttributeError("XlaBackend.rank is read from torch_xla.runtime")

    @property
    def world_size(self) -> int:
        import torch_xla.runtime as xr

        return int(xr.world_size())

    @world_size.setter
    def world_size(self, value: int) -> None:
        raise AttributeError("XlaBackend.world_size is read from torch_xla.runtime")

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def available_backends(cls) -> tuple[str, ...]:
        return () if _unavailable_reason() else (_NAME,)

    @classmethod
    def context_active(cls) -> bool:
        xla = sys.modules.get("torch_xla")
        if xla is None:  # the common case, on every query of a serial run: one dict lookup
            return False
        if getattr(_tls, "launched", False):
            return True
        # inside xmp.spawn (a process or thread of it), replication is set for every device
        c = getattr(xla, "_XLAC", None)
        if c is None or not c._xla_runtime_is_initialized():  # never start the runtime here
            return False
        return bool(c._xla_get_replication_devices_count() > 0)

    @classmethod
    def create_from_context(cls) -> Optional[Backend]:
        if not cls.context_active():
            return None
        return _shared_context()

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
        for arg, value, allowed in (
            ("timeout", timeout, "None with backend 'xla-tpu' (XLA collectives take no timeout)"),
            ("init_method", init_method, "None with backend 'xla-tpu' (PJRT finds the devices itself)"),
        ):
            if value is not None:
                raise bad_value("initialize", arg, value, allowed)
        if kwargs:
            name = sorted(kwargs)[0]
            raise bad_value("initialize", name, kwargs[name], "no keyword arguments with backend 'xla-tpu'")
        import_torch_xla("initialize")
        import torch_xla
        import torch_xla.runtime as xr

        torch_xla.device()  # starts the PJRT runtime of this process
        size, ordinal = int(xr.world_size()), int(xr.global_ordinal())
        launcher_size = os.environ.get("WORLD_SIZE")
        if launcher_size is not None and launcher_size.isdigit() and int(launcher_size) != size:
            raise OnedistRuntimeError(
                f"onedist.initialize: the launcher started WORLD_SIZE={launcher_size} processes, but the "
                f"XLA world of this process has {size} device(s) (PJRT_DEVICE={xr.device_type()}): "
                "processes that torchrun / srun / mpirun start do not form one XLA world here, so the "
                "collectives would silently stay inside each process.\n"
                "HINT: start the replicas with onedist.spawn('xla-tpu', fn, nproc_per_node=N) or "
                "Parallel(backend='xla-tpu', nproc_per_node=N) (xmp.spawn underneath), or use "
                "backend='gloo' for CPU processes"
            )
        for arg, given, actual in (("world_size", world_size, size), ("rank", rank, ordinal)):
            if given is not None and given != actual:
                raise bad_value(
                    "initialize",
                    arg,
                    given,
                    f"None or {actual}, what torch_xla.runtime reports for this XLA world",
                )
        return cls(owned=True)

    def is_stale(self) -> bool:
        return False if self.owned else not self.context_active()

    def finalize(self) -> None:
        # the PJRT runtime lives as long as the process (torch_xla cannot restart it): nothing to end
        self._groups.clear()

    # ------------------------------------------------------------------ queries
    def layout(self) -> Layout:
        import torch_xla.runtime as xr

        per_node = max(1, int(xr.local_device_count()))
        return Layout(
            local_rank=int(xr.local_ordinal()),
            nproc_per_node=per_node,
            node_rank=int(xr.host_index()),
            nnodes=max(1, int(xr.world_size()) // per_node),
        )

    def device(self) -> torch.device:
        import torch_xla

        return torch.device(torch_xla.device())

    # ------------------------------------------------------------------ training objects
    model_parallelism = "own"

    def prepare_model(
        self, model: torch.nn.Module, sync_bn: bool, hooks: dict[str, Any], ddp_kwargs: dict[str, Any]
    ) -> torch.nn.Module:
        options = {**hooks, **ddp_kwargs}
        world = self.world_size
        if options:
            logger.info(
                "onedist.auto_model: %s apply to DistributedDataParallel, which backend 'xla-tpu' does not "
                "use (auto_optim's step reduces the gradients); ignored",
                ", ".join(sorted(options)),
            )
        if sync_bn and world == 1:
            logger.info(
                "onedist.auto_model: sync_bn ignored with world size 1 (BatchNorm already sees the batch)"
            )
        elif sync_bn:
            raise bad_value(
                "auto_model",
                "sync_bn",
                sync_bn,
                "False with backend 'xla-tpu' (torch_xla has no SyncBatchNorm; each replica's BatchNorm "
                "sees its own batch)",
            )
        if world > 1:
            self._broadcast_module(model)
        return model

    def _broadcast_module(self, model: torch.nn.Module) -> None:
        """Rank 0's parameters and buffers on every replica (lazy: they join the next graph)."""
        xm = _xm()
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in [*model.parameters(), *model.buffers()]:
            if t.device.type == "xla":
                by_dtype.setdefault(t.dtype, []).append(t)
        if not by_dtype:
            return
        # the mask is device data, not a constant, so that every replica compiles the same graph
        keep = torch.tensor(self.rank == 0).to(self.device())
        with torch.no_grad():
            for dtype, tensors in by_dtype.items():
                wire = [torch.where(keep, t, torch.zeros_like(t)) for t in tensors]
                if dtype == torch.bfloat16:  # XLA's CPU collectives lack bfloat16
                    wire = [w.float() for w in wire]
                xm.all_reduce(xm.REDUCE_SUM, wire)  # in place on the list
                for t, w in zip(tensors, wire):
                    t.copy_(w)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> torch.optim.Optimizer:
        optimizer = super().wrap_optimizer(optimizer, **kwargs)
        if isinstance(optimizer, _XlaStep):
            return optimizer
        cls = _optimizer_class(type(optimizer))
        wrapped: torch.optim.Optimizer = object.__new__(cls)
        # the same state, param_groups and hooks (the containers are shared, not copied)
        wrapped.__dict__.update(optimizer.__dict__)
        return wrapped

    def wrap_dataloader(self, loader: Any) -> Any:
        return _device_loader_class()(loader, self.device())

    # ------------------------------------------------------------------ groups
    def new_group(self, ranks: tuple[int, ...], **kwargs: Any) -> Any:
        if kwargs:
            name = sorted(kwargs)[0]
            raise bad_value("new_group", name, kwargs[name], "no keyword arguments with backend 'xla-tpu'")
        world = self.world_size
        if ranks == tuple(range(world)):
            return None
        if len(ranks) > 1:
            raise bad_value(
                "new_group",
                "ranks",
                list(ranks),
                f"every rank (0..{world - 1}) or a single rank with backend 'xla-tpu'",
                hint="XLA runs a collective on every replica, while a onedist group is used by its members "
                "only; reduce over all ranks (e.g. with zeros from the others) instead",
            )
        with self._lock:
            return self._groups.setdefault(ranks, _Group(ranks))

    def group_ranks(self, group: Any) -> tuple[int, ...]:
        return tuple(range(self.world_size)) if group is None else tuple(group.ranks)

    def group_rank(self, group: Any) -> int:
        rank = self.rank
        if group is None:
            return rank
        return group.ranks.index(rank) if rank in group.ranks else -1

    def object_group(self, group: Any) -> Any:
        return group

    def local_group(self) -> Any:
        lay = self.layout()
        if lay.nnodes == 1:
            return None
        first = self.rank - lay.local_rank
        return self.new_group(tuple(range(first, first + lay.nproc_per_node)))

    # ------------------------------------------------------------------ primitives
    def comm_device(self, device: torch.device, op: str) -> torch.device:
        # Reductions of XLA tensors stay lazy on their device, as with xm.all_reduce. Everything else
        # travels through the host: the primitive moves it to the device and reads the result back
        # after torch_xla.sync(). (A broadcast's receivers hold tensors made differently from the
        # source's -- torch.empty is a graph constant on the device -- while the devices must
        # compile the same graph around a collective; on the host that difference is not a graph.)
        return device if device.type == "xla" and op == "all_reduce" else _CPU

    def reduce_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if dtype not in _XLA_DTYPES:
            raise OnedistTypeError(
                f"onedist: XLA collectives cannot reduce tensors of dtype {dtype} (they take "
                f"{', '.join(sorted(str(d) for d in _XLA_DTYPES))})\n"
                "HINT: convert first, e.g. t.to(torch.int64) or t.float()"
            )
        return torch.float32 if dtype == torch.bfloat16 else dtype

    def all_reduce_(self, t: torch.Tensor, op: str, group: Any, async_op: bool) -> Optional[Work]:
        if self._alone(group) or t.numel() == 0:
            return None
        xm = _xm()
        x = self._on_device(t)
        if op in ("AND", "OR"):  # XLA's CPU collectives have no bitwise reduction: gather, combine here
            rows = xm.all_gather(x.reshape(-1), dim=0, pin_layout=False)
            if t.device.type != "xla":
                _sync()
                rows = rows.cpu()
            rows = rows.view(self.world_size, -1)
            acc = rows[0].clone()
            for row in rows[1:]:
                if op == "AND":
                    acc.bitwise_and_(row)
                else:
                    acc.bitwise_or_(row)
            t.copy_(acc.view_as(t))
            return None
        self._finish(t, xm.all_reduce(getattr(xm, _XM_OPS[op]), x))
        return None

    def reduce_(self, t: torch.Tensor, dst: int, op: str, group: Any, async_op: bool) -> Optional[Work]:
        return self.all_reduce_(t, op, group, async_op)  # every replica runs it: all get the result

    def broadcast_(self, t: torch.Tensor, src: int, group: Any, async_op: bool) -> Optional[Work]:
        if self._alone(group) or t.numel() == 0:
            return None
        xm = _xm()
        flat = t.detach().reshape(-1).cpu()  # comm_device keeps broadcasts on the host anyway
        if flat.stride() != (1,):  # a byte view needs stride 1, even for one element
            flat = flat.clone(memory_format=torch.contiguous_format)
        # the bytes, zero on every rank but src, summed: exact for every dtype (-0.0, NaN payloads)
        dev = self.device()
        data = flat.view(torch.uint8).to(dev)
        scale = torch.tensor([int(self.rank == src)], dtype=torch.uint8).to(dev)  # data, not a constant
        summed = xm.all_reduce(xm.REDUCE_SUM, data * scale)
        _sync()
        out = summed.cpu().view(t.dtype).view_as(t)
        t.copy_(out.to(t.device))
        return None

    def all_gather_into_(
        self, out: torch.Tensor, t: torch.Tensor, group: Any, async_op: bool
    ) -> Optional[Work]:
        if self._alone(group):
            out.view(-1).copy_(t.reshape(-1))
            return None
        if t.numel() == 0:
            return None
        xm = _xm()
        gathered = xm.all_gather(self._on_device(t).reshape(-1), dim=0, pin_layout=False)
        self._finish(out, gathered)
        return None

    def all_to_all_single_(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: Any,
        async_op: bool,
    ) -> Optional[Work]:
        if self._alone(group):
            out.copy_(inp)
            return None
        n = self.world_size
        # xm.all_to_all splits evenly: every rank pads its blocks to the largest block of any rank
        longest = torch.tensor([max([0, *in_splits, *out_splits])], dtype=torch.int64)
        self.all_reduce_(longest, "MAX", group, False)
        width = int(longest.item())
        if width == 0:
            return None
        blocks = inp.new_zeros((n, width))
        offset = 0
        for j, size in enumerate(in_splits):
            blocks[j, :size] = inp[offset : offset + size]
            offset += size
        xm = _xm()
        received = xm.all_to_all(
            self._on_device(blocks), split_dimension=0, concat_dimension=0, split_count=n, pin_layout=False
        )
        if out.device.type != "xla":
            _sync()
            received = received.cpu()
        offset = 0
        for i, size in enumerate(out_splits):
            out[offset : offset + size] = received[i, :size]
            offset += size
        return None

    def barrier_(self, group: Any, async_op: bool) -> Optional[Work]:
        # a one-element all_reduce read back on the CPU (xm.rendezvous fails on the CPU devices)
        self.all_reduce_(torch.zeros(1), "SUM", group, False)
        return None

    def send_(self, t: torch.Tensor, dst: int, group: Any, tag: int, async_op: bool) -> Optional[Work]:
        raise _no_p2p("send")

    def recv_(self, t: torch.Tensor, src: Optional[int], group: Any, tag: int, async_op: bool) -> Any:
        raise _no_p2p("recv")

    # ------------------------------------------------------------------ helpers
    def _alone(self, group: Any) -> bool:
        """True when the collective involves this rank only (world size 1, or a group of one)."""
        return group is not None or self.world_size == 1

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.device.type == "xla" else t.to(self.device())

    @staticmethod
    def _finish(dst: torch.Tensor, result: torch.Tensor) -> None:
        """Write ``result`` (on the XLA device) into ``dst``: lazily on XLA, after the graph ran on CPU."""
        if dst.device.type == "xla":
            dst.copy_(result.reshape(dst.shape))
            return
        _sync()
        dst.copy_(result.cpu().reshape(dst.shape))


def _no_p2p(func: str) -> OnedistRuntimeError:
    return OnedistRuntimeError(
        f"onedist.{func}: backend 'xla-tpu' has no point-to-point send/recv (XLA replicas exchange data "
        "only through collectives that every replica runs)\n"
        "HINT: use onedist.broadcast(value, src=...) or all_gather, which every rank calls"
    )


_shared: Optional[XlaBackend] = None
_shared_lock = threading.Lock()


def _shared_context() -> XlaBackend:
    """The one backend object of this process for a context found inside xmp.spawn.

    The replica threads of one process share it (it keeps nothing per thread), so a thread that
    detects the context after another does not replace what the other holds.
    """
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = XlaBackend(owned=False)
        return _shared


def import_torch_xla(func: str) -> None:
    """Import torch_xla, or raise :class:`BackendUnavailableError` naming ``func`` and the fix."""
    reason = _unavailable_reason()
    try:
        import torch_xla  # noqa: F401
    except Exception as e:
        raise BackendUnavailableError(
            f"onedist.{func}: backend='xla-tpu' cannot start: torch_xla does not import ({e})"
            + (f"; {reason}" if reason else "")
            + f"\nHINT: {_INSTALL_HINT}"
        ) from e


# ---------------------------------------------------------------------------- training objects
class _XlaStep:
    """Mixed into the optimizer's own class by auto_optim: ``step()`` is ``xm.optimizer_step``."""

    def step(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        """Average the gradients over the replicas, step, then run the graph (``torch_xla.sync``)."""
        xm = _xm()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        xm.reduce_gradients(self)
        super().step(**kwargs)  # type: ignore[misc]
        _sync()
        return loss


_optimizer_classes: dict[type, type] = {}


def _optimizer_class(base: type[torch.optim.Optimizer]) -> type:
    """``base`` with :class:`_XlaStep` in front, under ``base``'s own name (isinstance holds)."""
    cls = _optimizer_classes.get(base)
    if cls is None:
        name = base.__name__
        cls = _optimizer_classes[base] = type(name, (_XlaStep, base), {"__module__": base.__module__})
    return cls


@functools.cache
def _device_loader_class() -> type:
    """torch_xla's ``MpDeviceLoader``, showing the wrapped DataLoader's attributes (sampler, ...)."""
    from torch_xla.distributed.parallel_loader import MpDeviceLoader

    class XlaDeviceLoader(MpDeviceLoader):  # type: ignore[misc]  # (torch_xla is untyped)
        """Batches already on the XLA device, graph cut after each; ``len()``, ``sampler``,
        ``dataset``, ``batch_size`` ... are the DataLoader's (``loader.sampler.set_epoch(e)`` works)."""

        def __getattr__(self, name: str) -> Any:
            if name.startswith("__") or name == "_loader":
                raise AttributeError(name)
            return getattr(self._loader, name)

    XlaDeviceLoader.__module__ = __name__
    XlaDeviceLoader.__qualname__ = "XlaDeviceLoader"
    return XlaDeviceLoader


# ---------------------------------------------------------------------------- launching
_CPU_THREADS_WARNING = (
    "onedist.spawn: %d XLA CPU devices run as threads of one process, and torch_xla's collectives between "
    "such threads race: XLA aborts them after 10 s ('Termination timeout for ... RendezvousKey') unless "
    "graph launches are serialised, which only onedist's tests do (see onedist's XLA page)"
)


def device_count_env(nproc: int, device_type: str) -> dict[str, Optional[str]]:
    """Make xmp.spawn start ``nproc`` devices; returns the variables set, with their old values."""
    if device_type != "CPU":
        return {}  # a TPU host's devices are what they are: each worker checks the count (_worker)
    logger.warning(_CPU_THREADS_WARNING, nproc)
    given = os.environ.get("CPU_NUM_DEVICES")
    if given is not None:
        if given.strip() != str(nproc):
            raise bad_value(
                "spawn",
                "nproc_per_node",
                nproc,
                f"1 or {given} (CPU_NUM_DEVICES={given} sets the number of XLA CPU devices)",
                hint="unset CPU_NUM_DEVICES (onedist then sets it to nproc_per_node), or pass "
                f"nproc_per_node={given}",
            )
        return {}
    os.environ["CPU_NUM_DEVICES"] = str(nproc)
    logger.info("onedist set CPU_NUM_DEVICES=%d for xmp.spawn (the environment did not set it)", nproc)
    return {"CPU_NUM_DEVICES": None}
