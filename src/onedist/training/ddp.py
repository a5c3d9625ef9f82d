"""DistributedDataParallel for auto_model: its options checked, communication hooks by name
(fp16/bf16 compression, PowerSGD, post-localSGD) and post-localSGD model averaging.

:func:`onedist.auto_model` checks every backend's options here, and wraps the model here for the
backends whose ``model_parallelism`` is "ddp" (torch.distributed's: gloo, nccl, shm, mpi).
"""

from __future__ import annotations

import inspect
import logging
import os
import weakref
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch.nn.parallel import DistributedDataParallel

from .._recovery import generation
from ..errors import bad_value

__all__ = ["COMM_HOOKS", "averager_for", "check_options", "wrap_ddp"]

logger = logging.getLogger("onedist")

#: names accepted by ``auto_model(comm_hook=...)``
COMM_HOOKS = ("fp16", "bf16", "powersgd", "batched_powersgd", "post_localsgd")
_WRAPPERS = ("fp16", "bf16")
_ONEDIST_OPTIONS = (
    "comm_hook",
    "comm_hook_kwargs",
    "comm_hook_state",
    "comm_wrapper",
    "model_averaging_period",
)

# parameter id -> (weak reference to the parameter, its model averager); auto_optim looks here
_AVERAGERS: dict[int, tuple[Any, Any]] = {}


def _ddp_parameters() -> frozenset[str]:
    names = set(inspect.signature(DistributedDataParallel.__init__).parameters)
    return frozenset(names - {"self", "module", "process_group"})


def _bf16_compress(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """torch's ``bf16_compress_hook`` under another name, for gloo (see _resolve_hook)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


# DDP checks a hook's annotations as objects (this module's are strings: __future__ annotations)
_bf16_compress.__annotations__ = {
    "state": Any,
    "bucket": getattr(torch.distributed, "GradBucket"),  # noqa: B009 (not in torch.distributed's __all__)
    "return": torch.futures.Future[torch.Tensor],
}


def _resolve_hook(
    name_or_fn: Any, kwargs: dict[str, Any], state: Any, local_group: Any
) -> tuple[Callable[..., Any], Any, Optional[dict[str, Any]]]:
    """(hook, state, post-localSGD settings or None) for ``comm_hook=name_or_fn``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if callable(name_or_fn):
        if kwargs:
            raise bad_value(
                "auto_model",
                "comm_hook_kwargs",
                kwargs,
                "None with a callable comm_hook (pass comm_hook_state)",
            )
        return name_or_fn, state, None
    if name_or_fn not in COMM_HOOKS:
        raise bad_value("auto_model", "comm_hook", name_or_fn, f"one of {COMM_HOOKS} or a callable hook")
    if state is not None:
        raise bad_value(
            "auto_model", "comm_hook_state", state, f"None with comm_hook={name_or_fn!r} (it makes its own)"
        )
    if name_or_fn in ("fp16", "bf16"):
        if kwargs:
            raise bad_value("auto_model", "comm_hook_kwargs", kwargs, f"None with comm_hook={name_or_fn!r}")
        hook: Callable[..., Any] = (
            default_hooks.fp16_compress_hook if name_or_fn == "fp16" else default_hooks.bf16_compress_hook
        )
        if name_or_fn == "bf16" and not torch.cuda.is_available():
            hook = _bf16_compress  # DDP refuses torch's by name without NCCL; gloo reduces bf16 fine
        return hook, None, None
    if name_or_fn in ("powersgd", "batched_powersgd"):
        opts = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 1_000, **kwargs}
        try:
            power_state = powerSGD_hook.PowerSGDState(process_group=None, **opts)
        except TypeError as e:
            raise bad_value(
                "auto_model", "comm_hook_kwargs", kwargs, f"keyword arguments of PowerSGDState ({e})"
            ) from e
        fn = powerSGD_hook.powerSGD_hook if name_or_fn == "powersgd" else powerSGD_hook.batched_powerSGD_hook
        return fn, power_state, None
    # post-localSGD: global all-reduce for start_localSGD_iter steps, then only within the subgroup
    # (this node by default), with the model averaged globally every model_averaging_period steps
    # onedist's handle for "every rank" is None, which PostLocalSGDState would replace by CUDA-sized
    # subgroups; name the world explicitly
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook

    subgroup = dist.group.WORLD if local_group is None else local_group
    opts = {"start_localSGD_iter": 1_000, "subgroup": subgroup, **kwargs}
    try:
        local_state = post_localSGD_hook.PostLocalSGDState(process_group=None, **opts)  # type: ignore[no-untyped-call]
    except TypeError as e:
        raise bad_value(
            "auto_model", "comm_hook_kwargs", kwargs, f"keyword arguments of PostLocalSGDState ({e})"
        ) from e
    return post_localSGD_hook.post_localSGD_hook, local_state, {"warmup_steps": opts["start_localSGD_iter"]}


