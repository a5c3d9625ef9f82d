"""``od.progress``: one progress display for the whole job, on the main process only.

The count and the rate shown are the job's: the items this rank has iterated times the world
size. That is exact when every rank iterates as many items as the others, which
:func:`onedist.auto_dataloader`'s sampler guarantees (it pads the ranks' shares to one length),
and it costs no collective: the display never slows the ranks down or waits for them. (For
throughput measured across ranks with uneven batches, see :class:`onedist.Throughput`, which
makes one small collective every N steps.)

On a terminal, with tqdm installed, it is a tqdm bar; otherwise (output to a file or a pipe, as
under ``onedist run``, torchrun's log files, ``srun`` and ``mpirun``, which prefix each line with
its rank) one plain line every ``every_s`` seconds and one at the end. Other ranks print nothing
and iterate the iterable itself, with no wrapper in between.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from importlib import import_module
from importlib.util import find_spec
from types import TracebackType
from typing import Any, Generic, Optional, TextIO, TypeVar

from ..errors import bad_type, bad_value

__all__ = ["Progress", "progress"]

T = TypeVar("T")
_STYLES = ("auto", "bar", "lines")


def progress(
    iterable: Iterable[T],
    total: Optional[int] = None,
    desc: Optional[str] = None,
    *,
    every_s: float = 10.0,
    unit: str = "it",
    style: str = "auto",
    file: Optional[TextIO] = None,
) -> Progress[T]:
    """Iterate ``iterable``, showing the job's progress on the main process (global rank 0).

    Call it on every rank with the same arguments; it makes no collective.

    Args:
        iterable: what to iterate (a DataLoader, a range, ...).
        total: the number of items this rank iterates; None: ``len(iterable)`` when it has one,
            else unknown (no percentage and no ETA). The display shows ``total`` times the world
            size.
        desc: a label in front of the display.
        every_s: seconds between two plain lines (0: a line after every item); the bar ignores it.
        unit: the name of an item ("it", "batch", "sample", ...).
        style: "auto" (a tqdm bar when tqdm is installed and ``file`` is a terminal, else plain
            lines), "bar" or "lines".
        file: where to write; None: ``sys.stderr``, as tqdm does.

    Returns:
        A :class:`Progress` to iterate; its ``set_postfix(**metrics)`` adds metrics to the display.

    Example:
        >>> import sys, onedist as od
        >>> bar = od.progress(range(4), desc="train", every_s=0, style="lines", file=sys.stdout)
        >>> for i in bar:
        ...     bar.set_postfix(loss=1.0 / (i + 1))
        train: 1/4 it 25% | ... it/s | elapsed 0:00 | ETA 0:00 | loss=1
        train: 2/4 it 50% | ... loss=0.5
        train: 3/4 it 75% | ... loss=0.3333
        train: 4/4 it 100% | ... loss=0.25
    """
    from ..context import get_world_size, is_main_process

    _check(iterable, total, desc, every_s, unit, style)
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    return Progress(iterable, total, desc, every_s, unit, style, file, is_main_process(), get_world_size())


def _check(iterable: Any, total: Any, desc: Any, every_s: Any, unit: Any, style: Any) -> None:
    if not isinstance(iterable, Iterable):
        raise bad_type("progress", "iterable", iterable, "an iterable (a DataLoader, a range, a list, ...)")
    if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 0):
        raise bad_value("progress", "total", total, "None or an int >= 0 (the items this rank iterates)")
    if desc is not None and not isinstance(desc, str):
        raise bad_type("progress", "desc", desc, "None or a str")
    if isinstance(every_s, bool) or not isinstance(every_s, (int, float)) or not every_s >= 0:
        raise bad_value("progress", "every_s", every_s, "a number of seconds >= 0")
    if not isinstance(unit, str) or not unit:
        raise bad_value("progress", "unit", unit, "a non-empty str")
    if style not in _STYLES:
        raise bad_value("progress", "style", style, _STYLES)


class Progress(Generic[T]):
    """The progress of one loop over an iterable (made by :func:`onedist.progress`).

    Iterate it as the iterable itself; ``with`` or :meth:`close` ends the display early. The count
    rises when the loop asks for the next item, so an item counts once its loop body is done.

    Attributes:
        n: the items counted so far, over every rank (this rank's times the world size).
        total: the items of the whole loop, over every rank; None when unknown.
    """

    def __init__(
        self,
        iterable: Iterable[T],
        total: Optional[int],
        desc: Optional[str],
        every_s: float,
        unit: str,
        style: str,
        file: Optional[TextIO],
        shown: bool,
        world_size: int,
    ) -> None:
        self.iterable, self.desc, self.every_s, self.unit = iterable, desc, float(every_s), unit
        self.world_size, self.shown = world_size, shown
        self.n = 0
        self.total = None if total is None else total * world_size
        self.postfix: dict[str, Any] = {}
        self.file = file
        self.style = _pick_style(style, file if file is not None else sys.stderr) if shown else "none"
        self.bar: Any = None
        self.started = self.last_line = 0.0
        self.line_n = -1  # the count the last plain line showed
        self.closed = False

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[T]:
        if not self.shown:
            return iter(self.iterable)  # other ranks: the iterable itself, no cost per item
        return self._shown()

    def _shown(self) -> Iterator[T]:
        self._start()
        step, bar, clock = self.world_size, self.bar, time.monotonic
        try:
            for item in self.iterable:
                yield item
                self.n += step
                if bar is not None:
                    bar.update(step)
                elif clock() - self.last_line >= self.every_s:
                    self._line()
        finally:
            self.close()

    def _start(self) -> None:
        self.started = self.last_line = time.monotonic()
        self.closed = False
        if self.style == "bar":
            tqdm = import_module("tqdm").tqdm  # optional: found by _pick_style

            self.bar = tqdm(
                total=self.total, desc=self.desc, unit=self.unit, file=self.file, dynamic_ncols=True
            )

    def set_postfix(self, **metrics: Any) -> None:
        """Show ``metrics`` (name=value) after the count from the next update on (main process).

        Example:
            >>> import onedist as od
            >>> bar = od.progress([1, 2], style="lines")
            >>> bar.set_postfix(loss=0.25, lr=1e-3)
            >>> bar.postfix
            {'loss': 0.25, 'lr': 0.001}
        """
        if not self.shown:
            return
        self.postfix = dict(metrics)
        if self.bar is not None:
            self.bar.set_postfix({k: _fmt(v) for k, v in metrics.items()}, refresh=False)

    def close(self) -> None:
        """End the display: the bar is closed, or the last plain line written (once)."""
        if not self.shown or self.closed:
            return
        self.closed = True
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.started and self.line_n != self.n:
            self._line()

    def _line(self) -> None:
        now = time.monotonic()
        self.last_line, self.line_n = now, self.n
        file = self.file if self.file is not None else sys.stderr
        file.write(format_line(self.desc, self.n, self.total, self.unit, now - self.started, self.postfix))
        file.flush()

    def __enter__(self) -> Progress[T]:
        return self

    def __exit__(
        self, tp: Optional[type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        self.close()


def format_line(
    desc: Optional[str], n: int, total: Optional[int], unit: str, elapsed: float, postfix: dict[str, Any]
) -> str:
    """One plain progress line: ``desc: n/total unit pct% | rate unit/s | elapsed m:ss | ETA m:ss | k=v``."""
    rate = n / elapsed if elapsed > 0 else 0.0
    head = f"{desc}: " if desc else ""
    if total is not None:
        parts = [f"{head}{n}/{total} {unit} {100 * n // total if total else 100}%"]
    else:
        parts = [f"{head}{n} {unit}"]
    parts.append(f"{rate:.1f} {unit}/s" if rate < 1000 else f"{rate:.0f} {unit}/s")
    parts.append(f"elapsed {_clock(elapsed)}")
    if total is not None:
        parts.append(f"ETA {_clock((total - n) / rate) if rate > 0 else '?'}")
    if postfix:
        parts.append(", ".join(f"{k}={_fmt(v)}" for k, v in postfix.items()))
    return " | ".join(parts) + "\n"


def _fmt(value: Any) -> str:
    if hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1:
        value = value.item()  # a one-element tensor: its number
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _clock(seconds: float) -> str:
    s = int(seconds)
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


def _pick_style(style: str, file: Any) -> str:
    """ "bar" or "lines": the bar needs tqdm and a terminal (a launcher's pipe or a log file gets lines)."""
    if style != "auto":
        if style == "bar":
            _require_tqdm()
        return style
    try:
        terminal = bool(file.isatty())
    except (AttributeError, ValueError):
        terminal = False
    if not terminal:
        return "lines"
    return "bar" if find_spec("tqdm") is not None else "lines"


def _require_tqdm() -> None:
    if find_spec("tqdm") is None:
        raise bad_value("progress", "style", "bar", "'auto' or 'lines' without tqdm", hint="pip install tqdm")
