"""The failure watcher: a thread per rank that ends the rank soon after another rank failed."""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable
from typing import Any, Optional

from ..backends.recorded import calls as recorded_log
from ..errors import CollectiveMismatchError, OnedistError, RemoteRankError
from ..state import world
from .channel import FAILED_COUNT, ServerProbe, failed_reports, publish_failure, rank_and_world, side_store
from .explain import explain, known_cause
from .forced_exit import run_forced_exit_callbacks
from .history import HistoryCheck
from .hooks import wait_until_gone
from .logged import LoggedCall
from .signals import SignalPipe
from .stall import StallCheck, forget_stalls, write_verdict
from .stall_report import StallReports, rank_state
from .stderr import release_stderr
from .torch_calls import torch_call

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


def _where(rank: int, main_ident: int) -> str:
    """Where this rank was: the collective it waited in and its line, or its main thread's line."""
    try:
        state = rank_state(rank, main_ident)
    except Exception:
        return f"rank {rank}'s whereabouts unknown"
    waits = state.get("waits")
    if waits is not None:
        return f"rank {rank} was waiting in {waits['call']} at {waits['site']}"
    return f"rank {rank} was at {state.get('site', '<unknown>')}"


def _sleep(stop: Any, seconds: float) -> bool:
    """Wait between two polls, handling Ctrl-C and SIGTERM meanwhile (:mod:`.signals`); True when
    the watcher is to stop."""
    pipe = _pipe
    if pipe is None:
        return bool(stop.wait(seconds))
    for signum in pipe.wait(seconds):
        if stop.is_set():
            break
        pipe.handle(signum, stop)
    return bool(stop.is_set())


def _say_stopped(rank: int, error: BaseException) -> None:
    """The watcher of ``rank`` stops on an error of onedist's own: hangs and mismatches are no
    longer reported on this rank, which the user must learn (and report) rather than guess."""
    sys.stderr.write(
        f"onedist: rank {rank}'s failure watcher stopped on an internal error; hangs and mismatched "
        f"calls are no longer reported on this rank (please report this): {type(error).__name__}: {error}\n"
    )
    sys.stderr.flush()


