"""Shared-memory collectives (``backend="shm"``) vs gloo vs memcpy, in the same worker processes.

    python benchmarks/bench_shm.py                       # world size 2
    python benchmarks/bench_shm.py --world-size 4 --json out.json

Rows (each a median of interleaved repetitions, the order rotating):
  all_reduce of 1 / 16 / 128 MB float32: shm (the default group) vs gloo (a gloo group over the same
      ranks, ``dist.new_group(backend="gloo")``), as bus-independent "algorithm bandwidth" =
      bytes / time, and memcpy = one ``copy_`` of the same bytes on one core (each rank at once);
  small-message latency: all_reduce of 1 float, barrier;
  all_gather_into_tensor and broadcast of 16 MB;
  gather, scatter, all_to_all_single of 8 floats per rank; all_to_all_single and gather of 1 and
      16 MB; onedist's all_gather of tensors whose first dimension differs per rank (small, and
      1 and 16 MB per rank);
  DDP training steps/s of an MLP with ~25 MB of float32 gradients, shm vs gloo.
Ratios are to gloo (>1 = faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
import onedist as od

# torch >= 2.13 renamed all_gather_into_tensor (which now warns) to all_gather_single
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

MB = 1 << 20


def _timed(fns: dict[str, Callable[[], None]], reps: int, inner: int) -> dict[str, float]:
    """Median seconds per call of each function, interleaved and rotated, all ranks in step."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(inner):
                fns[name]()
            samples[name].append((time.perf_counter() - t0) / inner)
    return {k: statistics.median(v) for k, v in samples.items()}


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)  # 1024*2048*3 floats ~ 25 MB of gradients
    return torch.nn.Sequential(
        torch.nn.Linear(1024, 2048),
        torch.nn.ReLU(),
        torch.nn.Linear(2048, 2048),
        torch.nn.ReLU(),
        torch.nn.Linear(2048, 1024),
    )


