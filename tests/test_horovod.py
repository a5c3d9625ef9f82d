"""The Horovod backend, for real: ranks started by ``horovodrun -np 2/3 --gloo`` run the collective
check module every backend passes (checks.py) and the Horovod checks (checks_horovod.py);
``od.spawn("horovod")`` / ``Parallel`` start workers through ``horovod.run``; the digits example
trains under both. Skipped when Horovod's PyTorch extension is not installed
(``bash .ci/install_horovod.sh`` builds it).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import checks
import checks_horovod as ch
import checks_loop
import checks_sharding
import onedist as od
from launch_env import clean_env
from launchpool import LaunchPool
from onedist.backends.horovod import installed
from test_shm import CORE_CHECKS

pytestmark = pytest.mark.skipif(
    not installed(), reason="Horovod's PyTorch extension is not installed (bash .ci/install_horovod.sh)"
)

TESTS = Path(__file__).parent
DIGITS = str(TESTS.parent / "examples" / "digits.py")


def _horovodrun(n: int) -> list[str]:
    return ["horovodrun", "-np", str(n), "-H", f"localhost:{n}", "--gloo"]


def _env(*also: str, **extra: str) -> dict[str, str]:
    """This environment without launcher variables (nor those starting with ``also``), with tests/
    importable (spawned workers unpickle the check functions by module name)."""
    env = clean_env(*also)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


# Horovod's background thread runs a negotiation round with the other ranks every
# HOROVOD_CYCLE_TIME ms (1 by default): idle ranks of a pool, two or three on 2 cores, keep the
# CPU busy between checks. The workers these tests start get 10 ms (what each test checks does not
# depend on it; see docs/testing.md for the CPU it saves). A value already set is kept.
CYCLE_TIME_MS = "10"


@pytest.fixture(autouse=True)
def _horovod_cycle_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """In this process's environment, which the pools, ``_env()`` and ``od.spawn`` pass on."""
    if "HOROVOD_CYCLE_TIME" not in os.environ:
        monkeypatch.setenv("HOROVOD_CYCLE_TIME", CYCLE_TIME_MS)


_pools: dict[int, LaunchPool] = {}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"hvd{n}")
def hvd(request: pytest.FixtureRequest):
    """A function running a check on every rank of one horovodrun world (started once per size)."""
    n = request.param

    def run(fn, *args, timeout: float = 120.0):
        pool = _pools.get(n)
        if pool is None or pool.broken:
            pool = _pools[n] = LaunchPool(_horovodrun(n), n, "horovod")
        return pool.run(fn, *args, timeout=timeout)

    run.world_size = n  # type: ignore[attr-defined]
    yield run
    pool = _pools.pop(n, None)
    if pool is not None:
        pool.close()


# ============================================================================ under horovodrun
@pytest.mark.launcher
@pytest.mark.parametrize("check", CORE_CHECKS, ids=lambda f: f.__name__.removeprefix("check_"))
def test_core_checks_under_horovodrun(hvd, check):
    hvd(check, *(("horovod",) if check is checks.check_queries else ()))


@pytest.mark.launcher
def test_context_layout_and_process_sets(hvd):
    infos = hvd(ch.check_context)
    n = hvd.world_size
    assert infos == [{"rank": r, "world_size": n, "local_rank": r} for r in range(n)]


@pytest.mark.launcher
def test_widened_and_byte_dtypes(hvd):
    hvd(ch.check_widened_and_byte_dtypes)


@pytest.mark.launcher
def test_send_recv_tags_any_source_and_size_errors(hvd):
    hvd(ch.check_p2p_tags_any_source_and_errors)


@pytest.mark.launcher
def test_auto_model_broadcasts_rank_0_parameters_and_buffers(hvd):
    hvd(ch.check_auto_model_broadcasts_from_rank_0)


@pytest.mark.launcher
@pytest.mark.parametrize("kind, batchnorm", [("sgd", False), ("adam", False), ("sgd", True)])
def test_distributed_optimizer_training_equals_one_process(hvd, kind, batchnorm):
    worst = hvd(ch.check_training_equals_one_process, kind, batchnorm)
    assert max(worst) <= 1e-5


