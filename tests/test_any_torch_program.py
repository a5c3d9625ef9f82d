"""onedist's backends by name in programs that never call onedist: a plain torch script, Lightning
and Accelerate under torchrun (tests/scripts/any_torch), each compared with gloo (2 ranks, CPU).

torch registers "shm" and "mpi4py" at `import torch` through onedist's `torch.backends` entry
point (onedist/_torch_plugin.py); these tests need onedist installed (`pip install -e .`), as
the README says, so that the entry point exists.
"""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import pyfork
from launch_env import clean_env
from prereqs import mpi4py_missing, mpirun_missing

SCRIPTS = Path(__file__).parent / "scripts" / "any_torch"
pytestmark = pytest.mark.launcher
STEPS = "6"
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")


def _needs(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        # printed too: a skipped framework must be visible in CI's log, not only with -rs
        print(f"skipping: {module} is not installed (pip install -e '.[test]')")
        pytest.skip(f"{module} is not installed (pip install -e '.[test]')")


def _launch(*args: str, launcher: tuple[str, ...] = TORCHRUN, **env_set: str) -> dict[int, str]:
    """Run a script on 2 ranks (``launcher``: the command before the script's path); each rank's
    ``rank R ...`` lines, joined."""
    done = pyfork.run(
        [*launcher, *args], cwd=SCRIPTS, env=clean_env(**env_set), capture_output=True, text=True, timeout=240
    )
    lines: dict[int, str] = {0: "", 1: ""}
    # "rank R what|": the ranks share one pipe, so a line may land inside another rank's
    for rank, said in re.findall(r"rank (\d+) ([^|\n]*)\|", done.stdout):
        lines[int(rank)] += f"rank {rank} {said}\n"
    # torch 2.13: a worker may abort at exit after its script succeeded, when a gloo thread takes
    # the GIL while Python finalizes (see test_torchrun_parity._torch_exit_abort); not ours
    exit_abort = "terminate called without an active exception" in done.stderr and all(lines.values())
    assert done.returncode == 0 or exit_abort, done.stdout[-3000:] + done.stderr[-5000:]
    return lines


def _results(lines: dict[int, str]) -> dict[int, str]:
    """Each rank's ``loss ... params ...`` line (step times differ run to run)."""
    return {r: next(line for line in text.splitlines() if " loss " in line) for r, text in lines.items()}


def test_torch_registers_the_names_through_the_entry_point() -> None:
    assert any(ep.value == "onedist._torch_plugin:autoload" for ep in entry_points(group="torch.backends"))
    code = (
        "import sys, torch.distributed as d; "
        "print('shm' in d.Backend.backend_list, 'mpi4py' in d.Backend.backend_list, "
        "d.Backend.default_device_backend_map['cpu'], 'onedist.backends' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.split() == ["True", "True", "gloo", "False"]  # gloo stays the CPU default
    off = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=off)
    assert run.stdout.split()[0] == "False"


def test_register_is_idempotent_and_keeps_a_name_registered_by_others() -> None:
    import torch.distributed as dist

    import onedist

    assert onedist.register_torch_backends() == ("shm", "mpi4py")
    before = dict(dist.Backend._plugins)
    assert onedist.register_torch_backends() == ("shm", "mpi4py")
    assert dict(dist.Backend._plugins) == before


def test_plain_torch_script_on_shm_equals_gloo() -> None:
    """all_reduce, all_gather, broadcast and a DDP step: the script compares with a gloo group."""
    lines = _launch("plain.py", "shm")
    assert all(f"rank {r} ok backend=shm world=2" in lines[r] for r in (0, 1)), lines


def test_plain_torch_script_on_mpi4py_under_mpirun() -> None:
    """torch's name for onedist's mpi4py group ("mpi" is torch's built-in, absent from the wheels)."""
    missing = mpi4py_missing() or mpirun_missing()
    if missing:
        print(f"skipping: {missing}")
        pytest.skip(str(missing))
    with socket.socket() as s:  # a free port for torch's env:// store (plain.py sets the rest)
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    mpirun = ("mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable)
    lines = _launch("plain.py", "mpi4py", launcher=mpirun, MASTER_PORT=port)
    assert all(f"rank {r} ok backend=mpi4py world=2" in lines[r] for r in (0, 1)), lines


def test_lightning_ddp_strategy_on_shm_ends_with_gloos_loss() -> None:
    _needs("lightning")
    gloo = _results(_launch("lightning_run.py", "gloo", STEPS))
    shm = _results(_launch("lightning_run.py", "shm", STEPS))
    assert shm == gloo


def test_accelerate_on_shm_ends_with_gloos_loss() -> None:
    """Accelerate 1.x maps every multi-CPU run to gloo (or a built-in mpi) and refuses any other
    name in ``InitProcessGroupKwargs(backend=...)``; it adopts a group that already exists, so
    ``dist.init_process_group("shm")`` before ``Accelerator()`` is the way on CPU."""
    _needs("accelerate")
    gloo = _results(_launch("accelerate_run.py", "gloo", "kwargs", STEPS))
    shm = _results(_launch("accelerate_run.py", "shm", "preinit", STEPS))
    assert shm == gloo


def test_accelerate_refuses_shm_in_init_process_group_kwargs_on_cpu() -> None:
    """Guards the documented limitation: when Accelerate accepts the name, this fails, and the
    docs (docs/migration/accelerate.md) and the test above should switch to the kwargs route."""
    _needs("accelerate")
    lines = _launch("accelerate_run.py", "shm", "kwargs", STEPS)
    assert "refused: Your assigned backend shm is not available" in lines[0] + lines[1], lines
