"""``onedist run --recovery live`` for real (issue 53, point 1): a rank SIGKILLed mid-training is
started again alone, the survivors keep their processes and roll back to the start of their step,
the replacement gets the state from a survivor, and the run ends with the uninterrupted run's
weights, bit for bit. Refusals: at once, naming what is supported."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

import onedist as od
from launch_env import clean_env
from run_helpers import onedist_command

pytestmark = [pytest.mark.launcher, pytest.mark.slow]

pytest.importorskip("sklearn", reason="the digits example needs scikit-learn (in the test extra)")

SCRIPT = str(Path(__file__).parent / "scripts" / "live_digits.py")
EPOCHS = "4"  # 23 batches an epoch on 3 ranks: 92 batches


def _run(tmp: Path, *flags: str, script_args: tuple[str, ...] = ()) -> tuple[Any, dict]:
    final = tmp / "final.pt"
    argv = onedist_command(
        "-n", "3", "--backend", "gloo", *flags,
        SCRIPT, "--epochs", EPOCHS, "--final", str(final), *script_args,
    )  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=clean_env("ONEDIST_"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, torch.load(final, weights_only=True)


def _uninterrupted(tmp: Path, accumulate: int) -> dict:
    proc, weights = _run(tmp, script_args=("--accumulate", str(accumulate)))
    assert "live recovery" not in proc.stderr
    return weights


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    return _uninterrupted(tmp_path_factory.mktemp("uninterrupted"), 1)


@pytest.fixture(scope="module")
def uninterrupted_k4(tmp_path_factory) -> dict:
    return _uninterrupted(tmp_path_factory.mktemp("uninterrupted_k4"), 4)


def _workers(out: str) -> dict[tuple[int, str], set[int]]:
    """(rank, "start"/"end") -> the pids that said so."""
    found: dict[tuple[int, str], set[int]] = {}
    for pid, rank, what in re.findall(r"pid (\d+) rank (\d) generation \d+ (start|end)", out):
        found.setdefault((int(rank), what), set()).add(int(pid))
    return found


def check_live(out: str, err: str, replaced: list[int]) -> None:
    """The survivors' pids never changed (one start, the same pid at the end); each rank of
    ``replaced`` was started once more, alone, and received the state from a survivor."""
    pids, shown = _workers(out), out[-3000:]
    for rank in range(3):
        started, ended = pids[(rank, "start")], pids[(rank, "end")]
        assert len(ended) == 1, shown
        if rank in replaced:
            assert len(started) == 2 and ended < started, shown  # a new process ended
        else:
            assert started == ended, shown  # the same process throughout
    lines = re.findall(r"worker rank (\d) \(pid \d+\) was killed by signal SIGKILL; live recovery", err)
    assert [int(r) for r in lines] == replaced, err[-3000:]
    received = re.findall(r"\[rank(\d)\]: onedist: live recovery: rank \d \(generation (\d)\) received", err)
    expected = [(r, g + 1) for g, r in enumerate(replaced)]  # each in the next generation
    assert [(int(r), int(g)) for r, g in received] == expected, err[-3000:]
    assert "restarting the workers" not in err


def check_same(weights: dict, expected: dict) -> None:
    assert weights.keys() == expected.keys()
    differ = [k for k in weights if not torch.equal(weights[k], expected[k])]
    assert differ == [], "weights differ from the uninterrupted run"


def test_rank_1_killed_at_step_35_is_replaced_alone_and_bit_identical(uninterrupted, tmp_path):
    """--inject-failure rank=1,step=35: the survivors (ranks 0 and 2) keep their pids, the run
    finishes, and the final weights are the uninterrupted run's."""
    flags = ("--max-restarts", "1", "--recovery", "live", "--inject-failure", "rank=1,step=35")
    proc, weights = _run(tmp_path, *flags)
    said = "rank 1 ends itself by SIGKILL after optimizer step 35"
    assert proc.stderr.count(said) == 1, proc.stderr[-3000:]
    check_live(proc.stdout, proc.stderr, replaced=[1])
    assert re.search(r"received the state of step 36 from rank 0", proc.stderr), proc.stderr[-3000:]
    check_same(weights, uninterrupted)


