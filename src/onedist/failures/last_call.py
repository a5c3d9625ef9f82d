"""The stall check at ``finalize``: a peer still blocked in a call this rank returned from.

gloo returns an all_reduce early, with a wrong result, on the rank whose tensor has fewer
elements; its peer waits for the rest. When that was the program's last collective, the early rank
never blocks again, so the stall check (:mod:`onedist.failures.stall`) sees one rank blocked and
nobody to compare it with, and the early rank would exit 0 with its wrong result. So ``finalize``
marks this rank done after its last call on the default group and, until the stall check's time
has passed since that call began (plus the watcher's sampling), looks at the peers: every peer
done ends the wait at once (the usual exit: milliseconds); a peer whose published report says it
is still blocked in a call numbered at or below this rank's last (the same report on two looks
1.2 s apart) cannot complete, so this rank writes the verdict (the peer's watcher breaks its call
and raises it) and raises it too. A peer that is busy elsewhere is not waited for past that time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, Optional

from ..state import world
from .channel import FAILED_COUNT, rank_and_world, server_gone, side_store
from .keys import BLOCKED_KEY, CHECKED_KEY, DONE_KEY, RECEIPT_WAIT_S, await_receipts
from .p2p_counts import p2p_verdict, publish_counts
from .stall import HINT, RETURNED_EARLY, stall_seconds, write_verdict

__all__ = ["check_at_finalize", "last_call_verdict"]

_CONFIRM_S = 1.2  # the watcher samples once a second: a report still there this much later is current
_SLACK_S = 2.5  # the watcher samples once a second (a report appears 3-4 s after the block), round trips
_LAST_OUT_S = 2.0  # how long rank 0 waits for its peers to be through with the check (see _leave)


def check_at_finalize() -> Optional[str]:
    """The mismatch report of this rank's last default-group call, or None (no watcher, no store,
    nothing wrong); called by ``finalize`` while the group still stands."""
    if world.watcher is None:
        return None
    try:
        rank, world_size = rank_and_world()
        store = side_store()
        if store is None or server_gone(store):
            return None
        log = world.backend.call_log()
        if log is not None:  # every call of the default group is on record, numbered by its log
            # (shm's log numbers no collectives: its own check compares them; its sends count)
            started = max((e.started for e in log.recent() if e.peer < 0), default=time.monotonic())
            publish_counts(store, rank, log)  # before this rank says it is done: see .p2p_counts
            return last_call_verdict(store, rank, world_size, log.seq, started, "recorded", p2p_verdict)
        return last_call_verdict(store, rank, world_size, world.world_calls, world.last_started)
    except Exception:  # the store's host left: the job is ending anyway
        return None


def last_call_verdict(
    store: Any,
    rank: int,
    world_size: int,
    last_seq: int,
    last_started: float,
    domain: str = "onedist",
    once_all_done: Optional[Callable[[Any, int, int], Optional[str]]] = None,
) -> Optional[str]:
    """Mark this rank done after call ``last_seq`` of the default group (begun at monotonic
    ``last_started``) and return the mismatch report when a peer is still blocked in it or earlier;
    once every peer is done, ``once_all_done(store, rank, world_size)``'s report (before rank 0
    may leave: the store is still there)."""
    after = stall_seconds()
    if after <= 0 or world_size <= 1 or (last_seq <= 0 and once_all_done is None):
        return None
    store.set(DONE_KEY.format(rank), str(last_seq))
    peers = [r for r in range(world_size) if r != rank]
    deadline = last_started + after + _SLACK_S
    first_seen: dict[int, tuple[Any, int, float]] = {}  # rank -> (its report's id, beat, when first seen)
    pause = 0.01
    failed_before = int(store.add(FAILED_COUNT, 0))
    while True:
        blocked = _blocked_behind(store, peers, last_seq, domain)
        if blocked is None:  # every peer is done
            verdict = once_all_done(store, rank, world_size) if once_all_done is not None else None
            _leave(store, rank, peers)
            return verdict
        if int(store.add(FAILED_COUNT, 0)) > failed_before:
            return None  # one failed (its error is what the job reports)
        now = time.monotonic()
        for r, report in blocked.items():
            beat = report.get("beat", 0)  # its watcher's looks since it published (stall.py)
            seen = first_seen.setdefault(r, (report["id"], beat, now))
            if seen[0] != report["id"]:
                first_seen[r] = (report["id"], beat, now)
            elif now - seen[2] >= _CONFIRM_S and beat > seen[1]:  # still there, and current
                return _decide(store, rank, world_size, last_seq, report, after, domain)
        if now > deadline and (not blocked or now > deadline + 2 * _CONFIRM_S):
            return None  # the peers not done are busy elsewhere (or left and came back)
        time.sleep(pause)
        pause = min(2 * pause, 0.2)


def _leave(store: Any, rank: int, peers: list[int]) -> None:
    """Rank 0, which hosts the store unless a launcher does, leaves after its peers' last store
    call of the check (within a bound): a peer's call to a store whose host has exited fails, and
    torch prints a C++ stack trace for it, even where it is caught (seen under mpirun on mpi4py,
    whose group's teardown does not hold rank 0 back as gloo's does)."""
    if rank != 0:
        store.set(CHECKED_KEY.format(rank), "1")
        return
    keys = [CHECKED_KEY.format(r) for r in peers]
    deadline = time.monotonic() + _LAST_OUT_S
    while not store.check(keys) and time.monotonic() < deadline:
        time.sleep(0.005)


def _blocked_behind(
    store: Any, peers: list[int], last_seq: int, domain: str
) -> Optional[dict[int, dict[str, Any]]]:
    """The peers' reports of default-group calls numbered ``last_seq`` or below (None when every
    peer is done)."""
    blocked: dict[int, dict[str, Any]] = {}
    waiting = False
    for r in peers:
        if store.check([DONE_KEY.format(r)]):
            continue
        waiting = True
        key = BLOCKED_KEY.format(r)
        if store.check([key]):
            report = json.loads(store.get(key))
            default = domain == "onedist" or report.get("default")
            if report.get("domain") == domain and default and 0 < report.get("seq", 0) <= last_seq:
                blocked[r] = report
    return blocked if waiting else None


def _decide(
    store: Any, rank: int, world_size: int, last_seq: int, report: dict[str, Any], after: float, domain: str
) -> str:
    seq = report["seq"]
    message = "\n".join(
        [
            f"onedist: rank {report['rank']} is blocked in call {seq} on the default group, which rank "
            f"{rank} returned from; rank {rank} finished after call {last_seq} (found at finalize, after "
            f"{after:.0f} s without debug mode), so that call can never complete:",
            f"  rank {report['rank']}: {report['call']} at {report['site']} (call {seq})",
            f"  rank {rank}: in finalize (its last call: call {last_seq})",
            RETURNED_EARLY,
            HINT,
        ]
    )
    write_verdict(store, seq, report.get("group"), message, rank, domain)
    await_receipts(store, report.get("group") or range(world_size), rank, RECEIPT_WAIT_S)
    return message
