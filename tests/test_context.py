"""Lifecycle: initialize / finalize / sync, init methods, a group created by the user."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
import torch.distributed as dist
import torch.multiprocessing as tmp

import onedist as od
import workers
from onedist._net import free_port


@pytest.fixture(autouse=True)
def _serial_after():
    yield
    od.finalize()


def test_initialize_alone_makes_a_group_of_one_and_finalize_restores_env():
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    od.initialize("gloo", timeout=30)
    assert (od.get_world_size(), od.get_rank(), od.backend(), od.model_name()) == (
        1,
        0,
        "gloo",
        "native-dist",
    )
    assert dist.is_initialized() and os.environ["MASTER_ADDR"] == "127.0.0.1"
    od.finalize()
    assert not dist.is_initialized() and od.model_name() == "serial"
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        assert name not in os.environ
    od.finalize()  # idempotent
    od.initialize("auto", timeout=timedelta(seconds=30))  # initialise again in the same process
    assert od.backend() == "gloo"


def test_initialize_twice_is_an_error():
    od.initialize("gloo")
    with pytest.raises(od.OnedistRuntimeError, match="(?s)already initialized by onedist.*finalize"):
        od.initialize("gloo")


def test_unknown_and_unavailable_backends_list_what_is_allowed():
    with pytest.raises(
        od.BackendUnavailableError, match=r"backend='glooo' is not a known backend; allowed: 'auto', 'gloo'"
    ):
        od.initialize("glooo")
    if "nccl" not in od.available_backends():  # with a GPU, tests/test_gpu.py initialises nccl
        with pytest.raises(
            od.BackendUnavailableError, match=r"(?s)'nccl' is not available.*available here: 'gloo'.*CUDA"
        ):
            od.initialize("nccl")
    if "horovod" not in od.available_backends():  # installed: tests/test_horovod.py covers it
        with pytest.raises(od.BackendUnavailableError, match="Horovod"):
            od.initialize("horovod")
    with pytest.raises(od.OnedistTypeError, match="backend has type int"):
        od.initialize(3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"init_method": "tcp://192.0.2.1:1234"}, "TCP initialization via init_method=.* will hang"),
        ({"init_method": "http://x"}, "init_method='http://x' is not allowed"),
        ({"rank": 2, "world_size": 2}, r"rank=2 is not allowed; allowed: 0..1"),
        ({"world_size": 0}, "world_size=0"),
        ({"timeout": -1}, "timeout=-1"),
        ({"timeout": "10"}, "timeout has type str"),
    ],
)
def test_initialize_bad_arguments(kwargs, match):
    with pytest.raises((od.OnedistValueError, od.OnedistTypeError), match=match):
        od.initialize("gloo", **kwargs)
    assert od.model_name() == "serial"


def test_env_rendezvous_with_partial_environment_says_what_is_missing():
    os.environ["RANK"] = "0"
    os.environ.pop("WORLD_SIZE", None)
    with pytest.raises(od.OnedistValueError, match="WORLD_SIZE is not set"):
        od.initialize("gloo")
    os.environ["WORLD_SIZE"] = "2"
    os.environ["GROUP_WORLD_SIZE"] = "2"  # two nodes: 127.0.0.1 cannot be the rendezvous
    os.environ.pop("MASTER_ADDR", None)
    try:
        with pytest.raises(od.OnedistValueError, match="over 2 nodes needs MASTER_ADDR"):
            od.initialize("gloo")
    finally:
        del os.environ["GROUP_WORLD_SIZE"]


def test_env_rendezvous_on_one_host_takes_ignites_defaults(monkeypatch):
    """Several processes, no MASTER_ADDR/PORT, nothing saying there are several nodes: every
    process computes ignite's 127.0.0.1:15000 alike; onedist sets and logs them, and restores."""
    from onedist.backends import _environ, _rendezvous

    for name in ("MASTER_ADDR", "MASTER_PORT", "GROUP_WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")  # a rank other than 0 listens on nothing
    monkeypatch.setenv("WORLD_SIZE", "2")
    env_set: dict = {}
    _rendezvous.prepare_env_rendezvous(None, None, env_set)
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("127.0.0.1", "15000")
    _environ.restore_env(env_set)
    assert "MASTER_ADDR" not in os.environ and "MASTER_PORT" not in os.environ


