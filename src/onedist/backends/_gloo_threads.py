"""gloo's worker threads go idle before the interpreter shuts down.

A gloo worker thread takes the GIL when it drops the last reference to a tensor that Python also
knew (the tensors of a collective whose caller has moved on) or runs a Python callback of a
work's future. Once the interpreter has begun to finalize, a thread that takes the GIL is ended
with ``pthread_exit``, and that unwinds through C++ frames that may not throw: the process aborts
with "terminate called without an active exception" (SIGABRT) after the script succeeded.

torch's ``ProcessGroupGloo`` joins its threads when it is destroyed, so a group that nothing holds
is safe once ``destroy_process_group`` has run. But ``DistributedDataParallel`` keeps its group
alive (torch 2.13: the group's threads outlive the module and ``destroy_process_group``), and such
a group's threads run until the process ends. :func:`settle` lets them finish what they hold while
Python is still whole: the calling thread releases the GIL until every gloo worker thread of this
process has been seen waiting for work several times in a row. ``finalize`` calls it, and
an ``atexit`` hook does, for programs that never call ``finalize``: atexit runs before finalizing.
"""

from __future__ import annotations

import atexit
import os
import time
from typing import Optional

__all__ = ["install_exit_hook", "settle"]

#: the name gloo's process group gives its worker threads (``/proc/<pid>/task/<tid>/comm``)
WORKER_NAME = "pt_gloo_runloop"
_TASKS = "/proc/self/task"
_QUIET_SAMPLES = 3  # consecutive samples: every worker blocked, no switch since the last
_SAMPLE_S = 0.005


def _read(tid: str, name: str) -> str:
    with open(f"{_TASKS}/{tid}/{name}", encoding="ascii", errors="replace") as f:
        return f.read()


def _workers_state() -> Optional[tuple[bool, dict[str, str]]]:
    """None when this process has no gloo worker thread, else (every one blocked in a futex wait,
    each one's count of voluntary context switches). A blocked thread waits for work on its
    condition variable, or for the GIL (a futex too, and a thread napping in a callback passes
    through it every time it wakes): so only a thread whose switch count stays the same from one
    sample to the next is idle. Where the kernel hides the wait channel, blocked at all (state S
    or D) counts."""
    try:
        tids = os.listdir(_TASKS)
    except OSError:  # not Linux: nothing to look at
        return None
    blocked_all, switches = True, {}
    for tid in tids:
        try:
            if _read(tid, "comm").strip() != WORKER_NAME:
                continue
            state = _read(tid, "stat").rsplit(")", 1)[1].split()[0]
            wchan = _read(tid, "wchan").strip()
            switches[tid] = _read(tid, "status").split("voluntary_ctxt_switches:", 1)[1].split(None, 1)[0]
        except (OSError, IndexError):
            continue  # the thread ended meanwhile
        blocked_all = blocked_all and state in ("S", "D") and (wchan in ("", "0") or "futex" in wchan)
    return (blocked_all, switches) if switches else None


def settle(max_wait_s: float = 2.0) -> bool:
    """Wait (GIL released) until every gloo worker thread is blocked, without a context switch in
    between, in ``_QUIET_SAMPLES`` consecutive samples; True when they are (or there are none),
    False after ``max_wait_s``."""
    deadline = time.monotonic() + max_wait_s
    quiet, before = 0, None
    while quiet < _QUIET_SAMPLES:
        found = _workers_state()
        if found is None:
            return True
        blocked, switches = found
        quiet = quiet + 1 if blocked and switches == before else 0
        before = switches
        if time.monotonic() > deadline:
            return False
        time.sleep(_SAMPLE_S)
    return True


def install_exit_hook() -> None:
    """Run :func:`settle` at exit (once per process, however many groups come and go)."""
    atexit.unregister(settle)
    atexit.register(settle)
