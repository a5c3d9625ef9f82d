"""Run torch's own backend-generic distributed tests on gloo (the control), shm and mpi4py; compare.

torch's ``DistributedTest._DistTestBase`` (``torch.testing._internal.distributed.distributed_test``,
what ``test/distributed/test_distributed_spawn.py`` runs) is the judge of onedist's process
groups: every test that passes on gloo must pass on ``shm`` and on ``mpi4py`` in the same runner,
except the entries of ``torch_expected.EXEMPT`` (each with its reason). torch's skip decorators
are evaluated as for gloo (see torch_dist_cases.py), so the CPU features torch gates to gloo by
name run on both. Passes:

* ``fork-ws2``, ``fork-ws3``: torch's harness, one forked process per rank for each test, on
  gloo and on shm;
* ``mpirun-ws2``: every test in-process on each rank of ``mpirun -np 2`` (torch's old
  ``TestMPI``), on gloo and on mpi4py, whose ranks must be MPI processes. A world that hangs or
  crashes in a test is stopped; that test fails and the run goes on from the next one.

The six runs (each pass on gloo and on its subject) go two at a time: they mostly wait on torch's
per-test process start-ups and barriers (385 s one after another, 207 s two at a time, the same
outcomes; three at a time saved another 35 s but slowed each run by 15 %).

An entry of ``torch_expected.KNOWN_FAILURES`` must fail (strict: one that starts passing fails
the run too). Exit status 1 on any surprise; the closing ``N passed, M failed`` line counts the
surprises as failures, so it and the exit status agree. Where Open MPI's ``mpirun`` or an MPI
library for mpi4py is missing (only the README's pip install), ``mpirun-ws2`` is skipped with
the reason printed.

Usage::

    python3 tests/foreign/torch_suite.py [--passes fork-ws2,fork-ws3,mpirun-ws2] [-k EXPR] [--verbose]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import reference  # noqa: E402
import sabotage  # noqa: E402
from suite_compare import Outcomes, compare, fold, read_jsonl  # noqa: E402
from torch_expected import EXEMPT, KNOWN_FAILURES  # noqa: E402

from bytecode import write_bytecode  # noqa: E402
from prereqs import mpirun_missing  # noqa: E402

#: pass name -> (harness, world size, backends under test beside the gloo control)
PASSES = {
    "fork-ws2": ("fork", 2, ("shm",)),
    "fork-ws3": ("fork", 3, ("shm",)),
    "mpirun-ws2": ("mpirun", 2, ("mpi4py",)),
}
# a test of the in-process harness that runs longer than this is stopped (torch's group timeout
# for most tests is 60 s: a rank left waiting by its peer's failure gives up before)
INPROC_DEADLINE_S = 150.0
#: runs at once (see run_passes)
LANES = 2
#: the files that decide which of torch's tests the control (gloo) runs, and how (reference.py)
CONTROL_INPUTS = [HERE / name for name in ("torch_dist_cases.py", "torch_inproc.py", "outcomes_plugin.py")]


def base_env(backend: str, world_size: int, temp_dir: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "MASTER_PORT")}
    env.update(WORLD_SIZE=str(world_size), TEMP_DIR=temp_dir, ONEDIST_TORCH_SUITE_BACKEND=backend)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


def fresh_temp_dir() -> str:
    """A folder laid out as torch's ``initialize_temp_directories`` does."""
    temp_dir = tempfile.mkdtemp(prefix="torch-suite-")
    for sub in ("barrier", "test_dir", "init_dir"):
        os.mkdir(os.path.join(temp_dir, sub))
    return temp_dir


def run_fork(backend: str, world_size: int, select: str) -> Outcomes:
    """test name -> outcome, torch's per-test processes (forked) under pytest."""
    temp_dir = fresh_temp_dir()
    try:
        with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as out:
            env = base_env(backend, world_size, temp_dir)
            env["ONEDIST_OUTCOMES"] = out.name
            cmd = [sys.executable, "-m", "pytest", str(HERE / "torch_dist_cases.py"), "-p", "outcomes_plugin"]
            cmd += ["-p", "no:cacheprovider", "-q", "--color=no", "-o", "addopts=", "--timeout=400"]
            cmd += ["-k", select] if select else []
            done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
            if done.returncode not in (0, 1):
                print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
            records = read_jsonl(Path(out.name))
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    for rec in records:
        rec["test"] = rec["nodeid"].rsplit("::", 1)[-1]
    return fold(records, "test")


