"""The supervisor's watch with real child processes: a worker that dies at any moment is seen."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

from onedist.launchers.supervisor import ProcessWorker, Supervisor


def test_a_worker_killed_between_the_failure_check_and_the_wait_is_seen():
    """Rank 1 is SIGKILLed right after the supervisor read the failures and before it waits (the
    worst moment): the watch still sees it and stops rank 0. It used to wait only on the workers
    still running when its wait began, so a rank killed in between was never waited on and the
    job hung (found as a killed-save test that hung in 2 of 6 runs under pytest)."""
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]  # write ends kept open here: never readable
    children = [ctx.Process(target=time.sleep, args=(60,), daemon=True) for _ in range(2)]
    for child in children:
        child.start()
    workers = [ProcessWorker(rank, rank, child, pipes[rank][0]) for rank, child in enumerate(children)]
    supervisor = Supervisor(workers)
    read_failures = supervisor.poll_failures

    def poll_then_kill_rank_1() -> object:
        seen = read_failures()
        if children[1].is_alive():
            os.kill(children[1].pid, signal.SIGKILL)
            children[1].join(10)  # gone before the supervisor lists who runs
        return seen

    supervisor.poll_failures = poll_then_kill_rank_1  # type: ignore[method-assign]
    found: list[object] = []
    watch = threading.Thread(target=lambda: found.append(supervisor.watch()), daemon=True)
    watch.start()
    watch.join(20)
    hung = watch.is_alive()
    for child in children:
        if child.is_alive():
            child.kill()
    assert not hung, "the watch did not see rank 1's death"
    failures = found[0]
    assert [(f.rank, f.exitcode) for f in failures if not f.stopped] == [(1, -signal.SIGKILL)], failures
    assert [f.rank for f in failures if f.stopped] == [0], failures
    supervisor.close()
