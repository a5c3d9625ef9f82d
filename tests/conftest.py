from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import pytest

from bytecode import write_bytecode
from distpool import DistPool

# Test this checkout, whatever `pip install -e` points at (another clone, a CI copy): in this process
# (pyproject's pythonpath) and in every process the tests start (PYTHONPATH is inherited).
_SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_SRC, os.environ.get("PYTHONPATH")) if p)

# A shell's background job without job control (`cmd &` in a script) starts with SIGINT ignored,
# and every process a test starts would inherit that: the tests that stop their workers with
# Ctrl-C would wait for ever. A handler is reset to the default in a child, so they get SIGINT.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

WORLDS = ["serial", 1, 2, 3, 4]


def pytest_sessionstart(session: pytest.Session) -> None:
    # before any test starts a process: the sources' and the tests' bytecode (see bytecode.py)
    write_bytecode(Path(_SRC), Path(__file__).resolve().parent)


#: what a worker process that torchrun started sees (local rank 0 of 2 on one node)
TORCHRUN_WORKER_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                       "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555",
                       "TORCHELASTIC_RUN_ID": "test"}  # fmt: skip

_pools: dict[tuple[Any, ...], DistPool] = {}


def _pool(world_size: int, backend: str = "gloo", env: Optional[dict[str, str]] = None) -> DistPool:
    if env is None and backend == "shm":
        env = {"ONEDIST_SHM_CHUNK_MB": "0.0625"}  # 64 KiB slots: small tensors cross chunk boundaries
    key = (world_size, backend, tuple(sorted((env or {}).items())))
    pool = _pools.get(key)
    if pool is None or pool.broken:
        pool = _pools[key] = DistPool(world_size, backend, env)
    return pool


@pytest.fixture(scope="session", autouse=True)
def _close_pools():
    yield
    for pool in _pools.values():
        pool.close()


class Runner:
    """Runs a check on every rank of a world: in this process ("serial") or in a shared pool."""

    def __init__(self, world: Any, backend: str = "gloo", env: Optional[dict[str, str]] = None) -> None:
        self.world = world
        self.world_size = 1 if world == "serial" else int(world)
        self.backend = backend
        self.env = env

    def __call__(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0) -> list[Any]:
        if self.world == "serial":
            return [fn(*args)]
        return _pool(self.world_size, self.backend, self.env).run(fn, *args, timeout=timeout)

    def __repr__(self) -> str:
        return f"Runner({self.world}, {self.backend})"


@pytest.fixture(params=WORLDS, ids=lambda w: "serial" if w == "serial" else f"ws{w}")
def world(request: pytest.FixtureRequest) -> Runner:
    return Runner(request.param)


@pytest.fixture(params=[2, 3], ids=lambda w: f"ws{w}")
def multi(request: pytest.FixtureRequest) -> Runner:
    """Only world sizes where ranks really differ."""
    return Runner(request.param)


def _training_worlds() -> list[tuple[Any, str]]:
    from onedist.backends.shm import supported

    worlds: list[tuple[Any, str]] = [("serial", "gloo"), (1, "gloo"), (2, "gloo"), (3, "gloo")]
    return worlds + ([(2, "shm"), (3, "shm")] if supported() else [])


@pytest.fixture(params=_training_worlds(), ids=lambda p: "serial" if p[0] == "serial" else f"{p[1]}-ws{p[0]}")
def training_world(request: pytest.FixtureRequest) -> Runner:
    """The training layer's checks: serially, gloo at 1-3 ranks, shm at 2 and 3 (the global
    batches of checks_loop and checks_sharding divide by 1, 2 and 3)."""
    world, backend = request.param
    return Runner(world, backend)


@pytest.fixture(autouse=True)
def _restore_environ():
    before = dict(os.environ)
    yield
    for key in set(os.environ) - set(before):
        del os.environ[key]
    for key, value in before.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
