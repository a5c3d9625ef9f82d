"""A rank that fails inside ``initialize`` before the group forms: the others raise, naming it.

Two independent processes with torchrun's variables and ``WORLD_SIZE=2``, as pytest-xdist runs
ignite's suite: without the announcement the surviving rank waited for the store's 30-minute
timeout. Each test bounds the run to well under that, and asserts the peer raised within 10 s.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import pyfork

pytestmark = pytest.mark.slow

_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    import torch.distributed  # initialize's imports, before the clocks start
    import onedist as od

    rank, bad = int(os.environ["RANK"]), os.environ["BAD_RANKS"].split(",")
    # both clocks start together: how long each process takes to import is the machine's load,
    # not what is measured
    ready = os.environ["READY_DIR"]
    open(os.path.join(ready, str(rank)), "w").close()
    while len(os.listdir(ready)) < 2:
        time.sleep(0.01)
    time.sleep(float(os.environ.get(f"LATE_{rank}", "0")))
    start = time.monotonic()
    try:
        if str(rank) in bad:
            od.initialize("gloo", timeout=-1)  # a bad argument on this rank only
        else:
            od.initialize("gloo", timeout=120)
        outcome = {"error": None}
        od.finalize()
    except Exception as e:
        outcome = {"error": type(e).__name__, "message": str(e), "rank": getattr(e, "rank", None)}
    outcome["seconds"] = time.monotonic() - start
    print(json.dumps(outcome))
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_two(bad_ranks: str, ready: Path, **late: str) -> dict[int, dict[str, object]]:
    """Both ranks' outcomes; ``LATE_<rank>="s"`` makes that rank start ``s`` seconds after the other."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2")
    env.update(BAD_RANKS=bad_ranks, READY_DIR=str(ready), **late)
    procs = {
        r: pyfork.popen(
            [sys.executable, "-c", _SCRIPT],
            env=dict(env, RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    }
    outcomes = {}
    for r, p in procs.items():
        out, err = p.communicate(timeout=90)
        assert p.returncode == 0, err
        outcomes[r] = json.loads(out.strip().splitlines()[-1])
    return outcomes


@pytest.mark.parametrize(("failing", "peer"), [(0, 1), (1, 0)])
def test_a_peer_of_a_rank_that_failed_in_initialize_raises_naming_it(
    failing: int, peer: int, tmp_path: Path
) -> None:
    outcomes = _run_two(str(failing), tmp_path)
    assert outcomes[failing]["error"] == "OnedistValueError"
    got = outcomes[peer]
    assert got["error"] == "RemoteRankError", got
    assert got["rank"] == failing
    assert f"rank {failing} failed in initialize" in str(got["message"])
    assert "timeout=-1 is not allowed" in str(got["message"])  # the failing rank's own error
    assert float(str(got["seconds"])) < 10


def test_a_late_rank_0_still_hears_of_a_peer_that_failed_in_initialize(tmp_path: Path) -> None:
    # rank 1 fails while rank 0, its store's host, is still 8 s away (slow imports on a loaded
    # node): rank 1 keeps trying to tell it (up to 10 s), and rank 0 raises at once instead of
    # waiting out its 120 s join timeout (with the old 3 s window, ~6 s with torch's retry, it did)
    outcomes = _run_two("1", tmp_path, LATE_0="8")
    assert outcomes[1]["error"] == "OnedistValueError"
    assert outcomes[0]["error"] == "RemoteRankError" and outcomes[0]["rank"] == 1, outcomes[0]
    assert float(str(outcomes[0]["seconds"])) < 5


def test_ranks_that_all_fail_in_initialize_each_raise_their_own_error_at_once(tmp_path: Path) -> None:
    outcomes = _run_two("0,1", tmp_path)
    for r in (0, 1):
        assert outcomes[r]["error"] == "OnedistValueError"
        assert float(str(outcomes[r]["seconds"])) < 5  # rank 0 does not hold its store for a reader
