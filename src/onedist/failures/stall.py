"""Stall detection: ranks blocked in different collectives raise, without debug mode or a timeout.

Every public collective records what it is in :data:`onedist.state.world` (a tuple; nothing is
computed), with its number among its group's collectives; plain ``torch.distributed`` calls are
found on the main thread's stack by :mod:`onedist.failures.torch_calls`, numbered by the process
group. Once the same call has blocked for ``ONEDIST_STALL_S`` seconds (3 by default; 0 turns the
check off), the failure watcher publishes it to the store, and reads its group's peers' reports
once a second (a rank that leaves the call clears its report). Two cases can never complete:

- two ranks blocked at the **same number** in different calls (all_reduce against barrier, a rank
  that skipped one): reported at once;
- every member blocked, at **different numbers**: a rank returned from a call its peers are still
  blocked in (gloo returns an all_reduce of fewer elements early, with a wrong result) and waits
  for them in the next one; reported when two samples a second apart agree and every peer's
  watcher has looked again in between (a new "beat" in its report: a watcher starved on a busy
  machine could otherwise leave a report behind that its main thread has already left).

The rank that sees it writes the verdict to the store and breaks the group's connections
(``Backend.break_pending``), so the call in flight raises on every rank, and the guard turns that
into :class:`~onedist.CollectiveMismatchError` listing each rank's call and ``file:line`` (a plain
call gets it raised in the main thread). A rank that is merely slow is left alone: it is not
blocked, or blocked where a peer still computes.

Limits: onedist's calls and plain ``torch.distributed`` calls are numbered apart, so a rank in one
against a rank in the other is not compared; a rank that spends longer than the stall time inside
a call its peers already finished (unpickling a huge object) could read as the second case (raise
``ONEDIST_STALL_S``); a backend that cannot break its pending call (mpi4py's blocking MPI calls,
Horovod, XLA) gets the error raised in its main thread when it returns to Python, and is ended with
the message printed when it does not within 3 s.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Optional

from ..backends.recorded.calls import SEND
from ..state import world
from .channel import server_gone
from .keys import BLOCKED_KEY, DONE_KEY, P2P_KEY, READ_KEY, RECEIPT_WAIT_S, VERDICT_KEY, await_receipts
from .logged import LoggedCall, first_difference, main_thread_idle, p2p_deadlock, waiting_call
from .torch_calls import TorchCall, torch_call

__all__ = ["HINT", "RETURNED_EARLY", "StallCheck", "forget_stalls", "read_verdict", "write_verdict"]


def stall_seconds() -> float:
    """How long a call blocks before the ranks compare it (``ONEDIST_STALL_S``, default 3 s)."""
    try:
        return max(0.0, float(os.environ.get("ONEDIST_STALL_S", "3")))
    except ValueError:
        return 3.0


class StallCheck:
    """One rank's side of the comparison, sampled by the failure watcher about once a second."""

    def __init__(self, store: Any, rank: int, world_size: int, main_ident: int = 0) -> None:
        self.store, self.rank, self.world_size, self.main_ident = store, rank, world_size, main_ident
        self.after = stall_seconds()
        self.call: Any = None  # what the main thread is blocked in: onedist's tuple, or a TorchCall
        self.since = 0.0
        self.mine: Optional[dict[str, Any]] = None
        self.published = 0  # how many reports this rank published (each report's id)
        self.apart: Optional[tuple[Any, ...]] = None  # the different numbers seen at the last sample
        self.beats: dict[int, int] = {}  # the peers' beats when those numbers were first seen
        self.decided = False  # this rank wrote the verdict

    def sample(self) -> Optional[str]:
        """The mismatch report when this rank's blocked call cannot complete, else None."""
        if self.after <= 0:
            return None
        call = self._blocked()
        idle = main_thread_idle()
        now = time.monotonic()
        if not _same(call, self.call):
            if self.mine is not None:  # left the call it reported: peers must not count it blocked
                self.store.set(BLOCKED_KEY.format(self.rank), "{}")
            self.call, self.since, self.mine, self.apart = call, now, None, None
            return None
        if call is None or now - self.since < self.after:
            return None
        if self.mine is None:  # published once per blocked call: its number makes it unambiguous
            self.mine = self._report(call)
            if self.mine is None:
                self.call = None
                return None
        else:  # still blocked in it: a new beat tells the peers that this report is current
            self.mine["beat"] = self.mine.get("beat", 0) + 1
        self.mine["idle"] = idle
        self.store.set(BLOCKED_KEY.format(self.rank), json.dumps(self.mine))
        return self._verdict_of_peer() or self._compare()

    def _blocked(self) -> Any:
        return blocked_call(self.main_ident)

    def _report(self, call: Any) -> Optional[dict[str, Any]]:
        if isinstance(call, LoggedCall):
            described, seq, domain = describe_logged(call, self.main_ident), call.seq, "recorded"
        elif isinstance(call, TorchCall):
            described, seq, domain = call.describe(), call.seq, "torch"
        else:
            # the default group's calls and a sub-group's are counted apart, even when it has every rank
            described, seq = call.describe(), call.seq
            domain = "onedist" if call.group is None else "onedist-group"
        if described.get("group") is None:  # not a member: it does not wait there
            return None
        self.published += 1
        return dict(described, seq=seq, domain=domain, rank=self.rank, id=self.published)

    def _peers(self) -> dict[int, dict[str, Any]]:
        """The current reports of this rank's group that count the same way (itself included)."""
        assert self.mine is not None
        reports = {self.rank: self.mine}
        for r in self.mine["group"]:
            key = BLOCKED_KEY.format(r)
            if r != self.rank and self.store.check([key]):
                report = json.loads(self.store.get(key))
                if report.get("domain") == self.mine["domain"] and report.get("group") == self.mine["group"]:
                    reports[r] = report
        return reports

    def _compare(self) -> Optional[str]:
        assert self.mine is not None
        reports = self._peers()
        if self.mine["domain"] == "recorded":
            found = self._compare_recorded(reports)
            if found is not None:
                return found
            if self.mine.get("peer", -1) >= 0:
                return None  # a send or receive: only a peer's missing counterpart settles it
            reports = {r: rep for r, rep in reports.items() if rep.get("peer", -1) < 0}
        same = {r: rep for r, rep in reports.items() if rep["seq"] == self.mine["seq"]}
        if any(rep["sig"] != self.mine["sig"] for rep in same.values()):
            return self._decide(same, _report(same, self.after))
        apart = tuple(sorted((r, rep["seq"], rep["id"]) for r, rep in reports.items()))
        if len(reports) < len(self.mine["group"]) or len({rep["seq"] for rep in reports.values()}) == 1:
            self.apart = None
            return None
        beats = {r: rep.get("beat", 0) for r, rep in reports.items() if r != self.rank}
        if apart != self.apart:  # every member blocked, at different numbers: confirm a second later
            self.apart, self.beats = apart, beats
            return None
        if any(beat <= self.beats.get(r, 0) for r, beat in beats.items()):
            # a peer's watcher has not looked again since (starved on a busy machine): its report
            # may be one its main thread has already left; wait for a new beat from every peer
            return None
        return self._decide(reports, _report_apart(reports, self.after))

    def _compare_recorded(self, reports: dict[int, dict[str, Any]]) -> Optional[str]:
        """The calls on record settle it: the first call the ranks' hashes differ at, or a send or
        receive whose peer is blocked elsewhere without the matching call."""
        assert self.mine is not None
        found = first_difference(reports)
        if found is not None:
            seq, calls = found
            waiting = {r: rep for r, rep in reports.items() if rep["seq"] == seq and rep.get("peer", -1) < 0}
            if len(waiting) == len(calls):  # every rank waits in its call seq
                return self._decide(waiting, _report(waiting, self.after), seq)
            return self._decide(reports, _report_differ(seq, calls, reports, self.after), seq)
        peer = p2p_deadlock(self.mine, self.rank, reports)
        if peer is not None:
            return self._decide(reports, _report_p2p(self.mine, self.rank, reports[peer], peer, self.after))
        return None

    def _decide(self, reports: dict[int, dict[str, Any]], message: str, seq: Optional[int] = None) -> str:
        if seq is None:
            seq = min(rep["seq"] for rep in reports.values())
        domain = self.mine["domain"] if self.mine else None
        write_verdict(self.store, seq, self.mine["group"] if self.mine else None, message, self.rank, domain)
        self.decided = True
        return message

    def let_peers_read(self) -> None:
        """After this rank's verdict, wait (up to 2 s) until the group's other ranks have read it:
        a plain torch.distributed call learns why its group broke from nowhere else (its peer's
        watcher raises the verdict in its main thread before the break wakes it). A store whose
        host has gone ends the wait: a request to it could hang for the store's whole timeout."""
        if not self.decided or self.mine is None:
            return
        try:
            await_receipts(self.store, self.mine["group"], self.rank, 2.0, gone=server_gone)
        except Exception:
            pass

    def _verdict_of_peer(self) -> Optional[str]:
        """A verdict a peer wrote about this rank's blocked call (it broke the group: a plain call
        here learns why from it)."""
        assert self.mine is not None
        verdict = _read(self.store, self.mine["seq"], self.rank, self.mine["group"])
        return None if verdict is None else str(verdict["message"])


