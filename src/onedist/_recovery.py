"""What ``onedist run --recovery live`` tells its workers, read without torch: the variables and
the store keys the launcher and the workers share. The recovery itself is
:mod:`onedist.training.live_steps`'s (the workers) and :mod:`onedist.launchers.replacement`'s (the launcher).

A *generation* is one make-up of the group: 0 for the workers first started, one more for each
replacement the launcher starts. A replacement is started with its generation in
:data:`GENERATION_ENV`, and the launcher then sets :func:`generation_key`; the survivors wait for
that key, and every rank makes the new group's connections under :func:`group_prefix` of the same
store, so that no key or port of an earlier generation is ever met again.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "ALLOWED",
    "ENV",
    "GENERATION_ENV",
    "LIVE",
    "MODES",
    "READY_KEY",
    "STARTED_ENV",
    "SUPPORTED_BACKENDS",
    "generation",
    "generation_key",
    "group_prefix",
    "is_live",
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
SUPPORTED_BACKENDS = ("gloo",)
#: each rank adds 1 once its loop runs under ``od.steps``: the launcher replaces a rank only then
READY_KEY = "onedist/live/ready"


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
