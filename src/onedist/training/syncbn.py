"""Synchronised batch normalisation for every device: torch's ``SyncBatchNorm`` runs on GPUs only.

:class:`SyncBatchNorm` normalises with the statistics of the global batch (all ranks), on CPU too
(gloo), through onedist's collectives, so it also works on any backend onedist supports. One
``all_gather`` of (count, mean, M2) per layer forward (Chan et al.'s parallel variance: no
cancellation, exact for uneven per-rank batches) and one ``all_reduce`` per layer backward,
the same traffic as torch's CUDA implementation. :func:`convert_sync_batchnorm` swaps the
BatchNorm layers of a model; ``auto_model(sync_bn=True)`` uses torch's on CUDA and this elsewhere.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]


def _stat_shape(x: torch.Tensor) -> list[int]:
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: Optional[torch.Tensor],
        bias: Optional[torch.Tensor],
        running_mean: Optional[torch.Tensor],
        running_var: Optional[torch.Tensor],
        eps: float,
        factor: float,
        group: Any,
    ) -> torch.Tensor:
        from ..collectives import all_gather

        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        count = xf.numel() // channels
        var_l, mean_l = torch.var_mean(xf, dim=dims, correction=0)
        row = torch.cat([xf.new_tensor([float(count)]), mean_l, var_l * count]).unsqueeze(0)
        rows = all_gather(row, group=group)  # (world, 1 + 2C): count, mean, M2 per rank
        counts = rows[:, :1]
        total = counts.sum()
        mean = (counts * rows[:, 1 : 1 + channels]).sum(0) / total
        m2 = (rows[:, 1 + channels :] + counts * (rows[:, 1 : 1 + channels] - mean) ** 2).sum(0)
        var = m2 / total
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None and running_var is not None:
            n = float(total)
            unbiased = var * (n / (n - 1)) if n > 1 else var
            running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
            running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)
        shape = _stat_shape(x)
        xhat = (xf - mean.view(shape)) * invstd.view(shape)
        y = xhat
        if weight is not None:
            y = y * weight.view(shape)
        if bias is not None:
            y = y + bias.view(shape)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.total = float(total)
        ctx.group = group
        out: torch.Tensor = y.to(x.dtype)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        from ..collectives import all_reduce

        xhat, weight, invstd = ctx.saved_tensors
        channels = xhat.shape[1]
        dims = [0, *range(2, xhat.dim())]
        shape = _stat_shape(xhat)
        g = grad_out.to(xhat.dtype)
        sum_dy = g.sum(dims)
        sum_dy_xhat = (g * xhat).sum(dims)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            sums = all_reduce(torch.cat([sum_dy, sum_dy_xhat]), group=ctx.group)
            mean_dy = (sums[:channels] / ctx.total).view(shape)
            mean_dy_xhat = (sums[channels:] / ctx.total).view(shape)
            scale = invstd if weight is None else invstd * weight
            grad_x = ((g - mean_dy - xhat * mean_dy_xhat) * scale.view(shape)).to(grad_out.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = sum_dy_xhat.to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_b = sum_dy.to(grad_out.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the global batch of all ranks (or of ``process_group``'s ranks), on any device.

    Takes any input of shape ``(N, C, ...)``. In training mode the mean and variance are those of
    every rank's batch together (ranks may have different batch sizes); running statistics are
    updated with them, identically on every rank. In eval mode, or with one process, it is plain
    BatchNorm. Every rank of the group must call it (it runs a collective).

    Args:
        num_features: the number of channels ``C``.
        eps: added to the variance for stability, as in ``torch.nn.BatchNorm1d``.
        momentum: the running statistics' update factor, as in ``torch.nn.BatchNorm1d``.
        affine: learn a per-channel scale and shift.
        track_running_stats: keep running mean and variance for eval mode.
        process_group: None (all ranks) or a list of ranks.

    Example:
        >>> import torch, onedist as od
        >>> bn = od.SyncBatchNorm(3)
        >>> bn(torch.randn(4, 3, 5)).shape
        torch.Size([4, 3, 5])
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            from ..errors import bad_value

            raise bad_value("SyncBatchNorm", "input", tuple(input.shape), "a tensor of shape (N, C, ...)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        from ..context import get_world_size

        self._check_input_dim(input)
        use_batch = self.training or not self.track_running_stats
        if not use_batch or get_world_size() == 1:
            return super().forward(input)
        track = self.training and self.track_running_stats
        factor = 0.0 if self.momentum is None else self.momentum
        if track and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        out: torch.Tensor = _SyncBatchNormFn.apply(  # type: ignore[no-untyped-call]
            input,
            self.weight,
            self.bias,
            self.running_mean if track else None,
            self.running_var if track else None,
            self.eps,
            factor,
            self.process_group,
        )
        return out


def convert_sync_batchnorm(module: torch.nn.Module, process_group: Any = None) -> torch.nn.Module:
    """Replace every BatchNorm layer of ``module`` by :class:`SyncBatchNorm` (weights and stats kept).

    Example:
        >>> import torch, onedist as od
        >>> net = od.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm2d(4)))
        >>> type(net[0]).__name__
        'SyncBatchNorm'
    """
    converted = module
    if isinstance(module, _BatchNorm) and not isinstance(module, (SyncBatchNorm, torch.nn.SyncBatchNorm)):
        converted = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
        )
        if module.affine:
            with torch.no_grad():
                converted.weight = module.weight
                converted.bias = module.bias
        converted.running_mean = module.running_mean
        converted.running_var = module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.training = module.training
        if hasattr(module, "qconfig"):
            converted.qconfig = module.qconfig
    for name, child in module.named_children():
        converted.add_module(name, convert_sync_batchnorm(child, process_group))
    return converted
