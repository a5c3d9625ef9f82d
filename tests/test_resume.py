"""od.save_training_state / od.resume / od.restart_count in one process: the newest complete
checkpoint, the RNG and the sampler's position restored bit for bit, and the argument errors."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import onedist as od
import pyfork
from onedist.training.resume import newest_step


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))


def test_no_checkpoint_is_step_0(tmp_path):
    assert od.resume(tmp_path / "missing", model=_model()) == 0
    assert od.resume(tmp_path, model=_model()) == 0


def test_the_newest_complete_checkpoint_is_loaded_and_temp_files_are_ignored(tmp_path):
    model = _model()
    for step in (2, 10, 9):
        with torch.no_grad():
            model[0].weight.fill_(step)
        od.save_training_state(tmp_path, step, model=model)
    # what a writer killed mid-write leaves: a temporary name, never the final one
    (tmp_path / ".step_00000099.pt.123.abc.tmp").write_bytes(b"torn")
    (tmp_path / "step_99.pt").write_bytes(b"not ours")  # not the 8-digit name
    assert newest_step(tmp_path) == 10
    fresh = _model()
    assert od.resume(tmp_path, model=fresh) == 10
    assert torch.equal(fresh[0].weight, torch.full_like(fresh[0].weight, 10))
    assert od.checkpoint_path(tmp_path, 10).name == "step_00000010.pt"


def test_temp_files_of_gone_writers_are_deleted_and_only_those(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid whose process has ended (a killed writer's)
    stale = tmp_path / f".step_00000005.pt.{dead.pid}.0123456789ab.tmp"
    running = tmp_path / f".step_00000006.pt.{os.getpid()}.0123456789ab.tmp"  # a writer still at work
    others = [tmp_path / "notes.tmp", tmp_path / f".last.pt.{dead.pid}.0123456789ab.tmp"]  # not ours
    for path in (stale, running, *others):
        path.write_bytes(b"torn")
    assert od.resume(tmp_path, model=_model()) == 0  # never loaded
    assert not stale.exists() and running.exists() and all(p.exists() for p in others)
    stale.write_bytes(b"torn")
    od.save_training_state(tmp_path, 7, model=_model())  # the writer cleans before it writes
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["step_00000007.pt", running.name, *(p.name for p in others)]
    )


def test_rng_states_come_back(tmp_path):
    np = pytest.importorskip("numpy")
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    od.save_training_state(tmp_path, 1)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(4)
    random.seed(4)
    np.random.seed(4)
    assert od.resume(tmp_path) == 1
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def _train(model, optimizer, loader, steps, start=0, save=None):
    """A loop with dropout and a shuffling sampler: steps start..steps-1, saving after ``save``."""
    step = start
    while step < steps:
        for x, y in loader:
            step += 1
            _one_step(model, optimizer, x, y)
            if save is not None and step == save[1]:
                od.save_training_state(
                    save[0], step, model=model, optimizer=optimizer, sampler=loader.sampler
                )
            if step == steps:
                return
        assert step % len(loader) == 0  # a resumed epoch ended where a whole one does


def _one_step(model, optimizer, x, y):
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


@pytest.mark.parametrize("saved_at", [3, 4, 6])  # mid-epoch, an epoch's end, mid-epoch of the 2nd
def test_resuming_mid_epoch_is_bit_identical(saved_at, tmp_path):
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))

    def setup():
        model = _model()
        sampler = od.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True)
        loader = DataLoader(data, batch_size=4, sampler=sampler)
        return model, torch.optim.AdamW(model.parameters(), lr=0.1), loader

    model, opt, loader = setup()
    _train(model, opt, loader, 10, save=(tmp_path, saved_at))
    model2, opt2, loader2 = setup()
    torch.rand(5)  # the restarted process's RNG is elsewhere
    start = od.resume(tmp_path, model=model2, optimizer=opt2, sampler=loader2.sampler)
    assert start == saved_at
    _train(model2, opt2, loader2, 10, start=start)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_sampler_state_round_trip():
    s = od.DistributedSampler(range(10), num_replicas=2, rank=1, seed=5)
    first = list(s)
    s2 = od.DistributedSampler(range(10), num_replicas=2, rank=1, seed=5)
    s2.load_state_dict({"epoch": 0, "position": 2})
    assert list(s2) == first[2:]
    second = list(s)
    s3 = od.DistributedSampler(range(10), num_replicas=2, rank=1, seed=5)
    s3.load_state_dict({"epoch": 0, "position": 5})  # the pass was complete: the next epoch
    assert list(s3) == second and s3.epoch == 1
    with pytest.raises(od.OnedistValueError, match="state"):
        s3.load_state_dict({"epoch": -1, "position": 0})


@pytest.mark.parametrize(
    "call, argument",
    [
        (lambda d: od.resume(3), "directory"),
        (lambda d: od.resume(d, model="net"), "model"),
        (lambda d: od.resume(d, optimizer=object()), "optimizer"),
        (lambda d: od.resume(d, sampler=torch.utils.data.SequentialSampler(range(3))), "sampler"),
        (lambda d: od.save_training_state(d, -1), "step"),
        (lambda d: od.save_training_state(d, True), "step"),
        (lambda d: od.save_training_state(d, 1.5), "step"),
        (lambda d: od.save_training_state(d, 1, scheduler=3), "scheduler"),
        (lambda d: od.checkpoint_path("", 1), "directory"),
    ],
)
def test_bad_arguments_name_the_argument(call, argument, tmp_path):
    with pytest.raises((od.OnedistTypeError, od.OnedistValueError), match=rf"\b{argument}\b.*allowed"):
        call(tmp_path)
    assert not list(tmp_path.iterdir())


def test_restart_count():
    assert od.restart_count({}) == 0
    assert od.restart_count({"TORCHELASTIC_RESTART_COUNT": "3"}) == 3
    with pytest.raises(od.OnedistValueError, match="TORCHELASTIC_RESTART_COUNT.*allowed: an int >= 0"):
        od.restart_count({"TORCHELASTIC_RESTART_COUNT": "x"})


# ---------------------------------------------------------------- another world size
def _save_on(directory: str) -> list[list[float]]:
    """Step 7 with rank-specific RNG states; rank 0's model is the one written."""
    torch.manual_seed(od.get_rank())
    model = torch.nn.Linear(3, 2)
    od.save_training_state(directory, 7, model=model)
    return model.weight.tolist()


