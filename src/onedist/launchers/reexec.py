"""``Parallel(start_method="subprocess")``: this process becomes local rank 0, the script re-runs itself.

For functions that cannot be pickled (closures, lambdas, functions defined under
``if __name__ == "__main__":``, objects holding locks), as PyTorch Lightning's subprocess script
launcher does:

1. The command that started this process is rebuilt: ``python script.py args`` becomes
   ``[sys.executable, <flags>, /abs/script.py, *args]``, ``python -m pkg.mod args`` becomes
   ``[sys.executable, <flags>, "-m", "pkg.mod", *args]`` (``<flags>``: the interpreter options that
   matter, from ``sys.flags``). The working directory and the environment are kept.
2. It is started once for each local rank 1..N-1 with torchrun's variables (RANK, LOCAL_RANK,
   WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
   ``ONEDIST_REEXEC=1`` and ``ONEDIST_ERROR_FILE``. Reaching the same ``Parallel(...)``, a child
   finds a launcher's variables, only initialises, and runs ``fn(local_rank)``; if ``fn`` raises it
   writes the exception to ``ONEDIST_ERROR_FILE`` for the parent.
3. This process sets the same variables for itself (rank 0) while the run lasts, initialises, runs
   ``fn(0, ...)``, finalises, waits for the children, restores the variables and returns ``fn``'s
   result.

Failure handling (nothing may hang; every process is gone within a few seconds of a failure):

* Children die with this process (Linux ``PR_SET_PDEATHSIG``) and run in their own session, so a
  terminal's Ctrl-C reaches this process only, which stops them.
* A watcher thread polls the children while this process is inside ``fn``. When one exits non-zero,
  it waits :data:`~onedist.launchers.supervisor.GRACE_S` for near-simultaneous failures, stops the
  other children (SIGTERM, SIGKILL after :data:`~onedist.launchers.supervisor.TERM_S`) and raises
  :class:`WorkerFailedError` in the main thread through a SIGINT sent to it. The main thread may
  be blocked in a collective with the GIL released, where no exception can be delivered: if it
  has not left ``fn`` within :data:`MAIN_GRACE_S`, the watcher prints the failure report (failing
  rank first) to stderr and ends the process with ``os._exit(1)``.
* When ``fn`` raises here, the children's reports that arrive within a short grace are collected,
  the children are stopped, and the exception is re-raised, unless it is only a consequence of a
  child's failure ("Connection closed by peer", ...): then :class:`WorkerFailedError` with the
  child's traceback first is raised instead.
* SIGINT (with Python's default handler) and SIGTERM (with no handler) stop the children; the main
  thread gets ``KeyboardInterrupt`` / ``SystemExit(143)``, or the process exits with ``128 + signal``
  after :data:`MAIN_GRACE_S` if it cannot. A SIGINT / SIGTERM handler of your own is kept and the
  signal is forwarded to the children.
"""

from __future__ import annotations

import ctypes
import enum
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from subprocess import _args_from_interpreter_flags  # type: ignore[attr-defined]
from typing import Any, Optional

from .._net import STORE_FD_ENV, discard_store_fd, rendezvous_port
from ..environments import TORCHRUN_VARS
from ..errors import OnedistRuntimeError, WorkerFailedError, bad_value, format_user_traceback
from .launcher import SingleAttemptLauncher
from .main_signals import MainSignals
from .report import Failure, failure_error, failure_report
from .spec import LaunchSpec
from .supervisor import GRACE_S, POLL_S, TERM_S, PopenWorker, Supervisor
from .worker import call_worker_fn, torchrun_env, worker_threads_env, write_error_file

__all__ = [
    "ERROR_FILE_ENV",
    "MAIN_GRACE_S",
    "MARKER_ENV",
    "ReexecLauncher",
    "child_init_args",
    "command_line",
    "record_error",
]

MARKER_ENV = "ONEDIST_REEXEC"  # set in the children: "a Parallel(start_method='subprocess') started me"
ERROR_FILE_ENV = "ONEDIST_ERROR_FILE"  # where a child writes its exception (as `onedist run` workers do)
MAIN_GRACE_S = 2.0  # after a failure, the main thread has this long to leave fn before os._exit
_started = False  # a run was started in this process (there can be one)
_HOW_STARTED = {
    "": "interactively (REPL or notebook)",
    "-c": "with `python -c`",
    "-": "from standard input (`python -`)",
}


