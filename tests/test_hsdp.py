"""sharding="hsdp": sharded within a node, replicated across nodes. Two network-namespace hosts of
2 ranks each under `onedist run` (test_netns.py's hosts: every byte between the nodes crosses a
veth), one node in a gloo pool, and the layout check."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest

import checks_hsdp
import checks_sharding
from conftest import Runner
from onedist.training.sharding import hsdp_shape
from run_helpers import onedist_command, outputs
from test_netns import hosts, needs_netns  # noqa: F401  (the module-scoped fixture)

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "hsdp_vs_ddp.py")
CHECKPOINT_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "hsdp_checkpoint.py")


def _on_two_hosts(start: Any, port: int, script: str, *args: str) -> list[dict[str, Any]]:
    """``script`` under onedist run on nodeA and nodeB, 2 ranks each: rank 0's RESULT line, after
    checking that both ended well and the ranks are where they should be."""
    cmd = ["--nnodes", "2", "-n", "2", "--master-addr", "nodeA", "--master-port", str(port)]
    procs = [
        start(node, [*onedist_command(*cmd, "--node-rank", str(k)), script, *args])
        for k, node in enumerate(("nodeA", "nodeB"))
    ]
    outs = outputs(procs, timeout=240)
    assert all(p.returncode == 0 for p in procs), outs
    result: list[dict[str, Any]] = json.loads(outs[0][0].split("RESULT ", 1)[1].splitlines()[0])
    assert [r["node"] for r in result] == ["nodeA", "nodeA", "nodeB", "nodeB"], result
    return result


@needs_netns
@pytest.mark.launcher
@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_hsdp_on_two_hosts_trains_like_ddp(hosts, backend):  # noqa: F811
    result = _on_two_hosts(hosts, 29541 + len(backend), SCRIPT, backend)
    assert all(r["mesh"] == [2, 2] and r["relative_difference"] <= 1e-5 for r in result), result


@needs_netns
@pytest.mark.launcher
def test_hsdp_on_two_hosts_builds_on_meta_and_resumes_a_sharded_checkpoint(hosts, tmp_path):  # noqa: F811
    """tests/checks_hsdp.py on 2 nodes x 2 ranks (gloo): a meta-built model initialised as the
    serial build; a checkpoint saved and resumed bit for bit, and loaded into an fsdp model."""
    folder = str(tmp_path)  # the namespaces share the file system
    result = _on_two_hosts(hosts, 29551, CHECKPOINT_SCRIPT, "gloo", folder)
    assert all(r["mesh"] == [2, 2] and r["output_difference"] <= 1e-6 for r in result), result


def test_hsdp_on_one_node_builds_on_meta_and_resumes_a_sharded_checkpoint(tmp_path):
    check = checks_hsdp.check_hsdp_meta_init_and_checkpoint_resume
    out = Runner(2, "gloo")(check, str(tmp_path), timeout=120)
    assert all(o["mesh"] == [2] for o in out), out


def test_hsdp_on_one_node_is_fsdp():
    out = Runner(2, "gloo")(checks_sharding.check_hsdp_trains_like_ddp)
    assert all(o["mesh"] == [2] for o in out), out


def test_hsdp_needs_the_same_number_of_ranks_on_every_node_numbered_node_by_node():
    assert hsdp_shape([(0, 0, 0, 2), (1, 0, 1, 2), (2, 1, 0, 2), (3, 1, 1, 2)]) == (2, 2)
    assert hsdp_shape([(r, 0, r, 3) for r in range(3)]) == (1, 3)
    uneven = [(0, 0, 0, 2), (1, 0, 1, 2), (2, 1, 0, 1)]  # srun -N2 -n3
    interleaved = [(0, 0, 0, 2), (1, 1, 0, 2), (2, 0, 1, 2), (3, 1, 1, 2)]
    for layouts, nodes in [(uneven, "[[0, 1], [2]]"), (interleaved, "[[0, 2], [1, 3]]")]:
        with pytest.raises(ValueError) as raised:
            hsdp_shape(layouts)
        message = str(raised.value)
        assert "sharding='hsdp' is not allowed; allowed: 'fsdp' (or 'hsdp' with the same number" in message
        assert f"here the nodes hold ranks {nodes}" in message, message
        assert "HINT: start as many processes on every node" in message, message


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
