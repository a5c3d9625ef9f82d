"""Gradient accumulation, the same on every backend: :func:`no_sync` and :func:`accumulate`.

Where the gradients are exchanged differs per backend, so skipping the exchange does too:

* DDP (gloo, nccl, shm, mpi): in the backward pass, by DDP's reducer: ``model.no_sync()``;
* FSDP2 (``fully_shard``): in the backward pass: ``set_requires_gradient_sync(False)``;
* Horovod: in the backward pass, by ``hvd.DistributedOptimizer``'s hooks: the backend holds them
  back (:meth:`~onedist.backends.interface.Backend.skip_gradient_sync`);
* XLA: at ``optimizer.step()`` (``xm.reduce_gradients``), once per step whatever the number of
  backward passes: nothing to skip;
* one process, or a model without a wrapper: no exchange at all.

The first backward pass outside the context exchanges the gradients accumulated inside it, once.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..errors import bad_type, bad_value
from .sharding import is_sharded

__all__ = [
    "Window",
    "accumulate",
    "micro_steps",
    "no_sync",
    "pending_gradients",
    "restore_pending_gradients",
    "set_micro_steps",
]


@contextlib.contextmanager
def no_sync(model: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
    """Skip the gradient exchange for the backward passes inside the context, on every backend.

    The gradients of those passes accumulate on each rank; the next backward pass outside the
    context exchanges the sum once. A no-op where nothing is exchanged (one process, an unwrapped
    model), so a loop written with it runs unchanged serially.

    Args:
        model: the model :func:`~onedist.auto_model` returned (a DDP, FSDP2 or plain module).
        enabled: False makes the context do nothing (Fabric's ``no_backward_sync(enabled=...)``):
            ``enabled=not last_micro_step`` keeps one code path for every micro-step.

    Loss scaling is yours: divide each micro-batch's loss by the number of micro-batches in the
    window to get the gradient of their mean (what one step on the whole window's batch gives).

    Example:
        >>> import torch, onedist as od
        >>> model = od.auto_model(torch.nn.Linear(4, 1))
        >>> batches = [torch.randn(2, 4) for _ in range(4)]
        >>> for i, x in enumerate(batches):
        ...     with od.no_sync(model, enabled=i < len(batches) - 1):
        ...         (model(x).sum() / len(batches)).backward()
        >>> model.weight.grad.shape
        torch.Size([1, 4])
    """
    if not isinstance(model, torch.nn.Module):
        raise bad_type("no_sync", "model", model, "a torch.nn.Module (the model auto_model returned)")
    if not isinstance(enabled, bool):
        raise bad_type("no_sync", "enabled", enabled, "a bool")
    if not enabled:
        yield
        return
    with _skip_exchange(model):
        yield


def _skip_exchange(model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
    from ..context import current

    inner = getattr(model, "_orig_mod", model)  # torch.compile's wrapper around the model
    if isinstance(inner, torch.nn.parallel.DistributedDataParallel):
        return inner.no_sync()
    if is_sharded(inner):  # an FSDP2 module (fully_shard)
        return _fsdp_no_sync(inner)
    return current().skip_gradient_sync(inner)


@contextlib.contextmanager
def _fsdp_no_sync(model: Any) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


@dataclass(frozen=True)
class Window:
    """Where one micro-step stands in its accumulation window (what :func:`accumulate` gives).

    Attributes:
        sync: this micro-step's backward pass exchanges the gradients: step the optimizer after it.
        size: the number of micro-batches in this window (``every``, or fewer in the last window
            of an epoch): divide the loss by it for the gradient of the window's mean loss.
        index: this micro-step's position in the window, from 0.
    """

    sync: bool
    size: int
    index: int


class _Counter:
    """How many micro-steps a model has made (the state behind :func:`accumulate`), and whether
    the last one left its window open (its gradients accumulated, not yet exchanged)."""

    __slots__ = ("calls", "open")

    def __init__(self, calls: int = 0, open: bool = False) -> None:
        self.calls = calls
        self.open = open


_counters: weakref.WeakKeyDictionary[torch.nn.Module, _Counter] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def accumulate(model: torch.nn.Module, every: int, loader: Optional[Any] = None) -> Iterator[Window]:
    """One micro-step of gradient accumulation over ``every`` micro-batches, counted for you.

    Each use is one micro-step (one batch). Inside, the gradient exchange is skipped
    (:func:`no_sync`) except on the last micro-step of a window, which exchanges the sum once and
    yields ``window.sync`` True: step the optimizer and zero the gradients then. With ``loader``
    (anything with ``len()``, one use per batch), the last batch of each epoch also closes its
    window, as Accelerate's ``accumulate`` does, and windows restart with the epoch; the last
    window of an epoch then has ``window.size`` < ``every`` micro-batches.

    The count lives with the model (one count per model), so the call goes inside the loop.

    Args:
        model: the model :func:`~onedist.auto_model` returned.
        every: micro-batches per optimizer step (1: every step syncs).
        loader: the loader the batches come from, to close a window at each epoch's end.

    Example:
        >>> import torch, onedist as od
        >>> model = od.auto_model(torch.nn.Linear(4, 1))
        >>> opt = od.auto_optim(torch.optim.SGD(model.parameters(), lr=0.1))
        >>> loader = [torch.randn(2, 4) for _ in range(6)]
        >>> steps = 0
        >>> for x in loader:
        ...     with od.accumulate(model, every=4, loader=loader) as window:
        ...         od.backward(model(x).sum() / window.size)
        ...     if window.sync:
        ...         opt.step(); opt.zero_grad(); steps += 1
        >>> steps   # a window of 4 batches, then the epoch's last 2
        2
    """
    if not isinstance(model, torch.nn.Module):
        raise bad_type("accumulate", "model", model, "a torch.nn.Module (the model auto_model returned)")
    if not isinstance(every, int) or isinstance(every, bool):
        raise bad_type("accumulate", "every", every, "an int >= 1")
    if every < 1:
        raise bad_value("accumulate", "every", every, "an int >= 1")
    epoch = _epoch_length(loader)
    counter = _counters.get(model)
    if counter is None:
        counter = _counters[model] = _Counter()
    window = _window(counter.calls, every, epoch)
    counter.calls += 1
    counter.open = not window.sync
    with no_sync(model, enabled=not window.sync):
        yield window


def _epoch_length(loader: Optional[Any]) -> Optional[int]:
    if loader is None:
        return None
    try:
        length = len(loader)
    except TypeError:
        raise bad_type(
            "accumulate",
            "loader",
            loader,
            "None or an object with len() (a DataLoader, a list of batches)",
            hint="an IterableDataset's loader has no length: leave loader out, or count the "
            "micro-steps yourself with od.no_sync",
        ) from None
    if length < 1:
        raise bad_value("accumulate", "loader", loader, "a loader with at least one batch")
    return int(length)


def _window(calls: int, every: int, epoch: Optional[int]) -> Window:
    """The window of micro-step number ``calls`` (from 0)."""
    if epoch is None:
        index = calls % every
        return Window(sync=index == every - 1, size=every, index=index)
    position = calls % epoch
    start = position - position % every
    size = min(every, epoch - start)
    index = position - start
    return Window(sync=index == size - 1, size=size, index=index)


# ---------------------------------------------------------------------------- checkpoints
def _counter_of(model: torch.nn.Module) -> Optional[_Counter]:
    """``model``'s count, also when it was kept under the wrapper of the same module."""
    from .wrappers import unwrap

    counter = _counters.get(model)
    if counter is not None:
        return counter
    inner = unwrap(model)
    return next((c for m, c in list(_counters.items()) if unwrap(m) is inner), None)


def micro_steps(model: torch.nn.Module) -> Optional[tuple[int, bool]]:
    """How many micro-steps :func:`accumulate` counted for ``model``, and whether the last one
    left its window open; None when it never counted one.

    Example:
        >>> import torch, onedist as od
        >>> model = torch.nn.Linear(2, 1)
        >>> with od.accumulate(model, every=3):
        ...     pass
        >>> micro_steps(model), micro_steps(torch.nn.Linear(2, 1))
        ((1, True), None)
    """
    counter = _counter_of(model)
    return None if counter is None else (counter.calls, counter.open)


def set_micro_steps(model: torch.nn.Module, calls: int, open: bool) -> None:
    """Continue :func:`accumulate`'s count for ``model`` at ``calls`` micro-steps (a resumed run).

    Example:
        >>> import torch, onedist as od
        >>> model = torch.nn.Linear(2, 1)
        >>> set_micro_steps(model, 5, True)
        >>> with od.accumulate(model, every=3) as window:
        ...     pass
        >>> window
        Window(sync=True, size=3, index=2)
    """
    counter = _counter_of(model)
    if counter is None:
        _counters[model] = _Counter(calls, open)
    else:
        counter.calls, counter.open = calls, open


def pending_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's gradients accumulated in an open window, not yet exchanged: by parameter name,
    copies on the CPU (each rank's differ: its own micro-batches).

    A sharded (FSDP2) model keeps them unsharded inside ``fully_shard``'s parameter groups, where
    :func:`restore_pending_gradients` puts them back.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> sorted(pending_gradients(model))
        ['bias', 'weight']
    """
    from .wrappers import unwrap

    module = unwrap(model)
    if is_sharded(module):
        return {name: grad.detach().cpu().clone() for name, (_, grad) in _fsdp_gradients(module).items()}
    return {
        name: p.grad.detach().cpu().clone() for name, p in module.named_parameters() if p.grad is not None
    }


def restore_pending_gradients(model: torch.nn.Module, gradients: dict[str, torch.Tensor]) -> None:
    """Put back what :func:`pending_gradients` gave: the next backward pass adds to them, as it
    would have in the saved run.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> restore_pending_gradients(model, {"bias": torch.ones(1)})
        >>> model.bias.grad, model.weight.grad
        (tensor([1.]), None)
    """
    from .wrappers import unwrap

    module = unwrap(model)
    if is_sharded(module):
        by_name = _fsdp_gradients(module, with_empty=True)
        for name, grad in gradients.items():
            fsdp_param, _ = by_name[name]
            # FSDP2 adds each later micro-step's unsharded gradient to this one, in the order
            # autograd would (acc + new), and reduce-scatters it at the window's last micro-step
            fsdp_param.unsharded_accumulated_grad = grad.to(fsdp_param.sharded_param.device)
        return
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, grad in gradients.items():
            params[name].grad = grad.to(device=params[name].device, dtype=params[name].dtype).clone()


def _fsdp_gradients(module: torch.nn.Module, with_empty: bool = False) -> dict[str, tuple[Any, Any]]:
    """Each FSDP2 parameter of ``module`` by name: (its FSDPParam, its unsharded accumulated
    gradient). torch keeps no public handle on them (2.4 to 2.13: ``unsharded_accumulated_grad``
    under a reduce dtype, else the unsharded parameter's ``grad``)."""
    names = {id(p): name for name, p in module.named_parameters()}
    found: dict[str, tuple[Any, Any]] = {}
    for sub in module.modules():
        get_state = getattr(sub, "_get_fsdp_state", None)
        state = get_state() if callable(get_state) else None
        group = getattr(state, "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", ()):
            grad = fsdp_param.unsharded_accumulated_grad
            if grad is None and hasattr(fsdp_param, "_unsharded_param"):
                grad = fsdp_param._unsharded_param.grad
            if grad is not None or with_empty:
                found[names[id(fsdp_param.sharded_param)]] = (fsdp_param, grad)
    return found
