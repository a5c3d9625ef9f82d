"""The XLA backend (``backend="xla-tpu"``) for real, on torch_xla's PJRT CPU device.

Runs where torch_xla imports (the separate virtual environment of ``.ci/xla_tests.sh``: torch_xla
2.9 needs torch 2.9); skipped elsewhere. No TPU here, so:

* world size 1 (``test_ws1_*``), in this process: every query, placement, auto_optim, the device
  loader, spawn with one device, and the errors;
* 2 XLA CPU devices (``test_ws2_*``): ``xmp.spawn`` runs them as two threads of one process; one
  subprocess (``tests/checks_xla.py``) runs every check there once, with the test-only workaround
  that serialises graph launches (see that module), and each test reads its part. A subprocess
  because xmp.spawn refuses a process whose XLA runtime started, as this one's has;
* several OS processes (torchrun) never form one XLA world on CPU: initialize refuses it
  (``test_ws1_initialize_under_a_launcher_of_several_processes_refuses``).
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")  # before torch_xla picks a device (and warns)
if os.environ.get("ONEDIST_REQUIRE_XLA") == "1":  # .ci/xla_tests.sh: a missing torch_xla is a failure
    import torch_xla  # noqa: F401
else:
    pytest.importorskip(
        "torch_xla", reason="torch_xla is not installed here (it needs torch 2.9: .ci/xla_tests.sh)"
    )

import torch

import checks_loop
import checks_sharding
import onedist as od
from launch_env import clean_env

HERE = Path(__file__).resolve().parent
DIGITS = HERE.parent / "examples" / "digits.py"
WS2_TIMEOUT_S = 900


def _env(**extra: str) -> dict[str, str]:
    return clean_env("CPU_NUM_DEVICES", **{"PJRT_DEVICE": "CPU", **extra})


@pytest.fixture
def xla1():
    """A world of this process's one XLA device (``initialize("xla-tpu")``), finalised after."""
    od.initialize("xla-tpu")
    try:
        yield od.device()
    finally:
        od.finalize()


