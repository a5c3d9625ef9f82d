"""Stall detection: ranks blocked in different collectives raise, without debug mode or a timeout.

Every public collective records what it is in :data:`onedist.state.world` (a tuple; nothing is
computed). Once the same call has blocked for ``ONEDIST_STALL_S`` seconds (3 by default; 0 turns
the check off), the failure watcher publishes it to the store, with its number among the default
group's collectives, and reads its peers'. Two ranks blocked at the **same number** in different
calls (all_reduce against barrier, different shapes, a rank that skipped one) can never meet: the
rank that sees it writes the verdict to the store and breaks the group's connections
(``Backend.break_pending``), so the call in flight raises on every rank, and the guard turns that
into :class:`~onedist.CollectiveMismatchError` listing each rank's call and ``file:line``. A rank
that is merely slow is left alone: it is not blocked, or blocked at an earlier number.

Limits: only collectives on the default group are compared (a sub-group's numbering differs per
rank); plain ``torch.distributed`` calls are not seen; a backend that cannot break its pending
call (mpi4py's blocking MPI calls, Horovod, XLA) gets the error raised in its main thread when it
returns to Python, and is ended with the message printed when it does not within 3 s.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Optional

from ..state import world

__all__ = ["StallCheck", "read_verdict"]

_BLOCKED_KEY = "onedist/blocked/{}"
_VERDICT_KEY = "onedist/stall-verdict"
_READ_KEY = "onedist/stall-verdict-read/{}"
_RECEIPT_WAIT_S = 3.0


def stall_seconds() -> float:
    """How long a call blocks before the ranks compare it (``ONEDIST_STALL_S``, default 3 s)."""
    try:
        return max(0.0, float(os.environ.get("ONEDIST_STALL_S", "3")))
    except ValueError:
        return 3.0


class StallCheck:
    """One rank's side of the comparison, sampled by the failure watcher about once a second."""

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.after = stall_seconds()
        self.call: Any = None
        self.since = 0.0
        self.mine: Optional[dict[str, Any]] = None

    def sample(self) -> Optional[str]:
        """The mismatch report when this rank's blocked call differs from a peer's, else None."""
        call = world.call
        if self.after <= 0 or call is None or call[5] < 0 or world.describe_call is None:
            self.call = None  # outside a default-group collective: nothing to compare
            return None
        now = time.monotonic()
        if call is not self.call:
            self.call, self.since, self.mine = call, now, None
            return None
        if now - self.since < self.after:
            return None
        if self.mine is None:  # published once per blocked call: its number makes it unambiguous
            self.mine = dict(world.describe_call(call), seq=call[5], rank=self.rank)
            self.store.set(_BLOCKED_KEY.format(self.rank), json.dumps(self.mine))
        return self._compare()

    def _compare(self) -> Optional[str]:
        assert self.mine is not None
        reports = {self.rank: self.mine}
        for r in range(self.world_size):
            key = _BLOCKED_KEY.format(r)
            if r != self.rank and self.store.check([key]):
                report = json.loads(self.store.get(key))
                if report["seq"] == self.mine["seq"]:
                    reports[r] = report
        if all(rep["sig"] == self.mine["sig"] for rep in reports.values()):
            return None
        message = _report(reports, self.world_size, self.after)
        self.store.set(_VERDICT_KEY, json.dumps({"seq": self.mine["seq"], "message": message}))
        return message


def _report(reports: dict[int, dict[str, Any]], world_size: int, after: float) -> str:
    seq = next(iter(reports.values()))["seq"]
    lines = [
        f"onedist: the ranks are blocked in different collectives (call {seq} on the default group, "
        f"found after {after:.0f} s without debug mode), so none of them can complete:"
    ]
    for r in sorted(reports):
        lines.append(f"  rank {r}: {reports[r]['call']} at {reports[r]['site']}")
    others = sorted(set(range(world_size)) - set(reports))
    if others:
        lines.append(f"  ranks {others}: not blocked in a collective there (busy, or still on the way)")
    lines.append(
        "HINT: every rank must call the same collectives, in the same order, on values of the same type, "
        "dtype and shape; ONEDIST_DEBUG=1 checks each call before it is made"
    )
    return "\n".join(lines)


def read_verdict(store: Any, seq: int, rank: int, world_size: int) -> Optional[str]:
    """The stall verdict that explains why a call numbered ``seq`` (or later) failed, if any.

    Every rank that reads it leaves a receipt; rank 0, which usually hosts the store, waits up to
    3 s for the others' before it raises (its exit would take the verdict with it)."""
    if store is None or seq < 0:
        return None
    try:
        if not store.check([_VERDICT_KEY]):
            return None
        verdict = json.loads(store.get(_VERDICT_KEY))
        if verdict["seq"] > seq:
            return None
        store.set(_READ_KEY.format(rank), "1")
        if rank == 0:
            receipts = [_READ_KEY.format(r) for r in range(1, world_size)]
            deadline = time.monotonic() + _RECEIPT_WAIT_S
            while not store.check(receipts) and time.monotonic() < deadline:
                time.sleep(0.02)
    except Exception:
        return None
    return str(verdict["message"])
