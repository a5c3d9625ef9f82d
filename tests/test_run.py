"""`onedist run` and external launchers (torchrun, mpirun) running one script, for real."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pyfork
from conftest import TORCHRUN_WORKER_ENV
from launch_env import clean_env
from onedist._net import free_port
from run_helpers import AGREE_SCRIPT, check_agree, infos, onedist_command, start_looping

TESTS = str(Path(__file__).parent)

needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI's mpirun")
pytestmark = pytest.mark.launcher


RANK_0_ENDS_FIRST = """
import time, onedist as od
od.initialize("gloo")
od.all_reduce(1)
if od.get_rank() == 1:
    time.sleep(2.5)  # rank 0, which hosts the rendezvous store, exits meanwhile
print("done", flush=True)
"""


def test_rank_0_ending_first_leaves_no_store_errors(tmp_path):
    # the failure watcher of rank 1 polled the store of rank 0, which had exited: torch printed a
    # 25-line C++ stack trace ("recvValue failed ... Connection was likely closed") in a run that
    # succeeded; the watcher now stops when its idle connection to the store reads end-of-file
    script = tmp_path / "rank0_first.py"
    script.write_text(RANK_0_ENDS_FIRST)
    proc = pyfork.run(
        onedist_command("-n", "2", str(script)), capture_output=True, text=True, timeout=120, env=clean_env()
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("done") == 2
    assert "recvValue" not in proc.stdout + proc.stderr and "frame #" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("n", [2, 3])
def test_onedist_run_starts_n_workers_with_prefixed_output(n, tmp_path):
    proc = pyfork.run(
        onedist_command("-n", str(n), AGREE_SCRIPT, str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=240,
        env=clean_env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check_agree(tmp_path, n)
    for r in range(n):
        assert f"[rank{r}]: rank {r} of {n} done" in proc.stdout


def test_onedist_run_module_mode_and_output_filter(tmp_path):
    proc = pyfork.run(
        onedist_command(
            "--nproc_per_node",
            "2",
            "--output-ranks",
            "1",
            "--no-prefix",
            "-m",
            "scripts.agree",
            str(tmp_path),
        ),
        capture_output=True,
        text=True,
        timeout=240,
        env=clean_env(),
        cwd=TESTS,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check_agree(tmp_path, 2)
    assert proc.stdout.strip() == "rank 1 of 2 done"


@pytest.mark.parametrize("how", ["raise", "exit", "kill"])
def test_onedist_run_failing_worker_stops_every_worker_within_5s(how, tmp_path):
    t0 = time.time()
    proc = pyfork.run(
        onedist_command("-n", "3", AGREE_SCRIPT, str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=240,
        env=clean_env(AGREE_FAIL_RANK="1", AGREE_FAIL_HOW=how, AGREE_SLEEP="60"),
    )
    ended = time.time()
    assert proc.returncode != 0
    failed_at = float((tmp_path / "failed_at").read_text())
    assert ended - failed_at < 5.0, f"{ended - failed_at:.1f} s from the failure to the launcher's exit"
    summary = proc.stderr[proc.stderr.index("onedist run: worker rank") :]
    assert summary.startswith("onedist run: worker rank 1 (local rank 1")
    if how == "raise":
        assert "RuntimeError: rank 1 failed on purpose" in summary and "Traceback" in summary
        assert proc.returncode == 1  # an uncaught exception's status
    elif how == "exit":
        assert "exited with code 3" in summary and proc.returncode == 3
    else:
        assert "killed by signal SIGKILL" in summary and proc.returncode == 1
    for info in infos(tmp_path, 3):  # no worker left behind
        with pytest.raises(ProcessLookupError):
            os.kill(info["pid"], 0)
    assert ended - t0 < 60


def test_onedist_run_forwards_sigterm(tmp_path):
    proc = pyfork.popen(
        onedist_command("-n", "2", AGREE_SCRIPT, str(tmp_path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(AGREE_SLEEP="60"),
    )
    deadline = time.time() + 120
    while not (tmp_path / "1.json").exists() or not (tmp_path / "0.json").exists():
        assert time.time() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by signal SIGTERM" in err
    for info in infos(tmp_path, 2):
        with pytest.raises(ProcessLookupError):
            os.kill(info["pid"], 0)


RAISES_IN_A_COLLECTIVE_LOOP = """
import os, sys, time, torch, torch.distributed as dist, onedist as od
od.initialize("gloo")
open(os.path.join(sys.argv[1], f"{od.get_rank()}.pid"), "w").write(str(os.getpid()))
def step():
    if od.get_rank() == 1 and os.environ.get("FAIL"):
        raise ValueError("rank 1 raised on purpose")
    dist.all_reduce(torch.ones(4))
