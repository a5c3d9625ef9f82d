"""The one object that holds this process's distributed state (:data:`world`).

Everything onedist remembers between calls lives here, in one place, as c10d keeps its mutable
world in one ``_World``: the active backend, debug mode, the failure machinery's flags and the
join context. Only the modules below write it, each its own part; everyone else only reads
(``tests/test_architecture.py`` compares this list with the code)::

    state                 backend, routes (current(): re-detected when the group went stale)
    context               backend, routes, world_calls, group_calls
    collectives.guard     call, world_calls, group_calls, last_started, explaining
    collectives.joined    call (od.join's step check)
    collectives.exchange  routes (how bytes travel, derived once per group and op)
    collectives.debug     debug
    collectives.helpers   one_rank_depth
    failures.channel      published
    failures.explain      explained
    failures.watcher      published, explained, watcher, watch_stop
    failures.hooks        hook_installed, previous_hook
    training.join         join

Nothing here imports above the backends, so every layer can use it.

Example:
    >>> from onedist.state import world
    >>> world.backend.model_name, world.backend.world_size
    ('serial', 1)
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, Optional, Protocol

from .backends import Backend, SerialBackend, detect_backend

__all__ = ["World", "current", "world"]


def _debug_from_environment() -> bool:
    return os.environ.get("ONEDIST_DEBUG", "").lower() in ("1", "true", "yes", "on")


class CallRouter(Protocol):
    """What the guard asks of an ``onedist.join`` context before each collective."""

    def route(
        self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], group_arg: int
    ) -> tuple[tuple[Any, ...], dict[str, Any]]: ...

    def check_peer(self, name: str, peer: int) -> None: ...


class RecordedCall(Protocol):
    """What the failure watcher reads of the collective a rank is blocked in."""

    @property
    def seq(self) -> int: ...

    @property
    def group(self) -> Any: ...

    def describe(self) -> dict[str, Any]: ...


class World:
    """This process's distributed state; one instance, :data:`world`."""

    __slots__ = (
        "backend",
        "call",
        "debug",
        "explained",
        "explaining",
        "group_calls",
        "hook_installed",
        "join",
        "last_started",
        "one_rank_depth",
        "previous_hook",
        "published",
        "routes",
        "watch_stop",
        "watcher",
        "world_calls",
    )

    def __init__(self) -> None:
        #: the active backend (``context`` re-detects it when the group it holds went stale)
        self.backend: Backend = SerialBackend()
        #: debug mode: every collective checks that the ranks make the same call first
        self.debug = _debug_from_environment()
        #: > 0 while inside a ``one_rank_only`` function (debug mode flags collectives there)
        self.one_rank_depth = 0
        #: > 0 while the main thread turns a failed collective into its own error (a timeout
        #: report takes seconds): the failure watcher leaves it alone meanwhile
        self.explaining = 0
        #: the main thread raised a stall verdict or a peer's failure read from the store (its own
        #: call explained it): the failure watcher does not raise it into the main thread again,
        #: where it would land in the program's handler of the first (failures.watcher)
        self.explained = False
        #: this rank published its own failure to the store
        self.published = False
        #: the failure excepthook is installed; the hook it replaced
        self.hook_installed = False
        self.previous_hook: Optional[Callable[..., Any]] = None
        #: the public collective this process is in (``onedist.collectives.guard.CallRecord``),
        #: None outside one: the failure watcher reads it when the call blocks (failures.stall)
        self.call: Optional[RecordedCall] = None
        #: how many collectives on the default group this process started (all ranks agree)
        self.world_calls = 0
        #: the same per sub-group (a sorted rank tuple or a group handle -> count)
        self.group_calls: dict[Any, int] = {}
        #: when the last collective on the default group began (time.monotonic), for the check
        #: at finalize
        self.last_started = 0.0
        #: what the collectives derive once per backend: (group, op) -> how bytes travel
        #: (onedist.collectives.exchange.channels); emptied whenever ``backend`` changes
        self.routes: dict[Any, Any] = {}
        #: inside ``onedist.join``: who is still in the loop, and what a collective becomes
        #: (``onedist.collectives.joined.JoinedRanks``, set and cleared by ``onedist.training.join``)
        self.join: Optional[CallRouter] = None
        #: the failure watcher thread and the event that stops it (None when not running)
        self.watcher: Optional[threading.Thread] = None
        self.watch_stop: Optional[threading.Event] = None


#: the state of this process
world = World()


def current() -> Backend:
    """The active backend, re-detected only when the one held went stale (a pointer check)."""
    b = world.backend
    if b.is_stale():
        if not isinstance(b, SerialBackend):
            b.finalize()  # the user destroyed the group: restore what onedist set
        b = world.backend = detect_backend()
        world.routes = {}
    return b