# ============================================================================ command line
def command_line() -> list[str]:
    """The command that re-runs this process's ``__main__`` with the same arguments.

    Raises:
        OnedistValueError: this process was not started from a script or module (``python -c``,
            REPL, notebook), so there is nothing to re-run.
    """
    main = sys.modules.get("__main__")
    argv0 = sys.argv[0] if sys.argv else ""
    main_file = getattr(main, "__file__", None)
    if argv0 in _HOW_STARTED or not main_file:
        how = _HOW_STARTED.get(argv0, "without a script file (notebook or embedded interpreter)")
        raise bad_value(
            "Parallel",
            "start_method",
            "subprocess",
            "'spawn' or 'fork' in a process started " + how,
            hint="start_method='subprocess' re-runs the command that started this process "
            "(`python script.py ...` or `python -m module ...`) for local ranks 1..N-1; there is no such "
            "command here. Use start_method='spawn' (fn defined at the top level of an importable "
            "module) or start_method='fork' (no CUDA before it), or move the code to a script",
        )
    interpreter_flags: list[str] = _args_from_interpreter_flags()  # -O, -B, -X ..., -W ... (sys.flags)
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", None)
    if isinstance(name, str) and name != "__main__":  # python -m pkg.mod / python -m pkg
        if name.endswith(".__main__"):
            name = name[: -len(".__main__")]
        return [sys.executable, *interpreter_flags, "-m", name, *sys.argv[1:]]
    # python script.py: __main__.__file__ is absolute (Python >= 3.9), even after an os.chdir;
    # python dir/ or app.zip (spec name "__main__"): re-run what was given
    script = main_file if spec is None else os.path.abspath(argv0)
    return [sys.executable, *interpreter_flags, script, *sys.argv[1:]]


# ============================================================================ child side
def is_child() -> bool:
    """True in a process started by ``Parallel(start_method="subprocess")``."""
    return os.environ.get(MARKER_ENV) == "1"


def record_error(exc: BaseException) -> None:
    """In a re-executed child, write ``exc`` to ``$ONEDIST_ERROR_FILE`` for the parent (else no-op).

    The first error of the process is kept: it is the cause, what follows is a consequence.
    """
    if not is_child() or (isinstance(exc, SystemExit) and exc.code in (0, None)):
        return
    path = os.environ.get(ERROR_FILE_ENV)
    if not path or os.path.exists(path):
        return
    try:
        write_error_file(path, exc)
    except OSError:
        pass


