"""The collective guard: failures that name ranks, and debug mode.

Every public collective runs through :func:`guarded`. On the default path it costs one function
call and a ``try`` (no communication, no frame inspection). When the communication library raises:

* a peer died ("Connection closed by peer", a reset): if that rank published its error in the
  rendezvous store before dying (the excepthook that :func:`install` sets, ``spawn``'s workers and
  ``Parallel.__exit__`` do), every peer raises :class:`RemoteRankError` with that rank's error and
  traceback instead of the library's message;
* a timeout: the rank publishes what it was waiting in (collective, group, call site), waits up to
  3 s for the other ranks of the group to do the same (they time out too when they wait in another
  collective), and raises :class:`OnedistTimeoutError` naming the collective, the group, the ranks
  that never arrived and what each other rank was doing.

Debug mode (``ONEDIST_DEBUG=1`` or :func:`onedist.set_debug`): before each collective the ranks of
the group exchange a fingerprint (operation, reduction op, root, value structure with dtypes,
shapes and devices, call site) in one small all_gather; when they differ, every rank raises
:class:`CollectiveMismatchError` listing each rank's call and its ``file:line``. A collective called
inside :func:`onedist.one_rank_only` or under ``if is_main_process():`` / ``if get_rank() == 0:``
raises at once, naming the line. Debug mode costs one extra small collective per call.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import json
import linecache
import os
import re
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import FrameType, TracebackType
from typing import Any, Optional, TypeVar

from .errors import (
    CollectiveMismatchError,
    OnedistError,
    OnedistRuntimeError,
    OnedistTimeoutError,
    RemoteRankError,
    format_user_traceback,
)

__all__ = [
    "guarded",
    "install",
    "is_debug",
    "publish_failure",
    "report_and_release",
    "set_debug",
    "uninstall",
]

F = TypeVar("F", bound=Callable[..., Any])

_FAILED_KEY = "onedist/failed/{}"
_FAILED_COUNT = "onedist/failed-count"
_WATCH_S = 1.0  # how often each rank asks the store whether another rank failed
_WATCH_GRACE_S = 3.0  # how long a rank blocked outside Python gets before it is ended
_STUCK_KEY = "onedist/stuck/{}"
_ACK_KEY = "onedist/stuck-read/{}"
_PEER_GONE_WAIT_S = 0.5  # how long a rank whose peer vanished waits for that peer's report
_REPORT_WAIT_S = 3.0  # how long a timed-out rank waits for the others' reports (and rank 0 for receipts)
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


class _Guard:
    __slots__ = (
        "debug",
        "explaining",
        "installed",
        "one_rank_depth",
        "previous_hook",
        "published",
        "watch_stop",
        "watcher",
    )

    def __init__(self) -> None:
        self.debug = os.environ.get("ONEDIST_DEBUG", "").lower() in ("1", "true", "yes", "on")
        self.one_rank_depth = 0  # > 0 while inside a one_rank_only function
        self.installed = False
        self.previous_hook: Any = None
        self.published = False  # this rank reported its own failure
        # > 0 while this rank's main thread turns a failed collective into its own error (a
        # timeout report takes seconds): the watch leaves it alone meanwhile
        self.explaining = 0
        self.watcher: Any = None
        self.watch_stop: Any = None


_guard = _Guard()


def set_debug(enabled: bool = True) -> None:
    """Turn debug mode on or off in this process (every rank must do the same).

    In debug mode the ranks check, before each collective, that they all call the same operation on
    compatible values, and raise :class:`~onedist.CollectiveMismatchError` on every rank (listing
    each rank's call and ``file:line``) instead of hanging. ``ONEDIST_DEBUG=1`` turns it on at start.

    Example:
        >>> import onedist as od
        >>> od.set_debug(True); od.all_reduce(1); od.set_debug(False)
        1
    """
    if not isinstance(enabled, bool):
        from .errors import bad_type

        raise bad_type("set_debug", "enabled", enabled, "a bool")
    _guard.debug = enabled


def is_debug() -> bool:
    """Whether debug mode is on in this process."""
    return _guard.debug


# ---------------------------------------------------------------------------- call sites
def _user_frame(frame: Optional[FrameType]) -> Optional[FrameType]:
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _PACKAGE_DIR:
        frame = frame.f_back
    return frame


def _site(frame: Optional[FrameType]) -> str:
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


# ---------------------------------------------------------------------------- the store side channel
def _store() -> Any:
    try:
        from .context import _state

        return _state.backend.side_store()
    except Exception:
        return None


def _world() -> tuple[int, int]:
    from .context import _state

    return _state.backend.rank, _state.backend.world_size


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


class _ServerProbe:
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


#: the first line of torch's C++ warning (with its stack trace) for a store request that failed
#: because the store's server is gone, e.g. ``[rank2]:[W1123 18:11:03.646544557 TCPStore.cpp:125]
#: [c10d] recvValue failed on SocketImpl(...): Connection reset by peer``
_STORE_NOISE = re.compile(r"^(\[rank\d+\]:)?\[[WE]\d{4} [\d:.]+ TCPStore\.cpp:\d+\] \[c10d\] ")
_STORE_NOISE_TAIL = ("Exception raised from ", "frame #", "<omitting python frames>")
_holding_stderr = threading.Lock()


def without_store_noise(text: str) -> str:
    """``text`` without torch's C++ warnings about store requests whose server is gone (each a
    line, an "Exception raised from" line and a C++ stack trace, then a blank line).

    >>> noise = "[W1123 18:11:03.6 TCPStore.cpp:125] [c10d] recvValue failed\\nframe #0: f\\n\\n"
    >>> without_store_noise("mine\\n" + noise + "mine too\\n")
    'mine\\nmine too\\n'
    """
    kept: list[str] = []
    skipping = False
    for line in text.splitlines(keepends=True):
        if _STORE_NOISE.match(line):
            skipping = True
            continue
        if skipping:
            if line.startswith(_STORE_NOISE_TAIL):
                continue
            skipping = False
            if not line.strip():
                continue
        kept.append(line)
    return "".join(kept)


class _Held:
    """fd 2 while :func:`_store_noise_held_back` holds it: the real stderr's duplicate, and the
    file that receives what is written meanwhile."""

    lock = threading.Lock()
    saved: Optional[int] = None
    file: Any = None


@contextlib.contextmanager
def _store_noise_held_back() -> Iterator[None]:
    """Hold back what this process writes to stderr (fd 2: Python and C++ alike) meanwhile, and
    write it afterwards without torch's warnings about a store whose server is gone.

    The explanation of a failure asks the rendezvous store for the other ranks' reports; the store's
    host (rank 0 under spawn and ``onedist run``) may exit between onedist's check that it is there
    and the request, and torch then prints a 20-line C++ stack trace before this rank's error,
    which reads as if this rank had failed first. The request itself raises, and onedist handles
    that. Nested or concurrent uses hold back once; a thread that ends the process meanwhile calls
    :func:`release_stderr` first."""
    if not _holding_stderr.acquire(blocking=False):
        yield
        return
    try:
        with _Held.lock:
            try:
                sys.stderr.flush()
                saved = os.dup(2)
            except (OSError, ValueError, AttributeError):
                saved = None
            if saved is not None:
                _Held.file = tempfile.TemporaryFile()  # noqa: SIM115 (release_stderr closes it)
                os.dup2(_Held.file.fileno(), 2)
                _Held.saved = saved
        try:
            yield
        finally:
            release_stderr()
    finally:
        _holding_stderr.release()


def release_stderr() -> None:
    """Give fd 2 back now, with what was held back (see :func:`_store_noise_held_back`); nothing
    when it is not held. Call it before ``os._exit``, which would lose what is held."""
    with _Held.lock:
        if _Held.saved is None:
            return
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(_Held.saved, 2)
        os.close(_Held.saved)
        _Held.saved = None
        held, _Held.file = _Held.file, None
        with contextlib.suppress(OSError):
            held.seek(0)
            text = without_store_noise(held.read().decode(errors="replace"))
            if text:
                os.write(2, text.encode())
        held.close()


def _server_gone(store: Any) -> bool:
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
        rank, world = _world()
        store = _store() if world > 1 else None
        if store is None or _server_gone(store):  # the rank hosting it already exited
            return
        with _store_noise_held_back():
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
    store.set(_FAILED_KEY.format(rank), json.dumps(report))
    _guard.published = True
    store.add(_FAILED_COUNT, 1)
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


def let_failed_rank_exit_first(exc: BaseException) -> None:
    """On a peer of a failed rank (``exc`` is the RemoteRankError naming it): wait, up to 2 s, until
    that rank's process is gone, so launchers that blame the first process to exit (mpirun, srun,
    torchrun without error files) name the rank that failed, not this one."""
    if not isinstance(exc, RemoteRankError):
        return
    report = getattr(exc, "report", None) or {}
    pid, host = report.get("pid"), report.get("host")
    deadline = time.monotonic() + 2.0
    if isinstance(pid, int) and host == socket.gethostname():
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            except PermissionError:
                return
            time.sleep(0.02)
    else:
        time.sleep(0.5)


def report_and_release(exc: BaseException, tb: Optional[TracebackType]) -> None:
    """A rank is leaving its distributed context because of ``exc`` (``Parallel.__exit__``).

    Publish the error, then print its traceback now, before the group is destroyed: destroying it
    releases the peers, whose errors would otherwise be printed before this rank's own. The
    excepthook then prints a one-line reminder instead of the same traceback again.
    """
    try:
        _, world = _world()
    except Exception:
        return
    if world <= 1 or isinstance(exc, (KeyboardInterrupt, RemoteRankError)):
        return
    if isinstance(exc, SystemExit):
        return
    publish_failure(exc, tb)
    try:
        sys.stderr.write(format_user_traceback(exc, tb))
        sys.stderr.flush()
        exc._onedist_printed = True  # type: ignore[attr-defined]
    except Exception:
        pass


def _failed_reports(ranks: Any, exclude: int) -> dict[int, dict[str, Any]]:
    return _reports(_FAILED_KEY, ranks, exclude)


def _reports(
    key_format: str, ranks: Any, exclude: int, keep: Callable[[dict[str, Any]], bool] = lambda r: True
) -> dict[int, dict[str, Any]]:
    """The JSON reports stored under ``key_format.format(rank)`` by the ranks of ``ranks``."""
    store = _store()
    if store is None or _server_gone(store):  # asking a store whose host exited prints C++ noise
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


def _excepthook(tp: type[BaseException], value: BaseException, tb: Optional[TracebackType]) -> None:
    if getattr(value, "_onedist_printed", False):
        sys.stderr.write(
            f"{tp.__name__}: {value} (traceback printed above, before the other ranks were released)\n"
        )
    else:
        publish_failure(value, tb)
        hook = _guard.previous_hook or sys.__excepthook__
        hook(tp, value, tb)
    _exit_without_mpi_finalize()


def _exit_without_mpi_finalize() -> None:
    """A rank dying of an exception must not enter MPI_Finalize (mpi4py's exit hook): it waits for
    the other ranks, which wait for this one to exit, and the MPI launcher then names a rank that
    only followed as the first to fail. Leave at once instead, as ``python -m mpi4py`` does."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return
    try:
        if not mpi.Is_initialized() or mpi.Is_finalized():
            return
    except Exception:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    release_stderr()
    os._exit(1)


def _watch(stop: Any, store: Any, rank: int, world: int, main_ident: int) -> None:
    """Background thread of every rank: end this rank soon after another rank failed.

    A rank that waits in a collective learns of a peer's death from the communication library; a
    rank that computes (or sleeps) outside collectives would run on until its next one, or forever
    under launchers that do not kill the job (plain ``srun``). Once a second, one ``add(key, 0)``
    round trip asks the store how many ranks failed; when one did, this rank gets that rank's
    error as a :class:`RemoteRankError` raised in its main thread, and if it is blocked outside
    Python for longer than 3 s, the error is printed and the process ends (exit status 1).
    """
    probe = _ServerProbe(store)
    try:
        _poll(stop, store, probe, rank, world, main_ident)
    finally:
        probe.close()


def _poll(stop: Any, store: Any, probe: _ServerProbe, rank: int, world: int, main_ident: int) -> None:
    import ctypes

    handled = 0
    while not stop.wait(_WATCH_S):
        if probe.gone():
            return  # the rank hosting the store exited: the job is ending
        try:
            count = int(store.add(_FAILED_COUNT, 0))
            if count <= handled or _guard.published or _guard.explaining:
                continue
            handled = count
            failed = _failed_reports(range(world), rank)
        except Exception:
            return  # the store is gone: the job is ending anyway
        if not failed:
            continue
        r, report = min(failed.items(), key=lambda kv: kv[1].get("time", 0.0))
        message = (
            f"onedist: rank {r} failed, so rank {rank} stops too:\n{report.get('traceback', '').rstrip()}"
        )

        remote = _remote_error_class(message, r)
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main_ident), ctypes.py_object(remote))
        if stop.wait(_WATCH_GRACE_S):
            return
        try:
            release_stderr()
            sys.stderr.write(message + f"\n(rank {rank} was blocked outside Python; ending it)\n")
            sys.stderr.flush()
        finally:
            os._exit(1)


