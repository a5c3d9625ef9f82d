"""The digits example's training under od.steps, for live recovery's tests and benchmark
(tests/test_live_recovery.py, benchmarks/bench_recovery.py).

    onedist run -n 3 --backend gloo --max-restarts 2 --recovery live live_digits.py --final w.pt

Prints ``pid <pid> rank <r> generation <g> start`` and ``... end``, and ``step <n> done <time>``
(rank 0) after each optimizer step; ``--kill R:M`` makes rank R (of the first generation) SIGKILL
itself before its micro-step M (from 1), inside an accumulation window when M is not a window's
first; ``--final`` is where rank 0 saves the model's weights; ``--checkpoint-dir`` saves a step
checkpoint after every step and resumes from the newest (today's restart, for the benchmark; one
batch per step).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import digits

import onedist as od


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--kill", action="append", default=[], help="R:M, rank R dies before micro-step M")
    parser.add_argument("--final", default=None)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--trace", action="store_true", help="print a sum of the weights after each step")
    args = parser.parse_args()
    od.initialize("auto")
    rank, generation = od.get_rank(), os.environ.get("ONEDIST_LIVE_GENERATION", "0")
    print(f"pid {os.getpid()} rank {rank} generation {generation} start", flush=True)
    kills = {int(r): int(m) for r, m in (k.split(":") for k in args.kill)}
    torch.manual_seed(0)
    train_set, _ = digits.datasets()
    loader = od.auto_dataloader(train_set, batch_size=64, shuffle=True)
    model = od.auto_model(digits.Net())
    optimizer = od.auto_optim(torch.optim.AdamW(model.parameters(), lr=0.01))
    k = args.accumulate
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=0.01, epochs=args.epochs, steps_per_epoch=-(-len(loader) // k)
    )
    objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    resumed = od.resume(args.checkpoint_dir, **objects) if args.checkpoint_dir else 0
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
