"""Workers of ``onedist run`` forked from the launcher once it has imported torch.

A new interpreter spends ~1 CPU-second importing torch before the script's first line; ``onedist
run`` imports it anyway (its store), so on one node it imports torch first and forks each worker
from itself: the worker starts at once, and the node pays for one import instead of one per
worker plus one (``docs/performance.md``, "Startup"). The child becomes what ``python -m
onedist.launchers.bootstrap script.py`` would be (:func:`become_worker`): its own session, its
variables, fresh standard streams, Python's default signal handlers and no exit handler of the
launcher's, and it never returns into the launcher's frames: it ends with ``os._exit`` after the
steps of Python's own exit (non-daemon threads joined, ``atexit`` handlers, the script's globals
released so that its open files are flushed and closed).

A fork is safe only from a process with one thread (a lock another thread held stays held in the
child), so the launcher forks only then (:func:`can_fork`, before each start), and only where it
sees no GPU (CUDA's driver, once asked, fails in a forked child). Where another thread runs (the
launchers' store of several nodes that agree on restarts, an elastic job's rendezvous), for a live
replacement and with ``--start-method spawn``, each worker is a new interpreter, as before.
"""

from __future__ import annotations

import atexit
import gc
import io
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from typing import IO, Any, Optional

from .worker import die_with_parent

__all__ = ["ForkedProcess", "can_fork", "fork_worker", "preload"]

_SIGNALS_RESET = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGCHLD", "SIGALRM")
_POLL_S = 0.01


def can_fork() -> bool:
    """True where a worker can be forked from this process: Linux, and this process runs one
    thread (counted by the kernel: torch's and the store's native threads count too)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return False
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def preload(omp_num_threads: Optional[str]) -> None:
    """Import torch and ``torch.distributed`` here, before the first fork: what every worker
    imports first. Not torch._dynamo (DDP's constructor imports it: 1.2 CPU-s more, for every
    launch); onedist's own modules are left to the workers (~0.1 s; imported here, a module that
    reads a variable at import would read the launcher's environment instead of the worker's).
    With the workers' ``OMP_NUM_THREADS`` (``None``: unset): the thread pools that read it at load
    time (OpenBLAS, which numpy and torch load, starts its threads then) are sized as in a new
    worker, and with one thread per worker start none, so that this process still runs one
    thread and may fork."""
    before = os.environ.get("OMP_NUM_THREADS")
    _set_variable("OMP_NUM_THREADS", omp_num_threads)
    try:
        import torch.distributed  # noqa: F401  (imported to have it loaded)
    finally:
        _set_variable("OMP_NUM_THREADS", before)


def _set_variable(name: str, value: Optional[str]) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


class ForkedProcess:
    """The part of :class:`subprocess.Popen` the launcher uses (:class:`~.supervisor.ChildProcess`),
    for a forked worker; signals go to its pid (:meth:`~.supervisor.Worker.send`)."""

    def __init__(self, pid: int, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        self.pid = pid
        self.stdout: Optional[IO[bytes]] = stdout
        self.stderr: Optional[IO[bytes]] = stderr
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: it ended, how is unknown
                self.returncode = 1
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(_POLL_S)
        assert self.returncode is not None
        return self.returncode


def fork_worker(env: dict[str, str], command: Sequence[str], held: Sequence[Any]) -> ForkedProcess:
    """Fork a worker that runs ``command`` (``[script, *args]`` or ``["-m", module, *args]``) with
    exactly the variables ``env``, its output on two new pipes. ``held``: what the launcher holds
    that the worker must not (the other workers' pipes, the store's socket), closed in the child."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    for stream in (sys.stdout, sys.stderr):  # or the child would write the launcher's buffer again
        stream.flush()
    launcher = os.getpid()
    # the launcher's handlers must not run in the child before it resets them (SIGINT would make
    # the child signal its siblings): blocked across the fork, the child unblocks after its reset
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.close(out_r)
            os.close(err_r)
            code = become_worker(env, list(command), out_w, err_w, held, launcher, blocked)
        except BaseException:  # onedist's own step failed (the script's errors are bootstrap's)
            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(code)
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    os.close(out_w)
    os.close(err_w)
    return ForkedProcess(pid, os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"))


def become_worker(
    env: dict[str, str],
    command: list[str],
    out_fd: int,
    err_fd: int,
    held: Sequence[Any],
    launcher: int,
    mask: set[Any],
) -> int:
    """In the forked child: become the worker and run the script; its exit status."""
    os.setsid()  # as start_new_session: a terminal's Ctrl-C reaches the launcher only
    die_with_parent(launcher)
    for thing in held:
        thing.close()
    _reset_signals(mask)
    atexit._clear()  # the launcher's exit handlers are not the worker's
    os.environ.clear()
    os.environ.update(env)
    _fresh_streams(out_fd, err_fd)
    _as_fresh_interpreter(command)
    from .bootstrap import main

    try:
        main()
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    return _exit_as_python(code)


def _reset_signals(mask: set[Any]) -> None:
    """Python's own handlers at start-up (SIGPIPE and SIGXFSZ stay ignored, as in any Python)."""
    signal.set_wakeup_fd(-1)
    for name in _SIGNALS_RESET:
        signum = getattr(signal, name, None)
        if signum is not None:
            signal.signal(signum, signal.default_int_handler if name == "SIGINT" else signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _fresh_streams(out_fd: int, err_fd: int) -> None:
    """stdout and stderr on the worker's pipes, unbuffered as ``PYTHONUNBUFFERED=1`` makes them."""
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.close(out_fd)
    os.close(err_fd)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "wb", closefd=False)
        new = io.TextIOWrapper(raw, encoding=old.encoding, errors=old.errors, write_through=True)
        setattr(sys, name, new)
        setattr(sys, f"__{name}__", new)


def _as_fresh_interpreter(command: list[str]) -> None:
    """What a new interpreter would differ in: the threads torch runs ops on (read from the
    environment when torch was imported: the launcher's), numpy's global random state (seeded from
    the OS in each new process; a fork would share the launcher's), ``sys.path[0]``."""
    if "OMP_NUM_THREADS" in os.environ:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    from . import bootstrap

    sys.argv = [bootstrap.__file__, *command]  # as `python -m onedist.launchers.bootstrap ...`
    if command[0] == "-m":  # `python -m` puts the working directory first (bootstrap relies on it)
        sys.path[0] = os.getcwd()


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)  # as Python prints sys.exit("message")
    return 1


def _exit_as_python(code: int) -> int:
    """Python's exit steps that matter to a script, without unwinding into the launcher: wait for
    non-daemon threads, run the exit handlers, release ``__main__``'s globals (their files flush
    and close, their ``__del__`` runs), flush the streams."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:
        pass
    atexit._run_exitfuncs()
    main = sys.modules.get("__main__")
    if main is not None:
        main.__dict__.clear()
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code
