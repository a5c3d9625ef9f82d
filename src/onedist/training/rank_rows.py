"""Every rank's row of a few numbers, on every rank, in one small all_reduce.

:class:`onedist.Throughput` and :func:`onedist.log_metrics` need sums and maxima of a handful of
numbers per rank. Rank r writes its numbers into row r of a ``world_size x k`` float64 matrix of
zeros and one SUM all_reduce fills every row on every rank: one collective, whatever the mix of
reductions wanted (a sum of samples and a maximum of times; a mean of one metric and a maximum
of another), exact (each entry is one rank's value plus zeros), and the same bits on every rank.
An all_gather would do the same with a size exchange first on backends where first dimensions
may differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..collectives import all_reduce
from ..context import current

__all__ = ["rank_rows"]


def rank_rows(values: Sequence[float]) -> torch.Tensor:
    """A ``world_size x len(values)`` float64 CPU tensor: row r holds rank r's ``values``. Call it
    on every rank with as many values; with one process, no collective."""
    backend = current()
    world_size = backend.world_size
    # the matrix built in Python and made a tensor in one call: the torch calls cost more than
    # the numbers (tens of microseconds each, right after a step)
    table = [[0.0] * len(values)] * world_size
    table[backend.rank] = [float(v) for v in values]
    rows = torch.tensor(table, dtype=torch.float64)
    if world_size > 1:
        all_reduce(rows)
    return rows