def _remote_error_class(message: str, rank: int) -> type[RemoteRankError]:
    """A RemoteRankError subclass whose no-argument constructor gives ``message`` (an exception
    raised in another thread through PyThreadState_SetAsyncExc is built without arguments)."""

    class _Remote(RemoteRankError):
        def __init__(self) -> None:
            super().__init__(message, rank)

    _Remote.__name__ = _Remote.__qualname__ = "RemoteRankError"
    return _Remote


def start_watch() -> None:
    """Start the failure watcher of this rank (called by initialize; ONEDIST_WATCH=0 turns it off)."""
    import threading

    if _guard.watcher is not None or os.environ.get("ONEDIST_WATCH", "1").lower() in ("0", "false", "off"):
        return
    try:
        rank, world = _world()
        store = _store() if world > 1 else None
    except Exception:
        return
    if store is None:
        return
    _guard.published = False
    stop = threading.Event()
    thread = threading.Thread(
        target=_watch,
        args=(stop, store, rank, world, threading.main_thread().ident),
        name="onedist-failure-watch",
        daemon=True,
    )
    thread.start()
    _guard.watcher, _guard.watch_stop = thread, stop
    # and at exit, for a program that never calls finalize: the interpreter kills a daemon thread
    # that is inside torch's C++ code (a store call) as it finalizes, which aborts the process
    import atexit

    atexit.unregister(stop_watch)
    atexit.register(stop_watch)


