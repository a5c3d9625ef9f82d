"""`onedist run --max-restarts N` for real: a worker SIGKILLed mid-training, the workers started
again, the training resumed from the newest checkpoint, and the final weights bit-identical to
an uninterrupted run's."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from subprocess import PIPE

import pytest
import torch

import pyfork
from launch_env import clean_env
from run_helpers import onedist_command

pytestmark = [pytest.mark.launcher, pytest.mark.slow]

DIGITS = str(Path(__file__).parent.parent / "examples" / "digits.py")
EPOCHS = "4"  # 23 steps an epoch on 2 ranks: 92 steps
EVERY = 5

pytest.importorskip("sklearn", reason="the digits example needs scikit-learn (in the test extra)")


def _digits(
    ckpt: Path, final: Path, *launcher: str, sharding: bool = False, start_method: str = "fork"
) -> list[str]:
    launcher = launcher or ("-n", "2")
    return onedist_command(
        *launcher, "--start-method", start_method, "--max-restarts", "3",
        DIGITS, "--backend", "gloo", "--epochs", EPOCHS,
        "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(EVERY), "--save-final", str(final),
        *(("--sharding", "fsdp") if sharding else ()),
    )  # fmt: skip


def _children(pid: int) -> dict[int, tuple[int, int]]:
    """The launcher's workers: pid -> (rank, MASTER_PORT), read from /proc."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[1]) != pid:
                continue
            raw = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            environ = dict(v.split(b"=", 1) for v in raw if b"=" in v)
        except (OSError, ValueError):
            continue
        if b"RANK" in environ:
            out[int(entry)] = (int(environ[b"RANK"]), int(environ[b"MASTER_PORT"]))
    return out


def _process_groups() -> dict[int, int]:
    """pid -> process group of every process on this machine."""
    out = {}
    for entry in os.listdir("/proc"):
        try:
            out[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[2])
        except (OSError, ValueError, IndexError):
            continue
    return out


def _shm() -> set[str]:
    """onedist's entries in /dev/shm (its shm backend uses memfds: there should be none)."""
    try:
        return {n for n in os.listdir("/dev/shm") if "onedist" in n}
    except FileNotFoundError:
        return set()


def bind_check(ports: set[int]) -> str:
    """Python code that binds every port with SO_REUSEADDR, as a server would (a listener left
    on one fails it); prints "free"."""
    return (
        "import socket\n"
        f"for port in {sorted(ports)}:\n"
        "    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        "    s.bind(('', port)); s.close()\n"
        "print('free')\n"
    )


#: the workers of a Run are new interpreters: it reads each one's rank from /proc/<pid>/environ,
#: which in a forked worker holds the launcher's variables (the kernel keeps a process's first
#: block); a forked run's restart: test_an_injected_failure_restarts_once_...
RUN_READS_ENVIRON = "spawn"


