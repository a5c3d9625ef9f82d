"""The one object that holds this process's distributed state (:data:`world`).

Everything onedist remembers between calls lives here, in one place, as c10d keeps its mutable
world in one ``_World``: the active backend, debug mode, and the failure machinery's flags. The
modules that own each part write it (``context`` the backend, ``collectives.debug`` the debug
flag, ``failures`` the watcher); everyone else only reads. Nothing here imports above the
backends, so every layer can use it.

Example:
    >>> from onedist.state import world
    >>> world.backend.model_name, world.backend.world_size
    ('serial', 1)
"""

from __future__ import annotations

import os
from typing import Any

from .backends import Backend, SerialBackend, detect

__all__ = ["World", "current", "world"]


def _debug_from_environment() -> bool:
    return os.environ.get("ONEDIST_DEBUG", "").lower() in ("1", "true", "yes", "on")


class World:
    """This process's distributed state; one instance, :data:`world`."""

    __slots__ = (
        "backend",
        "call",
        "debug",
        "describe_call",
        "explaining",
        "group_calls",
        "hook_installed",
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
        #: this rank published its own failure to the store
        self.published = False
        #: the failure excepthook is installed; the hook it replaced
        self.hook_installed = False
        self.previous_hook: Any = None
        #: the public collective this process is in (name, args, kwargs, compared arguments, the
        #: frame, its number among its group's collectives or -1, the group argument), None outside
        #: one: the failure watcher reads it when the call blocks (onedist.failures.stall)
        self.call: Any = None
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
        #: call record -> what the ranks compare ({"call", "site", "sig"}); set by the collectives
        self.describe_call: Any = None
        #: the failure watcher thread and the event that stops it (None when not running)
        self.watcher: Any = None
        self.watch_stop: Any = None


#: the state of this process
world = World()


def current() -> Backend:
    """The active backend, re-detected only when the one held went stale (a pointer check)."""
    b = world.backend
    if b.is_stale():
        if not isinstance(b, SerialBackend):
            b.finalize()  # the user destroyed the group: restore what onedist set
        b = world.backend = detect()
        world.routes = {}
    return b