def test_tcp_and_file_rendezvous_of_one_process_need_no_rank(tmp_path):
    """As in ignite: without rank/world_size and without a launcher, a group of one."""
    for init in (f"tcp://127.0.0.1:{free_port()}", f"file://{tmp_path}/rdzv"):
        od.initialize("gloo", init_method=init)
        try:
            assert (od.get_rank(), od.get_world_size()) == (0, 1)
        finally:
            od.finalize()


@pytest.mark.parametrize("scheme", ["env", "tcp", "file"])
def test_init_methods_with_real_workers(scheme, tmp_path):
    init = {"env": None, "tcp": f"tcp://127.0.0.1:{free_port()}", "file": f"file://{tmp_path}/rdzv"}[scheme]
    out = od.spawn(
        "gloo", workers.report, args=(scheme,), nproc_per_node=3, init_method=init, start_method="fork"
    )
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert all(o["sum"] == 3 and o["gathered"] == [0, 1, 2] and o["world_size"] == 3 for o in out)
    assert [o["local_rank"] for o in out] == [0, 1, 2]


def test_user_created_group_is_picked_up_without_collectives(tmp_path):
    port = free_port()
    tmp.start_processes(workers.user_group, args=(3, port, str(tmp_path)), nprocs=3, start_method="fork")
    info, elapsed = (tmp_path / "first_query").read_text().split("|")
    assert info == "(1, 3, 'gloo', 'native-dist')"
    assert float(elapsed) < 1.0  # answered from the group itself, not by waiting for rank 0
    assert (tmp_path / "layout").read_text() == "(2, 3, 1, 0)"


def test_sync_and_queries_follow_a_group_made_and_destroyed_by_the_user():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    assert od.get_world_size() == 1
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        assert od.backend() == "gloo" and od.get_world_size() == 1
        with pytest.raises(
            od.OnedistRuntimeError,
            match=r"already initialized by your code \(torch.distributed.init_process_group\)",
        ):
            od.initialize("gloo")
        od.set_local_rank(0)
        assert od.get_local_rank() == 0
    finally:
        dist.destroy_process_group()
    od.sync()
    assert od.model_name() == "serial"
    with pytest.raises(od.OnedistValueError, match="index=-1"):
        od.set_local_rank(-1)


def test_import_has_no_side_effects_and_imports_no_optional_backend():
    code = textwrap.dedent(
        """
        import logging, os, sys
        before = dict(os.environ)
        import onedist
        assert "torch" not in sys.modules, "import onedist must not import torch (launchers need none)"
        assert dict(os.environ) == before, "environment changed"
        assert not logging.getLogger("onedist").handlers
        bad = [m for m in sys.modules if m.split(".")[0] in ("horovod", "torch_xla", "mpi4py", "hostlist")]
        assert not bad, bad
        assert onedist.has_hvd_support in (True, False) and onedist.has_xla_support in (True, False)
        assert onedist.has_native_dist_support
        assert onedist.get_world_size() == 1 and "torch" in sys.modules  # imported on first use
        print("clean")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "clean"


def test_cli_version_and_info():
    out = subprocess.run(
        [sys.executable, "-m", "onedist", "--version"], capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == f"onedist {od.__version__}"
    env = {
        **os.environ,
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    for name in ("RANK", "WORLD_SIZE"):
        env.pop(name, None)
    out = subprocess.run(
        [sys.executable, "-m", "onedist", "info", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert "gloo" in info["available_backends"]
    detected = info["detected_environment"]
    assert (detected["name"], detected["rank"], detected["world_size"], detected["nnodes"]) == (
        "openmpi",
        1,
        2,
        1,
    )


def test_uneven_layout_three_plus_one_from_published_nodes(tmp_path):
    tmp.start_processes(
        workers.uneven_nodes, args=(4, free_port(), str(tmp_path)), nprocs=4, start_method="fork"
    )
    got = [ast.literal_eval((tmp_path / str(r)).read_text()) for r in range(4)]
    # (local_rank, nproc_per_node, node_rank, nnodes, size of the local group)
    assert got == [(0, 3, 0, 2, 3), (1, 3, 0, 2, 3), (2, 3, 0, 2, 3), (0, 1, 1, 2, 1)]
