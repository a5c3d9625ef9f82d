"""The guard every public collective runs through: debug checks before, explanations after.

On the default path it costs one function call and a ``try`` (no communication, no frame
inspection); see :mod:`onedist.failures.explain` for what a failure becomes, and
:mod:`onedist.collectives.debug` for debug mode.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, NamedTuple, Optional, TypeVar

from ..errors import CollectiveMismatchError, OnedistError
from ..failures.explain import explain
from ..failures.stderr import store_noise_held_back
from ..state import world
from .debug import debug_check, describe_call

F = TypeVar("F", bound=Callable[..., Any])

#: the name of onedist.join's step check, the one collective a join context does not reroute
STEP_CHECK = "join_step_check"


class CallRecord(NamedTuple):
    """The public collective this process is in (:data:`onedist.state.world`'s ``call``): made
    on every call, read only when it blocks (the failure watcher's stall check describes it)."""

    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    #: the arguments the ranks compare, as ``name=(position, default)``
    spec: dict[str, Any]
    frame: Optional[FrameType]
    #: its number among its group's collectives (-1: a group it cannot key)
    seq: int
    #: the group argument as given (None: the default group)
    group: Any
    #: time.monotonic() when it began (how long it waits, in a stall report)
    started: float = 0.0

    def describe(self) -> dict[str, Any]:
        """What the ranks compare when it blocks (:func:`~onedist.collectives.debug.describe_call`)."""
        return describe_call(self)


# ---------------------------------------------------------------------------- the decorator
def guarded(name: str, group_arg: int, **spec: tuple[int, Any]) -> Callable[[F], F]:
    """Decorate a public collective.

    ``group_arg``: position of its ``group`` parameter; ``spec``: the arguments debug mode compares,
    as ``name=(position, default)`` (e.g. ``op=(1, "SUM")``).
    """

    def decorator(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.monotonic()
            w = world
            outer = w.call
            group, seq = None, -1
            try:
                if w.join is not None and name != STEP_CHECK:  # inside onedist.join: may wait
                    args, kwargs = w.join.route(name, args, kwargs, group_arg)
                group = kwargs.get("group", args[group_arg] if len(args) > group_arg else None)
                if group is None:
                    seq = w.world_calls = w.world_calls + 1
                    w.last_started = started
                else:
                    seq = group_call_number(w, group)
                # what this rank waits in, should the call block (a tuple: no work until it does)
                w.call = CallRecord(name, args, kwargs, spec, sys._getframe(), seq, group, started)
                if w.debug:  # its exchange is a collective too: a dead peer shows here first
                    debug_check(name, args, kwargs, group, spec)
                return fn(*args, **kwargs)
            except CollectiveMismatchError as e:
                if getattr(e, "found_elsewhere", False):  # a peer's verdict names every rank's call
                    raise _explained(name, e, group, started, seq) from None
                raise e.with_traceback(None) from None  # the ranks' calls tell it all, not our frames
            except OnedistError:
                raise
            except RuntimeError as e:
                err = _explained(name, e, group, started, seq)
                if err is e:
                    raise
                raise err from None  # the explanation stands alone (see OnedistError.backend_error)
            finally:
                w.call = outer

        return wrapper  # type: ignore[return-value]

    return decorator


def _explained(name: str, e: BaseException, group: Any, started: float, seq: int) -> BaseException:
    """The backend's error ``e`` as onedist explains it (:func:`~onedist.failures.explain.explain`)."""
    w = world
    w.explaining += 1
    try:
        with store_noise_held_back():
            err = explain(name, e, group, started, seq)
    finally:
        w.explaining -= 1
    if err is not e and isinstance(err, OnedistError):
        err.backend_error = e
    return err


def group_call_number(w: Any, group: Any) -> int:
    """This call's number among the collectives this process started on ``group`` (a list of
    ranks, in any order, or a handle), for the stall check; -1 for a group it cannot key."""
    try:
        key = tuple(sorted(group)) if isinstance(group, (list, tuple, range)) else group
        seq: int = w.group_calls.get(key, 0) + 1
        w.group_calls[key] = seq
    except TypeError:  # unhashable, or ranks that do not sort: debug mode or the call names it
        return -1
    return seq
