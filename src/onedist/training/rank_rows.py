"""Every rank's row of a few numbers, on every rank, in one small all_gather.

:class:`onedist.Throughput` and :func:`onedist.log_metrics` need sums and maxima of a handful of
numbers per rank. Each rank sends its row and one :func:`onedist.all_gather` stacks them: one
collective, whatever the mix of reductions wanted (a sum of samples and a maximum of times; a mean
of one metric and a maximum of another), exact, and the same bits on every rank. A row is small
enough to travel inline in onedist's gather (one collective, no size exchange). An all_reduce
(SUM) of a ``world_size x k`` matrix of zeros with each rank's row filled in gives the same
numbers, but gloo reduces it in rounds, each waiting on the other rank: right after a training
step it took 1.5-1.9 ms on 2 ranks where the gather took 0.6 ms (medians, 2 cores). Inside
:func:`onedist.join` the gather returns the rows of the ranks still in their loops only, so a
mean is over them (the matrix would have kept a finished rank's row of zeros).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..collectives import all_gather
from ..context import current

__all__ = ["rank_rows"]


def rank_rows(values: Sequence[float]) -> torch.Tensor:
    """A ``ranks x len(values)`` float64 CPU tensor: a row per rank, in rank order, each that rank's
    ``values`` (inside :func:`onedist.join`, the ranks still in their loops). Call it on every rank
    with as many values; with one process, no collective."""
    # made a tensor in one call from Python numbers: a torch call per number costs more than the
    # numbers (tens of microseconds each, right after a step)
    row = torch.tensor([[float(v) for v in values]], dtype=torch.float64)
    if current().world_size == 1:
        return row
    rows: torch.Tensor = all_gather(row)
    return rows
