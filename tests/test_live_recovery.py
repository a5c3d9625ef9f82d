"""``onedist run --recovery live`` for real (issue 53, point 1): a rank SIGKILLed mid-training is
started again alone, the survivors keep their processes and roll back to the start of their step,
the replacement gets the state from a survivor, and the run ends with the uninterrupted run's
weights, bit for bit. Refusals: at once, naming what is supported."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import onedist as od
import pyfork
from launch_env import clean_env
from run_helpers import onedist_command

pytestmark = [pytest.mark.launcher, pytest.mark.slow]

pytest.importorskip("sklearn", reason="the digits example needs scikit-learn (in the test extra)")

SCRIPT = str(Path(__file__).parent / "scripts" / "live_digits.py")
EPOCHS = "4"  # 23 batches an epoch on 3 ranks: 92 batches
#: the backends live recovery runs on: onedist's recorded gloo group and its shared-memory group
BACKENDS = ("gloo", "shm")


def _run(tmp: Path, backend: str, *flags: str, script_args: tuple[str, ...] = ()) -> tuple[Any, dict]:
    final = tmp / "final.pt"
    argv = onedist_command(
        "-n", "3", "--backend", backend, *flags,
        SCRIPT, "--epochs", EPOCHS, "--final", str(final), *script_args,
    )  # fmt: skip
    proc = pyfork.run(argv, capture_output=True, text=True, timeout=240, env=clean_env("ONEDIST_"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, torch.load(final, weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Any:
    """The uninterrupted run's weights, by backend and script arguments, each run once."""
    runs: dict[tuple[str, ...], dict] = {}

    def weights(backend: str, *script_args: str) -> dict:
        key = (backend, *script_args)
        if key not in runs:
            tmp = tmp_path_factory.mktemp(f"uninterrupted_{backend}")
            proc, runs[key] = _run(tmp, backend, script_args=script_args)
            assert "live recovery" not in proc.stderr
        return runs[key]

    return weights


def _workers(out: str) -> dict[tuple[int, str], set[int]]:
    """(rank, "start"/"end") -> the pids that said so."""
    found: dict[tuple[int, str], set[int]] = {}
    for pid, rank, what in re.findall(r"pid (\d+) rank (\d) generation \d+ (start|end)", out):
        found.setdefault((int(rank), what), set()).add(int(pid))
    return found


def check_live(out: str, err: str, replaced: list[int], together: bool = False) -> None:
    """The survivors' pids never changed (one start, the same pid at the end); each rank of
    ``replaced`` was started once more and received the state from a survivor: alone, each in the
    next generation, or (``together``: ranks that died at once) all in the last generation."""
    pids, shown = _workers(out), out[-3000:]
    for rank in range(3):
        started, ended = pids[(rank, "start")], pids[(rank, "end")]
        assert len(ended) == 1, shown
        if rank in replaced:
            assert len(started) == 2 and ended < started, shown  # a new process ended
        else:
            assert started == ended, shown  # the same process throughout
    lines = re.findall(r"worker rank (\d) \(pid \d+\) was killed by signal SIGKILL; live recovery", err)
    received = re.findall(r"\[rank(\d)\]: onedist: live recovery: rank \d \(generation (\d)\) received", err)
    got = [(int(r), int(g)) for r, g in received]
    if together:  # in the order the launcher saw them die; one generation, the last
        assert sorted(int(r) for r in lines) == replaced, err[-3000:]
        assert sorted(got) == [(r, len(replaced)) for r in replaced], err[-3000:]
    else:
        assert [int(r) for r in lines] == replaced, err[-3000:]
        assert got == [(r, g + 1) for g, r in enumerate(replaced)], err[-3000:]  # each in the next generation
    assert "restarting the workers" not in err


def check_same(weights: dict, expected: dict) -> None:
    assert weights.keys() == expected.keys()
    differ = [k for k in weights if not torch.equal(weights[k], expected[k])]
    assert differ == [], "weights differ from the uninterrupted run"


