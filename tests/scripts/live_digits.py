"""The digits example's training under od.steps, for live recovery's tests and benchmark
(tests/test_live_recovery.py, benchmarks/bench_recovery.py).

    onedist run -n 3 --backend gloo --max-restarts 2 --recovery live live_digits.py --final w.pt

Prints ``pid <pid> rank <r> generation <g> start`` and ``... end``, and ``step <n> done <time>``
(rank 0) after each optimizer step; ``--kill R:M`` makes rank R (of the first generation) SIGKILL
itself before its micro-step M (from 1), inside an accumulation window when M is not a window's
first; ``--final`` is where rank 0 saves the model's weights; ``--checkpoint-dir`` saves a step
checkpoint after every step and resumes from the newest (today's restart, for the benchmark; one
batch per step); ``--plain`` runs the same loop without ``od.steps`` (the benchmark's baseline of
its cost per step; one batch per step, no recovery); ``--bucket-cap-mb`` is DDP's; ``--seed-per-rank``
seeds each rank's RNG (its dropout) apart once the model is made; ``--metric`` all-reduces the loss
after each optimizer step, inside the step.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import digits

import onedist as od


class PlainStep:
    """A step of the loop without od.steps (``--plain``): its batch and number, nothing kept."""

    def __init__(self, batch: Any, number: int) -> None:
        self.batch, self.number = batch, number

    def __enter__(self) -> Any:
        return self.batch

    def __exit__(self, *exc: object) -> bool:
        return False


def plain_steps(loader: Any, epochs: int) -> Iterator[PlainStep]:
    """What od.steps iterates over, without it: each pass's set_epoch, one step per batch."""
    number = 0
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            number += 1
            yield PlainStep(batch, number)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--kill", action="append", default=[], help="R:M, rank R dies before micro-step M")
    parser.add_argument("--final", default=None)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--trace", action="store_true", help="print a sum of the weights after each step")
    parser.add_argument("--plain", action="store_true", help="the same loop without od.steps")
    parser.add_argument("--metric", action="store_true", help="all_reduce the loss after each optimizer step")
    parser.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP's bucket_cap_mb")
    parser.add_argument(
        "--seed-per-rank", action="store_true", help="each rank's RNG (dropout) seeded apart after the set-up"
    )
    args = parser.parse_args()
    od.initialize("auto")
    rank, generation = od.get_rank(), os.environ.get("ONEDIST_LIVE_GENERATION", "0")
    print(f"pid {os.getpid()} rank {rank} generation {generation} start", flush=True)
    kills = {int(r): int(m) for r, m in (k.split(":") for k in args.kill)}
    torch.manual_seed(0)
    train_set, _ = digits.datasets()
    loader = od.auto_dataloader(train_set, batch_size=64, shuffle=True)
    ddp = {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}
    model = od.auto_model(digits.Net(), **ddp)
    if args.seed_per_rank:
        torch.manual_seed(1000 + rank)  # a stream of its own for each rank's dropout
    optimizer = od.auto_optim(torch.optim.AdamW(model.parameters(), lr=0.01))
    k = args.accumulate
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=0.01, epochs=args.epochs, steps_per_epoch=-(-len(loader) // k)
    )
    objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    resumed = od.resume(args.checkpoint_dir, **objects) if args.checkpoint_dir else 0
    if args.plain:
        loop: Any = plain_steps(loader, args.epochs)
    else:
        loop = od.steps(loader, model, optimizer, scheduler=scheduler, epochs=args.epochs)
    for micro, step in enumerate(loop, start=1):
        if step.number <= resumed:
            continue  # done before the restart (restored by od.resume)
        if kills.get(rank) == micro and generation == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        with step as (x, y):
            with od.accumulate(model, every=k, loader=loader) as window:
                loss = F.cross_entropy(model(x), y)
                od.backward(loss / window.size)
            if window.sync:
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                if args.metric:  # a collective after the optimizer step: a failure here finds the step done
                    od.all_reduce(loss.detach())
                if rank == 0 or args.trace:
                    trace = (
                        f" {sum(p.double().sum().item() for p in model.parameters())!r}" if args.trace else ""
                    )
                    print(f"step {step.number} done {time.time():.6f}{trace}", flush=True)
        if args.checkpoint_dir:
            od.save_training_state(args.checkpoint_dir, step.number, **objects)
    if rank == 0 and args.final:
        torch.save(od.unwrap(model).state_dict(), args.final)
    print(f"pid {os.getpid()} rank {rank} generation {generation} end", flush=True)
    od.finalize()


if __name__ == "__main__":
    main()
