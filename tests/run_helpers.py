"""Helpers of the tests that run `onedist run` and the external launchers on tests/scripts/agree.py
(test_run.py and the tests of the launchers, clusters and failures that reuse them).

Not a test module: it imports nothing heavy (no torch, no onedist), so that a module of spawned
workers may import it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from launch_env import clean_env

__all__ = [
    "AGREE_SCRIPT",
    "check_agree",
    "infos",
    "onedist_command",
    "outputs",
    "run_together",
    "start_looping",
]

Job = TypeVar("Job")
Result = TypeVar("Result")

#: each rank writes OUT/<rank>.json (its rank, layout and a collective's result): see check_agree
AGREE_SCRIPT = str(Path(__file__).parent / "scripts" / "agree.py")


def onedist_command(*args: str) -> list[str]:
    """``onedist run ARGS`` with this Python."""
    return [sys.executable, "-m", "onedist", "run", *args]


def outputs(procs: list[subprocess.Popen], timeout: float = 120) -> list[tuple[str, str]]:
    """Each process's (stdout, stderr) once it ended; any still running after ``timeout`` (or on
    an error) is killed, so a hung launcher cannot outlive its test."""
    try:
        return [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def infos(out: Path, n: int) -> list[dict]:
    """What ranks 0..n-1 of AGREE_SCRIPT wrote to ``out``."""
    return [json.loads((out / f"{r}.json").read_text()) for r in range(n)]


def check_agree(out: Path, n: int, nnodes: int = 1) -> list[dict]:
    """AGREE_SCRIPT's n ranks on ``nnodes`` nodes of n // nnodes ranks each agreed on their ranks
    and layout; what they wrote."""
    got = infos(out, n)
    assert [i["rank"] for i in got] == list(range(n))
    assert all(i["world_size"] == n and i["sum"] == n and i["ranks"] == list(range(n)) for i in got)
    per_node = n // nnodes
    assert [i["local_rank"] for i in got] == [r % per_node for r in range(n)]
    assert [i["local_rank_arg"] for i in got] == [r % per_node for r in range(n)]
    assert [i["node_rank"] for i in got] == [r // per_node for r in range(n)]
    assert all(i["nproc_per_node"] == per_node and i["nnodes"] == nnodes for i in got)
    return got


def start_looping(cmd: list[str], out: Path, n: int, settle: float) -> tuple[subprocess.Popen, list[int]]:
    """Start ``cmd`` in a process group of its own, as a shell's foreground job is, wait until its
    ``n`` ranks have written ``out/<rank>.pid`` (they then loop in collectives), then ``settle``
    seconds more; its process and the ranks' pids."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
        start_new_session=True,
    )
    deadline = time.time() + 120
    while not all((out / f"{r}.pid").exists() for r in range(n)):
        assert time.time() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    time.sleep(settle)
    return proc, [int((out / f"{r}.pid").read_text()) for r in range(n)]


def run_together(
    names: Iterable[str], start: Callable[[str], Job], finish: Callable[[Job], Result], at_once: int
) -> dict[str, Result]:
    """``start(name)`` for each name, at most ``at_once`` jobs running (jobs that mostly wait:
    each keeps its own clock); name -> ``finish(job)``, which waits for it. Finished in the order
    started."""
    results: dict[str, Result] = {}
    pending = list(names)
    running: list[tuple[str, Job]] = []
    while pending or running:
        while pending and len(running) < at_once:
            name = pending.pop(0)
            running.append((name, start(name)))
        name, job = running.pop(0)
        results[name] = finish(job)
    return results
