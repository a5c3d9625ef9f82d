"""The one interface every way of starting a job's workers implements: :class:`Launcher`.

Lightning Fabric's ``_Launcher`` is the model (a launcher is built from what it starts and has one
``launch``). onedist's adds the one restart loop: a launcher says how to run one *attempt* (start
the workers, watch them until they end, return their failures) and, where it differs from the
default, whether a failed attempt is restarted and what a finished run returns; :meth:`launch`
runs the attempts. :func:`onedist.spawn`, ``Parallel``, ``onedist run`` and the backends' own
launchers (mpirun, horovod.run, xmp.spawn) all start their workers through ``launch``.
"""

from __future__ import annotations

import abc
import sys
from typing import Any, ClassVar, Optional

from .report import Failure, failure_error, restart_line
from .spec import LaunchSpec

__all__ = ["Launcher", "SingleAttemptLauncher", "restart_verdict", "restarts_left"]


def restarts_left(attempt: int, max_restarts: int) -> bool:
    """Whether a restart is left after attempt ``attempt`` (0 first) of ``max_restarts``."""
    return attempt < max_restarts


def restart_verdict(
    attempt: int, max_restarts: int, *, failed: bool, signalled: bool = False, rejoin: bool = False
) -> str:
    """The one decision after an attempt, for every launcher (one node's or several nodes' agreed):
    "done" when no worker failed, "restart" when one did and :func:`restarts_left`, else "end". A
    signal to a launcher (Ctrl-C, SIGTERM) ends the job: it is never restarted. ``rejoin``: the
    nodes of an elastic job changed (the workers were stopped for a node that joins, or failed only
    because another node's did or left): restarted, without counting (as torchrun's agent).

    Example:
        >>> restart_verdict(0, 2, failed=True), restart_verdict(2, 2, failed=True)
        ('restart', 'end')
        >>> restart_verdict(0, 2, failed=True, signalled=True), restart_verdict(0, 2, failed=False)
        ('end', 'done')
        >>> restart_verdict(2, 2, failed=False, rejoin=True)
        'restart'
    """
    if signalled:
        return "end"
    if rejoin:
        return "restart"
    if not failed:
        return "done"
    return "restart" if restarts_left(attempt, max_restarts) else "end"


class Launcher(abc.ABC):
    """One way of starting a job's workers. Subclasses set :attr:`name` and implement
    :meth:`attempt` and :meth:`results`; the restart loop (:meth:`launch`) is the same for all."""

    #: how the restart lines and reports name this way of starting ("onedist.spawn", ...)
    name: ClassVar[str]

    def __init__(self, max_restarts: int = 0) -> None:
        self.max_restarts = max_restarts

    @abc.abstractmethod
    def attempt(self, number: int) -> list[Failure]:
        """Start the workers once (``number``: 0 first, then each restart), watch them until every
        one has ended; their failures (empty: all succeeded). May raise instead when this way of
        starting cannot be restarted (its own report is then the error)."""

    @abc.abstractmethod
    def results(self) -> list[Any]:
        """What the last, successful attempt's workers returned (in local-rank order)."""

    def restart(self, number: int, failures: list[Failure]) -> Optional[list[Failure]]:
        """After attempt ``number``: the failures the restart line reports if the workers
        are started again, or None to stop (called after every attempt: a launcher that agrees
        with other nodes may restart after a success here). Default: while ``max_restarts``
        allows (:func:`restart_verdict`)."""
        verdict = restart_verdict(number, self.max_restarts, failed=bool(failures))
        return failures if verdict == "restart" else None

    def finish(self, failures: list[Failure]) -> list[Any]:
        """The run's outcome after its last attempt: the results, or the failure raised."""
        if failures:
            raise failure_error(failures)
        return self.results()

    def launch(self) -> list[Any]:
        """Run attempts until one succeeds or :meth:`restart` says stop (one line on stderr per
        restart); :meth:`finish`'s outcome."""
        number = 0
        while True:
            failures = self.attempt(number)
            reported = self.restart(number, failures)
            if reported is None:
                return self.finish(failures)
            number += 1
            if reported:  # none: the launcher said why itself (an elastic job's nodes changed)
                sys.stderr.write(restart_line(self.name, reported, number, self.max_restarts))
                sys.stderr.flush()


class SingleAttemptLauncher(Launcher):
    """A launcher that is never restarted from here (the backends' own launchers, the re-exec one):
    its one attempt returns the workers' results or raises their failure with its own report.
    Restart such a job from outside, with ``od.resume``."""

    def __init__(self, spec: LaunchSpec) -> None:
        super().__init__()
        self.spec = spec
        self._results: list[Any] = []

    @abc.abstractmethod
    def run(self) -> list[Any]:
        """Start the workers of :attr:`spec`, wait for them; their results, or raise."""

    def attempt(self, number: int) -> list[Failure]:
        self._results = self.run()
        return []

    def results(self) -> list[Any]:
        return self._results
