"""``auto_model(..., activation_checkpointing=...)``: recompute each block's activations in the
backward pass instead of keeping them.

Each chosen block's ``forward`` becomes ``torch.utils.checkpoint.checkpoint(forward, ...,
use_reentrant=False)`` (the block's own attribute, set on the instance): the forward pass keeps only
the block's inputs, and the backward pass runs the block's forward again, with the random state it
had (dropout draws alike), before its gradients. The model keeps its structure: no wrapper module,
so ``isinstance``, attribute access and the state dict's keys are the model's own, and a checkpoint
saved with activation checkpointing loads without it. Under ``torch.no_grad()`` the block runs
plainly.

Which blocks:

* ``True``: the units FSDP2 shards (:mod:`onedist.training.sharding`: the blocks of every
  ``nn.ModuleList``, or ``policy=``'s with ``sharding="fsdp"``);
* a module class, or a set of them: every instance (not the root);
* a function ``(module) -> bool``: every submodule for which it returns True.

A block inside another chosen block is not checkpointed twice (the outer one recomputes it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import bad_type, bad_value

__all__ = ["check_activation_checkpointing", "checkpoint_blocks"]

_ALLOWED = "None, True, a torch.nn.Module class (or a set of them), or a function (module) -> bool"


def check_activation_checkpointing(value: Any) -> Any:
    """``value`` checked (None: no checkpointing)."""
    if value is None or value is False:
        return None
    if value is True or (isinstance(value, type) and issubclass(value, torch.nn.Module)):
        return value
    if isinstance(value, (set, frozenset, list, tuple)) and value:
        if all(isinstance(c, type) and issubclass(c, torch.nn.Module) for c in value):
            return tuple(value)
    elif callable(value) and not isinstance(value, type):
        return value
    raise bad_type("auto_model", "activation_checkpointing", value, _ALLOWED)


def checkpoint_blocks(
    model: torch.nn.Module, value: Any, units: Callable[[torch.nn.Module], list[torch.nn.Module]]
) -> list[torch.nn.Module]:
    """Put the blocks ``value`` chooses (``units(model)`` for True) under activation checkpointing;
    the blocks, outer before inner."""
    if value is True:
        chosen = units(model)
    elif isinstance(value, (type, tuple)):
        chosen = [m for m in model.modules() if m is not model and isinstance(m, value)]
    else:
        chosen = [m for m in model.modules() if m is not model and value(m)]
    if not chosen:
        raise bad_value(
            "auto_model",
            "activation_checkpointing",
            value,
            "a choice of blocks that finds at least one in the model",
            hint="True checkpoints the blocks of the model's nn.ModuleLists (or the sharding policy's "
            f"units): {type(model).__name__} has none; name the block class instead",
        )
    inside: set[int] = set()
    done = []
    for block in chosen:
        if id(block) in inside:
            continue
        inside.update(id(m) for m in block.modules())
        if not isinstance(block.forward, _Recomputed):
            block.forward = _Recomputed(block.forward)
        done.append(block)
    return done


class _Recomputed:
    """A block's forward run under ``torch.utils.checkpoint`` (non-reentrant) when gradients are on."""

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.forward = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)
