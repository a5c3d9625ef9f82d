"""Stall reports: where every rank is when one has waited long in a collective (not an error).

A rank that is merely slow (a long step, a stuck data loader, an endless loop, a ``time.sleep``)
is no mismatch, and the stall check leaves it alone (:mod:`.stall`); its peers wait. So that this
never stays silent until a timeout, a rank whose call has waited ``ONEDIST_STALL_REPORT_S``
seconds (60 by default, Horovod's stall inspector's figure; 0 turns reports off) asks every rank,
through the store, where it is. Each rank's failure watcher (a thread: it answers while the main
thread is inside C++) publishes the call it waits in, if any, and its main thread's Python stack;
the first rank of each node prints them all, once, to its launcher's output. The next report comes
after twice the wait (60 s, then 120 s more, then 240 s more...), while the same call waits. The
group's own timeout still ends the wait with an error.

Cost: one store round trip per rank and second (a counter), nothing on the calling thread.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import runpy
import socket
import sys
import time
import traceback
from typing import Any, Optional

from ..backends.recorded.calls import user_site
from ..state import world
from .logged import LoggedCall
from .stall import blocked_call, describe_logged

__all__ = ["StallReports", "report_seconds", "rank_state", "format_state"]

REPORTS = "onedist/stall-reports"  # the counter of requests
_STATE = "onedist/stall-report/{}/{}"  # one rank's state for request n
_COLLECT_S = 1.5  # how long the printing rank waits for the others' states
_FRAMES = 12  # the main thread's innermost frames shown
#: frames not shown: onedist's own, and the standard library's process starters
_HIDDEN = (
    os.path.join(os.path.dirname(sys.modules["onedist"].__file__ or ""), ""),
    os.path.join(os.path.dirname(multiprocessing.__file__ or ""), ""),
    runpy.__file__ or "<runpy>",
    "<frozen runpy>",
)


def report_seconds() -> float:
    """How long a call waits before the first stall report (``ONEDIST_STALL_REPORT_S``)."""
    try:
        return max(0.0, float(os.environ.get("ONEDIST_STALL_REPORT_S", "60")))
    except ValueError:
        return 60.0


def rank_state(rank: int, main_ident: int) -> dict[str, Any]:
    """Where this rank is: the collective it waits in (and for how long), its main thread's stack."""
    call, waited = _waiting(main_ident)
    frame = sys._current_frames().get(main_ident)
    summary = [f for f in traceback.extract_stack(frame) if not f.filename.startswith(_HIDDEN)]
    stack = "".join(traceback.format_list(summary[-_FRAMES:]))
    return {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "waits": call, "for": waited,
            "stack": stack, "site": user_site(frame)}  # fmt: skip


def _waiting(main_ident: int) -> tuple[Optional[dict[str, Any]], float]:
    call = blocked_call(main_ident)
    if call is None:
        return None, 0.0
    if isinstance(call, LoggedCall):
        described = describe_logged(call, main_ident)
        return {"call": described["call"], "site": described["site"], "seq": call.seq}, (
            time.monotonic() - call.entry.started
        )
    described = call.describe()
    started = getattr(call, "started", 0.0)  # onedist's calls know; a dist.* call on the stack does not
    return {"call": described["call"], "site": described["site"], "seq": call.seq}, (
        time.monotonic() - started if started else 0.0
    )


def format_state(state: dict[str, Any]) -> str:
    """One rank's part of a report."""
    head = f"  rank {state['rank']} (pid {state['pid']} on {state['host']}): "
    waits = state.get("waits")
    if waits is None:
        head += "not in a collective on record; its main thread is at:"
    else:
        since = f", for {state['for']:.0f} s" if state.get("for") else ""
        head += f"waits in {waits['call']} (call {waits['seq']}) at {waits['site']}{since}; its main thread:"
    stack = "".join(f"    {line}\n" for line in state.get("stack", "").rstrip().splitlines())
    return head + "\n" + stack.rstrip()


class StallReports:
    """One rank's side of the reports, sampled by the failure watcher about once a second."""

    def __init__(self, store: Any, rank: int, world_size: int, main_ident: int) -> None:
        self.store, self.rank, self.world_size, self.main_ident = store, rank, world_size, main_ident
        self.first = report_seconds()
        self.seen = int(store.add(REPORTS, 0))  # requests of an earlier group are not this one's
        self.call: Any = None  # the call this rank waits in, and when it began waiting
        self.since = 0.0
        self.next_at = 0.0  # seconds of waiting at which this rank asks for the next report
        self.interval = 0.0  # the wait before the next one after that
        self.last_seen = -1e9  # when this rank last saw a new request (monotonic)
        self.to_print: list[tuple[int, float]] = []  # (request, when to print it)

    def sample(self) -> None:
        if self.first <= 0:
            return
        now = time.monotonic()
        self._maybe_request(now)
        count = int(self.store.add(REPORTS, 0))
        while self.seen < count:
            self.seen += 1
            self.last_seen = now
            self.store.set(
                _STATE.format(self.seen, self.rank), json.dumps(rank_state(self.rank, self.main_ident))
            )
            if self._prints():
                self.to_print.append((self.seen, now + _COLLECT_S))
        while self.to_print and self.to_print[0][1] <= now:
            self._print(self.to_print.pop(0)[0])

    def _maybe_request(self, now: float) -> None:
        call = blocked_call(self.main_ident)
        same = call is self.call or (isinstance(call, LoggedCall) and call.same(self.call))
        if not same:
            self.call, self.since, self.next_at, self.interval = call, now, self.first, self.first
            return
        if call is None or now - self.since < self.next_at:
            return
        self.interval *= 2  # at 60 s, 180 s, 420 s...: each wait twice the one before
        self.next_at += self.interval
        if now - self.last_seen > self.first / 2:  # a peer waiting in the same stall asked already
            self.store.add(REPORTS, 1)

    def _prints(self) -> bool:
        """The first rank of each node prints (every launcher shows a report)."""
        try:
            return world.backend.layout().local_rank == 0
        except Exception:
            return self.rank == 0

    def _print(self, n: int) -> None:
        states = []
        for r in range(self.world_size):
            key = _STATE.format(n, r)
            if self.store.check([key]):
                states.append(json.loads(self.store.get(key)))
        waiting = [s for s in states if s.get("waits")]
        longest = max((s.get("for", 0.0) for s in waiting), default=0.0)
        silent = sorted(set(range(self.world_size)) - {s["rank"] for s in states})
        lines = [
            f"onedist: stall report: {len(waiting)} of {self.world_size} ranks wait in a collective (the "
            f"longest for {longest:.0f} s); not an error yet, the group's timeout still applies:"
        ]
        lines += [format_state(s) for s in sorted(states, key=lambda s: s["rank"])]
        if silent:
            lines.append(f"  ranks {silent}: no answer (their watcher is not running, or they are gone)")
        lines.append(
            "(the next report after twice this wait; ONEDIST_STALL_REPORT_S sets the first, 0 turns them off)"
        )
        sys.stderr.write("\n".join(lines) + "\n")
        sys.stderr.flush()
