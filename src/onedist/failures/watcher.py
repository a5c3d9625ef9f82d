"""The failure watcher: a thread per rank that ends the rank soon after another rank failed."""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Any, Optional

from ..errors import CollectiveMismatchError, RemoteRankError
from ..state import world
from .channel import FAILED_COUNT, ServerProbe, failed_reports, rank_and_world, side_store
from .hooks import wait_until_gone
from .stall import StallCheck, forget_stalls
from .stderr import release_stderr

_WATCH_S = 1.0  # how often each rank asks the store whether another rank failed


_WATCH_GRACE_S = 3.0  # how long a rank blocked outside Python gets before it is ended


def _watch(stop: Any, store: Any, rank: int, world_size: int, main_ident: int) -> None:
    """Background thread of every rank: end this rank soon after another rank failed.

    A rank that waits in a collective learns of a peer's death from the communication library; a
    rank that computes (or sleeps) outside collectives would run on until its next one, or forever
    under launchers that do not kill the job (plain ``srun``). Once a second, one ``add(key, 0)``
    round trip asks the store how many ranks failed; when one did, this rank gets that rank's
    error as a :class:`RemoteRankError` raised in its main thread, and if it is blocked outside
    Python for longer than 3 s, the error is printed and the process ends (exit status 1). The
    same loop compares a blocked collective with the peers' (:mod:`onedist.failures.stall`).
    """
    probe = ServerProbe(store)
    try:
        _poll(stop, store, probe, rank, world_size, main_ident)
    finally:
        probe.close()


def _poll(stop: Any, store: Any, probe: ServerProbe, rank: int, world_size: int, main_ident: int) -> None:
    handled = 0
    stall: Optional[StallCheck] = StallCheck(store, rank, world_size, main_ident)
    while not stop.wait(_WATCH_S):
        if probe.gone():
            return  # the rank hosting the store exited: the job is ending
        try:
            count = int(store.add(FAILED_COUNT, 0))
            failed = {}
            if count > handled and not world.published and not world.explaining:
                handled = count
                failed = failed_reports(range(world_size), rank)
            verdict = stall.sample() if stall is not None and not failed and not world.explaining else None
        except Exception:
            return  # the store is gone: the job is ending anyway
        if failed:
            r, report = min(failed.items(), key=lambda kv: kv[1].get("time", 0.0))
            if report.get("type") == CollectiveMismatchError.__name__:  # the same verdict on every rank
                message = report.get("message", "")
                _end_main_thread(stop, main_ident, _mismatch_error_class(message), message, rank)
                return
            message = (
                f"onedist: rank {r} failed, so rank {rank} stops too:\n{report.get('traceback', '').rstrip()}"
            )
            # if it must end this process, let the failed rank exit first: launchers blame the first
            gone = functools.partial(wait_until_gone, report)
            _end_main_thread(
                stop, main_ident, _remote_error_class(message, r), message, rank, before_exit=gone
            )
            return
        if verdict is not None and stall is not None:
            check, stall = stall, None  # one verdict per group: its connections are gone after it
            if world.call is None and _break_tells_peers():  # every rank's call raises at once
                _break()
                _end_main_thread(stop, main_ident, _mismatch_error_class(verdict), verdict, rank)
                return
            if world.call is None:  # a plain torch.distributed call: no guard there to explain it

                def break_after_peers_read(check: StallCheck = check) -> None:
                    check.let_peers_read()
                    _break()

                error = _mismatch_error_class(verdict)
                _end_main_thread(stop, main_ident, error, verdict, rank, break_after_peers_read)
                return
            if not _break_pending(stop):
                _end_main_thread(stop, main_ident, _mismatch_error_class(verdict), verdict, rank)
                return


def _break() -> bool:
    try:
        return bool(world.backend.break_pending())
    except Exception:
        return False


def _break_tells_peers() -> bool:
    try:
        return bool(world.backend.break_tells_peers())
    except Exception:
        return False


