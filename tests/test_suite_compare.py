"""The foreign suites' verdict: how ``tests/foreign`` folds a run's reports and compares onedist
(or shm, mpi4py) with its control (ignite, gloo), test by test.

The runners themselves take 20 minutes and run outside pytest; their verdict logic is checked
here on outcomes made up for the purpose, and the reports plugin on a real pytest run of a small
generated test file.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

FOREIGN = Path(__file__).resolve().parent / "foreign"
sys.path.insert(0, str(FOREIGN))

import ignite_suite  # noqa: E402
from suite_compare import compare, fold, read_jsonl  # noqa: E402


def _no_exemption(key: str) -> None:
    return None


def test_fold_keeps_the_worst_report_of_each_test() -> None:
    records = [
        {"nodeid": "a", "outcome": "passed"},
        {"nodeid": "a", "outcome": "failed", "longrepr": "boom"},  # a teardown error, another rank
        {"nodeid": "a", "outcome": "passed"},
        {"nodeid": "b", "outcome": "passed"},
        {"nodeid": "b", "outcome": "skipped", "longrepr": "no horovod"},
        {"nodeid": "c", "outcome": "xfailed"},
        {"nodeid": "d", "outcome": "skipped", "longrepr": "one xdist worker skipped"},
        {"nodeid": "d", "outcome": "failed", "longrepr": "the other failed"},
    ]
    assert fold(records, "nodeid") == {
        "a": ("failed", "boom"),
        "b": ("skipped", "no horovod"),
        "c": ("xfailed", ""),
        "d": ("failed", "the other failed"),
    }


def test_a_test_that_passes_on_the_control_must_pass_on_the_subject() -> None:
    control = {"p::ok": ("passed", ""), "p::bad": ("passed", ""), "p::gone": ("passed", "")}
    control["p::broken_there_too"] = ("failed", "")
    subject = {"p::ok": ("passed", ""), "p::bad": ("failed", "line 1\nAssertionError: 2 != 3")}
    subject["p::broken_there_too"] = ("failed", "")
    problems = compare(control, subject, _no_exemption, [], "onedist")
    assert problems == [
        "FAILED on onedist, passes on the control: p::bad\n      AssertionError: 2 != 3",
        "NOT RUN on onedist, passes on the control: p::gone\n      ",
    ]


def test_exempt_tests_are_not_judged() -> None:
    control = {"p::private": ("passed", "")}
    subject = {"p::private": ("failed", "asserts ignite's private class")}
    reason = {"p::private": "asserts on a private class"}.get
    assert compare(control, subject, reason, [], "onedist") == []


def test_known_failures_are_strict_both_ways() -> None:
    control = {"p::known": ("passed", ""), "p::fixed": ("passed", ""), "p::stale": ("failed", "")}
    subject = {"p::known": ("failed", ""), "p::fixed": ("passed", ""), "p::stale": ("failed", "")}
    known = ["p::known", "p::fixed", "p::stale", "other_pass::not_run_this_time"]
    assert compare(control, subject, _no_exemption, known, "shm") == [
        "PASSES NOW (remove from KNOWN_FAILURES): p::fixed",
        "LISTED but does not pass on the control (stale entry): p::stale",
    ]


def test_an_exempt_entry_is_stale_unless_it_passes_on_ignite_somewhere(monkeypatch) -> None:
    f = "tests/ignite/distributed/utils/test_x.py"
    monkeypatch.setattr(
        ignite_suite,
        "EXEMPT",
        {f"{f}::test_used": "r", f"{f}::test_hvd": "r", f"{f}::test_gone": "r"},
    )
    control = {
        f"serial::{f}::test_used[gloo]": ("failed", ""),
        f"spawn::{f}::test_used[nccl]": ("passed", ""),  # passes in one pass and parameter: used
        f"spawn::{f}::test_hvd": ("skipped", "('x.py', 3, 'Skipped: Skip if no Horovod dist support')"),
    }
    stale, unchecked = ignite_suite.stale_exempt(control)
    assert stale == [f"EXEMPT but passes on ignite nowhere (stale entry): {f}::test_gone"]
    assert unchecked == [
        "EXEMPT entry not checked here, its tests skip on ignite (Skip if no Horovod dist support): "
        f"{f}::test_hvd"
    ]
    assert ignite_suite.exempt_reason(f"ws2::{f}::test_used[gloo-2]") == "r"
    assert ignite_suite.exempt_reason(f"ws2::{f}::test_used_too") is None


SAMPLE = """
import pytest

def test_passes():
    pass

def test_fails():
    assert 1 == 2, "one is not two"

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass

