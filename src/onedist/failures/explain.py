"""Turning a backend's error in a collective into onedist's: which rank failed, who never arrived.

When the communication library raises in a collective:

* a peer died ("Connection closed by peer", a reset): if that rank published its error in the
  rendezvous store before dying, every peer raises :class:`~onedist.RemoteRankError` with that
  rank's error and traceback instead of the library's message;
* a timeout: the rank publishes what it was waiting in (collective, group, call site), waits up to
  3 s for the other ranks of the group to do the same (they time out too when they wait in another
  collective), and raises :class:`~onedist.OnedistTimeoutError` naming the collective, the group,
  the ranks that never arrived and what each other rank was doing.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch

from ..errors import CollectiveMismatchError, OnedistTimeoutError, RemoteRankError, call_site, user_frame
from ..state import world
from .channel import (
    ACK_KEY,
    STUCK_KEY,
    failed_reports,
    rank_and_world,
    server_gone,
    side_store,
    stuck_reports,
)
from .stall import read_verdict

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep

_PEER_GONE_WAIT_S = 0.5  # how long a rank whose peer vanished waits for that peer's report


_REPORT_WAIT_S = 3.0  # how long a timed-out rank waits for the others' reports (and rank 0 for receipts)


# ---------------------------------------------------------------------------- failure translation
def _is_timeout(e: BaseException) -> bool:
    text = str(e)
    return "Timed out" in text or "timed out" in text or "Timeout" in type(e).__name__


def _group_ranks(group: Any) -> tuple[int, ...]:
    b = world.backend
    if group is None:
        return tuple(range(b.world_size))
    if isinstance(group, (list, tuple, range)):
        return tuple(int(r) for r in group)
    try:
        return b.group_ranks(group)
    except Exception:
        return tuple(range(b.world_size))


def explain(name: str, e: BaseException, group: Any, started: float, seq: int = -1) -> BaseException:
    """The backend's error ``e`` of collective ``name`` as onedist explains it: the stall verdict,
    a peer's published failure, a timeout naming the ranks, a peer gone; ``e`` itself otherwise."""
    err = _explain(name, e, group, started, seq)
    _note_if_from_store(err, e)
    return err


def _note_if_from_store(err: Any, e: BaseException) -> None:
    """Mark that the main thread got a verdict or a peer's failure (see World.explained), and
    take back the same error the failure watcher may have raised into it meanwhile (it breaks a
    plain call's group after raising the verdict into the thread: that one would wait for the
    next bytecode, past this raise, and land in the program's handler of it)."""
    from_store = err is not e and isinstance(err, (CollectiveMismatchError, RemoteRankError))
    if from_store and threading.get_ident() == threading.main_thread().ident:
        world.explained = True
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(threading.get_ident()), None)


def _explain(name: str, e: BaseException, group: Any, started: float, seq: int = -1) -> BaseException:
    try:
        rank, world_size = rank_and_world()
    except Exception:
        return e
    if world_size <= 1:
        return e
    verdict = read_verdict(side_store(), seq, rank, world_size)  # blocked in different calls
    if verdict is not None:
        return CollectiveMismatchError(verdict)
    ranks = _group_ranks(group)
    site = call_site(user_frame(sys._getframe(1), _TORCH_DIR))  # a DDP backward's: below torch's frames
    failed = failed_reports(ranks, rank)
    if _is_timeout(e):  # a peer that timed out too did not cause this timeout: report both calls
        failed = {r: rep for r, rep in failed.items() if rep.get("type") != "OnedistTimeoutError"}
    if failed:
        return _remote_failure(name, rank, site, failed)
    if isinstance(e, CollectiveMismatchError):  # found elsewhere, no verdict: the backend's words
        return e
    if _is_timeout(e):
        return _timeout_error(name, e, ranks, rank, site, started)
    text = str(e)
    if any(s in text for s in _PEER_GONE):
        # A peer's connection went away. If that peer failed (it publishes its error) or timed
        # out (it publishes where it waited) just before, say so: gloo closes a timed-out rank's
        # connections at once, so its peers often see "closed" before their own timeout fires.
        waited = time.monotonic() - started
        since = time.time() - waited - 1.0
        store = side_store()
        # where this rank waited, for a timed-out peer's report (not to a store whose host, rank
        # 0, has exited: torch prints a C++ stack trace for that, before rank k's own error)
        if store is not None and not server_gone(store):
            mine = {
                "rank": rank,
                "call": name,
                "site": site,
                "group": list(ranks),
                "time": time.time(),
                "peer_gone": True,  # where it waited, not a timeout of its own
            }
            try:
                store.set(STUCK_KEY.format(rank), json.dumps(mine))
            except Exception:
                pass
        # A peer that timed out has waited its whole timeout, so this rank has usually waited a
        # while too; a peer that died at once (the common crash) is not worth a pause.
        deadline = time.monotonic() + (_PEER_GONE_WAIT_S if waited >= 1.0 else 0.0)
        while True:
            # the peer that broke the connections may have found the ranks' calls different: its
            # verdict can reach the store just after the break (a TCP store's set is not answered)
            verdict = read_verdict(store, seq, rank, world_size)
            if verdict is not None:
                return CollectiveMismatchError(verdict)
            failed = failed_reports(ranks, rank)
            if failed:
                return _remote_failure(name, rank, site, failed)
            if stuck_reports(ranks, rank, since):
                # a peer's timeout fired first and gloo closed its connections: the group timed
                # out, this rank included; report it as the timeout it is, with every rank's call
                return _timeout_error(name, e, ranks, rank, site, started)
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return _peer_gone_error(name, e, ranks, rank, site, store)
    return e