class Run:
    """One run of the digits example under launchers: kill a worker at a checkpoint, watch the
    workers of every attempt (for the leftovers check), and time the restart."""

    def __init__(self, procs: list[subprocess.Popen], ckpt: Path) -> None:
        self.procs, self.ckpt = procs, ckpt
        self.seen: dict[int, tuple[int, int]] = {}  # every worker of every attempt
        self.shm_before = _shm()
        self.t0 = time.monotonic()
        self.killed_at = self.restarted_at = self.planted = None

    def _look(self) -> set[int]:
        new = set()
        for p in self.procs:
            workers = _children(p.pid)
            new |= workers.keys() - self.seen.keys()
            self.seen.update(workers)
        return new

    def kill(self, after_step: int, victim: int) -> None:
        """SIGKILL rank ``victim`` once the checkpoint of step ``after_step`` exists, and leave a
        temporary file as a writer killed mid-write would (its pid in the name)."""
        marker = self.ckpt / f"step_{after_step:08d}.pt"
        while not marker.exists():
            assert all(p.poll() is None for p in self.procs) and time.monotonic() - self.t0 < 120
            self._look()
            time.sleep(0.005)
        self._look()
        pid = next(p for p, (r, _) in self.seen.items() if r == victim and _alive(p))
        os.kill(pid, signal.SIGKILL)
        self.killed_at = time.monotonic()
        self.planted = self.ckpt / f".step_{after_step + 1:08d}.pt.{pid}.0123456789ab.tmp"
        if marker.is_dir():  # a sharded checkpoint: its writer's temporary directory, half written
            self.planted.mkdir()
            (self.planted / "__0_0.distcp").write_bytes(b"half a shard")
        else:
            self.planted.write_bytes(b"half a checkpoint")

    def finish(self) -> list[tuple[str, str]]:
        """Wait for every launcher (watching the restarted workers); their (stdout, stderr)."""
        try:
            while any(p.poll() is None for p in self.procs):
                if self._look() and self.restarted_at is None:
                    self.restarted_at = time.monotonic()
                time.sleep(0.02)
            self.ended_at = time.monotonic()
            return [p.communicate(timeout=60) for p in self.procs]
        finally:
            for p in self.procs:
                if p.poll() is None:
                    p.kill()

    def check_nothing_left(self) -> set[int]:
        """No worker of any attempt, nor anything in their process groups (each worker leads its
        own), no temporary file in the checkpoint folder, no onedist segment in /dev/shm. Returns
        the workers' rendezvous ports, for the caller to bind where they listened."""
        for pid in self.seen:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        left = [pid for pid, group in _process_groups().items() if group in self.seen]
        assert not left, f"processes left in the workers' process groups: {left}"
        assert not [n for n in os.listdir(self.ckpt) if n.endswith(".tmp")], os.listdir(self.ckpt)
        assert _shm() == self.shm_before
        return {port for _, port in self.seen.values()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["model"]


def check_same_weights(final: Path, uninterrupted: dict[str, torch.Tensor]) -> None:
    mine = _weights(final)
    assert mine.keys() == uninterrupted.keys()
    same = all(torch.equal(mine[k], uninterrupted[k]) for k in mine)
    assert same, "weights differ from the uninterrupted run"


def check_restart_reported(err: str, victim: int, out: str, kill_after: int) -> int:
    """The restart line names the killed rank; the training resumed at or after ``kill_after``."""
    restarts = re.findall(
        r"onedist run: rank (\d) failed \((.*?)\); restarting the workers \(attempt (\d) of 3\)", err
    )
    assert restarts, err[-3000:]
    assert restarts[0] == (str(victim), "exit code -9, killed by signal SIGKILL", "1"), err[-3000:]
    resumed = re.search(r"resumed from step (\d+) \(restart 1\)", out)
    assert resumed and kill_after <= int(resumed.group(1)), out[-3000:]
    return int(resumed.group(1))


def _uninterrupted(tmp: Path, sharding: bool) -> dict[str, torch.Tensor]:
    proc = pyfork.run(
        _digits(tmp / "ckpt", tmp / "final.pt", sharding=sharding),
        capture_output=True, text=True, timeout=180, env=clean_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "restarting" not in proc.stderr
    return _weights(tmp / "final.pt")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    return _uninterrupted(tmp_path_factory.mktemp("uninterrupted"), sharding=False)


@pytest.mark.parametrize("seed", [1, 2])
def test_a_killed_worker_resumes_to_bit_identical_weights(seed, uninterrupted, tmp_path):
    kill_after = random.Random(seed).randrange(EVERY, 70, EVERY)  # the checkpoint to wait for
    victim = seed % 2  # rank 1 once (rank 0 hosts no store here: the launcher does), rank 0 once
    ckpt, final = tmp_path / "ckpt", tmp_path / "final.pt"
    argv = _digits(ckpt, final, start_method=RUN_READS_ENVIRON)
    run = Run([pyfork.popen(argv, stdout=PIPE, stderr=PIPE, text=True, env=clean_env())], ckpt)
    run.kill(kill_after, victim)
    [(out, err)] = run.finish()
    assert run.procs[0].returncode == 0, out[-3000:] + err[-3000:]
    resumed = check_restart_reported(err, victim, out, kill_after)
    check_same_weights(final, uninterrupted)
    ports = run.check_nothing_left()
    free = subprocess.run([sys.executable, "-c", bind_check(ports)], capture_output=True, text=True)
    assert free.stdout == "free\n", free.stderr
    assert run.restarted_at is not None
    print(f"kill after step {kill_after} (rank {victim}), resumed from {resumed}, "
          f"new workers {run.restarted_at - run.killed_at:.2f} s after the kill, "
          f"{run.ended_at - run.killed_at:.1f} s from the kill to the end")  # fmt: skip


def test_a_killed_worker_of_a_sharded_run_resumes_to_bit_identical_weights(tmp_path):
    """--sharding fsdp: every rank writes its shards of each step's checkpoint (a directory); the
    restarted workers load them and end with the uninterrupted sharded run's weights, bit for bit."""
    expected = _uninterrupted(tmp_path / "uninterrupted", sharding=True)
    ckpt, final = tmp_path / "ckpt", tmp_path / "final.pt"
    argv = _digits(ckpt, final, sharding=True, start_method=RUN_READS_ENVIRON)
    run = Run([pyfork.popen(argv, stdout=PIPE, stderr=PIPE, text=True, env=clean_env())], ckpt)
    run.kill(35, 1)  # the shards of step 35 written: mid-epoch 2, by a rank that hosts no store
    [(out, err)] = run.finish()
    assert run.procs[0].returncode == 0, out[-3000:] + err[-3000:]
    check_restart_reported(err, 1, out, 35)
    assert (ckpt / "step_00000035.pt").is_dir()
    check_same_weights(final, expected)
    run.check_nothing_left()


def test_an_injected_failure_restarts_once_and_resumes_to_bit_identical_weights(uninterrupted, tmp_path):
    """``onedist run --inject-failure rank=1,step=37``: rank 1 kills itself (SIGKILL) after its 37th
    optimizer step of the first attempt, says so, and the restarted run (not killed again)
    resumes from step 35 to the uninterrupted run's weights."""
    ckpt, final = tmp_path / "ckpt", tmp_path / "final.pt"
    argv = _digits(ckpt, final, "-n", "2", "--inject-failure", "rank=1,step=37")
    proc = pyfork.run(argv, capture_output=True, text=True, timeout=180, env=clean_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = "onedist: rank 1 ends itself by SIGKILL after optimizer step 37, as ONEDIST_INJECT_FAILURE asks"
    assert proc.stderr.count(said) == 1, proc.stderr[-3000:]
    assert check_restart_reported(proc.stderr, 1, proc.stdout, 35) == 35
    assert proc.stderr.count("restarting the workers") == 1, proc.stderr[-3000:]
    check_same_weights(final, uninterrupted)


FAILS_ON_THE_FIRST_ATTEMPT = """
import sys, onedist as od
od.initialize("gloo")
print(f"attempt {od.restart_count()} rank {od.get_rank()}", flush=True)
if od.restart_count() < int(sys.argv[1]) and od.get_rank() == 1:
    raise ValueError("rank 1 fails on purpose")
od.all_reduce(1)
"""


@pytest.mark.parametrize("fails, max_restarts, code", [(1, 2, 0), (3, 2, 1)])
def test_restarts_until_success_or_the_limit(fails, max_restarts, code, tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(FAILS_ON_THE_FIRST_ATTEMPT)
    proc = pyfork.run(
        onedist_command("-n", "2", "--max-restarts", str(max_restarts), str(script), str(fails)),
        capture_output=True,
        text=True,
        timeout=180,
        env=clean_env(),
    )
    assert proc.returncode == code, proc.stdout + proc.stderr
    attempts = min(fails, max_restarts) + 1
    for a in range(attempts):
        assert f"[rank0]: attempt {a} rank 0" in proc.stdout, proc.stdout
    lines = re.findall(r"onedist run: rank 1 failed \(ValueError: rank 1 fails on purpose\); .*", proc.stderr)
    assert lines == [
        f"onedist run: rank 1 failed (ValueError: rank 1 fails on purpose); restarting the workers "
        f"(attempt {a} of {max_restarts})"
        for a in range(1, attempts)
    ], proc.stderr
    if code:  # the last attempt's failure is reported in full, as without restarts
        assert "onedist run: worker rank 1 (local rank 1" in proc.stderr


SLEEPS = """
import os, sys, time, onedist as od
od.initialize("gloo")
open(os.path.join(sys.argv[1], f"{od.get_rank()}.pid"), "w").write(str(os.getpid()))
time.sleep(60)
"""


def test_sigterm_to_the_launcher_does_not_restart(tmp_path):
    script = tmp_path / "sleeps.py"
    script.write_text(SLEEPS)
    proc = pyfork.popen(
        onedist_command("-n", "2", "--max-restarts", "3", str(script), str(tmp_path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    deadline = time.time() + 120
    while not all((tmp_path / f"{r}.pid").exists() for r in (0, 1)):
        assert time.time() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "restarting" not in err and "stopped by signal SIGTERM" in err
    for r in (0, 1):
        with pytest.raises(ProcessLookupError):
            os.kill(int((tmp_path / f"{r}.pid").read_text()), 0)


# ---------------------------------------------------------------- Parallel(max_restarts=N)
KILLS_ITSELF = """
import os, signal, sys, onedist as od

def train(local_rank, out):
    attempt = od.restart_count()
    with open(os.path.join(out, f"{attempt}-{od.get_rank()}"), "w") as f:
        f.write(f"{os.getpid()} {os.environ['MASTER_PORT']}")
    if attempt == 0 and od.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would
    return od.all_reduce(attempt)

if __name__ == "__main__":
    with od.Parallel(backend="gloo", nproc_per_node=2, max_restarts=int(sys.argv[2])) as parallel:
        print("result", parallel.run(train, sys.argv[1]))
"""


@pytest.mark.parametrize("max_restarts", [1, 0])
def test_parallel_restarts_a_killed_worker(max_restarts, tmp_path):
    script, out = tmp_path / "kills.py", tmp_path / "out"
    script.write_text(KILLS_ITSELF)
    out.mkdir()
    shm_before = _shm()
    proc = pyfork.run(
        [sys.executable, str(script), str(out), str(max_restarts)],
        capture_output=True,
        text=True,
        timeout=180,
        env=clean_env(),
    )
    line = "onedist.spawn: rank 1 failed (exit code -9, killed by signal SIGKILL); restarting the workers"
    if max_restarts:
        assert proc.returncode == 0, proc.stderr
        assert "result 2" in proc.stdout  # attempt 1 on both ranks: od.restart_count() == 1
        assert f"{line} (attempt 1 of 1)" in proc.stderr, proc.stderr
        assert sorted(os.listdir(out)) == ["0-0", "0-1", "1-0", "1-1"]
    else:  # reported as before, not restarted
        assert proc.returncode == 1 and "restarting" not in proc.stderr, proc.stderr
        assert "WorkerFailedError" in proc.stderr and "was killed by signal SIGKILL" in proc.stderr
    workers = [tuple(map(int, (out / name).read_text().split())) for name in os.listdir(out)]
    for pid, _ in workers:  # every worker of every attempt has ended
        assert not _alive(pid)
    assert _shm() == shm_before
    free = subprocess.run([sys.executable, "-c", bind_check({p for _, p in workers})], capture_output=True)
    assert free.stdout == b"free\n", free.stderr


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_restarts": -1}, "max_restarts=-1 is not allowed; allowed: an int >= 0"),
        ({"max_restarts": "2"}, "max_restarts has type str ('2'); allowed: an int >= 0"),
        ({"max_restarts": True}, "max_restarts has type bool (True); allowed: an int >= 0"),
        ({"max_restarts": 1.0}, "max_restarts has type float (1.0); allowed: an int >= 0"),
        (
            {"max_restarts": 1, "nnodes": 2, "node_rank": 0, "master_port": 29999},
            "max_restarts=1 is not allowed; allowed: 0 with nnodes=2",
        ),
        (
            {"max_restarts": 1, "start_method": "subprocess"},
            "max_restarts=1 is not allowed; allowed: 0 with start_method='subprocess'",
        ),
    ],
)
def test_bad_max_restarts_are_refused_before_anything_starts(kwargs, message):
    import onedist as od

    with pytest.raises(ValueError if "not allowed" in message else TypeError, match=re.escape(message)):
        od.Parallel(backend="gloo", nproc_per_node=2, **kwargs)
    if "start_method" not in kwargs:  # the same check in spawn
        with pytest.raises(Exception, match=re.escape(message.replace("Parallel", "spawn"))):
            od.spawn("gloo", print, nproc_per_node=2, **kwargs)
