"""Every rank learns how a checkpoint step went, so none waits in the next collective for a rank
that raised.

* :func:`on_writer`: one rank does the step (writes a file, makes a directory); one broadcast gives
  every rank its result, or its error.
* :func:`on_every_rank`: every rank does the step (reads a file); one all_gather tells each rank
  whether another failed.

The rank that failed raises its own error; the others raise :class:`~onedist.RemoteRankError`
naming it, with its error's type and message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, TypeVar

from ..errors import RemoteRankError

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
    by that rank's error). Every rank must call it.

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
        statuses = all_gather_object(None if error is None else f"{type(error).__name__}: {error}")
        failed = [(r, s) for r, s in enumerate(statuses) if s is not None]
        if error is None and failed:
            rank, status = failed[0]
            raise RemoteRankError(f"{failure(rank)}. Its error: {status}", rank=rank)
    if error is not None:
        raise error
    out: T = result
    return out
