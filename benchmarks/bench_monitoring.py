"""What seeing the run costs: od.progress + od.Throughput + od.log_metrics against the bare step.

    python benchmarks/bench_monitoring.py                   # world size 2, gloo, CPU
    python benchmarks/bench_monitoring.py --world-size 3 --backend shm

Variants (bench_training.py's MLP and data, auto_model / auto_optim, one step per batch), all
training one model with one optimizer, so that they differ only in what they add to the step:
  bare        the training step alone
  bare again  the same loop again: the control, whose ratio to bare is this machine's noise
  monitored   the same steps over od.progress (plain lines, rank 0: a line every 10 s and one
              at the end, to /dev/null), od.Throughput.update every step (one all_gather every
              --every steps: 100, Throughput's default) and od.log_metrics({"loss": ...}) every
              step to a CSVLogger (rank 0 queues a row, its writer thread writes them every
              second; no collective); the rows left queued are written at the end of each
              repetition, within its time: otherwise the writer thread's work would fall in
              the next variant's repetition (it did: the control read x1.05, coming after
              monitored+)
  monitored+  monitored, with od.log_metrics(..., reduce="mean") every --every steps (one more
              small all_gather per window)
Repetitions of --steps steps are interleaved (the order rotates; every rank starts each one
together). For each repetition, each variant's wall time and CPU time (every thread of every
rank: time.process_time summed over the ranks) per step; the ratios to bare are taken within a
repetition (monitored / bare of the same repetition) and their medians reported, with their
quartiles in brackets, beside the control's. The load average before and after is printed: on a
busy machine the wall ratios wander (bare / bare again too), the CPU ratios less.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from bench_training import _data, _mlp, add_data_arguments

import onedist as od


def _loop(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batches: list[Any],
    args: argparse.Namespace,
    monitor: int,
    sink: Any,
    step: list[int],
    csv: Any,
) -> Callable[[int], list[int]]:
    """Train ``n`` steps of ``model`` (``step[0]``: the steps so far, of every variant) and return
    the nanoseconds spent outside each step (from an optimizer step's end to the next step's
    start: the loop's next item, and what monitors it); ``monitor``: 0 bare, 1 progress +
    throughput + log_metrics, 2 with the reduced log_metrics every ``args.every`` steps too."""
    throughput = od.Throughput(every=args.every)
    clock = time.perf_counter_ns

    def run(n: int) -> list[int]:
        items = (batches[(step[0] + i) % len(batches)] for i in range(n))
        if monitor:
            items = od.progress(items, total=n, desc="train", style="lines", file=sink)
        outside, mark = [], clock()
        for x, y in items:
            outside.append(clock() - mark)
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            mark = clock()
            step[0] += 1
            if monitor:
                throughput.update(len(y))
                od.log_metrics({"loss": loss.detach()}, step[0])
                if monitor == 2 and step[0] % args.every == 0:
                    od.log_metrics({"mean_loss": loss.detach()}, step[0], reduce="mean")
        if monitor:  # its rows written within its own time, not in the next variant's (see above)
            csv.flush()
        outside.append(clock() - mark)  # the loop's end: the progress's last line
        return outside

    return run


# variant -> per repetition, per step: (wall s, CPU s, mean s outside a step, median s outside)
Times = dict[str, list[tuple[float, float, float, float]]]


def interleaved_times(variants: dict[str, Callable[[int], list[int]]], steps: int, reps: int) -> Times:
    """Each variant's wall time, CPU time and time outside the steps (mean, median), per step, in
    each of ``reps`` repetitions, interleaved in a rotating order, every rank starting each one
    together. The CPU time is this process's (all its threads: gloo's and the CSV writer's too)."""
    times: Times = {name: [] for name in variants}
    names = list(variants)
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            outside = variants[name](steps)
            c1 = time.process_time()
            dist.barrier()  # the slowest rank's end: the wall time of the job's steps
            wall, cpu = (time.perf_counter() - t0) / steps, (c1 - c0) / steps
            times[name].append((wall, cpu, sum(outside) / steps / 1e9, statistics.median(outside) / 1e9))
    return times


def run(local_rank: int, args: argparse.Namespace, log_dir: str) -> Times:
    torch.set_num_threads(1)
    world, rank = od.get_world_size(), od.get_rank()
    x, y = _data(args.samples, args.features).tensors
    per = args.batch_size // world
    starts = range(rank * per, args.samples - args.batch_size + 1, args.batch_size)
    batches = [(x[i : i + per], y[i : i + per]) for i in starts]  # this rank's part of each batch
    model = od.auto_model(_mlp(args.features, args.hidden))
    opt = od.auto_optim(torch.optim.SGD(model.parameters(), lr=0.01))
    step = [0]
    csv = od.CSVLogger(log_dir)
    with open(os.devnull, "w") as sink, od.loggers(csv):
        names = {"bare": 0, "monitored": 1, "monitored+": 2, "bare again": 0}
        variants = {name: _loop(model, opt, batches, args, m, sink, step, csv) for name, m in names.items()}
        for fn in variants.values():  # warm-up: buckets, the CSV file
            fn(2 * args.every)
        return interleaved_times(variants, args.steps, args.reps)


def _ratios(times: Times, name: str, of: int) -> str:
    """``name``'s time / bare's in the same repetition: the median over the repetitions and, in
    brackets, their quartiles; ``of``: 0 wall, 1 CPU."""
    ratios = [t[of] / b[of] for t, b in zip(times[name], times["bare"])]
    low, median, high = statistics.quantiles(ratios, n=4)
    return f"x{median:.3f} [{low:.3f}-{high:.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--backend", default="gloo", help="gloo or shm (CPU)")
    parser.add_argument(
        "--every", type=int, default=100, help="steps per Throughput window (100: od.Throughput's default)"
    )
    add_data_arguments(parser)
    parser.add_argument("--batch-size", type=int, default=128, help="global batch size")
    parser.add_argument("--steps", type=int, default=100, help="steps per timed repetition")
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU benchmark, also on a GPU machine
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as log_dir:
        per_rank = od.spawn(args.backend, run, args=(args, log_dir), nproc_per_node=args.world_size)
    # the job's step: rank 0's wall time (the barrier makes it the slowest rank's); every rank's
    # CPU; the time outside the steps of the rank with the most
    times = {
        name: [
            (w, sum(r[name][i][1] for r in per_rank), *(max(r[name][i][k] for r in per_rank) for k in (2, 3)))
            for i, (w, *_) in enumerate(rows)
        ]
        for name, rows in per_rank[0].items()
    }
    print(
        f"onedist {od.__version__}, torch {torch.__version__}, {args.backend}, world size {args.world_size}, "
        f"{os.cpu_count()} CPUs; MLP {args.features}-{args.hidden}-{args.hidden}-2, global batch "
        f"{args.batch_size}, {args.steps} steps x {args.reps} interleaved repetitions (medians); "
        f"load average {load[0]:.2f} before, {os.getloadavg()[0]:.2f} after"
    )
    print("  (time / bare's in the same repetition: median [quartiles]; outside: between two steps)")
    for name, rows in times.items():
        wall, cpu, outside = (statistics.median(r[i] for r in rows) * 1e6 for i in (0, 1, 2))
        line = f"  {name:12s} {1e6 / wall:6.1f} steps/s {wall:6.0f} us, CPU {cpu:6.0f} us, "
        line += f"outside {outside:5.1f} us"
        if name != "bare":
            line += f"  wall {_ratios(times, name, 0)}  CPU {_ratios(times, name, 1)}"
        print(line)
    bare = statistics.median(r[0] for r in times["bare"])
    for name in ("monitored", "monitored+"):
        mean, median = (
            statistics.median(t[k] - b[k] for t, b in zip(times[name], times["bare"])) for k in (2, 3)
        )
        print(
            f"  {name}: outside the steps (the worst rank's), {mean * 1e6:.1f} us a step more than bare "
            f"({100 * mean / bare:.2f} % of a bare step), {median * 1e6:.1f} us in the median step "
            f"(without the window's collective: {100 * median / bare:.2f} %)"
        )


if __name__ == "__main__":
    main()
