"""Ctrl-C and SIGTERM on a hung job: each rank prints where it is before it ends.

Python runs a signal handler in the main thread, between two bytecodes: a rank blocked inside gloo
(or any C++ wait) never gets there, so Ctrl-C showed nothing and the launcher killed it after its
grace period. Here the signal also wakes the failure watcher's thread: Python's C-level handler
writes the signal's number to a pipe (``signal.set_wakeup_fd``), which the watcher waits on between
its polls. The watcher prints the rank's state (the collective it waits in, and for how long; its
main thread's Python stack, taken from the watcher's thread) and, when the main thread has not
left its wait a second later, ends the process by the same signal, as it would have ended without
onedist. A main thread that returns to Python handles the signal as usual (``KeyboardInterrupt``).

SIGTERM gets a handler only where it had none (the default ends the process at once, before
anyone could print): it prints the same state from the main thread and ends the process by
SIGTERM; Python's own SIGINT handler is wrapped the same way (the state first, then
``KeyboardInterrupt``). Nothing is installed where the program set its own handlers or its own
wakeup fd (asyncio's), or outside the main thread.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any, Optional

from .forced_exit import run_forced_exit_callbacks
from .stall_report import format_state, rank_state

__all__ = ["SignalPipe"]

_NAMES: dict[int, str] = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}
_LEAVE_S = 1.0  # how long the main thread gets to return to Python after the signal


class SignalPipe:
    """The pipe the watcher waits on: signals' numbers, and a byte that stops the wait."""

    def __init__(self, rank: int, main_ident: int) -> None:
        self.rank, self.main_ident = rank, main_ident
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)
        self.installed = self._install()
        self.dumped = False

    def _install(self) -> bool:
        if threading.current_thread() is not threading.main_thread():
            return False
        if signal.getsignal(signal.SIGINT) not in (signal.default_int_handler, signal.SIG_IGN):
            return False  # the program handles Ctrl-C itself (ignored, as a background job's, is kept)
        try:
            previous = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        except (ValueError, OSError):
            return False
        if previous != -1:  # someone else's (asyncio's): theirs stays
            signal.set_wakeup_fd(previous)
            return False
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, self._on_sigint)
        return True

    def wait(self, seconds: float) -> list[int]:
        """Sleep up to ``seconds``; the signals that arrived meanwhile (0: woken to stop)."""
        try:
            ready, _, _ = select.select([self.read_fd], [], [], seconds)
            return list(os.read(self.read_fd, 64)) if ready else []
        except OSError:
            time.sleep(seconds)
            return []

    def wake(self) -> None:
        try:
            os.write(self.write_fd, b"\0")
        except OSError:
            pass

    def handle(self, signum: int, stop: threading.Event) -> None:
        """The watcher's part: print this rank's state; end the process by ``signum`` when its main
        thread stays blocked outside Python."""
        if signum not in _NAMES:
            return
        self._dump(signum)
        frame = sys._current_frames().get(self.main_ident)
        where = (frame, frame.f_lasti) if frame is not None else None
        if stop.wait(_LEAVE_S):
            return
        frame = sys._current_frames().get(self.main_ident)
        if frame is not None and where == (frame, frame.f_lasti):  # still in the same wait
            _die_by(signum)

    def close(self) -> None:
        if self.installed and threading.current_thread() is threading.main_thread():
            try:
                if signal.set_wakeup_fd(-1) != self.write_fd:
                    pass  # replaced since: nothing of ours to undo
                if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                if signal.getsignal(signal.SIGINT) == self._on_sigint:
                    signal.signal(signal.SIGINT, signal.default_int_handler)
            except (ValueError, OSError):
                pass
        for fd in (self.read_fd, self.write_fd):
            try:
                os.close(fd)
            except OSError:
                pass

    def _on_sigint(self, signum: int, frame: Optional[FrameType]) -> None:
        """Python's Ctrl-C, after this rank's state (the main thread runs it between bytecodes: at
        once in Python code, after the wait ends inside C++, which the watcher covers meanwhile)."""
        self._dump(signum)
        raise KeyboardInterrupt

    def _on_sigterm(self, signum: int, frame: Optional[FrameType]) -> None:
        self._dump(signum)
        _die_by(signum)

    def _dump(self, signum: int) -> None:
        if self.dumped:
            return
        self.dumped = True
        try:
            text = format_state(rank_state(self.rank, self.main_ident))
        except Exception as e:  # never in the way of the signal
            text = f"  (where it was cannot be told: {e!r})"
        try:
            sys.stderr.write(f"onedist: rank {self.rank} got {_NAMES[signum]}; where it was:\n{text}\n")
            sys.stderr.flush()
        except Exception:
            pass


def _die_by(signum: int) -> None:
    """End the process by ``signum`` with its default action (the exit status launchers expect),
    from any thread: libc's ``signal`` resets it where Python's would refuse outside the main thread."""
    try:
        run_forced_exit_callbacks()
        sys.stderr.flush()
        libc: Any = ctypes.CDLL(None)
        libc.signal(signum, ctypes.c_void_p(0))  # SIG_DFL
        os.kill(os.getpid(), signum)
        time.sleep(1.0)
    finally:
        os._exit(128 + signum)
