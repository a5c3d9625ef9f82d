"""Watching the workers of one launch, and stopping them all when one fails.

One :class:`Supervisor` for every launcher that starts its workers itself: :func:`onedist.spawn`
(multiprocessing children, :class:`ProcessWorker`), ``Parallel(start_method="subprocess")`` and
``onedist run`` (re-run scripts, :class:`PopenWorker`). It records each worker's failure as a
:class:`~.report.Failure` (what the worker reported, else how it ended), waits :data:`GRACE_S`
after the first one for near-simultaneous reports, marks the workers still running as stopped,
and stops them: SIGTERM, then SIGKILL whoever is left after :data:`TERM_S`. The launcher turns
the failures into the one report of :mod:`.report`.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import pickle
import signal
import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import IO, Any, Generic, Optional, Protocol, TypeVar

from .report import Failure, read_failure

__all__ = [
    "ChildProcess",
    "GRACE_S",
    "INTERRUPT_S",
    "POLL_S",
    "TERM_S",
    "PopenWorker",
    "ProcessWorker",
    "Supervisor",
    "Worker",
]

# the failure policy of every launcher that watches its workers:
GRACE_S = 0.3  # wait this long after the first failure for near-simultaneous reports
#: ... and this long when it is a CollectiveMismatchError: every rank raises that verdict itself,
#: some from their failure watcher (polling once a second), not as a consequence of the first
MISMATCH_GRACE_S = 3.0
INTERRUPT_S = 2.0  # on Ctrl-C, how long the workers get to say where they were
TERM_S = 3.0  # then SIGTERM, and SIGKILL whoever is left after this long
POLL_S = 0.02  # how often workers without a waitable handle are polled


class Worker(ABC):
    """One started worker, as the supervisor sees it: its ranks, whether and how it ended, what
    it reported (a failure, or its result), and how to signal it."""

    def __init__(self, rank: int, local_rank: int) -> None:
        self.rank = rank
        self.local_rank = local_rank
        self.reported = False  # it reported its failure or its result
        self.result: Any = None
        self.failure: Optional[Failure] = None

    @property
    @abstractmethod
    def pid(self) -> Optional[int]:
        """The worker's process id."""

    @abstractmethod
    def poll(self) -> Optional[int]:
        """The exit code (negative: killed by that signal), or None while it runs."""

    @abstractmethod
    def collect(self) -> None:
        """Read the worker's report if one is waiting (non-blocking): sets ``result`` or ``failure``."""

    @abstractmethod
    def exit_failure(self, code: int) -> Optional[Failure]:
        """The failure of a worker that ended with ``code`` without reporting one (None: success)."""

    @abstractmethod
    def join(self, timeout: Optional[float]) -> None:
        """Wait up to ``timeout`` seconds (None: for ever) for the worker to end."""

    def waitables(self) -> list[Any]:
        """Handles ``multiprocessing.connection.wait`` can wait on (none: the worker is polled)."""
        return []

    def close(self) -> None:
        """Release what the parent holds of the worker (its end of a pipe)."""

    def send(self, sig: int) -> None:
        """Send ``sig`` to the worker if it still runs."""
        if self.poll() is None and self.pid is not None:
            try:
                os.kill(self.pid, sig)
            except (ProcessLookupError, OSError):
                pass

    def check(self) -> None:
        """Record its report, or the failure of how it ended."""
        if self.failure is None:
            self.collect()
        code = self.poll()
        if code is None:
            return
        if self.failure is None:
            self.join(None)
            self.collect()
        if self.failure is None:
            self.failure = self.exit_failure(code)
        elif self.failure.exitcode is None and not self.failure.stopped:
            self.failure.exitcode = code  # it reported before it ended


