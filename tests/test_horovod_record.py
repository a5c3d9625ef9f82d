"""Raw ``hvd.*`` calls on record (issue 49): under ``horovodrun -np 2 --gloo``, a call one rank
makes alone, or a different op, ends every rank with the verdict naming both lines; a rank outside
every call shows in the stall report with the waiting rank's ``hvd.*`` line; ``hvd.join`` renumbers.
The programs are tests/checks_horovod_record.py's cases. Skipped when Horovod's PyTorch extension is
not installed (``bash .ci/install_horovod.sh`` builds it).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from checks_horovod_record import site_line
from launch_env import clean_env
from onedist.backends.horovod import installed

pytestmark = [
    pytest.mark.skipif(
        not installed(), reason="Horovod's PyTorch extension is not installed (bash .ci/install_horovod.sh)"
    ),
    pytest.mark.launcher,
]

TESTS = Path(__file__).parent
CHECKS = str(TESTS / "checks_horovod_record.py")
MISMATCH = "the ranks are blocked in different collectives"


def _run(case: str, **env: str) -> tuple[int, str]:
    """Run one case on 2 ranks; its exit status and the ranks' output ("[r]<stderr>:..." lines)."""
    settings = {"HOROVOD_CYCLE_TIME": "10", "ONEDIST_STALL_REPORT_S": "0", **env}
    environ = clean_env("ONEDIST_", "HOROVOD_", **settings)
    environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), environ.get("PYTHONPATH")) if p)
    cmd = ["horovodrun", "-np", "2", "-H", "localhost:2", "--gloo", "python", "-c"]
    cmd.append(f"import checks_horovod_record as c; c.main({case!r})")
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=environ, cwd=TESTS)
    print(f"{case}: exit {proc.returncode} after {time.monotonic() - start:.1f} s")
    return proc.returncode, proc.stdout + proc.stderr


def _site(name: str) -> str:
    return f"{CHECKS}:{site_line(name)}"


def _rank_lines(out: str, rank: int) -> str:
    return "\n".join(line for line in out.splitlines() if line.startswith(f"[{rank}]<"))


def _assert_verdict_on_every_rank(out: str, *lines: str) -> None:
    for rank in (0, 1):
        mine = _rank_lines(out, rank)
        assert MISMATCH in mine, f"rank {rank} never said it:\n{out[-6000:]}"
    verdict = out[out.index(MISMATCH) :]
    for line in lines:
        assert line in verdict, f"{line} not named:\n{out[-6000:]}"


def test_a_lone_hvd_allreduce_against_od_barrier_ends_every_rank_naming_both_lines():
    rc, out = _run("alone")
    assert rc != 0, out[-4000:]
    lone = f"all_reduce(AVG, float32 x 4) at {_site('alone')}"
    _assert_verdict_on_every_rank(out, lone, f"at {_site('barrier')}")
    assert "alone done" not in out, out[-4000:]


def test_hvd_allreduce_against_hvd_allgather_is_a_mismatch_naming_both_lines():
    rc, out = _run("other_op")
    assert rc != 0, out[-4000:]
    reduce, gather = _site("allreduce"), _site("allgather")
    _assert_verdict_on_every_rank(
        out, f"all_reduce(SUM, float32 x 4) at {reduce}", f"all_gather(float32) at {gather}"
    )


def test_distributed_optimizer_gradients_against_od_barrier_name_the_backward_line():
    rc, out = _run("optimizer")
    assert rc != 0, out[-4000:]
    _assert_verdict_on_every_rank(out, f"at {_site('backward')}", f"at {_site('optimizer barrier')}")


def test_stall_report_names_the_waiting_ranks_hvd_line_and_the_job_then_completes():
    rc, out = _run("slow", ONEDIST_STALL_REPORT_S="3")
    assert rc == 0, out[-4000:]
    report = out[out.index("onedist: stall report") :]
    waits = re.search(
        r"rank 0 \(pid \d+ on [^)]*\): waits in all_reduce\(AVG, float32 x 4\) \(call \d+\) at (\S+),", report
    )
    assert waits is not None and waits.group(1) == _site("waits"), report[:3000]
    assert "rank 1 (pid" in report and "time.sleep(9)  # site: sleep" in report, report[:3000]
    assert MISMATCH not in out and "done" in _rank_lines(out, 0) and "done" in _rank_lines(out, 1)


def test_hvd_join_waits_on_record_and_the_calls_after_it_are_numbered_alike():
    rc, out = _run("join", ONEDIST_STALL_REPORT_S="3")
    assert rc != 0, out[-4000:]
    report = out[out.index("onedist: stall report") :]
    assert f"waits in hvd.join() (call 1) at {_site('join')}" in report, report[:3000]
    verdict = out[out.index(MISMATCH) :]
    assert verdict.startswith(f"{MISMATCH} (call 2 on group [0, 1]"), verdict
    _assert_verdict_on_every_rank(out, f"at {_site('after join')}", f"at {_site('barrier after join')}")


def test_wrapping_is_undone_at_finalize_and_absent_with_onedist_record_0():
    rc, out = _run("restored")
    assert rc == 0 and out.count("restored done") == 2, out[-4000:]
    rc, out = _run("off", ONEDIST_RECORD="0")
    assert rc == 0 and out.count("off done") == 2, out[-4000:]
