"""What every collective shares: reduction-op names, argument checks, group resolution, async results."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import torch

from ..backends import Backend, Work
from ..errors import OnedistTypeError, bad_type, bad_value
from ..state import world

CPU = torch.device("cpu")


U8 = torch.uint8


OP_NAMES = {
    "SUM": "SUM",
    "PRODUCT": "PRODUCT",
    "PROD": "PRODUCT",
    "MIN": "MIN",
    "MAX": "MAX",
    "AND": "AND",
    "BAND": "AND",
    "OR": "OR",
    "BOR": "OR",
    "MEAN": "MEAN",
    "AVERAGE": "MEAN",
    "AVG": "MEAN",
}


ALLOWED_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AND", "OR", "MEAN")


CHECKED_OPS = frozenset({"AND", "OR"})


PLAIN_OPS = frozenset({"SUM", "PRODUCT", "MIN", "MAX"})  # ops with dtype restrictions beyond complex numbers


GroupLike = Union[None, Sequence[int], Any]


# ============================================================================ arguments
def op_name(func: str, op: Any) -> str:
    name = OP_NAMES.get(op) if isinstance(op, str) else None
    if name is None:
        if isinstance(op, str):
            name = OP_NAMES.get(op.upper())
        elif op is not None:  # torch.distributed.ReduceOp / RedOpType
            name = OP_NAMES.get(str(getattr(op, "name", op)).rsplit(".", 1)[-1].upper())
        if name is None:
            raise bad_value(func, "op", op, (*ALLOWED_OPS, "AVERAGE"), says="Unsupported reduction operation")
    return name


def check_op_dtype(func: str, op: str, dtype: torch.dtype, where: str = "") -> None:
    if op in ("AND", "OR") and (dtype.is_floating_point or dtype.is_complex):
        raise OnedistTypeError(
            f"onedist.{func}: op={op!r} needs bool or integer values, got dtype {dtype}{where}\n"
            "HINT: use MIN/MAX for a logical AND/OR of 0./1. floats, or convert with .bool()"
        )
    if dtype.is_complex and op not in ("SUM", "MEAN"):
        raise OnedistTypeError(f"onedist.{func}: op={op!r} is not defined for complex dtype {dtype}{where}")


# ignite's words for a group argument that is not one, which its users' code may match on
IGNITE_BAD_RANKS = {
    "ranks": "Argument ranks should be list of int",
    "group": "Argument group should be list of int or ProcessGroup",
}


def check_ranks(func: str, arg: str, ranks: Any, world_size: int, empty: bool = False) -> tuple[int, ...]:
    """The sorted, distinct global ranks of ``ranks``; ``empty``: [] is allowed (it stays ())."""
    says = IGNITE_BAD_RANKS[arg]
    if not isinstance(ranks, (list, tuple, range)) or (len(ranks) == 0 and not empty):
        raise bad_value(func, arg, ranks, "a non-empty list of global ranks", says=says)
    seen = set()
    for r in ranks:
        if not isinstance(r, int) or isinstance(r, bool):
            raise bad_value(func, arg, list(ranks), f"ints in 0..{world_size - 1} ({r!r} is not)", says=says)
        if not 0 <= r < world_size:
            raise bad_value(
                func, arg, list(ranks), f"ranks in 0..{world_size - 1} (rank {r} is out of range)"
            )
        if r in seen:
            raise bad_value(func, arg, list(ranks), f"distinct ranks (rank {r} appears twice)")
        seen.add(r)
    return tuple(sorted(seen))


def check_peer(func: str, arg: str, value: Any, b: Backend, ranks: Optional[Sequence[int]]) -> None:
    """Validate a global ``src``/``dst``; ``ranks``: the group's ranks (None: the world, (): unknown)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad_type(func, arg, value, "int (a global rank)")
    if not 0 <= value < b.world_size:
        raise bad_value(func, arg, value, f"a global rank in 0..{b.world_size - 1}")
    if world.join is not None:  # inside onedist.join: a rank that left its loop answers no one
        world.join.check_peer(func, value)  # (before the group: od.join narrowed the default one)
    if ranks and value not in ranks:
        raise bad_value(func, arg, value, f"a rank of the group {list(ranks)}")


# ============================================================================ async results
class AsyncResult:
    """What a collective called with ``async_op=True`` returns.

    :meth:`wait` blocks until the communication is done and returns the same value the
    synchronous call would have returned.

    Example:
        >>> import onedist as od
        >>> handle = od.all_reduce(torch.ones(3), async_op=True)
        >>> # ... overlap computation here ...
        >>> handle.wait()
        tensor([1., 1., 1.])
    """

    __slots__ = ("_done", "_finish", "_result", "_works")

    def __init__(self, works: list[Optional[Work]], finish: Callable[[], Any]) -> None:
        self._works = [w for w in works if w is not None]
        self._finish = finish
        self._done = False
        self._result: Any = None

    def is_completed(self) -> bool:
        """True when :meth:`wait` would not block."""
        return self._done or all(w.is_completed() for w in self._works)  # type: ignore[attr-defined]

    def wait(self) -> Any:
        """Wait for the communication and return the collective's result."""
        if not self._done:
            with torch.no_grad():  # a backend may copy into the caller's tensors here
                for w in self._works:
                    w.wait()
                self._result = self._finish()
            self._done = True
            self._works = []
        return self._result


def done(value: Any, async_op: bool) -> Any:
    return AsyncResult([], lambda: value) if async_op else value


def resolve_group(func: str, b: Backend, group: GroupLike) -> tuple[Any, int, tuple[int, ...]]:
    """(group handle, my group rank or -1, the group's global ranks; () when unknown here)."""
    if group is None:
        return None, b.rank, tuple(range(b.world_size))
    if isinstance(group, (list, tuple, range)):
        ranks = check_ranks(func, "group", group, b.world_size)
        g = b.new_group(ranks)
        return g, (ranks.index(b.rank) if b.rank in ranks else -1), ranks
    try:
        me = b.group_rank(group)
    except (TypeError, ValueError, AttributeError, RuntimeError):
        raise bad_value(
            func,
            "group",
            group,
            "None, a list of global ranks, or a group from new_group",
            says=IGNITE_BAD_RANKS["group"],
        ) from None
    return group, me, (b.group_ranks(group) if me >= 0 else ())
