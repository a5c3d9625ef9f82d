"""Collectives on tensors, Python numbers, strings, any picklable object, and nested containers.

This package is the only place where Python values become tensors and back: a backend only sees
contiguous tensors on its communication device.

* Reductions (:func:`all_reduce`, :func:`reduce`; ``reductions.py``, packing in ``packing.py``) take
  tensors, numbers and dicts/lists/tuples of those. A nested value is reduced in **one collective
  per (device, dtype)**, not one per leaf. Python floats travel as float64 and ints as int64, so
  they come back exact.
* Data movement (:func:`all_gather`, :func:`broadcast`, :func:`gather`, :func:`scatter`;
  ``gathers.py``, ``broadcasts.py`` over ``exchange.py``) takes anything picklable; tensors inside
  travel as raw bytes. Sizes are negotiated in a fixed-size first round that also carries small
  values, so an object, a string, a number or a small tensor costs one collective, and tensors
  whose first dimension differs per rank need no padding (see :mod:`onedist.collectives.wire`).
* Inputs are never modified unless the function says in-place; results come back on the
  caller's device and dtype.
* ``group`` is None (every rank), a list of global ranks (the group is created once and cached)
  or a group handle. Ranks outside the group get their input back unchanged.
* Every public collective runs through :func:`~onedist.collectives.guard.guarded` (debug mode,
  failures that name ranks).
"""

from __future__ import annotations

from .base import AsyncResult, GroupLike
from .broadcasts import broadcast, broadcast_object, scatter
from .gathers import all_gather, all_gather_object, all_gather_tensors_with_shapes, gather
from .groups import barrier, new_group
from .p2p import irecv, isend, recv, send
from .reductions import all_reduce, reduce

__all__ = [
    "AsyncResult",
    "GroupLike",
    "all_gather",
    "all_gather_object",
    "all_gather_tensors_with_shapes",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_object",
    "gather",
    "irecv",
    "isend",
    "new_group",
    "recv",
    "reduce",
    "scatter",
    "send",
]
