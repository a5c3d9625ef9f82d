"""An onedist training script as Ray Train runs it (tests/test_ray.py): ``train_loop`` is what
``TorchTrainer(train_loop_per_worker=...)`` calls on each worker, and everything below it is the
code that runs unchanged under ``onedist run``, torchrun or srun.

``config`` (the dict given as ``train_loop_config``):
    ``out``: a folder; each rank writes ``rank<R>.json`` (what it saw), rank 0 ``final.pt`` (the
    trained weights). ``checkpoint_dir``: step checkpoints (``od.save_training_state`` /
    ``od.resume``), or None. ``epochs``: passes over the data. Test hooks, never in a real script:
    ``raise_at`` (rank 1 raises at that step, its time in ``out``/raised), ``kill_after`` (rank 1
    SIGKILLs itself after that step's checkpoint, on the first attempt only: ``out``/killed).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import onedist as od
from onedist.environments import detect_cluster

SAMPLES, FEATURES, BATCH = 96, 8, 16  # global batch 16: 8 per rank, 6 steps an epoch on 2 ranks


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = x @ torch.linspace(-1, 1, FEATURES) + 0.1 * torch.randn(SAMPLES, generator=g)
    return TensorDataset(x, y.unsqueeze(1))


def collectives(out: Path) -> None:
    """Every rank's view of the job and a few collectives, written to ``rank<R>.json``."""
    rank = od.get_rank()
    seen = {
        "rank": rank,
        "world_size": od.get_world_size(),
        "local_rank": od.get_local_rank(),
        "nproc_per_node": od.get_nproc_per_node(),
        "nnodes": od.get_nnodes(),
        "backend": od.backend(),
        "environment": getattr(detect_cluster(os.environ), "name", None),  # what `onedist info` names
        "main_thread": threading.current_thread() is threading.main_thread(),
        "reduced": od.all_reduce({"n": rank + 1, "t": torch.tensor([float(rank), 1.0])}),
        "gathered": od.all_gather(torch.full((rank + 1,), float(rank))).tolist(),  # uneven sizes
        "words": od.all_gather(f"r{rank}"),
    }
    seen["reduced"] = {"n": seen["reduced"]["n"], "t": seen["reduced"]["t"].tolist()}
    (out / f"rank{rank}.json").write_text(json.dumps(seen))


def training(local_rank: int, config: dict[str, Any]) -> None:
    out = Path(config["out"])
    collectives(out)
    torch.manual_seed(0)
    loader = od.auto_dataloader(dataset(), batch_size=BATCH, shuffle=True)
    model = od.auto_model(
        nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 1))
    )
    optimizer = od.auto_optim(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    ckpt = config.get("checkpoint_dir")
    step = od.resume(ckpt, model=model, optimizer=optimizer, sampler=loader.sampler) if ckpt else 0
    if step:
        (out / f"resumed{od.get_rank()}").write_text(str(step))
    steps = len(loader)
    for _epoch in range(step // steps, config["epochs"]):
        for x, y in loader:  # a resumed epoch: the rest of it (the sampler continues where it was)
            if config.get("raise_at") == step and od.get_rank() == 1:
                (out / "raised").write_text(repr(time.time()))
                raise ValueError(f"rank 1 failed on purpose at step {step}")
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if ckpt and step % 4 == 0:
                od.save_training_state(ckpt, step, model=model, optimizer=optimizer, sampler=loader.sampler)
                _maybe_die(config, step, out)
    if od.get_rank() == 0:
        torch.save(od.unwrap(model).state_dict(), out / "final.pt")


def _maybe_die(config: dict[str, Any], step: int, out: Path) -> None:
    """Rank 1 dies as a killed process does (no Python cleanup), once."""
    marker = out / "killed"
    if config.get("kill_after") == step and od.get_rank() == 1 and not marker.exists():
        marker.write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)


def train_loop(config: dict[str, Any]) -> None:
    """What TorchTrainer runs on each worker: the script's ``main``, unchanged (under a launcher,
    ``Parallel`` adopts the process group Ray made)."""
    with od.Parallel(backend="gloo") as parallel:
        parallel.run(training, config)


if __name__ == "__main__":  # without Ray: `python ray_train.py OUT` spawns the 2 workers itself
    import sys

    with od.Parallel(backend="gloo", nproc_per_node=2) as parallel:
        parallel.run(training, {"out": sys.argv[1], "epochs": int(sys.argv[2]), "checkpoint_dir": None})
