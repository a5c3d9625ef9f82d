"""A real one-node SLURM (munged, slurmctld, slurmd started by the test): srun and sbatch."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from onedist._net import free_port
from test_run import SCRIPT, _check_agree, _env, _onedist

CLUSTER = Path(__file__).parent / "cluster"

pytestmark = [
    pytest.mark.launcher,
    pytest.mark.skipif(
        shutil.which("slurmctld") is None or shutil.which("munged") is None or os.geteuid() != 0,
        reason="needs SLURM (slurm-wlm, munge) and root to start its daemons",
    ),
]


@pytest.fixture(scope="module")
def slurm():
    # not under pytest's tmp dir: munged runs as the munge user and must reach its socket
    state = Path(tempfile.mkdtemp(prefix="onedist-slurm-"))
    os.chmod(state, 0o755)
    port = free_port()
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
        yield {**_env(), "SLURM_CONF": str(state / "slurm.conf")}
    finally:
        subprocess.run(["bash", str(CLUSTER / "slurm_stop.sh"), str(state)], timeout=60)
        shutil.rmtree(state, ignore_errors=True)


@pytest.mark.parametrize("via, n", [("python", 2), ("onedist run", 3)])
def test_srun(slurm, via, n, tmp_path):
    runner = [sys.executable] if via == "python" else _onedist()
    proc = subprocess.run(
        ["srun", "-N1", f"-n{n}", "--overcommit", *runner, SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=slurm,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check_agree(tmp_path, n)


def test_sbatch(slurm, tmp_path):
    job = tmp_path / "job.sh"
    job.write_text(
        "#!/bin/bash\n#SBATCH -N1\n#SBATCH -n2\n#SBATCH --overcommit\n"
        f"srun --overcommit {sys.executable} {SCRIPT} {tmp_path}\n"
    )
    proc = subprocess.run(
        ["sbatch", "--wait", "-o", str(tmp_path / "out.txt"), str(job)],
        capture_output=True,
        text=True,
        timeout=240,
        env=slurm,
    )
    log = (tmp_path / "out.txt").read_text() if (tmp_path / "out.txt").exists() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + log
    _check_agree(tmp_path, 2)
