"""A model sharded on the CPU: glibc's malloc keeps the buffers each step gathers and frees.

FSDP2 allocates every unit's gathered parameters, the all-gather's output and the reduce-scatter's
input for each forward and backward, and frees them after (that is how a rank keeps 1/N of the
model). glibc's malloc hands an allocation above its mmap threshold (dynamic, 32 MiB at most by
default) straight to the kernel and gives it back on ``free``: every such buffer page-faults and
is zeroed again on first touch. Here a 33.6 MB tensor allocated and filled took 13.8 ms fresh and
4.0 ms from the heap; a 50 M-parameter FSDP2 step on 2 ranks, whose blocks are 33.6 MB units,
took 1.33x a DDP step with fresh buffers and 1.00-1.04x with the heap's (docs/performance.md).

So when ``auto_model`` shards a model on the CPU it raises glibc's mmap threshold to twice the
largest unit's bytes (:func:`keep_freed_buffers`), and the trim threshold to twice that: the freed
buffers stay in the heap and the next gather reuses them, warm. The price: the process keeps the
step's transient memory once it has reached it (its RSS does not fall back between steps), and the
heap's fragments raised the peak by 5 % on average, 11 % at most, in the benchmark, for a step 16 %
faster (``bench_sharding.py --parts heap``). Nothing changes where the C library is not glibc,
where you set the threshold yourself (``MALLOC_MMAP_THRESHOLD_``, or ``mmap_threshold`` in
``GLIBC_TUNABLES``), or with ``ONEDIST_CPU_HEAP=0``; onedist only ever raises it.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

from ..errors import bad_value

__all__ = ["keep_freed_buffers", "unit_bytes"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
_INT_MAX = (1 << 31) - 1  # mallopt takes a C int
_raised_to = 0  # the mmap threshold onedist set in this process (bytes); 0: none


def _enabled() -> bool:
    raw = os.environ.get("ONEDIST_CPU_HEAP", "1")
    if raw not in ("0", "1"):
        raise bad_value("ONEDIST_CPU_HEAP", "ONEDIST_CPU_HEAP", raw, '"1" (the default) or "0"')
    user_set = "MALLOC_MMAP_THRESHOLD_" in os.environ or "mmap_threshold" in os.environ.get(
        "GLIBC_TUNABLES", ""
    )
    return raw == "1" and not user_set


def _mallopt() -> Any:
    """glibc's ``mallopt``, or None where the C library is another (musl, macOS)."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    fn = libc.mallopt
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn


def keep_freed_buffers(nbytes: int) -> bool:
    """Let glibc's malloc serve allocations of up to ``nbytes`` from its heap and keep up to twice
    that free at its top (never lowered below what onedist set before); True when it changed.

    Example:
        >>> keep_freed_buffers(0)  # nothing to raise
        False
    """
    global _raised_to
    nbytes = min(int(nbytes), _INT_MAX // 2)
    if nbytes <= max(_raised_to, 32 << 20) or not _enabled():  # at or under glibc's own maximum
        return False
    mallopt = _mallopt()
    if mallopt is None or mallopt(_M_MMAP_THRESHOLD, nbytes) != 1:
        return False
    mallopt(_M_TRIM_THRESHOLD, 2 * nbytes)
    _raised_to = nbytes
    return True


def unit_bytes(model: Any, units: list[Any]) -> int:
    """The bytes of the largest unit's own parameters (those of no unit inside it): what one
    gather of it allocates. ``units`` outer before inner; the root's own parameters count too.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 8))
        >>> unit_bytes(net, [net[1]])  # the unit: 40 floats; the root's own: 20
        160
    """
    claimed: set[int] = set()
    sizes = []
    for unit in [*reversed(units), model]:  # inner units first
        own = [p for p in unit.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in own)
        sizes.append(sum(p.numel() * p.element_size() for p in own))
    return max(sizes, default=0)
