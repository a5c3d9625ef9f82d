"""Which backend a run gets, and what each one is said to accept (docs/backends.md).

``backend="auto"`` resolves ONEDIST_BACKEND first, then nccl, then shm for several processes on
one host, then gloo; an explicit name ignores the variable; ``onedist run --backend`` sets it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

import onedist as od
import pyfork
import workers
from launch_env import SLURM_MPI_PREFIXES, clean_env, strip_launcher_vars
from onedist.backends import mpi as od_mpi
from onedist.backends.shm import supported as shm_supported
from onedist.context import resolve_backend_name
from run_helpers import onedist_command

needs_shm = pytest.mark.skipif(not shm_supported(), reason="the shm backend needs Linux on x86-64")


@pytest.fixture(autouse=True)
def _serial_after():
    yield
    od.finalize()


def _launcher_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """No launcher variables and no ONEDIST_BACKEND: `auto` decides from the machine alone."""
    strip_launcher_vars(*SLURM_MPI_PREFIXES, monkeypatch=monkeypatch)
    monkeypatch.delenv("ONEDIST_BACKEND", raising=False)


@needs_shm
def test_auto_resolves_in_the_documented_order(monkeypatch):
    _launcher_free(monkeypatch)
    if "nccl" not in od.available_backends():
        assert resolve_backend_name("auto") == "gloo"  # a lone process on a machine without GPU
    assert resolve_backend_name("auto", nnodes=1, nprocs=2) == "shm"  # spawn/Parallel, one host
    assert resolve_backend_name("auto", nnodes=2, nprocs=2) == "gloo"  # several hosts
    assert resolve_backend_name("auto", nnodes=1, nprocs=1) == "gloo"  # one process
    # launcher variables saying that every process is on this host (torchrun's), or not
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29555")
    assert resolve_backend_name("auto") == "gloo"  # the layout is unknown
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resolve_backend_name("auto") == "shm"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    assert resolve_backend_name("auto") == "gloo"
    # nccl, where it is available, comes before shm; ONEDIST_BACKEND before both
    monkeypatch.setattr("onedist.context.available_backends", lambda: ("gloo", "nccl", "shm"))
    assert resolve_backend_name("auto", nnodes=1, nprocs=2) == "nccl"
    for value, expected in (("gloo", "gloo"), ("shm", "shm"), ("auto", "nccl")):
        monkeypatch.setenv("ONEDIST_BACKEND", value)
        assert resolve_backend_name("auto", nnodes=1, nprocs=2) == expected, value


@needs_shm
def test_auto_takes_onedist_backend_and_an_explicit_backend_ignores_it(monkeypatch):
    _launcher_free(monkeypatch)
    monkeypatch.setenv("ONEDIST_BACKEND", "shm")  # a lone process would otherwise get gloo
    od.initialize("auto")
    assert (od.backend(), dist.get_backend()) == ("shm", "shm")
    od.finalize()
    od.initialize("gloo")
    assert (od.backend(), dist.get_backend()) == ("gloo", "gloo")
    od.finalize()
    monkeypatch.setenv("ONEDIST_BACKEND", "nccl")  # not available here: never tried
    od.initialize("gloo")
    assert od.backend() == "gloo"


@needs_shm
def test_spawn_auto_is_shm_for_several_processes_on_one_host(monkeypatch):
    _launcher_free(monkeypatch)
    got = od.spawn("auto", workers.report, nproc_per_node=2, start_method="fork")
    assert [r["backend"] for r in got] == ["shm", "shm"]
    monkeypatch.setenv("ONEDIST_BACKEND", "gloo")
    got = od.spawn("auto", workers.report, nproc_per_node=2, start_method="fork")
    assert [r["backend"] for r in got] == ["gloo", "gloo"]


REPORT = """
import json, os, sys
import onedist as od
od.initialize("auto")
print("REPORT", json.dumps([os.environ.get("ONEDIST_BACKEND"), od.backend(), os.environ["MASTER_PORT"]]))
od.finalize()
"""


@needs_shm
@pytest.mark.launcher
def test_onedist_run_backend_sets_onedist_backend_in_the_workers(tmp_path):
    """Each run goes against what `auto` picks alone (shm for 2 processes, gloo for 1), so only
    the variable explains the result; the two runs, given no port, each pick a free one."""
    script = tmp_path / "which.py"
    script.write_text(REPORT)
    ports = []
    for n, name in (("2", "gloo"), ("1", "shm")):
        proc = pyfork.run(
            onedist_command("-n", n, "--backend", name, str(script)),
            capture_output=True,
            text=True,
            timeout=180,
            env=clean_env(),
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        lines = [
            json.loads(line.split("REPORT ", 1)[1]) for line in proc.stdout.splitlines() if "REPORT " in line
        ]
        assert len(lines) == int(n), proc.stdout
        assert all(line[:2] == [name, name] for line in lines), lines
        ports.append({line[2] for line in lines})
    assert len(ports[0]) == 1 and ports[0] != ports[1], ports


def test_spawn_and_parallel_pick_a_free_port_when_none_is_given(monkeypatch):
    """A fixed default (torch's 29500, ignite's 15000) would give every run the same port."""
    _launcher_free(monkeypatch)
    ports = [od.spawn("gloo", workers.env_var, args=("MASTER_PORT",), nproc_per_node=2, start_method="fork")]
    ports.append(
        od.spawn("gloo", workers.env_var, args=("MASTER_PORT",), nproc_per_node=2, start_method="fork")
    )
    with od.Parallel(backend="gloo", nproc_per_node=2, start_method="fork") as parallel:
        ports.append([parallel.run(workers.env_var, "MASTER_PORT")])
    assert all(len(set(p)) == 1 and p[0] is not None for p in ports), ports
    assert len({p[0] for p in ports}) == 3, ports


def _refuses_unreducible_dtypes() -> int:
    """uint64 and the float8 types: the docs' OnedistTypeError on every rank, from every reduction,
    and no primitive called first (a rank that sent would leave its peers waiting); the group
    stays in step afterwards."""
    from checks import count_primitives
    from onedist.errors import OnedistTypeError

    rank, world = od.get_rank(), od.get_world_size()
    names = [n for n in ("uint64", "float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]
    calls = {
        "all_reduce": lambda t: od.all_reduce(t),
        "all_reduce(MAX)": lambda t: od.all_reduce(t, op="MAX"),
        "reduce": lambda t: od.reduce(t, dst=world - 1),
    }
    for name in names:
        dtype = getattr(torch, name)
        expected = (
            f"onedist: gloo cannot reduce tensors of dtype torch.{name} (it reduces torch.bfloat16, "
            "torch.bool, torch.float16, torch.float32, torch.float64, torch.int32, torch.int64, "
            "torch.int8, torch.uint8, and onedist widens int16, uint16 and uint32)\n"
            "HINT: convert first, e.g. t.to(torch.int64) or t.float()"
        )
        for what, call in calls.items():
            with count_primitives() as counts:
                try:
                    call(torch.ones(4, dtype=dtype))
                except OnedistTypeError as e:
                    assert str(e) == expected, (name, what, str(e))
                else:
                    raise AssertionError(f"{what} of {name} on gloo did not raise")
            assert sum(counts.values()) == 0, (name, what, dict(counts))
        assert od.all_reduce(rank + 1) == world * (world + 1) // 2  # nobody was left waiting
    return len(names) * len(calls)


def test_gloo_refuses_uint64_and_float8_on_every_rank_before_sending(multi):
    counts = multi(_refuses_unreducible_dtypes)
    assert counts == [counts[0]] * multi.world_size and counts[0] >= 3, counts


def _uint64_means() -> list[list[float]]:
    """MEAN of uint64 values from 2**63 (past int64), as a tensor, in a dict and beside a number."""
    x = torch.tensor([2**63 + 2**40 * od.get_rank(), 3 + od.get_rank()], dtype=torch.uint64)
    return [
        od.all_reduce(x, op="MEAN").double().tolist(),
        od.all_reduce({"a": x}, op="MEAN")["a"].double().tolist(),
        od.all_reduce([x, 1], op="MEAN")[0].double().tolist(),
    ]


def test_the_mean_of_uint64_is_right_past_int64(world):
    """The other reductions of uint64 are refused on gloo; its MEAN is a float, summed in float64
    (int64, where the other integers are summed, would wrap at 2**63)."""
    n = world.world_size
    mean = torch.tensor([2**63 + 2**40 * (n - 1) / 2, 3 + (n - 1) / 2], dtype=torch.float64)
    expected = mean.to(torch.get_default_dtype()).double().tolist()
    assert world(_uint64_means) == [[expected] * 3] * n


def test_mpi_is_listed_when_mpi4py_is_installed(monkeypatch):
    if importlib.util.find_spec("mpi4py") is None or not od_mpi.installed():
        pytest.skip("needs mpi4py and an MPI library")
    assert "mpi" in od.available_backends()
    if dist.is_mpi_available():
        return  # a torch built against MPI lists it whatever mpi4py does
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mpi4py" else real(name, *a)
    )
    od_mpi.installed.cache_clear()
    try:
        assert "mpi" not in od.available_backends()
    finally:
        monkeypatch.undo()
        od_mpi.installed.cache_clear()


@pytest.mark.parametrize("users_ft", [None, "0"], ids=["ft-unset", "ft-set-by-the-user"])
def test_initialize_mpi_runs_onedists_mpi4py_group(users_ft):
    """A singleton MPI process (no mpirun): torch's name is "mpi4py", onedist's "mpi"; Open MPI 5's
    ULFM switch is on (a mismatch can then be broken), unless the user set it. In a child:
    starting MPI in the test process would outlive the test."""
    if dist.is_mpi_available() or not od_mpi.installed():
        pytest.skip("needs mpi4py and an MPI library, and a torch without MPI of its own")
    code = (
        "import os, onedist as od, torch, torch.distributed as dist\n"
        "od.initialize('mpi')\n"
        "print(od.backend(), dist.get_backend(), od.all_reduce(torch.ones(2)).tolist(),"
        " os.environ['OMPI_MCA_mpi_ft_enable'])\n"
        "od.finalize()\n"
    )
    env = clean_env()
    env.pop("OMPI_MCA_mpi_ft_enable", None)
    if users_ft is not None:
        env["OMPI_MCA_mpi_ft_enable"] = users_ft
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1] == f"mpi mpi4py [1.0, 1.0] {users_ft or '1'}", proc.stdout


def test_shm_is_listed_only_on_linux_x86_64(monkeypatch):
    for machine, system in (("aarch64", "linux"), ("x86_64", "darwin")):
        monkeypatch.setattr(platform, "machine", lambda m=machine: m)
        monkeypatch.setattr(sys, "platform", system)
        assert not shm_supported() and "shm" not in od.available_backends(), (machine, system)
        assert resolve_backend_name("auto", nnodes=1, nprocs=2) != "shm"
    monkeypatch.undo()
    assert ("shm" in od.available_backends()) == (sys.platform == "linux" and platform.machine() == "x86_64")


def test_a_failure_while_registering_the_torch_plugin_is_only_a_warning(monkeypatch):
    """torch calls the entry point inside every `import torch`: an exception would fail them all."""
    from onedist import _torch_plugin

    (entry,) = [e for e in importlib.metadata.entry_points(group="torch.backends") if e.name == "onedist"]
    assert entry.value == "onedist._torch_plugin:autoload"

    def broken() -> None:
        raise RuntimeError("an unusual torch")

    monkeypatch.setattr(_torch_plugin, "register_torch_backends", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        entry.load()()
    assert [str(w.message) for w in caught] == [
        "onedist could not register its torch.distributed backends: RuntimeError('an unusual torch')"
    ]


# sums that wrap, of 1000 elements: Open MPI 4.1's vector kernels, which saturate, took 8-bit sums
# of 64 elements or more here and 16-bit ones of 8 or more (shorter ones wrapped)
WRAPPING_SUMS = """
import torch, torch.distributed as dist, onedist as od
od.initialize("mpi")
for dtype, value in ((torch.uint8, 200), (torch.int8, 100), (torch.int16, 30000), (torch.uint16, 60000)):
    t = torch.full((1000,), value, dtype=dtype)
    dist.all_reduce(t)
    if od.get_rank() == 0:
        print(str(dtype), sorted(set(t.long().tolist())), flush=True)