def stop_watch() -> None:
    """Stop the failure watcher (called by finalize, and at exit)."""
    if _guard.watcher is not None:
        _guard.watch_stop.set()
        # a watcher left inside a store call would take the GIL back while the interpreter
        # finalizes, which can abort the process: its calls end within seconds (a store whose host
        # left fails at once), so wait long enough for one, and bounded all the same
        _guard.watcher.join(timeout=_WATCH_S + 10)
        _guard.watcher = _guard.watch_stop = None


def install() -> None:
    """Publish uncaught exceptions of this process to the other ranks (called by initialize)."""
    if not _guard.installed:
        _guard.previous_hook = sys.excepthook
        sys.excepthook = _excepthook
        _guard.installed = True


def uninstall() -> None:
    """Undo :func:`install` (for tests; finalize keeps the hook: an exception that made a rank
    leave its context is printed by it after finalize)."""
    if _guard.installed:
        if sys.excepthook is _excepthook:
            sys.excepthook = _guard.previous_hook or sys.__excepthook__
        _guard.installed = False
        _guard.previous_hook = None


# ---------------------------------------------------------------------------- failure translation
def _is_timeout(e: BaseException) -> bool:
    text = str(e)
    return "Timed out" in text or "timed out" in text or "Timeout" in type(e).__name__