def run(local_rank: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    gloo = dist.new_group(backend="gloo")
    world = dist.get_world_size()
    out: dict[str, Any] = {}
    for size_mb in args.sizes:
        n = int(size_mb * MB) // 4
        a, b, src = torch.ones(n), torch.ones(n), torch.ones(n)
        t = _timed(
            {
                "shm": lambda a=a: dist.all_reduce(a),
                "gloo": lambda b=b: dist.all_reduce(b, group=gloo),
                "memcpy": lambda a=a, src=src: a.copy_(src),
            },
            reps=args.reps,
            inner=max(1, int(64 / max(size_mb, 0.25))),
        )
        out[f"all_reduce {size_mb:g} MB"] = {k: (size_mb * MB / v / 1e9, v) for k, v in t.items()}
    x, y = torch.ones(1), torch.ones(1)
    out["latency"] = _timed(
        {
            "shm all_reduce 1 float": lambda: dist.all_reduce(x),
            "gloo all_reduce 1 float": lambda: dist.all_reduce(y, group=gloo),
            "shm barrier": lambda: dist.barrier(),
            "gloo barrier": lambda: dist.barrier(group=gloo),
        },
        reps=args.reps,
        inner=200,
    )
    n = 16 * MB // 4
    part, full = torch.ones(n // world), torch.empty(n // world * world)
    bc = torch.ones(n)
    out["16 MB others"] = _timed(
        {
            "shm all_gather": lambda: _gather_into(full, part),
            "gloo all_gather": lambda: _gather_into(full, part, group=gloo),
            "shm broadcast": lambda: dist.broadcast(bc, src=0),
            "gloo broadcast": lambda: dist.broadcast(bc, src=0, group=gloo),
        },
        reps=args.reps,
        inner=4,
    )
    me = dist.get_rank()
    few, many = torch.ones(8 * world), torch.empty(8 * world)  # 8 floats per rank
    parts = [torch.empty(8) for _ in range(world)] if me == 0 else None
    ragged = torch.ones(3 + me, 5)  # first dimension differs per rank (small: one round of onedist's)
    out["small exchanges"] = _timed(
        {
            "shm gather": lambda: dist.gather(few[:8], parts, dst=0),
            "gloo gather": lambda: dist.gather(few[:8], parts, dst=0, group=gloo),
            "shm scatter": lambda: dist.scatter(many[:8], parts, src=0),
            "gloo scatter": lambda: dist.scatter(many[:8], parts, src=0, group=gloo),
            "shm all_to_all_single": lambda: dist.all_to_all_single(many, few),
            "gloo all_to_all_single": lambda: dist.all_to_all_single(many, few, group=gloo),
            "shm od.all_gather ragged": lambda: od.all_gather(ragged),
            "gloo od.all_gather ragged": lambda: od.all_gather(ragged, group=gloo),
        },
        reps=args.reps,
        inner=100,
    )
    for size_mb in (1, 16):  # all_to_all: 1 MB fits a slot, 16 MB goes in rounds
        n = size_mb * MB // 4 // world * world
        send, got = torch.ones(n), torch.empty(n)
        outs = [torch.empty(n // world) for _ in range(world)] if me == 0 else None
        # onedist's all_gather of tensors whose first dimension differs: size_mb MB per rank
        ragged_big = torch.ones(size_mb * MB // 4 // 1024 + me, 1024)
        out[f"{size_mb} MB exchanges"] = _timed(
            {
                "shm all_to_all_single": lambda send=send, got=got: dist.all_to_all_single(got, send),
                "gloo all_to_all_single": lambda send=send, got=got: dist.all_to_all_single(
                    got, send, group=gloo
                ),
                "shm gather": lambda send=send, outs=outs, n=n: dist.gather(send[: n // world], outs, dst=0),
                "gloo gather": lambda send=send, outs=outs, n=n: dist.gather(
                    send[: n // world], outs, dst=0, group=gloo
                ),
                "shm od.all_gather ragged": lambda t=ragged_big: od.all_gather(t),
                "gloo od.all_gather ragged": lambda t=ragged_big: od.all_gather(t, group=gloo),
            },
            reps=args.reps,
            inner=8 if size_mb == 1 else 2,
        )
    data = torch.randn(args.batch, 1024)
    steppers = {}
    for name, group in (("shm", None), ("gloo", gloo)):
        model = torch.nn.parallel.DistributedDataParallel(_mlp(), process_group=group)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step(model: Any = model, opt: Any = opt) -> None:
            opt.zero_grad(set_to_none=True)
            model(data).pow(2).mean().backward()
            opt.step()

        steppers[name] = step
    out["DDP step"] = _timed(steppers, reps=args.reps, inner=3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 16, 128], help="all_reduce sizes, MB")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32, help="DDP rows per rank per step")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU benchmark, also on a GPU machine
    res = od.spawn("shm", run, args=(args,), nproc_per_node=args.world_size)[0]
    print(
        f"onedist {od.__version__}, torch {torch.__version__}, world size {args.world_size}, "
        f"{os.cpu_count()} CPUs; medians of {args.reps} interleaved repetitions; ratios to gloo"
    )
    for key, rows in res.items():
        print(f"\n{key}")
        if key.startswith("all_reduce"):
            gloo_bw = rows["gloo"][0]
            for name, (bw, sec) in rows.items():
                print(f"  {name:8s} {sec * 1e3:9.2f} ms  {bw:6.2f} GB/s   x{bw / gloo_bw:.2f} of gloo")
        else:
            for name, sec in rows.items():
                base = rows.get(name.replace("shm", "gloo"), sec)
                unit = f"{sec * 1e6:9.1f} us" if sec < 1e-3 else f"{sec * 1e3:9.2f} ms"
                speed = f"   x{base / sec:.2f} of gloo" if name.startswith("shm") else ""
                print(f"  {name:26s} {unit}{speed}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"world_size": args.world_size, "torch": torch.__version__, "results": res}, f, indent=2
            )


if __name__ == "__main__":
    main()