@pytest.mark.launcher
def test_training_loop_accumulation_and_bf16_mixed(hvd):
    """od.no_sync holds back hvd.DistributedOptimizer's allreduces: the K-fold batch's weights with
    one exchange per parameter per window (as one plain step); bf16-mixed computes in bfloat16."""
    for counted_by_onedist in (False, True):
        out = hvd(checks_loop.check_accumulation_equals_the_big_batch, counted_by_onedist)
        assert len({o["exchanges_per_window"] for o in out}) == 1 and out[0]["exchanges_per_window"] > 0, out
    hvd(checks_loop.check_bf16_mixed_runs_the_forward_in_bfloat16)
    hvd(checks_loop.check_precision_arguments)
    hvd(checks_sharding.check_sharding_is_refused_where_torch_distributed_does_not_train)


@pytest.mark.launcher
def test_no_sync_with_adasum_and_od_join_raise_on_horovod(hvd):
    hvd(ch.check_no_sync_with_adasum_and_od_join_raise)


@pytest.mark.launcher
def test_training_loop_on_one_horovod_rank():
    """horovodrun -np 1: no hooks, nothing exchanged; the same weights as the K-fold batch."""
    pool = LaunchPool(_horovodrun(1), 1, "horovod")
    try:
        for counted_by_onedist in (False, True):
            out = pool.run(
                checks_loop.check_accumulation_equals_the_big_batch, counted_by_onedist, timeout=120
            )
            assert out[0]["exchanges_per_window"] == 0, out
    finally:
        pool.close()


@pytest.mark.launcher
def test_optimizer_state_from_rank_0_and_state_dict_round_trip(hvd):
    hvd(ch.check_optimizer_state_from_rank_0_and_round_trip)


@pytest.mark.launcher
def test_auto_optim_arguments(hvd):
    hvd(ch.check_auto_optim_arguments)


# ============================================================================ one plain process
def test_world_of_one_user_context_and_initialize_errors():
    # a plain process: no launcher's variables, and no Horovod settings from the environment
    env = _env("HOROVOD_")
    proc = subprocess.run(
        [sys.executable, "-c", "import checks_horovod; checks_horovod.serial_checks()"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=TESTS,
    )
    assert proc.returncode == 0 and "serial checks passed" in proc.stderr, (
        proc.stdout[-3000:] + proc.stderr[-3000:]
    )


def test_import_onedist_does_not_import_horovod():
    code = (
        "import sys, onedist as od; "
        "assert 'horovod' in od.available_backends(); "
        "od.get_world_size(); od.model_name(); "
        "assert not any(m == 'horovod' or m.startswith('horovod.') for m in sys.modules), 'imported'"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env()
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"nnodes": 2}, r"please set 'hosts' argument instead: nnodes=2 is not allowed; allowed: 1 with"),
        ({"master_port": 29400}, r"master_port=29400 is not allowed; allowed: None"),
        ({"master_addr": "10.1.2.3"}, r"master_addr='10.1.2.3' is not allowed; allowed: a loopback"),
        ({"init_method": "tcp://127.0.0.1:29400"}, r"init_method='tcp://127.0.0.1:29400' is not allowed"),
        ({"start_method": "fork"}, r"start_method='fork' is not allowed; allowed: 'spawn'"),
    ],
)
def test_spawn_arguments_horovod_cannot_honour(kwargs, match):
    with pytest.raises(od.OnedistValueError, match=match) as e:
        od.spawn("horovod", ch.worker_report, args=(1,), nproc_per_node=2, **kwargs)
    assert "horovodrun -np N -H host1:n1,host2:n2" in str(e.value)
    if "nnodes" in kwargs:  # ignite raises RuntimeError for these: code catching it still works
        assert isinstance(e.value, RuntimeError) and isinstance(e.value, od.LaunchArgumentError)


@pytest.mark.parametrize(
    "backend, hosts, match",
    [
        ("horovod", "localhost:1", r"hosts='localhost:1' is not allowed; allowed: hosts with at least "),
        ("horovod", "localhost", r"hosts='localhost' is not allowed; allowed: a str 'host1:slots"),
        ("horovod", "a:1,:2", r"allowed: a str 'host1:slots,host2:slots' \(slots: an int >= 1\)"),
        ("horovod", ["localhost:2"], r"hosts has type list \(\['localhost:2'\]\); allowed: a str"),
        ("gloo", "localhost:2", r"hosts='localhost:2' is not allowed; allowed: None with backend 'gloo'"),
    ],
)
def test_spawn_hosts_is_checked(backend, hosts, match):
    with pytest.raises((od.OnedistValueError, od.OnedistTypeError), match=match):
        od.spawn(backend, ch.worker_report, args=(1,), nproc_per_node=2, hosts=hosts)