def _resume_on(directory: str) -> dict:
    """What resume gives here: the step, the model, whether this process's RNG was left alone
    (it draws what its own seed gives), and rank 0's warnings."""
    import logging

    from checks import onedist_log

    with onedist_log(logging.WARNING) as records:
        model = torch.nn.Linear(3, 2)
        torch.manual_seed(100 + od.get_rank())
        own = torch.rand(3, generator=torch.Generator().manual_seed(100 + od.get_rank()))
        step = od.resume(directory, model=model)
        drawn = torch.rand(3)
    return {
        "step": step,
        "weight": model.weight.tolist(),
        "rng_left": torch.equal(drawn, own),
        "warnings": [r.getMessage() for r in records],
    }


def test_resume_on_another_world_size_restores_the_model_but_not_the_rng_states(tmp_path):
    """Saved by 2 ranks, resumed by 3: every rank gets the model and the step, no rank gets a
    saved RNG state (which rank's would it be?), and rank 0 says so once. Resumed by 2, the RNG
    states do come back (the contrast that makes the first check mean something)."""
    from conftest import Runner

    saved = Runner(2)(_save_on, str(tmp_path))[0]
    three = Runner(3)(_resume_on, str(tmp_path))
    assert [(r["step"], r["weight"], r["rng_left"]) for r in three] == [(7, saved, True)] * 3, three
    assert three[0]["warnings"] == [
        f"onedist.resume: {tmp_path / 'step_00000007.pt'} was saved by 2 ranks, this run has 3: "
        "the RNG states are not restored"
    ], three[0]
    assert three[1]["warnings"] == three[2]["warnings"] == [], three
    two = Runner(2)(_resume_on, str(tmp_path))
    assert [(r["step"], r["rng_left"], r["warnings"]) for r in two] == [(7, False, [])] * 2, two


