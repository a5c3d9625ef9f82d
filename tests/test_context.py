"""Lifecycle: initialize / finalize / sync, init methods, a group created by the user; what
initialize says when a rendezvous goes wrong (docs/troubleshooting.md), the failure watch it
starts and finalize stops, and debug mode's check of a collective only some ranks reach."""

from __future__ import annotations

import ast
import gc
import json
import logging
import os
import re
import socket
import subprocess
import sys
import textwrap
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as tmp

import onedist as od
import workers
from launch_env import SLURM_MPI_PREFIXES, clean_env, strip_launcher_vars
from onedist._net import free_port
from onedist.backends import _rendezvous


@pytest.fixture(autouse=True)
def _serial_after():
    yield
    od.finalize()


def test_initialize_alone_makes_a_group_of_one_and_finalize_restores_env():
    strip_launcher_vars()
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

    strip_launcher_vars(monkeypatch=monkeypatch)
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
    env = clean_env(OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_SIZE="2")
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


def _rank_env(monkeypatch: pytest.MonkeyPatch, rank: int, port: int) -> None:
    """This process as rank ``rank`` of 2 started by another launcher (srun, mpirun): env:// only."""
    strip_launcher_vars(*SLURM_MPI_PREFIXES, monkeypatch=monkeypatch)
    monkeypatch.delenv("ONEDIST_STORE_FD", raising=False)
    for name, value in (
        ("RANK", rank),
        ("WORLD_SIZE", 2),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", port),
    ):
        monkeypatch.setenv(name, str(value))


