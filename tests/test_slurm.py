"""A real one-node SLURM (munged, slurmctld, slurmd started by the test): srun and sbatch."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from launch_env import clean_env
from run_helpers import AGREE_SCRIPT, check_agree, onedist_command
from test_launch import _facts

CLUSTER = Path(__file__).parent / "cluster"
FAILING_RANK = str(Path(__file__).parent / "scripts" / "launchpage_failing_rank.py")

pytestmark = [
    pytest.mark.launcher,
    pytest.mark.skipif(
        shutil.which("slurmctld") is None or shutil.which("munged") is None or os.geteuid() != 0,
        reason="needs SLURM (slurm-wlm, munge) and root to start its daemons",
    ),
]


def _free_port_pair() -> int:
    """A port ``p`` where ``p`` and ``p + 1`` are both free (slurmctld listens on ``p``, slurmd on
    ``p + 1``), below the kernel's range of ephemeral ports. A port the OS picked is in that range,
    and so is ``p + 1``: any outgoing connection of the suite may take it as its local port before
    slurmd binds it ("Unable to bind listen port", one full run)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = range(min(20000, low - 200), low - 1)  # p + 1 < low too
    candidates = random.Random().sample(ports, 100)
    for p in candidates:
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("0.0.0.0", p))
                b.bind(("0.0.0.0", p + 1))
        except OSError:
            continue
        return p
    raise RuntimeError(f"no two free ports next to each other among {len(candidates)} tried")


@pytest.fixture(scope="module")
def slurm():
    # not under pytest's tmp dir: munged runs as the munge user and must reach its socket
    state = Path(tempfile.mkdtemp(prefix="onedist-slurm-"))
    os.chmod(state, 0o755)
    port = _free_port_pair()
    try:
        started = subprocess.run(
            ["bash", str(CLUSTER / "slurm_1node.sh"), str(state), str(port)],
            timeout=120,
            capture_output=True,
            text=True,
        )
        if started.returncode != 0:  # say why: the daemons' own words and their logs
            logs = "".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(state.glob("*.log")))
            why = started.stderr[-3000:]
            pytest.fail(f"the 1-node SLURM did not start (exit {started.returncode}):\n{why}\n{logs}")
        yield clean_env(SLURM_CONF=str(state / "slurm.conf"))
    finally:
        subprocess.run(["bash", str(CLUSTER / "slurm_stop.sh"), str(state)], timeout=60)
        shutil.rmtree(state, ignore_errors=True)


