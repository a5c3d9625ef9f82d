"""spawn / Parallel with real worker processes, failure propagation, and torchrun."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import onedist as od
import pyfork
import workers
from conftest import TORCHRUN_WORKER_ENV
from launch_env import clean_env
from onedist.launchers.launcher import Launcher
from onedist.launchers.report import Failure
from run_helpers import AGREE_SCRIPT, check_agree, start_looping

REPO = Path(__file__).resolve().parents[1]


def test_spawn_returns_every_local_rank_result():
    out = od.spawn("gloo", workers.report, args=("x",), nproc_per_node=4, start_method="fork")
    assert [o["local_rank_arg"] for o in out] == [0, 1, 2, 3]
    assert all(o["world_size"] == 4 and o["sum"] == 6 and o["nproc_per_node"] == 4 for o in out)
    assert len({o["pid"] for o in out}) == 4 and os.getpid() not in {o["pid"] for o in out}


@pytest.mark.launcher
def test_spawn_with_start_method_spawn_imports_the_function():
    out = od.spawn("gloo", workers.report, kwargs_dict={"tag": "s"}, nproc_per_node=2, start_method="spawn")
    assert [o["rank"] for o in out] == [0, 1] and out[0]["tag"] == "s"


@pytest.mark.parametrize(
    "how, headline",
    [
        ("raise", "rank 1 (local rank 1, pid {pid}) failed with ValueError: boom on rank 1"),
        ("exit", "rank 1 (local rank 1, pid {pid}) exited with code 3"),
        ("sys.exit", "rank 1 (local rank 1, pid {pid}) failed with SystemExit: 3"),
        ("kill", "rank 1 (local rank 1, pid {pid}) was killed by signal SIGKILL"),
    ],
)
def test_a_failing_worker_stops_the_others_and_is_reported_first(how, headline):
    t0 = time.monotonic()
    with pytest.raises(od.WorkerFailedError) as e:
        od.spawn("gloo", workers.fail_on, args=(1, how), nproc_per_node=3, start_method="fork", timeout=120)
    elapsed = time.monotonic() - t0
    err = e.value
    assert err.rank == 1 and err.local_rank == 1
    first_line = str(err).splitlines()[0]
    assert first_line.startswith("onedist: worker rank 1 (local rank 1, pid "), first_line
    assert headline.split("pid {pid})")[1] in first_line
    if how == "raise":
        assert "Traceback of rank 1" in str(err) and "in fail_on" in str(err)
        assert 'raise ValueError(f"boom on rank {bad_rank}")' in err.remote_traceback
        # it starts at the user's function, as mp.spawn's would without its wrapper frame
        first_frame = err.remote_traceback.splitlines()[1]
        assert first_frame.startswith(f'  File "{workers.__file__}"'), err.remote_traceback
    elif how != "sys.exit":
        assert err.exitcode == (3 if how == "exit" else -9)
    assert "rank 0:" in str(err) and "rank 2:" in str(err)  # the others are accounted for
    assert elapsed < 30, elapsed  # the waiting ranks were not left to the 120 s timeout


def test_a_result_that_cannot_be_pickled_comes_back_as_none():
    assert od.spawn("gloo", workers.unpicklable_on_rank_1, nproc_per_node=2, start_method="fork") == [0, None]


def test_system_exit_zero_is_success():
    assert od.spawn("gloo", workers.exit_zero, nproc_per_node=2, start_method="fork") == [None, None]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"nproc_per_node": 0}, r"nproc_per_node=0 is not allowed; allowed: an int >= 1"),
        ({"nproc_per_node": "2"}, "nproc_per_node has type str"),
        ({"nnodes": 2, "node_rank": 2, "master_port": 1234}, r"node_rank=2 is not allowed; allowed: 0..1"),
        ({"nnodes": 2}, r"master_port=None is not allowed.*nnodes > 1"),
        ({"master_port": 70000}, "master_port=70000"),
        ({"start_method": "thread"}, "start_method='thread'"),
        ({"init_method": "udp://x"}, "init_method='udp://x'"),
        ({"args": 3}, "args has type int"),
    ],
)
def test_spawn_bad_arguments(kwargs, match):
    with pytest.raises((od.OnedistValueError, od.OnedistTypeError), match=match):
        od.spawn("gloo", workers.report, **kwargs)


def test_spawn_unpicklable_function_says_how_to_fix():
    with pytest.raises(od.OnedistTypeError, match="(?s)fn has type function.*module level.*fork"):
        od.spawn("gloo", lambda i: i, nproc_per_node=2, start_method="spawn")
    with pytest.raises(od.BackendUnavailableError, match="xla-tpu"):
        od.spawn("xla-tpu", workers.report)


def test_parallel_refuses_spawn_arguments_the_launcher_contradicts(monkeypatch):
    # as a process that torchrun started sees it; nothing starts or initialises before the check
    for name, value in TORCHRUN_WORKER_ENV.items():
        monkeypatch.setenv(name, value)
    message = (
        "onedist.Parallel: nproc_per_node=3 is not allowed; allowed: 2, the value the launcher that "
        "started this process set\nHINT: an external launcher (torchrun, srun, ...) already started"
    )
    with pytest.raises(od.OnedistValueError, match=re.escape(message)):
        od.Parallel(backend="gloo", nproc_per_node=3)
    with pytest.raises(od.OnedistValueError, match="master_port=1234 is not allowed; allowed: 29555"):
        od.Parallel(backend="gloo", nproc_per_node=2, master_port=1234)
    assert od.Parallel(backend="gloo", nproc_per_node=2, master_port=29555).mode == "external"


@pytest.mark.parametrize("backend", ["mpi", "horovod"])
def test_backends_with_their_own_launcher_refuse_restarts(backend):
    if backend not in od.available_backends():
        pytest.skip(f"backend {backend!r} is not installed here")
    with pytest.raises(
        od.OnedistValueError, match=f"max_restarts=1 is not allowed; allowed: 0 with backend '{backend}'"
    ):
        od.spawn(backend, workers.report, nproc_per_node=2, max_restarts=1)


def test_xla_tpu_refuses_restarts(monkeypatch):
    # torch_xla is not installed here: pass the availability check, as on a TPU host, to reach
    # the check of what xmp.spawn cannot do
    monkeypatch.setattr("onedist.context.backend_class", lambda name: object)
    with pytest.raises(
        od.OnedistValueError, match="max_restarts=1 is not allowed; allowed: 0 with backend 'xla-tpu'"
    ):
        od.spawn("xla-tpu", workers.report, max_restarts=1)


def test_parallel_modes_serial_spawn_and_errors():
    with od.Parallel(backend=None) as p:
        assert p.mode == "serial"
        assert p.run(lambda i, x: (i, x, od.get_world_size()), 5) == (0, 5, 1)
    with od.Parallel(backend="gloo", nproc_per_node=2, start_method="fork") as p:
        assert p.mode == "spawn"
        res = p.run(workers.report, "par")
        assert res["rank"] == 0 and res["world_size"] == 2 and res["tag"] == "par"
    with od.Parallel(backend="gloo") as p:  # no launcher, no nproc: a group of one process
        assert p.run(lambda i: (i, od.get_world_size(), od.backend())) == (0, 1, "gloo")
    assert od.model_name() == "serial"
    with pytest.raises(od.OnedistValueError, match="should be also None, but given 2(.|\n)*nproc_per_node=2"):
        od.Parallel(backend=None, nproc_per_node=2)
    with pytest.raises(od.OnedistValueError, match="stat_method"):
        od.Parallel(backend="gloo", stat_method="fork")
    with pytest.raises(od.WorkerFailedError, match="boom on rank 0"):
        with od.Parallel(backend="gloo", nproc_per_node=2, start_method="fork") as p:
            p.run(workers.fail_on, 0, "raise")


@pytest.mark.parametrize(
    ("kwargs", "ignite_words", "given"),
    [
        ({"backend": "abc"}, "Unknown backend 'abc'. Available backends:", "backend='abc'"),
        ({"nnodes": 2}, "If backend is None, argument 'nnodes' should be also None", "nnodes=2"),
        ({"backend": "gloo", "nproc_per_node": -1}, "Argument nproc_per_node should positive", "=-1"),
        ({"backend": "gloo", "nproc_per_node": 1, "nnodes": -1}, "Argument nnodes should positive", "=-1"),
        (
            {"backend": "gloo", "nproc_per_node": 1, "nnodes": 2},
            "arguments node_rank should be given",
            "None",
        ),
        (
            {"backend": "gloo", "nproc_per_node": 1, "nnodes": 2, "node_rank": 2},
            "Argument node_rank should be between 0 and 1, but given 2",
            "node_rank=2",
        ),
        (
            {"backend": "gloo", "nproc_per_node": 1, "nnodes": 2, "node_rank": 1},
            "arguments master_addr and master_port or init_method should be specified",
            "master_port",
        ),
        (  # a documentation address (RFC 5737): never this machine; nothing is sent to it
            {"backend": "gloo", "nproc_per_node": 1, "init_method": "tcp://192.0.2.1:23456"},
            "will hang. To fix this, please configure MASTER_ADDR",
            "init_method='tcp://192.0.2.1:23456'",
        ),
    ],
)
def test_parallel_checks_its_arguments_as_ignite_does(kwargs, ignite_words, given):
    """Raised when constructed, in ignite's order and words, followed by onedist's given / allowed."""
    with pytest.raises(ValueError) as caught:
        od.Parallel(**kwargs)
    assert ignite_words in str(caught.value) and given in str(caught.value) and "allowed" in str(caught.value)


def test_parallel_takes_a_master_port_of_digits_and_logs_ignites_lines(caplog):
    p = od.Parallel(
        backend="gloo", nproc_per_node=2, nnodes=2, node_rank=1, master_addr="h", master_port="3344"
    )
    assert p.master_port == 3344
    p._log.propagate = True  # onedist's logger writes to stderr only; let caplog see it here
    try:
        with caplog.at_level("INFO", logger="onedist.Parallel"):
            p._log_start()
    finally:
        p._log.propagate = False
    text = caplog.text
    assert "Initialized distributed launcher with backend: 'gloo'" in text
    assert "nnodes: 2" in text and "master_addr: h" in text and "master_port: 3344" in text
    with pytest.raises(od.OnedistTypeError, match="master_port has type str"):
        od.Parallel(backend="gloo", nproc_per_node=2, master_port="x")


SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import onedist as od

    def main(local_rank, out):
        info = {"local_rank": local_rank, "rank": od.get_rank(), "world_size": od.get_world_size(),
                "nproc": od.get_nproc_per_node(), "sum": od.all_reduce(1),
                "ranks": od.all_gather(od.get_rank())}
        with open(f"{out}/{od.get_rank()}.json", "w") as f:
            json.dump(info, f)

    if __name__ == "__main__":
        with od.Parallel(backend="gloo", nproc_per_node=2) as parallel:
            assert parallel.mode == sys.argv[2], parallel.mode
            parallel.run(main, sys.argv[1])
    """
)