def _group_ranks(group: Any) -> tuple[int, ...]:
    from .context import _state

    b = _state.backend
    if group is None:
        return tuple(range(b.world_size))
    if isinstance(group, (list, tuple, range)):
        return tuple(int(r) for r in group)
    try:
        return b.group_ranks(group)
    except Exception:
        return tuple(range(b.world_size))


def _explain(name: str, e: BaseException, group: Any, started: float) -> BaseException:
    try:
        rank, world = _world()
    except Exception:
        return e
    if world <= 1:
        return e
    ranks = _group_ranks(group)
    site = _site(_user_frame(sys._getframe(1)))
    failed = _failed_reports(ranks, rank)
    if _is_timeout(e):  # a peer that timed out too did not cause this timeout: report both calls
        failed = {r: rep for r, rep in failed.items() if rep.get("type") != "OnedistTimeoutError"}
    if failed:
        return _remote_failure(name, rank, site, failed)
    if _is_timeout(e):
        return _timeout_error(name, e, ranks, rank, site, started)
    text = str(e)
    if any(s in text for s in _PEER_GONE):
        # A peer's connection went away. If that peer failed (it publishes its error) or timed
        # out (it publishes where it waited) just before, say so: gloo closes a timed-out rank's
        # connections at once, so its peers often see "closed" before their own timeout fires.
        waited = time.monotonic() - started
        since = time.time() - waited - 1.0
        store = _store()
        # where this rank waited, for a timed-out peer's report (not to a store whose host, rank
        # 0, has exited: torch prints a C++ stack trace for that, before rank k's own error)
        if store is not None and not _server_gone(store):
            mine = {
                "rank": rank,
                "call": name,
                "site": site,
                "group": list(ranks),
                "time": time.time(),
                "peer_gone": True,  # where it waited, not a timeout of its own
            }
            try:
                store.set(_STUCK_KEY.format(rank), json.dumps(mine))
            except Exception:
                pass
        # A peer that timed out has waited its whole timeout, so this rank has usually waited a
        # while too; a peer that died at once (the common crash) is not worth a pause.
        deadline = time.monotonic() + (_PEER_GONE_WAIT_S if waited >= 1.0 else 0.0)
        while True:
            failed = _failed_reports(ranks, rank)
            if failed:
                return _remote_failure(name, rank, site, failed)
            if _stuck_reports(ranks, rank, since):
                # a peer's timeout fired first and gloo closed its connections: the group timed
                # out, this rank included; report it as the timeout it is, with every rank's call
                return _timeout_error(name, e, ranks, rank, site, started)
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        # a consequence, not a cause: marked as such, so this rank does not publish it as its own
        # failure (launchers and error files would blame it) and reports treat it as secondary
        culprit = getattr(e, "culprit", None)  # shm knows which group rank exited
        if getattr(e, "exited", False) and isinstance(culprit, int) and 0 <= culprit < len(ranks):
            gone, who = ranks[culprit], f"rank {ranks[culprit]} of group {list(ranks)} exited"
        else:
            gone, who = -1, f"another rank of group {list(ranks)} closed its connection"
        return RemoteRankError(
            f"onedist.{name} (rank {rank}, at {site}): {who} without reporting an error (it returned, "
            "exited or was killed).\n"
            f"(backend: {text.strip()[:300]})",
            gone,
        )
    return e