# ============================================================================ world size 1
def test_ws1_import_onedist_does_not_import_torch_xla_and_lists_xla_tpu():
    code = textwrap.dedent(
        """
        import sys, onedist as od
        assert od.has_xla_support
        backends = od.available_backends()
        assert "torch_xla" not in sys.modules, "import and available_backends must not import torch_xla"
        assert od.model_name() == "serial" and "torch_xla" not in sys.modules
        print(list(backends))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env()
    )
    assert out.returncode == 0, out.stderr
    assert "'xla-tpu'" in out.stdout


def test_ws1_initialize_queries_placement_and_collectives(xla1):
    dev = xla1
    assert dev == torch.device("xla", 0)
    assert (od.model_name(), od.backend()) == ("xla-dist", "xla-tpu")
    assert (od.get_world_size(), od.get_rank(), od.get_local_rank()) == (1, 0, 0)
    assert (od.get_nproc_per_node(), od.get_nnodes(), od.get_node_rank()) == (1, 1, 0)
    assert od.is_main_process() and od.show_config()["device"] == "xla:0"
    model = od.auto_model(torch.nn.Linear(3, 2))
    assert isinstance(model, torch.nn.Linear) and all(p.device == dev for p in model.parameters())
    x = torch.ones(3, device=dev)
    assert od.all_reduce(x).device == dev and od.all_reduce(x, op="MEAN").cpu().tolist() == [1.0] * 3
    assert od.all_reduce(2.5) == 2.5 and od.all_gather("a") == ["a"]
    assert od.broadcast_object({"k": [1]}) == {"k": [1]} and od.all_gather(x).device == dev
    od.barrier()
    assert od.new_group([0]) is None
    with pytest.raises(
        od.OnedistValueError, match="new_group: backend=.* is not allowed|no keyword arguments"
    ):
        od.new_group([0], backend="gloo")


def test_ws1_finalize_returns_to_serial(xla1):
    od.finalize()
    assert od.model_name() == "serial" and od.device() == torch.device("cpu")
    od.initialize("xla-tpu")  # the fixture finalises again
    assert od.backend() == "xla-tpu"


def test_ws1_auto_optim_is_the_same_optimizer_class_and_matches_cpu(xla1):
    torch.manual_seed(0)
    reference = torch.nn.Linear(4, 1)
    model = od.auto_model(copy.deepcopy(reference))
    optimizer = od.auto_optim(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert isinstance(optimizer, torch.optim.SGD) and type(optimizer).__name__ == "SGD"
    assert od.auto_optim(optimizer) is optimizer  # wrapping twice changes nothing
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        for m, opt, sched, dev in (
            (model, optimizer, scheduler, xla1),
            (reference, ref_opt, ref_sched, "cpu"),
        ):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x.to(dev)), y.to(dev)).backward()
            opt.step()
            sched.step()
    got = torch.cat([p.detach().cpu().flatten() for p in model.parameters()])
    want = torch.cat([p.detach().flatten() for p in reference.parameters()])
    assert torch.allclose(got, want, atol=1e-5), (got, want)
    state = optimizer.state_dict()
    assert state["param_groups"][0]["lr"] == pytest.approx(0.025) and len(state["state"]) == 2
    fresh = od.auto_optim(torch.optim.SGD(model.parameters(), lr=1.0))
    fresh.load_state_dict(copy.deepcopy(state))
    assert fresh.state_dict()["param_groups"][0]["lr"] == pytest.approx(0.025)
    buf = fresh.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(buf.cpu(), state["state"][0]["momentum_buffer"].cpu())
    with pytest.raises(od.OnedistValueError, match=r"auto_optim: barrier=True is not allowed"):
        od.auto_optim(torch.optim.SGD(model.parameters(), lr=0.1), barrier=True)


def test_ws1_auto_dataloader_is_a_device_loader_with_len_sampler_and_set_epoch(xla1):
    data = torch.utils.data.TensorDataset(torch.arange(10.0), torch.arange(10))
    loader = od.auto_dataloader(data, batch_size=4, shuffle=True)
    assert type(loader).__name__ == "XlaDeviceLoader" and len(loader) == 3
    assert loader.batch_size == 4 and loader.dataset is data
    epochs = []
    for _ in range(2):
        seen = []
        for x, y in loader:
            assert x.device == xla1 and y.device == xla1
            seen.extend(y.cpu().tolist())
        epochs.append(seen)
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(10))
    sampler = od.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True)
    loader = od.auto_dataloader(data, batch_size=5, sampler=sampler)
    loader.sampler.set_epoch(3)  # the wrapped DataLoader's sampler, as without XLA
    assert loader.sampler is sampler and sampler.epoch == 3
    evaluation = od.auto_dataloader(data, batch_size=3, evaluation=True)
    preds = torch.cat([x.cpu() for x, _ in evaluation])
    out = od.all_gather_eval(preds, evaluation)  # finds the sampler through the device loader
    assert out.tolist() == [float(i) for i in range(10)]


def test_ws1_spawn_with_one_device_runs_here_in_the_xla_context():
    out = od.spawn("xla-tpu", _report, args=("x",), nproc_per_node=1)
    assert out == [("xla-dist", "xla-tpu", "xla:0", 0, 1, "x")]
    assert od.model_name() == "serial"  # the context ended with the worker


def test_ws1_spawn_failure_names_rank_and_traceback():
    with pytest.raises(od.WorkerFailedError, match=r"(?s)rank 0 .*ValueError: bad input 7.*_fail_with") as e:
        od.spawn("xla-tpu", _fail_with, args=(7,), nproc_per_node=1)
    assert e.value.rank == 0 and "_fail_with" in (e.value.remote_traceback or "")
    assert od.model_name() == "serial"


def test_ws1_parallel_without_nproc_initialises_this_device():
    with od.Parallel(backend="xla-tpu") as parallel:
        assert parallel.run(_report, "p") == ("xla-dist", "xla-tpu", "xla:0", 0, 1, "p")
    assert od.model_name() == "serial"


def test_ws1_initialize_inside_a_spawned_worker_says_who_made_the_context():
    assert od.spawn("xla-tpu", _initialize_again, nproc_per_node=1) == ["xla-dist"]


def _initialize_again(local_rank: int) -> str:
    with pytest.raises(od.OnedistRuntimeError, match=r"already initialized by xmp.spawn \(yours, or onedist"):
        od.initialize("xla-tpu")
    return od.model_name()


def _report(local_rank: int, tag: str) -> tuple[Any, ...]:
    return (od.model_name(), od.backend(), str(od.device()), od.get_rank(), od.get_world_size(), tag)


def _fail_with(local_rank: int, value: int) -> None:
    raise ValueError(f"bad input {value}")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"timeout": 5},
            r"initialize: timeout=datetime.timedelta\(seconds=5\) is not allowed; allowed: None",
        ),
        (
            {"init_method": "tcp://127.0.0.1:1"},
            r"init_method='tcp://127.0.0.1:1' is not allowed; allowed: None",
        ),
        (
            {"pg_options": 1},
            r"pg_options=1 is not allowed; allowed: no keyword arguments with backend 'xla-tpu'",
        ),
        ({"world_size": 2}, r"world_size=2 is not allowed; allowed: None or 1"),
        ({"rank": 0, "world_size": 1}, None),
    ],
)
def test_ws1_initialize_arguments(kwargs, match):
    if match is None:
        od.initialize("xla-tpu", **kwargs)
        od.finalize()
        return
    with pytest.raises(od.OnedistValueError, match=match):
        od.initialize("xla-tpu", **kwargs)
    assert od.model_name() == "serial"


def test_ws1_initialize_under_a_launcher_of_several_processes_refuses(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(od.OnedistRuntimeError, match=r"(?s)WORLD_SIZE=2 processes.*1 device.*HINT: .*spawn"):
        od.initialize("xla-tpu")
    assert od.model_name() == "serial"


def test_ws1_unknown_name_xla_lists_xla_tpu():
    with pytest.raises(
        od.BackendUnavailableError, match=r"backend='xla' is not a known backend; .*'xla-tpu'"
    ):
        od.initialize("xla")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"nnodes": 2, "master_port": 29500}, r"nnodes=2 is not allowed; allowed: 1 with backend 'xla-tpu'"),
        ({"master_port": 29500}, r"master_port=29500 is not allowed; allowed: None"),
        ({"master_addr": "10.0.0.1"}, r"master_addr='10.0.0.1' is not allowed"),
        ({"init_method": "env://"}, r"init_method='env://' is not allowed; allowed: None"),
        ({"timeout": 30}, r"timeout=.* is not allowed; allowed: None \(XLA collectives take no timeout\)"),
    ],
)
def test_ws1_spawn_arguments_that_xmp_spawn_cannot_honour(kwargs, match):
    with pytest.raises(od.OnedistValueError, match=match):
        od.spawn("xla-tpu", _report, args=("x",), nproc_per_node=2, **kwargs)


def test_ws1_spawn_several_devices_explains_what_cannot_work_here(monkeypatch):
    monkeypatch.setenv("CPU_NUM_DEVICES", "3")
    with pytest.raises(
        od.OnedistValueError, match=r"nproc_per_node=2 is not allowed; allowed: 1 or 3 \(CPU_NUM_DEVICES=3"
    ):
        od.spawn("xla-tpu", _report, args=("x",), nproc_per_node=2)
    monkeypatch.delenv("CPU_NUM_DEVICES")
    od.initialize("xla-tpu")  # this process's XLA runtime runs from now on (if it did not already)
    od.finalize()
    with pytest.raises(
        od.OnedistRuntimeError, match=r"(?s)nproc_per_node=2 needs xmp.spawn.*has not used XLA"
    ):
        od.spawn("xla-tpu", _report, args=("x",), nproc_per_node=2)
    assert "CPU_NUM_DEVICES" not in os.environ  # what spawn set is restored
    with pytest.raises(od.OnedistTypeError, match="fn has type function"):
        od.spawn("xla-tpu", lambda i: i, nproc_per_node=2)


def test_ws1_dtypes_xla_cannot_reduce_say_so(xla1):
    with pytest.raises(
        od.OnedistTypeError, match=r"XLA collectives cannot reduce tensors of dtype torch.uint64"
    ):
        od.all_reduce(torch.ones(2, dtype=torch.uint64))


def test_ws1_digits_example_trains_on_the_xla_device():
    """The example itself (examples/digits.py --backend xla-tpu), one epoch on xla:0."""
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn")
    proc = subprocess.run(
        [sys.executable, str(DIGITS), "--backend", "xla-tpu", "--epochs", "1", "--target", "0.5"],
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "device: xla:0" in proc.stderr + proc.stdout
    assert "parameters identical on 1 process(es)" in proc.stdout
    final = re.search(r"final test accuracy (\d\.\d+) over 1 process", proc.stdout)
    assert final and float(final.group(1)) >= 0.5, proc.stdout[-2000:]


# ============================================================================ 2 XLA CPU devices
@pytest.fixture(scope="module")
def ws2() -> dict[str, Any]:
    """Every 2-device check, run once in a fresh process (tests/checks_xla.py)."""
    proc = subprocess.run(
        [sys.executable, str(HERE / "checks_xla.py"), "ws2", "failure"],
        capture_output=True,
        text=True,
        timeout=WS2_TIMEOUT_S,
        env=_env(PYTHONPATH=os.pathsep.join([str(HERE.parent / "src"), str(HERE)])),
        cwd=HERE.parent,
    )
    reports = {}
    for line in proc.stdout.splitlines():
        if line.startswith("XLA-RESULT "):
            report = json.loads(line[len("XLA-RESULT ") :])
            reports[report["mode"]] = report
    reports["_output"] = proc.stdout[-4000:] + proc.stderr[-6000:]
    return reports


def _checks(ws2: dict[str, Any], *names: str) -> list[dict[str, Any]]:
    report = ws2.get("ws2")
    if report is None:
        pytest.fail(f"the 2-device run printed no result:\n{ws2['_output']}")
    if not report["ok"]:
        pytest.fail(f"the 2-device run failed ({report['seconds']} s):\n{report['message']}")
    per_rank = report["result"]
    assert len(per_rank) == 2
    for name in names:
        assert all(name in r for r in per_rank), name
    return [{n: r[n][0] for n in names} for r in per_rank]


def test_ws2_queries_each_device_thread_sees_its_own_rank_and_device(ws2):
    out = _checks(ws2, "check_queries")
    assert [o["check_queries"] for o in out] == [
        {"rank": r, "world_size": 2, "device": f"xla:{r}"} for r in range(2)
    ]


def test_ws2_all_reduce_every_op_and_dtype_numbers_nested_and_reduce(ws2):
    _checks(
        ws2,
        "check_all_reduce_ops_and_dtypes",  # SUM PRODUCT MIN MAX MEAN AND OR; bfloat16 ... uint8, complex
        "check_all_reduce_layout_device_inplace_async",
        "check_all_reduce_numbers_exact",
        "check_reduce",
    )


def test_ws2_xla_tensors_reduce_lazily_and_come_back_on_their_device(ws2):
    out = _checks(ws2, "check_xla_tensors_results_on_their_device")
    assert out[0] == out[1] == {"check_xla_tensors_results_on_their_device": [1.0, 2.0]}


def test_ws2_all_gather_tensors_uneven_objects_strings_and_mismatch(ws2):
    _checks(
        ws2,
        "check_all_gather_tensors_and_objects",
        "check_all_gather_object",
        "check_all_gather_mismatch_raises_everywhere",
        "check_one_element_strided_tensors",
    )


def test_ws2_uneven_all_gather_of_256kib_or_more_goes_over_all_to_all(ws2):
    _checks(ws2, "check_uneven_all_gather_over_256kib")


def test_ws2_broadcast_bit_exact_every_dtype_objects_and_source_error(ws2):
    _checks(ws2, "check_broadcast_bit_exact", "check_broadcast_source_error")


def test_ws2_gather_and_scatter_over_all_to_all(ws2):
    _checks(ws2, "check_gather", "check_scatter")


def test_ws2_groups_world_and_single_rank_barrier(ws2):
    _checks(ws2, "check_groups_world_and_single_rank")


def test_ws2_send_recv_raise_clearly(ws2):
    _checks(ws2, "check_p2p_raises_clearly")


def test_ws2_helpers_and_argument_errors(ws2):
    _checks(ws2, "check_helpers", "check_argument_errors")


def test_ws2_auto_model_auto_optim_device_loader_train_like_one_process(ws2):
    out = _checks(ws2, "check_training_equals_one_process")
    assert out[0] == out[1]  # identical parameters on both devices (and equal to one CPU process)


def test_ws2_training_loop_accumulation_and_bf16_mixed(ws2):
    """od.no_sync / od.accumulate: the K-fold batch's weights, one gradient all_reduce per window
    (at the step, as one plain step); bf16-mixed computes in bfloat16 (tests/checks_loop.py)."""
    out = _checks(ws2, "check_loop_no_sync", "check_loop_accumulate", "check_loop_bf16_mixed")
    for o in out:
        for name in ("check_loop_no_sync", "check_loop_accumulate"):
            assert o[name]["relative_difference"] <= 1e-6 and o[name]["exchanges_per_window"] == 1, o


def test_ws1_training_loop_accumulation_and_bf16_mixed(xla1):
    for counted_by_onedist in (False, True):
        out = checks_loop.check_accumulation_equals_the_big_batch(counted_by_onedist)
        assert out["exchanges_per_window"] == 0, out
    checks_loop.check_bf16_mixed_runs_the_forward_in_bfloat16()
    checks_loop.check_no_sync_and_accumulate_arguments()
    checks_loop.check_precision_arguments()
    checks_sharding.check_sharding_is_refused_where_torch_distributed_does_not_train()


def test_ws2_worker_failure_names_rank_and_traceback(ws2):
    report = ws2.get("failure")
    assert report is not None, ws2["_output"]
    assert not report["ok"] and report["type"] == "WorkerFailedError", report
    assert (report["rank"], report["local_rank"]) == (1, 1)
    assert "ValueError: deliberate failure on rank 1" in report["message"]
    assert "rank 0: stopped by onedist after rank 1 failed" in report["message"]
    assert report["seconds"] < 120  # rank 0, waiting in a collective for rank 1, was ended


def test_ws2_digits_example_trains_with_identical_parameters(ws2):
    """examples/digits.py's own training function, 8 steps on both devices (it checks the parameters)."""
    out = _checks(ws2, "check_digits_example_trains")
    first, second = (o["check_digits_example_trains"] for o in out)
    if "skipped" in first:
        pytest.skip(first["skipped"])
    assert first["accuracy"] >= 0 and first == second  # -1.0 when the example saw different parameters
