"""Calls that completed although the ranks disagreed on them: found from the calls on record.

gloo completes some calls that the ranks made differently, and nobody waits: an all_reduce with
SUM on one rank and MAX on another (each rank reduces with its own operation), or of float32 on one
rank against int32 of the same byte size. The stall check never sees them. So, once a second, the
failure watcher publishes each recorded group's last calls (number, running hash of the signatures,
text, line: :data:`onedist.failures.logged.RECENT` of them) when they changed, and compares them
with the next rank's in the group (a ring: any difference between two ranks is a difference between
two neighbours somewhere). The first call number at which the hashes differ is the first call they
disagree on; the rank that finds it writes the verdict, reports it as its failure (every rank's
watcher raises it in its main thread within a second) and breaks the group's pending calls.

Cost: one store write (when the group made calls) and one read per group and second, from the
watcher's thread. The keys carry a number the group's members agreed on when they made it, so a
report left in the store by an earlier group (the same ``env://`` port, re-initialised) is never read.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from ..backends.recorded.calls import CallLog, logs
from .keys import HISTORY_KEY
from .logged import entry_text, first_difference, is_p2p

__all__ = ["HistoryCheck"]

#: how many calls each report carries
_CARRIED = 32


class HistoryCheck:
    """One rank's side of the comparison, sampled by the failure watcher about once a second."""

    def __init__(self, store: Any, rank: int) -> None:
        self.store, self.rank = store, rank
        #: log key -> (the last completed call it published, that report)
        self._published: dict[str, tuple[int, dict[str, Any]]] = {}

    def sample(self) -> Optional[tuple[str, CallLog]]:
        """The verdict (and the log of its group) when two neighbours' calls differ, else None."""
        for log in logs():
            if len(log.ranks) < 2 or self.rank not in log.ranks:
                continue
            mine = self._publish(log)
            if mine is None:
                continue
            found = self._compare(log, mine)
            if found is not None:
                return found, log
        return None

    def _publish(self, log: CallLog) -> Optional[dict[str, Any]]:
        """This rank's completed calls (a call still waited for is the stall check's), published
        when they changed; None once a call of the group failed (a timeout, a broken connection:
        the failure's own path explains it, and a failed call's partner may be any call)."""
        waiting = log.waiting()
        if log.failed:
            return None
        done = min((e.seq for e in waiting if not is_p2p(e)), default=log.seq + 1) - 1
        recent = [e for e in log.recent() if not is_p2p(e)]
        # a call numbered as it started is written just after: not done until it is written
        done = min(done, max((e.seq for e in recent), default=0))
        last = self._published.get(log.key)
        if last is not None and last[0] == done:
            return last[1]
        entries = [e for e in recent if e.seq <= done][-_CARRIED:]
        report = {"recent": [[e.seq, e.chain, entry_text(log, e), e.site] for e in entries]}
        self.store.set(HISTORY_KEY.format(log.key, self.rank), json.dumps(report))
        self._published[log.key] = (done, report)
        return report

    def _compare(self, log: CallLog, mine: dict[str, Any]) -> Optional[str]:
        me = log.ranks.index(self.rank)
        neighbour = log.ranks[(me + 1) % len(log.ranks)]
        key = HISTORY_KEY.format(log.key, neighbour)
        if not self.store.check([key]):
            return None
        theirs = json.loads(self.store.get(key))
        found = first_difference({self.rank: mine, neighbour: theirs})
        if found is None:
            return None
        seq, calls = found
        return _message(seq, calls, log)


def _message(seq: int, calls: dict[int, list[Any]], log: CallLog) -> str:
    from .stall import HINT

    where = "the default group" if log.default else f"group {list(log.ranks)}"
    lines = [
        f"onedist: the ranks made different calls as call {seq} on {where}, and the calls completed (found "
        "by comparing the ranks' calls on record, without debug mode): their results are wrong:"
    ]
    for r in sorted(calls):
        lines.append(f"  rank {r}: {calls[r][2]} at {calls[r][3]}")
    lines.append(HINT)
    return "\n".join(lines)
