"""``onedist info``: the network report and the launch-environment warnings (onedist._diagnose).

Unit tests feed plain dicts and fake probes; the subprocess tests run the real command with a
crafted environment. Nothing here waits on the network: the unreachable-master case uses an
injected connect function, and the only real probes go to 127.0.0.1 or are bounded by timeouts.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pytest

import onedist
import onedist as od
from launch_env import SLURM_MPI_PREFIXES, clean_env, strip_launcher_vars
from onedist import _diagnose as diag
from onedist._net import free_port

IFACES = {"lo": ["127.0.0.1"], "eth0": ["10.0.0.2"], "ib0": ["10.1.0.2"]}
TORCHRUN_2_NODES = {
    "RANK": "2",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "0",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2",
    "MASTER_PORT": "29500",
}
SRUN = "/opt/slurm/bin/srun"


def _never_connects(host: str, port: int, timeout: float) -> None:
    raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")


def report(
    environ: dict[str, str],
    *,
    resolved: Optional[dict[str, list[str]]] = None,
    connect: Any = _never_connects,
    route: Any = None,
    ifaces: Optional[dict[str, list[str]]] = IFACES,
) -> dict[str, Any]:
    """A network report from fake probes: names resolve through ``resolved`` (IP literals to
    themselves), everything routes from eth0 (loopback from lo), nothing listens."""
    names = {"node1": ["10.0.0.2"], "localhost": ["127.0.0.1"], **(resolved or {})}

    def resolver(host: str) -> list[str]:
        if host in names:
            return names[host]
        literal = diag._ip_literal(host)
        if literal is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [literal]

    def router(ip: str) -> str:
        return "127.0.0.1" if ip.startswith("127.") else "10.0.0.2"

    return diag.network_report(
        environ,
        resolver=resolver,
        router=route or router,
        interfaces=lambda: ifaces,
        connect=connect,
        hostname=lambda: "node1",
    )


def warns(environ: dict[str, str], **kw: Any) -> list[str]:
    net = kw.pop("network", None) or report(environ)
    kw.setdefault("which", lambda program: SRUN if program == "srun" else None)
    return diag.warnings(environ, network=net, **kw)


def one(found: list[str], needle: str) -> str:
    hits = [w for w in found if needle in w]
    assert len(hits) == 1, (needle, found)
    assert "HINT: " in hits[0], hits[0]
    return hits[0]


# ============================================================================ clean environments
@pytest.mark.parametrize(
    "environ",
    [
        {},
        {**TORCHRUN_2_NODES, "MASTER_ADDR": "10.0.0.1"},
        {
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "1",
        },
        {"SLURM_JOB_ID": "5", "SLURM_NTASKS": "1"},
        {
            "CUDA_VISIBLE_DEVICES": "",
            "ONEDIST_BACKEND": "auto",
            "GLOO_SOCKET_IFNAME": "eth0",
            "NCCL_SOCKET_IFNAME": "eth",
        },
    ],
    ids=["empty", "torchrun-2-nodes", "torchrun-1-process", "slurm-1-task", "settings-ok"],
)
def test_clean_environment_has_no_warnings(environ):
    assert warns(environ, available_backends=["gloo"], gpu_count=0) == []


# ============================================================================ srun
def test_sbatch_script_with_several_tasks_warns_to_use_srun():
    w = one(warns({"SLURM_JOB_ID": "5", "SLURM_NTASKS": "4"}), "srun")
    assert w.startswith("SLURM job 5 has 4 tasks but this process was not started by srun")
    assert "`srun python train.py`" in w and "`srun onedist run train.py`" in w
    # the older spellings
    one(warns({"SLURM_JOBID": "5", "SLURM_NPROCS": "4"}), "has 4 tasks")


@pytest.mark.parametrize(
    "extra",
    [
        {"SLURM_STEP_ID": "0", "SLURM_PROCID": "1"},  # a task srun started
        {"SLURM_NTASKS": "1"},  # one task: nothing is lost
        {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1"},  # torchrun inside
        {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"},
    ],
    ids=["srun-task", "one-task", "torchrun-in-sbatch", "mpirun-in-salloc"],
)
def test_no_srun_warning_when_something_launched_it(extra):
    environ = {"SLURM_JOB_ID": "5", "SLURM_NTASKS": "4", **extra}
    assert not [w for w in warns(environ) if "srun" in w]


def test_no_srun_warning_without_srun_on_path():
    environ = {"SLURM_JOB_ID": "5", "SLURM_NTASKS": "4"}
    assert diag.warnings(environ, network=report(environ), which=lambda program: None) == []


def test_default_which_reads_the_environ_path(tmp_path):
    """Only "is srun on PATH" is tested: a fake executable named srun, found through environ's PATH."""
    fake = tmp_path / "srun"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    environ = {"SLURM_JOB_ID": "5", "SLURM_NTASKS": "2", "PATH": str(tmp_path)}
    one(diag.warnings(environ, network=report(environ)), "not started by srun")
    environ["PATH"] = str(tmp_path / "empty")
    assert diag.warnings(environ, network=report(environ)) == []


