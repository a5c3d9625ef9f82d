"""od.join (uneven data): the loop of issue 38 on gloo and shm pools of 2 and 3 ranks and serially,
against torch's Join replayed in one process (tests/checks_join.py) and torch's Join itself on
gloo; calls that need a finished rank; arguments; the digits example's --uneven switch under
Parallel and `onedist run`, and the uneven loop itself started by Parallel (mpirun for mpi4py) and
`onedist run`. mpi4py in a shared mpirun pool: test_mpi.py."""

from __future__ import annotations

import json
import os
import sys

import pytest

import checks_join
import pyfork
from conftest import Runner
from onedist.backends.shm import supported as shm_supported
from prereqs import mpirun_missing

HERE = os.path.dirname(os.path.abspath(__file__))
DIGITS = os.path.join(os.path.dirname(HERE), "examples", "digits.py")

WORLDS = [("gloo", 2), ("gloo", 3)] + ([("shm", 2), ("shm", 3)] if shm_supported() else [])


@pytest.mark.parametrize("backend, n", WORLDS, ids=[f"{b}-ws{n}" for b, n in WORLDS])
@pytest.mark.parametrize(
    "sync_bn, divide_by_world",
    [(False, True), (True, False)],
    ids=["ddp-by-world", "syncbn-by-ranks-in-loop"],
)
def test_uneven_loop_ends_with_torch_joins_weights_and_exact_metrics(backend, n, sync_bn, divide_by_world):
    out = Runner(n, backend)(checks_join.check_uneven_loop_equals_torch_join, sync_bn, divide_by_world)
    assert [o["steps"] for o in out] == [10 + 3 * r for r in range(n)], out


@pytest.mark.parametrize("backend", ["gloo"] + (["shm"] if shm_supported() else []))
def test_each_collective_is_over_the_ranks_still_in_their_loops(backend):
    assert Runner(3, backend)(checks_join.check_each_collective_over_the_ranks_still_in_their_loops) == [
        2,
        3,
        4,
    ]


@pytest.mark.parametrize("n", [2, 3])
def test_weights_equal_torch_join_itself_on_gloo(n):
    world = Runner(n, "gloo")
    ours = world(checks_join.check_uneven_loop_equals_torch_join, False, True)[0]["weights"]
    theirs = world(checks_join.check_torch_join_on_the_same_batches)[0]
    diff = max(abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(_flat(x), _flat(y)))
    assert diff <= 1e-6, diff


def _flat(value):
    return [v for row in value for v in _flat(row)] if isinstance(value, list) else [value]


def test_serially_od_join_does_nothing():
    out = Runner("serial")(checks_join.check_uneven_loop_equals_torch_join, True, True)
    assert out[0]["steps"] == 10


@pytest.mark.parametrize("backend", ["gloo"] + (["shm"] if shm_supported() else []))
def test_an_even_loop_inside_od_join_equals_the_loop_outside_it(backend):
    Runner(2, backend)(checks_join.check_even_loop_is_untouched)


@pytest.mark.parametrize("n", [2, 3])
def test_a_broadcast_from_a_finished_rank_raises_on_every_rank_at_once(n):
    out = Runner(n, "gloo")(checks_join.check_broadcast_from_a_finished_rank_raises_everywhere)
    assert all(o["seconds"] < 10 for o in out), out


def test_a_group_or_a_send_that_needs_a_finished_rank_raises_on_every_rank():
    out = Runner(3, "gloo")(checks_join.check_calls_that_need_a_finished_rank_raise)
    assert all(o == ["all_reduce:0", "send:0"] for o in out), out


@pytest.mark.parametrize("world", ["serial", 2], ids=["serial", "gloo-ws2"])
def test_bad_arguments_raise_naming_them(world):
    Runner(world, "gloo")(checks_join.check_join_arguments)


SCRIPT = os.path.join(HERE, "scripts", "join_uneven.py")
LAUNCHED = [
    ("parallel", "gloo", 3),
    ("parallel", "shm", 2),
    ("parallel", "mpi", 2),
    ("onedist-run", "gloo", 2),
]


