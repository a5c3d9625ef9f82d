"""A process's random number generators' states, read and set back (for step checkpoints).

torch's CPU generator, CUDA's when available, Python's ``random`` and NumPy's global one when
installed, in types ``torch.load(weights_only=True)`` reads back.
"""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["own_tensors", "rng_state", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    """This process's RNG states.

    Example:
        >>> import torch
        >>> state = rng_state()
        >>> a = torch.rand(2); set_rng_state(state); torch.equal(a, torch.rand(2))
        True
    """
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state["numpy"] = [kind, torch.from_numpy(np.array(keys)), int(pos), int(has_gauss), float(cached)]
    return state


def own_tensors(value: Any) -> Any:
    """``value`` with each tensor copied into storage of its own: a gathered tensor may be a view
    into one buffer of every rank's bytes, which ``torch.set_rng_state`` misreads (segfault).

    Example:
        >>> import torch
        >>> buffer = torch.arange(4)
        >>> own_tensors({"a": [buffer[2:]]})["a"][0].untyped_storage().nbytes()
        16
    """
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: own_tensors(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(own_tensors(v) for v in value)
    return value


def set_rng_state(state: dict[str, Any]) -> None:
    """Set this process's RNG states to ``state`` (what :func:`rng_state` returned).

    Example:
        >>> import random
        >>> state = rng_state(); a = random.random(); set_rng_state(state); a == random.random()
        True
    """
    state = own_tensors(state)
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            return
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy(), pos, has_gauss, cached))
