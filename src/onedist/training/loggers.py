"""``od.loggers`` and ``od.log_metrics``: metrics to CSV, TensorBoard or any logger, from the main process.

``od.loggers(target, ...)`` sets where the metrics go: :class:`CSVLogger`, :class:`TensorBoardLogger`
or any object with ``log_metrics(metrics, step)`` (Lightning's loggers, your own).
``od.log_metrics(metrics, step)`` is called on every rank; only the main process (global rank 0)
writes, and the others return at once, unless ``reduce=`` asks for the metrics over every rank:
then every rank takes part in one all_gather (see
:func:`~onedist.training.rank_rows.rank_rows`), whatever the mix of mean, sum, max and min.

Nothing is lost when the job ends early. The training thread only queues a CSV row (writing it
there cost a step tens of microseconds: a step leaves the CPU's caches cold for this code); the
CSV logger's thread writes the queued rows every ``flush_s`` seconds, as TensorBoard's writer
flushes every ``flush_s`` seconds; every logger is flushed and closed at the end of a
``with od.loggers(...):`` block, when ``od.loggers`` replaces them, and at the exit of the
process, which is how a rank leaves when another rank failed (onedist raises
:class:`~onedist.RemoteRankError` in it, and the exception ends the process normally). Where
onedist ends the process without its exit handlers instead (its main thread blocked inside a
collective after another rank failed, SIGTERM from a launcher stopping the job, an uncaught error
under MPI), the loggers are flushed and closed first
(:func:`~onedist.failures.forced_exit.on_forced_exit`).
"""

from __future__ import annotations

import atexit
import csv
import math
import os
import threading
import weakref
import zlib
from collections import deque
from collections.abc import Mapping
from importlib.util import find_spec
from types import TracebackType
from typing import IO, Any, Optional, Protocol, Union, runtime_checkable

import torch

from ..context import is_main_process
from ..errors import CollectiveMismatchError, OnedistRuntimeError, bad_type, bad_value
from ..failures import on_forced_exit

__all__ = ["CSVLogger", "Loggers", "MetricLogger", "TensorBoardLogger", "log_metrics", "loggers"]

_REDUCTIONS = ("mean", "sum", "max", "min")
PathLike = Union[str, "os.PathLike[str]"]


@runtime_checkable
class MetricLogger(Protocol):
    """What ``od.loggers`` takes: an object with ``log_metrics(metrics, step)`` (Lightning's
    loggers have it). ``save()``, ``flush()`` and ``finalize(status)`` are called too when it has them."""

    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int]) -> None: ...


