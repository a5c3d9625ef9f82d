"""Parallel(start_method="subprocess"): the script re-runs itself for local ranks 1..N-1, for real."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

import onedist as od
import pyfork
from launch_env import clean_env
from onedist.launchers.reexec import command_line

SCRIPTS = Path(__file__).parent / "scripts"
SCRIPT = str(SCRIPTS / "reexec_script.py")


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    tmp = tmp_path / "tmp"  # where the parent makes its error-file folder: must be empty at the end
    tmp.mkdir(exist_ok=True)
    return clean_env("ONEDIST_", "REEXEC_", **{"TMPDIR": str(tmp), **extra})


def _run(tmp_path: Path, cmd: list[str], timeout: float = 120, **extra: str) -> subprocess.CompletedProcess:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    return pyfork.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=_env(tmp_path, **extra), cwd=SCRIPTS
    )


def _infos(out: Path, n: int) -> list[dict]:
    return [json.loads((out / f"{r}.json").read_text()) for r in range(n)]


def _check_agree(out: Path, n: int, offset: int) -> list[dict]:
    infos = _infos(out, n)
    assert [i["rank"] for i in infos] == list(range(n))
    assert [i["local_rank"] for i in infos] == list(range(n))
    assert [i["local_rank_arg"] for i in infos] == list(range(n))
    assert all(i["world_size"] == n and i["nproc_per_node"] == n and i["nnodes"] == 1 for i in infos)
    assert all(i["sum"] == n and i["ranks"] == list(range(n)) for i in infos)
    assert all(i["offset_sum"] == n * offset + n * (n - 1) // 2 for i in infos)
    assert [i["child"] for i in infos] == [False] + [True] * (n - 1)  # rank 0 is the process started
    assert len({i["pid"] for i in infos}) == n
    result = json.loads((out / "result.json").read_text())
    assert result["mode"] == "subprocess"
    assert result["result"] == infos[0]  # run returned rank 0's value
    return infos


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    except OSError:  # no /proc
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has ended


def _assert_all_gone(pids: list[int], deadline: float) -> None:
    while not all(_gone(p) for p in pids) and time.time() < deadline:
        time.sleep(0.05)
    assert all(_gone(p) for p in pids), [p for p in pids if not _gone(p)]


def _assert_clean(tmp_path: Path) -> None:
    assert list((tmp_path / "tmp").iterdir()) == []  # the error-file folder was removed


# ============================================================================ command line
def _fake_main(monkeypatch: pytest.MonkeyPatch, argv: list[str], file: str | None, spec: str | None) -> None:
    main = types.ModuleType("__main__")
    if file is not None:
        main.__file__ = file
    main.__spec__ = None if spec is None else types.SimpleNamespace(name=spec)  # type: ignore[assignment]
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", argv)


def test_command_line_of_a_script_and_of_modules(monkeypatch, tmp_path):
    script = str(tmp_path / "train.py")
    _fake_main(monkeypatch, [script, "--lr", "0.1"], script, None)
    cmd = command_line()
    assert cmd[0] == sys.executable and cmd[-3:] == [script, "--lr", "0.1"]
    assert cmd[1:-3] == subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]
    _fake_main(monkeypatch, ["/x/pkg/train.py", "a"], "/x/pkg/train.py", "pkg.train")
    assert command_line()[-3:] == ["-m", "pkg.train", "a"]
    _fake_main(monkeypatch, ["/x/pkg/__main__.py"], "/x/pkg/__main__.py", "pkg.__main__")
    assert command_line()[-2:] == ["-m", "pkg"]


@pytest.mark.parametrize("argv, file", [(["-c"], None), ([""], None), (["-"], "<stdin>"), (["x.py"], None)])
def test_command_line_refuses_what_cannot_be_rerun(monkeypatch, argv, file):
    _fake_main(monkeypatch, argv, file, None)
    with pytest.raises(od.OnedistValueError, match="start_method='subprocess' is not allowed") as e:
        command_line()
    assert "start_method='spawn'" in str(e.value) and "'fork'" in str(e.value)


# ============================================================================ real runs
@pytest.mark.launcher
@pytest.mark.parametrize("n", [2, 3])
def test_closure_defined_under_main_runs_on_every_rank(n, tmp_path):
    proc = _run(tmp_path, [sys.executable, SCRIPT, str(tmp_path / "out"), str(n)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    infos = _check_agree(tmp_path / "out", n, offset=100)
    _assert_all_gone([i["pid"] for i in infos], time.time() + 1)
    _assert_clean(tmp_path)


@pytest.mark.launcher
@pytest.mark.parametrize("module", ["reexecpkg.train", "reexecpkg"])
def test_module_run_with_dash_m_reruns_the_module(module, tmp_path):
    proc = _run(tmp_path, [sys.executable, "-m", module, str(tmp_path / "out"), "2"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check_agree(tmp_path / "out", 2, offset=7)
    _assert_clean(tmp_path)


@pytest.mark.launcher
@pytest.mark.parametrize(
    "how, parent_sleeps, headline",
    [
        ("raise", False, "failed with RuntimeError: rank 1 failed on purpose"),
        ("raise", True, "failed with RuntimeError: rank 1 failed on purpose"),
        ("exit", False, "exited with code 3 without raising an exception"),
    ],
    ids=["raise-parent-in-barrier", "raise-parent-in-sleep", "exit-parent-in-barrier"],
)
def test_a_failing_child_ends_the_run_quickly(how, parent_sleeps, headline, tmp_path):
    # rank 0 (the parent) waits in a barrier, where gloo sees rank 1 go, or sleeps in plain Python,
    # where only onedist's watcher can tell it (it raises WorkerFailedError in the main thread)
    out = tmp_path / "out"
    extra = {"REEXEC_SLEEP_RANK": "0"} if parent_sleeps else {}
    proc = _run(
        tmp_path,
        [sys.executable, SCRIPT, str(out), "2"],
        REEXEC_FAIL_RANK="1",
        REEXEC_FAIL_HOW=how,
        **extra,
    )
    ended = time.time()
    failed_at = float((out / "failed_at").read_text())
    assert proc.returncode == 1, proc.stderr
    assert ended - failed_at < 5, ended - failed_at
    err = proc.stderr
    pid = _infos(out, 2)[1]["pid"]
    assert f"WorkerFailedError: onedist: worker rank 1 (local rank 1, pid {pid}) {headline}" in err
    if how == "raise":
        # rank 1's own traceback comes first, then the parent's report with it first
        assert err.index("RuntimeError: rank 1 failed on purpose") < err.index("WorkerFailedError")
        assert "Traceback of rank 1" in err
    if not parent_sleeps:
        # the parent's own error, a consequence: gloo's, or onedist's RemoteRankError naming rank 1
        assert "rank 0: failed with RemoteRankError" in err or "rank 0: failed with RuntimeError" in err
        assert err.index("Traceback of rank 1" if how == "raise" else "exited with code 3") < err.index(
            "Other workers:"
        )
    _assert_all_gone([i["pid"] for i in _infos(out, 2)], failed_at + 5)
    _assert_clean(tmp_path)


@pytest.mark.launcher
def test_a_failing_parent_stops_the_child_and_its_exception_propagates(tmp_path):
    out = tmp_path / "out"
    proc = _run(tmp_path, [sys.executable, SCRIPT, str(out), "2"], REEXEC_FAIL_RANK="0")
    ended = time.time()
    failed_at = float((out / "failed_at").read_text())
    assert proc.returncode == 1
    assert ended - failed_at < 5, ended - failed_at
    assert "RuntimeError: rank 0 failed on purpose" in proc.stderr
    assert "WorkerFailedError" not in proc.stderr  # the parent's own exception, unchanged
    _assert_all_gone([i["pid"] for i in _infos(out, 2)], failed_at + 5)
    _assert_clean(tmp_path)


@pytest.mark.launcher
def test_a_parent_that_does_not_leave_fn_is_ended_with_the_report(tmp_path):
    # rank 0 swallows every exception (onedist's WorkerFailedError included) and stays in fn: the
    # watcher prints the report and ends the process
    out = tmp_path / "out"
    proc = _run(
        tmp_path, [sys.executable, SCRIPT, str(out), "2"], REEXEC_FAIL_RANK="1", REEXEC_STUCK_RANK="0"
    )
    ended = time.time()
    failed_at = float((out / "failed_at").read_text())
    assert proc.returncode == 1
    assert ended - failed_at < 5, ended - failed_at
    report = proc.stderr[proc.stderr.index("onedist: worker rank 1") :]
    assert report.startswith("onedist: worker rank 1 (local rank 1, pid ")
    assert "failed with RuntimeError: rank 1 failed on purpose" in report.splitlines()[0]
    assert "Traceback of rank 1" in report and "did not leave fn within 2 s" in report
    _assert_all_gone([i["pid"] for i in _infos(out, 2)], failed_at + 5)
    _assert_clean(tmp_path)


@pytest.mark.launcher
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_parent_stops_the_children(sig, tmp_path):
    # rank 1 sleeps; the parent (rank 0) waits for it in a barrier, inside gloo
    out = tmp_path / "out"
    out.mkdir()
    proc = pyfork.popen(
        [sys.executable, SCRIPT, str(out), "2"],
        stderr=subprocess.PIPE,
        text=True,
        env=_env(tmp_path, REEXEC_SLEEP_RANK="1"),
        cwd=SCRIPTS,
    )
    try:
        deadline = time.time() + 60
        while not (out / "sleeping").exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        sent = time.time()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert time.time() - sent < 5
    assert proc.returncode in (-sig, 128 + sig), (proc.returncode, err)
    _assert_all_gone([i["pid"] for i in _infos(out, 2)], sent + 5)
    _assert_clean(tmp_path)


def test_python_dash_c_gets_a_clear_error(tmp_path):
    code = "import onedist as od; od.Parallel(backend='gloo', nproc_per_node=2, start_method='subprocess')"
    proc = _run(tmp_path, [sys.executable, "-c", code])
    assert proc.returncode == 1
    assert "OnedistValueError: onedist.Parallel: start_method='subprocess' is not allowed" in proc.stderr
    assert "`python -c`" in proc.stderr and "start_method='spawn'" in proc.stderr