# ============================================================================ horovod.run
@pytest.mark.launcher
def test_spawn_and_parallel_through_horovod_run(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", _env()["PYTHONPATH"])
    start = time.monotonic()
    results = od.spawn("horovod", ch.worker_report, args=(10,), kwargs_dict={"offset": 1}, nproc_per_node=2)
    assert [(r["local_rank"], r["rank"], r["world_size"], r["backend"]) for r in results] == [
        (0, 0, 2, "horovod"),
        (1, 1, 2, "horovod"),
    ]
    assert [r["sum"] for r in results] == [31, 31]
    if "OMP_NUM_THREADS" not in os.environ:  # 2 ranks share this node's cores, as under torchrun
        assert all(r["threads"] == 1 and r["omp"] == "1" for r in results)
    with od.Parallel(backend="horovod", nproc_per_node=2) as parallel:
        first = parallel.run(ch.worker_report, 3)
    assert (first["rank"], first["sum"]) == (0, 9)
    assert od.model_name() == "serial"  # nothing left in this process
    print(f"spawn + Parallel: {time.monotonic() - start:.1f} s")


@pytest.mark.launcher
def test_spawn_over_hosts_as_ignite_passes_them(monkeypatch):
    # horovod.run counts 'localhost' and '127.0.0.1' as two hosts, both local (no ssh): two
    # "nodes" of one process each, through the same path as real hosts
    monkeypatch.setenv("PYTHONPATH", _env()["PYTHONPATH"])
    results = od.spawn("horovod", ch.worker_layout, nproc_per_node=2, hosts="localhost:1,127.0.0.1:1")
    assert results == [(0, 0, 0, 2, 1, 3), (1, 0, 1, 2, 1, 3)]
    with od.Parallel(backend="horovod", nproc_per_node=2, hosts="localhost:1,127.0.0.1:1") as parallel:
        assert parallel.run(ch.worker_layout) == (0, 0, 0, 2, 1, 3)


@pytest.mark.launcher
def test_spawn_timeout_names_the_rank_that_never_arrived(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", _env()["PYTHONPATH"])
    message, slept = od.spawn("horovod", ch.worker_timeout, nproc_per_node=2, timeout=2)
    assert slept == "slept"
    # the time the rank waited: the 2 s timeout, and whatever a busy machine adds before it raises
    assert "all_reduce on rank 0" in message and re.search(r"timed out after 2\.\d s", message), message
    assert "Ranks that never arrived: [1]" in message, message


@pytest.mark.launcher
def test_spawn_worker_failure_names_the_rank_with_its_traceback(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", _env()["PYTHONPATH"])
    start = time.monotonic()
    with pytest.raises(od.WorkerFailedError) as e:
        od.spawn("horovod", ch.worker_fails_on_rank_1, nproc_per_node=2)
    assert time.monotonic() - start < 45  # rank 0 (sleeping 60 s) was stopped
    text = str(e.value)
    assert e.value.rank == 1 and text.startswith("onedist: worker rank 1 (local rank 1"), text
    assert "KeyError: 'no such shard on rank 1'" in text and "worker_fails_on_rank_1" in text
    assert "rank 0: stopped by onedist after rank 1 failed" in text


# ============================================================================ the digits example
@pytest.mark.launcher
@pytest.mark.parametrize("launcher", ["spawn", "horovodrun"])
def test_digits_example_trains_with_identical_parameters(launcher):
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn")
    args = ["--backend", "horovod", "--epochs", "2", "--max-steps", "8", "--target", "0"]
    if launcher == "spawn":
        cmd = [sys.executable, DIGITS, *args, "--nproc-per-node", "2"]
    else:
        cmd = [*_horovodrun(2), sys.executable, DIGITS, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "distributed configuration: horovod-dist" in out
    assert re.search(r"parameters identical on 2 process\(es\)", out), out[-3000:]
    assert len(re.findall(r"epoch +\d+ +train loss", out)) == 2  # rank 0 prints, once per epoch
