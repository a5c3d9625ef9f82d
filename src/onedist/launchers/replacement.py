"""The launcher's side of live recovery (``onedist run --recovery live``): a worker that dies is
started again alone, the others keep running.

:class:`LiveRecovery` watches the workers in place of :meth:`~.supervisor.Supervisor.watch`.
When a worker is killed by a signal (SIGKILL, the OOM killer, a segfault) while every rank's loop
runs under ``od.steps`` (each said so in the store: :data:`onedist._recovery.READY_KEY`) and
restarts are left (each replacement counts as one of ``--max-restarts``), it starts that rank
alone, in the next *generation* (a spare kept warm once every loop runs, :mod:`.standby`, becomes
it; else a new process), and then sets the generation's key in the store the
launcher hosts: the survivors, rolled back to the start of their step, wait for that key, meet the
replacement (the launcher says "go" once every member is counted in and none died meanwhile, else
"next": ranks that die together are replaced in one generation, :func:`onedist._recovery.meet`),
make the group again with it and send it the state (:mod:`onedist.training.live_steps`). Anything
else (a worker that raised, a failure before every loop was ready, no restart left, a signal to
the launcher) goes to the supervisor's watch as before: the workers are stopped, and
``--max-restarts`` restarts them all.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from typing import Any, Optional

from .._recovery import (
    GENERATION_ENV,
    GO,
    NEXT,
    READY_KEY,
    STARTED_ENV,
    decision_key,
    generation_key,
    meet_key,
)
from .launcher import restarts_left
from .report import Failure
from .supervisor import POLL_S, PopenWorker, Supervisor

__all__ = ["LiveRecovery"]


class LiveRecovery:
    """Replace dead workers of one attempt alone (see the module doc). ``store``: the store the
    launcher hosts; ``restarts``: this attempt's number and ``--max-restarts``; ``replace(worker,
    variables)``: start that worker's rank again with these variables added, returning the new
    worker; ``replaced``: the workers replaced so far, over every attempt (this one appends: each
    was one restart); ``stopping()``: the launcher got a signal (a worker it ends is not
    replaced); ``warm()``: make a spare ready for the next replacement (:mod:`.standby`)."""

    def __init__(
        self,
        store: Any,
        world_size: int,
        restarts: tuple[int, int],
        replace: Callable[[PopenWorker, dict[str, str]], PopenWorker],
        replaced: list[PopenWorker],
        stopping: Callable[[], bool],
        warm: Callable[[], None] = lambda: None,
    ) -> None:
        self.store, self.world_size = store, world_size
        self.attempt, self.max_restarts = restarts
        self.replace, self.replaced, self.stopping, self.warm = replace, replaced, stopping, warm
        #: this attempt's group make-up: 0 for the workers first started, one more per replacement
        self.generation = 0
        self._decided = 0  # the last generation whose meeting the launcher decided
        self._warmed = -1  # the generation a spare was made ready for

    def _ready(self) -> int:
        """How many ranks said their loop runs under ``od.steps`` (the replacements too)."""
        try:
            return int(self.store.add(READY_KEY, 0))
        except Exception:
            return 0

    def _warm_when_ready(self) -> None:
        """A spare for the next failure: one with the first workers, then one once each
        replacement runs its loop (so that its imports do not slow the recovery)."""
        if self._warmed < 0 or (
            self._warmed < self.generation and self._ready() >= self.world_size + self.generation
        ):
            self._warmed = self.generation
            if restarts_left(self.attempt + len(self.replaced), self.max_restarts):
                self.warm()

    def _replaceable(self, code: int) -> bool:
        """A worker that ended with ``code`` is replaced alone: killed by a signal, the launcher
        not stopping, a restart left, every loop ready."""
        used = self.attempt + len(self.replaced)
        if code >= 0 or self.stopping() or not restarts_left(used, self.max_restarts):
            return False
        return self._ready() >= self.world_size

    def _decide(self) -> None:
        """The current generation's meeting: "go" once every member is counted in (the deaths
        of this poll were seen first: a dead member's generation was given up by :meth:`_start`)."""
        number = self.generation
        if number > self._decided and int(self.store.add(meet_key(number), 0)) >= self.world_size:
            self.store.set(decision_key(number), GO)
            self._decided = number

    def _start(self, supervisor: Supervisor[PopenWorker], dead: PopenWorker, code: int) -> None:
        if self.generation > self._decided:  # its members meet again in the next one, with this rank's
            self.store.set(decision_key(self.generation), NEXT)
            self._decided = self.generation
        self.generation += 1
        used = self.attempt + len(self.replaced) + 1
        sys.stderr.write(
            f"onedist run: worker rank {dead.rank} (pid {dead.pid}) was killed by signal "
            f"{signal.Signals(-code).name}; live recovery: starting rank {dead.rank} alone (generation "
            f"{self.generation}, restart {used} of {self.max_restarts}), the others keep running\n"
        )
        sys.stderr.flush()
        new = self.replace(dead, {GENERATION_ENV: str(self.generation), STARTED_ENV: repr(time.time())})
        supervisor.workers[supervisor.workers.index(dead)] = new
        self.replaced.append(dead)
        self.store.set(generation_key(self.generation), "1")  # the survivors' signal to rejoin

    def watch(
        self, supervisor: Supervisor[PopenWorker], give_up: Optional[Callable[[], bool]]
    ) -> list[Failure]:
        """Watch until every worker ended; replace those :meth:`_replaceable`; anything else is
        the supervisor's watch (the workers stopped). The failures (empty: all succeeded)."""
        while True:
            self._warm_when_ready()
            for w in list(supervisor.workers):
                code = w.poll()
                if code is None or code == 0:
                    continue
                if self._replaceable(code):
                    self._start(supervisor, w, code)
                    continue
                return supervisor.watch(give_up)  # today's way: stop the others, report
            self._decide()
            if not supervisor.running():
                return supervisor.failures()
            if give_up is not None and give_up():
                return supervisor.watch(give_up)
            time.sleep(POLL_S)