class ProcessWorker(Worker):
    """A multiprocessing child that reports through a pipe: ``("ok", result)`` or ``("error",
    time, type, message, traceback)``, pickled; exiting without a report is a failure."""

    def __init__(self, rank: int, local_rank: int, process: Any, conn: Any, exit_hint: str = "") -> None:
        super().__init__(rank, local_rank)
        self.process = process
        self.conn = conn
        self.exit_hint = exit_hint  # added to the report of a worker that exited 1 without reporting

    @property
    def pid(self) -> Optional[int]:
        pid: Optional[int] = self.process.pid
        return pid

    def poll(self) -> Optional[int]:
        code: Optional[int] = self.process.exitcode
        return code

    def waitables(self) -> list[Any]:
        return [self.process.sentinel] if self.reported else [self.process.sentinel, self.conn]

    def join(self, timeout: Optional[float]) -> None:
        self.process.join(timeout)

    def close(self) -> None:
        self.conn.close()

    def collect(self) -> None:
        if self.reported:
            return
        try:
            if not self.conn.poll():
                return
            msg = pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            return
        except Exception as e:  # the result could not be unpickled here
            self.reported = True
            self.failure = Failure(
                self.rank,
                self.local_rank,
                self.pid,
                time.time(),
                exc_type=type(e).__name__,
                message=f"its return value could not be unpickled in the parent: {e}",
            )
            return
        self.reported = True
        if msg[0] == "ok":
            self.result = msg[1]
            return
        _, when, exc_type, message, tb = msg
        self.failure = Failure(
            self.rank, self.local_rank, self.pid, when, exc_type=exc_type, message=message, traceback=tb
        )

    def exit_failure(self, code: int) -> Optional[Failure]:
        if code == 0 and self.reported:
            return None
        failure = Failure(self.rank, self.local_rank, self.pid, time.time(), exitcode=code)
        if code == 1 and self.exit_hint:
            failure.extra.append(self.exit_hint)
        return failure


class ChildProcess(Protocol):
    """What :class:`PopenWorker` uses of its process: a :class:`subprocess.Popen`, or a worker
    ``onedist run`` forked (:class:`~.forked.ForkedProcess`)."""

    pid: int
    stdout: Optional[IO[bytes]]
    stderr: Optional[IO[bytes]]

    def poll(self) -> Optional[int]: ...

    def wait(self, timeout: Optional[float] = None) -> int: ...


class PopenWorker(Worker):
    """A subprocess that writes its failure to ``error_file`` (read by
    :func:`~.report.read_failure`); exiting 0 is a success. ``early``: a report counts as soon as
    it is written (else once the worker ended: it may still be flushing its output)."""

    def __init__(
        self,
        rank: int,
        local_rank: int,
        popen: ChildProcess,
        error_file: str,
        exit_hint: str = "",
        early: bool = True,
    ) -> None:
        super().__init__(rank, local_rank)
        self.popen = popen
        self.error_file = error_file
        self.exit_hint = exit_hint  # added to the report of a worker that exited 1 without reporting
        self.early = early

    @property
    def pid(self) -> Optional[int]:
        return self.popen.pid

    def poll(self) -> Optional[int]:
        return self.popen.poll()

    def join(self, timeout: Optional[float]) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def collect(self) -> None:
        if self.reported or (not self.early and self.poll() is None):
            return
        failure = read_failure(self.error_file, self.rank, self.local_rank, self.pid, self.poll())
        if failure is not None:
            self.reported = True
            self.failure = failure

    def exit_failure(self, code: int) -> Optional[Failure]:
        if code == 0:
            return None
        failure = Failure(self.rank, self.local_rank, self.pid, time.time(), exitcode=code)
        if code == 1 and self.exit_hint:
            failure.extra.append(self.exit_hint)
        return failure


W = TypeVar("W", bound=Worker)


