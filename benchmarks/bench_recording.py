"""What putting every call on record costs (issue 49): the same calls on a recorded gloo group and on
torch's plain gloo group, in the same worker processes, interleaved.

    python benchmarks/bench_recording.py                 # 2 gloo ranks, CPU
    python benchmarks/bench_recording.py --json out.json

Rows (each a ratio to the plain group: 1.00 = free):
  dist.all_reduce, 1 float       torch.distributed's function on each group
  dist.all_reduce, 64 KiB        the same, 16384 floats (the record's cost is per call)
  od.all_reduce, 1 float         onedist's, on each group (``group=``)
  DDP step                       forward, backward (the gradient buckets), SGD step of an MLP
                                 (128 -> 256 -> 256 -> 2, 64 samples a rank): DDP over each group
The A/A row (the plain group against a second plain group) is the noise floor.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_collectives import compare

import onedist as od
from onedist.backends.recorded import gloo as recorded_gloo


def _ddp_step(group: Any) -> Callable[[], None]:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(128, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 2),
    )
    model = torch.nn.parallel.DistributedDataParallel(mlp, process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 128), torch.randint(0, 2, (64,))

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def run(local_rank: int, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)
    recorded_gloo.register()
    recorded = dist.new_group(backend=recorded_gloo.NAME)
    plain, plain_again = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
    t, big = torch.ones(1), torch.ones(16384)
    cases: dict[str, dict[str, Callable[[], Any]]] = {
        "dist.all_reduce, 1 float": {
            "plain gloo": lambda: dist.all_reduce(t, group=plain),
            "recorded": lambda: dist.all_reduce(t, group=recorded),
            "plain gloo again (A/A)": lambda: dist.all_reduce(t, group=plain_again),
        },
        "dist.all_reduce, 64 KiB": {
            "plain gloo": lambda: dist.all_reduce(big, group=plain),
            "recorded": lambda: dist.all_reduce(big, group=recorded),
        },
        "od.all_reduce, 1 float": {
            "plain gloo": lambda: od.all_reduce(t, group=plain),
            "recorded": lambda: od.all_reduce(t, group=recorded),
        },
        "DDP step": {"plain gloo": _ddp_step(plain), "recorded": _ddp_step(recorded)},
    }
    iters = {"DDP step": args.iters // 10}
    results: dict[str, dict[str, float]] = {}
    for case, variants in cases.items():
        medians = compare(variants, iters.get(case, args.iters), args.reps)
        base = medians["plain gloo"]
        results[case] = {name: medians[name] / base for name in variants}
        results[case]["plain gloo, us"] = base * 1e6
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--iters", type=int, default=300, help="calls per timed repetition (DDP: a tenth)")
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    results = od.spawn("gloo", run, args=(args,), nproc_per_node=args.world_size)[0]
    lines = [f"torch {torch.__version__}, gloo, {args.world_size} ranks, {os.cpu_count()} CPUs; x plain gloo"]
    for case, row in results.items():
        lines.append(f"{case} (plain gloo: {row.pop('plain gloo, us'):.1f} us)")
        lines += [f"  {name:24s} x{ratio:.3f}" for name, ratio in row.items()]
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"torch": torch.__version__, "ranks": args.world_size, **results})
        )


if __name__ == "__main__":
    main()
