"""The store keys through which the ranks compare blocked calls: one place that names the
protocol :mod:`.stall` (the watcher's check) and :mod:`.last_call` (the check at finalize) share.

A rank publishes what it is blocked in under ``BLOCKED_KEY`` (``"{}"``: nothing), the rank that
finds a mismatch writes the verdict under ``VERDICT_KEY``, every rank that reads it leaves a
receipt under ``READ_KEY``, and a rank done with its collectives says so under ``DONE_KEY`` (and
under ``CHECKED_KEY`` once its check at finalize made its last store call; its sends and
receives under ``P2P_KEY`` just before).
"""

from __future__ import annotations

import time
from typing import Any

__all__ = [
    "BLOCKED_KEY",
    "CHECKED_KEY",
    "DONE_KEY",
    "HISTORY_KEY",
    "P2P_KEY",
    "P2P_RANKS_KEY",
    "READ_KEY",
    "RECEIPT_WAIT_S",
    "VERDICT_KEY",
    "await_receipts",
]

BLOCKED_KEY = "onedist/blocked/{}"
VERDICT_KEY = "onedist/stall-verdict"
READ_KEY = "onedist/stall-verdict-read/{}"
#: a rank done with its collectives, at finalize
DONE_KEY = "onedist/done/{}"
#: a rank through with the check at finalize: it calls the store no more
CHECKED_KEY = "onedist/checked/{}"
#: a rank's sends and receives on the default group, per peer, published at finalize (.p2p_counts)
P2P_KEY = "onedist/p2p/{}"
#: how many ranks made any send or receive (.p2p_counts reads the counts only when not zero)
P2P_RANKS_KEY = "onedist/p2p-ranks"
#: a rank's last calls on a recorded group (the group's log key, the rank), see .history
HISTORY_KEY = "onedist/calls/{}/{}"
#: how long the rank that hosts the store waits for the others' receipts before it raises (its
#: exit would take the verdict with it)
RECEIPT_WAIT_S = 3.0


def await_receipts(store: Any, members: Any, me: int, timeout: float, gone: Any = None) -> None:
    """Wait up to ``timeout`` s until every member but ``me`` has left its read receipt (or
    ``gone(store)`` says the store's host left)."""
    receipts = [READ_KEY.format(r) for r in members if r != me]
    deadline = time.monotonic() + timeout
    while receipts and time.monotonic() < deadline:
        if (gone is not None and gone(store)) or store.check(receipts):
            return
        time.sleep(0.02)
