"""What each rank alone knows of a training run, for a step checkpoint: one dict per rank.

Ranks differ in their RNG states (dropout on different data), in the gradients they accumulated
in an open :func:`~onedist.accumulate` window (their own micro-batches, not yet exchanged), and,
inside :func:`~onedist.join` or with uneven loaders, in how far their loaders and windows got.
:func:`rank_state` is that dict; :func:`~onedist.save_training_state` gathers every rank's to the
writer, and :func:`~onedist.resume` gives each rank its own back.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .accumulation import micro_steps, pending_gradients
from .positions import position
from .rng import rng_state

__all__ = ["rank_state"]


def rank_state(model: Optional[torch.nn.Module], loader: Any) -> dict[str, Any]:
    """This rank's part of a step checkpoint: its RNG states; with ``model``, the micro-steps
    :func:`~onedist.accumulate` counted and, in an open window, the gradients accumulated; with
    ``loader`` (tracked), its position (:func:`~onedist.training.positions.position`).

    Example:
        >>> import torch
        >>> sorted(rank_state(torch.nn.Linear(2, 1), None))
        ['rng']
    """
    state: dict[str, Any] = {"rng": rng_state()}
    counted = None if model is None else micro_steps(model)
    if model is not None and counted is not None:
        calls, open_window = counted
        state["micro_steps"] = [calls, open_window]
        if open_window:
            state["gradients"] = pending_gradients(model)
    if loader is not None:
        state["loader"] = position(loader)
    return state