def blocked_call(main_ident: int) -> Any:
    """What this rank waits in: its oldest unfinished call on record (every call of onedist's
    gloo and shm groups), else onedist's call or a plain ``torch.distributed`` call the main thread
    is in (numbered apart); None when it waits in none."""
    logged = waiting_call()
    if logged is not None:
        return logged
    call = world.call
    if call is not None:
        return call if call.seq >= 0 else None
    return torch_call(main_ident) if main_ident else None


def describe_logged(call: LoggedCall, main_ident: int) -> dict[str, Any]:
    """A call on record as the ranks compare it, in the words of what the user called when it is
    the call the main thread is in: onedist's (``all_reduce(op=SUM, value ...)``) or
    ``torch.distributed``'s function."""
    words = None
    if call.newest and world.call is not None:
        words = str(world.call.describe()["call"])
    elif call.newest and main_ident:
        plain = torch_call(main_ident)
        words = None if plain is None else str(plain.describe()["call"])
    described = call.describe(words)
    described["default"] = world.backend.call_log() is call.log
    return described


def write_verdict(
    store: Any, seq: int, group: Any, message: str, rank: int, domain: Optional[str] = None
) -> None:
    """Publish the mismatch report about call ``seq`` of ``group`` for every rank to read (the
    peers' watchers break their calls on it, their guards raise it).

    Returns once the store holds it: a TCP store's ``set`` is not answered, and the writer breaks
    the group's connections next, so a peer whose call breaks could otherwise ask the store before
    the server applied the write, find no verdict and report a vanished peer instead. A read on the
    same connection is answered after the write. The writer keeps its own copy (its guard reads it
    without the store) and leaves its own receipt (the store's host waits for every member's)."""
    global _known
    verdict = {"seq": seq, "group": group, "message": message, "domain": domain}
    store.set(VERDICT_KEY, json.dumps(verdict))
    store.check([VERDICT_KEY])  # the round trip that orders the write before the break
    _known = verdict
    store.set(READ_KEY.format(rank), "1")