def child_init_args(init_method: Optional[str]) -> dict[str, int]:
    """``rank`` / ``world_size`` for ``initialize`` in a child when ``init_method`` is tcp:// or file://."""
    if not is_child() or init_method is None or init_method.startswith("env://"):
        return {}
    return {"rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}


# ============================================================================ parent side
# added to the report of a child that exited with status 1 before it wrote its error
_EXIT_HINT = (
    "It raised outside fn (e.g. while importing the script or before reaching Parallel); its "
    "own traceback is in the output above."
)


def _write_stderr(text: str) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    from ..failures import release_stderr

    release_stderr()  # the main thread may be holding stderr back (and this process may end next)
    try:
        os.write(2, text.encode(errors="replace"))
    except OSError:
        pass


class Phase(enum.Enum):
    """Where a run is. It leaves RUNNING once, by whichever thread comes first (:class:`_Phases`)."""

    RUNNING = "running"  # the main thread is in initialize / fn / finalize
    LEFT = "left"  # it came out by itself
    FAILED = "failed"  # the watcher took over: a child failed
    SIGNALLED = "signalled"  # the watcher took over: a stop signal arrived


class _Phases:
    """The run's :class:`Phase`, and the event of the main thread leaving fn."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # RLock: the SIGINT handler may run while the main thread holds it
        self.now = Phase.RUNNING
        self.left_fn = threading.Event()

    def leave(self, to: Phase) -> Phase:
        """Move out of RUNNING to ``to``; the phase found (RUNNING: this call moved it). The main
        thread's move (``to`` LEFT) also marks that it left fn, whatever it found."""
        with self.lock:
            found = self.now
            if found is Phase.RUNNING:
                self.now = to
            if to is Phase.LEFT:
                self.left_fn.set()
        return found


class _Launch:
    """One run: the children, the watcher thread, the main thread's signals, and the phase."""

    def __init__(self, cmd: list[str], rank0: int, child_env: dict[int, dict[str, str]]) -> None:
        self.cmd = cmd
        self.rank0 = rank0
        self.child_env = child_env
        self.supervisor = Supervisor[PopenWorker]()  # the children
        self.phase = _Phases()
        self.signals = MainSignals(self._interrupted, self.phase.lock)
        self.done = threading.Event()
        self.error: Optional[WorkerFailedError] = None  # the children's failure (Phase.FAILED)
        self.delivered = False  # raised in the main thread
        self.signalled: Optional[int] = None  # the stop signal (Phase.SIGNALLED)
        self.tmpdir = ""
        self.watcher: Optional[threading.Thread] = None
        self.initialized = False  # the main thread's group exists: finalise it at the end

    def _interrupted(self) -> Optional[BaseException]:
        """What the main thread raises when the watcher's interrupt reaches it: the children's
        failure, once, while it is still in fn."""
        if self.phase.now is Phase.FAILED and not self.delivered and not self.phase.left_fn.is_set():
            self.delivered = True
            return self.error
        return None

    # ------------------------------------------------------------------ children
    def start_children(self) -> None:
        libc: Any = None
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(None, use_errno=True)  # loaded here, not between fork and exec
            except OSError:
                libc = None
        parent = os.getpid()
        ignore_sigint = self.signals.sigint_ignored

        def die_with_parent() -> None:  # runs in the child between fork and exec
            if libc is not None:
                try:
                    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
                except Exception:
                    pass
            if ignore_sigint:  # SIGINT was ignored before onedist's handler: so it stays in the child
                try:
                    signal.signal(signal.SIGINT, signal.SIG_IGN)
                except Exception:
                    pass
            if os.getppid() != parent:
                os._exit(1)

        for local_rank, extra in self.child_env.items():
            rank = int(extra["RANK"])
            error_file = os.path.join(self.tmpdir, f"{rank}.json")
            env = {**os.environ, **extra, MARKER_ENV: "1", ERROR_FILE_ENV: error_file}
            popen = subprocess.Popen(
                self.cmd,
                env=env,
                cwd=os.getcwd(),
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C reaches this process only; it stops the children
                preexec_fn=die_with_parent,
            )
            self.supervisor.workers.append(PopenWorker(rank, local_rank, popen, error_file, _EXIT_HINT))

    def running(self) -> list[PopenWorker]:
        return self.supervisor.running()

    def signal_children(self, sig: int) -> None:
        self.supervisor.signal_all(sig)

    def stop(self) -> None:
        """SIGTERM the children, SIGKILL whoever is left after TERM_S."""
        self.supervisor.stop(kill_wait=5.0)

    def poll_failures(self) -> Optional[float]:
        """Record the children's failures; the monotonic time now if one failed, else None."""
        return self.supervisor.poll_failures()

    def failures(self, mark_stopped: bool) -> list[Failure]:
        return self.supervisor.failures(mark_stopped)

    # ------------------------------------------------------------------ watcher thread
    def watch(self) -> None:
        first: Optional[float] = None
        while not self.done.is_set():
            for signum in self.signals.read(POLL_S):
                if signum in self.signals.stop_signals:
                    self.on_stop_signal(signum)
                    return
                if signum in self.signals.forward_signals:
                    self.signal_children(signum)
            if self.phase.now is not Phase.RUNNING:
                return
            seen = self.poll_failures()
            if first is None:
                first = seen
            if first is not None and time.monotonic() >= first + GRACE_S:
                self.on_child_failure()
                return

    def on_child_failure(self) -> None:
        with self.phase.lock:
            if self.phase.leave(Phase.FAILED) is not Phase.RUNNING:
                return
            self.error = failure_error(self.failures(mark_stopped=True))
        deadline = time.monotonic() + MAIN_GRACE_S
        self.signals.interrupt_main()
        self.finish(deadline, str(self.error) + "\n", 1)

    def on_stop_signal(self, signum: int) -> None:
        with self.phase.lock:
            if self.phase.leave(Phase.SIGNALLED) is not Phase.RUNNING:
                return
            self.signalled = signum
        deadline = time.monotonic() + MAIN_GRACE_S
        name = signal.Signals(signum).name
        self.finish(deadline, f"onedist: stopped by signal {name}\n", 128 + signum)

    def finish(self, deadline: float, message: str, code: int) -> None:
        """Stop the children; if the main thread is still in fn at ``deadline``, exit the process."""
        self.signal_children(signal.SIGTERM)
        kill_at = time.monotonic() + TERM_S
        while True:
            alive = bool(self.running())
            now = time.monotonic()
            if not self.phase.left_fn.is_set() and now >= deadline:
                self.die(message, code)
            if alive and now >= kill_at:
                self.signal_children(signal.SIGKILL)
            if not alive and self.phase.left_fn.is_set():
                return
            time.sleep(POLL_S)

    def die(self, message: str, code: int) -> None:
        self.signal_children(signal.SIGKILL)
        for w in self.supervisor.workers:
            w.join(1.0)
        _write_stderr(
            message
            + f"onedist: the main process (rank {self.rank0}) did not leave fn within {MAIN_GRACE_S:g} s "
            "(blocked in a collective or other native call, or it caught the error); exiting\n"
        )
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        os._exit(code)

    # ------------------------------------------------------------------ main thread
    def join_watcher(self) -> None:
        if self.watcher is not None:
            self.watcher.join(TERM_S + MAIN_GRACE_S + 1.0)

    def main_failed(self, exc: BaseException) -> BaseException:
        """The exception to raise after ``exc`` came out of initialize / fn / finalize here."""
        when = time.time()
        found = self.phase.leave(Phase.LEFT)
        if found is Phase.FAILED and self.error is not None:
            self.join_watcher()  # it stops the children
            return self.error
        if found is Phase.SIGNALLED or isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            self.join_watcher()
            self.stop()
            return exc
        mine = Failure(
            self.rank0,
            0,
            os.getpid(),
            when,
            exc_type=type(exc).__name__,
            message=str(exc),
            traceback=format_user_traceback(exc),
        )
        # collect the children's failures that arrive within the grace period; when this error is
        # only a consequence of another rank's ("connection closed by peer"), wait longer for it
        start = time.monotonic()
        deadline = start + (MAIN_GRACE_S if mine.secondary else GRACE_S)
        while self.running() and time.monotonic() < deadline:
            seen = self.poll_failures()
            if seen is not None:
                deadline = min(deadline, seen + GRACE_S)
            time.sleep(POLL_S)
        failures = self.failures(mark_stopped=True)
        self.stop()
        primary, _ = failure_report([mine, *failures])
        if primary is mine:
            return exc
        return failure_error([mine, *failures])

    def wait_children(self) -> None:
        """After fn returned here: wait for the children; raise if one fails."""
        failures = self.supervisor.watch()
        if failures:
            raise failure_error(failures)


class ReexecLauncher(SingleAttemptLauncher):
    """``Parallel(start_method="subprocess")``: ``fn`` of ``spec`` here as local rank 0 and in
    re-executed children (see the module docstring); ``[fn's return value here]``. Not restarted
    (this process is rank 0 itself)."""

    name = "onedist.Parallel (subprocess)"

    def run(self) -> list[Any]:
        return [_run_subprocess(self.spec)]  # a failure is raised here, in rank 0, where fn ran


def _run_subprocess(spec: LaunchSpec) -> Any:
    """Run ``fn(local_rank, *args, **kwargs)`` of ``spec`` here as local rank 0 and in re-executed
    children. See the module docstring. Returns ``fn``'s return value here."""
    _check_can_start()
    cmd = command_line()
    spec.check_rendezvous_port()
    threads = worker_threads_env(spec.nproc_per_node)
    port, store_fd = _bind_store(spec)

    def env_for(local_rank: int) -> dict[str, str]:
        return torchrun_env(
            local_rank, spec.nproc_per_node, spec.node_rank, spec.nnodes, spec.master_addr, port
        )

    children = {lr: {**env_for(lr), **threads} for lr in range(1, spec.nproc_per_node)}
    launch = _Launch(cmd, spec.rank(0), children)
    global _started
    _started = True
    saved = {k: os.environ.get(k) for k in TORCHRUN_VARS}
    previous_threads: Optional[int] = None
    try:
        os.environ.update(env_for(0))
        previous_threads = _set_torch_threads(threads)
        launch.tmpdir = tempfile.mkdtemp(prefix="onedist-reexec-")
        launch.signals.install()
        launch.start_children()
        launch.watcher = threading.Thread(target=launch.watch, name="onedist-reexec-watcher", daemon=True)
        launch.watcher.start()
        if store_fd is not None:
            os.environ[STORE_FD_ENV] = str(store_fd)  # initialize takes it over (and closes it)
            store_fd = None
        return _run_rank0(launch, spec)
    finally:
        if store_fd is not None:  # never handed to initialize
            os.environ[STORE_FD_ENV] = str(store_fd)
        discard_store_fd(os.environ)
        _end(launch, saved, previous_threads)


def _check_can_start() -> None:
    """Refuse a run in a child (it would start processes again) and a second run in a process."""
    if is_child():
        raise OnedistRuntimeError(
            "onedist.Parallel: this process was started by Parallel(start_method='subprocess') but does "
            "not see the variables it was given (RANK, WORLD_SIZE, ...), so it would start processes "
            "again\nHINT: do not remove RANK / WORLD_SIZE / LOCAL_RANK from os.environ before Parallel"
        )
    if _started:
        raise OnedistRuntimeError(
            "onedist.Parallel: start_method='subprocess' can run only once per process: its children "
            "re-run the whole script, so they would meet the first run again, not this one\n"
            "HINT: put everything in one run(fn), or use start_method='spawn' / 'fork' for the others"
        )


def _bind_store(spec: LaunchSpec) -> tuple[int, Optional[int]]:
    """The rendezvous port, and the store's socket (a file descriptor) when this process hosts it.

    This process is rank 0: it binds the store's socket now and serves on it (no port race;
    loopback only on one node), as spawn and `onedist run` do."""
    try:
        port, sock = rendezvous_port(
            spec.master_addr,
            spec.master_port,
            host_store=spec.rank(0) == 0 and spec.env_rendezvous,
            what="master_port",
        )
    except OSError as e:
        raise OnedistRuntimeError(f"onedist.Parallel: {e.strerror or e}") from e
    return port, (sock.detach() if sock is not None else None)


def _set_torch_threads(threads: dict[str, str]) -> Optional[int]:
    """Apply OMP_NUM_THREADS of ``threads`` to torch here (as in the children); the previous count."""
    if not threads:
        return None
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(int(threads["OMP_NUM_THREADS"]))
    return previous


def _run_rank0(launch: _Launch, spec: LaunchSpec) -> Any:
    """Initialise as rank 0, run ``fn(0, ...)``, finalise, then wait for the children."""
    from ..context import finalize, initialize

    try:
        initialize(
            spec.backend,
            timeout=spec.timeout,
            init_method=spec.init_method,
            rank=None if spec.env_rendezvous else spec.rank(0),
            world_size=None if spec.env_rendezvous else spec.world_size,
        )
        launch.initialized = True
        result = call_worker_fn(spec.fn, 0, spec.args, spec.kwargs)
        launch.initialized = False
        finalize()
    except BaseException as e:
        err = launch.main_failed(e)
        if err is e:
            raise
        raise err from None
    found = launch.phase.leave(Phase.LEFT)
    if found is Phase.FAILED and launch.error is not None:
        launch.join_watcher()
        raise launch.error
    if found is Phase.SIGNALLED and launch.signalled is not None:  # fn returned as the signal came
        launch.join_watcher()
        if launch.signalled == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + launch.signalled)
    launch.wait_children()
    return result


def _end(launch: _Launch, saved: dict[str, Optional[str]], previous_threads: Optional[int]) -> None:
    """Whatever happened: the watcher and the children gone, the group finalised, this process's
    signal handlers, thread count and variables as they were."""
    launch.done.set()
    launch.join_watcher()
    launch.stop()
    if launch.initialized:  # still set only when fn raised: no last call to check (context.finalize_context)
        from ..context import finalize_context

        try:
            finalize_context(check_last_call=False)
        except Exception:
            pass
    launch.signals.restore()
    if previous_threads is not None:
        import torch

        torch.set_num_threads(previous_threads)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    if launch.tmpdir:
        shutil.rmtree(launch.tmpdir, ignore_errors=True)