def _poll(stop: Any, store: Any, probe: ServerProbe, rank: int, world_size: int, main_ident: int) -> None:
    handled = 0
    failed_before = int(store.add(FAILED_COUNT, 0))  # failures of an earlier group on this store
    stall: Optional[StallCheck] = StallCheck(store, rank, world_size, main_ident)
    history = HistoryCheck(store, rank)
    reports = StallReports(store, rank, world_size, main_ident)
    while not _sleep(stop, _WATCH_S):
        if probe.gone():
            return  # the rank hosting the store exited: the job is ending
        try:
            count = int(store.add(FAILED_COUNT, 0))
            failed = {}
            if count > handled and not world.published and not world.explaining:
                handled = count
                failed = failed_reports(range(world_size), rank)
            # the store's host may leave at any moment (the job ends): asking a store that is gone
            # makes torch print a C++ stack trace, so look again before each part of the poll
            verdict = found = None
            if stall is not None and not failed and not world.explaining and not probe.gone():
                verdict = stall.sample()
                if verdict is None and not probe.gone():
                    found = history.sample()
            if not failed and verdict is None and found is None and not probe.gone():
                reports.sample()
        except (RuntimeError, OSError):
            return  # the store is gone: the job is ending anyway
        except Exception as e:  # onedist's own mistake: say so, never stop watching in silence
            _say_stopped(rank, e)
            return
        if found is not None:  # calls that completed although the ranks disagreed
            _end_on_history(stop, store, probe, found, rank, main_ident, failed_before)
            return
        if failed and world.explained:  # its own call raised it already: see World.explained
            return
        if failed:
            r, report = min(failed.items(), key=lambda kv: kv[1].get("time", 0.0))
            if report.get("type") == CollectiveMismatchError.__name__:  # the same verdict on every rank
                message = report.get("message", "")
                _end_main_thread(stop, main_ident, _mismatch_error_class(message), message, rank)
                return
            message = (
                f"onedist: rank {r} failed, so rank {rank} stops too ({_where(rank, main_ident)}):\n"
                f"{report.get('traceback', '').rstrip()}"
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
            if world.call is None and isinstance(check.call, LoggedCall) and not torch_call(main_ident):
                # a call on record waited on outside torch's functions (an asynchronous call's or a
                # send's wait(), DDP's backward): its wait raises the verdict itself once the group
                # is broken (recorded.calls.explain_failure)
                check.let_peers_read()
                _break()
                _end_if_still_blocked(stop, check.call, verdict, rank)
                return
            if world.call is None:  # a plain torch.distributed call: no guard there to explain it

                def break_after_peers_read(check: StallCheck = check) -> None:
                    check.let_peers_read()
                    _break()

                error = _mismatch_error_class(verdict)
                _end_main_thread(stop, main_ident, error, verdict, rank, break_after_peers_read)
                return
            check.let_peers_read()  # a peer in a plain call hears the verdict before the break
            still_there = functools.partial(_still_in, world.call)
            if not _break_pending(stop):
                error = _mismatch_error_class(verdict)
                _end_main_thread(stop, main_ident, error, verdict, rank, still_there=still_there)
                return


def _end_on_history(
    stop: Any, store: Any, probe: ServerProbe, found: Any, rank: int, main_ident: int, failed_before: int
) -> None:
    """Every rank learns it (the verdict, and this rank's failure report: their watchers raise it);
    the group's pending calls break; this rank's main thread raises it."""
    message, log = found
    error = _mismatch_error_class(message)
    # the peers raise it from their own watchers (within a second; a neighbour may have found it
    # too): this rank waits until every rank of the group has, so that no launcher stops one of
    # them as a consequence of this rank's failure. The store may be gone meanwhile (its host, a
    # neighbour that found it too, has raised it and ended): this rank raises it all the same.
    deadline = time.monotonic() + 2 * _WATCH_S
    try:
        write_verdict(store, log.seq, list(log.ranks), message, rank, "recorded")
        publish_failure(error())
        while time.monotonic() < deadline and not probe.gone():
            if int(store.add(FAILED_COUNT, 0)) >= failed_before + len(log.ranks):
                break
            if stop.wait(0.05):
                return
    except Exception:
        pass
    _end_main_thread(stop, main_ident, error, message, rank, _break)


def _end_if_still_blocked(stop: Any, call: LoggedCall, message: str, rank: int) -> None:
    """End the process (the message printed) when the main thread is still blocked in ``call``
    after the grace period: a wait that no explanation reaches (inside a C++ caller)."""
    deadline = time.monotonic() + _WATCH_GRACE_S
    while time.monotonic() < deadline:
        if stop.wait(0.05) or call.entry not in call.log.waiting():
            return
    _exit_with(message, rank)


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


def _still_in(call: Any) -> bool:
    """Whether the main thread is still in ``call``: once it left (its guard raised the verdict),
    the verdict raised into it again would land in the program's own except clause."""
    return world.call is call


def _end_main_thread(
    stop: Any,
    main_ident: int,
    error: type[BaseException],
    message: str,
    rank: int,
    then: Any = None,
    before_exit: Any = None,
    still_there: Optional[Callable[[], bool]] = None,
) -> None:
    """Raise ``error`` in the main thread (after which ``then()`` may break the call it waits in);
    end the process if it is still blocked outside Python after the grace period (after
    ``before_exit()``). Nothing at all when ``still_there()`` says the main thread left the call
    the error is about."""
    import ctypes

    if still_there is not None and not still_there():
        return
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main_ident), ctypes.py_object(error))
    if then is not None:
        then()
    if stop.wait(_WATCH_GRACE_S):
        return
    if before_exit is not None:
        before_exit()
    _exit_with(message, rank)


def _exit_with(message: str, rank: int) -> None:
    try:
        run_forced_exit_callbacks()
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
    world.published = world.explained = False  # a new group: nothing raised of it yet
    recorded_log.explain_failure = _explain_failure
    recorded_log.known_cause = functools.partial(known_cause, rank=rank, world_size=world_size)
    try:
        forget_stalls(store, rank)
    except Exception:  # a store without delete_key: nothing of an earlier group in it either
        pass
    stop = threading.Event()
    global _pipe
    _pipe = SignalPipe(rank, threading.main_thread().ident or 0)
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


def _explain_failure(name: str, error: BaseException, started: float) -> BaseException:
    """onedist's explanation of a failed collective that no guard runs around (a DDP backward's):
    the stall verdict that broke it, a peer's error, a timeout naming the ranks."""
    if isinstance(error, OnedistError):  # explained already (a work's wait inside a DDP step)
        return error
    explained = explain(name, error, None, started, sys.maxsize)
    if explained is not error and isinstance(explained, OnedistError):
        explained.backend_error = error
    return explained


#: the pipe that wakes the watcher on a signal (and to stop), while it runs
_pipe: Optional[SignalPipe] = None


def stop_watch() -> None:
    """Stop the failure watcher (called by finalize, and at exit)."""
    global _pipe
    if world.watcher is not None and world.watch_stop is not None:
        world.watch_stop.set()
        if _pipe is not None:
            _pipe.wake()
        # a watcher left inside a store call would take the GIL back while the interpreter
        # finalizes, which can abort the process: its calls end within seconds (a store whose host
        # left fails at once), so wait long enough for one, and bounded all the same
        world.watcher.join(timeout=_WATCH_S + 10)
        world.watcher = world.watch_stop = None
        if _pipe is not None:
            _pipe.close()
            _pipe = None
