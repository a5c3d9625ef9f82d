"""What ``onedist run --recovery live`` tells its workers, read without torch: the variables and
the store keys the launcher and the workers share. The recovery itself is
:mod:`onedist.training.live_steps`'s (the workers) and :mod:`onedist.launchers.replacement`'s (the launcher).

A *generation* is one make-up of the group: 0 for the workers first started, one more for each
replacement the launcher starts. A replacement is started with its generation in
:data:`GENERATION_ENV`, and the launcher then sets :func:`generation_key`; the survivors wait for
that key, and every rank makes the new group's connections under :func:`group_prefix` of the same
store, so that no key or port of an earlier generation is ever met again.

Before that, every member of the new generation *meets* (:func:`meet`): each counts itself in
under :func:`meet_key`, and the launcher, which sees every death, decides (:func:`decision_key`):
:data:`GO` once all ``world_size`` members are counted in and none has died, :data:`NEXT` when
another rank died first, whose replacement starts the next generation, where they all meet again.
So ranks that die at once (or one after the other, before the group is made again) are replaced
together, in the last generation, and a group is never made with a dead member, but for one that
dies after the launcher's decision and before the group is made (its peers then wait for the
group's timeout).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

__all__ = [
    "ALLOWED",
    "ENV",
    "GENERATION_ENV",
    "LIVE",
    "MODES",
    "READY_KEY",
    "STARTED_ENV",
    "SUPPORTED_BACKENDS",
    "GO",
    "NEXT",
    "decision_key",
    "generation",
    "generation_key",
    "group_prefix",
    "is_live",
    "joined",
    "meet",
    "meet_key",
    "own_key",
    "set_joined",
]

#: the variable that asks the workers for live recovery (``onedist run --recovery live`` sets it)
ENV = "ONEDIST_RECOVERY"
#: the generation a replacement is started in (unset: 0, the first workers)
GENERATION_ENV = "ONEDIST_LIVE_GENERATION"
#: when the launcher started a replacement (``time.time()``), for the replacement's log line
STARTED_ENV = "ONEDIST_LIVE_STARTED"
#: the recovery modes
MODES = ("restart", "live")
LIVE = "live"
#: what ``recovery`` allows
ALLOWED = (
    "'restart' (a failure restarts every worker: the default) or 'live' (the survivors keep their "
    "processes, the dead rank is replaced and gets the state from a survivor)"
)
#: the backends live recovery runs on (their group can be made again on the same store)
SUPPORTED_BACKENDS = ("gloo", "shm")
#: each rank adds 1 once its loop runs under ``od.steps``: the launcher replaces a rank only then
READY_KEY = "onedist/live/ready"
#: the launcher's decisions on a generation's meeting (see :func:`meet`)
GO, NEXT = b"go", b"next"
#: how long a rank waits at a meeting for the launcher's decision
MEET_WAIT_S = 300.0

_joined: list[int] = []  # the generation this process's group is in, once it met there (or 0)


def is_live(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` asks for live recovery.

    Example:
        >>> is_live({"ONEDIST_RECOVERY": "live"}), is_live({})
        (True, False)
    """
    return environ.get(ENV, "") == LIVE


def generation(environ: Mapping[str, str]) -> int:
    """The generation this process was started in (0: one of the first workers).

    Example:
        >>> generation({"ONEDIST_LIVE_GENERATION": "2"}), generation({})
        (2, 0)
    """
    return int(environ.get(GENERATION_ENV, "0") or "0")


def generation_key(number: int) -> str:
    """The key the launcher sets once the replacement of generation ``number`` is started."""
    return f"onedist/live/generation/{number}"


def group_prefix(number: int) -> str:
    """The store prefix of the connections of generation ``number`` ("" for the first).

    Example:
        >>> group_prefix(0), group_prefix(3)
        ('', 'live-3/')
    """
    return f"live-{number}/" if number else ""


def meet_key(number: int) -> str:
    """The count of the members of generation ``number`` that arrived at its meeting."""
    return f"onedist/live/meet/{number}"


def own_key(rank: int) -> str:
    """Where rank ``rank`` keeps its own state of its latest step (its RNG states, and its module's
    buffers where they are its own), for a replacement of it: ``onedist.training.live_state``."""
    return f"onedist/live/own/{rank}"


def decision_key(number: int) -> str:
    """The launcher's decision on generation ``number``'s meeting: :data:`GO` or :data:`NEXT`."""
    return f"onedist/live/decision/{number}"


def _unprefixed(store: Any) -> Any:
    """The store under torch's prefixes (a group's store is its name's ``PrefixStore``)."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


def meet(store: Any, number: int, wait_s: float = MEET_WAIT_S) -> int:
    """Count this rank in at generation ``number``'s meeting and wait for the launcher's
    decision; on :data:`NEXT` (another rank died meanwhile) do the same at the next generation.
    Returns the generation every member met in (see the module doc); also :func:`joined` from now."""
    store = _unprefixed(store)
    deadline = time.monotonic() + wait_s
    while True:
        store.add(meet_key(number), 1)
        left = max(deadline - time.monotonic(), 0.001)
        store.wait([decision_key(number)], timedelta(seconds=left))
        if store.get(decision_key(number)) == GO:
            set_joined(number)
            return number
        number += 1


def joined(environ: Mapping[str, str], store: Any = None) -> int:
    """The generation this process's group is in: 0 for a first worker, else the one it met in
    (a replacement, given ``store``, meets at its first call: the group it is making)."""
    if not _joined:
        number = generation(environ)
        if number and store is not None:
            return meet(store, number)
        return number
    return _joined[0]


def set_joined(number: int) -> None:
    """This process's group was made again in generation ``number``."""
    _joined[:] = [number]
