"""The ``shm`` backend (shared-memory collectives for the ranks of one host), on real processes.

Correctness against gloo in the same processes (bit for bit for integers), the whole collective
check module of test_collectives.py, DDP equivalence, and what happens when a rank is killed.
Figures live in benchmarks/bench_shm.py, not here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import checks
import checks_eval
import checks_pg
import onedist as od
import workers
from conftest import Runner
from distpool import DistPool
from onedist.backends.shm import supported

pytestmark = pytest.mark.skipif(not supported(), reason="the shm backend needs Linux on x86-64")


@pytest.fixture(params=[2, 3, 4], ids=lambda w: f"ws{w}")
def shm(request: pytest.FixtureRequest) -> Runner:
    return Runner(request.param, backend="shm")


def test_available():
    assert "shm" in od.available_backends()


def test_slot_size_follows_the_setting_else_fits_the_l3_cache(monkeypatch):
    from onedist import OnedistValueError
    from onedist.backends.shm import segment as shm_module  # where the slot size is chosen

    MiB = 1 << 20
    l3 = shm_module._l3_bytes()  # this machine's, from sysfs
    assert l3 is None or l3 >= MiB
    monkeypatch.delenv("ONEDIST_SHM_CHUNK_MB", raising=False)
    monkeypatch.setattr(shm_module, "_l3_bytes", lambda: 32 * MiB)
    # one bank (ranks + 1 slots) in at most half the L3, 4 MiB at most, 256 KiB at least
    assert [shm_module._chunk_bytes(n) for n in (2, 4, 8, 64)] == [4 * MiB, 3 * MiB, 1792 << 10, 256 << 10]
    monkeypatch.setattr(shm_module, "_l3_bytes", lambda: None)
    assert shm_module._chunk_bytes(8) == 4 * MiB
    monkeypatch.setenv("ONEDIST_SHM_CHUNK_MB", "0.5")
    assert shm_module._chunk_bytes(8) == MiB // 2  # the setting wins
    monkeypatch.setenv("ONEDIST_SHM_CHUNK_MB", "lots")
    with pytest.raises(OnedistValueError, match="ONEDIST_SHM_CHUNK_MB.*'lots'"):
        shm_module._chunk_bytes(2)


def test_ranks_use_rank_0s_slot_size():
    pool = DistPool(2, "shm", rank_env=[{"ONEDIST_SHM_CHUNK_MB": "0.0625"}, {"ONEDIST_SHM_CHUNK_MB": "1"}])
    try:
        assert pool.run(checks_pg.check_slot_size_is_rank_0s) == [64 << 10] * 2
    finally:
        pool.close()


def test_all_reduce_equals_gloo_every_dtype_op_and_size(shm):
    assert shm(checks_pg.check_all_reduce_equals_gloo, timeout=240)[0] > 200


# 1 MiB slots and 3 threads per rank: copies and reductions of 256 KiB or more are split over
# helper threads (on many-core machines they are by default; on 2 cores they are not)
SPLIT = {"ONEDIST_SHM_CHUNK_MB": "1", "ONEDIST_SHM_THREADS": "3"}


@pytest.mark.parametrize("world_size", [2, 3])
def test_split_over_helper_threads_equals_gloo(world_size):
    run = Runner(world_size, backend="shm", env=SPLIT)
    assert run(checks_pg.check_all_reduce_equals_gloo, timeout=240)[0] > 200
    run(checks_pg.check_copy_collectives_equal_gloo, timeout=120)
    run(checks_pg.check_gather_scatter_all_to_all_exact, timeout=120)  # direct reads over threads too
    run(checks_pg.check_non_contiguous_and_views)
    assert max(run(checks_pg.check_ddp_equals_gloo, timeout=120)) < 1e-5


def test_group_thread_lets_go_of_a_collectives_tensors():
    assert Runner(2, backend="shm")(checks_pg.check_group_thread_lets_go_of_tensors) == [True, True]


# all_to_all larger than a slot: read straight out of the peers' memory (process_vm_readv), else
# in rounds through the slots; 256 KiB slots keep the exchanges small
SMALL_SLOTS = {"ONEDIST_SHM_CHUNK_MB": "0.25"}


def _kernel_allows_cross_memory_reads() -> bool:
    """Whether a child process may read this one's memory (a container's seccomp profile may say
    no: then every exchange goes in rounds, which the other all_to_all tests check)."""
    import ctypes

    from onedist.backends import cma

    data, got = ctypes.create_string_buffer(b"onedist", 8), ctypes.create_string_buffer(8)
    pid = os.fork()
    if pid == 0:
        ok = cma.read(os.getppid(), ctypes.addressof(got), ctypes.addressof(data), 8)
        os._exit(0 if ok and got.value == data.value else 1)
    return os.waitpid(pid, 0)[1] == 0


def test_all_to_all_reads_peers_directly_and_falls_back_when_the_kernel_refuses():
    if not _kernel_allows_cross_memory_reads():
        pytest.skip("this machine's kernel refuses process_vm_readv between its processes")
    pool = DistPool(3, "shm", env=SMALL_SLOTS)  # its own processes: rank 1 ends up filtered
    try:
        reads = pool.run(checks_pg.check_all_to_all_reads_directly_then_falls_back, timeout=120)
    finally:
        pool.close()
    assert reads == [[True, True], [True, False], [True, True]]  # the second: rank 1's reads refused


def test_all_to_all_in_rounds_when_one_rank_may_not_read_others():
    env = [{**SMALL_SLOTS}, {**SMALL_SLOTS, "ONEDIST_SHM_CMA": "0"}, {**SMALL_SLOTS}]
    pool = DistPool(3, "shm", rank_env=env)
    try:
        assert min(pool.run(checks_pg.check_all_to_all_without_direct_reads_on_one_rank, timeout=240)) > 100
    finally:
        pool.close()


def test_direct_reads_setting_is_checked(monkeypatch):
    from onedist import OnedistValueError
    from onedist.backends import cma

    monkeypatch.setenv("ONEDIST_SHM_CMA", "0")
    assert not cma.enabled()
    monkeypatch.setenv("ONEDIST_SHM_CMA", "yes")
    with pytest.raises(OnedistValueError, match="ONEDIST_SHM_CMA.*'yes'"):
        cma.enabled()
    monkeypatch.setenv("ONEDIST_CMA", "0")  # the name for shm and gloo; the earlier one yields to it
    assert not cma.enabled()
    monkeypatch.setenv("ONEDIST_CMA", "1")
    assert cma.enabled()
    monkeypatch.setenv("ONEDIST_CMA", "on")
    with pytest.raises(OnedistValueError, match="ONEDIST_CMA.*'on'"):
        cma.enabled()


def test_bad_arguments_raise_on_every_rank_and_leave_the_group_usable(shm):
    assert shm(checks_pg.check_bad_arguments_raise_and_leave_the_group_usable) == [18] * shm.world_size


def test_mismatched_calls_raise_on_every_rank_and_leave_the_group_usable(shm):
    assert shm(checks_pg.check_mismatched_calls_raise_on_every_rank_and_leave_the_group_usable) == [21] * (
        shm.world_size
    )


def _sizes_not_shapes() -> list[float]:
    """shm compares element counts: a [2, 3] tensor against a [3, 2] one moves the same six
    elements and is summed (no error), while debug mode, which compares shapes, raises on every
    rank before the sum."""
    from onedist.errors import CollectiveMismatchError

    rank, world = od.get_rank(), od.get_world_size()
    shape = (3, 2) if rank == world - 1 else (2, 3)
    t = torch.full(shape, float(rank + 1))
    dist.all_reduce(t)
    assert t.shape == shape and t.flatten().tolist() == [world * (world + 1) / 2] * 6, t
    od.set_debug(True)
    try:
        od.all_reduce(torch.ones(shape))
    except CollectiveMismatchError as e:
        assert "[3, 2]" in str(e) and "[2, 3]" in str(e), str(e)
    else:
        raise AssertionError("debug mode let a [2, 3] all_reduce meet a [3, 2] one")
    finally:
        od.set_debug(False)
    return t.flatten().tolist()


def test_sizes_are_compared_not_shapes(shm):
    # [2, 3] against [3, 2]: summed as six elements each, not an error (debug mode catches it)
    total = shm.world_size * (shm.world_size + 1) / 2
    assert shm(_sizes_not_shapes) == [[total] * 6] * shm.world_size


def test_timeout_raises_in_torchs_words(shm):
    shm(checks_pg.check_timeout_in_torchs_words)


def test_sparse_all_reduce_sums_like_gloo(shm):
    shm(checks_pg.check_sparse_all_reduce_sums_like_gloo)


def test_fsdp2_and_functional_collectives_equal_gloo(shm):
    assert max(shm(checks_pg.check_fsdp2_and_functional_collectives_equal_gloo, timeout=120)) < 1e-5


def test_non_contiguous_inputs(shm):
    shm(checks_pg.check_non_contiguous_and_views)


def test_all_gather_broadcast_reduce_scatter_equal_gloo(shm):
    shm(checks_pg.check_copy_collectives_equal_gloo, timeout=120)


def test_gather_scatter_all_to_all_exact(shm):
    shm(checks_pg.check_gather_scatter_all_to_all_exact, timeout=120)


@pytest.mark.parametrize("kind", ["eval", "padded", "user_shuffle"])
def test_exact_evaluation(shm, kind):
    """all_gather_eval on shm (what backend="auto" gives several CPU processes on one host): its
    gathers of per-rank results whose sizes differ go through the slots."""
    assert shm(checks_eval.check_eval_exact, kind) == [checks_eval.serial_accuracy()] * shm.world_size


# Two "hosts" on this one machine: ONEDIST_SHM_HOST gives each rank the host identity it would get
# from its hostname on a real cluster (the network between them is loopback here).
SPLIT_HOSTS = {
    4: ["host-a", "host-b", "host-a", "host-b"],  # interleaved: each host has ranks 0,2 / 1,3
    3: ["host-a", "host-a", "host-b"],  # a host with one rank has no shared memory of its own
}


@pytest.mark.parametrize("world_size", [3, 4])
def test_hierarchical_over_two_simulated_hosts_equals_gloo(world_size):
    hosts = SPLIT_HOSTS[world_size]
    pool = DistPool(
        world_size,
        "shm",
        env={"ONEDIST_SHM_CHUNK_MB": "0.0625"},
        rank_env=[{"ONEDIST_SHM_HOST": h} for h in hosts],
    )
    try:
        expected = [[r for r in range(world_size) if hosts[r] == h] for h in dict.fromkeys(hosts)]
        assert pool.run(checks_pg.check_shm_hierarchy) == [expected] * world_size
        assert pool.run(checks_pg.check_all_reduce_equals_gloo, timeout=240)[0] > 200
        pool.run(checks_pg.check_copy_collectives_equal_gloo, timeout=120)  # broadcast from every root
        pool.run(checks_pg.check_reduce_and_barrier_and_gloo_ops)
        pool.run(checks_pg.check_non_contiguous_and_views)
        assert max(pool.run(checks_pg.check_ddp_equals_gloo, timeout=120)) < 1e-5
        if world_size == 4:  # each host has two ranks: the mismatch is the same on both, and no rank waits
            pool.run(checks_pg.check_mismatch_on_one_host_names_the_group_ranks)
    finally:
        pool.close()


def test_back_to_back_collectives_under_skew(shm):
    assert shm(checks_pg.check_back_to_back_collectives_under_skew, timeout=120) == [120] * shm.world_size


def test_spawned_job_with_threaded_collectives_exits_cleanly():
    # each worker ran its 1 MiB collectives on the group's thread; that thread outlived
    # finalize() and aborted the process at exit ("terminate called without an active
    # exception") until shutdown() waited for it
    assert od.spawn("shm", workers.large_collectives, nproc_per_node=2) == [6.0, 6.0]


NO_WAIT = """
import torch, torch.distributed as dist, onedist as od
od.initialize("shm")
work = dist.all_reduce(torch.ones(8 << 20), async_op=True)
print("leaving", flush=True)
"""


def _onedist_run(tmp_path, text: str, n: int) -> subprocess.CompletedProcess:
    """``onedist run -n n`` of a script with this text; its output."""
    script = tmp_path / "script.py"
    script.write_text(text)
    cmd = [sys.executable, "-m", "onedist", "run", "-n", str(n), str(script)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_script_that_exits_during_a_collective_exits_cleanly(tmp_path):
    # no wait, no finalize: at exit the group's thread is still inside the collective (torch code);
    # onedist finishes it before the interpreter finalizes (1 run in 3 aborted before)
    proc = _onedist_run(tmp_path, NO_WAIT, 2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "terminate called" not in proc.stderr
    assert proc.stdout.count("leaving") == 2


def test_reduce_barrier_and_delegated_ops(shm):
    shm(checks_pg.check_reduce_and_barrier_and_gloo_ops)


def test_sub_groups(shm):
    shm(checks_pg.check_sub_groups)


def test_ddp_equals_ddp_on_gloo(shm):
    assert max(shm(checks_pg.check_ddp_equals_gloo, timeout=120)) < 1e-5


# The check module every backend must pass (the same functions test_collectives.py runs on gloo).
CORE_CHECKS = [
    checks.check_queries,
    checks.check_all_reduce_ops_and_dtypes,
    checks.check_all_reduce_layout_device_inplace_async,
    checks.check_all_reduce_numbers_exact,
    checks.check_all_reduce_nested_one_collective_per_dtype,
    checks.check_reduce,
    checks.check_all_gather_tensors,
    checks.check_all_gather_values,
    checks.check_all_gather_mismatch_raises_everywhere,
    checks.check_broadcast,
    checks.check_broadcast_source_error,
    checks.check_gather,
    checks.check_scatter,
    checks.check_groups,
    checks.check_p2p,
    checks.check_all_gather_object,
    checks.check_argument_errors,
    checks.check_one_element_strided_tensors,
    checks.check_python_numbers_take_either_way_alike,
    checks.check_large_objects_travel_whole,
    checks.check_detectron2_differentiable_collectives_and_local_group,
]


@pytest.mark.parametrize("check", CORE_CHECKS, ids=lambda f: f.__name__.removeprefix("check_"))
@pytest.mark.parametrize("world_size", [2, 3])
def test_core_checks_on_shm(check, world_size):
    Runner(world_size, backend="shm")(check, *(("shm",) if check is checks.check_queries else ()))


def _kill_rank_1(local_rank: int, stamp: str) -> None:
    big = torch.ones(8 << 20)  # 32 MB: several slots, the kill lands mid-collective
    for i in range(1000):
        if od.get_rank() == 1 and i == 3:
            with open(stamp, "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        od.all_reduce(big, inplace=True)


def _memfds() -> set[str]:
    found = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    if "onedist-shm" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                        found.add(f"{pid}/{fd}")
            except OSError:
                pass
    return found


@pytest.mark.launcher
def test_sigkill_mid_collective_stops_the_others_and_leaves_nothing(tmp_path):
    """SIGKILL of one rank inside a 32 MB all_reduce: the run ends within 5 s of the kill, naming
    rank 1, and no segment survives: no process holds a onedist memfd afterwards."""
    holders_before = {f.split("/")[0] for f in _memfds()}
    stamp = str(tmp_path / "killed")
    with pytest.raises(od.WorkerFailedError, match=r"(?s)rank 1.*(SIGKILL|signal 9|-9)"):
        with od.Parallel(backend="shm", nproc_per_node=3) as parallel:
            parallel.run(_kill_rank_1, stamp)
    with open(stamp) as f:
        after_kill = time.time() - float(f.read())
    assert after_kill < 5.0, after_kill
    # segments are memfds, never files: nothing of the run in /dev/shm (other programs' entries,
    # e.g. multiprocessing's sem.mp-*, come and go there), and no live process maps one any more
    assert not [name for name in os.listdir("/dev/shm") if "onedist" in name]
    assert {f.split("/")[0] for f in _memfds()} - holders_before == set()


def _bare_rank(rank: int, port: int, q, killed_at) -> None:
    """A rank with no launcher around it: only the shm group itself can notice a dead peer."""
    torch.set_num_threads(1)
    os.environ["ONEDIST_WATCH"] = "0"  # not the failure watch either: the segment's pid check
    od.initialize("shm", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3, timeout=60)
    big = torch.ones(8 << 20)
    od.all_reduce(big, inplace=True)
    if rank == 1:
        killed_at.value = time.time()  # shared memory: survives the SIGKILL (a queue may not)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        while True:
            od.all_reduce(big, inplace=True)
    except Exception as e:
        q.put((rank, f"{type(e).__name__}: {e}", time.time(), getattr(e, "rank", None)))


def test_peers_of_a_killed_rank_raise_within_5_s_without_a_launcher():
    import multiprocessing as mp

    from onedist._net import free_port

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    killed_at = ctx.Value("d", 0.0)
    port = free_port()
    procs = [ctx.Process(target=_bare_rank, args=(r, port, q, killed_at), daemon=True) for r in range(3)]
    for p in procs:
        p.start()
    try:
        got = {}
        while len(got) < 2:
            rank, what, when, blamed = q.get(timeout=60)
            got[rank] = (what, when, blamed)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert procs[1].exitcode == -signal.SIGKILL
    for rank in (0, 2):
        what, when, blamed = got[rank]
        assert what.startswith("RemoteRankError") and "rank 1 (pid" in what and "exited" in what, what
        assert "rank 1 of group [0, 1, 2] exited" in what and blamed == 1, what  # named, not "another rank"
        assert when - killed_at.value < 5.0, (rank, when - killed_at.value)


HOST_RANK_EXITS = """
import os, sys, onedist as od
os.environ["ONEDIST_SHM_HOST"] = "host-" + "ab"[int(os.environ["RANK"]) % 2]  # hosts [0, 2] and [1, 3]
od.initialize("shm")
od.all_reduce(1)
if od.get_rank() == 2:
    sys.exit(0)  # leaves without an error, in the middle of the job
try:
    od.all_reduce(1)
except od.RemoteRankError as e:
    print(f"blamed {e.rank}: {str(e).splitlines()[0]}", flush=True)
"""


@pytest.mark.launcher
def test_a_rank_that_exits_is_named_across_the_two_levels(tmp_path):
    """Over two simulated hosts: rank 0 (rank 2's host) learns from the host's segment that rank 2
    exited, and names it as a rank of the whole group, not of the host's group (where it is rank
    1). Ranks 1 and 3 only see their leader's connection go: they blame nobody, rather than the
    rank 1 that failed as a consequence."""
    proc = _onedist_run(tmp_path, HOST_RANK_EXITS, 4)
    said = dict(line.split(": blamed ", 1) for line in proc.stdout.splitlines() if ": blamed " in line)
    assert said["[rank0]"].startswith("2: ") and "rank 2 of group [0, 1, 2, 3] exited" in said["[rank0]"], (
        said
    )
    assert said["[rank1]"].startswith("-1: ") and said["[rank3]"].startswith("-1: "), said
