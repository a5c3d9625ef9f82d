"""A run stopped at a micro-step and resumed ends with the uninterrupted run's weights, bit for bit
(issue 51, point 4): checks run on every rank of a pool (tests/test_resume.py runs them on gloo and
shm, DDP and FSDP) and serially.

Each check trains the same loop three ways in one process, new objects standing for a new process
(a model, optimizer, loader and accumulate count of their own, the RNG moved on): uninterrupted;
stopped right after ``od.save_training_state`` at micro-step ``stop``; resumed from there with
``od.resume`` to the end. The loop has everything that must come back: dropout (each rank's RNG),
a shuffling ``od.auto_dataloader`` (its epoch and position), ``od.accumulate`` over 3 micro-batches
with the epoch's last batch closing a window (its count, and the gradients of a window saved open),
AdamW's state, and extra state (a stateful meter, a plain list; the writer's values, so the sums
of every rank's losses).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from torch.utils.data import TensorDataset

import onedist as od

EPOCHS = 2
EVERY = 3
GLOBAL_BATCH = 8  # 40 samples: 5 batches per rank and epoch at 2 ranks, windows of 3 and 2


class Meter:
    """Extra state with ``state_dict``: the sum of the losses seen (on this rank)."""

    def __init__(self) -> None:
        self.total = torch.zeros((), dtype=torch.float64)

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total = state["total"].clone()


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(40, 6, generator=g), torch.randn(40, 1, generator=g))


def _setup(sharding: Optional[str], num_workers: int = 0) -> tuple[Any, Any, Any, Meter]:
    """A new process's objects: the same initial weights everywhere, the RNG moved on per rank."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
    model = od.auto_model(net, sharding=sharding) if sharding else od.auto_model(net)
    optimizer = od.auto_optim(torch.optim.AdamW(model.parameters(), lr=0.05))
    loader = od.auto_dataloader(_data(), batch_size=GLOBAL_BATCH, shuffle=True, num_workers=num_workers)
    torch.manual_seed(1000 + od.get_rank())  # what a restarted process's RNG would be: elsewhere
    return model, optimizer, loader, Meter()


def _train(
    directory: str, sharding: Optional[str], stop: Optional[int], num_workers: int = 0
) -> dict[str, Any]:
    """The loop: resume (a fresh start when there is no checkpoint), train to the end or save at
    micro-step ``stop`` and return there."""
    model, optimizer, loader, meter = _setup(sharding, num_workers)
    resumed = od.resume(directory, model=model, optimizer=optimizer, loader=loader, meter=meter, losses=[])
    micro, losses = int(resumed), list(resumed.extra["losses"])
    assert resumed.extra["meter"] is meter
    for _ in range(micro // len(loader), EPOCHS):
        for x, y in loader:
            with od.accumulate(model, every=EVERY, loader=loader) as window:
                loss = torch.nn.functional.mse_loss(model(x), y) / window.size
                od.backward(loss)
            if window.sync:
                optimizer.step()
                optimizer.zero_grad()
            micro += 1
            total = od.all_reduce(
                loss.detach().double()
            )  # extra state is the writer's: the same on every rank
            meter.total += total
            losses.append(round(float(total), 6))
            if micro == stop:
                od.save_training_state(
                    directory,
                    micro,
                    model=model,
                    optimizer=optimizer,
                    loader=loader,
                    meter=meter,
                    losses=losses,
                )
                return {"stopped": micro, "open": not window.sync}
    return {"weights": _whole(model), "meter": float(meter.total), "losses": losses, "micro": micro}


def _whole(model: torch.nn.Module) -> list[float]:
    """Every parameter, whole (a sharded one gathered), as one flat list."""
    tensors = (getattr(p, "full_tensor", lambda p=p: p)() for p in od.unwrap(model).parameters())
    return torch.cat([t.detach().flatten().cpu() for t in tensors]).tolist()


def check_stopped_and_resumed_runs_end_bit_identical(
    tmpdir: str, sharding: Optional[str], stops: list[int], num_workers: int = 0
) -> dict[str, Any]:
    """For each micro-step in ``stops``: stop there, resume, and compare with the uninterrupted
    run: the weights (bit for bit), the meter, the list of losses; what each stop saved."""
    whole = _train(os.path.join(tmpdir, "whole"), sharding, None, num_workers)
    found: dict[str, Any] = {"micro": whole["micro"], "stops": {}}
    for stop in stops:
        directory = os.path.join(tmpdir, f"stop_{stop}")
        stopped = _train(directory, sharding, stop, num_workers)
        assert stopped["stopped"] == stop, stopped
        resumed = _train(directory, sharding, None, num_workers)
        found["stops"][stop] = {
            "open": stopped["open"],
            "weights": resumed["weights"] == whole["weights"],
            "meter": resumed["meter"] == whole["meter"],
            "losses": resumed["losses"] == whole["losses"],
        }
    return found


# ---------------------------------------------------------------- inside od.join
def _join_batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11 + rank)
    return [torch.randn(4, 6, generator=g) for _ in range(2 if rank == 1 else 5)]  # rank 1 leaves first