class Supervisor(Generic[W]):
    """The workers of one launch: watch them, stop them, collect their failures."""

    def __init__(self, workers: Sequence[W] = ()) -> None:
        self.workers: list[W] = list(workers)

    def close(self) -> None:
        """Release what the parent holds of every worker."""
        for w in self.workers:
            w.close()

    def running(self) -> list[W]:
        return [w for w in self.workers if w.poll() is None]

    def signal_all(self, sig: int) -> None:
        """Send ``sig`` to every worker that still runs."""
        for w in self.running():
            w.send(sig)

    def stop(self, kill_wait: Optional[float] = None) -> None:
        """SIGTERM the workers still running, SIGKILL whoever is left after :data:`TERM_S`, and
        wait for them (``kill_wait`` seconds each at most; None: until they are gone)."""
        alive = self.running()
        if not alive:
            return
        for w in alive:
            w.send(signal.SIGTERM)
        deadline = time.monotonic() + TERM_S
        for w in alive:
            w.join(max(0.0, deadline - time.monotonic()))
        for w in alive:
            if w.poll() is None:
                w.send(signal.SIGKILL)
                w.join(kill_wait)

    def poll_failures(self) -> Optional[float]:
        """Record the workers' failures; the monotonic time now if any worker failed, else None."""
        for w in self.workers:
            w.check()
        return time.monotonic() if any(w.failure is not None for w in self.workers) else None

    def failures(self, mark_stopped: bool = False) -> list[Failure]:
        """The failures recorded; with ``mark_stopped``, a worker still running counts as stopped."""
        self.poll_failures()
        out: list[Failure] = []
        for w in self.workers:
            if w.failure is None and mark_stopped and w.poll() is None:
                w.failure = Failure(w.rank, w.local_rank, w.pid, time.time(), stopped=True)
            if w.failure is not None:
                out.append(w.failure)
        return out

    def wait(self, timeout: Optional[float], workers: Optional[Sequence[Worker]] = None) -> None:
        """Wait until a worker may have something to say, ``timeout`` seconds at most (None: no
        limit, when every worker can be waited on)."""
        waitables = [h for w in (self.running() if workers is None else workers) for h in w.waitables()]
        if waitables:
            multiprocessing.connection.wait(waitables, timeout)
        else:
            time.sleep(POLL_S if timeout is None else min(timeout, POLL_S))

    def _grace(self) -> float:
        mismatch = any(
            getattr(w.failure, "exc_type", None) == "CollectiveMismatchError" for w in self.workers
        )
        return MISMATCH_GRACE_S if mismatch else GRACE_S

    def watch(self, give_up: Optional[Callable[[], bool]] = None) -> list[Failure]:
        """Wait for every worker; :data:`GRACE_S` after the first failure (or once ``give_up()``
        is true) stop the others. Returns the failures (empty: every worker succeeded)."""
        first: Optional[float] = None
        while True:
            # which run, before their failures are read, and the wait on those same workers: one
            # that ends after this line wakes the wait at once (waited on only if still running
            # when the wait began, a rank killed in between was missed and the job hung)
            running = self.running()
            seen = self.poll_failures()
            first = seen if first is None else first
            if not running:
                break
            grace = self._grace()
            if first is not None and time.monotonic() >= first + grace:
                self.failures(mark_stopped=True)
                self.stop()
                break
            if give_up is not None and give_up():
                self.failures(mark_stopped=True)  # stopped from outside: not failures of their own
                self.stop()
                break
            if first is not None:
                self.wait(max(0.0, first + grace - time.monotonic()), running)
            else:  # without a failure, only a signal to give up needs polling
                self.wait(None if give_up is None else POLL_S, running)
        return self.failures()

    def interrupted(self) -> None:
        """Ctrl-C in the parent: give the workers :data:`INTERRUPT_S` to report where they were
        (SIGINT to those that have not after a moment: the signal may have reached the parent
        alone), then stop those left."""
        pending = [w for w in self.workers if not w.reported and w.poll() is None]
        start = time.monotonic()
        nudged = False
        try:
            while pending and time.monotonic() < start + INTERRUPT_S:
                if not nudged and time.monotonic() >= start + INTERRUPT_S / 4:
                    nudged = True
                    for w in pending:
                        w.send(signal.SIGINT)
                self.wait(INTERRUPT_S / 8, pending)
                for w in list(pending):
                    w.collect()
                    if w.reported or w.poll() is not None:
                        w.collect()
                        pending.remove(w)
        finally:
            self.stop()