class CSVLogger:
    """Metrics to ``directory/name``: a header ``step,<metric>,...`` and one row per call.

    Written by the main process only, created at its first row (an existing file is replaced).
    The training thread only queues a row (a few microseconds); a thread of the logger writes the
    rows queued every ``flush_s`` seconds, and every row left is written at :meth:`flush` and
    :meth:`close`, which ``od.loggers`` calls at the end of its block, at the exit of the process
    and before onedist ends a rank without its exit handlers (SIGTERM, ...). ``flush_s=0``: each
    row is written and flushed in the call, by the training thread. A metric that appears later
    adds a column (the file is rewritten once with it); a row leaves the metrics it does not have
    empty.

    Example:
        >>> import onedist as od
        >>> csv_logger = od.CSVLogger("/tmp/od-csv-doc")
        >>> with od.loggers(csv_logger):
        ...     _ = od.log_metrics({"loss": 0.5}, step=1)
        ...     _ = od.log_metrics({"loss": 0.25, "accuracy": 0.9}, step=2)
        >>> from pathlib import Path
        >>> print(Path(csv_logger.path).read_text().strip())
        step,loss,accuracy
        1,0.5,
        2,0.25,0.9
    """

    def __init__(self, directory: PathLike, name: str = "metrics.csv", flush_s: float = 1.0) -> None:
        if not isinstance(directory, (str, os.PathLike)):
            raise bad_type("CSVLogger", "directory", directory, "a str or os.PathLike")
        if not isinstance(name, str) or not name or os.sep in name:
            raise bad_value(
                "CSVLogger", "name", name, "a file name (a non-empty str without a path separator)"
            )
        if isinstance(flush_s, bool) or not isinstance(flush_s, (int, float)) or not flush_s >= 0:
            raise bad_value("CSVLogger", "flush_s", flush_s, "a number of seconds >= 0")
        self.path = os.path.join(os.fspath(directory), name)
        self.flush_s = float(flush_s)
        self.columns: list[str] = []
        self.file: Optional[IO[str]] = None
        # rows queued by the training thread (deque: append and popleft are atomic, no lock)
        self.queued: deque[tuple[Optional[int], dict[str, Any]]] = deque()
        self.lock = threading.Lock()  # one writer at a time: the logger's thread, flush, close
        self.stop: Optional[threading.Event] = None  # set: the writer thread ends
        self.failed: Optional[BaseException] = None  # what stopped the writer thread
        self.hooked = False  # closed at the exit of the process

    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int]) -> None:
        """Queue one row (``step`` first); with ``flush_s=0``, write it now."""
        self.queued.append((step, dict(metrics)))  # a copy: the caller may change its dict later
        if self.stop is None:
            if self.flush_s == 0:
                self.flush()
            else:
                self._start_writer()
        elif self.failed is not None:  # the thread could not write: say why, here
            failed, self.failed = self.failed, None
            self.stop.set()
            self.stop = None
            raise failed

    def _start_writer(self) -> None:
        """The thread that writes the queued rows every ``flush_s`` seconds (a daemon: the exit
        of the process closes the logger, through ``od.loggers`` or :func:`_close_csv_at_exit`)."""
        stop = self.stop = threading.Event()

        def write_every_flush_s() -> None:
            while not stop.wait(self.flush_s):
                try:
                    self.flush()
                except Exception as e:  # raised by the next log_metrics, on the training thread
                    self.failed = e
                    return

        threading.Thread(target=write_every_flush_s, name="onedist-csv-writer", daemon=True).start()
        if not self.hooked:
            atexit.register(_close_csv_at_exit, weakref.ref(self))
            self.hooked = True

    def flush(self) -> None:
        """Write and flush the rows queued so far."""
        with self.lock:
            rows = []
            while self.queued:
                rows.append(self.queued.popleft())
            if rows:
                self._write(rows)

    def _write(self, rows: list[tuple[Optional[int], dict[str, Any]]]) -> None:
        """Append ``rows`` to the file (opened at the first row; rewritten when a column is new)."""
        start = 0
        for i, (_, metrics) in enumerate(rows):
            new = [k for k in metrics if k not in self.columns]
            if self.file is None or new:
                self._append(rows[start:i])
                self._reopen(new)
                start = i
        self._append(rows[start:])

    def _append(self, rows: list[tuple[Optional[int], dict[str, Any]]]) -> None:
        if not rows:
            return
        assert self.file is not None
        columns = self.columns
        table = [["" if step is None else step, *(m.get(c, "") for c in columns)] for step, m in rows]
        csv.writer(self.file).writerows(table)
        self.file.flush()

    def _reopen(self, new: list[str]) -> None:
        """Open the file at the first row; with new columns, rewrite it with them."""
        rows: list[dict[str, str]] = []
        if self.file is not None:
            self.file.close()
            with open(self.path, newline="") as f:
                rows = list(csv.DictReader(f))
        else:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self.columns += new
        with open(self.path, "w", newline="") as f:
            writer = csv.DictWriter(f, ["step", *self.columns])
            writer.writeheader()
            writer.writerows(rows)
        self.file = open(self.path, "a", newline="")  # noqa: SIM115 (kept open between rows)

    def close(self) -> None:
        """Write the rows queued, stop the writer thread and close the file (a later row reopens
        the file and rewrites it)."""
        if self.stop is not None:
            self.stop.set()
            self.stop = None
        self.flush()
        with self.lock:
            if self.file is not None:
                self.file.close()
                self.file = None
                self.columns = []


def _close_csv_at_exit(ref: weakref.ref[CSVLogger]) -> None:
    """Close a CSV logger at the exit of the process (one used without ``od.loggers`` too)."""
    logger = ref()
    if logger is not None:
        logger.close()


