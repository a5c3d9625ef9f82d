"""The torch release a training feature needs, checked where the feature is asked for.

onedist installs with torch >= 2.1; some features call torch APIs that came later (FSDP2's
``fully_shard`` and ``get_total_norm``: 2.6; ``torch.amp.GradScaler(device)``: 2.3). On an older
torch they would fail deep inside with an ``ImportError`` or ``AttributeError``: here they raise
at once, naming the argument, the torch release found and the one needed.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ..errors import bad_value

__all__ = ["require_torch", "torch_release"]


def torch_release() -> tuple[int, int]:
    """torch's (major, minor) release, from ``torch.__version__`` ("2.13.0+cpu" -> (2, 13)).

    Example:
        >>> torch_release() >= (2, 1)
        True
    """
    match = re.match(r"(\d+)\.(\d+)", str(torch.__version__))
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def require_torch(func: str, argument: str, value: Any, release: tuple[int, int]) -> None:
    """Raise naming ``argument=value`` when this torch is older than ``release``.

    Example:
        >>> require_torch("auto_model", "sharding", "fsdp", (99, 0))
        Traceback (most recent call last):
        ...
        onedist.errors.OnedistValueError: onedist.auto_model: sharding='fsdp' is not allowed; allowed: ...
    """
    if torch_release() < release:
        needed = ".".join(map(str, release))
        raise bad_value(
            func,
            argument,
            value,
            f"what torch {torch.__version__} has: {argument}={value!r} needs torch >= {needed}",
            hint=f"pip install 'torch>={needed}'",
        )
