"""The main thread's signals during ``Parallel(start_method="subprocess")`` (:mod:`.reexec`).

This process is local rank 0 and the children's launcher at once: SIGINT and SIGTERM must stop the
run even while its main thread is blocked in native code, a failed child must interrupt that main
thread, and a handler of the user's own must keep working. :class:`MainSignals` installs the
handlers (only where the default would end the process; a user's handler gets the signal forwarded
to the children instead), a wakeup pipe the watcher thread reads (``signal.set_wakeup_fd``: a signal
is seen there whatever the main thread does), and interrupts the main thread with a real SIGINT
(``pthread_kill``, which also ends a blocking sleep or select), telling its own interrupts from the
user's Ctrl-C by counting them.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, Optional, cast

__all__ = ["MainSignals"]


class MainSignals:
    """SIGINT / SIGTERM of a run's main thread (see the module doc). ``interrupted`` gives the
    exception the main thread raises when the watcher's interrupt reaches it (None: nothing)."""

    def __init__(self, interrupted: Callable[[], Optional[BaseException]], lock: Any) -> None:
        self._interrupted = interrupted
        self.lock = lock  # the run's (an RLock: the handler may run while the main thread holds it)
        self.in_main_thread = threading.current_thread() is threading.main_thread()
        self.installed = False  # our SIGINT handler is in place: the watcher can interrupt
        self.prev_int: Any = None
        self.prev_term: Any = None
        self.stop_signals: set[int] = set()  # the default would end the process: they stop the run
        self.forward_signals: set[int] = set()  # the user's own handler runs: the children get them
        self._sent = self._seen = 0  # interrupts the watcher sent, and those the handler took
        self._wake_r = self._wake_w = self._prev_wakeup = -1

    def install(self) -> None:
        self.prev_int = signal.getsignal(signal.SIGINT) if self.in_main_thread else None
        if self.prev_int is None:  # not the main thread, or a handler set outside Python: no
            return  # signal plumbing; the os._exit fallback remains
        self.prev_term = signal.getsignal(signal.SIGTERM)
        for signum, prev in ((signal.SIGINT, self.prev_int), (signal.SIGTERM, self.prev_term)):
            if prev is signal.default_int_handler or prev == signal.SIG_DFL:
                self.stop_signals.add(signum)
            elif callable(prev):
                self.forward_signals.add(signum)
        if signal.SIGTERM in self.stop_signals:
            signal.signal(signal.SIGTERM, _on_sigterm)
        signal.signal(signal.SIGINT, self._on_sigint)  # also how the watcher interrupts this thread
        self.installed = True
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._prev_wakeup = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)

    def restore(self) -> None:
        if not self.installed:
            return
        signal.set_wakeup_fd(self._prev_wakeup)
        signal.signal(signal.SIGINT, self.prev_int)
        if signal.SIGTERM in self.stop_signals:
            signal.signal(signal.SIGTERM, self.prev_term)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        self._wake_r = self._wake_w = -1
        self.installed = False

    @property
    def sigint_ignored(self) -> bool:
        """SIGINT was ignored before the run (the children keep ignoring it)."""
        return bool(self.prev_int == signal.SIG_IGN)

    def read(self, timeout: float) -> list[int]:
        """The signals that arrived within ``timeout`` seconds (the watcher thread's wait)."""
        if self._wake_r < 0:
            time.sleep(timeout)
            return []
        try:
            ready, _, _ = select.select([self._wake_r], [], [], timeout)
        except (OSError, ValueError):  # closed by the main thread at the very end
            return []
        if not ready:
            return []
        try:
            data = os.read(self._wake_r, 512)
        except (BlockingIOError, OSError):
            return []
        if self._prev_wakeup >= 0:  # e.g. an asyncio loop's: pass the signal on
            try:
                os.write(self._prev_wakeup, data)
            except OSError:
                pass
        return list(data)

    def interrupt_main(self) -> None:
        """Interrupt the main thread (from the watcher) where the handler is installed."""
        with self.lock:
            if not self.installed:
                return
            self._sent += 1
        if threading.main_thread().ident is not None:
            signal.pthread_kill(cast(int, threading.main_thread().ident), signal.SIGINT)

    def _on_sigint(self, signum: int, frame: Optional[FrameType]) -> None:
        with self.lock:
            ours = self._sent > self._seen
            if ours:
                self._seen += 1
            error = self._interrupted() if ours else None
        if error is not None:
            raise error
        if ours:  # our interrupt, after the main thread came out by itself: nothing to do
            return
        if callable(self.prev_int):
            self.prev_int(signum, frame)
        elif self.prev_int != signal.SIG_IGN:
            raise KeyboardInterrupt


def _on_sigterm(signum: int, frame: Optional[FrameType]) -> None:
    raise SystemExit(128 + signum)