while True:
    step()
"""


def test_worker_traceback_starts_at_the_script_with_one_rank_prefix(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(RAISES_IN_A_COLLECTIVE_LOOP)
    proc = pyfork.run(
        onedist_command("-n", "2", str(script), str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(FAIL="1"),
    )
    assert proc.returncode == 1, proc.stderr
    own = [line for line in proc.stderr.splitlines() if line.startswith("[rank1]:")]
    # as `python loop.py` prints it: from the script's frame, not the launcher's runpy frames, and
    # torch's own "[rank1]:" prefix (its excepthook) is not prefixed a second time
    assert own[0] == "[rank1]: Traceback (most recent call last):", own
    assert own[1].startswith(f'[rank1]:   File "{script}", line 10, in <module>'), own
    assert own[-1] == "[rank1]: ValueError: rank 1 raised on purpose", own
    assert "launchers/bootstrap" not in proc.stderr and "runpy" not in proc.stderr
    assert "[rank1]: [rank1]:" not in proc.stderr and "[rank0]: [rank0]:" not in proc.stderr
    summary = proc.stderr[proc.stderr.index("onedist run: worker rank 1") :]
    assert "Traceback of rank 1:\nTraceback (most recent call last):\n  File" in summary


def test_ctrl_c_on_the_terminal_ends_every_process_with_status_130(tmp_path):
    """Ctrl-C sends SIGINT to the terminal's foreground process group: the launcher, which
    forwards it to the workers (they run in their own session)."""
    script = tmp_path / "loop.py"
    script.write_text(RAISES_IN_A_COLLECTIVE_LOOP)
    proc, pids = start_looping(
        onedist_command("-n", "2", str(script), str(tmp_path)), tmp_path, 2, settle=1.0
    )
    t0 = time.time()
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert time.time() - t0 < 5.0
    assert proc.returncode == 128 + signal.SIGINT, err
    for rank, pid in enumerate(pids):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        assert f"[rank{rank}]: KeyboardInterrupt" in err, err  # where each rank was, to debug a hang
    assert "launchers/bootstrap" not in err


def test_the_onedist_run_page_shows_the_real_usage_and_a_row_for_every_flag(monkeypatch):
    """docs/launchers/onedist-run.md's ``--help`` block is the parser's usage (at 80 columns), and
    its table has a row for every declared flag: the flags come from one declaration, which a new
    flag or a new order changes."""
    from onedist.launchers.arguments import ARGUMENTS
    from onedist.launchers.run import build_parser

    monkeypatch.setenv("COLUMNS", "80")
    page = (Path(__file__).parent.parent / "docs" / "launchers" / "onedist-run.md").read_text()
    assert build_parser().format_usage() in page
    missing = [a.flags for a in ARGUMENTS.values() if a.flags and not any(f"`{f}" in page for f in a.flags)]
    assert not missing, missing


@pytest.mark.parametrize(
    "args, message",
    [
        (["-n", "0"], "--nproc-per-node='0' is not allowed"),
        (["-n", "two"], "--nproc-per-node='two' is not allowed"),
        (["--output-ranks", "a"], "--output-ranks='a' is not allowed"),
        (["--nnodes", "2"], "--master-port is needed with --nnodes > 1"),
        (["--nnodes", "2", "--node-rank", "2", "--master-port", "1"], "--node-rank=2 is not allowed"),
        (["--nnodes", "1:4"], "--nnodes=1:4 is not allowed with --rdzv-backend=static; allowed: N, or"),
        (["--nnodes", "0"], "--nnodes='0' is not allowed"),
        (["--master-port", "70000"], "--master-port=70000 is not allowed; allowed: an int in 1..65535"),
        (["-n", "2", "--backend", "glooo"], "backend='glooo' is not a known backend"),
        (["--rdzv-backend", "etcd"], "--rdzv-backend='etcd' is not allowed; allowed: 'static', 'c10d'"),
        (["--max-restarts", "-1"], "--max-restarts=-1 is not allowed; allowed: an int >= 0"),
        (["--nnodes", "2:3", "--rdzv-backend", "c10d", "--node-rank", "1"], "--node-rank=1 is not allowed"),
        (["--rdzv-endpoint", "h:1", "--master-port", "2"], "name the same thing: pass one"),
        (["--rdzv-endpoint", "h:port"], "--rdzv-endpoint='h:port' is not allowed; allowed: HOST[:PORT]"),
        (["-n", "2", "missing.py"], "can't open file '{cwd}/missing.py': [Errno 2] No such file"),
        (["-n", "2", "-m", "no_such_module"], "No module named 'no_such_module'"),
        (["--inject-failure", "rank=1"], "--inject-failure='rank=1' is not allowed; allowed: rank=R,step=S"),
        (["--inject-failure", "rank=1,step=3,signal=SIGFOO"], "--inject-failure='rank=1,step=3,signal=SIG"),
    ],
)
def test_onedist_run_usage_errors(args, message, tmp_path):
    """Refused before any worker starts: exit status 2 and the launcher's one line (a missing
    script was each worker's runpy error, after its start-up)."""
    target = [] if args[-1] in ("missing.py", "no_such_module") else [AGREE_SCRIPT, str(tmp_path)]
    proc = pyfork.run(
        onedist_command(*args, *target),
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and message.format(cwd=tmp_path) in proc.stderr, proc.stderr
    assert "[rank" not in proc.stdout + proc.stderr, proc.stderr  # no worker ran


PROBE = """
import json, os, sys
here = os.path.dirname(__file__)
os.chdir("/")  # a script that changes directory, then finds its files through __file__
print(json.dumps([__file__, sys.argv, os.path.exists(os.path.join(here, "data.txt"))]))
"""


def test_a_script_sees_what_python_gives_it_and_every_argument_after_its_name(tmp_path):
    """``__file__`` absolute and ``sys.argv`` as typed, as ``python sub/probe.py`` gives them (it
    was relative under onedist run: after os.chdir the script lost its files); an option after
    the script's name is the script's, even one that abbreviates a launcher flag (``--nproc``
    was refused as ambiguous)."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "probe.py").write_text(PROBE)
    (tmp_path / "sub" / "data.txt").write_text("x")
    command = ["sub/probe.py", "--nproc", "2", "--max-restarts", "-m"]
    python = subprocess.run(
        [sys.executable, *command], capture_output=True, text=True, timeout=60, env=clean_env(), cwd=tmp_path
    )
    expected = [str(tmp_path / "sub" / "probe.py"), command, True]
    assert json.loads(python.stdout) == expected, python.stderr
    ran = pyfork.run(
        onedist_command("-n", "2", "--no-prefix", *command),
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
        cwd=tmp_path,
    )
    assert ran.returncode == 0, ran.stderr
    assert [json.loads(line) for line in ran.stdout.splitlines()] == [expected] * 2, ran.stdout


def test_under_a_launcher_a_disagreeing_n_is_refused_and_an_agreeing_one_runs_in_place(tmp_path):
    # a process torchrun started (its worker's variables): its workers exist already
    script = tmp_path / "hello.py"
    script.write_text("print('ran in place')\nraise SystemExit(4)\n")
    env = clean_env(**TORCHRUN_WORKER_ENV)
    refused = pyfork.run(
        onedist_command("-n", "3", str(script)), capture_output=True, text=True, timeout=60, env=env
    )
    assert refused.returncode == 2, refused.stderr
    assert (
        "--nproc-per-node=3 disagrees with the torchelastic launcher that started this process"
        in refused.stderr
    )
    # in place: rank 0's output, though --output-ranks names rank 1 only, with no prefix, and the
    # script's own exit status
    ran = pyfork.run(
        onedist_command("-n", "2", "--output-ranks", "1", str(script)),
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert ran.returncode == 4 and ran.stdout == "ran in place\n", ran.stderr


def test_python_spawns_the_same_script(tmp_path):
    """`python agree.py OUT 2`: no launcher, so Parallel spawns the workers itself."""
    proc = pyfork.run(
        [sys.executable, AGREE_SCRIPT, str(tmp_path), "2"],
        capture_output=True,
        text=True,
        timeout=240,
        env=clean_env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check_agree(tmp_path, 2)


def test_torchrun_one_node(tmp_path):
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", AGREE_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=clean_env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check_agree(tmp_path, 2)


def test_torchrun_two_agents_as_two_nodes(tmp_path):
    port = str(free_port())
    cmds = [
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            port,
            AGREE_SCRIPT,
            str(tmp_path),
        ]
        for node in (0, 1)
    ]
    procs = [
        subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
        for c in cmds
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    check_agree(tmp_path, 4, nnodes=2)


@pytest.mark.parametrize("flags", ["onedist", "torchrun's"])
def test_onedist_run_two_nodes_on_one_host(flags, tmp_path):
    port = str(free_port())
    where = ["--master-port", port] if flags == "onedist" else ["--rdzv-endpoint", f"127.0.0.1:{port}"]
    if flags != "onedist":
        where += ["--rdzv-backend", "c10d", "--rdzv-id", "job7", "--nnodes", "2:2"]
    else:
        where += ["--nnodes", "2"]
    procs = [
        pyfork.popen(
            onedist_command("--node-rank", str(node), "-n", "2", *where, AGREE_SCRIPT, str(tmp_path)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(),
        )
        for node in (0, 1)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    check_agree(tmp_path, 4, nnodes=2)


@needs_mpirun
@pytest.mark.parametrize("via, n", [("python", 2), ("python", 3), ("onedist run", 3)])
def test_open_mpi_mpirun(via, n, tmp_path):
    runner = [sys.executable] if via == "python" else onedist_command()
    flags = ["--allow-run-as-root", "--oversubscribe", "-np", str(n)]
    cmd = ["mpirun", *flags, *runner, AGREE_SCRIPT, str(tmp_path)]
    proc = pyfork.run(cmd, capture_output=True, text=True, timeout=240, env=clean_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check_agree(tmp_path, n)


@pytest.mark.skipif(
    shutil.which("mpiexec.hydra") is None,
    reason="needs MPICH's mpiexec.hydra (apt-get install --no-install-recommends mpich)",
)
@pytest.mark.parametrize("via, n", [("python", 2), ("onedist run", 3)])
def test_mpich_hydra_mpiexec(via, n, tmp_path):
    """MPICH 4's launcher names no job and no port (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID and
    MPI_LOCALNRANKS only): on one node the ranks derive the port from their common parent, the
    hydra proxy. Before, initialize asked for MASTER_PORT. mpi4py here is Open MPI's, which warns
    under MPICH ("suspicious MPI execution environment"): onedist does not ask it."""
    runner = [sys.executable] if via == "python" else onedist_command()
    cmd = ["mpiexec.hydra", "-n", str(n), *runner, AGREE_SCRIPT, str(tmp_path)]
    proc = pyfork.run(cmd, capture_output=True, text=True, timeout=240, env=clean_env(AGREE_BACKEND="auto"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "suspicious MPI" not in proc.stderr, proc.stderr
    got = check_agree(tmp_path, n)
    # hydra's variables say every rank is on this host: auto is shm there
    assert [i["backend"] for i in got] == ["shm"] * n, got
