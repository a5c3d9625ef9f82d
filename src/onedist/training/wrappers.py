"""The wrappers auto_model puts around a model, and :func:`unwrap`, which takes them off."""

from __future__ import annotations

import torch

__all__ = ["WRAPPERS", "unwrap"]

#: the modules that hold the user's model as ``.module``
WRAPPERS = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP / DataParallel / ``torch.compile`` wrappers (``model`` if none).

    Example:
        >>> import torch, onedist as od
        >>> inner = torch.nn.Linear(2, 2)
        >>> od.unwrap(torch.nn.DataParallel(inner)) is inner
        True
    """
    seen = 0
    while seen < 16:
        if isinstance(model, WRAPPERS):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):  # torch.compile
            model = model._orig_mod
        else:
            return model
        seen += 1
    return model