def test_names(select: str) -> list[str]:
    """The tests of torch's class, in pytest's order, as pytest's ``-k`` selects them."""
    cmd = [sys.executable, "-m", "pytest", str(HERE / "torch_dist_cases.py"), "--collect-only", "-q"]
    cmd += ["-p", "no:cacheprovider", "-o", "addopts="] + (["-k", select] if select else [])
    env = base_env("gloo", 2, tempfile.gettempdir())
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    return [line.rsplit("::", 1)[-1] for line in done.stdout.splitlines() if "::" in line]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_mpirun(backend: str, world_size: int, select: str) -> Outcomes:
    """test name -> outcome, every test in-process on each rank of one mpirun, started again after
    a test that hangs or ends the world."""
    names = test_names(select)
    records: list[dict[str, str]] = []
    start = attempt = 0
    with tempfile.TemporaryDirectory(prefix="torch-suite-out-") as out:
        (Path(out) / "tests").write_text("\n".join(names), encoding="utf-8")
        while start < len(names):
            attempt += 1
            logs = [Path(out) / str(attempt) / f"rank{r}.jsonl" for r in range(world_size)]
            logs[0].parent.mkdir()
            stopped = _one_mpirun(backend, world_size, out, start, attempt, logs)
            done = [read_jsonl(log) for log in logs]
            finished = [{rec["index"] for rec in recs if rec["outcome"] != "start"} for recs in done]
            records += [rec for recs in done for rec in recs if rec["outcome"] != "start"]
            complete = set.intersection(*finished)
            stuck = next((i for i in range(start, len(names)) if i not in complete), len(names))
            if stuck < len(names):  # the world ended or hung in this test: it failed on every rank
                why = stopped or "the world ended during this test (a rank crashed)"
                records.append({"index": stuck, "test": names[stuck], "outcome": "failed", "text": why})
            start = stuck + 1
    return fold(records, "test")