@pytest.mark.launcher
@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_same_script_under_python_and_torchrun(launcher, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    if launcher == "torchrun":
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(od._net.free_port()),
            str(script),
            str(tmp_path),
            "external",
        ]
    else:
        cmd = [sys.executable, str(script), str(tmp_path), "spawn"]
    proc = pyfork.run(cmd, capture_output=True, text=True, timeout=240, env=clean_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import json

    infos = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert [i["local_rank"] for i in infos] == [0, 1]
    assert all(
        i["world_size"] == 2 and i["nproc"] == 2 and i["sum"] == 2 and i["ranks"] == [0, 1] for i in infos
    )


@pytest.mark.launcher
def test_worker_error_under_python_script_exits_nonzero_with_rank_traceback(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(
        textwrap.dedent(
            """
            import onedist as od
            import torch

            def main(local_rank):
                if od.get_rank() == 1:
                    raise RuntimeError("disk full on rank 1")
                od.all_reduce(torch.ones(1))

            if __name__ == "__main__":
                with od.Parallel(backend="gloo", nproc_per_node=2) as p:
                    p.run(main)
            """
        )
    )
    proc = pyfork.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    assert proc.returncode != 0
    assert "WorkerFailedError: onedist: worker rank 1 (local rank 1" in proc.stderr
    assert "RuntimeError: disk full on rank 1" in proc.stderr


_LOOP = """
import os, sys
import torch
import onedist as od


def training(local_rank, out):
    t = torch.ones(4)
    od.all_reduce(t)
    with open(os.path.join(out, f"{od.get_rank()}.pid"), "w") as f:
        f.write(str(os.getpid()))
    while True:
        od.all_reduce(t)


if __name__ == "__main__":
    with od.Parallel(backend="gloo", nproc_per_node=2) as parallel:
        parallel.run(training, sys.argv[1])
"""


@pytest.mark.launcher
@pytest.mark.parametrize("to", ["process group", "parent only"])
def test_ctrl_c_shows_where_each_worker_was_and_stops_them(to, tmp_path):
    """Ctrl-C on a terminal sends SIGINT to the whole foreground process group (the parent and its
    workers); ``kill -INT <parent>`` to the parent alone. Either way every worker is gone, and the
    parent prints each worker's traceback with its rank (mp.spawn prints each child's; before,
    onedist printed only the parent's, 8 frames of launch.py and selectors)."""
    import signal

    script = tmp_path / "loop.py"
    script.write_text(_LOOP)
    proc, pids = start_looping([sys.executable, str(script), str(tmp_path)], tmp_path, 2, settle=0.5)
    t0 = time.time()
    if to == "process group":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert time.time() - t0 < 5.0, err
    assert proc.returncode == -signal.SIGINT, err
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert "onedist.spawn: interrupted; where each worker was:" in err, err
    for rank in range(2):
        assert f"[rank{rank}]: KeyboardInterrupt" in err, err
        assert f'[rank{rank}]:   File "{script}", line 13, in training' in err, err  # the loop's all_reduce
    assert "selectors.py" not in err and "in _watch" not in err, err  # the parent's frames end at spawn


def test_finalize_returns_once_the_gloo_threads_that_outlive_the_group_are_idle():
    # the README main job once ended with SIGABRT after it succeeded: a gloo thread of a group
    # that DDP keeps alive took the GIL while the interpreter finalized (see backends/_gloo_threads)
    rank0 = od.spawn("gloo", workers.finalize_while_gloo_is_busy, nproc_per_node=2, start_method="fork")[0]
    # the premise: DDP kept the group and its threads, and the callback ran on one of them
    assert rank0["gloo_threads"] > 0 and rank0["on_gloo_thread"], rank0
    assert rank0["napped"], rank0  # finalize waited for it


class _Scripted(Launcher):
    """A Launcher whose attempts fail as scripted: the restart loop on its own, in this process
    (the real launchers' restarts run in test_restarts.py)."""

    name = "scripted"

    def __init__(self, failing_attempts: int, max_restarts: int) -> None:
        super().__init__(max_restarts)
        self.failing, self.numbers = failing_attempts, []

    def attempt(self, number: int) -> list[Failure]:
        self.numbers.append(number)
        if number < self.failing:
            return [Failure(rank=1, local_rank=1, pid=None, when=0.0, exc_type="ValueError", message="boom")]
        return []

    def results(self) -> list:
        return ["done"]


@pytest.mark.parametrize("failing, max_restarts", [(0, 0), (2, 2), (3, 2), (1, 0)])
def test_the_restart_loop_restarts_while_allowed_then_raises_the_failure(failing, max_restarts, capsys):
    launcher = _Scripted(failing, max_restarts)
    if failing > max_restarts:
        with pytest.raises(od.WorkerFailedError, match="rank 1.*ValueError: boom"):
            launcher.launch()
    else:
        assert launcher.launch() == ["done"]
    assert launcher.numbers == list(range(min(failing, max_restarts) + 1))
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        f"scripted: rank 1 failed (ValueError: boom); restarting the workers (attempt {n} of {max_restarts})"
        for n in range(1, min(failing, max_restarts) + 1)
    ]


@pytest.mark.launcher
def test_torchrun_c10d_rendezvous_two_agents(tmp_path):
    """torchrun's dynamic rendezvous: two agents on one host, the same c10d endpoint and run id and
    no node rank; torchrun numbers the nodes as the agents join, and the onedist script (agree.py)
    gets the right ranks and layout from its variables."""
    endpoint = f"127.0.0.1:{od._net.free_port()}"
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "job1"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", *rdzv]
    env = clean_env(TMPDIR=str(tmp_path))  # torchrun's log folders
    agents = [
        subprocess.Popen(
            [*cmd, AGREE_SCRIPT, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    try:
        outs = [a.communicate(timeout=240) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    assert all(a.returncode == 0 for a in agents), outs
    check_agree(tmp_path, 2, nnodes=2)


# ---------------------------------------------------------------------------- a failing rank under torchrun
TORCHRUN_FAILING = REPO / "tests" / "scripts" / "launchpage_torchrun.py"
_torchrun_runs: dict[str, tuple[subprocess.CompletedProcess, Path]] = {}


def _torchrun_failing(how: str, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """``torchrun --standalone --nproc-per-node 2 launchpage_torchrun.py OUT how``, run once per
    ``how`` for the tests below: rank 1 raises, calls ``sys.exit(3)`` or is SIGKILLed while rank 0
    waits in a barrier. Nothing of a launcher is inherited, and no ``OMP_NUM_THREADS``: torchrun
    sets it. TMPDIR is the run's folder (torchrun leaves its error files there)."""
    if how not in _torchrun_runs:
        out = tmp_path_factory.mktemp(f"torchrun-{how}")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        proc = subprocess.run(
            [*cmd, str(TORCHRUN_FAILING), str(out), how],
            capture_output=True,
            text=True,
            timeout=240,
            env=clean_env("OMP_NUM_THREADS", TMPDIR=str(out)),
            cwd=out,
        )
        _torchrun_runs[how] = (proc, out)
    return _torchrun_runs[how]


_TORCHRUN_FAILURE = re.compile(
    r"\[\d+\]:\n\s+time\s+: .*\n\s+host\s+: .*\n\s+rank\s+: (?P<rank>\d+) \(local_rank: \d+\)\n"
    r"\s+exitcode\s+: (?P<exitcode>-?\d+) .*\n\s+error_file: (?P<error_file>.*)\n"
    r"\s+traceback : (?P<traceback>.*?)\n(?:-{20,}|={20,})",
    re.DOTALL,
)


def _torchrun_failures(stderr: str) -> dict[str, dict[str, str]]:
    """torchrun's closing report: each failed rank's entry, and which one is the "Root Cause"."""
    failures, root = stderr.partition("Root Cause (first observed failure):")[::2]
    found = {m["rank"]: m.groupdict() for m in _TORCHRUN_FAILURE.finditer(failures)}
    cause = _TORCHRUN_FAILURE.search(root)
    assert cause is not None, f"no Root Cause in torchrun's output:\n{stderr[-3000:]}"
    found[cause["rank"]] = {**cause.groupdict(), "root_cause": "yes"}
    return found


def _facts(proc: subprocess.CompletedProcess, out: Path) -> list[dict]:
    """What each rank wrote once the group formed (before rank 1 failed)."""
    import json

    missing = [r for r in range(2) if not (out / f"{r}.json").exists()]
    assert not missing, f"ranks {missing} never got a group:\n{proc.stderr[-3000:]}"
    return [json.loads((out / f"{r}.json").read_text()) for r in range(2)]


@pytest.mark.launcher
def test_under_torchrun_the_group_joins_the_agents_store(tmp_path_factory):
    """TORCHELASTIC_USE_AGENT_STORE: the socket listening on MASTER_PORT is the agent's (each
    worker's parent); no worker, rank 0 included, listens there with a store of its own."""
    proc, out = _torchrun_failing("raise", tmp_path_factory)
    facts = _facts(proc, out)
    assert [(f["store_listener_parent"], f["store_listener_here"]) for f in facts] == [(True, False)] * 2, (
        facts,
        proc.stderr[-3000:],
    )


@pytest.mark.launcher
def test_onedist_leaves_torchruns_omp_num_threads_alone(tmp_path_factory):
    """torchrun sets OMP_NUM_THREADS=1 when it was not set; the group formed, it is still 1 and
    torch computes with 1 thread."""
    proc, out = _torchrun_failing("raise", tmp_path_factory)
    facts = _facts(proc, out)
    assert [(f["omp_num_threads"], f["threads"]) for f in facts] == [("1", 1)] * 2, (
        facts,
        proc.stderr[-3000:],
    )


@pytest.mark.launcher
def test_torchruns_root_cause_shows_the_error_file_onedist_wrote(tmp_path_factory):
    """No @record in the script: onedist writes TORCHELASTIC_ERROR_FILE, so torchrun's "Root
    Cause" is rank 1 with its exception and traceback, read from that file."""
    proc, _ = _torchrun_failing("raise", tmp_path_factory)
    failures = _torchrun_failures(proc.stderr)
    cause = failures["1"]
    assert cause.get("root_cause") == "yes" and cause["exitcode"] == "1", failures
    assert cause["error_file"].endswith("error.json"), failures  # not <N/A>: the file exists
    assert cause["traceback"].startswith("Traceback (most recent call last):"), failures
    assert "launchpage_torchrun.py" in cause["traceback"] and ", in main" in cause["traceback"], failures
    assert cause["traceback"].rstrip().endswith("ValueError: rank 1 failed on purpose"), failures


@pytest.mark.launcher
@pytest.mark.parametrize("how, exitcode", [("exit", "3"), ("kill", "-9")])
def test_a_worker_that_exits_or_is_killed_writes_no_error_file(how, exitcode, tmp_path_factory):
    """torchrun then shows the exit code (or signal) of rank 1 only, with no error file."""
    proc, _ = _torchrun_failing(how, tmp_path_factory)
    failures = _torchrun_failures(proc.stderr)
    assert failures["1"]["exitcode"] == exitcode, failures
    assert failures["1"]["error_file"] == "<N/A>", failures


@pytest.mark.launcher
def test_torchrun_exits_1_on_a_workers_sys_exit_3(tmp_path_factory):
    """torchrun's own status, whatever the worker's code (`onedist run` exits 3: test_run.py)."""
    proc, _ = _torchrun_failing("exit", tmp_path_factory)
    assert _torchrun_failures(proc.stderr)["1"]["exitcode"] == "3"
    assert proc.returncode == 1, proc.stderr[-3000:]


def _fail_with_an_error_file(local_rank: int, folder: str, existing: bool) -> None:
    """Rank 1 raises with TORCHELASTIC_ERROR_FILE pointing into ``folder`` (written before, if
    ``existing``) while rank 0 waits in a barrier."""
    od.barrier()
    if od.get_rank() == 1:
        path = os.path.join(folder, "error.json")
        os.environ["TORCHELASTIC_ERROR_FILE"] = path
        if existing:
            with open(path, "w") as f:
                f.write('{"message": "written before onedist"}')
        raise ValueError("rank 1 failed on purpose")
    od.barrier()


@pytest.mark.parametrize("existing", [False, True], ids=["absent", "existing"])
def test_a_failing_rank_writes_its_error_file_unless_it_exists(existing, tmp_path):
    """onedist writes torchelastic's error file (what @record writes) only where none exists."""
    import json

    with pytest.raises(od.WorkerFailedError, match="rank 1 failed on purpose"):
        od.spawn(
            "gloo",
            _fail_with_an_error_file,
            args=(str(tmp_path), existing),
            nproc_per_node=2,
            start_method="fork",
        )
    written = json.loads((tmp_path / "error.json").read_text())
    if existing:
        assert written == {"message": "written before onedist"}
    else:
        assert written["message"]["message"] == "ValueError: rank 1 failed on purpose", written
        callstack = written["message"]["extraInfo"]["py_callstack"]
        assert "in _fail_with_an_error_file" in callstack and callstack.rstrip().endswith(
            "ValueError: rank 1 failed on purpose"
        ), callstack
