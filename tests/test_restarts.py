"""`onedist run --max-restarts N` for real: a worker SIGKILLed mid-training, the workers started
again, the training resumed from the newest checkpoint, and the final weights bit-identical to
an uninterrupted run's."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from test_run import _env, _onedist

pytestmark = [pytest.mark.launcher, pytest.mark.slow]

DIGITS = str(Path(__file__).parent.parent / "examples" / "digits.py")
EPOCHS = "4"  # 23 steps an epoch on 2 ranks: 92 steps
EVERY = 5

pytest.importorskip("sklearn", reason="the digits example needs scikit-learn (in the test extra)")


def _digits(ckpt: Path, final: Path) -> list[str]:
    return _onedist(
        "-n", "2", "--max-restarts", "3", DIGITS, "--backend", "gloo", "--epochs", EPOCHS,
        "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(EVERY), "--save-final", str(final),
    )  # fmt: skip


def _children(pid: int) -> dict[int, int]:
    """The launcher's workers: pid -> rank (read from /proc)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[1]) != pid:
                continue
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ranks = [int(v[5:]) for v in environ if v.startswith(b"RANK=")]
        if ranks:
            out[int(entry)] = ranks[0]
    return out


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["model"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    proc = subprocess.run(
        _digits(tmp / "ckpt", tmp / "final.pt"), capture_output=True, text=True, timeout=180, env=_env()
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "restarting" not in proc.stderr
    return _weights(tmp / "final.pt")


@pytest.mark.parametrize("seed", [1, 2])
def test_a_killed_worker_resumes_to_bit_identical_weights(seed, uninterrupted, tmp_path):
    kill_after = random.Random(seed).randrange(EVERY, 70, EVERY)  # the checkpoint to wait for
    victim = seed % 2  # rank 1 once (rank 0 hosts no store here: the launcher does), rank 0 once
    ckpt, final = tmp_path / "ckpt", tmp_path / "final.pt"
    t0 = time.monotonic()
    proc = subprocess.Popen(
        _digits(ckpt, final), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
    )
    seen: dict[int, int] = {}
    try:
        marker = ckpt / f"step_{kill_after:08d}.pt"
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() - t0 < 120, proc.communicate()
            seen.update(_children(proc.pid))
            time.sleep(0.005)
        workers = _children(proc.pid)
        seen.update(workers)
        pid = next(p for p, r in workers.items() if r == victim)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        restarted_at = None
        while proc.poll() is None:  # the restarted workers, for the orphan check
            new = _children(proc.pid).keys() - seen.keys()
            if new and restarted_at is None:
                restarted_at = time.monotonic()
            seen.update(dict.fromkeys(new, -1))
            time.sleep(0.02)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    restarts = re.findall(
        r"onedist run: rank (\d) failed \((.*?)\); restarting the workers \(attempt (\d) of 3\)", err
    )
    assert restarts[0] == (str(victim), "exit code -9, killed by signal SIGKILL", "1"), err[-3000:]
    resumed = re.search(r"resumed from step (\d+) \(restart 1\)", out)
    assert resumed and kill_after <= int(resumed.group(1)), out[-3000:]
    mine = _weights(final)
    assert mine.keys() == uninterrupted.keys()
    assert all(torch.equal(mine[k], uninterrupted[k]) for k in mine), (
        "weights differ from the uninterrupted run"
    )
    for pid in seen:  # no worker of any attempt left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert restarted_at is not None
    print(f"kill after step {kill_after} (rank {victim}), resumed from {resumed.group(1)}, "
          f"new workers {restarted_at - killed_at:.2f} s after the kill, "
          f"{time.monotonic() - killed_at:.1f} s from the kill to the end")  # fmt: skip


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
    proc = subprocess.run(
        _onedist("-n", "2", "--max-restarts", str(max_restarts), str(script), str(fails)),
        capture_output=True,
        text=True,
        timeout=180,
        env=_env(),
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
    proc = subprocess.Popen(
        _onedist("-n", "2", "--max-restarts", "3", str(script), str(tmp_path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
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