@pytest.mark.parametrize("via, n", [("python", 2), ("onedist run", 3)])
def test_srun(slurm, via, n, tmp_path):
    runner = [sys.executable] if via == "python" else onedist_command()
    proc = subprocess.run(
        ["srun", "-N1", f"-n{n}", "--overcommit", *runner, AGREE_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=slurm,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check_agree(tmp_path, n)


def test_srun_monitored_loop_writes_the_serial_runs_csv_with_one_progress_stream(slurm, tmp_path):
    """od.progress, od.Throughput and od.log_metrics under srun -n 2 (tests/scripts/monitored.py):
    the CSV equals the serial run's, and only task 0 prints progress (srun --label names each
    line's task)."""
    monitored = str(Path(__file__).parent / "scripts" / "monitored.py")
    serial, launched = tmp_path / "serial", tmp_path / "srun"
    done = subprocess.run([sys.executable, monitored, str(serial), "none"], capture_output=True, env=slurm)
    assert done.returncode == 0, done.stderr[-3000:]
    proc = subprocess.run(
        ["srun", "-N1", "-n2", "--overcommit", "--label", sys.executable, monitored, str(launched), "gloo"],
        capture_output=True,
        text=True,
        timeout=240,
        env=slurm,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (launched / "metrics.csv").read_text() == (serial / "metrics.csv").read_text()
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "train: " in line]
    assert lines and all(line.startswith("0: train: ") for line in lines), lines
    assert lines[-1].startswith("0: train: 20/20 batch 100% | "), lines[-1]


def test_sbatch(slurm, tmp_path):
    job = tmp_path / "job.sh"
    job.write_text(
        "#!/bin/bash\n#SBATCH -N1\n#SBATCH -n2\n#SBATCH --overcommit\n"
        f"srun --overcommit {sys.executable} {AGREE_SCRIPT} {tmp_path}\n"
    )
    proc = subprocess.run(
        ["sbatch", "--parsable", "-o", str(tmp_path / "out.txt"), str(job)],
        capture_output=True,
        text=True,
        timeout=60,
        env=slurm,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    state = _job_end(proc.stdout.strip().split(";")[0], slurm)
    log = (tmp_path / "out.txt").read_text() if (tmp_path / "out.txt").exists() else ""
    assert "JobState=COMPLETED" in state and "ExitCode=0:0" in state, state + log
    check_agree(tmp_path, 2)


def _job_end(job_id: str, env: dict[str, str], timeout: float = 240.0) -> str:
    """``scontrol show job``'s line for ``job_id`` once it ended (polled every 0.2 s: `sbatch
    --wait` polls at a growing interval, up to 10 s, and saw a 4 s job end after 10 s)."""
    deadline = time.monotonic() + timeout
    while True:
        shown = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30, env=env
        ).stdout
        state = shown.split("JobState=", 1)[-1].split(" ", 1)[0]
        if state and state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            return shown
        assert time.monotonic() < deadline, shown
        time.sleep(0.2)


def test_srun_pmi2_tasks_are_read_as_slurm_tasks(slurm):
    """`srun --mpi=pmi2` gives each task PMI_RANK / PMI_SIZE beside its SLURM variables, the same
    rank and size: the detection reads the SLURM ones (`slurm`), which also say where rank 0 runs.
    Read as PMI (`mpich`), rank 0's host was unknown: onedist asked mpi4py, whose Open MPI aborted
    in MPI_Init (built without SLURM's PMI)."""
    plugins = subprocess.run(["srun", "--mpi=list"], capture_output=True, text=True, timeout=60, env=slurm)
    if "pmi2" not in plugins.stdout + plugins.stderr:
        pytest.skip("this SLURM has no pmi2 plugin")
    detect = (
        "import json, os; from onedist.environments import detect_cluster; e = detect_cluster(os.environ); "
        "print(json.dumps([os.environ['SLURM_PROCID'], os.environ.get('PMI_RANK'), e.name, e.rank, "
        "e.world_size, e.master_addr is not None]))"
    )
    proc = subprocess.run(
        ["srun", "-N1", "-n2", "--mpi=pmi2", sys.executable, "-c", detect],
        capture_output=True,
        text=True,
        timeout=120,
        env=slurm,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = sorted(json.loads(line) for line in proc.stdout.splitlines())
    assert seen == [["0", "0", "slurm", 0, 2, True], ["1", "1", "slurm", 1, 2, True]], proc.stdout


def test_onedist_info_in_a_task(slurm):
    """What `onedist info` shows in task 1 of `srun -n2`: the slurm environment with the first host
    of the node list as master and the port derived from the job id, and the probe of that address."""
    only_task_1 = f'[ "$SLURM_PROCID" = 1 ] && exec {sys.executable} -m onedist info --json; true'
    proc = subprocess.run(
        ["srun", "-N1", "-n2", "sh", "-c", only_task_1],
        capture_output=True,
        text=True,
        timeout=120,
        env=slurm,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    info = json.loads(proc.stdout)
    job = int(info["launcher_environment"]["SLURM_JOB_ID"])
    port = 20000 + job % 20000  # step 0 of the job srun made
    assert info["detected_environment"] == {
        "name": "slurm", "rank": 1, "world_size": 2, "local_rank": 1, "nproc_per_node": 2, "node_rank": 0,
        "nnodes": 1, "master_addr": socket.gethostname(), "master_port": port, "master_port_derived": True,
    }  # fmt: skip
    network = info["network"]
    assert network["master_addr_source"] == "detected environment (slurm)", network
    probe = network["master_probe"]
    assert probe is not None, network
    assert probe["address"] in network["resolved"] and probe["port"] == port, probe
    # nothing of this job listens there: refused, unless another program happens to hold the port
    assert probe["reachable"] is True and probe["result"] in ("refused", "open"), probe


@pytest.fixture(scope="module")
def srun_failing_rank(slurm, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """`srun -n2 python launchpage_failing_rank.py OUT` (rank 1 raises while rank 0 waits in a
    barrier), run once for the tests below; no OMP_NUM_THREADS, as srun sets none."""
    out = tmp_path_factory.mktemp("srun-failing-rank")
    env = {k: v for k, v in slurm.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run(
        ["srun", "-N1", "-n2", "--overcommit", sys.executable, FAILING_RANK, str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    return proc, out


def test_srun_leaves_torchs_thread_count_alone(srun_failing_rank):
    """No OMP_NUM_THREADS from srun, and torch's thread count once the group formed is the one torch
    chose itself before onedist ran (every CPU the task sees: srun binds nothing here)."""
    facts = _facts(*srun_failing_rank)
    assert all(f["environment"] == "slurm" and f["omp_num_threads"] is None for f in facts), facts
    assert [f["threads_after"] for f in facts] == [f["threads_before"] for f in facts], facts


def test_under_srun_the_waiting_rank_raises_remote_rank_error_naming_the_failing_task(srun_failing_rank):
    """Rank 0, waiting in a barrier when task 1 raised, raises RemoteRankError naming rank 1 with its
    error, and prints it."""
    proc, out = srun_failing_rank
    assert proc.returncode != 0, proc.stdout + proc.stderr
    raised = json.loads((out / "remote_error.json").read_text())  # rank 0's, in its barrier
    assert raised["rank"] == 1, raised
    assert "rank 1 failed, so this collective cannot complete" in raised["message"], raised
    assert "ValueError: rank 1 failed on purpose" in raised["message"], raised
    assert "RemoteRankError: onedist.barrier (rank 0" in proc.stderr, proc.stderr[-3000:]
