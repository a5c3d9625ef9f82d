"""What must run before a rank is ended without Python's exit handlers.

onedist ends a rank with ``os._exit`` (or its signal's default action) where a normal exit would
hang: its main thread blocked inside a collective after another rank failed (the watcher), an
uncaught exception under MPI (MPI_Finalize would wait for the peers), SIGTERM from a launcher
stopping the job. ``atexit`` handlers do not run then, so what they would have saved is lost: a
logger's buffered metrics (TensorBoard's writer keeps up to ``flush_s`` seconds). Code that holds
such data registers a callback with :func:`on_forced_exit`; every such path calls
:func:`run_forced_exit_callbacks` first. The callbacks run on a thread of their own, for
:data:`CALLBACK_S` seconds at most in all (a callback stuck on a lock the blocked main thread holds
must not keep the rank alive).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["CALLBACK_S", "on_forced_exit", "run_forced_exit_callbacks"]

#: how long the callbacks may take together before the rank is ended anyway
CALLBACK_S = 2.0

_callbacks: list[Callable[[], None]] = []


def on_forced_exit(callback: Callable[[], None]) -> None:
    """Run ``callback()`` before this process is ended without its exit handlers (once, however
    many times it was registered)."""
    if callback not in _callbacks:
        _callbacks.append(callback)


def run_forced_exit_callbacks(timeout: float = CALLBACK_S) -> None:
    """Run the registered callbacks (each once, errors ignored), ``timeout`` seconds at most."""
    callbacks, _callbacks[:] = list(_callbacks), []
    if not callbacks:
        return

    def run_all() -> None:
        for callback in callbacks:
            try:
                callback()
            except Exception:  # the rank is being ended: nothing may stop that
                pass

    thread = threading.Thread(target=run_all, name="onedist-forced-exit", daemon=True)
    thread.start()
    thread.join(timeout)