# ============================================================================ master address
def test_master_addr_that_does_not_resolve():
    environ = {**TORCHRUN_2_NODES, "MASTER_ADDR": "no-such-host.invalid"}
    net = report(environ)
    assert net["resolved"] == [] and "not known" in net["resolve_error"]
    assert net["master_probe"] is None and net["source_ip"] is None
    w = one(warns(environ, network=net), "does not resolve")
    assert "no-such-host.invalid" in w


def test_master_addr_from_the_detected_environment_is_checked_too():
    environ = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    environ |= {"SLURM_NODEID": "0", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "gpu[01-02]"}
    net = report(environ)
    assert (net["master_addr"], net["master_addr_source"]) == ("gpu01", "detected environment (slurm)")
    assert net["master_port"] == 20007  # derived from the job id
    one(warns(environ, network=net), "gpu01 (detected environment (slurm)) does not resolve")


@pytest.mark.parametrize(
    "error, name",
    [
        (TimeoutError("timed out"), "ETIMEDOUT"),
        (OSError(errno.EHOSTUNREACH, "No route to host"), "EHOSTUNREACH"),
        (OSError(errno.ENETUNREACH, "Network is unreachable"), "ENETUNREACH"),
    ],
)
def test_unreachable_master_port(error, name):
    calls = []

    def connect(host: str, port: int, timeout: float) -> None:
        calls.append((host, port, timeout))
        raise error

    environ = {**TORCHRUN_2_NODES, "MASTER_ADDR": "10.9.9.9"}
    net = report(environ, connect=connect)
    assert calls == [("10.9.9.9", 29500, diag.CONNECT_TIMEOUT)] and diag.CONNECT_TIMEOUT <= 0.5
    assert net["master_probe"]["reachable"] is False and net["master_probe"]["errno"] == name
    w = one(warns(environ, network=net), "unreachable")
    assert f"MASTER_ADDR 10.9.9.9 port 29500 is unreachable from this host ({name}: " in w


@pytest.mark.parametrize("result", ["refused", "open"])
def test_refused_or_open_master_port_is_reachable(result):
    def connect(host: str, port: int, timeout: float) -> None:
        if result == "refused":
            raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")

    environ = {**TORCHRUN_2_NODES, "MASTER_ADDR": "10.9.9.9"}
    net = report(environ, connect=connect)
    assert net["master_probe"]["result"] == result and net["master_probe"]["reachable"] is True
    assert warns(environ, network=net) == []


def test_no_route_to_master():
    def router(ip: str) -> str:
        raise OSError(errno.ENETUNREACH, "Network is unreachable")

    environ = {**TORCHRUN_2_NODES, "MASTER_ADDR": "10.9.9.9"}
    net = report(environ, route=router)
    assert net["route_error"] == "ENETUNREACH: Network is unreachable" and net["master_probe"] is None
    assert "no route (ENETUNREACH" in one(warns(environ, network=net), "unreachable")


