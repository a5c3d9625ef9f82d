"""The training loop's options: gradient accumulation and mixed precision, in the same processes.

    python benchmarks/bench_loop.py                   # world size 2, gloo, CPU
    python benchmarks/bench_loop.py --world-size 3 --backend shm

Variants (bench_training.py's MLP and data; each micro-batch is one forward and backward pass):
  raw k=1            DDP by hand, an optimizer step (and a gradient exchange) per micro-batch
  raw k=4            DDP by hand, model.no_sync() on 3 micro-batches of 4
  onedist k=1        auto_model / auto_optim, a step per micro-batch
  onedist k=4        od.accumulate(model, every=4): one exchange and one step per 4 micro-batches
  onedist bf16 k=1   auto_model(precision="bf16-mixed") + od.backward
  onedist k=1 join   onedist k=1 inside `with od.join(model, optimizer):` (even data: what the
                     block costs a loop whose ranks never run out of batches)
  raw k=1 Join       raw k=1 inside torch.distributed.algorithms.Join([model])
Repetitions are interleaved (the order rotates); medians of micro-batches/s, and the ratios that
answer the questions: what accumulation saves (k=4 / k=1), what onedist's accumulation costs
against the hand-written one, bf16-mixed against float32 on this device, and od.join's step check
against the same loop outside it (and torch's Join against raw).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.algorithms.join import Join

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from bench_training import _data, _mlp, add_data_arguments, interleaved_rates

import onedist as od


def _loop(model: torch.nn.Module, opt: Any, batches: list[Any], k: int, how: str) -> Callable[[int], None]:
    """Train ``n`` micro-batches, an optimizer step every ``k``; ``how``: "raw" (model.no_sync by
    hand), "onedist" (od.accumulate, od.backward)."""
    position = [0]

    def run(n: int) -> None:
        for _ in range(n):
            x, y = batches[position[0] % len(batches)]
            position[0] += 1
            if how == "onedist":
                with od.accumulate(model, every=k) as window:
                    od.backward(torch.nn.functional.cross_entropy(model(x), y) / window.size)
                last = window.sync
            else:
                last = position[0] % k == 0
                with model.no_sync() if not last else _nothing():
                    (torch.nn.functional.cross_entropy(model(x), y) / k).backward()
            if last:
                opt.step()
                opt.zero_grad(set_to_none=True)

    return run


def _inside(block: Callable[[], Any], run: Callable[[int], None]) -> Callable[[int], None]:
    """``run``, each repetition inside a fresh ``block()`` (od.join, torch's Join)."""

    def inside(n: int) -> None:
        with block():
            run(n)

    return inside


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def run(local_rank: int, args: argparse.Namespace) -> dict[str, float]:
    torch.set_num_threads(1)
    world, rank = od.get_world_size(), od.get_rank()
    data = _data(args.samples, args.features)
    per = args.batch_size // world
    x, y = data.tensors
    mine = [i + rank * per for i in range(0, args.samples - args.batch_size + 1, args.batch_size)]
    batches = [(x[i : i + per], y[i : i + per]) for i in mine]  # this rank's part of each micro-batch
    variants: dict[str, Callable[[int], None]] = {}
    for k in (1, args.k):
        model = torch.nn.parallel.DistributedDataParallel(_mlp(args.features, args.hidden))
        variants[f"raw k={k}"] = _loop(model, torch.optim.SGD(model.parameters(), lr=0.01), batches, k, "raw")
    for k, precision in ((1, "32"), (args.k, "32"), (1, "bf16-mixed")):
        model = od.auto_model(_mlp(args.features, args.hidden), precision=precision)
        opt = od.auto_optim(torch.optim.SGD(model.parameters(), lr=0.01))
        name = f"onedist {'bf16 ' if precision != '32' else ''}k={k}"
        variants[name] = _loop(model, opt, batches, k, "onedist")
    model = od.auto_model(_mlp(args.features, args.hidden))
    opt = od.auto_optim(torch.optim.SGD(model.parameters(), lr=0.01))
    variants["onedist k=1 join"] = _inside(
        lambda: od.join(model, opt), _loop(model, opt, batches, 1, "onedist")
    )
    ddp = torch.nn.parallel.DistributedDataParallel(_mlp(args.features, args.hidden))
    raw = _loop(ddp, torch.optim.SGD(ddp.parameters(), lr=0.01), batches, 1, "raw")
    variants["raw k=1 Join"] = _inside(lambda: Join([ddp]), raw)
    for fn in variants.values():  # warm-up: buckets, buffers, autocast's caches
        fn(2 * args.k)
    return interleaved_rates(variants, args.steps, args.reps)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--backend", default="gloo", help="gloo or shm (CPU)")
    parser.add_argument("--k", type=int, default=4, help="micro-batches per optimizer step")
    add_data_arguments(parser)
    parser.add_argument("--batch-size", type=int, default=128, help="global micro-batch size")
    parser.add_argument("--steps", type=int, default=64, help="micro-batches per timed repetition")
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU benchmark, also on a GPU machine
    rates = od.spawn(args.backend, run, args=(args,), nproc_per_node=args.world_size)[0]
    print(
        f"onedist {od.__version__}, torch {torch.__version__}, {args.backend}, world size {args.world_size}, "
        f"{os.cpu_count()} CPUs; MLP {args.features}-{args.hidden}-{args.hidden}-2, global micro-batch "
        f"{args.batch_size}, {args.steps} micro-batches x {args.reps} interleaved repetitions (medians)"
    )
    for name, rate in rates.items():
        print(f"  {name:18s} {rate:9.1f} micro-batches/s")
    k = args.k
    print(
        f"  accumulation k={k} / k=1:   onedist x{rates[f'onedist k={k}'] / rates['onedist k=1']:.2f}, "
        f"raw x{rates[f'raw k={k}'] / rates['raw k=1']:.2f}"
    )
    print(
        f"  onedist / raw:              k=1 x{rates['onedist k=1'] / rates['raw k=1']:.3f}, "
        f"k={k} x{rates[f'onedist k={k}'] / rates[f'raw k={k}']:.3f}"
    )
    print(f"  bf16-mixed / float32 (k=1): x{rates['onedist bf16 k=1'] / rates['onedist k=1']:.2f}")
    print(
        f"  inside / outside the block: od.join x{rates['onedist k=1 join'] / rates['onedist k=1']:.3f}, "
        f"torch Join x{rates['raw k=1 Join'] / rates['raw k=1']:.3f}"
    )


if __name__ == "__main__":
    main()
