"""Every rank learns how a checkpoint step went, so none waits in the next collective for a rank
that raised.

* :func:`on_writer`: one rank does the step (writes a file, makes a directory); one broadcast gives
  every rank its result, or its error.
* :func:`on_every_rank`: every rank does the step (reads a file); one all_gather tells each rank
  whether another failed.

The rank that failed raises its own error; the others raise :class:`~onedist.RemoteRankError`
naming it, with its error's type and message, or, when that rank found a checkpoint damaged,
:class:`~onedist.CheckpointCorruptError`: every rank then raises the error that callers (such as
:func:`onedist.resume`, which skips a damaged step) act on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, TypeVar

from ..errors import CheckpointCorruptError, RemoteRankError

__all__ = ["on_every_rank", "on_writer"]

T = TypeVar("T")


def on_writer(writer: int, step: Callable[[], Any], failure: str) -> Any:
    """``step()`` on global rank ``writer``, then one broadcast: every rank returns the writer's
    result, or raises (``failure``, followed by the writer's error, on the others). Every rank
    must call it.

    Example:
        >>> import onedist as od
        >>> on_writer(0, lambda: "written", "rank 0 could not write")
        'written'
    """
    from ..collectives import broadcast_object
    from ..context import current

    result: Any = None
    error: Optional[BaseException] = None
    status: Optional[str] = None
    if current().rank == writer:
        try:
            result = step()
        except Exception as e:
            error, status = e, f"{type(e).__name__}: {e}"
    result, status = broadcast_object((result, status), src=writer)
    if error is not None:
        raise error
    if status is not None:
        raise RemoteRankError(f"{failure}. Its error: {status}", rank=writer)
    return result


def on_every_rank(step: Callable[[], T], failure: Callable[[int], str]) -> T:
    """``step()`` on every rank, then (several ranks) one all_gather of whether it failed: a rank
    whose step failed raises its error, the others the first failure (``failure(rank)``, followed
    by that rank's error). When any rank found a checkpoint damaged, every rank raises
    :class:`~onedist.CheckpointCorruptError` (its own, or that rank's faults), so that every rank
    takes the same decision on it. Every rank must call it.

    Example:
        >>> on_every_rank(lambda: 3, lambda rank: f"rank {rank} failed")
        3
    """
    from ..collectives import all_gather_object
    from ..context import current

    result: Any = None
    error: Optional[BaseException] = None
    try:
        result = step()
    except Exception as e:
        error = e
    if current().world_size > 1:
        statuses = all_gather_object(None if error is None else _status(error))
        failed = [(r, s) for r, s in enumerate(statuses) if s is not None]
        damaged = [(r, s) for r, s in failed if s[1] is not None]
        if damaged and not isinstance(error, CheckpointCorruptError):  # every rank raises what resume acts on
            rank, (status, faults) = damaged[0]
            raise CheckpointCorruptError(f"{failure(rank)}. Its error: {status}", faults) from error
        if error is None and failed:
            rank, (status, _) = failed[0]
            raise RemoteRankError(f"{failure(rank)}. Its error: {status}", rank=rank)
    if error is not None:
        raise error
    out: T = result
    return out


def _status(error: BaseException) -> tuple[str, Optional[dict[str, str]]]:
    """What the other ranks learn of ``error``: its type and message, and a damaged file's faults."""
    faults = error.faults if isinstance(error, CheckpointCorruptError) else None
    return f"{type(error).__name__}: {error}", faults
