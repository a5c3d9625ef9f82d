"""One failure report, whichever launcher started the workers.

A :class:`Failure` is what the parent knows of one worker that failed: its rank, how it ended
(an exception's type, message and traceback, an exit code or a signal), and whether it was only
stopped, or failed only as a consequence of another rank's failure. :func:`failure_report` picks
the failure to show first (the earliest that is not a consequence) and writes the report that
``spawn``, ``Parallel``, ``onedist run`` and the backends' own launchers all raise or print.
Every worker that is not a multiprocessing child writes its failure as one JSON record (type,
message, traceback, time; with rank, local_rank and pid when a backend's launcher started it:
:func:`onedist.launchers.worker.write_error_file`), read here by :func:`read_failure`.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from ..errors import WorkerFailedError

__all__ = [
    "PEER_LOST",
    "Failure",
    "failure_error",
    "failure_report",
    "read_failure",
    "reported_failure_error",
    "reported_failures",
    "restart_line",
]

# messages of errors that are only the consequence of a peer's death
PEER_LOST = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "socket closed",
    "connection refused",
    "read error",
    "remote process exited",
    "communicator was aborted",
    "could not send its value",
)


@dataclass
class Failure:
    rank: int
    local_rank: int
    pid: Optional[int]
    when: float
    exitcode: Optional[int] = None
    exc_type: Optional[str] = None
    message: str = ""
    traceback: Optional[str] = None
    stopped: bool = False  # stopped by onedist after another worker failed
    extra: list[str] = field(default_factory=list)

    @property
    def secondary(self) -> bool:
        if self.stopped or self.exc_type == "RemoteRankError":
            return True
        text = f"{self.message}\n{self.traceback or ''}".lower()
        return any(p in text for p in PEER_LOST)

    def what(self) -> str:
        if self.exc_type is not None:
            return f"failed with {self.exc_type}: {self.message}"
        if self.exitcode is not None and self.exitcode < 0:
            try:
                name = signal.Signals(-self.exitcode).name
            except ValueError:
                name = str(-self.exitcode)
            return f"was killed by signal {name}"
        return f"exited with code {self.exitcode} without raising an exception"

    def headline(self) -> str:
        return f"rank {self.rank} (local rank {self.local_rank}, pid {self.pid}) {self.what()}"


def _record(path: str) -> Optional[dict[str, Any]]:
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _failure_of(
    record: dict[str, Any], rank: int, local_rank: int, pid: Optional[int], exitcode: Optional[int]
) -> Failure:
    return Failure(
        rank,
        local_rank,
        pid,
        float(record.get("time", time.time())),
        exitcode=exitcode,
        exc_type=str(record.get("type")),
        message=str(record.get("message", "")),
        traceback=record.get("traceback"),
    )


def read_failure(
    path: str, rank: int, local_rank: int, pid: Optional[int], exitcode: Optional[int]
) -> Optional[Failure]:
    """The failure a worker wrote to ``path`` (type, message, traceback, time), or None when it
    wrote none (yet). The one reader of the error files of every launcher."""
    record = _record(path)
    return None if record is None else _failure_of(record, rank, local_rank, pid, exitcode)


def reported_failures(paths: list[str]) -> list[Failure]:
    """The failures that workers started by a backend's own launcher (``horovod.run``,
    ``xmp.spawn``) wrote, with their rank, local_rank and pid in the record."""
    failures = []
    for path in paths:
        record = _record(path)
        try:
            if record is not None:
                failures.append(_failure_of(record, record["rank"], record["local_rank"], record["pid"], 1))
        except KeyError:
            continue
    return failures


def reported_failure_error(
    reports: list[str], finished: Callable[[int], bool] = lambda rank: False
) -> Optional[WorkerFailedError]:
    """The WorkerFailedError of workers started by a backend's own launcher, from their JSON
    reports (``reports[rank]``: rank's path), or None when none reported. A rank that neither
    reported nor ``finished`` is listed as stopped after the failure."""
    failures = reported_failures(reports)
    if not failures:
        return None
    reported = {f.rank for f in failures}
    failures += [
        Failure(r, r, None, time.time(), stopped=True)
        for r in range(len(reports))
        if r not in reported and not finished(r)
    ]
    return failure_error(failures)


def failure_error(failures: list[Failure]) -> WorkerFailedError:
    """The WorkerFailedError of these failures (the failing rank's traceback first)."""
    primary, message = failure_report(failures)
    return WorkerFailedError(message, primary.rank, primary.local_rank, primary.exitcode, primary.traceback)


def failure_report(failures: list[Failure]) -> tuple[Failure, str]:
    """The failure to show first (the earliest that is not a consequence of another), and the report.

    Shared by :func:`spawn` and ``onedist run``.
    """
    primary_pool = [f for f in failures if not f.secondary] or failures
    primary = min(primary_pool, key=lambda f: f.when)
    lines = [f"onedist: worker {primary.headline()}"]
    lines.extend(primary.extra)
    if primary.traceback:
        lines.append(f"\nTraceback of rank {primary.rank}:\n{primary.traceback.rstrip()}")
    others = [f for f in failures if f is not primary]
    if others:
        lines.append("\nOther workers:")
        for f in sorted(others, key=lambda f: f.rank):
            if f.stopped:
                lines.append(f"  rank {f.rank}: stopped by onedist after rank {primary.rank} failed")
            elif f.secondary:  # its message may quote the primary's whole traceback: the first line will do
                first = f.what().splitlines()[0] if f.what() else ""
                lines.append(f"  rank {f.rank}: {first} (a consequence of rank {primary.rank}'s failure)")
            else:
                lines.append(f"  rank {f.rank}: {f.what()}")
    return primary, "\n".join(lines)


def restart_line(who: str, failures: list[Failure], attempt: int, max_restarts: int) -> str:
    """``onedist run: rank 1 failed (exit code -9, killed by signal SIGKILL); restarting the
    workers (attempt 1 of 3)``: the ranks that failed on their own (not those stopped, nor their
    consequences). ``who``: the launcher that restarts ("onedist run", "onedist.spawn")."""
    causes = [f for f in failures if not f.secondary] or [f for f in failures if not f.stopped]
    ranks = ", ".join(str(f.rank) for f in causes) or "?"
    why = "; ".join(_cause(f) for f in causes)
    return (
        f"{who}: rank{'s' if len(causes) > 1 else ''} {ranks} failed ({why}); "
        f"restarting the workers (attempt {attempt} of {max_restarts})\n"
    )


def _cause(f: Failure) -> str:
    if f.exc_type is not None:
        return f"{f.exc_type}: {f.message.splitlines()[0] if f.message else ''}"
    if f.exitcode is not None and f.exitcode < 0:
        return f"exit code {f.exitcode}, {f.what().removeprefix('was ')}"
    return f"exit code {f.exitcode}"
