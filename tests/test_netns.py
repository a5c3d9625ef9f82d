"""Two "hosts" on one machine: network namespaces with their own hostnames, addresses and /etc/hosts.

Nothing but a veth pair (or a bridge) joins them, so every byte between the nodes really crosses a
network, and 127.0.0.1 on one node is not the other node: a multi-node bug (a loopback master, a
wrong interface) hangs or fails here exactly as on a cluster. Needs root, iproute2 and util-linux.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from launch_env import clean_env
from run_helpers import AGREE_SCRIPT, check_agree, infos, onedist_command, outputs

CLUSTER = Path(__file__).parent / "cluster"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))

#: the tests that run on namespace hosts (the ``hosts`` fixture also skips when ``ip netns`` fails)
needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("ip", "nsenter", "unshare")),
    reason="needs root, iproute2 (ip) and util-linux (nsenter, unshare) for network namespaces",
)
pytestmark = [pytest.mark.launcher, needs_netns]

_ID = os.getpid() % 10000
_SUBNET = 100 + os.getpid() % 50  # 10.<subnet>.0.0/16 (and 10.<subnet + 50>...), private to these namespaces


@pytest.fixture(scope="module")
def hosts():
    prefix = f"od{_ID}"
    work = Path(tempfile.mkdtemp(prefix="onedist-netns-"))
    try:
        up = subprocess.run(
            ["bash", str(CLUSTER / "netns_hosts.sh"), "up", prefix, str(_SUBNET), str(work)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if up.returncode != 0:  # a container without CAP_SYS_ADMIN / CAP_NET_ADMIN, say
            pytest.skip(f"`ip netns` is not usable here: {up.stderr.strip()[-300:]}")

        def on(node: str, cmd: list[str], **kw) -> subprocess.Popen:
            ns = f"{prefix}{node[-1]}"  # nodeA -> <prefix>A
            return subprocess.Popen(
                ["bash", str(CLUSTER / "netns_exec.sh"), ns, node, str(work / "hosts"), *cmd],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=clean_env(),
                **kw,
            )

        yield on
    finally:
        subprocess.run(["bash", str(CLUSTER / "netns_hosts.sh"), "down", prefix], timeout=60)
        shutil.rmtree(work, ignore_errors=True)


def _both(procs: list[subprocess.Popen]) -> None:
    outs = outputs(procs, timeout=240)
    assert all(p.returncode == 0 for p in procs), outs


def _check_hosts(out: Path, hostnames: list[str]) -> None:
    assert [i["hostname"] for i in infos(out, len(hostnames))] == hostnames


def test_torchrun_pair_on_two_hosts(hosts, tmp_path):
    """Two torchrun agents, one per namespace host; the master is named by hostname (/etc/hosts)."""
    cmd = ["--nnodes", "2", "--nproc-per-node", "2", "--master-addr", "nodeA", "--master-port", "29531"]
    _both(
        [
            hosts(node, [TORCHRUN, *cmd, "--node-rank", str(k), AGREE_SCRIPT, str(tmp_path)])
            for k, node in enumerate(("nodeA", "nodeB"))
        ]
    )
    check_agree(tmp_path, 4, nnodes=2)
    _check_hosts(tmp_path, ["nodeA", "nodeA", "nodeB", "nodeB"])


def test_onedist_run_pair_on_two_hosts(hosts, tmp_path):
    cmd = ["--nnodes", "2", "-n", "2", "--master-addr", "nodeA", "--master-port", "29532"]
    _both(
        [
            hosts(node, [*onedist_command(*cmd, "--node-rank", str(k)), AGREE_SCRIPT, str(tmp_path)])
            for k, node in enumerate(("nodeA", "nodeB"))
        ]
    )
    check_agree(tmp_path, 4, nnodes=2)
    _check_hosts(tmp_path, ["nodeA", "nodeA", "nodeB", "nodeB"])


def test_shm_two_hosts_is_hierarchical(hosts, tmp_path):
    """backend shm over two namespace hosts: shared memory within each, gloo across the veth."""
    cmd = ["--nnodes", "2", "-n", "2", "--master-addr", "nodeA", "--master-port", "29533"]
    _both(
        [
            hosts(
                node,
                [
                    "env",
                    "AGREE_BACKEND=shm",
                    *onedist_command(*cmd, "--node-rank", str(k)),
                    AGREE_SCRIPT,
                    str(tmp_path),
                ],
            )
            for k, node in enumerate(("nodeA", "nodeB"))
        ]
    )
    got = check_agree(tmp_path, 4, nnodes=2)
    assert all(i["backend"] == "shm" and i["shm_hosts"] == [[0, 1], [2, 3]] for i in got), got
    assert all(i["shm_sum_ok"] and i["shm_broadcast_ok"] for i in got), got


# ---------------------------------------------------------------- a real 2-node SLURM
@pytest.fixture(scope="module")
def slurm2():
    if shutil.which("slurmctld") is None or shutil.which("munged") is None:
        pytest.skip("needs SLURM (slurm-wlm) and munge")
    prefix = f"os{_ID}"
    state = Path(tempfile.mkdtemp(prefix="onedist-slurm2-"))
    os.chmod(state, 0o755)  # munged runs as the munge user
    script = str(CLUSTER / "slurm_2node_netns.sh")
    try:
        subprocess.run(
            ["bash", script, "up", prefix, str(_SUBNET + 50), str(state)],
            check=True,
            capture_output=True,
            timeout=120,
        )
        ctl = (state / "slurmctld.pid").read_text().strip()

        def client(cmd: list[str]) -> subprocess.CompletedProcess:
            # SLURM clients run on the "ctl" host: its network, hostname and /etc/hosts
            return subprocess.run(
                ["nsenter", "-t", ctl, "-n", "-u", "-m", "env", f"SLURM_CONF={state / 'slurm.conf'}", *cmd],
                capture_output=True,
                text=True,
                timeout=240,
                env=clean_env(),
            )

        yield client
    finally:
        subprocess.run(["bash", script, "down", prefix, str(state)], timeout=120)
        shutil.rmtree(state, ignore_errors=True)


@pytest.mark.parametrize("via", ["python", "onedist run"])
def test_slurm_srun_two_nodes_four_tasks(slurm2, via, tmp_path):
    runner = [sys.executable] if via == "python" else onedist_command()
    proc = slurm2(["srun", "-N2", "-n4", "--overcommit", *runner, AGREE_SCRIPT, str(tmp_path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check_agree(tmp_path, 4, nnodes=2)
    _check_hosts(tmp_path, ["node1", "node1", "node2", "node2"])


def test_slurm_srun_uneven_two_nodes_three_tasks(slurm2, tmp_path):
    """srun -N2 -n3 puts 2 tasks on node1 and 1 on node2: the layout is exact, from SLURM's variables."""
    proc = slurm2(["srun", "-N2", "-n3", "--overcommit", sys.executable, AGREE_SCRIPT, str(tmp_path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = infos(tmp_path, 3)
    assert [i["hostname"] for i in got] == ["node1", "node1", "node2"]
    assert [i["local_rank"] for i in got] == [0, 1, 0]
    assert [i["node_rank"] for i in got] == [0, 0, 1]
    assert [i["nproc_per_node"] for i in got] == [2, 2, 1]
    assert all(i["nnodes"] == 2 and i["world_size"] == 3 and i["sum"] == 3 for i in got)
