"""Synchronisation and groups: :func:`barrier`, :func:`new_group`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..context import current
from .base import AsyncResult, GroupLike, check_ranks, done, resolve_group
from .guard import guarded


# ============================================================================ sync and groups
@guarded("barrier", 0)
def barrier(group: GroupLike = None, *, async_op: bool = False) -> Any:
    """Wait until every rank of the group arrives (NCCL: on this rank's GPU).

    Example:
        >>> import onedist as od
        >>> od.barrier()
    """
    b = current()
    g, me, _ = resolve_group("barrier", b, group)
    if me < 0:
        return done(None, async_op)
    work = b.barrier_(g, async_op)
    return AsyncResult([work], lambda: None) if async_op else None


def new_group(ranks: Sequence[int], **kwargs: Any) -> Any:
    """The group of these global ranks, created once and cached.

    Only the members take part in creating it (torch's local synchronization), so a group can be
    made and used inside ``if rank in ranks:``. The same list (in any order) returns the same
    group; the list of every rank returns None (the default group).

    Args:
        ranks: distinct global ranks.
        **kwargs: passed to ``torch.distributed.new_group`` (``backend``, ``timeout``, ...).

    Example:
        >>> import onedist as od
        >>> group = od.new_group([0])
        >>> od.all_reduce(1, group=group)
        1
    """
    b = current()
    members = check_ranks("new_group", "ranks", ranks, b.world_size, empty=True)
    if not members and b.model_name != "serial":
        members = tuple(range(b.world_size))  # torch's (so ignite's) meaning of []: every rank
    return b.new_group(members, **kwargs)
