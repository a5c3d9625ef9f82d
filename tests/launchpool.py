"""Worker ranks started by a real launcher (``mpirun``, ``horovodrun``), shared by many checks.

:class:`distpool.DistPool` forks its ranks; this pool has a launcher start them instead, so the
launcher's own environment and process model are the ones tested. Each rank runs
``tests/scripts/pool_worker.py``: it calls ``od.initialize(backend)`` with nothing but what the
launcher set, connects back to this process (an authenticated socket on loopback) and runs the
module-level check functions it is sent. :meth:`LaunchPool.run` returns the per-rank results or
raises with every failing rank's traceback; a check that hangs fails after ``timeout`` seconds and
the pool is torn down (the launcher's process group is killed).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, Listener
from typing import Any, Optional

from distpool import CheckFailed, collect

_TESTS = os.path.dirname(os.path.abspath(__file__))
_WORKER = os.path.join(_TESTS, "scripts", "pool_worker.py")


class LaunchPool:
    """``world_size`` ranks started by ``cmd_prefix`` (e.g. ``["mpirun", "-np", "3"]``)."""

    def __init__(
        self,
        cmd_prefix: Sequence[str],
        world_size: int,
        backend: str,
        env: Optional[dict[str, str]] = None,
        python: str = sys.executable,
        start_timeout: float = 120.0,
    ) -> None:
        self.world_size = world_size
        self.backend = backend
        self.broken = False
        authkey = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=authkey)
        host, port = self._listener.address
        full_env = dict(os.environ)
        paths = [_TESTS, full_env.get("PYTHONPATH", "")]
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        full_env.update(env or {})
        self.cmd = [*cmd_prefix, python, _WORKER, host, str(port), authkey.hex(), backend]
        self._proc = subprocess.Popen(
            self.cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=full_env,
            start_new_session=True,  # one process group: close() kills the launcher and its ranks
        )
        self._output: list[str] = []
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        self.conns: list[Optional[Connection]] = [None] * world_size
        try:
            self._accept(start_timeout)
        except BaseException:
            self.close()
            raise

    def _drain(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self._output.append(line)

    def output(self) -> str:
        """What the launcher and its ranks printed so far (last 100 lines)."""
        return "".join(self._output[-100:])

    def _accept(self, timeout: float) -> None:
        accepted: list[Connection] = []
        failure: list[BaseException] = []

        def accept() -> None:
            try:
                for _ in range(self.world_size):
                    accepted.append(self._listener.accept())
            except BaseException as e:  # the listener closed by a timeout
                failure.append(e)

        t = threading.Thread(target=accept, daemon=True)
        t.start()
        deadline = time.monotonic() + timeout
        while t.is_alive() and time.monotonic() < deadline and self._proc.poll() is None:
            t.join(0.1)
        if len(accepted) < self.world_size:
            code = self._proc.poll()
            state = "running" if code is None else f"exited with {code}"
            raise CheckFailed(
                f"{' '.join(self.cmd)}: {len(accepted)} of {self.world_size} ranks connected "
                f"(launcher {state})\n{self.output()}"
            )
        for conn in accepted:
            status, value = conn.recv()
            if status != "ready":
                raise CheckFailed(f"a rank failed to initialise {self.backend!r}:\n{value}\n{self.output()}")
            self.conns[value] = conn
        if any(c is None for c in self.conns):
            raise CheckFailed(f"ranks reported duplicate ranks: {self.output()}")

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0) -> list[Any]:
        """``fn(*args)`` on every rank; the per-rank results in rank order."""
        if self.broken:
            raise CheckFailed("pool is broken")
        conns = [c for c in self.conns if c is not None]
        for c in conns:
            c.send((fn, args))
        return collect(fn, conns, timeout, self.close, died=lambda r: f"rank {r} died\n{self.output()}")

    def close(self) -> None:
        """Stop the ranks (cleanly when they answer, else by killing the launcher's process group)."""
        self.broken = True
        for c in self.conns:
            if c is not None:
                try:
                    c.send(None)
                except OSError:
                    pass
        try:
            self._proc.wait(15)
        except subprocess.TimeoutExpired:
            pass
        if self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._proc.wait()
        for c in self.conns:
            if c is not None:
                c.close()
        self._listener.close()