def test_resume_says_where_it_resumed_from_with_default_logging(tmp_path):
    """Parallel's lines show with Python's default logging; od.resume's do too (the "onedist"
    logger, unconfigured, showed only warnings): a plain script, nothing configured."""
    script = (
        "import sys, torch, onedist as od\n"
        "m = torch.nn.Linear(2, 2)\n"
        "print(od.resume(sys.argv[1], model=m))\n"
        "od.save_training_state(sys.argv[1], 7, model=m)\n"
        "print(od.resume(sys.argv[1], model=m))\n"
    )
    out = pyfork.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["0", "7"], out
    assert f"onedist.resume: no checkpoint in {tmp_path}; starting at step 0" in out.stderr, out.stderr
    assert f"onedist.resume: resumed from step 7 ({tmp_path}/step_00000007.pt)" in out.stderr, out.stderr


# ---------------------------------------------------------------- a run stopped at any micro-step (issue 51)
def _worlds() -> list[tuple[str, str]]:
    from onedist.backends.shm import supported

    return [("gloo", s) for s in ("ddp", "fsdp")] + (
        [("shm", s) for s in ("ddp", "fsdp")] if supported() else []
    )


@pytest.mark.parametrize("backend, sharding", _worlds(), ids=lambda v: v)
def test_a_run_stopped_at_any_micro_step_resumes_to_bit_identical_weights(backend, sharding, tmp_path):
    """2 ranks, dropout, a shuffling od.auto_dataloader, od.accumulate over 3 micro-batches (the
    epoch's last batch closing a window of 2), AdamW, extra state: stopped right after the save of
    micro-step 4 (a window open, mid-epoch), 5 (an epoch's end, the window closed) or 7 (a window
    open in the second epoch) and resumed, the weights, the meter and the losses are the
    uninterrupted run's, on every rank."""
    import checks_resume
    from conftest import Runner

    out = Runner(2, backend)(
        checks_resume.check_stopped_and_resumed_runs_end_bit_identical,
        str(tmp_path),
        "fsdp" if sharding == "fsdp" else None,
        [4, 5, 7],
    )
    expected = {
        "micro": 10,
        "stops": {
            stop: {"open": stop != 5, "weights": True, "meter": True, "losses": True} for stop in (4, 5, 7)
        },
    }
    assert out == [expected] * 2, out


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_serial_run_with_a_random_sampler_resumes_to_bit_identical_weights(num_workers, tmp_path):
    """One process: od.auto_dataloader is a plain DataLoader with torch's RandomSampler, which has
    no state: the resumed pass sets back the RNG states of the saved pass's start (the same
    shuffle, the same base seed for the workers) and loads and drops the batches already seen."""
    import checks_resume

    out = checks_resume.check_stopped_and_resumed_runs_end_bit_identical(
        str(tmp_path), None, [4, 5, 7], num_workers
    )
    assert all(
        s == {"open": s["open"], "weights": True, "meter": True, "losses": True}
        for s in out["stops"].values()
    )
    assert out["micro"] == 10, out


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_a_save_inside_join_after_a_rank_left_holds_every_ranks_rng_and_resumes_bit_identical(
    backend, tmp_path
):
    """Saved by rank 0 inside od.join once rank 1 has left its loop: the checkpoint holds both ranks'
    RNG states (rank 1 sent what it left with); resumed at the same world size, no rank warns, the
    weights and what each rank draws after the block are the uninterrupted run's."""
    import checks_resume
    from conftest import Runner
    from onedist.backends.shm import supported

    if backend == "shm" and not supported():
        pytest.skip("the shm backend is not supported here")
    out = Runner(2, backend)(
        checks_resume.check_a_save_inside_join_after_a_rank_left_resumes_bit_identical, str(tmp_path)
    )
    assert out == [{"weights": True, "draw": True, "rng_entries": 2, "warnings": []}] * 2, out


