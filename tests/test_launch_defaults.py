"""What `onedist run`, `spawn` and `Parallel` do without being asked: how many workers `-n auto`
starts, the variables their workers get, what a killed launcher or parent leaves behind, and how
a failure on the way out of `Parallel` is reported, and restarts at their edges
(docs/launchers/onedist-run.md, spawn.md and faults.md name each test in their "Checked by")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# at the top, as a training script imports it: a "spawn" worker imports this module (to unpickle
# its function) before the launcher's OMP_NUM_THREADS reaches its environment
import torch

import onedist as od
import onedist.cli
import onedist.launchers.run_spec as spec
from launch_env import clean_env
from onedist._net import free_port
from onedist.launchers.pet import apply_pet_defaults
from onedist.launchers.run import build_parser
from run_helpers import onedist_command, outputs
from test_crash import _proc_stat


# ============================================================================ onedist run
def _nproc(value: str) -> int:
    args = build_parser().parse_args(["-n", value, "train.py"])
    apply_pet_defaults(args, {})
    return spec.check_run_values(args)


def test_nproc_auto_cpu_and_gpu_count_what_this_host_has(monkeypatch, capsys):
    monkeypatch.setattr(os, "cpu_count", lambda: 5)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2,3")
    assert (_nproc("auto"), _nproc("gpu"), _nproc("cpu")) == (3, 3, 5)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible
    assert (_nproc("auto"), _nproc("cpu")) == (1, 5)
    assert onedist.cli.main(["run", "-n", "gpu", "train.py"]) == 2  # nothing was started
    assert (
        "--nproc-per-node='gpu' is not allowed; allowed: an int >= 1, 'auto', 'cpu' (no GPU is visible)"
        in (capsys.readouterr().err)
    )
    # without the variable, the GPUs are the /dev/nvidia<N> device files (faked: none here)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    devices = {"/dev/nvidia[0-9]*": ["/dev/nvidia0", "/dev/nvidia1"]}
    monkeypatch.setattr(spec.glob, "glob", lambda pattern: devices.get(pattern, []))
    assert (_nproc("auto"), _nproc("gpu")) == (2, 2)


AUTO = """
import json, os, sys, onedist as od
od.initialize("auto")
info = {"rank": od.get_rank(), "world_size": od.get_world_size(), "backend": od.backend(),
        "ONEDIST_BACKEND": os.environ.get("ONEDIST_BACKEND"), "sum": od.all_reduce(1)}
with open(os.path.join(sys.argv[1], f"{od.get_rank()}.json"), "w") as f:
    json.dump(info, f)