@pytest.mark.slow
@pytest.mark.launcher
@pytest.mark.parametrize("launcher, backend, n", LAUNCHED, ids=[f"{a}-{b}-ws{n}" for a, b, n in LAUNCHED])
def test_uneven_loop_under_parallel_and_onedist_run(launcher, backend, n):
    """The same loop as above, started by od.Parallel (mpirun for mpi4py) and by `onedist run`."""
    if backend == "shm" and not shm_supported():
        pytest.skip("shm is not supported on this machine")
    if backend == "mpi" and mpirun_missing() is not None:
        pytest.skip(str(mpirun_missing()))
    if launcher == "parallel":
        cmd = [sys.executable, SCRIPT, backend, str(n)]
    else:
        cmd = [sys.executable, "-m", "onedist", "run", "-n", str(n), SCRIPT, backend, "0"]
    proc = pyfork.run(cmd, capture_output=True, text=True, timeout=240, cwd=HERE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert [o["steps"] for o in out] == [10 + 3 * r for r in range(n)], out
    assert all(o["difference"] <= 1e-6 for o in out), out


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["parallel", "onedist-run"])
def test_digits_uneven_ends_with_identical_parameters(launcher):
    """examples/digits.py --uneven (rank r trains on world_size - 1 - r batches fewer)."""
    if launcher == "parallel":
        cmd = [sys.executable, DIGITS, "--nproc-per-node", "3", "--backend", "gloo"]
    else:
        cmd = [sys.executable, "-m", "onedist", "run", "-n", "2", DIGITS, "--backend", "gloo"]
    proc = pyfork.run(
        [*cmd, "--uneven", "--epochs", "2", "--target", "0.5"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=HERE,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "parameters identical on" in proc.stdout, proc.stdout


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("sharding", [None, "fsdp"], ids=["ddp", "fsdp"])
def test_an_even_loop_makes_one_step_check_per_forward_and_sends_nothing_at_its_end(n, sharding):
    out = Runner(n, "gloo")(
        checks_join.check_even_loop_sends_one_step_check_per_forward_and_nothing_at_the_end, sharding
    )
    step_check = ("all_reduce_", n + 4, "torch.int64")
    # the end: the ranks' last step check, answered with zeros; no parameters, buffers or states
    assert all(o == {"in_loop": [step_check] * 5, "at_end": [step_check]} for o in out), out


def test_a_sharded_model_adds_one_broadcast_per_step_check_once_a_rank_has_left():
    """Rank r with 2 + r steps on 3 ranks: the checks of steps 3 and 4 (rank 0, then rank 1 out)
    and the last one are each followed by the optimizer steps' broadcast_object (one 4 KiB
    broadcast); at the end, one more for the optimizer's hyperparameters."""
    out = Runner(3, "gloo")(
        checks_join.check_even_loop_sends_one_step_check_per_forward_and_nothing_at_the_end, "fsdp", True
    )
    names = [{k: [f"{c[0]}{c[1]}" for c in v] for k, v in o.items()} for o in out]
    check, sent = "all_reduce_7", "broadcast_4096"
    assert names[2] == {"in_loop": [check, check, check, sent, check, sent], "at_end": [check, sent, sent]}, (
        names
    )
    assert names[0] == {"in_loop": [check, check], "at_end": [check, sent] * 3 + [sent]}, names


def test_buffers_come_from_the_lowest_rank_still_in_its_loop():
    """torch's Join would take the highest: rank 2 once rank 0 has left, where this takes rank 1."""
    assert (
        Runner(3, "gloo")(checks_join.check_buffers_come_from_the_lowest_rank_in_its_loop) == [[2, 4, 6]] * 3
    )


def test_a_sharded_model_without_its_optimizer_and_a_zero_redundancy_optimizer_are_refused():
    Runner(2, "gloo")(
        checks_join.check_sharded_model_without_its_optimizer_and_zero_optimizer_raise_at_the_start
    )


@pytest.mark.parametrize("backend, n", WORLDS, ids=[f"{b}-ws{n}" for b, n in WORLDS])
@pytest.mark.parametrize(
    "divide_by_world, accumulate", [(True, 1), (False, 2)], ids=["by-world", "by-ranks-in-loop-no-sync"]
)
def test_a_sharded_model_ends_with_ddp_joins_weights_and_adamw_state(backend, n, divide_by_world, accumulate):
    """sharding='fsdp': the finished ranks' shadow steps and mirrored AdamW steps (an LR scheduler
    stepping every step) give the weights, buffers and AdamW state of DDP + od.join."""
    out = Runner(n, backend)(
        checks_join.check_sharded_uneven_loop_equals_ddp_join, divide_by_world, accumulate
    )
    assert [o["steps"] for o in out] == [10 + 3 * r for r in range(n)], out
    assert all(max(o["diffs"].values()) <= 1e-6 and o["moved"] > 0.01 for o in out), out


@pytest.mark.parametrize("backend", ["gloo"] + (["shm"] if shm_supported() else []))
def test_a_finished_rank_clips_its_shards_with_the_others(backend):
    out = Runner(3, backend)(checks_join.check_clipping_a_sharded_model_inside_join)
    assert out == [{"steps": 2 + 2 * r, "clipped": 6} for r in range(3)], out


@pytest.mark.parametrize("backend", ["gloo"] + (["shm"] if shm_supported() else []))
def test_a_sharded_model_with_a_rank_without_batches_and_evaluation_passes_equals_ddp_join(backend):
    """Rank 0 has no batch (it repeats rank 1's first), rank r 2 + r; an evaluation forward pass
    (eval mode, no gradients) before every other training step."""
    out = Runner(3, backend)(checks_join.check_sharded_uneven_loop_equals_ddp_join, True, 1, True)
    assert [o["steps"] for o in out] == [0, 3, 4], out


def test_a_checkpoint_inside_the_block_raises_once_rank_0_has_left(tmp_path):
    out = Runner(2, "gloo")(checks_join.check_checkpoint_inside_the_block_once_rank_0_has_left, str(tmp_path))
    expected = {"saved": [0], "error": {"call": "broadcast_object", "rank": 0}, "on_disk": 0}
    assert out == [expected] * 2, out


@pytest.mark.parametrize("n", [2, 3])
def test_debug_mode_names_a_collective_made_before_the_step_check(n):
    out = Runner(n, "gloo")(checks_join.check_debug_mode_names_a_collective_made_before_the_step_check)
    for o in out:
        lines = o["message"].splitlines()
        assert (
            lines[0]
            == f"onedist debug mode: the ranks of group {list(range(n))} called different collectives:"
        )
        assert (
            lines[1].startswith('  rank 0: join_step_check(value ["T", "torch.int64", ')
            and "checks_join.py:" in lines[1]
        )
        assert all(
            line.startswith(f'  rank {r}: all_reduce(op=SUM, value ["T", "torch.float32", [1]')
            for r, line in zip(range(1, n), lines[2:])
        ), lines
    assert len({o["message"] for o in out}) == 1, out  # the same verdict on every rank