def test_two_failures_are_each_replaced_alone(uninterrupted, tmp_path):
    """Rank 1 at step 35 (injected), then rank 2 before its 60th step (it kills itself)."""
    flags = ("--max-restarts", "2", "--recovery", "live", "--inject-failure", "rank=1,step=35")
    proc, weights = _run(tmp_path, *flags, script_args=("--kill", "2:60"))
    check_live(proc.stdout, proc.stderr, replaced=[1, 2])
    check_same(weights, uninterrupted)


def test_accumulation_killed_inside_a_window_twice_is_bit_identical(uninterrupted_k4, tmp_path):
    """od.accumulate over 4 batches; rank 1 dies before micro-step 30 (the 2nd of its window) and
    rank 2 before micro-step 61 (the 3rd of its): the survivors roll back to the window's start."""
    flags = ("--max-restarts", "2", "--recovery", "live")
    script_args = ("--accumulate", "4", "--kill", "1:30", "--kill", "2:61")
    proc, weights = _run(tmp_path, *flags, script_args=script_args)
    check_live(proc.stdout, proc.stderr, replaced=[1, 2])
    check_same(weights, uninterrupted_k4)


LOOP_WITHOUT_STEPS = """
import torch, onedist as od
od.initialize("gloo")
print(f"attempt {od.restart_count()} rank {od.get_rank()}", flush=True)
model = od.auto_model(torch.nn.Linear(2, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
od.finalize()
"""