def _remote_failure(name: str, rank: int, site: str, failed: dict[int, dict[str, Any]]) -> BaseException:
    r, report = min(failed.items(), key=lambda kv: kv[1].get("time", 0.0))
    err = RemoteRankError(
        f"onedist.{name} (rank {rank}, at {site}): rank {r} failed, so this collective cannot complete:\n"
        f"{report['traceback'].rstrip()}",
        r,
    )
    err.report = report  # type: ignore[attr-defined]
    return err


def _stuck_reports(ranks: Any, exclude: int, since: float) -> dict[int, dict[str, Any]]:
    """The timeout reports (where each waited when it timed out) that ranks of ``ranks`` published
    after ``since`` (not the reports of ranks that, like this one, only saw a peer vanish)."""
    return _reports(
        _STUCK_KEY, ranks, exclude, lambda rep: rep.get("time", 0.0) >= since and not rep.get("peer_gone")
    )


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket closed")


def _timeout_error(
    name: str, e: BaseException, ranks: tuple[int, ...], rank: int, site: str, started: float
) -> BaseException:
    waited = time.monotonic() - started
    now = time.time()
    mine = {"rank": rank, "call": name, "site": site, "group": list(ranks), "time": now}
    store = _store()
    reports: dict[int, dict[str, Any]] = {}
    if store is not None and not _server_gone(store):
        try:
            store.set(_STUCK_KEY.format(rank), json.dumps(mine))
            others = [r for r in ranks if r != rank]
            deadline = time.monotonic() + _REPORT_WAIT_S
            while others and time.monotonic() < deadline:
                for r in list(others):
                    key = _STUCK_KEY.format(r)
                    if store.check([key]):
                        report = json.loads(store.get(key))
                        if report.get("time", 0.0) >= now - waited - 10.0:
                            reports[r] = report
                            others.remove(r)
                if others:
                    time.sleep(0.05)
            store.set(_ACK_KEY.format(rank), str(now))
            if rank == 0 and reports:
                # rank 0 usually hosts the store: stay until the others have read what they need
                acks = [_ACK_KEY.format(r) for r in reports]
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


