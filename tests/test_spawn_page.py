"""What docs/launchers/spawn.md (and the loader-worker note of docs/training.md) say `spawn` and
`Parallel` do, that no other test checks: Ctrl-C's report of a worker busy outside Python, the
fork server ending with the program, and the world a DataLoader worker of a spawned worker sees.

This module is imported by the "spawn" workers (and their loader workers) to unpickle what they
run: it imports nothing heavy at its top."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

import onedist as od
from launch_env import clean_env

pytestmark = pytest.mark.launcher


# ============================================================================ Ctrl-C
BUSY_IN_C = """
import os, sys, time
import torch
import onedist as od


def training(local_rank, out):
    torch.set_num_threads(1)
    od.barrier()
    with open(os.path.join(out, f"{od.get_rank()}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if od.get_rank() == 1:
        # one call into torch's C++ code that lasts far longer than the test (62 products of
        # 2000 x 2000 matrices): no Python runs until it returns, so Ctrl-C cannot interrupt it
        torch.linalg.matrix_power(torch.ones(2000, 2000), 2**62)
    while True:  # rank 0 waits in Python
        time.sleep(0.05)


if __name__ == "__main__":
    with od.Parallel(backend="gloo", nproc_per_node=2, start_method="fork") as parallel:
        parallel.run(training, sys.argv[1])
"""


def test_ctrl_c_lists_a_worker_busy_outside_python_as_such_and_stops_it(tmp_path):
    """Ctrl-C (SIGINT to the process group): rank 0, in Python, reports its traceback; rank 1,
    inside one long torch call, cannot, and is listed as "(no traceback: busy outside Python,
    stopped)" once its 2 s are over; both are gone, and the parent raises KeyboardInterrupt."""
    from run_helpers import start_looping

    script = tmp_path / "busy.py"
    script.write_text(BUSY_IN_C)
    proc, pids = start_looping([sys.executable, str(script), str(tmp_path)], tmp_path, 2, settle=0.3)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGINT, err
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    report = err[err.index("onedist.spawn: interrupted; where each worker was:\n") :]
    assert "[rank0]: KeyboardInterrupt\n" in report and f'[rank0]:   File "{script}", line ' in report, report
    assert "[rank1]: (no traceback: busy outside Python, stopped)\n" in report, report
    assert not any(
        line.startswith("[rank1]: ") and "busy outside Python" not in line for line in report.splitlines()
    )


# ============================================================================ forkserver
FORKSERVER = """
import os
import onedist as od


def parents(local_rank):
    server = os.getppid()  # a "forkserver" worker's parent: the fork server
    with open(f"/proc/{server}/stat") as f:
        return server, int(f.read().rsplit(")", 1)[1].split()[1])  # and the server's parent


if __name__ == "__main__":
    found = od.spawn("gloo", parents, nproc_per_node=2, start_method="forkserver")
    print(os.getpid(), *(pid for pair in found for pid in pair), flush=True)
"""


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as ended: its new parent may never reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_the_fork_server_exits_with_the_program(tmp_path):
    """`spawn(..., start_method="forkserver")`: the workers are children of one fork server, a child
    of the program; once the program has exited, the server is gone too (within 5 s)."""
    script = tmp_path / "forkserver.py"
    script.write_text(FORKSERVER)
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with out.open("w") as stdout, err.open("w") as stderr:  # files: the server holds no pipe to wait for
        code = subprocess.run(
            [sys.executable, str(script)],
            stdout=stdout,
            stderr=stderr,
            timeout=240,
            env=clean_env(),
            cwd=tmp_path,
        ).returncode
    assert code == 0, err.read_text()
    program, server, its_parent, server_again, its_parent_again = map(int, out.read_text().split())
    assert server == server_again and its_parent == its_parent_again == program, out.read_text()
    deadline = time.monotonic() + 5.0
    while _running(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _running(server)
    if left:  # only when it is still the server (its parent was the program): a pid may be reused
        with open(f"/proc/{server}/cmdline", "rb") as f:
            if b"forkserver" in f.read():
                os.kill(server, signal.SIGKILL)
    assert not left, f"the fork server {server} outlived the program {program}"


# ============================================================================ loader workers
class WorkerView:
    """A dataset of one item: what the loader worker that reads it sees."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> dict:
        return {
            "world_size": od.get_world_size(),
            "start_method": multiprocessing.get_start_method(),
            "pid": os.getpid(),
            "parent": os.getppid(),
        }


def loader_view(local_rank: int) -> dict:
    """On rank 0, a DataLoader with one worker process reads WorkerView; both ranks count themselves."""
    import torch

    view = None
    if od.get_rank() == 0:
        view = next(iter(torch.utils.data.DataLoader(WorkerView(), batch_size=None, num_workers=1)))
    return {"view": view, "pid": os.getpid(), "world_size": od.get_world_size(), "sum": od.all_reduce(1)}


def test_loader_workers_of_a_spawned_worker_are_spawned_and_see_world_size_1():
    """Under `Parallel` (its default "spawn" workers), a DataLoader's worker is a fresh process
    started with "spawn" too, without the process group: `od.get_world_size()` is 1 there."""
    with od.Parallel(backend="gloo", nproc_per_node=2) as parallel:
        out = parallel.run(loader_view)  # local rank 0's
    assert (out["world_size"], out["sum"]) == (2, 2), out
    view = out["view"]
    assert view["world_size"] == 1 and view["start_method"] == "spawn", view
    assert view["parent"] == out["pid"] != view["pid"], (view, out)