class TensorBoardLogger:
    """Metrics as TensorBoard scalars in ``directory`` (``torch.utils.tensorboard.SummaryWriter``).

    Needs the ``tensorboard`` package (``pip install tensorboard``): without it, making one raises
    :class:`~onedist.OnedistRuntimeError` saying so. The writer is made by the main process at its
    first metric; it flushes every ``flush_s`` seconds and when the loggers are closed.

    Example:
        >>> import onedist as od
        >>> try:
        ...     board = od.TensorBoardLogger("/tmp/od-tb-doc")
        ... except od.OnedistRuntimeError as e:   # tensorboard is not installed
        ...     board = None
        ...     assert "pip install tensorboard" in str(e)
        >>> with od.loggers(*[board] if board else []):
        ...     _ = od.log_metrics({"loss": 0.5}, step=1)
    """

    def __init__(self, directory: PathLike, flush_s: float = 10.0) -> None:
        if find_spec("tensorboard") is None:
            raise OnedistRuntimeError(
                "onedist.TensorBoardLogger: needs the tensorboard package, which is not installed"
                "\nHINT: pip install tensorboard"
            )
        if not isinstance(directory, (str, os.PathLike)):
            raise bad_type("TensorBoardLogger", "directory", directory, "a str or os.PathLike")
        if isinstance(flush_s, bool) or not isinstance(flush_s, (int, float)) or not flush_s > 0:
            raise bad_value("TensorBoardLogger", "flush_s", flush_s, "a number of seconds > 0")
        self.directory, self.flush_s = os.fspath(directory), flush_s
        self.writer: Any = None

    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int]) -> None:
        """Add each metric as a scalar at ``step``."""
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(self.directory, flush_secs=max(1, round(self.flush_s)))
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step)

    def flush(self) -> None:
        """Write what the writer holds."""
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file (a later metric opens a new one)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class Loggers:
    """The loggers :func:`onedist.log_metrics` writes to (made by :func:`onedist.loggers`).

    ``with`` it, or :meth:`close` it, to flush and close them; otherwise that happens at the exit
    of the process, or when :func:`onedist.loggers` replaces them.

    Attributes:
        targets: the loggers, in the order given.
    """

    def __init__(self, targets: tuple[MetricLogger, ...]) -> None:
        self.targets = targets
        self.closed = False

    def write(self, metrics: dict[str, float], step: Optional[int]) -> None:
        """Give ``metrics`` to every logger (the caller is the main process)."""
        for target in self.targets:
            target.log_metrics(metrics, step)

    def flush(self) -> None:
        """Flush every logger (``flush()`` or, for Lightning's, ``save()``, where it has one)."""
        for target in self.targets:
            for name in ("flush", "save"):
                method = getattr(target, name, None)
                if callable(method):
                    method()
                    break

    def close(self, status: str = "success") -> None:
        """Flush and close every logger once: ``close()``, or ``finalize(status)`` (Lightning's)."""
        if self.closed:
            return
        self.closed = True
        if _active.current is self:
            _active.current = None
        self.flush()
        for target in self.targets:
            if callable(getattr(target, "close", None)):
                target.close()  # type: ignore[attr-defined]
            elif callable(getattr(target, "finalize", None)):
                target.finalize(status)  # type: ignore[attr-defined]

    def __enter__(self) -> Loggers:
        return self

    def __exit__(
        self, tp: Optional[type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        self.close("success" if exc is None else "failed")


class _Active:
    """The loggers in use (one set per process) and whether the exit hook is installed."""

    current: Optional[Loggers] = None
    hooked = False


_active = _Active()


def _close_at_exit() -> None:
    import sys

    if _active.current is not None:
        _active.current.close("failed" if hasattr(sys, "last_value") else "success")


def _close_at_forced_exit() -> None:
    if _active.current is not None:
        _active.current.close("failed")


def loggers(*targets: MetricLogger) -> Loggers:
    """Send what :func:`onedist.log_metrics` logs to ``targets`` from now on (the previous
    loggers, if any, are flushed and closed). Call it on every rank; only the main process writes.

    Args:
        targets: :class:`CSVLogger`, :class:`TensorBoardLogger`, or any object with
            ``log_metrics(metrics, step)`` (Lightning's ``CSVLogger``, ``TensorBoardLogger``,
            ``WandbLogger``, ...). None: log nowhere.

    Returns:
        A :class:`Loggers`; ``with`` it to close them at the end of a block.

    Example:
        >>> import onedist as od
        >>> class Printer:                        # any object with log_metrics(metrics, step)
        ...     def log_metrics(self, metrics, step):
        ...         print(step, metrics)
        >>> with od.loggers(Printer()):
        ...     _ = od.log_metrics({"loss": 0.5}, step=3)
        3 {'loss': 0.5}
    """
    for i, target in enumerate(targets):
        if not callable(getattr(target, "log_metrics", None)):
            raise bad_type(
                "loggers",
                f"targets[{i}]",
                target,
                "od.CSVLogger, od.TensorBoardLogger or an object with "
                "a log_metrics(metrics, step) method (Lightning's loggers have one)",
            )
    if _active.current is not None:
        _active.current.close()
    if not _active.hooked:
        atexit.register(_close_at_exit)
        on_forced_exit(_close_at_forced_exit)
        _active.hooked = True
    _active.current = Loggers(targets)
    return _active.current


def log_metrics(
    metrics: Mapping[str, Any],
    step: Optional[int] = None,
    *,
    reduce: Union[str, Mapping[str, str], None] = None,
) -> dict[str, float]:
    """Log ``metrics`` at ``step`` to the loggers of :func:`onedist.loggers`, from the main process.

    Call it on every rank. Without ``reduce`` the main process's own values are logged and no rank
    waits for another; with it, every rank must call it with the same metric names, and one small
    collective gives every rank the reduced values.

    Args:
        metrics: name -> a number or a one-element tensor.
        step: the step (an int >= 0), or None.
        reduce: None (this rank's values), "mean", "sum", "max" or "min" for every metric, or a
            dict name -> one of those (the metrics it does not name: the main process's values).

    Returns:
        The values logged, as floats (on every rank; with ``reduce``, reduced over every rank).

    Example:
        >>> import torch, onedist as od
        >>> od.log_metrics({"loss": torch.tensor(0.25), "correct": 30}, step=10, reduce={"correct": "sum"})
        {'loss': 0.25, 'correct': 30.0}
    """
    values = _floats(metrics)
    # (the checks' exact classes first: this runs every step, after the step has evicted this
    # code from the CPU's caches, where each Python operation costs several times its warm time)
    if (
        step is not None
        and (step.__class__ is not int or step < 0)
        and (isinstance(step, bool) or not isinstance(step, int) or step < 0)
    ):
        raise bad_value("log_metrics", "step", step, "None or an int >= 0")
    if reduce is not None:
        ops = _reductions(reduce, values)
        if ops:
            values = _reduce(values, ops)
    active = _active.current
    if active is not None and is_main_process():
        active.write(values, step)
    return values


def _floats(metrics: Any) -> dict[str, float]:
    if metrics.__class__ is not dict and not isinstance(metrics, Mapping):
        raise bad_type("log_metrics", "metrics", metrics, "a dict of metric name -> number")
    values: dict[str, float] = {}
    for name, value in metrics.items():
        if name.__class__ is not str and not isinstance(name, str):
            raise bad_type("log_metrics", "metrics' key", name, "a str (the metric's name)")
        cls = value.__class__
        if cls is torch.Tensor and value.numel() == 1:
            value = value.item()  # a one-element tensor (a GPU's waits for its value here)
            cls = value.__class__
        if cls is float or cls is int:
            values[name] = float(value)
            continue
        if hasattr(value, "numel") and value.numel() == 1:
            value = value.item()  # a one-element tensor (a GPU's waits for its value here)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad_type("log_metrics", f"metrics[{name!r}]", value, "a number or a one-element tensor")
        values[name] = float(value)
    return values


def _reductions(reduce: Any, values: dict[str, float]) -> dict[str, str]:
    """Metric name -> reduction, for the metrics to reduce."""
    if reduce is None:
        return {}
    if isinstance(reduce, str):
        if reduce not in _REDUCTIONS:
            raise bad_value(
                "log_metrics", "reduce", reduce, ("None", *_REDUCTIONS, "a dict name -> one of those")
            )
        return dict.fromkeys(values, reduce)
    if not isinstance(reduce, Mapping):
        raise bad_type(
            "log_metrics", "reduce", reduce, f"None, one of {_REDUCTIONS} or a dict name -> one of those"
        )
    for name, op in reduce.items():
        if name not in values:
            raise bad_value(
                "log_metrics", "reduce", dict(reduce), f"names of metrics given ({', '.join(values)})"
            )
        if op not in _REDUCTIONS:
            raise bad_value("log_metrics", f"reduce[{name!r}]", op, _REDUCTIONS)
    return {name: reduce[name] for name in values if name in reduce}


def _reduce(values: dict[str, float], ops: dict[str, str]) -> dict[str, float]:
    """``values`` with the metrics of ``ops`` reduced over every rank (one all_gather)."""
    from .rank_rows import rank_rows

    names = sorted(ops)  # the ranks may have built their dicts in any order
    # as Python numbers at once: a torch call per column cost more than the numbers
    rows = rank_rows([zlib.crc32("\0".join(names).encode()), *(values[n] for n in names)]).tolist()
    checksums, *columns = zip(*rows)
    if len(set(checksums)) > 1:  # every rank sees it: every rank raises
        raise CollectiveMismatchError(
            f"onedist.log_metrics: the ranks reduce metrics of different names; this rank's: {names}"
            "\nHINT: call od.log_metrics with the same metric names on every rank"
        )
    out = dict(values)
    for name, column in zip(names, columns):
        op = ops[name]
        if op == "mean":
            out[name] = math.fsum(column) / len(column)
        elif op == "sum":
            out[name] = math.fsum(column)
        else:
            out[name] = float(max(column) if op == "max" else min(column))
    return out