def test_a_loop_without_od_steps_keeps_todays_restart(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(LOOP_WITHOUT_STEPS)
    argv = onedist_command(
        "-n", "2", "--backend", "gloo", "--max-restarts", "1", "--recovery", "live",
        "--inject-failure", "rank=1,step=3", str(script),
    )  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=clean_env("ONEDIST_"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "restarting the workers (attempt 1 of 1)" in proc.stderr, proc.stderr[-3000:]
    assert "live recovery" not in proc.stderr
    assert "attempt 1 rank 0" in proc.stdout


@pytest.mark.parametrize(
    "flags, says",
    [
        (("--recovery", "sometimes"), "--recovery='sometimes' is not allowed; allowed: 'restart'"),
        (("--recovery", "live"), "--max-restarts=0 is not allowed with it; allowed: an int >= 1"),
        (("--recovery", "live", "--max-restarts", "1", "--backend", "shm"),
         "--recovery=live is not allowed with backend 'shm'; allowed: 'gloo'"),
        (("--recovery", "live", "--max-restarts", "1", "--backend", "horovod"),
         "--recovery=live is not allowed with backend 'horovod'; allowed: 'gloo'"),
        (("--recovery", "live", "--max-restarts", "1", "--backend", "mpi"),
         "--recovery=live is not allowed with backend 'mpi'; allowed: 'gloo'"),
        (("--recovery", "live", "--max-restarts", "1", "--backend", "xla-tpu"),
         "--recovery=live is not allowed with backend 'xla-tpu'; allowed: 'gloo'"),
        (("--recovery", "live", "--max-restarts", "1"),  # auto is shm for several processes here
         "--recovery=live is not allowed with backend 'shm' (what --backend auto resolves to here)"),
        (("--recovery", "live", "--max-restarts", "1", "--backend", "gloo", "--nnodes", "2",
          "--node-rank", "0", "--master-port", "29999"), "--recovery=live is not allowed with --nnodes=2"),
    ],
)  # fmt: skip
def test_onedist_run_refuses_what_live_recovery_cannot_do_before_any_worker_starts(flags, says, tmp_path):
    argv = onedist_command("-n", "2", *flags, SCRIPT)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=clean_env("ONEDIST_"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert says in proc.stderr, proc.stderr[-3000:]
    assert "pid " not in proc.stdout  # no worker started


def test_spawn_and_parallel_refuse_live_naming_onedist_run():
    refused = r"recovery='live' is not allowed.*onedist run"
    with pytest.raises(od.OnedistValueError, match=r"onedist.Parallel: " + refused):
        od.Parallel(backend="gloo", nproc_per_node=2, recovery="live")
    with pytest.raises(od.OnedistValueError, match=r"onedist.spawn: " + refused):
        od.spawn("gloo", print, nproc_per_node=2, recovery="live")
    with pytest.raises(od.OnedistValueError, match=r"recovery='sometimes' is not allowed; allowed: 're"):
        od.Parallel(backend="gloo", nproc_per_node=2, recovery="sometimes")
    with pytest.raises(od.OnedistTypeError, match=r"recovery has type int"):
        od.spawn("gloo", print, nproc_per_node=2, recovery=1)


PARALLEL_UNDER_RUN = """
import onedist as od

def train(local_rank):
    print(f"rank {od.get_rank()} of {od.get_world_size()}", flush=True)

if __name__ == "__main__":
    with od.Parallel(backend="gloo", recovery="live") as parallel:
        parallel.run(train)
"""


def test_parallel_recovery_live_only_initialises_under_onedist_run(tmp_path):
    script = tmp_path / "parallel.py"
    script.write_text(PARALLEL_UNDER_RUN)
    argv = onedist_command(
        "-n", "2", "--backend", "gloo", "--max-restarts", "1", "--recovery", "live", str(script)
    )
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=clean_env("ONEDIST_"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rank 0 of 2" in proc.stdout and "rank 1 of 2" in proc.stdout


REFUSED_IN_THE_LOOP = """
import sys, torch, onedist as od
od.initialize("auto")
model = od.auto_model(torch.nn.Linear(4, 4), sharding="fsdp" if sys.argv[1] == "fsdp" else None)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)
try:
    od.steps(loader, model, optimizer)
except od.OnedistValueError as e:
    print("refused:", str(e).splitlines()[0], flush=True)
od.finalize()
"""


@pytest.mark.parametrize(
    "backend, model, says",
    [
        ("gloo", "fsdp", "onedist.steps: model='FSDPLinear (sharded: FSDP2)' is not allowed; allowed: a "
         "DistributedDataParallel model"),
        ("shm", "ddp", "onedist.steps: backend='shm' is not allowed; allowed: 'gloo'"),
    ],
)  # fmt: skip
def test_od_steps_refuses_a_sharded_model_or_another_backend_at_once(backend, model, says, tmp_path):
    """Under live recovery (ONEDIST_RECOVERY=live, as the launcher sets it), od.steps refuses at
    its construction, naming what is supported."""
    script = tmp_path / "refused.py"
    script.write_text(REFUSED_IN_THE_LOOP)
    argv = onedist_command("-n", "2", "--backend", backend, str(script), model)
    env = clean_env("ONEDIST_", ONEDIST_RECOVERY="live")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count(f"refused: {says}") == 2, proc.stdout[-3000:]


def test_od_steps_bad_arguments_name_the_argument():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.randn(4, 2), batch_size=2)
    with pytest.raises(
        od.OnedistValueError, match=r"onedist.steps: epochs=0 is not allowed; allowed: an int"
    ):
        od.steps(loader, model, optimizer, epochs=0)
    with pytest.raises(od.OnedistTypeError, match=r"onedist.steps: epochs has type float"):
        od.steps(loader, model, optimizer, epochs=1.0)
    with pytest.raises(od.OnedistTypeError, match=r"onedist.steps: model has type str"):
        od.steps(loader, "model", optimizer)
    with pytest.raises(od.OnedistTypeError, match=r"onedist.steps: loader has type int"):
        od.steps(3, model, optimizer)
    with pytest.raises(od.OnedistTypeError, match=r"onedist.steps: state\['meter'\] has type list"):
        od.steps(loader, model, optimizer, state={"meter": []})


def test_serially_od_steps_only_iterates_and_sets_the_sampler_epoch():
    """No live recovery: each pass calls set_epoch; a failure inside a step is not swallowed."""
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = od.DistributedSampler(list(range(4)), num_replicas=1, rank=0, shuffle=False)
    loader = torch.utils.data.DataLoader(torch.randn(4, 2), batch_size=2, sampler=sampler)
    seen = []
    for step in od.steps(loader, model, optimizer, epochs=3):
        with step:
            seen.append((step.epoch, step.index, step.number, sampler.epoch))
    assert seen == [(e, i, 2 * e + i + 1, e) for e in range(3) for i in range(2)]
    with pytest.raises(od.RemoteRankError):
        for step in od.steps(loader, model, optimizer):
            with step:
                raise od.RemoteRankError("a peer died", 1)
