"""``od.clip_grad_norm_``: gradient clipping that is right for sharded and unsharded models alike.

The norm is over the whole model: with FSDP2 each rank holds a shard of every gradient (a
DTensor), and the norm of the shards is reduced over the ranks (torchtitan's way:
``get_total_norm``, then ``full_tensor()``); with DDP every rank holds the whole, already averaged
gradient. Under ``precision="16-mixed"`` the gradients carry the GradScaler's scale until the
optimizer's step: they are unscaled first, through the optimizer (the step then does not unscale
again).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..errors import bad_type, bad_value
from . import precision
from .join_sharded import clip_in_join
from .sharding import is_sharded

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    model: torch.nn.Module,
    max_norm: float,
    norm_type: float = 2.0,
    optimizer: Optional[torch.optim.Optimizer] = None,
) -> torch.Tensor:
    """Scale ``model``'s gradients so that their total norm is at most ``max_norm``; the total norm
    before clipping (a plain tensor, the same on every rank).

    Call it between the backward pass and ``optimizer.step()``, on every rank.

    Args:
        model: the model :func:`~onedist.auto_model` returned (DDP, FSDP2 or plain).
        max_norm: the largest total norm allowed (> 0).
        norm_type: the p of the p-norm (2.0; ``float("inf")`` for the largest entry).
        optimizer: the model's optimizer; needed under ``precision="16-mixed"``, whose gradients
            are unscaled first.

    Example:
        >>> import torch, onedist as od
        >>> model = od.auto_model(torch.nn.Linear(4, 1))
        >>> od.backward(model(torch.ones(2, 4)).sum() * 100)
        >>> float(od.clip_grad_norm_(model, max_norm=1.0)) > 1.0   # the norm before clipping
        True
        >>> round(float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm()), 4)
        1.0
    """
    from ..context import current

    if not isinstance(model, torch.nn.Module):
        raise bad_type("clip_grad_norm_", "model", model, "a torch.nn.Module (the model auto_model returned)")
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise bad_value("clip_grad_norm_", "max_norm", max_norm, "a number > 0")
    b = current()
    if b.model_parallelism != "ddp" and b.world_size > 1:
        raise bad_value(
            "clip_grad_norm_",
            "model",
            type(model).__name__,
            "a model of torch.distributed's backends (gloo, nccl, shm, mpi) or of one process",
            hint=f"backend {b.backend!r} averages the gradients inside optimizer.step(): clipping "
            "before it would clip each rank's own gradients",
        )
    _unscale(optimizer)
    joined = clip_in_join(model, max_norm, norm_type) if is_sharded(model) else None
    if joined is not None:  # inside od.join once a rank has left: the finished ranks clip too
        return joined
    params = [p for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)  # type: ignore[misc]
    full = getattr(total, "full_tensor", None)  # a DTensor: the shards' norm, reduced over the ranks
    if full is not None:
        total = full()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _unscale(optimizer: Any) -> None:
    scaler = precision.active_scaler()
    if scaler is None:
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise bad_value(
            "clip_grad_norm_",
            "optimizer",
            optimizer,
            "the model's optimizer (auto_optim's) under precision='16-mixed'",
            hint="its gradients carry the GradScaler's scale until the step: they are unscaled first",
        )
    scaler.unscale_(optimizer)