@pytest.mark.parametrize("addr", ["127.0.0.1", "127.0.1.1", "localhost", "::1"])
def test_loopback_master_with_several_nodes_hangs(addr):
    environ = {**TORCHRUN_2_NODES, "MASTER_ADDR": addr}
    w = one(warns(environ), "loopback")
    assert f"MASTER_ADDR={addr} is a loopback address but the job spans 2 nodes, so this will hang" in w
    # one node (LOCAL_WORLD_SIZE == WORLD_SIZE): loopback is right
    single = {**environ, "LOCAL_WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "1", "GROUP_RANK": "0"}
    assert warns(single) == []


def test_loopback_default_is_not_blamed_on_master_addr():
    """No MASTER_ADDR, no detected master: the report falls back to 127.0.0.1, which nobody set."""
    environ = {"SLURM_JOB_ID": "5", "SLURM_NNODES": "2", "SLURM_NTASKS": "1"}
    net = report(environ)
    assert (net["master_addr"], net["master_addr_source"]) == ("127.0.0.1", "default")
    assert warns(environ, network=net) == []


def test_sbatch_script_reports_the_first_node_as_master():
    environ = {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NNODES": "2"}
    net = report(environ)
    assert (net["master_addr"], net["master_addr_source"]) == ("node1", "first node of SLURM_JOB_NODELIST")
    assert net["resolved"] == ["10.0.0.2"] and net["interface"] == "eth0"


# ============================================================================ interfaces
def test_report_routes_and_interfaces():
    net = report({**TORCHRUN_2_NODES, "MASTER_ADDR": "10.0.0.1"})
    assert (net["source_ip"], net["interface"], net["interfaces"]) == ("10.0.0.2", "eth0", IFACES)
    assert net["gloo"] == {"interface": "eth0", "address": "10.0.0.2", "source": "hostname"}
    assert net["nccl"]["interface"] == "ib0" and net["nccl"]["source"].startswith("NCCL default")
    json.dumps(net)  # serializable


def test_gloo_socket_ifname_that_does_not_exist():
    environ = {"GLOO_SOCKET_IFNAME": "doesnotexist0"}
    net = report(environ)
    assert net["gloo"] == {
        "interface": "doesnotexist0",
        "source": "GLOO_SOCKET_IFNAME",
        "exists": False,
        "missing": ["doesnotexist0"],
    }
    w = one(warns(environ, network=net), "GLOO_SOCKET_IFNAME")
    assert "(doesnotexist0; interfaces here: lo, eth0, ib0)" in w
    # a comma list: only the missing name is reported
    net = report({"GLOO_SOCKET_IFNAME": "eth0,eth7"})
    assert net["gloo"]["missing"] == ["eth7"]
    assert report({"GLOO_SOCKET_IFNAME": "eth0,ib0"})["gloo"]["exists"] is True


@pytest.mark.parametrize(
    "value, selected",
    [
        ("eth", ["eth0"]),  # a prefix
        ("eth0,ib", ["eth0", "ib0"]),
        ("=eth", []),  # exact: no interface is called "eth"
        ("=eth0", ["eth0"]),
        ("^eth,lo", ["ib0"]),  # exclude
        ("^=eth0", ["lo", "ib0"]),  # exclude exactly
        (" ib , lo ", ["lo", "ib0"]),
        ("^eth,lo,ib", []),
        ("bond", []),
    ],
)
def test_nccl_socket_ifname_syntax(value, selected):
    net = report({"NCCL_SOCKET_IFNAME": value})
    assert net["nccl"]["selected"] == selected and net["nccl"]["source"] == "NCCL_SOCKET_IFNAME"
    found = [w for w in warns({"NCCL_SOCKET_IFNAME": value}, network=net) if "NCCL_SOCKET_IFNAME" in w]
    assert len(found) == (0 if selected else 1), found
    if found:
        assert "matches no interface on this host (interfaces here: lo, eth0, ib0)" in found[0]


def test_parse_ifname_spec():
    assert diag.parse_ifname_spec("^=docker0,lo") == diag.IfnameSpec(
        ("docker0", "lo"), exclude=True, exact=True
    )
    gloo = diag.parse_ifname_spec("eth0,^eth1", nccl=False)
    assert gloo.exact and not gloo.exclude and gloo.names == ("eth0", "^eth1")  # gloo has no syntax
    assert diag.nccl_default_interfaces({"lo": ["127.0.0.1"], "docker0": ["172.17.0.1"]}) == ["docker0"]
    assert diag.nccl_default_interfaces({"lo": ["127.0.0.1"], "eth0": []}) == ["lo"]  # no address


def test_interfaces_unknown_means_no_interface_warning():
    environ = {"GLOO_SOCKET_IFNAME": "x", "NCCL_SOCKET_IFNAME": "y"}
    net = report(environ, ifaces=None)
    assert net["interface"] is None and net["gloo"]["exists"] is None and net["nccl"]["exists"] is None
    assert warns(environ, network=net) == []


def test_gloo_binds_loopback_when_the_hostname_resolves_to_it():
    environ = {**TORCHRUN_2_NODES, "MASTER_ADDR": "10.0.0.1"}
    net = report(environ, resolved={"node1": ["127.0.1.1"]})
    assert net["gloo"]["address"] == "127.0.1.1" and net["gloo"]["interface"] == "lo"
    w = one(warns(environ, network=net), "gloo binds to")
    assert "GLOO_SOCKET_IFNAME=eth0" in w
    fixed = {**environ, "GLOO_SOCKET_IFNAME": "eth0"}
    assert warns(fixed, network=report(fixed, resolved={"node1": ["127.0.1.1"]})) == []


def test_real_loopback_interface_mapping():
    ifaces = diag.list_interfaces()
    assert ifaces is not None
    name = diag.interface_for("127.0.0.1", ifaces)
    assert name is not None and "127.0.0.1" in ifaces[name]
    if sys.platform.startswith("linux"):
        assert name == "lo"
    assert diag.route_source("127.0.0.1") == "127.0.0.1"
    net = diag.network_report({"MASTER_ADDR": "127.0.0.1"})
    assert (net["source_ip"], net["interface"]) == ("127.0.0.1", name)


# ============================================================================ launcher variables
@pytest.mark.parametrize(
    "environ, needle",
    [
        ({"RANK": "0"}, "RANK is set but WORLD_SIZE is not"),
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK is not"),
        (
            {"RANK": "4", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
            "RANK=4 is outside 0..WORLD_SIZE-1",
        ),
        ({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=2 is outside 0..LOCAL_WORLD_SIZE-1"),
        ({"GROUP_RANK": "3", "GROUP_WORLD_SIZE": "2"}, "GROUP_RANK=3 is outside"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
            "LOCAL_WORLD_SIZE=4 is larger than WORLD_SIZE=2",
        ),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1"}, "MASTER_PORT is not"),
    ],
)
def test_partial_launcher_environment(environ, needle):
    one(warns(environ, network=report(environ, resolved={"h": ["10.0.0.1"]})), needle)


# ============================================================================ backend and GPUs
def test_onedist_backend_not_available():
    w = one(warns({"ONEDIST_BACKEND": "nccl"}, available_backends=["gloo"]), "ONEDIST_BACKEND")
    assert w.startswith("ONEDIST_BACKEND='nccl' is not available here (available: gloo)")
    assert warns({"ONEDIST_BACKEND": "gloo"}, available_backends=["gloo"]) == []
    assert warns({"ONEDIST_BACKEND": "auto"}, available_backends=["gloo"]) == []
    assert warns({"ONEDIST_BACKEND": "nccl"}) == []  # not checked without the list


def test_cuda_visible_devices_without_a_gpu():
    w = one(warns({"CUDA_VISIBLE_DEVICES": "0,1"}, gpu_count=0), "CUDA_VISIBLE_DEVICES")
    assert w.startswith("CUDA_VISIBLE_DEVICES=0,1 but torch sees no GPU")
    assert warns({"CUDA_VISIBLE_DEVICES": "0,1"}, gpu_count=2) == []
    assert warns({"CUDA_VISIBLE_DEVICES": "-1"}, gpu_count=0) == []  # hidden on purpose
    assert warns({"CUDA_VISIBLE_DEVICES": "0"}) == []  # not checked without the count


# ============================================================================ real probes, timeouts
def test_real_probe_of_a_closed_loopback_port_is_refused():
    port = free_port()
    environ = {
        **TORCHRUN_2_NODES,
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    net = diag.network_report(environ)
    assert net["master_probe"]["result"] == "refused" and net["master_probe"]["reachable"] is True
    assert diag.warnings(environ, network=net) == []


def test_slow_resolver_is_abandoned(monkeypatch):
    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(2)
        raise socket.gaierror(socket.EAI_AGAIN, "too late")

    monkeypatch.setattr(socket, "getaddrinfo", slow)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        diag.resolve("slow.example", timeout=0.1)
    assert time.monotonic() - start < 0.5
    assert diag.resolve("10.1.2.3") == ["10.1.2.3"]  # literals need no lookup


def test_unroutable_master_returns_within_a_second():
    """Real probes toward 10.255.255.1 (usually a black hole): bounded by the probe timeouts."""
    environ = {"MASTER_ADDR": "10.255.255.1", "MASTER_PORT": "29500"}
    start = time.monotonic()
    net = diag.network_report(environ)
    assert time.monotonic() - start < 1.0
    # whatever this network does with the address (a sandbox may even accept the connection)
    assert net["master_probe"] is None or net["master_probe"]["timeout_s"] == diag.CONNECT_TIMEOUT


# ============================================================================ the command
_OTHER_LAUNCHERS = (*SLURM_MPI_PREFIXES, "HOROVOD_", "MV2_", "JSM_", "LSB_", "MPI_LOCAL")
_SETTINGS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "ONEDIST_BACKEND", "CUDA_VISIBLE_DEVICES")


def _info_env(extra: dict[str, str], path: Optional[Path] = None) -> dict[str, str]:
    env = {k: v for k, v in clean_env(*_OTHER_LAUNCHERS).items() if k not in _SETTINGS}
    # the child imports the onedist this test imported
    src = str(Path(onedist.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    if path is not None:
        env["PATH"] = f"{path}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def _run_info(
    extra: dict[str, str], *args: str, path: Optional[Path] = None
) -> subprocess.CompletedProcess[str]:
    env = _info_env(extra, path)
    out = subprocess.run(
        [sys.executable, "-m", "onedist", "info", *args], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr  # warnings are advice: still exit status 0
    return out


def test_info_json_in_an_sbatch_script_with_a_bad_gloo_interface(tmp_path):
    """A fake ``srun`` on PATH: the warning only checks that srun is on PATH, it never runs it."""
    fake = tmp_path / "srun"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    extra = {"SLURM_JOB_ID": "5", "SLURM_NTASKS": "4", "GLOO_SOCKET_IFNAME": "doesnotexist0"}
    info = json.loads(_run_info(extra, "--json", path=tmp_path).stdout)
    found = info["warnings"]
    assert len(found) == 2, found
    one(found, "SLURM job 5 has 4 tasks but this process was not started by srun")
    w = one(found, "GLOO_SOCKET_IFNAME=doesnotexist0 names interface(s) that do not exist")
    assert ("lo" in w) == ("lo" in info["network"]["interfaces"])
    gloo = info["network"]["gloo"]
    assert (gloo["interface"], gloo["source"], gloo["exists"]) == (
        "doesnotexist0",
        "GLOO_SOCKET_IFNAME",
        False,
    )
    assert info["detected_environment"] is None


def test_info_human_output_warns_last_about_a_loopback_master():
    extra = {**TORCHRUN_2_NODES, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    lines = _run_info(extra).stdout.splitlines()
    assert lines[-1].startswith("WARNING: MASTER_ADDR=127.0.0.1 is a loopback address"), lines
    assert "this will hang" in lines[-1]
    assert sum(line.startswith("WARNING: ") for line in lines) == 1
    assert (
        "network:" in lines
        and "  interface: lo" in lines
        and not any(line.startswith("warnings:") for line in lines)
    )


NO_GROUP = """
import json, sys, torch.distributed as dist
from onedist.cli import main
assert main(["info", "--json"]) == 0
print(json.dumps({"initialized": dist.is_initialized()}))
"""


def test_info_starts_no_process_group_and_does_not_wait_for_the_job():
    """As rank 1 of a job whose rendezvous host accepts connections but never answers: a process
    group (or a store client) would wait there until its timeout; the probe's connection only
    checks that the port is reachable."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        env = _info_env(
            {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        )
        out = subprocess.run(
            [sys.executable, "-c", NO_GROUP], capture_output=True, text=True, timeout=30, env=env
        )
    assert out.returncode == 0, out.stderr
    *report, last = out.stdout.strip().splitlines()
    assert json.loads(last) == {"initialized": False}
    info = json.loads("\n".join(report))
    assert info["network"]["master_probe"] is not None and not info["warnings"], info


def test_info_json_clean_environment():
    info = json.loads(_run_info({}, "--json").stdout)
    assert info["warnings"] == []
    net = info["network"]
    assert (net["master_addr"], net["master_addr_source"], net["master_probe"]) == (
        "127.0.0.1",
        "default",
        None,
    )
    assert net["interface"] == diag.interface_for("127.0.0.1", net["interfaces"])


@pytest.mark.skipif(
    shutil.which("srun") is None, reason="needs SLURM's srun on PATH (as a real allocation would)"
)
def test_parallel_warns_when_an_sbatch_script_skips_srun(monkeypatch, caplog):
    """`python train.py` in `sbatch --ntasks=2`: one process, not two. Parallel says so at once
    (not only `onedist info`), instead of training on one process in silence."""
    strip_launcher_vars("SLURM_", monkeypatch=monkeypatch)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    with caplog.at_level("WARNING", logger="onedist"):
        od.Parallel(backend="gloo")
    assert "SLURM job 4242 has 2 tasks but this process was not started by srun" in caplog.text
    caplog.clear()
    monkeypatch.setenv("SLURM_NTASKS", "1")
    with caplog.at_level("WARNING", logger="onedist"):
        od.Parallel(backend="gloo")
    assert "srun" not in caplog.text