od.finalize()
"""


@pytest.mark.launcher
def test_nproc_auto_backend_and_ignored_pet_variables_in_one_run(tmp_path):
    """Two visible GPUs (by their variable; torch here has no CUDA): `-n auto` starts two workers,
    whose `initialize("auto")` is `--backend`'s gloo (shm otherwise, two processes on one host);
    torchrun's variables of flags `onedist run` lacks are named on one line and change nothing."""
    script = tmp_path / "auto.py"
    script.write_text(AUTO)
    logs = tmp_path / "logs"
    env = clean_env(CUDA_VISIBLE_DEVICES="0,1", PET_MONITOR_INTERVAL="5", PET_LOG_DIR=str(logs))
    proc = subprocess.run(
        onedist_command("-n", "auto", "--backend", "gloo", str(script), str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    infos = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert not (tmp_path / "2.json").exists()
    assert [(i["rank"], i["world_size"], i["sum"]) for i in infos] == [(0, 2, 2), (1, 2, 2)], infos
    assert all(i["backend"] == "gloo" and i["ONEDIST_BACKEND"] == "gloo" for i in infos), infos
    named = [line for line in proc.stderr.splitlines() if "PET_" in line]
    assert named == [
        "onedist run: ignoring PET_MONITOR_INTERVAL, PET_LOG_DIR: torchrun flags onedist run does not have"
    ], proc.stderr
    assert not logs.exists()  # torchrun would write the workers' logs there


REPORTS_HOW_IT_STARTED = """
import atexit, json, os, signal, sys, threading, time
preloaded = "torch" in sys.modules  # before this script imports anything of its own
import numpy as np
import torch

rank = int(os.environ["RANK"])
out = os.path.dirname(os.path.abspath(sys.argv[0]))
os.chdir("/")  # __file__ must still name the script
json.dump({
    "preloaded": preloaded, "file": __file__, "argv": sys.argv, "path0": sys.path[0],
    "own_session": os.getsid(0) == os.getpid(), "threads": torch.get_num_threads(),
    "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    "random": np.random.randint(1 << 30),
}, open(f"{out}/{rank}.json", "w"))
left_open = open(f"{out}/{rank}.unclosed", "w")
left_open.write("flushed at exit")  # never closed: Python's exit flushes it
atexit.register(lambda: open(f"{out}/{rank}.atexit", "w").close())
threading.Thread(target=lambda: (time.sleep(0.3), open(f"{out}/{rank}.thread", "w").close())).start()
"""


@pytest.mark.launcher
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_worker_starts_and_ends_as_python_script_py_would(start_method, tmp_path):
    """--start-method fork (the default) forks the workers from the launcher once it imported
    torch; spawn starts a new interpreter each. Either way the script sees what `python script.py`
    gives it and ends as Python ends (exit handlers, threads, unclosed files)."""
    script = tmp_path / "report.py"
    script.write_text(REPORTS_HOW_IT_STARTED)
    env = clean_env(PET_START_METHOD=start_method)
    proc = subprocess.run(
        [*onedist_command("-n", "2"), "report.py", "x"], cwd=tmp_path, capture_output=True, text=True,
        timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    for r, report in enumerate(reports):
        assert report["preloaded"] is (start_method == "fork"), report
        assert report["file"] == str(script) and report["argv"] == ["report.py", "x"], report
        assert report["path0"] == str(tmp_path) and report["own_session"], report
        assert report["threads"] == 1 and report["sigint"] and report["sigterm"], report
        assert (tmp_path / f"{r}.unclosed").read_text() == "flushed at exit"
        assert (tmp_path / f"{r}.atexit").exists() and (tmp_path / f"{r}.thread").exists()
    assert reports[0]["random"] != reports[1]["random"]  # numpy seeded in each, as a new process is


def test_the_launcher_forks_only_while_it_runs_one_thread():
    code = (
        "import threading, time\n"
        "from onedist.launchers.forked import can_fork\n"
        "alone = can_fork()\n"
        "threading.Thread(target=time.sleep, args=(2,), daemon=True).start()\n"
        "print(alone, can_fork())"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["True", "False"], proc.stdout + proc.stderr


EXITS_3_AFTER_AN_EARLY_RETURN = """
import os, sys, time, torch, onedist as od

def main(local_rank):
    od.all_reduce(1)
    # gloo returns rank 0's 2-element all_reduce early (a wrong sum); rank 1 waits for its 3rd
    od.all_reduce(torch.ones(2 + od.get_rank()))
    if od.get_rank() == 0:
        sys.exit(3)

with od.Parallel(backend="gloo") as parallel:
    parallel.run(main)
"""


@pytest.mark.launcher
def test_sys_exit_3_leaving_parallel_is_reported_as_such_without_the_finalize_check(tmp_path):
    """Rank 0 leaves `Parallel` on `SystemExit(3)` while rank 1 is still blocked in a call rank 0
    returned from: `finalize`'s check would find that (CollectiveMismatchError, status 1, seconds
    later); after an error it is skipped, so the job reports rank 0's own exit and its status."""
    script = tmp_path / "exits.py"
    script.write_text(EXITS_3_AFTER_AN_EARLY_RETURN)
    proc = subprocess.run(
        onedist_command("-n", "2", str(script)),
        capture_output=True,
        text=True,
        timeout=240,
        env=clean_env(ONEDIST_STALL_S="3"),
    )
    assert proc.returncode == 3, proc.stderr
    report = proc.stderr[proc.stderr.index("onedist run: worker rank") :]
    assert report.startswith("onedist run: worker rank 0 (local rank 0, pid "), report
    assert report.splitlines()[0].endswith(") failed with SystemExit: 3"), report
    assert "CollectiveMismatchError" not in proc.stderr, proc.stderr


SLEEPS = """
import os, sys, time

def sleep(local_rank, out):
    with open(os.path.join(out, os.environ["RANK"] + ".pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)

if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:  # onedist run started this process
        sleep(None, sys.argv[1])
    else:
        import onedist as od
        od.spawn("gloo", sleep, args=(sys.argv[1],), nproc_per_node=2, start_method="fork")
"""


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie counts as ended: its new parent may never reap it)."""
    stat = _proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def _start_sleepers(cmd: list[str], out: Path) -> tuple[subprocess.Popen, list[int]]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
    deadline = time.time() + 120
    while not all((out / f"{r}.pid").exists() for r in (0, 1)):
        assert time.time() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    return proc, [int((out / f"{r}.pid").read_text()) for r in (0, 1)]


def _left_running(pids: list[int], out: Path, within: float) -> list[int]:
    """The workers in ``pids`` still running after ``within`` seconds; those are then killed (only
    when their command line names this test's folder: a pid may have been reused)."""
    deadline = time.monotonic() + within
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if _running(p)]
    for pid in left:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if str(out).encode() in f.read():
                    os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass
    return left


@pytest.mark.launcher
@pytest.mark.parametrize("parent", ["onedist run", "spawn"])
def test_a_sigkilled_launcher_leaves_no_worker(parent, tmp_path):
    """SIGKILL gives the launcher (or `spawn`'s parent) no chance to stop its workers: Linux does
    (PR_SET_PDEATHSIG); they would sleep a minute otherwise."""
    script = tmp_path / "sleeps.py"
    script.write_text(SLEEPS)
    cmd = (
        onedist_command("-n", "2", str(script), str(tmp_path))
        if parent == "onedist run"
        else [sys.executable]
    )
    if parent == "spawn":
        cmd += [str(script), str(tmp_path)]
    proc, pids = _start_sleepers(cmd, tmp_path)
    proc.kill()
    proc.wait(timeout=30)
    left = _left_running(pids, tmp_path, within=10.0)
    proc.communicate(timeout=30)  # spawn's forked workers hold its output pipes until they end
    assert left == []


@pytest.mark.launcher
def test_sigint_to_the_launcher_is_not_restarted(tmp_path):
    """Ctrl-C (SIGINT, here to the launcher alone) stops the job even with restarts left."""
    script = tmp_path / "sleeps.py"
    script.write_text(SLEEPS)
    proc, pids = _start_sleepers(
        onedist_command("-n", "2", "--max-restarts", "3", str(script), str(tmp_path)), tmp_path
    )
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "restarting" not in err and "stopped by signal SIGINT" in err, err
    assert _left_running(pids, tmp_path, within=5.0) == []
    assert sorted(p.name for p in tmp_path.glob("*.pid")) == ["0.pid", "1.pid"]  # no second attempt


@pytest.mark.launcher
@pytest.mark.slow
def test_nodes_given_different_nnodes_refuse_to_start(tmp_path):
    script = tmp_path / "up.py"
    script.write_text("print('up', flush=True)\n")
    port = str(free_port())
    flags = ["-n", "1", "--master-port", port, "--max-restarts", "1", str(script)]
    cmds = [
        onedist_command("--nnodes", nnodes, "--node-rank", k, *flags)
        for k, nnodes in (("0", "2"), ("1", "3"))
    ]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "env": clean_env()}
    procs = [subprocess.Popen(cmd, **pipes) for cmd in cmds]
    outs = outputs(procs)
    assert [p.returncode for p in procs] == [1, 1], outs
    message = (
        "--nnodes=3 on node 1 differs from node 0's --nnodes=2; allowed: the same --nnodes on every node"
    )
    assert all(message in err for _, err in outs), outs
    assert not any("up" in out for out, _ in outs), outs


# ============================================================================ spawn and Parallel
def threads(local_rank: int) -> dict:
    return {
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "threads": torch.get_num_threads(),
        "ppid": os.getppid(),
        "sum": od.all_reduce(1),
    }


@pytest.mark.launcher
@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_spawned_workers_get_one_omp_thread_from_either_start_method(start_method, monkeypatch):
    """Two workers share this host and OMP_NUM_THREADS is not set: each gets 1, and its torch,
    imported before that (with this module, to unpickle ``threads``), one thread (2 otherwise on
    a host of 2 CPUs or more). forkserver's workers are the fork server's children."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    out = od.spawn("gloo", threads, nproc_per_node=2, start_method=start_method, timeout=120)
    assert [(o["omp"], o["threads"], o["sum"]) for o in out] == [("1", 1, 2)] * 2, out
    parents = {o["ppid"] for o in out}
    if start_method == "spawn":
        assert parents == {os.getpid()}, out
    else:
        assert len(parents) == 1 and os.getpid() not in parents, out


FORKSERVER_TWICE = """
import os, onedist as od

def probe(local_rank):
    with open(f"/proc/{os.getppid()}/maps") as maps:  # the fork server's memory
        return os.environ.get("FLAG"), "libtorch_cpu" in maps.read()

if __name__ == "__main__":
    os.environ["FLAG"] = "before"
    print(od.spawn("gloo", probe, nproc_per_node=2, start_method="forkserver", timeout=120))
    os.environ["FLAG"] = "after"  # the fork server runs on, with the environment it started with
    print(od.spawn("gloo", probe, nproc_per_node=2, start_method="forkserver", timeout=120))
"""


@pytest.mark.launcher
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/maps")
def test_forkserver_workers_fork_with_torch_loaded_and_get_the_callers_environment(tmp_path):
    """start_method="forkserver": the server has torch loaded before it forks a worker (none of
    the workers imports it again), and a worker gets the caller's environment at od.spawn's call,
    not the one the server started with."""
    script = tmp_path / "twice.py"
    script.write_text(FORKSERVER_TWICE)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=clean_env()
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = proc.stdout.strip().splitlines()[-2:]
    assert first == str([("before", True)] * 2), proc.stdout
    assert second == str([("after", True)] * 2), proc.stdout


INTERACTIVE = """
import logging, onedist as od
logging.basicConfig(level=logging.INFO)
def f(local_rank):
    return od.all_reduce(1)
print(od.spawn('gloo', f, nproc_per_node=2))
"""


@pytest.mark.launcher
def test_a_function_defined_in_python_dash_c_runs_with_fork_and_says_so():
    env = {k: v for k, v in clean_env().items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run(
        [sys.executable, "-c", INTERACTIVE], capture_output=True, text=True, timeout=240, env=env
    )
    assert proc.returncode == 0 and proc.stdout == "[2, 2]\n", proc.stdout + proc.stderr
    assert (
        "INFO:onedist:onedist.spawn: fn is defined interactively; starting workers with 'fork'" in proc.stderr
    )
    assert "INFO:onedist:onedist: OMP_NUM_THREADS=1 in each worker (set it to override)" in proc.stderr


DEFINED_UNDER_MAIN = """
import onedist as od

if __name__ == "__main__":
    def train(local_rank):
        return local_rank

    od.spawn("gloo", train, nproc_per_node=2)
"""


@pytest.mark.launcher
def test_a_function_defined_under_main_fails_in_spawn_workers_with_the_hint(tmp_path):
    """It pickles by name, but a "spawn" worker imports the script without running that block."""
    script = tmp_path / "under_main.py"
    script.write_text(DEFINED_UNDER_MAIN)
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        env=clean_env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr
    missing = "AttributeError: Can't get attribute 'train' on <module '__mp_main__'"
    assert missing in err, err
    report = err[err.index("WorkerFailedError: onedist: worker rank") :]
    assert err.index(missing) < err.index(report)  # Python's error comes above onedist's report
    assert ") exited with code 1 without raising an exception\n" in report.splitlines(keepends=True)[0], (
        report
    )
    hint = textwrap.dedent(
        """\
        It exited before onedist could run your function. If the script starts workers at import
        time, guard the start with `if __name__ == "__main__":` (start_method 'spawn' re-imports the
        main module in every worker)."""
    ).replace("\n", " ")
    assert hint in report, report


def fails_on_the_first_attempt(local_rank: int) -> tuple[int, int]:
    if od.restart_count() == 0 and od.get_rank() == 1:
        raise ValueError("rank 1 fails on the first attempt")
    return od.restart_count(), int(os.environ["MASTER_PORT"])


def test_a_restart_uses_the_given_master_port_again():
    port = free_port()
    out = od.spawn(
        "gloo",
        fails_on_the_first_attempt,
        nproc_per_node=2,
        start_method="fork",
        master_port=port,
        max_restarts=1,
    )
    assert out == [(1, port), (1, port)]
