"""Backend "mpi" on stock PyTorch wheels (onedist's process group over mpi4py), under real mpirun.

The wheels have no MPI process group; with mpi4py installed, ``initialize("mpi")`` registers
onedist's (backends/mpi.py). Here it runs the same core check module as gloo, every dtype and op
against values computed locally, the collectives gloo has no kernels for, DDP against DDP on gloo
in the same processes, the example, and the failure modes (a hang ends at the timeout, a crash
ends the job), all under Open MPI's ``mpirun``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import checks
import checks_full_checkpoint
import checks_join
import checks_large_models
import checks_loop
import checks_mpi4py
import checks_pg
import checks_sharded_checkpoint
import checks_sharding
import onedist as od
from launch_env import clean_env
from launchpool import LaunchPool
from prereqs import mpirun_missing
from test_launch import _facts
from test_shm import CORE_CHECKS

pytestmark = [
    pytest.mark.launcher,
    pytest.mark.skipif(mpirun_missing() is not None, reason=str(mpirun_missing())),
]

MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe"]
HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "scripts")
_pools: dict[int, LaunchPool] = {}


@pytest.fixture(scope="module", autouse=True)
def _close_pools():
    yield
    for pool in _pools.values():
        pool.close()
    _pools.clear()


def mpi_world(n: int) -> LaunchPool:
    """``n`` ranks started by ``mpirun -np n``, each with ``initialize("mpi")``; shared by the tests."""
    pool = _pools.get(n)
    if pool is None or pool.broken:
        # the shared checks size their tensors from the shm slot size: 64 KiB keeps them small
        pool = _pools[n] = LaunchPool(
            [*MPIRUN, "-np", str(n)], n, "mpi", env={"ONEDIST_SHM_CHUNK_MB": "0.0625"}
        )
    return pool


def test_mpi_is_available_on_this_torch_wheel():
    import torch.distributed as dist

    assert not dist.is_mpi_available()  # the wheel has no MPI: what runs below is onedist's group
    assert "mpi" in od.available_backends()


@pytest.mark.parametrize("check", CORE_CHECKS, ids=lambda f: f.__name__.removeprefix("check_"))
def test_core_checks_under_mpirun_np3(check):
    mpi_world(3).run(check, *(("mpi",) if check is checks.check_queries else ()))


@pytest.mark.parametrize("n", [2, 3])
def test_every_dtype_and_op_exact(n):
    assert mpi_world(n).run(checks_mpi4py.check_mpi_every_dtype_and_op_exact, timeout=120)[0] > 250


@pytest.mark.parametrize("n", [2, 3])
def test_all_reduce_equals_gloo_in_the_same_processes(n):
    assert mpi_world(n).run(checks_pg.check_all_reduce_equals_gloo, timeout=120)[0] > 200


@pytest.mark.parametrize("n", [2, 3])
def test_copy_collectives_equal_gloo(n):
    mpi_world(n).run(checks_pg.check_copy_collectives_equal_gloo, timeout=120)
    mpi_world(n).run(checks_pg.check_non_contiguous_and_views)


@pytest.mark.parametrize("n", [2, 3])
def test_exchanges_p2p_and_sub_groups(n):
    mpi_world(n).run(checks_mpi4py.check_mpi_exchanges)
    mpi_world(n).run(checks_pg.check_reduce_and_barrier_and_gloo_ops)
    mpi_world(n).run(checks_pg.check_sub_groups)


def test_sparse_all_reduce_and_a_barrier_timeout_as_gloo():
    mpi_world(3).run(checks_pg.check_sparse_all_reduce_sums_like_gloo)
    mpi_world(2).run(checks_pg.check_timeout_in_torchs_words)


def test_bad_arguments_raise_on_every_rank_and_leave_the_group_usable():
    assert mpi_world(3).run(checks_pg.check_bad_arguments_raise_and_leave_the_group_usable) == [18] * 3


def test_fsdp2_and_functional_collectives_equal_gloo():
    assert (
        max(mpi_world(2).run(checks_pg.check_fsdp2_and_functional_collectives_equal_gloo, timeout=120)) < 1e-5
    )


@pytest.mark.parametrize("n", [1, 2, 3])
def test_training_loop_accumulation_and_bf16_mixed(n):
    """od.no_sync / od.accumulate give the K-fold batch's weights with one exchange per window, and
    bf16-mixed computes in bfloat16 (the checks every backend runs, tests/checks_loop.py)."""
    for counted_by_onedist in (False, True):
        out = mpi_world(n).run(checks_loop.check_accumulation_equals_the_big_batch, counted_by_onedist)
        assert {o["exchanges_per_window"] for o in out} == {1 if n > 1 else 0}, out
    mpi_world(n).run(checks_loop.check_bf16_mixed_runs_the_forward_in_bfloat16)


@pytest.mark.parametrize("n", [2, 3])
def test_fsdp_trains_like_ddp_on_a_fraction_of_the_bytes(n, tmp_path):
    """auto_model(sharding="fsdp"), od.clip_grad_norm_, od.full_state_dict (tests/checks_sharding.py),
    and a sharded checkpoint's round trip (tests/checks_sharded_checkpoint.py)."""
    for clip in (False, True):
        mpi_world(n).run(
            checks_sharding.check_fsdp_trains_like_ddp_on_a_fraction_of_the_bytes, clip, timeout=120
        )
    mpi_world(n).run(checks_sharding.check_sharding_arguments)
    mpi_world(n).run(checks_sharding.check_accumulation_on_a_sharded_model, timeout=120)
    mpi_world(n).run(checks_sharding.check_full_state_dict_exports, str(tmp_path))
    (tmp_path / "round-trip").mkdir()
    mpi_world(n).run(
        checks_sharded_checkpoint.check_sharded_checkpoint_round_trip,
        str(tmp_path / "round-trip"),
        timeout=120,
    )