# ---------------------------------------------------------------------------- debug mode
def _signature(value: Any, depth: int = 0) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return ["T", str(value.dtype), list(value.shape), value.device.type]
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if depth > 6:
        return type(value).__name__
    if isinstance(value, dict):
        return {str(k): _signature(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [_signature(v, depth + 1) for v in value[:64]]]
    return type(value).__name__


def _relax_first_dim(sig: Any) -> Any:
    """all_gather / gather accept different first dimensions: compare the rest only."""
    if isinstance(sig, list) and sig and sig[0] == "T":
        return ["T", sig[1], ["*", *sig[2][1:]] if sig[2] else [], sig[3]]
    if isinstance(sig, dict):
        return {k: _relax_first_dim(v) for k, v in sig.items()}
    if isinstance(sig, list) and len(sig) == 2 and isinstance(sig[1], list):
        return [sig[0], [_relax_first_dim(v) for v in sig[1]]]
    return sig


_STRUCTURE_FREE = frozenset({"all_gather_object", "gather", "broadcast", "scatter", "barrier"})


def _fingerprint(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any], site: str, spec: dict[str, Any]
) -> dict[str, Any]:
    value = args[0] if args else kwargs.get("tensor", kwargs.get("data", kwargs.get("obj")))
    fp: dict[str, Any] = {"call": name, "site": site}
    for key, (position, default) in spec.items():
        given = kwargs.get(key, args[position] if len(args) > position else default)
        fp[key] = str(getattr(given, "name", given)).upper() if key == "op" else str(given)
    if name not in _STRUCTURE_FREE:
        sig = _signature(value)
        fp["value"] = _relax_first_dim(sig) if name == "all_gather" else sig
    return fp


def _inside_rank_only_block(frame: Optional[FrameType]) -> Optional[str]:
    """'if is_main_process():' / 'if get_rank() == 0:' around the calling line, if any."""
    if frame is None:
        return None
    return _rank_only_test(frame.f_code.co_filename, frame.f_lineno)


@functools.lru_cache(maxsize=4096)
def _rank_only_test(filename: str, line: int) -> Optional[str]:
    tree = _parsed(filename)
    if tree is None:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and node.body:
            start, end = (
                node.body[0].lineno,
                max(getattr(n, "end_lineno", n.lineno) or n.lineno for n in node.body),
            )
            if start <= line <= end:
                test = ast.unparse(node.test)
                if "is_main_process()" in test or "get_rank() ==" in test or "get_local_rank() ==" in test:
                    return test
    return None


@functools.lru_cache(maxsize=64)
def _parsed(filename: str) -> Optional[ast.AST]:
    source = "".join(linecache.getlines(filename))
    if not source:
        return None
    try:
        return ast.parse(source)
    except SyntaxError:
        return None


