"""Run pytorch-ignite's own ``tests/ignite/distributed`` on ignite and on onedist; compare.

ignite's suite is the judge of onedist's promise that an ignite user switches by changing one
import. The sdist of pytorch-ignite (which ships ``tests/``) is downloaded once, and its
distributed tests run three ways, as ignite's own CI runs them:

* ``serial``: ``-m "not distributed"``;
* ``ws2``: ``WORLD_SIZE=2 -m distributed -n 2 --dist=each`` (two xdist workers form the group);
* ``spawn``: ``-m distributed`` without ``WORLD_SIZE`` (spawn, Parallel and torchrun tests).

Each pass runs twice through the same command: on ignite itself (the control), and with
ignite's public modules resolved to onedist (:mod:`onedist.ignite_alias`, installed in every
process by a ``.pth`` file that this runner puts in site-packages for the run and that acts only
where ``ONEDIST_AS_IGNITE=1``: ignite's launcher tests replace ``PYTHONPATH`` for the scripts they
start, so a ``sitecustomize`` there would leave those scripts on ignite). Every test that passes
on ignite must pass on onedist, except the entries of ``ignite_expected.EXEMPT`` (each with its
reason); an entry of ``ignite_expected.KNOWN_FAILURES`` must fail (strict: one that starts
passing fails the run too, so the list only shrinks). Exit status 1 on any surprise, and the
closing ``N passed, M failed`` line counts every surprise as a failure. An EXEMPT entry whose
tests skip on ignite itself here (Horovod's, where Horovod is not built) is not judged: the run
prints the skip reason instead of calling the entry stale.

Where an exempt test also calls checks that do apply, ``ignite_split/`` runs those checks on
their own: its files are copied into ignite's test tree and compared like ignite's tests.

Usage::

    python3 tests/foreign/ignite_suite.py [--passes serial,ws2,spawn] [--verbose] [--record]
        [--tests utils/test_serial.py] [--sabotage]

ignite's side is recorded once per environment (:mod:`reference`): where ``reference/`` has the
file for this machine's facts, only onedist's side runs; ``--record`` runs ignite's side again
and rewrites it. ``--tests`` narrows both sides to one file or test; ``--sabotage`` breaks
onedist on purpose (:mod:`sabotage`), to show that a run against the recorded side fails then.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.append(str(HERE.parent))

import reference  # noqa: E402
from ignite_expected import EXEMPT, KNOWN_FAILURES  # noqa: E402
from suite_compare import Outcomes, compare, fold, read_jsonl  # noqa: E402

from bytecode import write_bytecode  # noqa: E402

VERSION = "0.5.5"
CACHE = HERE.parent.parent / "build" / "foreign"
PASSES = {
    "serial": (["-m", "not distributed"], {}),
    "ws2": (["-m", "distributed", "-n", "2", "--dist=each"], {"WORLD_SIZE": "2"}),
    "spawn": (["-m", "distributed"], {}),
}
TESTS = "tests/ignite/distributed"
PIP_DOWNLOAD = (sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps")
# a .pth line that starts with "import" is executed at every interpreter start; it imports
# onedist only where the variable asks for it
PTH = Path(sysconfig.get_paths()["purelib"]) / "onedist-ignite-alias.pth"
PTH_LINE = (
    'import os; os.environ.get("ONEDIST_AS_IGNITE") == "1" and '
    '__import__("onedist.ignite_alias").ignite_alias.install()\n'
)
# --sabotage: onedist broken on purpose in every process of onedist's side (see sabotage.py)
SABOTAGE_LINE = (
    'import os, sys; os.environ.get("ONEDIST_AS_IGNITE") == "1" and '
    f'(sys.path.insert(0, {str(HERE)!r}), __import__("sabotage").break_onedist_api())\n'
)
#: what the self-check runs with onedist broken (see self_check): ignite's serial tests of the
#: queries (world size, rank, ...), whose answers the break changes
SELF_CHECK = "tests/ignite/distributed/utils/test_serial.py"


def sdist_root() -> Path:
    """The unpacked pytorch-ignite sdist (downloaded from PyPI on first use)."""
    root = CACHE / f"pytorch_ignite-{VERSION}"
    if (root / "tests" / "ignite" / "distributed").is_dir():
        return root
    CACHE.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [*PIP_DOWNLOAD, "-d", str(CACHE), f"pytorch-ignite=={VERSION}"],
        check=True,
    )
    with tarfile.open(CACHE / f"pytorch_ignite-{VERSION}.tar.gz") as tar:
        tar.extractall(CACHE, filter="data")
    return root


def add_split_tests(root: Path) -> None:
    """Copy ``ignite_split/<name>.py`` beside ignite's tests as ``test_onedist_<name>.py`` (they
    import ignite's helpers and fixtures; named so that onedist's own pytest run skips them)."""
    for path in sorted((HERE / "ignite_split").glob("*.py")):
        shutil.copyfile(
            path, root / "tests" / "ignite" / "distributed" / "utils" / f"test_onedist_{path.name}"
        )


# ignite expands SLURM node lists with `scontrol` when it is installed (as in CI, for onedist's own
# SLURM tests); scontrol needs a configuration even for that, so both runs get a minimal one
SLURM_CONF = """ClusterName=ignite-suite
SlurmctldHost=localhost
NodeName=localhost CPUs=1 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES State=UP
"""


@contextmanager
def alias_pth(sabotage: bool = False) -> Iterator[None]:
    """The ``.pth`` file in site-packages for the duration of the run (removed after)."""
    PTH.write_text(PTH_LINE + (SABOTAGE_LINE if sabotage else ""), encoding="utf-8")
    try:
        yield
    finally:
        PTH.unlink(missing_ok=True)


def run_pass(root: Path, impl: str, name: str, tests: str = TESTS) -> Outcomes:
    """nodeid -> (outcome, failure text) of one pass on one implementation (of ``tests``: ignite's
    distributed tests, or a file or test among them)."""
    args, extra_env = PASSES[name]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(extra_env)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["ONEDIST_AS_IGNITE"] = "1" if impl == "onedist" else "0"
    if shutil.which("scontrol") and "SLURM_CONF" not in env:
        env["SLURM_CONF"] = str(CACHE / "slurm.conf")
        (CACHE / "slurm.conf").write_text(SLURM_CONF, encoding="utf-8")
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as out:
        env["ONEDIST_OUTCOMES"] = out.name
        cmd = [sys.executable, "-m", "pytest", tests, "-p", "outcomes_plugin"]
        cmd += ["-p", "no:cacheprovider", "-q", "--color=no", "--timeout=300", *args]
        start = time.monotonic()
        done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=2400)
        tail = done.stdout.strip().splitlines()[-1:] or ["(no output)"]
        print(f"  {impl:8s} {name:7s} {time.monotonic() - start:5.0f} s  {tail[0]}", flush=True)
        if done.returncode not in (0, 1):
            print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
        records = read_jsonl(Path(out.name))
        print(f"  {'':8s} {'':7s} slowest: {slowest(records)}", flush=True)
        return fold(records, "nodeid")


def slowest(records: list[dict[str, str]], n: int = 3) -> str:
    """The ``n`` tests of a pass that took longest (call phase), for whoever makes the suite faster."""
    seconds: dict[str, float] = {}  # a test's longest run (xdist's --dist=each runs it per worker)
    for r in records:
        if r["when"] == "call":
            seconds[r["nodeid"]] = max(seconds.get(r["nodeid"], 0.0), float(r.get("seconds", 0)))
    top = sorted(seconds.items(), key=lambda item: -item[1])[:n]
    return ", ".join(f"{nodeid.rsplit('/', 1)[-1]} {s:.0f} s" for nodeid, s in top)


def exempt_reason(key: str) -> str | None:
    """The reason ``<pass>::<node id>`` is exempt: its entry names the test function, for every
    pass and parameter."""
    function = key.split("::", 1)[1].split("[", 1)[0]
    return EXEMPT.get(function)


def stale_exempt(control: Outcomes) -> tuple[list[str], list[str]]:
    """(stale entries, unchecked entries) of EXEMPT, from ignite's outcomes of a run of every pass
    (an entry may name one pass's test).

    Stale: an entry that names no test passing on ignite. An entry whose tests all skipped on ignite
    here (Horovod's without Horovod built) cannot be judged on this machine: it is unchecked, and
    the run says why instead of failing."""
    stale, unchecked = [], []
    for function in sorted(EXEMPT):
        outcomes = [v for k, v in control.items() if _names(k.split("::", 1)[1], function)]
        if any(outcome == "passed" for outcome, _ in outcomes):
            continue
        if outcomes and all(outcome == "skipped" for outcome, _ in outcomes):
            reasons = sorted({_skip_reason(text) for _, text in outcomes})
            unchecked.append(
                f"EXEMPT entry not checked here, its tests skip on ignite ({'; '.join(reasons)}): {function}"
            )
        else:
            stale.append(f"EXEMPT but passes on ignite nowhere (stale entry): {function}")
    return stale, unchecked


def _skip_reason(text: str) -> str:
    """The reason in a skip report's text (``(file, line, 'Skipped: reason')``)."""
    return text.rsplit("Skipped: ", 1)[-1].strip(" ')\"\n") or "skipped"


def _names(nodeid: str, function: str) -> bool:
    """Whether ``nodeid`` is a test of ``function`` (any parameters), or its file skipped whole."""
    return nodeid == function or nodeid.startswith(function + "[") or function.startswith(nodeid + "::")


def control_facts() -> dict[str, str]:
    """What ignite's outcomes on ignite depend on (see reference.py)."""
    inputs = [HERE / "outcomes_plugin.py", *sorted((HERE / "ignite_split").glob("*.py"))]
    return reference.environment("ignite", inputs, (VERSION, PASSES, SLURM_CONF))


def recorded_control(facts: dict[str, str], passes: list[str], tests: str) -> Optional[Outcomes]:
    """ignite's outcomes of ``passes`` recorded under ``facts`` (those of ``tests``)."""
    control = reference.load(facts, passes)
    if control is None:
        return None
    return {k: v for k, v in control.items() if _under(k.split("::", 1)[1], tests)}


def _under(nodeid: str, tests: str) -> bool:
    """Whether pytest's ``nodeid`` is one of the tests that ``tests`` (a folder, file or test) names."""
    return nodeid == tests or nodeid.startswith(tuple(tests.rstrip("/") + end for end in ("/", "::", "[")))


def self_check(root: Path, recorded: Outcomes) -> bool:
    """Whether the recorded side catches a regression: ignite's serial tests of :data:`SELF_CHECK`
    on onedist broken on purpose (sabotage.py) must fail against it (~15 s)."""
    with alias_pth(sabotage=True):
        broken = {f"serial::{k}": v for k, v in run_pass(root, "onedist", "serial", SELF_CHECK).items()}
    control = {
        k: v
        for k, v in recorded.items()
        if k.startswith("serial::") and _under(k.split("::", 1)[1], SELF_CHECK)
    }
    return reference.caught(control, broken, exempt_reason, f"onedist ({SELF_CHECK.rsplit('/', 1)[-1]})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--passes", default="serial,ws2,spawn", help="comma-separated: serial, ws2, spawn")
    parser.add_argument("--verbose", action="store_true", help="print every onedist failure's text")
    parser.add_argument("--record", action="store_true", help="run ignite's side again, record it")
    parser.add_argument("--tests", default=TESTS, help=f"a file or test under {TESTS} (default: all of it)")
    parser.add_argument("--sabotage", action="store_true", help="break onedist on purpose (sabotage.py)")
    opts = parser.parse_args()
    passes = opts.passes.split(",")
    if not opts.tests.startswith(TESTS):  # a path under ignite's distributed tests
        opts.tests = f"{TESTS}/{opts.tests}"
    root = sdist_root()
    add_split_tests(root)
    # the workers of both sides import ignite's test modules, and onedist's side onedist
    write_bytecode(HERE.parent.parent / "src", root / "tests", HERE)
    facts = control_facts()
    recorded = None if opts.record else recorded_control(facts, passes, opts.tests)
    control: Outcomes = {} if recorded is None else recorded
    mine: Outcomes = {}
    impls = (("onedist", mine),) if recorded is not None else (("ignite", control), ("onedist", mine))
    if recorded is not None:
        print(f"  ignite's side: recorded in {reference.describe(reference.path_for(facts))}")
        # the self-check compares with the recorded serial pass, whatever --passes/--tests narrow
        whole = recorded_control(facts, list(PASSES), TESTS) or {}
        if not opts.sabotage and not self_check(root, whole):
            return 1
    with alias_pth(opts.sabotage):
        for name in passes:
            for impl, into in impls:
                found = run_pass(root, impl, name, opts.tests)
                into.update({f"{name}::{k}": v for k, v in found.items()})
    if recorded is None and opts.tests == TESTS and set(passes) == set(PASSES):
        written = reference.save(facts, passes, control)
        print(f"  ignite's side recorded in {reference.describe(written)} (commit it: runs here skip it)")
    passing = [k for k, (o, _) in control.items() if o == "passed"]
    applicable = [k for k in passing if not exempt_reason(k)]
    ok = [k for k in applicable if mine.get(k, ("",))[0] == "passed"]
    problems = compare(control, mine, exempt_reason, KNOWN_FAILURES, "onedist")
    unchecked: list[str] = []
    if set(opts.passes.split(",")) == set(PASSES):
        stale, unchecked = stale_exempt(control)
        problems += stale
    if opts.verbose:
        for key in sorted(k for k in applicable if mine.get(k, ("",))[0] != "passed"):
            print(f"--- {key}\n{mine.get(key, ('', 'not run'))[1][-2500:]}")
    print(f"ignite {VERSION} suite (tests/ignite/distributed, passes: {opts.passes}):")
    exempt, known = len(passing) - len(applicable), len(KNOWN_FAILURES)
    print(
        f"  ignite passes {len(passing)} tests; {exempt} of them are exempt (cannot apply to onedist; "
        f"{len(EXEMPT)} entries in ignite_expected.EXEMPT)"
    )
    print(f"  onedist passes {len(ok)} of the {len(applicable)} applicable; known failures listed: {known}")
    for line in unchecked + problems:
        print("  " + line)
    # every problem is one failure (a test that fails here, or a stale list entry): the closing
    # line and the exit status always agree
    print(f"{len(ok)} passed, {len(problems)} failed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
