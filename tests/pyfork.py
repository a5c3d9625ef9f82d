"""Python processes for the tests, forked from a server that imported torch once (issue 50).

Most of the suite's processes are ``python script.py`` or ``python -m onedist run ...`` started by a
test, and each new interpreter spends ~1.4 CPU-s importing torch, and its workers ~1.3 more importing
``torch._dynamo`` (DDP's constructor and every optimizer import it). :func:`run` and :class:`Popen`
take the same arguments as :mod:`subprocess`'s, but the process is forked from one server per test
session that imported torch, ``torch.distributed`` and ``torch._dynamo`` at its start: it begins at
the script's first line. It is still a process of its own running the real script: its own pid,
variables (exactly ``env``), working directory, standard streams (the caller's pipes or files,
passed over a Unix socket), session (``start_new_session``), Python's default signal handlers, and
``sys.argv``, ``sys.path`` and ``__main__`` as a new interpreter sets them (``PYTHONPATH`` included).

What differs from a new interpreter, and why a test that depends on it starts a real one: the
modules imported at the server's start were imported with the server's variables (torch reads a few
``TORCH_*`` ones then: ``TORCH_DEVICE_BACKEND_AUTOLOAD`` for one); ``ps`` and ``/proc/<pid>/environ``
show the server's command line and variables (``os.environ`` is right); ``sys.flags`` and ``-X``
options are the server's (none); without ``OMP_NUM_THREADS`` torch computes on one thread (a new
interpreter would start one per core and a second thread at ``import torch``, and a launcher
with that thread could not fork its own workers); its parent is the server, not the test. A script
or ``-m module`` runs as a worker that ``onedist run`` forks runs it (``onedist.launchers.bootstrap``,
``runpy.run_module`` for a module) and ends as that worker ends (``onedist.launchers.forked``): with
``os._exit`` after Python's exit steps (non-daemon threads joined, ``atexit``, ``__main__``
released), not by interpreter finalization.

Without ``os.pidfd_open`` (not Linux, kernel < 5.3) or where ``ONEDIST_TEST_FORK=0``, both are
:mod:`subprocess`'s own.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Mapping, Sequence
from typing import IO, Any, Optional

__all__ = ["Popen", "popen", "run"]

PIPE, STDOUT, DEVNULL = subprocess.PIPE, subprocess.STDOUT, subprocess.DEVNULL
_MESSAGE_MAX = 1 << 20


# ==================================================================================== the client
class Popen:
    """``subprocess.Popen(args, ...)`` for ``args = [sys.executable, ...]``, forked from the server
    (see the module docstring): ``pid``, ``args``, ``stdin``/``stdout``/``stderr`` (with ``PIPE``),
    ``returncode``, :meth:`poll`, :meth:`wait`, :meth:`communicate`, :meth:`send_signal`,
    :meth:`terminate`, :meth:`kill`."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        stdin: Any = None,
        stdout: Any = None,
        stderr: Any = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Any = None,
        text: bool = False,
        encoding: Optional[str] = None,
        errors: Optional[str] = None,
        start_new_session: bool = False,
    ) -> None:
        if not args or args[0] != sys.executable:
            raise ValueError(f"args must start with sys.executable ({sys.executable!r}): {list(args)[:2]!r}")
        self.args = list(args)
        text = text or encoding is not None or errors is not None
        self.returncode: Optional[int] = None
        self._readers: Optional[dict[Any, _Reader]] = None
        ends, theirs = _streams(stdin, stdout, stderr)
        coding = (encoding or "utf-8", errors or "strict") if text else None
        self.stdin, self.stdout, self.stderr = (_wrap(fd, i == 0, coding) for i, fd in enumerate(ends))
        request = {
            "argv": [str(a) for a in self.args[1:]],
            "env": dict(os.environ if env is None else env),
            "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
            "new_session": start_new_session,
        }
        try:
            self._conn = _server().request(request, theirs)
            self.pid = int(json.loads(self._conn.recv(_MESSAGE_MAX))["pid"])
        finally:
            for fd in set(theirs) - {0, 1, 2}:
                os.close(fd)

    def poll(self) -> Optional[int]:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._take_status()
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._take_status()
        assert self.returncode is not None
        return self.returncode

    def _take_status(self) -> None:
        data = self._conn.recv(_MESSAGE_MAX)
        status = json.loads(data)["status"] if data else 255 << 8  # the server died: treat as 255
        self.returncode = os.waitstatus_to_exitcode(status)
        self._conn.close()

    def communicate(self, input: Any = None, timeout: Optional[float] = None) -> tuple[Any, Any]:
        """Write ``input``, read ``stdout`` and ``stderr`` (those that are pipes) to their ends, wait
        for the exit; on a timeout raises :class:`subprocess.TimeoutExpired` and leaves the process
        running, as :mod:`subprocess` does (a later call goes on reading)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.stdin is not None:
            if input:
                self.stdin.write(input)
            self.stdin.close()
            self.stdin = None
        if self._readers is None:
            self._readers = {s: _Reader(s) for s in (self.stdout, self.stderr) if s is not None}
        for reader in self._readers.values():
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        out = self._readers[self.stdout].data if self.stdout is not None else None
        err = self._readers[self.stderr].data if self.stderr is not None else None
        return out, err

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> Popen:
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in (self.stdin, self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()


def run(
    args: Sequence[str],
    *,
    capture_output: bool = False,
    timeout: Optional[float] = None,
    check: bool = False,
    input: Any = None,
    stdout: Any = None,
    stderr: Any = None,
    **kwargs: Any,
) -> subprocess.CompletedProcess:
    """``subprocess.run`` with the process forked from the server (:class:`Popen`); on a timeout
    the process is killed and :class:`subprocess.TimeoutExpired` raised, as there."""
    if capture_output:
        stdout = stderr = PIPE
    stdin = PIPE if input is not None else kwargs.pop("stdin", None)
    if not _forkable(args):
        streams = {"stdin": stdin, "stdout": stdout, "stderr": stderr}
        return subprocess.run(args, timeout=timeout, check=check, input=input, **streams, **kwargs)
    proc = Popen(args, stdin=stdin, stdout=stdout, stderr=stderr, **kwargs)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    if check and proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, proc.args, out, err)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def popen(args: Sequence[str], **kwargs: Any) -> Any:
    """:class:`Popen` for ``[sys.executable, ...]``; ``subprocess.Popen`` for another program or
    where forking is off (see the module docstring)."""
    return Popen(args, **kwargs) if _forkable(args) else subprocess.Popen(args, **kwargs)


def _forkable(args: Sequence[str]) -> bool:
    return (
        bool(args)
        and args[0] == sys.executable
        and os.environ.get("ONEDIST_TEST_FORK", "1") != "0"
        and hasattr(os, "pidfd_open")
    )


def _streams(stdin: Any, stdout: Any, stderr: Any) -> tuple[list[Optional[int]], list[int]]:
    """(our ends of the pipes, or None; the child's three descriptors)."""
    ours: list[Optional[int]] = [None, None, None]
    theirs: list[int] = []
    for i, how in enumerate((stdin, stdout, stderr)):
        if how is None:
            theirs.append(i)
        elif how == PIPE:
            r, w = os.pipe()
            ours[i], child = (w, r) if i == 0 else (r, w)
            theirs.append(child)
        elif how == DEVNULL:
            theirs.append(os.open(os.devnull, os.O_RDWR))
        elif how == STDOUT:
            theirs.append(os.dup(theirs[1]) if theirs[1] > 2 else theirs[1])
        else:
            theirs.append(os.dup(how if isinstance(how, int) else how.fileno()))
    return ours, theirs


def _wrap(fd: Optional[int], writing: bool, coding: Optional[tuple[str, str]]) -> Optional[IO[Any]]:
    """Our end of a pipe, as ``subprocess`` gives it: binary, or text (``coding``: encoding and
    errors) with universal newlines."""
    if fd is None:
        return None
    if coding is None:
        return os.fdopen(fd, "wb" if writing else "rb")
    encoding, errors = coding
    if writing:
        return io.TextIOWrapper(os.fdopen(fd, "wb"), encoding=encoding, errors=errors, write_through=True)
    return open(fd, encoding=encoding, errors=errors)


class _Reader(threading.Thread):
    """Reads one of the child's output streams to its end (``data``), then closes it."""

    def __init__(self, stream: IO[Any]) -> None:
        super().__init__(daemon=True)
        self.stream, self.data = stream, stream.read(0)
        self.start()

    def run(self) -> None:
        with self.stream:
            self.data = self.stream.read()


class _Server:
    """The client's side of the fork server: one per test session, started at the first use."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="onedist-pyfork-")
        self.path = os.path.join(self.dir, "server.sock")
        ready_r, ready_w = os.pipe()
        from launch_env import clean_env

        self.proc = subprocess.Popen(
            [sys.executable, __file__, self.path, str(ready_w), str(os.getpid())],
            env=clean_env("ONEDIST_", base=_SESSION_ENV),
            pass_fds=(ready_w,),
            stdin=subprocess.DEVNULL,
        )
        os.close(ready_w)
        with os.fdopen(ready_r, "rb") as ready:  # the server writes a byte once it listens
            if ready.read(1) != b"1":
                raise RuntimeError(f"pyfork: the fork server did not start (exit status {self.proc.wait()})")
        atexit.register(self.stop)

    def request(self, request: dict, fds: list[int]) -> socket.socket:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(self.path)
        socket.send_fds(conn, [json.dumps(request).encode()], fds)
        return conn

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait()
        for name in os.listdir(self.dir):
            os.unlink(os.path.join(self.dir, name))
        os.rmdir(self.dir)


#: the variables the server imports torch with: the session's at collection, not those of the test
#: that happens to start the first process (it may have set some for its own processes)
_SESSION_ENV = dict(os.environ)
_SERVER: Optional[_Server] = None
_SERVER_LOCK = threading.Lock()


def _server() -> _Server:
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is None or _SERVER.proc.poll() is not None:
            _SERVER = _Server()
        return _SERVER


# ==================================================================================== the server
def _serve(path: str, ready_fd: int, client: int) -> None:
    """Import torch once (one OpenMP thread while importing: a pool started now would make this
    process multi-threaded, and a fork of it unsafe), then fork a child per request, until the
    client (pytest) ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C ends pytest, which stops this server
    os.environ["OMP_NUM_THREADS"] = "1"
    import numpy  # noqa: F401
    import torch
    import torch._dynamo
    import torch.distributed  # noqa: F401

    del os.environ["OMP_NUM_THREADS"]
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        raise SystemExit(f"pyfork: the server runs {threads} threads after importing torch: no fork")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    os.write(ready_fd, b"1")
    os.close(ready_fd)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, the client's connection)
    while os.getppid() == client:
        for key, _ in selector.select(timeout=1.0):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                started = _start(conn, listener, selector, children)
                if started is not None:
                    pidfd = os.pidfd_open(started)
                    children[pidfd] = (started, conn)
                    selector.register(pidfd, selectors.EVENT_READ)
            else:
                pid, conn = children.pop(key.fd)
                selector.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                _send(conn, {"status": status})
                conn.close()


def _start(conn: socket.socket, listener: socket.socket, selector: Any, children: dict) -> Optional[int]:
    data, fds, _, _ = socket.recv_fds(conn, _MESSAGE_MAX, 3)
    request = json.loads(data)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for pidfd, (_, other) in children.items():
                os.close(pidfd)
                other.close()
            selector.close()
            listener.close()
            code = _become(request, fds, conn)
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    for fd in fds:
        os.close(fd)
    _send(conn, {"pid": pid})
    return pid


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.send(json.dumps(message).encode())
    except OSError:  # the client went away: nobody waits for this answer
        pass


def _become(request: dict, fds: list[int], conn: socket.socket) -> int:
    """In the child: the request's streams, session, directory and variables, Python's start-up
    state, then its program; its exit status. Its signals and its end are those of a worker that
    ``onedist run`` forks (``onedist.launchers.forked``, imported once the variables are set)."""
    conn.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    if request["new_session"]:
        os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _fresh_streams()
    _fresh_state()
    from onedist.errors import user_traceback
    from onedist.launchers.forked import _exit_as_python, _exit_code, _reset_signals

    _reset_signals(signal.pthread_sigmask(signal.SIG_BLOCK, ()))  # the mask as it is
    try:
        _run_program(request["argv"])
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException as e:
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        tb = user_traceback(tb)  # and bootstrap's and runpy's: the program's frames, as Python prints
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        if isinstance(e, KeyboardInterrupt):  # as Python ends on an uncaught Ctrl-C
            _exit_as_python(1)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        code = 1
    return _exit_as_python(code)


def _fresh_streams() -> None:
    """``sys.stdin``/``stdout``/``stderr`` on descriptors 0-2, line-buffered to a terminal and
    block-buffered otherwise, as a new interpreter has them (unbuffered with ``PYTHONUNBUFFERED``)."""
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        mode = "rb" if fd == 0 else "wb"
        raw = io.FileIO(fd, mode, closefd=False)
        buffered: Any = raw
        if not (unbuffered and fd):
            buffered = io.BufferedReader(raw) if fd == 0 else io.BufferedWriter(raw)
        stream = io.TextIOWrapper(
            buffered,
            encoding="utf-8",
            errors="backslashreplace" if fd == 2 else "strict",
            line_buffering=fd == 2 or os.isatty(fd),
            write_through=unbuffered or fd == 2,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _fresh_state() -> None:
    """What a new interpreter has and a fork would share with the server: torch's thread count
    (from ``OMP_NUM_THREADS``, else torch's default), the random states seeded from the OS, and
    ``sys.path`` with this ``PYTHONPATH`` (its first entry is set by :func:`_run_program`)."""
    import random

    import torch

    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # without it torch keeps one (see the docstring)
        torch.set_num_threads(int(threads))
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[1:] = [*extra, *(p for p in _BASE_PATH if p not in extra)]


def _run_program(argv: list[str]) -> None:
    """``python argv...`` in a new ``__main__``: a script or ``-m module`` as a worker ``onedist run``
    forks runs it (``onedist.launchers.bootstrap.run_target``), ``-c code`` here."""
    from onedist.launchers.bootstrap import run_target

    main = types.ModuleType("__main__")
    _REPLACED.append(sys.modules["__main__"])
    sys.modules["__main__"] = main  # what runpy puts back after `-m`, and the exit steps release
    if argv[0] == "-c":
        sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
        main.__dict__["__builtins__"] = __builtins__
        exec(compile(argv[1], "<string>", "exec", dont_inherit=True), main.__dict__)
        return
    if argv[0] == "-m":
        sys.path[0] = os.getcwd()  # as `python -m` sets it (run_target relies on it)
    run_target(argv)  # a script's own directory replaces sys.path[0] there


def _path_without_pythonpath() -> list[str]:
    """``sys.path[1:]`` of a new interpreter without ``PYTHONPATH`` (asked of one: ~30 ms): a child
    puts its own ``PYTHONPATH`` before it. Not this server's own path: a directory in both
    ``PYTHONPATH`` and a ``.pth`` file (an editable install) is in it only once, where
    ``PYTHONPATH`` put it."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = "import json, sys; print(json.dumps(sys.path[1:]))"
    found = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return list(json.loads(found.stdout))


_REPLACED: list[Any] = []  # the server's own __main__, kept while a child's program is __main__
_BASE_PATH: list[str] = []

if __name__ == "__main__":
    _BASE_PATH = _path_without_pythonpath()
    atexit._clear()
    _serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
