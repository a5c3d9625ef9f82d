"""Mixed precision in one argument: ``auto_model(model, precision=...)`` and :func:`backward`.

Fabric's names: ``"32"`` (nothing changes), ``"bf16-mixed"`` (the forward pass under the device's
bfloat16 autocast; parameters, gradients and optimizer state stay float32) and ``"16-mixed"``
(float16 autocast on CUDA, with a ``GradScaler``: :func:`backward` scales the loss, and the
optimizer :func:`~onedist.auto_optim` returns unscales the gradients and skips a step whose
gradients hold inf or NaN; the scale is updated at the next :func:`backward`), and ``"bf16-true"``
(the parameters themselves bfloat16, so their gradients and the optimizer state are too; floating
inputs are cast to bfloat16 on the way in, floating outputs back to float32 on the way out).

The forward pass runs under autocast through two hooks on the model (a pre-hook enters the
context, a hook that also runs on an exception leaves it and turns the floating outputs back to
float32), so the model keeps its type (``isinstance(model, DistributedDataParallel)`` holds) and a
``copy.deepcopy`` of it carries its own hooks. One scaler per process, made by the first
``auto_model`` with ``"16-mixed"`` and shared by every model and optimizer (Fabric and Accelerate
also keep one per process): each optimizer's ``step()`` unscales and steps its own parameters, and
the scale is updated once per iteration, at the next :func:`backward` (torch's recipe for several
optimizers: every ``scaler.step``, then one ``scaler.update``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, Optional

import torch

from ..errors import bad_type, bad_value
from .versions import require_torch

__all__ = [
    "PRECISIONS",
    "active_scaler",
    "apply_precision",
    "backward",
    "cast_parameters",
    "check_precision",
    "scaled_optimizer",
]

#: what ``auto_model(precision=...)`` accepts (``32`` and ``"32-true"`` mean ``"32"``)
PRECISIONS = ("32", "bf16-mixed", "bf16-true", "16-mixed")
_ALIASES = {"32-true": "32", 32: "32"}

_scaler: Optional[Any] = None  # the GradScaler of "16-mixed" (CUDA), shared by backward and the optimizers
_stepped = False  # an optimizer stepped through the scaler since its last update
_active = threading.local()  # the autocast contexts entered by the forward pre-hook, innermost last


def check_precision(precision: Any, device: torch.device, backend: Optional[str]) -> str:
    """``precision`` by its canonical name, or the error naming what this device and backend allow."""
    if isinstance(precision, bool) or not isinstance(precision, (str, int)):
        raise bad_type("auto_model", "precision", precision, "a str: " + ", ".join(map(repr, PRECISIONS)))
    name = _ALIASES.get(precision, precision)
    if name == "16-mixed":
        require_torch("auto_model", "precision", precision, (2, 3))  # torch.amp.GradScaler(device)
    allowed = _allowed(device, backend)
    if name not in allowed:
        hint = None
        if name == "16-mixed":
            hint = "float16 training needs CUDA (and a backend with the GradScaler path): use 'bf16-mixed'"
        elif name in ("bf16-mixed", "bf16-true") and device.type == "cuda":
            hint = "this GPU has no bfloat16: use '16-mixed'"
        elif name == "bf16-true":
            hint = (
                "bfloat16 parameters are built for torch.distributed (gloo, nccl, shm, mpi) and one process"
            )
        where = f"on device {device.type!r} with backend {backend or 'serial'!r}"
        raise bad_value(
            "auto_model", "precision", precision, f"{', '.join(map(repr, allowed))} {where}", hint
        )
    return str(name)


def _allowed(device: torch.device, backend: Optional[str]) -> tuple[str, ...]:
    # bfloat16 parameters through Horovod's and XLA's own optimizer wrappers: not built nor tested
    true = ("bf16-true",) if backend not in ("horovod", "xla-tpu") else ()
    if device.type == "cuda":
        bf16 = ("bf16-mixed", *true) if torch.cuda.is_bf16_supported() else ()
        # the GradScaler with hvd.DistributedOptimizer needs its synchronize() first: not built
        fp16 = ("16-mixed",) if backend != "horovod" else ()
        return ("32", *bf16, *fp16)
    if device.type in ("cpu", "xla"):
        return ("32", "bf16-mixed", *true)
    return ("32",)


def cast_parameters(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """``model`` with its floating parameters and buffers in bfloat16 under ``"bf16-true"`` (before
    it is wrapped or sharded, and before the optimizer sees its parameters)."""
    return model.to(torch.bfloat16) if precision == "bf16-true" else model


def apply_precision(model: torch.nn.Module, precision: str, device: torch.device) -> torch.nn.Module:
    """Put ``model``'s forward pass under ``precision``'s autocast (see the module doc)."""
    global _scaler
    if precision == "32":
        return model
    if precision == "bf16-true":
        model.register_forward_pre_hook(_inputs_to_bfloat16, with_kwargs=True)
        model.register_forward_hook(lambda module, args, output: _to_float32(output))
        return model
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    model.register_forward_pre_hook(functools.partial(_enter_autocast, device.type, dtype))
    model.register_forward_hook(_leave_autocast, always_call=True)
    if precision == "16-mixed" and _scaler is None:
        _scaler = torch.amp.GradScaler(device.type)
    return model


def _enter_autocast(device_type: str, dtype: torch.dtype, module: torch.nn.Module, args: Any) -> None:
    context = torch.autocast(device_type, dtype=dtype)
    context.__enter__()  # type: ignore[no-untyped-call]
    stack = getattr(_active, "stack", None)
    if stack is None:
        stack = _active.stack = []
    stack.append(context)


def _leave_autocast(module: torch.nn.Module, args: Any, output: Any) -> Any:
    _active.stack.pop().__exit__(None, None, None)
    return _to_float32(output)


def _inputs_to_bfloat16(module: torch.nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
    return _cast(args, torch.bfloat16), _cast(kwargs, torch.bfloat16)


def _to_float32(value: Any) -> Any:
    """Floating tensors of lower precision in ``value`` (nested lists, tuples, dicts) as float32: the
    loss is then computed in float32, whatever the layers returned."""
    return _cast(value, torch.float32)


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """Floating tensors in ``value`` (nested lists, tuples, dicts) as ``dtype``: to float32 those of
    lower precision (float64 stays), to bfloat16 every other floating one (as Fabric's bf16-true)."""
    if isinstance(value, torch.Tensor):
        if dtype == torch.float32:
            return value.float() if value.dtype in (torch.float16, torch.bfloat16) else value
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_cast(v, dtype) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _cast(v, dtype)) for k, v in value.items())
    return value