@pytest.mark.xfail(reason="known")
def test_xfails():
    assert False

@pytest.fixture
def broken():
    yield
    raise RuntimeError("teardown broke")

def test_passes_then_teardown_fails(broken):
    pass
"""


def test_the_outcomes_plugin_records_what_pytest_saw(tmp_path) -> None:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "test_skipped_module.py").write_text(
        "import pytest\npytest.skip('no backend', allow_module_level=True)\n"
    )
    out = tmp_path / "outcomes.jsonl"
    env = {"PYTHONPATH": str(FOREIGN), "ONEDIST_OUTCOMES": str(out), "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "outcomes_plugin", "-p", "no:cacheprovider", "."]
    subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, timeout=120)
    outcomes = fold(read_jsonl(out), "nodeid")
    assert {k: v[0] for k, v in outcomes.items()} == {
        "test_sample.py::test_passes": "passed",
        "test_sample.py::test_fails": "failed",
        "test_sample.py::test_skipped": "skipped",
        "test_sample.py::test_xfails": "xfailed",
        "test_sample.py::test_passes_then_teardown_fails": "failed",
        "test_skipped_module.py": "skipped",
    }
    assert "one is not two" in outcomes["test_sample.py::test_fails"][1]
    assert "not here" in outcomes["test_sample.py::test_skipped"][1]
    assert "no backend" in outcomes["test_skipped_module.py"][1]
    assert read_jsonl(tmp_path / "absent.jsonl") == []


@pytest.mark.parametrize("pass_name", ["serial", "ws2", "spawn"])
def test_every_pass_is_run_on_ignite_and_onedist_the_same_way(pass_name, monkeypatch, tmp_path) -> None:
    """Both sides of a pass get the same pytest command; only ``ONEDIST_AS_IGNITE`` differs (the
    command is caught here, not run: the real runs are the runner's, in CI)."""
    seen = []

    def fake_run(cmd, cwd, env, **kwargs):
        seen.append((cmd, {k: v for k, v in env.items() if k != "ONEDIST_OUTCOMES"}))
        return subprocess.CompletedProcess(cmd, 0, "1 passed\n", "")

    monkeypatch.setattr(ignite_suite.subprocess, "run", fake_run)
    monkeypatch.setattr(ignite_suite, "CACHE", tmp_path)
    for impl in ("ignite", "onedist"):
        ignite_suite.run_pass(tmp_path, impl, pass_name)
    (cmd_a, env_a), (cmd_b, env_b) = seen
    assert cmd_a == cmd_b and env_a.pop("ONEDIST_AS_IGNITE") == "0" and env_b.pop("ONEDIST_AS_IGNITE") == "1"
    assert env_a == env_b
    assert ("WORLD_SIZE" in env_a) == (pass_name == "ws2")


def test_a_recorded_control_is_used_only_under_the_facts_it_was_recorded_under(monkeypatch, tmp_path) -> None:
    """reference.py: the outcomes come back for the same facts and the passes recorded; other
    facts (another torch, a changed runner file) or a pass not recorded find none, so the control
    runs. The texts are cut to what a verdict reads."""
    import reference

    monkeypatch.setattr(reference, "FOLDER", tmp_path)
    runner = tmp_path / "runner_input.py"
    runner.write_text("TESTS = 1\n")
    facts = reference.environment("ignite", [runner], ("serial", "spawn"))
    outcomes = {
        "serial::t.py::test_a": ("passed", "long text nobody reads"),
        "spawn::t.py::test_b": ("skipped", "('t.py', 3, 'Skipped: Skip if no GPU')"),
        "spawn::t.py::test_c": ("failed", "Traceback\n  ...\nAssertionError: 1 != 2"),
    }
    path = reference.save(facts, ["serial", "spawn"], outcomes)
    assert path.parent == tmp_path and path.name.startswith("ignite-")
    assert reference.load(facts, ["serial", "spawn"]) == {
        "serial::t.py::test_a": ("passed", ""),
        "spawn::t.py::test_b": ("skipped", "('t.py', 3, 'Skipped: Skip if no GPU')"),
        "spawn::t.py::test_c": ("failed", "AssertionError: 1 != 2"),
    }
    assert list(reference.load(facts, ["serial"]) or {}) == ["serial::t.py::test_a"]
    assert reference.load(facts, ["serial", "ws2"]) is None  # a pass never recorded
    assert reference.load({**facts, "torch": "2.99.0"}, ["serial"]) is None
    runner.write_text("TESTS = 2\n")  # the runner's files decide which tests run: another key
    assert reference.load(reference.environment("ignite", [runner], ("serial", "spawn")), ["serial"]) is None