def test_initialize_on_rank_0_names_a_port_in_use(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        _rank_env(monkeypatch, 0, port)
        with pytest.raises(od.OnedistRuntimeError) as e:
            od.initialize("gloo", timeout=10)
    assert str(e.value) == (
        f"onedist.initialize (rank 0): MASTER_PORT={port} is already in use on 127.0.0.1, so rank 0 cannot "
        'host the rendezvous there\nHINT: pass another free port (e.g. `python -c "import onedist._net as n; '
        f"print(n.free_port(''))\"` on node 0) to every node, or stop what holds it: "
        f"`ss -ltnp | grep :{port}`"
    )
    assert od.model_name() == "serial"


def test_a_missing_rank_0_is_named_as_the_rendezvous_host(monkeypatch):
    port = free_port()  # nobody listens there: rank 0 never started
    _rank_env(monkeypatch, 1, port)
    monkeypatch.setattr(_rendezvous, "_ANNOUNCE_CONNECT_S", 0.2)  # telling a rank 0 that never comes
    with pytest.raises(od.OnedistTimeoutError) as e:
        od.initialize("gloo", timeout=2)
    text = str(e.value)
    assert text.startswith(
        f"onedist.initialize (rank 1 of 2): the rendezvous host, rank 0 at 127.0.0.1:{port} "
        "(MASTER_ADDR:MASTER_PORT), did not answer within 2 s ("
    ), text
    assert (
        "HINT: check that rank 0 started, that every rank was given the same MASTER_ADDR and MASTER_PORT"
        in text
    )


def test_initialize_logs_the_missing_ranks_while_it_waits(monkeypatch, caplog):
    assert _rendezvous._JOIN_LOG_S == 30.0  # the docs' "every 30 s", shortened below
    monkeypatch.setattr(_rendezvous, "_JOIN_LOG_S", 0.3)
    monkeypatch.setattr(_rendezvous, "_HOLD_S", 0.2)  # rank 0 then holds its store for nobody
    _rank_env(monkeypatch, 0, free_port())
    with caplog.at_level(logging.WARNING, logger="onedist"), pytest.raises(od.OnedistTimeoutError) as e:
        od.initialize("gloo", timeout=1.5)
    text = str(e.value)
    # the traceback holds rank 0's store, whose server thread would be alive when a later test
    # forks a pool: its children then hung in their own rendezvous
    del e
    gc.collect()
    assert re.match(
        r"onedist.initialize \(rank 0 of 2\): ranks \[1\] did not join the rendezvous within 2 s", text
    )
    waits = [r.getMessage() for r in caplog.records if "to join the rendezvous" in r.getMessage()]
    assert len(waits) >= 2, waits
    assert all(
        re.fullmatch(r"onedist.initialize: rank 0 has waited \d+ s for ranks \[1\] to join the rendezvous", w)
        for w in waits
    ), waits


def test_a_wrong_gloo_socket_ifname_fails_when_the_group_is_created(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuchif0")
    with pytest.raises(od.WorkerFailedError) as e:
        od.spawn("gloo", workers.report, nproc_per_node=2, start_method="fork")
    assert "failed with RuntimeError: [enforce fail at" in str(e.value), str(e.value)
    assert "Unable to find address for: nosuchif0" in str(e.value), str(e.value)


def _watch_states(rank: int, ports: list[int], out: str) -> None:
    """Initialize and finalize a group of 2 with each ONEDIST_WATCH setting; whether the watcher
    thread ran at each step."""
    import threading

    def watching() -> bool:
        return any(t.name == "onedist-failure-watch" and t.is_alive() for t in threading.enumerate())

    states = []
    for i, value in enumerate(("0", "false", "off", None)):
        if value is None:
            os.environ.pop("ONEDIST_WATCH", None)
        else:
            os.environ["ONEDIST_WATCH"] = value
        od.initialize("gloo", init_method=f"tcp://127.0.0.1:{ports[i]}", rank=rank, world_size=2, timeout=60)
        states.append([value, watching()])
        od.finalize()
    states.append(["after finalize", watching()])
    with open(os.path.join(out, str(rank)), "w") as f:
        json.dump(states, f)


def test_onedist_watch_turns_the_watcher_off_and_finalize_stops_it(tmp_path):
    ports: list[int] = []
    while len(ports) < 4:  # a group per setting, each on its own rendezvous port
        port = free_port()
        if port not in ports:
            ports.append(port)
    tmp.start_processes(_watch_states, args=(ports, str(tmp_path)), nprocs=2, start_method="fork")
    for rank in range(2):
        states = json.loads((tmp_path / str(rank)).read_text())
        assert states == [
            ["0", False],
            ["false", False],
            ["off", False],
            [None, True],
            ["after finalize", False],
        ]


def _rank_only_calls() -> list[tuple[str, Any]]:
    """The same all_reduce under each test that only some ranks pass (the debug check reads it)."""

    def main_process() -> Any:
        if od.is_main_process():
            return od.all_reduce(1.0)

    def rank_zero() -> Any:
        if od.get_rank() == 0:
            return od.all_reduce(1.0)

    def local_rank_zero() -> Any:
        if od.get_local_rank() == 0:
            return od.all_reduce(1.0)

    return [
        ("od.is_main_process()", main_process),
        ("od.get_rank() == 0", rank_zero),
        ("od.get_local_rank() == 0", local_rank_zero),
    ]


def _flags_a_collective_under_a_rank_test() -> list[str]:
    """Debug mode: rank 0 raises at the collective itself, naming the `if`, without waiting for
    the others (who never come: the pool's time limit would catch a wait); off by default."""
    from onedist.errors import OnedistRuntimeError

    rank = od.get_rank()
    od.set_debug(True)
    seen = []
    try:
        for test, call in _rank_only_calls():
            try:
                call()
            except OnedistRuntimeError as e:
                assert rank == 0, (rank, str(e))
                text = str(e)
                assert f"is inside `if {test}:`, which only some ranks enter" in text, text
                assert "test_context.py:" in text and "HINT: call the collective on every rank" in text, text
                seen.append(test)
            else:
                assert rank != 0, f"no error under `if {test}:`"
    finally:
        od.set_debug(False)
    assert od.all_reduce(1) == od.get_world_size()  # no rank sent anything: the group is in step
    return seen


def test_debug_mode_flags_a_collective_under_a_rank_test_at_once(multi):
    seen = multi(_flags_a_collective_under_a_rank_test, timeout=30)
    assert seen == [["od.is_main_process()", "od.get_rank() == 0", "od.get_local_rank() == 0"]] + [[]] * (
        multi.world_size - 1
    )


def _one_rank_leaves(rank: int, port: int, out: str, leaver: int) -> None:
    """Rank ``leaver`` exits without an error and without finalize; the other then waits in an
    all_reduce and writes what it raised to OUT/<its rank>."""
    os.environ["ONEDIST_WATCH"] = "0"  # only the collective can notice
    od.initialize("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=60)
    od.barrier()
    if rank == leaver:
        os._exit(0)
    try:
        od.all_reduce(1)
        said = "no error"
    except Exception as e:
        said = f"{type(e).__name__}|{getattr(e, 'rank', None)}|{e}"
    with open(os.path.join(out, str(rank)), "w") as f:
        f.write(said)


def _left_alone(tmp_path, leaver: int) -> tuple[str, str, str]:
    """(error type, its rank, its text) on the rank that stayed."""
    args = (free_port(), str(tmp_path), leaver)
    tmp.start_processes(_one_rank_leaves, args=args, nprocs=2, start_method="fork")
    kind, blamed, text = (tmp_path / str(1 - leaver)).read_text().split("|", 2)
    assert kind == "RemoteRankError" and blamed == "-1", (kind, blamed, text)
    return kind, blamed, text


def test_a_peer_that_exits_without_an_error_is_a_closed_connection_on_gloo(tmp_path):
    _, _, text = _left_alone(tmp_path, leaver=1)
    assert (
        "another rank of group [0, 1] closed its connection without reporting an error "
        "(it returned, exited or was killed)." in text
    ), text


def test_a_peer_that_cannot_read_the_reports_does_not_claim_there_were_none(tmp_path):
    """Rank 0 holds the store where a failing rank leaves its error: once it has exited, a rank that
    sees a closed connection cannot know whether its peer reported one (under load rank 0 can leave
    before a slower peer reads, as happened with rank 1's report in the crash runs), and says so."""
    _, _, text = _left_alone(tmp_path, leaver=0)
    assert "without reporting an error" not in text, text
    assert (
        "another rank of group [0, 1] closed its connection; rank 0, which holds the ranks' error "
        "reports, has exited too, so whether it reported an error cannot be read here" in text
    ), text
