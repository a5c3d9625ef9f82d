"""The tests' forked Python processes (tests/pyfork.py) are what ``python ...`` would be, in what
the tests that use them rely on: the same probe run both ways reports the same."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pyfork
from launch_env import clean_env

PROBE = """
import atexit, json, os, signal, sys, threading
import torch
out = {
    "argv": sys.argv, "file": globals().get("__file__"), "name": __name__, "path": sys.path,
    "cwd": os.getcwd(), "env": {k: v for k, v in os.environ.items() if k.startswith("PYFORK_")},
    "in_path": os.environ["PYFORK_EXTRA"] in sys.path, "sid_own": os.getsid(0) == os.getpid(),
    "int_handler": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    "term_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    "threads": torch.get_num_threads(), "stdin": sys.stdin.read(),
}
print(json.dumps(out), flush=True)
print("to stderr", file=sys.stderr)
threading.Thread(target=lambda: print("thread joined", flush=True)).start()
atexit.register(lambda: print("atexit ran", flush=True))
left_open = open(sys.argv[1], "w"); left_open.write("flushed at exit")  # never closed by the script
raise SystemExit(int(sys.argv[2]))
"""


def _both(tmp_path: Path, argv_tail: list[str], **kwargs) -> list[subprocess.CompletedProcess]:
    runs = []
    for how in (subprocess.run, pyfork.run):
        runs.append(how([sys.executable, *argv_tail], capture_output=True, text=True, timeout=60, **kwargs))
    return runs


@pytest.mark.parametrize("new_session", [False, True])
def test_a_forked_script_sees_what_python_gives_it(tmp_path, new_session):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    extra = str(tmp_path / "extra")
    env = clean_env(PYFORK_X="1", PYFORK_EXTRA=extra, PYTHONPATH=extra, OMP_NUM_THREADS="1")
    outs = []
    for how in (subprocess.run, pyfork.run):
        left = tmp_path / "left.txt"
        left.unlink(missing_ok=True)
        proc = how(
            [sys.executable, "probe.py", str(left), "3"],
            input="from stdin",
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            cwd=tmp_path,
            start_new_session=new_session,
        )
        assert proc.returncode == 3, proc.stderr
        assert proc.stderr == "to stderr\n"
        lines = proc.stdout.splitlines()
        assert lines[1:] == ["thread joined", "atexit ran"], proc.stdout
        assert left.read_text() == "flushed at exit"
        outs.append(json.loads(lines[0]))
    python, forked = outs
    assert forked == python
    assert python["argv"][0] == "probe.py" and python["file"] == str(script) and python["in_path"]
    assert python["path"][:2] == [str(tmp_path), extra]  # the script's directory, then PYTHONPATH
    assert python["sid_own"] == new_session and python["threads"] == 1 and python["stdin"] == "from stdin"


def test_a_module_and_code_run_as_with_python_m_and_c(tmp_path):
    code = "import sys; print(sys.argv, __name__, repr(sys.path[0]))"
    python, forked = _both(tmp_path, ["-c", code, "x"], cwd=tmp_path)
    assert forked.stdout == python.stdout and python.stdout.startswith("['-c', 'x'] __main__ ''")
    python, forked = _both(tmp_path, ["-m", "json.tool", "--help"], cwd=tmp_path)
    assert (forked.returncode, forked.stdout) == (python.returncode, python.stdout) == (0, python.stdout)


def test_an_uncaught_error_prints_the_programs_traceback_only_and_exits_1(tmp_path):
    (tmp_path / "boom.py").write_text("def f():\n    raise ValueError('boom')\nf()\n")
    python, forked = _both(tmp_path, [str(tmp_path / "boom.py")])
    assert forked.returncode == python.returncode == 1
    assert forked.stderr == python.stderr and "pyfork" not in forked.stderr


def test_signals_and_timeouts_reach_the_forked_process(tmp_path):
    proc = pyfork.popen(
        [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert isinstance(proc, pyfork.Popen) and proc.stdout.readline() == "ready\n"
    with pytest.raises(subprocess.TimeoutExpired):
        proc.communicate(timeout=0.2)
    os.killpg(proc.pid, signal.SIGTERM)  # its own session: the group is its own
    assert proc.communicate(timeout=30) == ("", None) and proc.returncode == -signal.SIGTERM
    with pytest.raises(subprocess.TimeoutExpired):
        pyfork.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=0.5)


def test_a_forked_launcher_still_forks_its_workers_with_torch_loaded(tmp_path):
    """`onedist run` started this way runs one thread, so its workers are forked too and begin
    with torch and torch._dynamo loaded (what makes the suite's launches cheap)."""
    script = tmp_path / "w.py"
    script.write_text(
        "import resource, sys\n"
        "u = resource.getrusage(resource.RUSAGE_SELF)\n"
        "print('dynamo' if 'torch._dynamo' in sys.modules else 'fresh', u.ru_utime + u.ru_stime < 0.5)\n"
    )
    start = time.monotonic()
    proc = pyfork.run(
        [sys.executable, "-m", "onedist", "run", "-n", "2", "--no-prefix", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env("ONEDIST_"),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["dynamo True", "dynamo True"], (proc.stdout, time.monotonic() - start)
