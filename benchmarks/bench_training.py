"""Training throughput: onedist's auto_model / auto_optim / auto_dataloader vs raw DDP (and ignite /
accelerate when installed), the same MLP and data, in the same worker processes.

    python benchmarks/bench_training.py                    # world size 2, gloo, CPU
    python benchmarks/bench_training.py --world-size 4 --steps 100 --json out.json
    python benchmarks/bench_training.py --backend nccl --world-size 1 --amp   # one GPU

Variants (each: a DDP model, SGD, a loader giving each rank global_batch / world samples per step)
  raw DDP     DistributedDataParallel + DistributedSampler + DataLoader, by hand
  onedist     od.auto_model + od.auto_optim + od.auto_dataloader
  ignite      ignite.distributed.auto_model / auto_optim / auto_dataloader (if installed)
  accelerate  Accelerator().prepare(model, optimizer, loader) (if installed)
Repetitions are interleaved (raw, onedist, ...; the order rotates), medians reported, with the
ratio of steps/s to raw DDP (>1 = faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
import onedist as od


def _data(n: int, features: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=g)
    return TensorDataset(x, (x[:, :8].sum(1) > 0).long())


def _mlp(features: int, hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(features, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 2),
    )


def _stepper(
    model: torch.nn.Module, opt: torch.optim.Optimizer, loader: Any, amp: bool = False
) -> Callable[[int], None]:
    """A function that trains ``steps`` steps, continuing through the loader's epochs (moving each
    batch to the model's device; with ``amp``, float16 autocast and a gradient scaler on CUDA)."""
    state: dict[str, Iterator[Any]] = {"it": iter(loader)}
    dev = next(model.parameters()).device
    scaler = torch.amp.GradScaler("cuda", enabled=amp)

    def run(steps: int) -> None:
        for _ in range(steps):
            try:
                x, y = next(state["it"])
            except StopIteration:
                state["it"] = iter(loader)
                x, y = next(state["it"])
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with torch.autocast(dev.type, dtype=torch.float16, enabled=amp):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    return run


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that size :func:`_data` and :func:`_mlp` (shared by the training benchmarks)."""
    parser.add_argument("--samples", type=int, default=16384)
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)


def interleaved_rates(variants: dict[str, Callable[[int], None]], steps: int, reps: int) -> dict[str, float]:
    """Each variant's median rate (``steps`` per second) over ``reps`` repetitions, interleaved in a
    rotating order, every rank starting each one together."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            t0 = time.perf_counter()
            variants[name](steps)
            dist.barrier()
            samples[name].append(steps / (time.perf_counter() - t0))
    return {name: statistics.median(v) for name, v in samples.items()}


def run(local_rank: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    world = od.get_world_size()
    data = _data(args.samples, args.features)
    variants: dict[str, Callable[[int], None]] = {}
    cuda = args.backend == "nccl"
    amp = args.amp

    if cuda:
        torch.cuda.set_device(local_rank)
        net = _mlp(args.features, args.hidden).cuda(local_rank)
        model = torch.nn.parallel.DistributedDataParallel(net, device_ids=[local_rank])
    else:
        model = torch.nn.parallel.DistributedDataParallel(_mlp(args.features, args.hidden))
    sampler = DistributedSampler(data, shuffle=True)
    loader = DataLoader(data, batch_size=args.batch_size // world, sampler=sampler, pin_memory=cuda)
    variants["raw DDP"] = _stepper(model, torch.optim.SGD(model.parameters(), lr=0.01), loader, amp)

    model = od.auto_model(_mlp(args.features, args.hidden))
    opt = od.auto_optim(torch.optim.SGD(model.parameters(), lr=0.01))
    variants["onedist auto_*"] = _stepper(
        model, opt, od.auto_dataloader(data, batch_size=args.batch_size, shuffle=True), amp
    )

    try:
        import ignite.distributed as idist

        model = idist.auto_model(_mlp(args.features, args.hidden))
        opt = idist.auto_optim(torch.optim.SGD(model.parameters(), lr=0.01))
        loader = idist.auto_dataloader(data, batch_size=args.batch_size, shuffle=True)
        variants["ignite auto_*"] = _stepper(model, opt, loader, amp)
    except ImportError:
        pass
    try:
        from accelerate import Accelerator

        accel = Accelerator(cpu=not cuda)
        model = _mlp(args.features, args.hidden)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        loader = DataLoader(data, batch_size=args.batch_size // world, shuffle=True)
        model, opt, loader = accel.prepare(model, opt, loader)
        variants["accelerate prepare"] = _stepper(model, opt, loader, amp)
    except ImportError:
        pass

    for fn in variants.values():  # warm-up: first steps allocate buckets and buffers
        fn(5)
    medians = interleaved_rates(variants, args.steps, args.reps)
    raw = medians["raw DDP"]
    return {k: {"steps/s": v, "ratio_to_raw": v / raw} for k, v in medians.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo", help="nccl: one GPU per rank")
    parser.add_argument("--amp", action="store_true", help="float16 autocast + GradScaler (CUDA)")
    add_data_arguments(parser)
    parser.add_argument("--batch-size", type=int, default=128, help="global batch size")
    parser.add_argument("--steps", type=int, default=60, help="steps per timed repetition")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if args.backend == "gloo":  # CPU: on a GPU machine, keep every variant (and od.device()) on CPU
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    results = od.spawn(args.backend, run, args=(args,), nproc_per_node=args.world_size)[0]
    print(
        f"onedist {od.__version__}, torch {torch.__version__}, {args.backend}"
        f"{' + AMP' if args.amp else ''}, world size {args.world_size}, "
        f"{os.cpu_count()} CPUs; MLP {args.features}-{args.hidden}-{args.hidden}-2, global batch "
        f"{args.batch_size}, {args.steps} steps x {args.reps} interleaved repetitions (medians)"
    )
    for name, row in results.items():
        print(f"  {name:20s} {row['steps/s']:9.1f} steps/s   x{row['ratio_to_raw']:.3f} of raw DDP")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "world_size": args.world_size,
                    "backend": args.backend,
                    "amp": args.amp,
                    "torch": torch.__version__,
                    "results": results,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
