"""Rank-aware logging: rank 0 logs by default, every rank on request, with a rank prefix."""

from __future__ import annotations

import logging
import sys
from typing import IO, Optional

__all__ = ["log_shown", "setup_logger"]

_DEFAULT_FORMAT = "%(asctime)s %(name)s %(levelname)s: %(message)s"
_ALL_RANKS_FORMAT = "%(asctime)s [rank%(rank)s] %(name)s %(levelname)s: %(message)s"


class _RankFilter(logging.Filter):
    """Adds ``record.rank``; drops records of ranks other than 0 unless ``all_ranks``.

    The rank is read when a record is logged, so a logger set up before the distributed context
    exists is right once it does.
    """

    def __init__(self, distributed_rank: Optional[int], all_ranks: bool) -> None:
        super().__init__()
        self.distributed_rank = distributed_rank
        self.all_ranks = all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        rank = self.distributed_rank
        if rank is None:
            from .state import current

            rank = current().rank
        record.rank = rank
        return self.all_ranks or rank == 0


def setup_logger(
    name: Optional[str] = "onedist",
    level: int = logging.INFO,
    stream: Optional[IO[str]] = None,
    format: Optional[str] = None,
    filepath: Optional[str] = None,
    distributed_rank: Optional[int] = None,
    reset: bool = False,
    encoding: str = "utf-8",
    all_ranks: bool = False,
) -> logging.Logger:
    """A logger that writes on rank 0 only (or on every rank, each line prefixed with its rank).

    Args:
        name: logger name; None for the root logger.
        level: logging level.
        stream: where to write (default ``sys.stderr``).
        format: ``logging`` format; ``%(rank)s`` is available. Default: time, name, level,
            message, and ``[rank<N>]`` when ``all_ranks``.
        filepath: also write to this file (every rank that logs; use a per-rank path with
            ``all_ranks``).
        distributed_rank: the rank to filter on; default: the live rank at each record.
        reset: remove the handlers this function added before (re-configure).
        encoding: file encoding.
        all_ranks: log on every rank instead of rank 0 only.

    Returns:
        The configured logger (propagation to the root logger is turned off).

    Example:
        >>> import onedist as od
        >>> log = od.setup_logger("train", all_ranks=True)
        >>> log.info("epoch %d done", 1)   # stderr: 2026-11-22 20:00:00,000 [rank0] train INFO: epoch 1 done
    """
    logger = logging.getLogger(name)
    ours = [h for h in logger.handlers if getattr(h, "_onedist", False)]
    if ours and not reset:
        return logger
    for h in ours:
        logger.removeHandler(h)
    logger.setLevel(level)
    logger.propagate = False
    fmt = logging.Formatter(format or (_ALL_RANKS_FORMAT if all_ranks else _DEFAULT_FORMAT))
    handlers: list[logging.Handler] = [logging.StreamHandler(stream or sys.stderr)]
    if filepath is not None:
        handlers.append(logging.FileHandler(filepath, encoding=encoding))
    for h in handlers:
        h.setLevel(level)
        h.setFormatter(fmt)
        h.addFilter(_RankFilter(distributed_rank, all_ranks))
        h._onedist = True  # type: ignore[attr-defined]
        logger.addHandler(h)
    return logger


def log_shown(logger: logging.Logger, level: int, msg: str, *args: object) -> None:
    """``logger.log(level, msg, *args)``, and where logging is configured nowhere (no handler
    between ``logger`` and the root) the line on stderr on rank 0 all the same, as
    :func:`setup_logger`'s lines are: Python's last resort shows warnings only, and onedist's
    INFO lines (od.resume's step) are what a user looks for. A handler anywhere decides instead."""
    if logger.hasHandlers():
        logger.log(level, msg, *args)
        return
    record = logger.makeRecord(logger.name, level, "(unknown file)", 0, msg, args, None)
    if _RankFilter(None, False).filter(record):
        sys.stderr.write(logging.Formatter(_DEFAULT_FORMAT).format(record) + "\n")