def _join_train(directory: str, stop: Optional[int]) -> dict[str, Any]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    model = od.auto_model(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(2000 + od.get_rank())
    step = od.resume(directory, model=model, optimizer=optimizer)
    batches = _join_batches(od.get_rank())
    with od.join(model, optimizer):
        for x in batches[step:]:
            optimizer.zero_grad()
            model(x).sum().backward()
            optimizer.step()
            step += 1
            if step == stop:  # rank 0 only gets here (rank 1 had 2 batches)
                od.save_training_state(directory, step, model=model, optimizer=optimizer)
                break
    # what each rank draws next: its RNG as it left its loop (rank 1) or stopped (rank 0)
    return {"weights": _whole(model), "draw": torch.rand(4).tolist()}


def check_a_save_inside_join_after_a_rank_left_resumes_bit_identical(tmpdir: str) -> dict[str, Any]:
    """Rank 1 has 2 batches, rank 0 has 5 and saves after its 4th (rank 1 has left): the checkpoint
    holds both ranks' RNG states; resumed, rank 1 leaves at once and rank 0 trains its last batch:
    the weights and what each rank draws afterwards are the uninterrupted run's."""
    import logging

    from checks import onedist_log

    whole = _join_train(os.path.join(tmpdir, "whole"), None)
    directory = os.path.join(tmpdir, "stopped")
    _join_train(directory, 4)
    with onedist_log(logging.WARNING) as records:
        resumed = _join_train(directory, None)
    saved = od.load_checkpoint(od.checkpoint_path(directory, 4), map_location="cpu")
    return {
        "weights": resumed["weights"] == whole["weights"],
        "draw": resumed["draw"] == whole["draw"],
        "rng_entries": len(saved["ranks"]),
        "warnings": [r.getMessage() for r in records],
    }


# ---------------------------------------------------------------- another world size
def check_save_inside_a_window(directory: str) -> dict[str, Any]:
    """Micro-step 4 of the loop (a window open, mid-epoch) saved; what the ranks hold then."""
    model, optimizer, loader, _ = _setup(None)
    od.resume(directory, model=model, optimizer=optimizer, loader=loader)
    out = _train(directory, None, 4)
    saved = od.load_checkpoint(od.checkpoint_path(directory, 4), map_location="cpu")
    return {"open": out["open"], "model": saved["model"], "optimizer": saved["optimizer"]}


def check_resume_at_another_world_size(directory: str) -> dict[str, Any]:
    """What a resume at this world size restores of check_save_inside_a_window's checkpoint."""
    import logging

    from checks import onedist_log
    from onedist.training.accumulation import micro_steps

    model, optimizer, loader, _ = _setup(None)
    with onedist_log(logging.WARNING) as records:
        step = od.resume(directory, model=model, optimizer=optimizer, loader=loader)
    return {
        "step": int(step),
        "model": od.unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "micro_steps": micro_steps(model),
        "grads": [p.grad for p in model.parameters()],
        "batches_left": len(list(loader)),
        "batches": len(loader),
        "warnings": [r.getMessage() for r in records],
    }