def test_a_meta_model_is_initialised_as_one_process_and_allocates_only_each_ranks_shards():
    """tests/checks_large_models.py under mpirun (mpi4py, 2 ranks): a model built under
    od.init_module(empty_init=True) gets the serial init's weights, and a 256 MiB one grows each
    rank's peak RSS by < 16 MiB to build, by at most its half + one layer + 16 MiB to shard."""
    out = mpi_world(2).run(checks_large_models.check_meta_init_equals_the_serial_init, "fsdp")
    assert all(o["sharded"] for o in out), out
    big = mpi_world(2).run(
        checks_large_models.check_a_large_meta_model_allocates_only_its_shards, timeout=120
    )
    print(big)
    assert all(o["held"] * 2 <= o["total"] * 1.01 for o in big), big


def test_a_one_file_checkpoint_loads_into_a_256_mib_meta_model_reading_only_each_ranks_shards(tmp_path):
    """tests/checks_full_checkpoint.py under mpirun (mpi4py, 2 ranks): building, sharding and
    loading a one-file checkpoint grows each rank's peak RSS by at most its half (twice: its shards
    and the file pages of its chunks) + the stated overhead; full_state_dict and
    save_checkpoint(full=True) gather a tensor at a time; 3 steps equal one process's."""
    path = str(tmp_path / "big.pt")
    total = checks_full_checkpoint.write_big_checkpoint(path, plain=False)
    out = mpi_world(2).run(
        checks_full_checkpoint.check_a_one_file_checkpoint_loads_into_shards_reading_only_their_bytes,
        path,
        total,
        str(tmp_path),
        timeout=180,
    )
    print(out)
    assert out[0]["max_difference"] <= 1e-5 and out[0]["moved"] >= 1e-3, out[0]


def test_a_sharded_checkpoint_saved_on_2_ranks_loads_on_3(tmp_path):
    """Sharded checkpoints over the mpi4py group: saved on 2 ranks, resharded by DCP onto 3."""
    mpi_world(2).run(checks_sharded_checkpoint.check_save_for_another_world, str(tmp_path), timeout=120)
    assert (
        mpi_world(3).run(checks_sharded_checkpoint.check_load_at_another_world, str(tmp_path), timeout=120)
        == [4] * 3
    )


def test_ddp_equals_ddp_on_gloo():
    assert max(mpi_world(3).run(checks_pg.check_ddp_equals_gloo, timeout=120)) < 1e-5


def _mpirun(n: int, *cmd: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)}
    start = time.monotonic()
    argv = [*MPIRUN, "-np", str(n), sys.executable, *cmd]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    return proc, time.monotonic() - start


