"""Failures that name ranks: what a failing rank tells the others, and how the others learn it.

* ``channel.py``: the store side channel, each rank's failure and timeout reports;
* ``hooks.py``: how a failing rank leaves (excepthook, its error printed first, peers wait for it);
* ``watcher.py``: a thread per rank that ends it soon after another rank failed;
* ``stall.py``, ``last_call.py``: ranks blocked in different collectives, during the run and at
  ``finalize``;
* ``explain.py``: a backend's error in a collective, turned into onedist's (which rank failed,
  which ranks never arrived, what each was doing);
* ``stderr.py``: torch's C++ noise about a store whose host left, held back meanwhile.

Backends never import this package; ``context`` installs it when a group forms, and the guard of
every collective (:mod:`onedist.collectives.guard`) uses its explanations.
"""

from __future__ import annotations

from .channel import publish_failure
from .forced_exit import on_forced_exit
from .hooks import install, let_failed_rank_exit_first, report_and_release, uninstall
from .last_call import check_at_finalize
from .stderr import release_stderr, without_store_noise
from .watcher import start_watch, stop_watch

__all__ = [
    "check_at_finalize",
    "install",
    "let_failed_rank_exit_first",
    "on_forced_exit",
    "publish_failure",
    "release_stderr",
    "report_and_release",
    "start_watch",
    "stop_watch",
    "uninstall",
    "without_store_noise",
]