def known_cause(name: str, e: BaseException, rank: int, world_size: int) -> Any:
    """The stall verdict behind ``e``, or the error of a peer that published its failure, as
    onedist's error; None when neither is known (the caller's own error stands)."""
    store = side_store()
    verdict = read_verdict(store, sys.maxsize, rank, world_size)
    if verdict is not None:
        err: BaseException = CollectiveMismatchError(verdict)
    else:
        failed = failed_reports(range(world_size), rank)
        if not failed:
            return None
        err = _remote_failure(name, rank, call_site(user_frame(sys._getframe(1), _TORCH_DIR)), failed)
    _note_if_from_store(err, e)
    return err


def _peer_gone_error(
    name: str, e: BaseException, ranks: Any, rank: int, site: str, store: Any
) -> RemoteRankError:
    """A peer's connection went away and no report of it can be read. A consequence, not a cause:
    marked as such, so this rank does not publish it as its own failure (launchers and error files
    would blame it) and reports treat it as secondary."""
    culprit = getattr(e, "culprit", None)  # shm knows which group rank exited
    if getattr(e, "exited", False) and isinstance(culprit, int) and 0 <= culprit < len(ranks):
        gone, who = ranks[culprit], f"rank {ranks[culprit]} of group {list(ranks)} exited"
    else:
        gone, who = -1, f"another rank of group {list(ranks)} closed its connection"
    if store is not None and server_gone(store):
        # rank 0 left first (a peer slower to get here under load): a report may have been there
        how = (
            "; rank 0, which holds the ranks' error reports, has exited too, so whether it reported "
            "an error cannot be read here (the other ranks' output shows it if it did)"
        )
    else:
        how = " without reporting an error (it returned, exited or was killed)"
    return RemoteRankError(
        f"onedist.{name} (rank {rank}, at {site}): {who}{how}.\n(backend: {str(e).strip()[:300]})", gone
    )


def _remote_failure(name: str, rank: int, site: str, failed: dict[int, dict[str, Any]]) -> BaseException:
    r, report = min(failed.items(), key=lambda kv: kv[1].get("time", 0.0))
    if report.get("type") == CollectiveMismatchError.__name__:  # one verdict, the same on every rank
        return CollectiveMismatchError(report["message"])
    err = RemoteRankError(
        f"onedist.{name} (rank {rank}, at {site}): rank {r} failed, so this collective cannot complete:\n"
        f"{report['traceback'].rstrip()}",
        r,
    )
    err.report = report  # type: ignore[attr-defined]
    return err


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket closed")


def _timeout_error(
    name: str, e: BaseException, ranks: tuple[int, ...], rank: int, site: str, started: float
) -> BaseException:
    waited = time.monotonic() - started
    now = time.time()
    mine = {"rank": rank, "call": name, "site": site, "group": list(ranks), "time": now}
    store = side_store()
    reports: dict[int, dict[str, Any]] = {}
    if store is not None and not server_gone(store):
        try:
            store.set(STUCK_KEY.format(rank), json.dumps(mine))
            others = [r for r in ranks if r != rank]
            deadline = time.monotonic() + _REPORT_WAIT_S
            while others and time.monotonic() < deadline:
                for r in list(others):
                    key = STUCK_KEY.format(r)
                    if store.check([key]):
                        report = json.loads(store.get(key))
                        if report.get("time", 0.0) >= now - waited - 10.0:
                            reports[r] = report
                            others.remove(r)
                if others:
                    time.sleep(0.05)
            store.set(ACK_KEY.format(rank), str(now))
            if rank == 0 and reports:
                # rank 0 usually hosts the store: stay until the others have read what they need
                acks = [ACK_KEY.format(r) for r in reports]
                store.wait(acks, timedelta(seconds=_REPORT_WAIT_S))
        except Exception:
            pass
    missing = [r for r in ranks if r != rank and r not in reports]
    lines = [
        f"onedist.{name} on rank {rank} (group {list(ranks)}, at {site}) timed out after {waited:.1f} s.",
    ]
    if missing:
        lines.append(
            f"Ranks that never arrived: {missing} (no report from them: busy outside onedist's collectives, "
            "hung, or gone)."
        )
    for r in sorted(reports):
        rep = reports[r]
        lines.append(
            f"rank {r} was waiting in onedist.{rep['call']} at {rep['site']} (group {rep['group']})."
        )
    different = sorted({rep["call"] for rep in reports.values()} - {name})
    if different:
        lines.append(
            f"HINT: the ranks called different collectives ({name} vs {', '.join(different)}): every rank "
            "of a group must call the same collectives in the same order; ONEDIST_DEBUG=1 checks each call."
        )
    else:
        lines.append(
            "HINT: every rank of the group must call this collective; raise the timeout "
            "(initialize(timeout=...)) if one rank legitimately works longer."
        )
    lines.append(f"(backend: {str(e).strip()[:300]})")
    return OnedistTimeoutError("\n".join(lines))
