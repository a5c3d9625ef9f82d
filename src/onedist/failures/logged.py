"""The calls on record (:mod:`onedist.backends.recorded`) as the stall check reports and compares them.

A rank whose oldest unfinished call on record has waited for the stall time publishes it with the
last calls before it (number, running hash of the signatures, text, line). Two ranks' reports
settle what neither could alone:

* the first call number at which their running hashes differ is the first call they disagree on
  (different kind, reduction, dtype or size), even when gloo let one of them return from it;
* a send or receive that waits for a peer which is itself blocked elsewhere, and has not posted the
  matching receive or send, can never complete (point-to-point calls are counted per peer: rank A's
  k-th send to B is B's k-th receive from A).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Optional

from ..backends.recorded.calls import RECV, SEND, CallLog, Entry, describe, logs

__all__ = ["LoggedCall", "first_difference", "p2p_deadlock", "waiting_call"]

#: how many calls before the waiting one a report carries
RECENT = 16


class LoggedCall:
    """A call on record that this rank waits in."""

    __slots__ = ("entry", "log")

    def __init__(self, log: CallLog, entry: Entry) -> None:
        self.log, self.entry = log, entry

    @property
    def seq(self) -> int:
        return self.entry.seq

    @property
    def group(self) -> tuple[int, ...]:
        return self.log.ranks

    @property
    def p2p(self) -> bool:
        return is_p2p(self.entry)

    @property
    def newest(self) -> bool:
        """The last collective this rank made on the group (a blocking call in progress is)."""
        return not self.p2p and self.entry.seq == self.log.seq

    def same(self, other: Any) -> bool:
        return isinstance(other, LoggedCall) and other.entry is self.entry

    def describe(self, text: Optional[str] = None) -> dict[str, Any]:
        """The report: ``text`` (the caller's words for it, when it knows better) or the log's."""
        entry, log = self.entry, self.log
        return {
            "call": text or entry_text(log, entry),
            "site": entry.site,
            "sig": json.dumps([*entry.sig, entry.peer, entry.step]),
            "group": list(log.ranks),
            "peer": entry.peer if self.p2p else -1,
            "kind": entry.sig[0],
            "nth": entry.seq if self.p2p else 0,
            "recent": [
                [e.seq, e.chain, entry_text(log, e), e.site]
                for e in log.recent()
                if not is_p2p(e) and (log.seq if self.p2p else entry.seq) - RECENT < e.seq <= log.seq
            ],
            "sent": {str(k): v for k, v in log.sent.items()},
            "received": {str(k): v for k, v in log.received.items()},
            "idle": main_thread_idle(),
        }


def is_p2p(entry: Entry) -> bool:
    return entry.sig[0] in (SEND, RECV)


def entry_text(log: CallLog, entry: Entry) -> str:
    if entry.text:
        return entry.text
    text = describe(entry.sig, entry.step)
    if is_p2p(entry):
        which = "send to" if entry.sig[0] == SEND else "receive from"
        peer = "any rank" if entry.peer < 0 else f"rank {log.ranks[entry.peer]}"
        return f"{text} (its {_nth(entry.seq)} {which} {peer})"
    return text


def _nth(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def waiting_call() -> Optional[LoggedCall]:
    """The oldest call on record, in any of this process's groups, that has not completed."""
    oldest: Optional[LoggedCall] = None
    for log in logs():
        waiting = log.waiting()
        if waiting and (oldest is None or waiting[0].started < oldest.entry.started):
            oldest = LoggedCall(log, waiting[0])
    return oldest


def first_difference(reports: dict[int, dict[str, Any]]) -> Optional[tuple[int, dict[int, list[Any]]]]:
    """The first call number at which the ranks' running hashes differ, with each rank's
    ``[seq, hash, text, site]`` there; None when they agree wherever they overlap."""
    by_rank = {r: {int(item[0]): item for item in rep.get("recent", [])} for r, rep in reports.items()}
    common = set.intersection(*(set(seqs) for seqs in by_rank.values())) if by_rank else set()
    for seq in sorted(common):
        if len({by_rank[r][seq][1] for r in by_rank}) > 1:
            return seq, {r: by_rank[r][seq] for r in by_rank}
    return None


def p2p_deadlock(mine: dict[str, Any], rank: int, reports: dict[int, dict[str, Any]]) -> Optional[int]:
    """The rank this rank's send or receive waits for when that rank is blocked elsewhere and has
    not posted the matching call; None otherwise (or when this rank does not wait in one)."""
    peer_index = mine.get("peer", -1)
    if peer_index < 0 or not mine.get("idle"):
        return None
    peer = mine["group"][peer_index]
    theirs = reports.get(peer)
    if theirs is None or not theirs.get("idle"):
        return None
    me = str(mine["group"].index(rank))
    posted = theirs["received" if mine["kind"] == SEND else "sent"].get(me, 0)
    if posted >= mine["nth"]:
        return None  # the peer posted it: the call may still complete
    return int(peer)


# ---------------------------------------------------------------------------- is the main thread idle
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_last_cpu: list[float] = [-1.0, 0.0]  # the main thread's CPU seconds, and when read


def _main_cpu() -> Optional[float]:
    tid = threading.main_thread().native_id
    try:
        with open(f"/proc/self/task/{tid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime
    except (OSError, IndexError, ValueError):
        return None


def main_thread_idle() -> bool:
    """True when the main thread used under a tenth of the time since the last look (it waits:
    a rank computing inside one long C call is not idle); True where /proc cannot tell."""
    cpu, now = _main_cpu(), time.monotonic()
    if cpu is None:
        return True
    before, then = _last_cpu
    _last_cpu[:] = [cpu, now]
    if before < 0 or now - then < 0.2:
        return True
    return cpu - before < 0.1 * (now - then)