od.finalize()
"""


@pytest.mark.launcher
def test_mpi4py_sums_of_8_and_16_bit_integers_wrap_as_torchs_instead_of_saturating():
    """Open MPI 4.1 saturates these sums (200 + 200 = 255 in uint8); onedist reduces them in a wider
    type, so they wrap as torch's and gloo's do."""
    from prereqs import mpirun_missing

    if dist.is_mpi_available() or mpirun_missing() is not None:
        pytest.skip(str(mpirun_missing() or "a torch with MPI of its own"))
    command = [
        "mpirun",
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        "2",
        sys.executable,
        "-c",
        WRAPPING_SUMS,
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env=clean_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    expected = {
        torch.uint8: 200 + 200 - 256,
        torch.int8: 100 + 100 - 256,
        torch.int16: 30000 + 30000 - 65536,
        torch.uint16: 60000 + 60000 - 65536,
    }
    assert proc.stdout.splitlines() == [f"{dtype} [{value}]" for dtype, value in expected.items()], (
        proc.stdout
    )


def test_the_error_for_a_backend_not_here_is_the_one_backends_md_shows(monkeypatch):
    """docs/backends.md quotes the error of backend='nccl' on a machine with gloo and shm only."""
    if "nccl" in od.available_backends():
        pytest.skip("nccl is available here: the page shows a machine without it")
    monkeypatch.setattr("onedist.context.available_backends", lambda: ("gloo", "shm"))
    with pytest.raises(od.BackendUnavailableError) as info:
        od.initialize("nccl")
    shown = f"{type(info.value).__module__}.{type(info.value).__name__}: {info.value}"
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "backends.md")) as f:
        assert shown + "\n```" in f.read(), shown
