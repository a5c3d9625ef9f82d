"""Collectives that autograd goes through (detectron2's ``differentiable_all_reduce`` and
``differentiable_all_gather``): the gradient of each rank's input gathers the gradients that every
rank's outputs received.

* :func:`differentiable_all_reduce`: the sum over the ranks; every rank's output depends on every
  rank's input, so the input's gradient is the sum of the output gradients over the ranks.
* :func:`differentiable_all_gather`: one tensor per rank (this rank's own entry included); the
  input's gradient is the sum over the ranks of the gradient each gave this rank's entry.

Both run on every backend through onedist's collectives; with one process they return the input
(as a one-element list for the gather), as detectron2 does.
"""

from __future__ import annotations

from typing import Any

import torch

from ..context import current
from ..errors import bad_type
from .gathers import all_gather
from .reductions import all_reduce

__all__ = ["differentiable_all_gather", "differentiable_all_reduce"]


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = all_reduce(x, inplace=False)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = all_reduce(grad, inplace=False)
        return out


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        gathered: torch.Tensor = all_gather(x.unsqueeze(0))  # every rank's x, stacked
        return tuple(gathered.unbind(0))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> torch.Tensor:
        summed: torch.Tensor = all_reduce(torch.stack(grads), inplace=False)
        return summed[current().rank]


def _check(func: str, x: Any) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise bad_type(func, "input", x, "a torch.Tensor (the same shape and dtype on every rank)")
    return x


def differentiable_all_reduce(input: torch.Tensor) -> torch.Tensor:
    """The sum of ``input`` over the ranks, with gradients that flow back to every rank's input.

    Every rank must call it with a tensor of the same shape and dtype; the backward pass is a
    collective too (every rank runs it). With one process: ``input`` itself.

    Example:
        >>> import torch, onedist as od
        >>> x = torch.ones(3, requires_grad=True)
        >>> od.differentiable_all_reduce(x * 2).sum().backward()
        >>> x.grad.tolist() == [2.0 * od.get_world_size()] * 3
        True
    """
    x = _check("differentiable_all_reduce", input)
    if current().world_size == 1:
        return x
    out: torch.Tensor = _AllReduce.apply(x)  # type: ignore[no-untyped-call]
    return out


def differentiable_all_gather(input: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``input``, one tensor per rank in rank order, with gradients that flow back:
    this rank's input gets the sum of the gradients every rank's outputs gave its entry.

    Every rank must call it with a tensor of the same shape and dtype (a list of tensors, as
    detectron2 returns; :func:`onedist.all_gather` concatenates instead). With one process:
    ``[input]``.

    Example:
        >>> import torch, onedist as od
        >>> x = torch.ones(2, requires_grad=True)
        >>> parts = od.differentiable_all_gather(x)
        >>> len(parts) == od.get_world_size()
        True
    """
    x = _check("differentiable_all_gather", input)
    if current().world_size == 1:
        return [x]
    return list(_AllGather.apply(x))  # type: ignore[no-untyped-call]