def active_scaler() -> Optional[Any]:
    """The process's GradScaler (``"16-mixed"``), or None."""
    return _scaler


def backward(loss: torch.Tensor, **kwargs: Any) -> None:
    """``loss.backward()``, with the loss scaled first where ``auto_model(precision="16-mixed")``
    made a GradScaler; the same call on every backend and precision.

    Args:
        loss: the loss tensor.
        **kwargs: ``Tensor.backward``'s arguments (``retain_graph``, ``inputs``, ...).

    Example:
        >>> import torch, onedist as od
        >>> model = od.auto_model(torch.nn.Linear(4, 1), precision="bf16-mixed")
        >>> od.backward(model(torch.randn(8, 4)).pow(2).mean())
        >>> model.weight.grad.dtype      # the parameters and their gradients stay float32
        torch.float32
    """
    global _stepped
    if not isinstance(loss, torch.Tensor):
        raise bad_type("backward", "loss", loss, "a torch.Tensor")
    if _scaler is None:
        loss.backward(**kwargs)  # type: ignore[no-untyped-call]
        return
    if _stepped:  # the last iteration's steps are done: its scale update (lower after inf/NaN)
        _scaler.update()
        _stepped = False
    _scaler.scale(loss).backward(**kwargs)


def scaled_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``optimizer`` whose ``step()`` goes through the GradScaler when there is one (unscale, skip
    on inf/NaN; the scale is updated at the next :func:`backward`); unchanged otherwise. The class
    stays the optimizer's own."""
    if _scaler is None or getattr(optimizer, "_onedist_scaled", False):
        return optimizer
    plain_step: Callable[..., Any] = optimizer.step
    inside = threading.local()

    @functools.wraps(plain_step)
    def step(*args: Any, **kwargs: Any) -> Any:
        global _stepped
        if getattr(inside, "scaler", False) or _scaler is None:  # the scaler's own call: the real step
            return plain_step(*args, **kwargs)
        inside.scaler = True
        try:
            result = _scaler.step(optimizer, *args, **kwargs)
            _stepped = True
        finally:
            inside.scaler = False
        return result

    optimizer.step = step  # type: ignore[method-assign]
    optimizer._onedist_scaled = True  # type: ignore[attr-defined]
    return optimizer