def test_resume_at_another_world_size_restores_model_optimizer_count_and_loader_position(tmp_path):
    """Saved by 2 ranks inside an open window, after 4 of an epoch's 5 batches; resumed by one
    process: the model, AdamW's state, the step and the count of micro-steps are the saved ones
    exactly; the gradients of the open window are not restored (each rank's own) and rank 0 says
    so with the RNG states; the loader's pass yields the one batch left."""
    import checks_resume
    from conftest import Runner

    saved = Runner(2)(checks_resume.check_save_inside_a_window, str(tmp_path))[0]
    assert saved["open"] is True
    got = checks_resume.check_resume_at_another_world_size(str(tmp_path))
    assert got["step"] == 4 and got["micro_steps"] == (4, True), got
    assert all(torch.equal(got["model"][k], v) for k, v in saved["model"].items())
    assert got["optimizer"]["param_groups"] == saved["optimizer"]["param_groups"]
    for key, state in saved["optimizer"]["state"].items():
        assert all(torch.equal(got["optimizer"]["state"][key][k], v) for k, v in state.items())
    assert got["grads"] == [None] * len(got["grads"]), got["grads"]
    assert (got["batches"], got["batches_left"]) == (5, 1), got
    assert got["warnings"] == [
        f"onedist.resume: {od.checkpoint_path(tmp_path, 4)} was saved by 2 ranks, this run has 1: the RNG "
        "states are not restored nor the gradients of the open accumulation window"
    ], got["warnings"]


def test_extra_state_comes_back_and_defaults_fill_what_is_missing(tmp_path):
    """Stateful extras are loaded into the objects given to resume; plain values come back as they
    are, other picklable ones unpickled; a name the checkpoint lacks gets the value given (a
    stateful one is left as it is, with a warning)."""
    import fractions
    import logging

    from checks import onedist_log

    scaler = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.25)
    od.save_training_state(
        tmp_path, 3, opt2=scaler, epoch=2, best={"loss": 0.5, "at": (1, 2)}, ratio=fractions.Fraction(1, 3)
    )
    fresh = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1.0)
    other = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1.0)
    with onedist_log(logging.WARNING) as records:
        step = od.resume(tmp_path, opt2=fresh, other=other, epoch=0, missing="default")
    assert step == 3 and isinstance(step, int) and isinstance(step, od.training.resume.Resumed)
    assert step.extra == {
        "opt2": fresh,
        "epoch": 2,
        "best": {"loss": 0.5, "at": (1, 2)},
        "ratio": fractions.Fraction(1, 3),
        "other": other,
        "missing": "default",
    }
    assert fresh.param_groups[0]["lr"] == 0.25 and other.param_groups[0]["lr"] == 1.0
    assert [r.getMessage() for r in records] == [
        f"onedist.resume: {od.checkpoint_path(tmp_path, 3)} holds no 'other' (its extra state: "
        "['best', 'epoch', 'opt2', 'ratio']): other was left as it was"
    ]
    with pytest.raises(
        od.OnedistValueError, match=r"\bbad\b.*allowed: an object with state_dict\(\) or a picklable"
    ):
        od.save_training_state(tmp_path, 4, bad=lambda: 0)
    with pytest.raises(od.OnedistTypeError, match=r"\bloader\b.*allowed: a torch.utils.data.DataLoader"):
        od.resume(tmp_path, loader=[1, 2])


def test_a_loader_never_given_to_resume_is_refused_by_save(tmp_path):
    loader = DataLoader(range(8), batch_size=2)
    with pytest.raises(od.OnedistValueError, match="loader= was never given to od.resume"):
        od.save_training_state(tmp_path, 1, loader=loader)
    assert not list(tmp_path.iterdir())