def test_digits_example_trains_with_identical_parameters():
    example = os.path.join(os.path.dirname(HERE), "examples", "digits.py")
    proc, _ = _mpirun(3, example, "--backend", "mpi", "--epochs", "2", "--max-steps", "8", "--target", "0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "backend: mpi" in proc.stderr + proc.stdout
    assert "parameters identical on 3 process(es)" in proc.stdout
    # rank 0 hosts the store and leaves last: no rank's store call fails (torch would print a
    # C++ stack trace for it, "recvValue failed ... Connection was likely closed")
    assert "TCPStore" not in proc.stderr, proc.stderr[-3000:]


def test_a_barrier_nobody_else_calls_raises_at_the_timeout_naming_the_absent_rank():
    proc, took = _mpirun(3, os.path.join(HERE, "scripts", "mpi_failures.py"), "hang")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    for rank in (0, 2):  # each waiting rank raises (torch's words), naming rank 1
        raised = rf"\[rank{rank}\]: onedist.errors.OnedistTimeoutError: .*barrier on rank {rank}"
        assert re.search(raised, out), out
        assert f"[rank{rank}]: Ranks that never arrived: [1]" in out, out
    assert "Timed out waiting 3000ms" in out, out
    assert "unreachable" not in out
    assert took < 45, took  # 3 s timeout, not rank 1's 60 s sleep


def test_a_hang_in_a_blocking_call_ends_the_job_at_the_timeout_naming_the_collective():
    proc, took = _mpirun(3, os.path.join(HERE, "scripts", "mpi_failures.py"), "hang_in_all_reduce")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    # ranks 0 and 2 both wait in MPI_Allreduce; the first watchdog to fire aborts the job
    pattern = r"all_reduce on rank [02] of the world group did not complete within its timeout"
    assert re.search(pattern, out), out
    assert "unreachable" not in out
    assert took < 45, took  # 3 s timeout + the watchdog's 1 s tick + MPI_Abort, not rank 1's 60 s sleep


def test_a_crash_on_one_rank_ends_the_others_with_its_error():
    proc, took = _mpirun(3, os.path.join(HERE, "scripts", "mpi_failures.py"), "raise")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "boom on rank 1" in out, out
    assert "unreachable" not in out
    assert took < 45, took


# ============================================================================ spawn("mpi") through mpirun
@pytest.fixture
def launchpage_mpi(monkeypatch):
    """tests/scripts/launchpage_mpi.py, imported by name (as the ranks import it: a pool's ranks run
    from tests/scripts, spawn("mpi")'s ranks get this process's sys.path)."""
    monkeypatch.syspath_prepend(SCRIPTS)
    import launchpage_mpi

    return launchpage_mpi


def test_spawn_starts_the_ranks_through_mpirun(launchpage_mpi, monkeypatch):
    import workers

    # what spawn("mpi") adds for Open MPI: the variables that let it run as root (only when this
    # process is root), --oversubscribe when the ranks outnumber the cores
    monkeypatch.delenv("OMPI_ALLOW_RUN_AS_ROOT", raising=False)
    monkeypatch.delenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", raising=False)
    out = od.spawn("mpi", launchpage_mpi.report_with_launch, args=(2,), nproc_per_node=3)
    assert [report for report, _ in out] == [(r, 3, "mpi", r, r, 6) for r in range(3)]
    for _, launch in out:
        assert launch["mpirun"][launch["mpirun"].index("-np") + 1] == "3", launch
        assert ("--oversubscribe" in launch["mpirun"]) == ((os.cpu_count() or 1) < 3), launch
        root = "1" if os.geteuid() == 0 else None
        assert (launch["allow_run_as_root"], launch["allow_run_as_root_confirm"]) == (root, root), launch
    with od.Parallel(backend="mpi", nproc_per_node=2) as parallel:
        assert parallel.run(workers.mpi_report, 5) == (0, 2, "mpi", 0, 0, 10)  # rank 0's result


def test_spawn_failure_names_the_rank_and_its_traceback():
    import workers

    start = time.monotonic()
    with pytest.raises(od.WorkerFailedError, match=r"(?s)rank 1 .*ValueError: bad input on rank 1") as e:
        od.spawn("mpi", workers.fail_on_rank_1, nproc_per_node=3)
    assert e.value.rank == 1 and "fail_on_rank_1" in (e.value.remote_traceback or "")
    # rank 0 waits in a barrier, which polls MPI_Ibarrier in Python: the failure watcher's
    # RemoteRankError ends it there (or mpirun stops it first)
    consequence = (
        r"rank 0: (stopped by onedist after rank 1 failed|failed with RemoteRankError: .*rank 1's failure)"
    )
    assert re.search(consequence, str(e.value)), str(e.value)
    assert time.monotonic() - start < 60


def test_spawn_failure_does_not_list_ranks_that_had_finished_as_stopped():
    import workers

    with pytest.raises(od.WorkerFailedError, match="late failure on rank 1") as e:
        od.spawn("mpi", workers.fail_on_rank_1_after_the_others_return, nproc_per_node=3)
    assert "stopped" not in str(e.value), str(e.value)  # ranks 0 and 2 had returned their results


SCRIPT_FN = """
import onedist as od

def main(local_rank):  # defined in the script itself: each rank imports it as __mp_main__
    return od.all_reduce(local_rank + 1)

if __name__ == "__main__":
    print("results", od.spawn("mpi", main, nproc_per_node=2))
"""


def test_spawn_runs_a_function_defined_in_the_main_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT_FN)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "results [3, 3]" in proc.stdout


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        ({"nnodes": 2, "master_addr": "10.0.0.1", "master_port": 29500}, "nnodes"),
        ({"master_port": 29500}, "master_port"),
        ({"start_method": "fork"}, "start_method"),
    ],
)
def test_spawn_arguments_mpirun_cannot_honour(kwargs, arg):
    import workers

    with pytest.raises(od.OnedistValueError, match=rf"(?s){arg}.*with backend 'mpi'.*mpirun -np N -H"):
        od.spawn("mpi", workers.mpi_report, args=(1,), nproc_per_node=2, **kwargs)