def _break_pending(stop: Any) -> bool:
    """Break the group's connections so the blocked call raises (the guard explains it); True when
    the main thread left that call within the grace period."""
    blocked = world.call
    if not _break():
        return False
    deadline = time.monotonic() + _WATCH_GRACE_S
    while world.call is blocked and time.monotonic() < deadline:
        if stop.wait(0.05):
            return True
    return world.call is not blocked


def _end_main_thread(
    stop: Any,
    main_ident: int,
    error: type[BaseException],
    message: str,
    rank: int,
    then: Any = None,
    before_exit: Any = None,
) -> None:
    """Raise ``error`` in the main thread (after which ``then()`` may break the call it waits in);
    end the process if it is still blocked outside Python after the grace period (after
    ``before_exit()``)."""
    import ctypes

    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main_ident), ctypes.py_object(error))
    if then is not None:
        then()
    if stop.wait(_WATCH_GRACE_S):
        return
    if before_exit is not None:
        before_exit()
    try:
        release_stderr()
        sys.stderr.write(message + f"\n(rank {rank} was blocked outside Python; ending it)\n")
        sys.stderr.flush()
    finally:
        os._exit(1)


def _mismatch_error_class(message: str) -> type[CollectiveMismatchError]:
    """A CollectiveMismatchError whose no-argument constructor gives ``message`` (see below)."""

    class _Mismatch(CollectiveMismatchError):
        def __init__(self) -> None:
            super().__init__(message)

    _Mismatch.__name__ = _Mismatch.__qualname__ = "CollectiveMismatchError"
    _Mismatch.__module__ = CollectiveMismatchError.__module__
    return _Mismatch


def _remote_error_class(message: str, rank: int) -> type[RemoteRankError]:
    """A RemoteRankError subclass whose no-argument constructor gives ``message`` (an exception
    raised in another thread through PyThreadState_SetAsyncExc is built without arguments)."""

    class _Remote(RemoteRankError):
        def __init__(self) -> None:
            super().__init__(message, rank)

    _Remote.__name__ = _Remote.__qualname__ = "RemoteRankError"
    _Remote.__module__ = RemoteRankError.__module__  # printed as onedist.errors.RemoteRankError
    return _Remote


def start_watch() -> None:
    """Start the failure watcher of this rank (called by initialize; ONEDIST_WATCH=0 turns it off)."""
    import threading

    if world.watcher is not None or os.environ.get("ONEDIST_WATCH", "1").lower() in ("0", "false", "off"):
        return
    try:
        rank, world_size = rank_and_world()
        store = side_store() if world_size > 1 else None
    except Exception:
        return
    if store is None:
        return
    world.published = False
    try:
        forget_stalls(store, rank)
    except Exception:  # a store without delete_key: nothing of an earlier group in it either
        pass
    stop = threading.Event()
    thread = threading.Thread(
        target=_watch,
        args=(stop, store, rank, world_size, threading.main_thread().ident),
        name="onedist-failure-watch",
        daemon=True,
    )
    thread.start()
    world.watcher, world.watch_stop = thread, stop
    # and at exit, for a program that never calls finalize: the interpreter kills a daemon thread
    # that is inside torch's C++ code (a store call) as it finalizes, which aborts the process
    import atexit

    atexit.unregister(stop_watch)
    atexit.register(stop_watch)


def stop_watch() -> None:
    """Stop the failure watcher (called by finalize, and at exit)."""
    if world.watcher is not None and world.watch_stop is not None:
        world.watch_stop.set()
        # a watcher left inside a store call would take the GIL back while the interpreter
        # finalizes, which can abort the process: its calls end within seconds (a store whose host
        # left fails at once), so wait long enough for one, and bounded all the same
        world.watcher.join(timeout=_WATCH_S + 10)
        world.watcher = world.watch_stop = None