def forget_stalls(store: Any, rank: int) -> None:
    """Clear what this rank left in the store and in memory under an earlier group (a store can
    outlive its group: the same ``env://`` port, re-initialised), so no peer reads it as current."""
    global _known
    _known = None
    store.set(BLOCKED_KEY.format(rank), "{}")
    mine = (READ_KEY.format(rank), DONE_KEY.format(rank), P2P_KEY.format(rank))
    for key in mine + ((VERDICT_KEY,) if rank == 0 else ()):
        store.delete_key(key)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (TorchCall, LoggedCall)):
        return a.same(b)
    return a is b


def _report(reports: dict[int, dict[str, Any]], after: float) -> str:
    rep0 = next(iter(reports.values()))
    lines = [
        f"onedist: the ranks are blocked in different collectives (call {rep0['seq']} on "
        f"{_group_text(rep0)}, found after {after:.0f} s without debug mode), so none of them can complete:"
    ]
    for r in sorted(reports):
        lines.append(f"  rank {r}: {reports[r]['call']} at {reports[r]['site']}")
    others = sorted(set(rep0["group"]) - set(reports))
    if others:
        lines.append(f"  ranks {others}: not blocked in a collective there (busy, or still on the way)")
    lines.append(HINT)
    return "\n".join(lines)


def _report_apart(reports: dict[int, dict[str, Any]], after: float) -> str:
    first = min(rep["seq"] for rep in reports.values())
    rep0 = next(iter(reports.values()))
    behind = sorted(r for r, rep in reports.items() if rep["seq"] == first)
    lines = [
        f"onedist: ranks {behind} are blocked in call {first} on {_group_text(rep0)}, which the other ranks "
        f"returned from; they wait in later calls (found after {after:.0f} s without debug mode), so none of "
        "them can complete:"
    ]
    for r in sorted(reports):
        lines.append(f"  rank {r}: {reports[r]['call']} at {reports[r]['site']} (call {reports[r]['seq']})")
    lines.append(RETURNED_EARLY)
    lines.append(HINT)
    return "\n".join(lines)