@pytest.mark.parametrize("n", [2, 3])
def test_uneven_data_inside_od_join_ends_with_torch_joins_weights(n):
    """od.join on mpi4py: rank r with 10 + 3r batches, DDP (and SyncBatchNorm), a metrics
    all_reduce and an all_gather every step (tests/checks_join.py); a broadcast from a finished
    rank raises on every rank."""
    for sync_bn, divide_by_world in ((False, True), (True, False)):
        out = mpi_world(n).run(checks_join.check_uneven_loop_equals_torch_join, sync_bn, divide_by_world)
        assert [o["steps"] for o in out] == [10 + 3 * r for r in range(n)], out
    mpi_world(n).run(checks_join.check_broadcast_from_a_finished_rank_raises_everywhere)


def test_a_sharded_model_inside_od_join_ends_with_ddp_joins_weights_and_adamw_state():
    """sharding='fsdp' inside od.join on mpi4py (2 ranks, rank r with 10 + 3r batches): the
    finished rank's shadow steps give the weights, buffers and AdamW state of DDP + od.join, as on
    gloo and shm (tests/test_join.py)."""
    for divide_by_world, accumulate in ((True, 1), (False, 2)):
        out = mpi_world(2).run(
            checks_join.check_sharded_uneven_loop_equals_ddp_join, divide_by_world, accumulate, timeout=120
        )
        assert [o["steps"] for o in out] == [10, 13], out
        assert all(max(o["diffs"].values()) <= 1e-6 and o["moved"] > 0.01 for o in out), out