def _exchange(fp: dict[str, Any], b: Any, handle: Any, group: Any) -> Optional[list[dict[str, Any]]]:
    """None when every group rank's fingerprint (without the call site) equals this one, else all of them.

    One all_reduce (MAX) of ``[d, -d]`` for a 124-bit digest ``d`` per call: every rank equal iff the
    maximum of ``d`` equals minus the maximum of ``-d`` (the minimum). The full fingerprints travel
    only on a mismatch (every rank sees it, so every rank takes the second round).
    """
    import hashlib

    import torch

    from .collectives import _all_gather

    comparable = json.dumps({k: v for k, v in fp.items() if k != "site"}, sort_keys=True).encode()
    raw = hashlib.blake2b(comparable, digest_size=16).digest()
    mask = (1 << 62) - 1
    d = [int.from_bytes(raw[:8], "little") & mask, int.from_bytes(raw[8:], "little") & mask]
    device = b.comm_device(torch.device("cpu"), "all_reduce")
    t = torch.tensor([d[0], d[1], -d[0], -d[1]], dtype=torch.int64, device=device)
    b.all_reduce_(t, "MAX", b.object_group(handle), False)
    top = t.tolist()
    if top[0] == d[0] and top[1] == d[1] and -top[2] == d[0] and -top[3] == d[1]:
        return None
    every = _all_gather("debug check", json.dumps(fp, sort_keys=True), group, False, False)
    return [json.loads(f) for f in every]


def _debug_check(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any], group: Any, spec: dict[str, Any]
) -> None:
    frame = _user_frame(sys._getframe(2))
    site = _site(frame)
    if _guard.one_rank_depth > 0:
        raise OnedistRuntimeError(
            f"onedist.{name} at {site} is called inside a one_rank_only function: the other ranks do not run "
            "it, so they never join this collective (deadlock).\nHINT: move the collective out of the "
            "one_rank_only function, or call it on every rank"
        )
    block = _inside_rank_only_block(frame)
    if block is not None:
        raise OnedistRuntimeError(
            f"onedist.{name} at {site} is inside `if {block}:`, which only some ranks enter: the others "
            "never join this collective (deadlock).\nHINT: call the collective on every rank, before the `if`"
        )
    from .collectives import _members
    from .context import current

    b = current()
    handle, me, ranks = _members(name, b, group)
    if me < 0:  # not a member: the collective does not communicate here, nothing to compare
        return
    mine = _fingerprint(name, args, kwargs, site, spec)
    decoded = _exchange(mine, b, handle, group)
    if decoded is not None:
        lines = [f"onedist debug mode: the ranks of group {list(ranks)} called different collectives:"]
        for r, fp in zip(ranks, decoded):
            extra = ", ".join(f"{k}={fp[k]}" for k in ("op", "src", "dst") if k in fp)
            value = f", value {json.dumps(fp['value'])[:200]}" if "value" in fp else ""
            lines.append(f"  rank {r}: {fp['call']}({extra}{value}) at {fp['site']}")
        lines.append(
            "HINT: every rank of a group must call the same collectives, in the same order, on values of "
            "the same type, dtype and shape (all_gather: any first dimension)"
        )
        raise CollectiveMismatchError("\n".join(lines))


# ---------------------------------------------------------------------------- the decorator
def guarded(name: str, group_arg: int, **spec: tuple[int, Any]) -> Callable[[F], F]:
    """Decorate a public collective.

    ``group_arg``: position of its ``group`` parameter; ``spec``: the arguments debug mode compares,
    as ``name=(position, default)`` (e.g. ``op=(1, "SUM")``).
    """

    def decorator(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.monotonic()
            try:
                if _guard.debug:  # its exchange is a collective too: a dead peer shows here first
                    group = kwargs.get("group", args[group_arg] if len(args) > group_arg else None)
                    _debug_check(name, args, kwargs, group, spec)
                return fn(*args, **kwargs)
            except CollectiveMismatchError as e:  # the ranks' calls tell it all, not onedist's frames
                raise e.with_traceback(None) from None
            except OnedistError:
                raise
            except RuntimeError as e:
                group = kwargs.get("group", args[group_arg] if len(args) > group_arg else None)
                _guard.explaining += 1
                try:
                    with _store_noise_held_back():
                        err = _explain(name, e, group, started)
                finally:
                    _guard.explaining -= 1
                if err is e:
                    raise
                if isinstance(err, OnedistError):
                    err.backend_error = e
                raise err from None  # the explanation stands alone (see OnedistError.backend_error)

        return wrapper  # type: ignore[return-value]

    return decorator
