"""A pool of real gloo worker processes, shared by the tests of one world size.

Each worker initialises onedist with ``init_method="tcp://..."`` and an explicit rank and world
size, and no launcher variables (LOCAL_RANK, ...) in its environment, so the layout queries are
answered from what the ranks published, not from the environment. A check is a module-level
function; :meth:`DistPool.run` calls it on every rank and returns the per-rank results, or raises
with every failing rank's traceback. A check that hangs is a failure: the pool is killed after
``timeout`` seconds and a fresh one is made for the next test, as after any failed check.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from typing import Any, Optional

from launch_env import strip_launcher_vars
from onedist._net import free_port

_CTX = mp.get_context("fork")  # workers start in ~0.1 s instead of re-importing torch


def _serve(rank: int, world_size: int, port: int, conn: Any, backend: str, env: dict[str, str]) -> None:
    import torch

    import onedist as od

    torch.set_num_threads(1)  # forked after the parent may have used OpenMP (libgomp would hang)

    strip_launcher_vars()
    os.environ.update(env)
    if "ONEDIST_DEBUG" in env:  # read once, where onedist's state is first made: maybe in the parent
        od.set_debug(env["ONEDIST_DEBUG"] == "1")
    od.initialize(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=120
    )
    serve(conn)
    od.finalize()
    conn.close()


def serve(conn: Any) -> None:
    """A rank's side of a pool: run each ``(fn, args)`` received, send back its result or its
    traceback, until ``None`` arrives."""
    while True:
        msg = conn.recv()
        if msg is None:
            break
        fn, args = msg
        try:
            conn.send(("ok", fn(*args)))
        except BaseException:
            conn.send(("err", traceback.format_exc()))


def collect(
    fn: Callable[..., Any],
    conns: list[Any],
    timeout: float,
    on_hang: Callable[[], None],
    died: Callable[[int], str] = lambda r: f"rank {r} died",
) -> list[Any]:
    """The results of ``fn`` from every rank's connection, in rank order, or CheckFailed with every
    failing rank's traceback. Once a rank failed, the others get 5 s more; a rank that does not
    answer in time counts as hung (``on_hang`` then tears the pool down)."""
    world_size = len(conns)
    results: list[Any] = [None] * world_size
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    pending = set(range(world_size))
    first_error = 0.0
    while pending:
        limit = deadline if not errors else min(deadline, first_error + 5.0)
        progressed = False
        for r in sorted(pending):
            try:
                ready = conns[r].poll(0.01)
                status, value = conns[r].recv() if ready else (None, None)
            except (EOFError, OSError):
                ready, status, value = True, "err", died(r)
            if ready:
                pending.discard(r)
                progressed = True
                if status == "ok":
                    results[r] = value
                else:
                    first_error = first_error or time.monotonic()
                    errors[r] = value
        if not progressed and time.monotonic() > limit:
            on_hang()
            for r in pending:
                errors[r] = f"rank {r} did not finish within the time limit (hung)"
            break
    if errors:
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise CheckFailed(f"{fn.__name__} failed on ranks {sorted(errors)}:\n{text}")
    return results


class CheckFailed(AssertionError):
    pass


class DistPool:
    def __init__(
        self,
        world_size: int,
        backend: str = "gloo",
        env: Optional[dict[str, str]] = None,
        rank_env: Optional[list[dict[str, str]]] = None,
    ) -> None:
        self.world_size = world_size
        self.backend = backend
        port = free_port()
        self.conns = []
        self.procs = []
        for rank in range(world_size):
            parent, child = _CTX.Pipe()
            p = _CTX.Process(
                target=_serve,
                args=(
                    rank,
                    world_size,
                    port,
                    child,
                    backend,
                    {**(env or {}), **(rank_env or [{}] * world_size)[rank]},
                ),
                daemon=True,
            )
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        self.broken = False

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0) -> list[Any]:
        if self.broken:
            raise CheckFailed("pool is broken")
        for c in self.conns:
            c.send((fn, args))
        try:
            return collect(fn, self.conns, timeout, self.kill)
        except CheckFailed:
            # a failed check may leave the group unusable (a stall verdict breaks its calls): the
            # next test gets a fresh pool, not the same failure again (one failing check once
            # failed every later check of its world size)
            self.close()
            raise

    def close(self) -> None:
        """Ask each worker to end; those still there 2 s later (all together) are killed."""
        self.broken = True
        for c in self.conns:
            try:
                c.send(None)
            except (OSError, BrokenPipeError):
                pass
        deadline = time.monotonic() + 2.0
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """End every worker now: a hung worker never reads the request to end (it waited 2 s
        each)."""
        self.broken = True
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join()