# ============================================================================ gloo under a user's mpirun
@pytest.fixture(scope="module")
def mpirun_failing_rank(tmp_path_factory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`mpirun -np 2 python launchpage_failing_rank.py OUT` (gloo; rank 1 logs at INFO, then raises
    while rank 0 waits in a barrier), run once for the tests below; no OMP_NUM_THREADS, and none
    of the variables onedist derives (MASTER_PORT, ...)."""
    out = tmp_path_factory.mktemp("mpirun-failing-rank")
    env = clean_env("GLOO_SOCKET_IFNAME", "OMP_NUM")
    script = os.path.join(SCRIPTS, "launchpage_failing_rank.py")
    proc = subprocess.run(
        [*MPIRUN, "-np", "2", sys.executable, script, str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    return proc, out


def test_mpirun_initialize_logs_each_variable_it_sets(mpirun_failing_rank):
    """Rank 1 with the INFO log on (mpi_env.py on docs/launchers/mpirun.md): one line per variable
    initialize exports for env://, in the page's order."""
    proc, out = mpirun_failing_rank
    port = _facts(proc, out)[1]["master_port"]
    lines = [
        line
        for line in proc.stdout.splitlines() + proc.stderr.splitlines()
        if line.startswith("onedist set ")
    ]
    expected = ["RANK=1", "WORLD_SIZE=2", "LOCAL_RANK=1", "LOCAL_WORLD_SIZE=2", "GROUP_RANK=0",
                "GROUP_WORLD_SIZE=1", "MASTER_ADDR=127.0.0.1", f"MASTER_PORT={port}"]  # fmt: skip
    assert [line.removesuffix(" (the environment did not set it)") for line in lines[:8]] == [
        f"onedist set {v}" for v in expected
    ], lines
    # gloo pinned to the loopback interface (its name: lo on Linux), and nothing else
    assert len(lines) == 9 and re.fullmatch(
        r"onedist set GLOO_SOCKET_IFNAME=\S+ \(the environment did not set it\)", lines[8]
    ), lines


def test_mpirun_rank_0_chooses_the_port_through_mpi4py(mpirun_failing_rank):
    """With mpi4py, rank 0 picks a free port and broadcasts it: every rank has it, and it is not the
    port derived from Open MPI's job id."""
    facts = _facts(*mpirun_failing_rank)
    assert {f["environment"] for f in facts} == {"openmpi"}, facts
    assert facts[0]["master_port"] == facts[1]["master_port"] != facts[0]["derived_port"], facts


def test_mpirun_leaves_torchs_thread_count_alone(mpirun_failing_rank):
    """No OMP_NUM_THREADS from mpirun, and torch's thread count once the group formed is the one
    torch chose itself before onedist ran."""
    facts = _facts(*mpirun_failing_rank)
    assert all(f["omp_num_threads"] is None for f in facts), facts
    assert [f["threads_after"] for f in facts] == [f["threads_before"] for f in facts], facts


def test_under_mpirun_the_waiting_ranks_raise_remote_rank_error_naming_the_failing_rank(mpirun_failing_rank):
    """Rank 0, waiting in a barrier when rank 1 raised, raises RemoteRankError naming rank 1 with its
    error (recorded by rank 0 as it is raised, before mpirun, seeing rank 1 exit, ends the job)."""
    proc, out = mpirun_failing_rank
    assert proc.returncode != 0, proc.stdout + proc.stderr
    raised = json.loads((out / "remote_error.json").read_text())  # rank 0's, in its barrier
    assert raised["rank"] == 1, raised
    assert "rank 1 failed, so this collective cannot complete" in raised["message"], raised
    assert "ValueError: rank 1 failed on purpose" in raised["message"], raised


def test_open_mpi_refuses_root_and_more_ranks_than_slots_without_its_flags():
    """Open MPI's own behaviour, behind the flags on docs/launchers/mpirun.md (no Python started)."""
    plain = clean_env("OMPI_", "PRTE_")  # no MCA settings
    more = str((os.cpu_count() or 1) + 1)

    def mpirun(*args: str, env: dict[str, str] = plain) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["mpirun", *args, "true"], capture_output=True, text=True, timeout=60, env=env)

    if os.geteuid() == 0:
        refused = mpirun("-np", "1")
        assert refused.returncode != 0 and "attempt to run as root" in refused.stdout + refused.stderr, (
            refused
        )
        allowed = {**plain, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
        assert mpirun("-np", "1", env=allowed).returncode == 0
    as_root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    too_many = mpirun(*as_root, "-np", more)
    assert too_many.returncode != 0, too_many
    assert "There are not enough slots available in the system" in too_many.stdout + too_many.stderr, too_many
    assert mpirun(*as_root, "--oversubscribe", "-np", more).returncode == 0


def test_backend_mpi_still_makes_the_rendezvous_store(launchpage_mpi):
    """Over mpi4py the collectives need no store, but onedist makes torch's TCPStore at the
    MASTER_ADDR:MASTER_PORT it derived from Open MPI's variables (failure reports, the layout)."""
    for seen in mpi_world(2).run(launchpage_mpi.check_rendezvous_store):
        assert (seen["backend"], seen["torch_backend"], seen["tcp_store"]) == ("mpi", "mpi4py", True), seen
        assert seen["address"] == seen["master"] and seen["joined"] == [True, True], seen