RETURNED_EARLY = (
    "A call that returns on some ranks only is one the ranks disagree on, most often in shape: gloo "
    "returns an all_reduce early, with a wrong result, on the rank that has fewer elements."
)


def _report_differ(
    seq: int, calls: dict[int, list[Any]], reports: dict[int, dict[str, Any]], after: float
) -> str:
    """Each rank's call ``seq``, in the words of its report when that is the call it waits in."""
    returned = sorted(r for r in calls if reports[r]["seq"] != seq)
    lines = [
        f"onedist: the ranks made different calls as call {seq} on "
        f"{_group_text(next(iter(reports.values())))}; ranks {returned} returned from theirs and wait "
        f"in later calls (found after {after:.0f} s without debug mode), so none of them can complete:"
    ]
    for r in sorted(calls):
        text = (
            reports[r]["call"] if reports[r]["seq"] == seq and reports[r].get("peer", -1) < 0 else calls[r][2]
        )
        lines.append(f"  rank {r}: {text} at {calls[r][3]}")
    lines.append(RETURNED_EARLY)
    lines.append(HINT)
    return "\n".join(lines)


def _report_p2p(mine: dict[str, Any], rank: int, theirs: dict[str, Any], peer: int, after: float) -> str:
    counterpart = "receive from" if mine["kind"] == SEND else "send to"
    lines = [
        f"onedist: rank {rank} waits in a point-to-point call with rank {peer}, which waits elsewhere and "
        f"never posted the matching {counterpart} rank {rank} (found after {after:.0f} s without debug "
        "mode), so neither can complete:",
        f"  rank {rank}: {mine['call']} at {mine['site']}",
        f"  rank {peer}: {theirs['call']} at {theirs['site']}",
        "HINT: every send needs a receive posted on its destination (and the other way round) before "
        "either rank waits in another call; batch_isend_irecv posts them together",
    ]
    return "\n".join(lines)


def _group_text(rep: dict[str, Any]) -> str:
    group = rep["group"]
    default = rep["domain"] == "onedist" or rep.get("default")
    where = "the default group" if default else f"group {group}"
    if rep["domain"] == "torch":
        where += " (torch.distributed calls, numbered by the process group)"
    return where


HINT = (
    "HINT: every rank must call the same collectives, in the same order, on values of the same type, "
    "dtype and shape; ONEDIST_DEBUG=1 checks each call before it is made"
)


def read_verdict(store: Any, seq: int, rank: int, world_size: int) -> Optional[str]:
    """The stall verdict that explains why a call numbered ``seq`` (or later) failed, if any.

    Every rank that reads it leaves a receipt; rank 0, which usually hosts the store, waits up to
    3 s for the others' before it raises (its exit would take the verdict with it)."""
    if store is None or seq < 0:
        return None
    try:
        try:
            verdict = _read(store, seq, rank)
        except Exception:  # the store's host left after the watcher read it: the copy read then
            verdict = _known if _known is not None and _known["seq"] <= seq else None
        if verdict is None:
            return None
        if rank == 0:
            await_receipts(store, verdict.get("group") or range(world_size), 0, RECEIPT_WAIT_S)
    except Exception:
        return None
    return str(verdict["message"])


def _read(store: Any, seq: int, rank: int, group: Any = None) -> Optional[dict[str, Any]]:
    """The verdict in the store when it concerns a call numbered ``seq`` or earlier (of ``group``,
    when given), with this rank's read receipt left; None otherwise."""
    if not store.check([VERDICT_KEY]):
        return None
    global _known
    verdict: dict[str, Any] = json.loads(store.get(VERDICT_KEY))
    # a verdict on calls on record is numbered by the group's log, not by onedist's count: the
    # group is broken after it, so any failure of the group's calls is its consequence
    later = verdict["seq"] > seq and verdict.get("domain") != "recorded"
    if later or (group is not None and verdict.get("group") != group):
        return None
    store.set(READ_KEY.format(rank), "1")
    _known = verdict
    return verdict


#: the last verdict this process read (its watcher reads it before breaking the call, the guard
#: after: by then the rank that wrote it may have left, taking the store with it)
_known: Optional[dict[str, Any]] = None
