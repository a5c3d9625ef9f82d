"""Helpers on top of the collectives: rank filters, ordered sections, shared seeds, metric dicts."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import wraps
from typing import Any, Optional, TypeVar

from ..context import current
from ..errors import RemoteRankError, bad_type, bad_value
from ..state import world
from .base import GroupLike
from .broadcasts import broadcast
from .gathers import all_gather_object
from .groups import barrier
from .reductions import all_reduce

__all__ = [
    "create_local_process_group",
    "one_rank_first",
    "one_rank_only",
    "reduce_dict",
    "shared_random_seed",
    "synchronize",
]

F = TypeVar("F", bound=Callable[..., Any])


def _check_rank_arg(func: str, rank: Any) -> None:
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise bad_type(func, "rank", rank, "int >= 0")
    if rank < 0:
        raise bad_value(func, "rank", rank, "an int >= 0")


def one_rank_only(rank: int = 0, with_barrier: bool = False) -> Callable[[F], F]:
    """Decorator: run the function on global rank ``rank`` only (None is returned elsewhere).

    Args:
        rank: the rank that runs it.
        with_barrier: every rank waits at a barrier after the call (all ranks must then call the
            decorated function).

    Example:
        >>> import onedist as od
        >>> @od.one_rank_only()
        ... def save(path):
        ...     return f"saved {path}"
        >>> save("model.pt")
        'saved model.pt'
    """
    _check_rank_arg("one_rank_only", rank)

    def decorator(func: F) -> F:
        @wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = None
            if current().rank == rank:
                world.one_rank_depth += 1  # debug mode flags collectives in here
                try:
                    result = func(*args, **kwargs)
                finally:
                    world.one_rank_depth -= 1
            if with_barrier:
                barrier()
            return result

        return wrapper  # type: ignore[return-value]

    return decorator


@contextmanager
def one_rank_first(rank: int = 0, local: bool = False) -> Iterator[None]:
    """Context manager: ``rank`` runs the block first, the others after it finished.

    For downloads and cache builds. If the first rank's block raises, the waiting ranks raise
    :class:`~onedist.RemoteRankError` with its error instead of waiting forever (one small
    collective, like ignite's barrier).

    Args:
        rank: the rank that goes first (global, or local with ``local=True``).
        local: ``rank`` is a local rank: on every node, that local rank goes first.

    Example:
        >>> import onedist as od
        >>> with od.one_rank_first(local=True):
        ...     data = "downloaded once per node"
    """
    _check_rank_arg("one_rank_first", rank)
    b = current()
    lay = b.layout()
    size = lay.nproc_per_node if local else b.world_size
    if rank >= size:
        what = "local rank in 0.." if local else "rank in 0.."
        raise bad_value(
            "one_rank_first",
            "rank",
            rank,
            f"a {what}{size - 1}",
            says=f"rank should be between 0 and {size - 1}, but given {rank}",
        )
    if b.world_size == 1:
        yield
        return
    me = lay.local_rank if local else b.rank
    node = lay.node_rank if local else 0
    if me == rank:
        try:
            yield
        except BaseException as e:
            all_gather_object((True, node, f"{type(e).__name__}: {e}"))
            raise
        all_gather_object((True, node, None))
        return
    statuses = all_gather_object((False, node, None))
    for global_rank, (is_leader, leader_node, error) in enumerate(statuses):
        if is_leader and leader_node == node and error is not None:
            raise RemoteRankError(
                f"onedist.one_rank_first: rank {global_rank} failed inside the block it ran first, so "
                f"this rank does not run it. Its error: {error}",
                rank=global_rank,
            )
    yield


def shared_random_seed() -> int:
    """A random int in [0, 2**31) that is the same on every rank (drawn on rank 0).

    Example:
        >>> import onedist as od
        >>> seed = od.shared_random_seed()
        >>> 0 <= seed < 2**31
        True
    """
    seed = int.from_bytes(os.urandom(4), "little") % 2**31 if current().rank == 0 else None
    result: int = broadcast(seed, src=0, safe_mode=True)
    return result


def reduce_dict(
    input_dict: Mapping[Any, Any], average: bool = True, group: GroupLike = None
) -> dict[Any, Any]:
    """Reduce a dict of scalar metrics (tensors or numbers) in one collective per dtype.

    Unlike detectron2's version (which leaves the result on rank 0 only), every rank gets the
    result.

    Args:
        input_dict: metric name → tensor or number; ranks may insert the keys in any order.
        average: mean over ranks (True) or sum (False).
        group: None (every rank), a list of global ranks, or a group handle.

    Example:
        >>> import torch
        >>> import onedist as od
        >>> od.reduce_dict({"loss": torch.tensor(0.25), "acc": 0.5})
        {'loss': tensor(0.2500), 'acc': 0.5}
    """
    if not isinstance(input_dict, Mapping):
        raise bad_type("reduce_dict", "input_dict", input_dict, "a dict of tensors or numbers")
    result: dict[Any, Any] = all_reduce(dict(input_dict), op="MEAN" if average else "SUM", group=group)
    return result


def create_local_process_group(num_workers_per_machine: int) -> Any:
    """detectron2's call after starting processes without its ``launch()``: here the group of the
    ranks on this machine, :func:`onedist.get_local_process_group` (onedist knows where the ranks
    run: nothing to create), after checking ``num_workers_per_machine`` against it.

    Raises:
        OnedistValueError: ``num_workers_per_machine`` is not the number of ranks on this machine
            (detectron2 would build groups of the wrong ranks from it).

    Example:
        >>> import onedist as od
        >>> group = od.create_local_process_group(od.get_local_size())
    """
    from ..context import get_local_process_group, get_local_size

    n = num_workers_per_machine
    if not isinstance(n, int) or isinstance(n, bool):
        raise bad_type("create_local_process_group", "num_workers_per_machine", n, "an int >= 1")
    local = get_local_size()
    if n != local:
        raise bad_value(
            "create_local_process_group",
            "num_workers_per_machine",
            n,
            f"{local}, the number of ranks on this machine",
        )
    return get_local_process_group()


def synchronize(group: Optional[GroupLike] = None) -> None:
    """Barrier among all ranks; a no-op when serial (detectron2's name).

    Example:
        >>> import onedist as od
        >>> od.synchronize()
    """
    if current().world_size > 1:
        barrier(group)
