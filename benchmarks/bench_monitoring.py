"""What seeing the run costs: od.progress + od.Throughput + od.log_metrics against the bare step.

    python benchmarks/bench_monitoring.py                   # world size 2, gloo, CPU
    python benchmarks/bench_monitoring.py --world-size 3 --backend shm

Variants (bench_training.py's MLP and data, auto_model / auto_optim, one step per batch):
  bare        the training step alone
  bare again  the same, on a model of its own: the noise of this machine's timings
  monitored   the same steps over od.progress (plain lines, rank 0: a line every 10 s and one
              at the end, to /dev/null), od.Throughput.update every step (one all_reduce every
              --every steps) and od.log_metrics({"loss": ...}) every step to a CSVLogger (rank 0
              writes and flushes a row; no collective)
  monitored+  monitored, with od.log_metrics(..., reduce="mean") every --every steps (one more
              small all_reduce per window)
Repetitions are interleaved (the order rotates); medians of steps/s, and the ratio of the bare
step's rate to each monitored one (the time a monitored step takes, in bare steps; target <= 1.02).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from bench_training import _data, _mlp, add_data_arguments, interleaved_rates

import onedist as od


def _loop(batches: list[Any], args: argparse.Namespace, monitor: int, sink: Any) -> Callable[[int], None]:
    """Train ``n`` steps; ``monitor``: 0 bare, 1 progress + throughput + log_metrics, 2 with the
    reduced log_metrics every ``args.every`` steps too."""
    model = od.auto_model(_mlp(args.features, args.hidden))
    opt = od.auto_optim(torch.optim.SGD(model.parameters(), lr=0.01))
    throughput = od.Throughput(every=args.every)
    step = [0]

    def run(n: int) -> None:
        items = (batches[(step[0] + i) % len(batches)] for i in range(n))
        if monitor:
            items = od.progress(items, total=n, desc="train", style="lines", file=sink)
        for x, y in items:
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            step[0] += 1
            if monitor:
                throughput.update(len(y))
                od.log_metrics({"loss": loss.detach()}, step[0])
                if monitor == 2 and step[0] % args.every == 0:
                    od.log_metrics({"mean_loss": loss.detach()}, step[0], reduce="mean")

    return run


def run(local_rank: int, args: argparse.Namespace, log_dir: str) -> dict[str, float]:
    torch.set_num_threads(1)
    world, rank = od.get_world_size(), od.get_rank()
    x, y = _data(args.samples, args.features).tensors
    per = args.batch_size // world
    starts = range(rank * per, args.samples - args.batch_size + 1, args.batch_size)
    batches = [(x[i : i + per], y[i : i + per]) for i in starts]  # this rank's part of each batch
    with open(os.devnull, "w") as sink, od.loggers(od.CSVLogger(log_dir)):
        names = {"bare": 0, "monitored": 1, "monitored+": 2, "bare again": 0}
        variants = {name: _loop(batches, args, m, sink) for name, m in names.items()}
        for fn in variants.values():  # warm-up: buckets, the CSV file
            fn(2 * args.every)
        return interleaved_rates(variants, args.steps, args.reps)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--backend", default="gloo", help="gloo or shm (CPU)")
    parser.add_argument("--every", type=int, default=50, help="steps per Throughput window")
    add_data_arguments(parser)
    parser.add_argument("--batch-size", type=int, default=128, help="global batch size")
    parser.add_argument("--steps", type=int, default=200, help="steps per timed repetition")
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU benchmark, also on a GPU machine
    with tempfile.TemporaryDirectory() as log_dir:
        rates = od.spawn(args.backend, run, args=(args, log_dir), nproc_per_node=args.world_size)[0]
    print(
        f"onedist {od.__version__}, torch {torch.__version__}, {args.backend}, world size {args.world_size}, "
        f"{os.cpu_count()} CPUs; MLP {args.features}-{args.hidden}-{args.hidden}-2, global batch "
        f"{args.batch_size}, {args.steps} steps x {args.reps} interleaved repetitions (medians)"
    )
    for name, rate in rates.items():
        print(f"  {name:12s} {rate:9.1f} steps/s")
    print(
        f"  time of a step, monitored / bare: x{rates['bare'] / rates['monitored']:.3f}, "
        f"with a reduced metric every {args.every} steps x{rates['bare'] / rates['monitored+']:.3f}; "
        f"noise: bare / bare again x{rates['bare'] / rates['bare again']:.3f}"
    )


if __name__ == "__main__":
    main()
