"""Ports and interfaces: one-node jobs listen on loopback only; a port in use fails fast with the fix."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import onedist as od
import pyfork
import workers
from launch_env import clean_env
from netutil import is_loopback_listener
from onedist.errors import OnedistRuntimeError
from run_helpers import onedist_command

LISTENERS = str(Path(__file__).parent / "scripts" / "listeners.py")


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_spawn_one_node_listens_on_loopback_only(start_method):
    found = od.spawn("gloo", workers.listeners, nproc_per_node=2, start_method=start_method)
    assert all(found), found  # rank 0 hosts the store, every rank a gloo listener
    assert all(is_loopback_listener(a) for per_rank in found for a in per_rank), found


@pytest.mark.launcher
def test_onedist_run_one_node_listens_on_loopback_only(tmp_path):
    proc = pyfork.run(
        onedist_command("-n", "2", LISTENERS, str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=240,
        env=clean_env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = [json.loads((tmp_path / f"{r}.json").read_text())["listening"] for r in range(2)]
    assert all(found) and all(is_loopback_listener(a) for per_rank in found for a in per_rank), found


def test_group_of_one_listens_on_loopback_and_frees_the_port():
    env = clean_env()
    code = (
        "import os, onedist as od\n"
        "from netutil import listening\n"
        "od.initialize('gloo')\n"
        "print(sorted(listening(os.getpid())))\n"
        "od.finalize()\n"
        "print(sorted(listening(os.getpid())))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "PYTHONPATH": str(Path(__file__).parent)},
    )
    assert proc.returncode == 0, proc.stderr
    during, after = (eval(line) for line in proc.stdout.splitlines()[-2:])
    assert during and all(is_loopback_listener(a) for a in during), during
    assert after == [], after


def _taken_port() -> socket.socket:
    s = socket.socket()
    s.bind(("", 0))
    s.listen()
    return s


def test_spawn_port_in_use_fails_before_starting_workers():
    with _taken_port() as s:
        port = s.getsockname()[1]
        expected = rf"master_port={port} is already in use(.|\n)*HINT"
        with pytest.raises(OnedistRuntimeError, match=expected) as e:
            od.spawn("gloo", workers.report, nproc_per_node=2, master_port=port)
    assert "ss -ltnp" in str(e.value)


@pytest.mark.launcher
@pytest.mark.parametrize("nnodes", ["1", "2"])
def test_onedist_run_port_in_use_is_a_usage_error(nnodes, tmp_path):
    with _taken_port() as s:
        port = str(s.getsockname()[1])
        proc = pyfork.run(
            onedist_command("--nnodes", nnodes, "--master-port", port, "-n", "1", LISTENERS, str(tmp_path)),
            capture_output=True,
            text=True,
            timeout=60,
            env=clean_env(),
        )
    assert proc.returncode == 2
    assert f"--master-port={port} is already in use" in proc.stderr and "HINT" in proc.stderr
    assert not list(tmp_path.iterdir())  # no worker ran


def _other_interface() -> tuple[str, str] | None:
    """A non-loopback interface with an IPv4 address, and that address (onedist info's listing)."""
    from onedist._diagnose import list_interfaces

    for name, addresses in (list_interfaces() or {}).items():
        if not name.startswith("lo") and addresses:
            return name, addresses[0]
    return None


def test_gloo_socket_ifname_set_by_the_user_wins(monkeypatch):
    other = _other_interface()
    if other is None:
        pytest.skip("this machine has no non-loopback IPv4 interface")
    name, ip = other
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", name)
    found = od.spawn("gloo", workers.listeners, nproc_per_node=2, start_method="fork")
    gloo = [a for per_rank in found for a in per_rank if a.startswith(ip + ":")]
    assert len(gloo) >= 2, found  # each rank's gloo pair listens on the user's interface


def test_gloo_is_pinned_to_loopback_by_default():
    assert od.spawn("gloo", workers.env_var, args=("GLOO_SOCKET_IFNAME",), nproc_per_node=2) == ["lo", "lo"]