@pytest.mark.parametrize("backend", BACKENDS)
def test_rank_1_killed_at_step_35_is_replaced_alone_and_bit_identical(backend, uninterrupted, tmp_path):
    """--inject-failure rank=1,step=35: the survivors (ranks 0 and 2) keep their pids, the run
    finishes, and the final weights are the uninterrupted run's."""
    flags = ("--max-restarts", "1", "--recovery", "live", "--inject-failure", "rank=1,step=35")
    proc, weights = _run(tmp_path, backend, *flags)
    said = "rank 1 ends itself by SIGKILL after optimizer step 35"
    assert proc.stderr.count(said) == 1, proc.stderr[-3000:]
    check_live(proc.stdout, proc.stderr, replaced=[1])
    assert re.search(r"received the state of step 36 from rank 0", proc.stderr), proc.stderr[-3000:]
    check_same(weights, uninterrupted(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_failures_are_each_replaced_alone(backend, uninterrupted, tmp_path):
    """Rank 1 at step 35 (injected), then rank 2 before its 60th step (it kills itself)."""
    flags = ("--max-restarts", "2", "--recovery", "live", "--inject-failure", "rank=1,step=35")
    proc, weights = _run(tmp_path, backend, *flags, script_args=("--kill", "2:60"))
    check_live(proc.stdout, proc.stderr, replaced=[1, 2])
    check_same(weights, uninterrupted(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_accumulation_killed_inside_a_window_twice_is_bit_identical(backend, uninterrupted, tmp_path):
    """od.accumulate over 4 batches; rank 1 dies before micro-step 30 (the 2nd of its window) and
    rank 2 before micro-step 61 (the 3rd of its): the survivors roll back to the window's start."""
    flags = ("--max-restarts", "2", "--recovery", "live")
    script_args = ("--accumulate", "4", "--kill", "1:30", "--kill", "2:61")
    proc, weights = _run(tmp_path, backend, *flags, script_args=script_args)
    check_live(proc.stdout, proc.stderr, replaced=[1, 2])
    check_same(weights, uninterrupted(backend, "--accumulate", "4"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_ranks_dying_at_once_are_replaced_together(backend, uninterrupted, tmp_path):
    """Ranks 1 and 2 SIGKILL themselves before micro-step 40: the launcher sees one, starts its
    replacement, then sees the other before the group could be made again; the survivor (rank 0)
    and both replacements meet in the last generation, and rank 0 sends both the state."""
    flags = ("--max-restarts", "2", "--recovery", "live")
    proc, weights = _run(tmp_path, backend, *flags, script_args=("--kill", "1:40", "--kill", "2:40"))
    check_live(proc.stdout, proc.stderr, replaced=[1, 2], together=True)
    assert proc.stderr.count("received the state of step 40 from rank 0") == 2, proc.stderr[-3000:]
    check_same(weights, uninterrupted(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_ddp_with_several_buckets_is_bit_identical(backend, uninterrupted, tmp_path):
    """bucket_cap_mb=0.01: the digits model's gradients take several DDP buckets, and the first
    step after the recovery uses the survivors' buckets on every rank (gloo's ring sums each element
    in an order that depends on its place in its bucket: another bucketing changes the bits)."""
    flags = ("--max-restarts", "1", "--recovery", "live", "--inject-failure", "rank=1,step=35")
    buckets = ("--bucket-cap-mb", "0.01")
    proc, weights = _run(tmp_path, backend, *flags, script_args=buckets)
    check_live(proc.stdout, proc.stderr, replaced=[1])
    check_same(weights, uninterrupted(backend, *buckets))


@pytest.mark.parametrize("backend", BACKENDS)
def test_rank_0_dying_is_replaced_and_bit_identical(backend, uninterrupted, tmp_path):
    """Rank 0 (whose BatchNorm statistics DDP broadcasts at each forward pass, and which saves the
    final weights) SIGKILLs itself before micro-step 40: the store lives in the launcher, rank 1
    sends the state, and the replacement takes rank 0's own buffers and RNG states of the step's
    start from the launcher's store (the sender's statistics would be wrong)."""
    flags = ("--max-restarts", "1", "--recovery", "live")
    proc, weights = _run(tmp_path, backend, *flags, script_args=("--kill", "0:40"))
    check_live(proc.stdout, proc.stderr, replaced=[0])
    said = "received the state of step 40 from rank 1, "
    assert said in proc.stderr and "; its own RNG states" in proc.stderr, proc.stderr[-3000:]
    check_same(weights, uninterrupted(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_drawing_from_streams_of_their_own_get_their_own_back(backend, uninterrupted, tmp_path):
    """Each rank's dropout seeded apart; rank 1 killed right after optimizer step 35 (between two
    steps) and rank 2 inside its step 60: each replacement draws from the dead rank's own stream
    from the step's start, not from the sender's."""
    flags = ("--max-restarts", "2", "--recovery", "live", "--inject-failure", "rank=1,step=35")
    seeded = ("--seed-per-rank",)
    proc, weights = _run(tmp_path, backend, *flags, script_args=(*seeded, "--kill", "2:60"))
    check_live(proc.stdout, proc.stderr, replaced=[1, 2])
    assert proc.stderr.count("; its own RNG states") == 2, proc.stderr[-3000:]
    check_same(weights, uninterrupted(backend, *seeded))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failure_after_the_optimizer_step_finds_the_step_done(backend, uninterrupted, tmp_path):
    """The loss all-reduced after each optimizer step, inside the step; rank 1 killed right after
    its optimizer step 35: the survivors fail in that all_reduce with step 35 done, roll nothing
    back, and go on from step 36 (rank 0 never prints step 35's line)."""
    flags = ("--max-restarts", "1", "--recovery", "live", "--inject-failure", "rank=1,step=35")
    metric = ("--metric",)
    proc, weights = _run(tmp_path, backend, *flags, script_args=metric)
    check_live(proc.stdout, proc.stderr, replaced=[1])
    assert "step 35 done" not in proc.stdout and "step 36 done" in proc.stdout, proc.stdout[-3000:]
    assert "received the state of step 36 from rank 0" in proc.stderr, proc.stderr[-3000:]
    check_same(weights, uninterrupted(backend, *metric))


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
    proc = pyfork.run(argv, capture_output=True, text=True, timeout=120, env=clean_env("ONEDIST_"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "restarting the workers (attempt 1 of 1)" in proc.stderr, proc.stderr[-3000:]
    assert "live recovery" not in proc.stderr
    assert "attempt 1 rank 0" in proc.stdout


@pytest.mark.parametrize(
    "flags, says",
    [
        (("--recovery", "sometimes"), "--recovery='sometimes' is not allowed; allowed: 'restart'"),
        (("--recovery", "live"), "--max-restarts=0 is not allowed with it; allowed: an int >= 1"),
        (("--recovery", "live", "--max-restarts", "1", "--backend", "horovod"),
         "--recovery=live is not allowed with backend 'horovod'; allowed: 'gloo', 'shm'"),
        (("--recovery", "live", "--max-restarts", "1", "--backend", "mpi"),
         "--recovery=live is not allowed with backend 'mpi'; allowed: 'gloo', 'shm'"),
        (("--recovery", "live", "--max-restarts", "1", "--backend", "xla-tpu"),
         "--recovery=live is not allowed with backend 'xla-tpu'; allowed: 'gloo', 'shm'"),
        (("--recovery", "live", "--max-restarts", "1", "--backend", "gloo", "--nnodes", "2",
          "--node-rank", "0", "--master-port", "29999"), "--recovery=live is not allowed with --nnodes=2"),
    ],
)  # fmt: skip
def test_onedist_run_refuses_what_live_recovery_cannot_do_before_any_worker_starts(flags, says, tmp_path):
    argv = onedist_command("-n", "2", *flags, SCRIPT)
    proc = pyfork.run(argv, capture_output=True, text=True, timeout=60, env=clean_env("ONEDIST_"))
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
    proc = pyfork.run(argv, capture_output=True, text=True, timeout=120, env=clean_env("ONEDIST_"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rank 0 of 2" in proc.stdout and "rank 1 of 2" in proc.stdout


REFUSED_IN_THE_LOOP = """
import sys, torch, onedist as od
od.initialize("auto")
print("backend", od.backend(), flush=True)
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
    "backend, model, record, says",
    [
        ("gloo", "fsdp", "1", "onedist.steps: model='FSDPLinear (sharded: FSDP2)' is not allowed; allowed: a "
         "DistributedDataParallel model"),
        ("gloo", "ddp", "0", "onedist.steps: backend=\"gloo (torch's own gloo group: ONEDIST_RECORD=0)\" is "
         "not allowed; allowed: 'gloo', 'shm'"),
        ("shm", "ddp", "1", None),
        ("auto", "ddp", "1", None),  # shm for several processes on one host
    ],
)  # fmt: skip
def test_od_steps_refuses_a_sharded_model_or_another_backend_at_once(backend, model, record, says, tmp_path):
    """Under live recovery (ONEDIST_RECOVERY=live, as the launcher sets it), od.steps refuses at
    its construction, naming what is supported; on shm (and auto, shm here) it takes the loop."""
    script = tmp_path / "refused.py"
    script.write_text(REFUSED_IN_THE_LOOP)
    argv = onedist_command("-n", "2", "--backend", backend, str(script), model)
    env = clean_env("ONEDIST_", ONEDIST_RECOVERY="live", ONEDIST_RECORD=record)
    proc = pyfork.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if says is None:
        assert proc.stdout.count("backend shm") == 2 and "refused" not in proc.stdout, proc.stdout[-3000:]
    else:
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


def test_a_generation_meets_on_the_launchers_word_and_moves_on_when_a_rank_dies_meanwhile():
    """The meeting of a new generation (onedist._recovery.meet) with the launcher's decisions
    (LiveRecovery): in one process, over a real store; ranks are threads. Rank 1 dies, its
    replacement and rank 0 meet in generation 1; rank 2 dies before it came: the launcher says
    "next", and all three meet in generation 2."""
    import threading
    import types
    from datetime import timedelta

    from onedist._recovery import decision_key, meet
    from onedist.launchers.replacement import LiveRecovery

    store = torch.distributed.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
    workers = [types.SimpleNamespace(rank=r, pid=1000 + r) for r in range(3)]
    supervisor = types.SimpleNamespace(workers=list(workers))
    started: list[int] = []

    def replace(dead: Any, variables: dict[str, str]) -> Any:
        started.append(dead.rank)
        return types.SimpleNamespace(rank=dead.rank, pid=2000 + dead.rank)

    launcher = LiveRecovery(store, 3, (0, 5), replace, [], stopping=lambda: False)
    met: dict[str, int] = {}

    def member(name: str, number: int) -> None:  # a client of its own, as each rank's
        client = torch.distributed.TCPStore("127.0.0.1", store.port, 1, False, timeout=timedelta(seconds=30))
        met[name] = meet(client, number, wait_s=30)

    launcher._start(supervisor, workers[1], -9)  # rank 1 dies: generation 1
    threads = [threading.Thread(target=member, args=(n, 1)) for n in ("rank 0", "rank 1 (gen 1)")]
    for t in threads:
        t.start()
    launcher._decide()  # two of three counted in (rank 2 has not come): no decision
    assert not store.check([decision_key(1)])
    launcher._start(supervisor, workers[2], -9)  # rank 2 dies before it came: generation 2
    assert store.get(decision_key(1)) == b"next"
    threads.append(threading.Thread(target=member, args=("rank 2 (gen 2)", 2)))
    threads[-1].start()
    while sum(met.get(n) is None for n in ("rank 0", "rank 1 (gen 1)", "rank 2 (gen 2)")) and any(
        t.is_alive() for t in threads
    ):
        launcher._decide()
        time.sleep(0.01)
    for t in threads:
        t.join(30)
    assert met == {"rank 0": 2, "rank 1 (gen 1)": 2, "rank 2 (gen 2)": 2}
    assert started == [1, 2] and store.get(decision_key(2)) == b"go"
