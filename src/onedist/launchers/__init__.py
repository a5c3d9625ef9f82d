"""Starting worker processes: the launch arguments, the launchers, one failure report.

* :mod:`.spawn`: :func:`onedist.spawn`, workers started by multiprocessing, and their supervisor.
* :mod:`.reexec`: ``Parallel(start_method="subprocess")``, the script re-run for the other ranks.
* :mod:`.run` and :mod:`.bootstrap`: ``onedist run`` (torchrun's flags) and its workers' entry.
* :mod:`.spec`: :class:`~.spec.LaunchSpec`, the arguments of one launch, checked once.
* :mod:`.supervisor`: one supervisor for the launchers that start their workers themselves
  (spawn, re-exec, ``onedist run``): watch, stop them all when one fails, collect the failures.
* :mod:`.checks`: arguments a way of starting cannot honour, refused before anything starts.
* :mod:`.worker`: what a worker is given (torchrun's variables, its thread count) and does at its
  end (its result or its failure written where the parent reads it).
* :mod:`.report`: one failure report format for every launcher (the failing rank first).
* the launchers of the backends whose processes must come from their own launcher:
  :mod:`.mpirun` (``mpirun``), :mod:`.horovodrun` (``horovod.run``), :mod:`.xmp`
  (``xmp.spawn``), found by :func:`own_launcher`.

Backends never import this package, the building blocks (spec, checks, worker, report,
supervisor) never import the launchers that use them, and the launchers never import one another
(CI checks these: ``lint-imports``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Optional

from .spec import LaunchSpec

__all__ = ["LaunchSpec", "own_launcher"]

#: backends whose workers a launcher of their own starts: backend name -> module with ``launch``
_OWN = {
    "mpi": "onedist.launchers.mpirun",
    "horovod": "onedist.launchers.horovodrun",
    "xla-tpu": "onedist.launchers.xmp",
}


def own_launcher(backend: str) -> Optional[Callable[[LaunchSpec], Optional[list[Any]]]]:
    """The launcher that starts ``backend``'s workers, or None when onedist's process launcher
    does. A launcher returns the workers' results in rank order, or None to leave the start to
    onedist's (mpirun for a world of one)."""
    module = _OWN.get(backend)
    if module is None:
        return None
    launch: Callable[[LaunchSpec], Optional[list[Any]]] = importlib.import_module(module).launch
    return launch