def _one_mpirun(backend: str, world_size: int, out: str, start: int, attempt: int, logs: list[Path]) -> str:
    """Run the tests from ``start`` under one mpirun; the reason it was stopped, if it was."""
    temp_dir = fresh_temp_dir()
    env = base_env(backend, world_size, temp_dir)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMPI_MCA_mpi_warn_on_fork="0")
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(world_size)]
    cmd += ["--bind-to", "none", sys.executable, str(HERE / "torch_inproc.py"), "--tests", f"{out}/tests"]
    cmd += ["--start", str(start), "--out", str(logs[0].parent), "--run-id", str(attempt)]
    stopped = ""
    with open(logs[0].parent / "output.txt", "w", encoding="utf-8") as output:
        proc = subprocess.Popen(cmd, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            current, since = -1, time.monotonic()
            while proc.poll() is None:
                time.sleep(0.5)
                newest = max((_last_start(log) for log in logs), default=-1)
                if newest != current:
                    current, since = newest, time.monotonic()
                elif time.monotonic() - since > INPROC_DEADLINE_S:
                    stopped = f"stopped: no rank finished this test within {INPROC_DEADLINE_S:.0f} s"
                    break
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            shutil.rmtree(temp_dir, ignore_errors=True)
    return stopped


def _last_start(log: Path) -> int:
    """The index of the last test a rank started (-1 before the first)."""
    starts = [int(rec["index"]) for rec in read_jsonl(log) if rec["outcome"] == "start"]
    return max(starts, default=-1)


def run_pass(name: str, backend: str, select: str) -> Outcomes:
    harness, world_size, _ = PASSES[name]
    begin = time.monotonic()
    found = (run_fork if harness == "fork" else run_mpirun)(backend, world_size, select)
    counts = {o: sum(1 for v, _ in found.values() if v == o) for o in ("passed", "skipped", "failed")}
    summary = ", ".join(f"{n} {o}" for o, n in counts.items())
    print(f"  {backend:7s} {name:10s} {time.monotonic() - begin:5.0f} s  {summary}", flush=True)
    return {f"{name}::{test}": outcome for test, outcome in found.items()}


def exempt_reason(key: str, backend: str) -> str | None:
    """The reason ``<pass>::<test>`` cannot apply to ``backend`` (entries name a test for every
    pass, or ``<pass>::<test>``)."""
    entry = EXEMPT.get(key) or EXEMPT.get(key.split("::", 1)[1])
    return entry[1] if entry and backend in entry[0] else None


def run_passes(names: list[str], select: str, control: bool = True) -> dict[tuple[str, str], Outcomes]:
    """(pass, backend) -> outcomes of every run of ``names`` (gloo's too with ``control``),
    ``LANES`` at a time (why: the module doc); each run has its own folders, store file or port."""
    controls = ("gloo",) if control else ()
    runs = [(name, backend) for name in names for backend in (*controls, *PASSES[name][2])]
    with ThreadPoolExecutor(max_workers=LANES) as pool:
        futures = {run: pool.submit(run_pass, run[0], run[1], select) for run in runs}
        return {run: future.result() for run, future in futures.items()}


#: what the self-check runs on a broken shm group (see self_check)
SELF_CHECK = "test_all_gather and not cuda and not complex and not object and not coalesced"


def self_check(recorded: Outcomes) -> bool:
    """Whether the recorded side catches a regression: torch's all_gather tests on shm broken on
    purpose (sabotage.py: each rank's part arrives off by one) must fail against it (~10 s)."""
    os.environ[sabotage.ENV_VAR] = "1"
    try:
        broken = {f"fork-ws2::{k}": v for k, v in run_fork("shm", 2, SELF_CHECK).items()}
    finally:
        del os.environ[sabotage.ENV_VAR]
    control = {k: v for k, v in recorded.items() if k in broken}
    return reference.caught(control, broken, lambda k: exempt_reason(k, "shm"), "shm (all_gather, fork-ws2)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--passes", default=",".join(PASSES), help="comma-separated: " + ", ".join(PASSES))
    parser.add_argument("-k", dest="select", default="", help="pytest -k expression (development)")
    parser.add_argument("--verbose", action="store_true", help="print every unexpected failure's text")
    parser.add_argument("--record", action="store_true", help="run gloo's side and record it (reference.py)")
    opts = parser.parse_args()
    write_bytecode(ROOT / "src", HERE)  # every rank of every run imports both (see bytecode.py)
    problems: list[str] = []
    lines = []
    passed = 0
    names = []
    for name in opts.passes.split(","):
        missing = mpirun_missing() if PASSES[name][0] == "mpirun" else None
        if missing:  # an optional part of the machine: said, not failed
            lines.append(f"  {name}: skipped, {missing}")
            print(f"  {name}: skipped, {missing}", flush=True)
        else:
            names.append(name)
    facts = reference.environment("torch", CONTROL_INPUTS, (PASSES, INPROC_DEADLINE_S))
    recorded = None if opts.record or opts.select else reference.load(facts, names)
    if recorded is not None:
        print(f"  gloo's side: recorded in {reference.describe(reference.path_for(facts))}", flush=True)
        if "fork-ws2" in names and not self_check(recorded):
            return 1
    outcomes = run_passes(names, opts.select, control=recorded is None)
    if recorded is None and not opts.select and names == list(PASSES):
        gloo = {k: v for name in names for k, v in outcomes[name, "gloo"].items()}
        written = reference.describe(reference.save(facts, names, gloo))
        print(f"  gloo's side recorded in {written} (commit it: later runs here skip it)", flush=True)
    for name in names:
        if recorded is not None:
            outcomes[name, "gloo"] = {k: v for k, v in recorded.items() if k.startswith(f"{name}::")}
        control = outcomes[name, "gloo"]
        if opts.verbose:
            failing = sorted(k for k, (o, _) in control.items() if o == "failed")
            print("\n".join(f"    (fails on gloo too) {k}" for k in failing))
        for backend in PASSES[name][2]:
            mine = outcomes[name, backend]
            known = [k for k, (backends, _) in KNOWN_FAILURES.items() if backend in backends]
            found = compare(control, mine, lambda k, b=backend: exempt_reason(k, b), known, backend)
            problems += found
            passing = [k for k, (o, _) in control.items() if o == "passed"]
            applicable = [k for k in passing if not exempt_reason(k, backend)]
            ok = [k for k in applicable if mine.get(k, ("",))[0] == "passed"]
            passed += len(ok)
            lines.append(
                f"  {name}: gloo passes {len(passing)}; {backend} passes {len(ok)} of the "
                f"{len(applicable)} applicable ({len(passing) - len(applicable)} exempt)"
            )
            if opts.verbose:
                for key in sorted(k for k in applicable if mine.get(k, ("",))[0] != "passed"):
                    print(f"--- {backend} {key}\n{mine.get(key, ('', 'not run'))[1][-2500:]}")
    print("torch's distributed suite (DistributedTest._DistTestBase):")
    print("\n".join(lines + ["  " + p for p in problems]))
    # each problem is one failure (a test that fails on onedist's backend, or a stale list entry):
    # the closing line and the exit status always agree
    print(f"{passed} passed, {len(problems)} failed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
