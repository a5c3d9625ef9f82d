"""The store side channel: each rank's failure and timeout reports, in the rendezvous store.

A rank that fails publishes its error (type, message, traceback, pid, host) under
``onedist/failed/<rank>`` and counts it in ``onedist/failed-count``; a rank whose collective timed out
publishes where it waited under ``onedist/stuck/<rank>``. Peers read them to name the rank that
caused their own failure. Every call is best effort: a store whose host exited is never asked
(torch would print a C++ stack trace), and a failing store never raises here.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, Optional

from ..errors import RemoteRankError, format_user_traceback
from ..state import world
from .stderr import store_noise_held_back

FAILED_KEY = "onedist/failed/{}"


FAILED_COUNT = "onedist/failed-count"


STUCK_KEY = "onedist/stuck/{}"


ACK_KEY = "onedist/stuck-read/{}"


# ---------------------------------------------------------------------------- the store side channel
def side_store() -> Any:
    try:
        return world.backend.side_store()
    except Exception:
        return None


def rank_and_world() -> tuple[int, int]:
    return world.backend.rank, world.backend.world_size


def _server_address(store: Any) -> Optional[tuple[str, int]]:
    """(host, port) of the TCP server behind ``store`` (through prefix wrappers), or None."""
    from torch._C._distributed_c10d import TCPStore

    for _ in range(8):
        if isinstance(store, TCPStore):
            return store.host, store.port
        store = getattr(store, "underlying_store", None)
        if store is None:
            break
    return None


class ServerProbe:
    """An idle connection to the store's TCP server, which reads end-of-file once the server is
    gone (the rank that hosted it exited). A store call to a closed server makes torch print a
    C++ stack trace, even where it is caught; without this probe every run in which rank 0
    finished a second before another rank printed one, from the watcher's poll."""

    def __init__(self, store: Any) -> None:
        self._sock: Optional[socket.socket] = None
        address = _server_address(store)
        if address is not None:
            try:
                self._sock = socket.create_connection(address, timeout=2)
                self._sock.setblocking(False)
            except OSError:
                pass

    def gone(self) -> bool:
        if self._sock is None:
            return False  # not a TCP store (file store, MPI): nothing to probe
        try:
            return self._sock.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False  # open and quiet: the server is there
        except OSError:
            return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def server_gone(store: Any) -> bool:
    """True when ``store`` is a TCP store whose server no longer accepts connections."""
    address = _server_address(store)
    if address is None:
        return False
    try:
        socket.create_connection(address, timeout=2).close()
    except OSError:
        return True
    return False


def publish_failure(exc: BaseException, tb: Optional[TracebackType] = None) -> None:
    """Tell the other ranks, through the rendezvous store, that this rank failed with ``exc``.

    Their collectives then raise :class:`RemoteRankError` with this error instead of "Connection
    closed by peer". Best effort, never raises; does nothing with one process or without a store.
    """
    if isinstance(exc, (RemoteRankError, KeyboardInterrupt)) or (
        isinstance(exc, SystemExit) and exc.code in (0, None)
    ):
        return
    try:
        rank, world_size = rank_and_world()
        store = side_store() if world_size > 1 else None
        if store is None or server_gone(store):  # the rank hosting it already exited
            return
        with store_noise_held_back():
            _publish(store, rank, exc, tb)
    except Exception:
        pass


def _publish(store: Any, rank: int, exc: BaseException, tb: Optional[TracebackType]) -> None:
    text = format_user_traceback(exc, tb)
    report = {
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": text[-8000:],
        "time": time.time(),
        "pid": os.getpid(),
        "host": socket.gethostname(),
    }
    store.set(FAILED_KEY.format(rank), json.dumps(report))
    world.published = True
    store.add(FAILED_COUNT, 1)
    _torchelastic_error_file(exc, text)


def _torchelastic_error_file(exc: BaseException, text: str) -> None:
    """Under torchrun, write the error file its agent reads (what torchelastic's ``@record`` writes),
    so its "Root Cause" names this rank instead of whichever rank exited first."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))},
        }
    }
    with open(path, "w") as f:
        json.dump(data, f)


def failed_reports(ranks: Any, exclude: int) -> dict[int, dict[str, Any]]:
    return _reports(FAILED_KEY, ranks, exclude)


def _reports(
    key_format: str, ranks: Any, exclude: int, keep: Callable[[dict[str, Any]], bool] = lambda r: True
) -> dict[int, dict[str, Any]]:
    """The JSON reports stored under ``key_format.format(rank)`` by the ranks of ``ranks``."""
    store = side_store()
    if store is None or server_gone(store):  # asking a store whose host exited prints C++ noise
        return {}
    found: dict[int, dict[str, Any]] = {}
    for r in ranks:
        if r == exclude:
            continue
        key = key_format.format(r)
        try:
            if store.check([key]):
                report = json.loads(store.get(key))
                if keep(report):
                    found[r] = report
        except Exception:
            return found
    return found


def stuck_reports(ranks: Any, exclude: int, since: float) -> dict[int, dict[str, Any]]:
    """The timeout reports (where each waited when it timed out) that ranks of ``ranks`` published
    after ``since`` (not the reports of ranks that, like this one, only saw a peer vanish)."""
    return _reports(
        STUCK_KEY, ranks, exclude, lambda rep: rep.get("time", 0.0) >= since and not rep.get("peer_gone")
    )
