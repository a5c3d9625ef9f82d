"""Starting worker processes: the launch arguments, the launchers, one failure report.

* :mod:`.launcher`: :class:`~.launcher.Launcher`, the interface every way of starting implements,
  with the one restart loop.
* :mod:`.spawn`: :func:`onedist.spawn`, and :func:`~.spawn.launcher_for`, which picks the
  launcher of a launch (by plain imports of the launcher modules).
* the launchers, one module each: :mod:`.processes` (onedist's own, multiprocessing),
  :mod:`.reexec` (``Parallel(start_method="subprocess")``, the script re-run for the other ranks),
  :mod:`.run` (``onedist run``, torchrun's flags; :mod:`.bootstrap` is its workers' entry), and
  those of the backends whose processes must come from their own launcher: :mod:`.mpirun`
  (``mpirun``), :mod:`.horovodrun` (``horovod.run``), :mod:`.xmp` (``xmp.spawn``).
* :mod:`.arguments`: the launch arguments declared once (name, type, default, torchrun flag,
  ``PET_*`` variable, ignite's name, rule), from which the front ends are derived.
* :mod:`.spec`: :class:`~.spec.LaunchSpec`, the arguments of one launch, checked once.
* :mod:`.supervisor`: one supervisor for the launchers that start their workers themselves
  (processes, re-exec, ``onedist run``): watch, stop them all when one fails, collect the failures.
* :mod:`.checks`: a function the chosen start method cannot carry, refused before anything starts.
* :mod:`.worker`: what a worker is given (torchrun's variables, its thread count) and does at its
  end (its result or its failure written where the parent reads it).
* :mod:`.report`: one failure report format for every launcher (the failing rank first).

Backends never import this package, the building blocks (arguments, pet, spec, checks, worker, report,
supervisor, launcher) never import the launchers that use them, and the launchers never import
one another (CI checks these: ``lint-imports``).
"""

from __future__ import annotations

from .spec import LaunchSpec

__all__ = ["LaunchSpec"]