def check_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split auto_model's options into onedist's and DDP's; raise on names neither knows."""
    ddp_names = _ddp_parameters()
    ours = {k: options[k] for k in _ONEDIST_OPTIONS if k in options}
    ddp_kwargs = {k: v for k, v in options.items() if k not in ours}
    unknown = sorted(k for k in ddp_kwargs if k not in ddp_names)
    if unknown:
        raise bad_value(
            "auto_model",
            unknown[0],
            ddp_kwargs[unknown[0]],
            "a keyword argument of DistributedDataParallel ("
            + ", ".join(sorted(ddp_names))
            + ") or of onedist ("
            + ", ".join(_ONEDIST_OPTIONS)
            + ")",
        )
    if "device_ids" in ddp_kwargs or "output_device" in ddp_kwargs:
        given = "device_ids" if "device_ids" in ddp_kwargs else "output_device"
        raise bad_value(
            "auto_model", given, ddp_kwargs[given], "not given: onedist sets it from the local rank's device"
        )
    return ours, ddp_kwargs


def wrap_ddp(
    model: torch.nn.Module,
    device: torch.device,
    sync_bn: bool,
    ours: dict[str, Any],
    ddp_kwargs: dict[str, Any],
    local_group: Callable[[], Any],
) -> torch.nn.Module:
    """``DistributedDataParallel(model, ...)`` with auto_model's options applied.

    ``ddp_kwargs``: DDP's own keyword arguments (passed through); ``ours``: onedist's
    ``comm_hook``, ``comm_hook_kwargs``, ``comm_hook_state``, ``comm_wrapper``,
    ``model_averaging_period`` (both as :func:`check_options` split them).
    """
    ddp_kwargs = dict(ddp_kwargs)
    if sync_bn:
        if device.type != "cuda":
            # ignite's (torch's) answer, now instead of at DDP's first look; onedist's own
            # SyncBatchNorm works on any device, but only when asked for by name
            raise bad_value(
                "auto_model",
                "sync_bn",
                True,
                "True only on CUDA devices (torch's SyncBatchNorm)",
                hint="model = od.convert_sync_batchnorm(model) before auto_model gives onedist's "
                "SyncBatchNorm, which works on CPU too",
                says=f"SyncBatchNorm layers only work with GPU modules (this model is on {device.type})",
            )
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)  # type: ignore[no-untyped-call]
    if device.type == "cuda":
        ddp_kwargs["device_ids"] = [device.index]
        ddp_kwargs["output_device"] = device.index
    if generation(os.environ) and "init_sync" not in ddp_kwargs:
        # a live recovery's replacement: the survivors are not in DDP's constructor, and the
        # state comes from one of them (onedist.training.live_state)
        ddp_kwargs["init_sync"] = False
    wrapped = DistributedDataParallel(model, **ddp_kwargs)

    hook_name = ours.get("comm_hook")
    period = ours.get("model_averaging_period")
    if hook_name is None:
        for key in ("comm_hook_kwargs", "comm_hook_state", "comm_wrapper", "model_averaging_period"):
            if ours.get(key) is not None:
                raise bad_value("auto_model", key, ours[key], "None unless comm_hook is given")
        return wrapped
    group = local_group() if hook_name == "post_localsgd" else None
    hook, state, averaging = _resolve_hook(
        hook_name, dict(ours.get("comm_hook_kwargs") or {}), ours.get("comm_hook_state"), group
    )
    wrapper = ours.get("comm_wrapper")
    if wrapper is not None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        if wrapper not in _WRAPPERS:
            raise bad_value("auto_model", "comm_wrapper", wrapper, f"one of {_WRAPPERS}")
        hook = (
            default_hooks.fp16_compress_wrapper if wrapper == "fp16" else default_hooks.bf16_compress_wrapper
        )(hook)
    wrapped.register_comm_hook(state, hook)
    if averaging is None:
        if period is not None:
            raise bad_value(
                "auto_model", "model_averaging_period", period, "None unless comm_hook='post_localsgd'"
            )
        return wrapped
    if not isinstance(period, int) or isinstance(period, bool) or period < 1:
        raise bad_value(
            "auto_model",
            "model_averaging_period",
            period,
            "an int >= 1 with comm_hook='post_localsgd' (average the model every that many steps)",
        )
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    averager = PeriodicModelAverager(period=period, warmup_steps=averaging["warmup_steps"])
    for p in wrapped.parameters():
        _AVERAGERS[id(p)] = (weakref.ref(p), averager)
    return wrapped


def averager_for(optimizer: torch.optim.Optimizer) -> Any:
    """The post-localSGD averager of the model whose parameters ``optimizer`` updates, or None."""
    found = None
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = _AVERAGERS.get(id(p))
            if entry is not None and entry[0]() is p:
                found = entry[1]
    for key in [k for k, (ref, _) in _AVERAGERS.items() if ref() is None]:
        del _AVERAGERS[key]
    return found
