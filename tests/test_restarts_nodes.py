"""`onedist run --nnodes 2 --max-restarts N` for real: the nodes' launchers agree on each restart
through node 0's store. Two launchers on 127.0.0.1 for the protocol (restart together, the limit,
a launcher that vanishes, flags that differ), and the digits training over two network-namespace
hosts with a worker SIGKILLed: both nodes resume to weights bit-identical to an uninterrupted run."""

from __future__ import annotations

import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from subprocess import PIPE

import pytest

from launch_env import clean_env
from run_helpers import onedist_command, outputs
from test_netns import hosts, needs_netns  # noqa: F401  (hosts: the namespace hosts fixture)
from test_restarts import (
    EVERY,
    FAILS_ON_THE_FIRST_ATTEMPT,
    RUN_READS_ENVIRON,
    Run,
    _digits,
    bind_check,
    check_restart_reported,
    check_same_weights,
    uninterrupted,  # noqa: F401  (the fixture: the reference weights)
)

pytestmark = [pytest.mark.launcher, pytest.mark.slow]

SLEEPS = """
import time, onedist as od
od.initialize("gloo")
print(f"up {od.get_rank()}", flush=True)
time.sleep(60)
"""


def _free_port() -> int:
    import onedist._net as net

    return net.free_port()


def _nodes(script: Path, *args: str, max_restarts: tuple[int, int] = (2, 2)) -> list[subprocess.Popen]:
    """Two launchers on this host, one process each, nodes 0 and 1 of one job."""
    port = str(_free_port())
    procs = []
    for k in (0, 1):
        flags = ["--nnodes", "2", "-n", "1", "--node-rank", str(k), "--master-port", port]
        cmd = onedist_command(*flags, "--max-restarts", str(max_restarts[k]), str(script), *args)
        procs.append(subprocess.Popen(cmd, stdout=PIPE, stderr=PIPE, text=True, env=clean_env()))
    return procs


@pytest.mark.parametrize("fails, max_restarts, code", [(1, 2, 0), (3, 1, 1)])
def test_two_nodes_restart_together(fails, max_restarts, code, tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(FAILS_ON_THE_FIRST_ATTEMPT)
    procs = _nodes(script, str(fails), max_restarts=(max_restarts, max_restarts))
    outs = outputs(procs)
    assert [p.returncode for p in procs] == [code, code], outs
    attempts = min(fails, max_restarts) + 1
    for k, (out, err) in enumerate(outs):  # every node ran every attempt, and said why it restarted
        assert [f"[rank{k}]: attempt {a} rank {k}" for a in range(attempts)] == re.findall(
            rf"\[rank{k}\]: attempt \d rank {k}", out
        ), out
        lines = re.findall(r"onedist run: rank 1 failed \(ValueError: rank 1 fails on purpose\); .*", err)
        assert len(lines) == attempts - 1, err
    if code:  # node 1's failure, in full there and named on node 0
        assert "onedist run: worker rank 1 (local rank 0" in outs[1][1]
        named = r"on node 1, rank 1 .* ValueError: rank 1 fails on purpose; no restart is left"
        assert re.search(named, outs[0][1]), outs[0][1]


def _sleeping_nodes(tmp_path: Path) -> list[subprocess.Popen]:
    """Two launchers whose workers initialised and sleep (node 1's said so)."""
    script = tmp_path / "sleeps.py"
    script.write_text(SLEEPS)
    procs = _nodes(script)
    deadline = time.monotonic() + 120
    while procs[1].stdout.readline().strip() != "[rank1]: up 1":
        if time.monotonic() > deadline or procs[1].poll() is not None:
            for p in procs:
                p.kill()
            pytest.fail(f"node 1's worker did not start: {[p.communicate() for p in procs]}")
    return procs


def test_a_vanished_launcher_ends_the_job_on_the_other_node(tmp_path):
    procs = _sleeping_nodes(tmp_path)
    procs[1].kill()  # node 1's launcher: its worker dies with it
    killed_at = time.monotonic()
    [(_, err), _] = outputs(procs, timeout=60)
    took = time.monotonic() - killed_at
    assert procs[0].returncode == 1, err
    assert "node 1's launcher has not answered for 5 s while this node ran attempt 0" in err, err
    assert took < 15, took
    print(f"node 0 ended {took:.1f} s after node 1's launcher was killed")


def test_nodes_given_different_max_restarts_refuse_to_start(tmp_path):
    script = tmp_path / "sleeps.py"
    script.write_text(SLEEPS)
    procs = _nodes(script, max_restarts=(2, 3))
    outs = outputs(procs)
    assert [p.returncode for p in procs] == [1, 1], outs
    message = "--max-restarts=3 on node 1 differs from node 0's --max-restarts=2; allowed: the same"
    assert all(message in err for _, err in outs), outs
    assert not any("up" in out for out, _ in outs)


@needs_netns
def test_a_killed_worker_on_two_namespace_hosts_resumes_to_bit_identical_weights(
    hosts,  # noqa: F811
    uninterrupted,  # noqa: F811
    tmp_path,
):
    """2 nodes x 1 worker, over a veth between two network namespaces: the same 2 ranks, the same
    sums, so the same weights as the one-node run."""
    seed = 3
    kill_after = random.Random(seed).randrange(EVERY, 70, EVERY)
    victim = seed % 2  # rank 1: node B's worker, so node B's launcher asks node A for the restart
    ckpt, final = tmp_path / "ckpt", tmp_path / "final.pt"
    port = str(_free_port())
    cmd = ["--nnodes", "2", "-n", "1", "--master-addr", "nodeA", "--master-port", port]
    run = Run(
        [
            # one thread per worker, as `-n 2` gives each on one node: the same arithmetic
            hosts(
                node,
                [
                    "env",
                    "OMP_NUM_THREADS=1",
                    *_digits(ckpt, final, *cmd, "--node-rank", str(k), start_method=RUN_READS_ENVIRON),
                ],
            )
            for k, node in enumerate(("nodeA", "nodeB"))
        ],
        ckpt,
    )
    run.kill(kill_after, victim)
    outs = run.finish()
    assert [p.returncode for p in run.procs] == [0, 0], [(o[-2000:], e[-3000:]) for o, e in outs]
    for _, err in outs:  # both nodes report the restart of rank 1 (rank 0, on node A, resumed)
        check_restart_reported(err, victim, outs[0][0], kill_after)
    check_same_weights(final, uninterrupted)
    ports = run.check_nothing_left() | {int(port)}
    free = hosts("nodeA", [sys.executable, "-c", bind_check(ports)])  # the ports listened on node A
    assert free.communicate(timeout=60)[0] == "free\n"
    assert run.restarted_at is not None
    print(f"two hosts: kill after step {kill_after} (rank {victim}), new workers "
          f"{run.restarted_at - run.killed_at:.2f} s after the kill, "
          f"{run.ended_at - run.killed_at:.1f} s from the kill to the end")  # fmt: skip


def test_sigterm_to_one_node_ends_the_job_without_restart(tmp_path):
    procs = _sleeping_nodes(tmp_path)
    procs[1].send_signal(signal.SIGTERM)
    outs = outputs(procs, timeout=60)
    assert [p.returncode for p in procs] == [1, 128 + signal.SIGTERM], outs
    assert "node 1's launcher was stopped by SIGTERM; the job ends, no restart" in outs[0][1]
    assert not any("restarting" in err for _, err in outs)
