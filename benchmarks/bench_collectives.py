"""Collectives: onedist side by side with raw torch.distributed (and ignite / accelerate when installed).

Every variant runs in the same worker processes on the same process group (gloo unless
``--backend`` says otherwise), in interleaved
repetitions (raw, onedist, raw, onedist, ...), and the report gives medians and the ratio to raw.

    python benchmarks/bench_collectives.py                 # world size 2, gloo, CPU
    python benchmarks/bench_collectives.py --world-size 4 --json out.json
    python benchmarks/bench_collectives.py --backend shm   # the same on the shared-memory backend

Cases
  small all_reduce     one float32, per-call latency; raw = dist.all_reduce(t), compared with
                       onedist's default od.all_reduce(t) (in place, as ignite and raw: the A/B
                       row); "raw + clone" (input kept) with onedist's inplace=False
  large all_reduce     16/64/128 MB float32; the same pairs. "raw again (A/A)" in both cases is raw
                       once more: how far apart two identical calls land (the noise floor)
  dict of 100 metrics  100 0-dim tensors; raw = torch.stack + one all_reduce + unbind (by hand);
                       also raw leaf by leaf, as peers that loop over a dict do
  uneven all_gather    rank r sends n*(r+1)/W rows; raw = sizes all_gather + pad to the largest +
                       all_gather_into_tensor + unpad ("pad-then-gather")
  object all_gather    a small dict; raw = dist.all_gather_object
  object broadcast     a small dict; raw = dist.broadcast_object_list
Debug mode (ONEDIST_DEBUG=1: ranks compare each call first) is measured on the small all_reduce,
where its extra small collective weighs most.
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


def _optional(name: str) -> Any:
    try:
        return __import__(name)
    except Exception:
        return None


def _debug(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` with onedist's debug mode on (a fingerprint exchange before each collective)."""
    od.set_debug(True)
    try:
        return fn()
    finally:
        od.set_debug(False)


def timeit(fn: Callable[[], Any], iters: int) -> float:
    """Seconds per call of ``fn``, all ranks starting together; rank 0's view."""
    fn()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    dist.barrier()
    return (time.perf_counter() - t0) / iters


def compare(variants: dict[str, Callable[[], Any]], iters: int, reps: int) -> dict[str, float]:
    """Median seconds per call of each variant, measured in interleaved repetitions.

    The order of the variants rotates every repetition, so none always runs first or last.
    """
    samples: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(timeit(variants[name], iters))
    return {k: statistics.median(v) for k, v in samples.items()}


_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def pad_then_gather(x: torch.Tensor, world: int) -> torch.Tensor:
    n = torch.tensor([x.shape[0]])
    sizes = torch.empty(world, dtype=torch.int64)
    _all_gather_single(sizes, n)
    m = int(sizes.max())
    padded = torch.zeros((m, *x.shape[1:]), dtype=x.dtype)
    padded[: x.shape[0]] = x
    out = torch.empty((world * m, *x.shape[1:]), dtype=x.dtype)
    _all_gather_single(out, padded)
    return torch.cat([out[i * m : i * m + int(sizes[i])] for i in range(world)])


def run(local_rank: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    rank, world = od.get_rank(), od.get_world_size()
    quick = args.quick
    results: dict[str, Any] = {}
    idist = _optional("ignite.distributed") and __import__("ignite.distributed", fromlist=["x"])
    accel = None
    if _optional("accelerate") is not None:
        from accelerate import PartialState
        from accelerate.utils import operations as accel_ops

        PartialState(cpu=not torch.cuda.is_available())
        accel = accel_ops

    def record(case: str, medians: dict[str, float], unit: str, scale: float, bytes_: int = 0) -> None:
        raw = medians["raw"]
        results[case] = {
            name: {
                unit: value * scale,
                "ratio_to_raw": value / raw,
                **({"GB/s": bytes_ / value / 1e9} if bytes_ else {}),
            }
            for name, value in medians.items()
        }

    # -- small all_reduce latency
    t = torch.ones(1)

    def raw_new_tensor() -> torch.Tensor:
        out = t.clone()
        dist.all_reduce(out)
        return out

    variants: dict[str, Callable[[], Any]] = {
        "raw": lambda: dist.all_reduce(t),
        "raw again (A/A)": lambda: dist.all_reduce(t),  # the noise floor of the ratios
        "onedist (default)": lambda: od.all_reduce(t),
        "raw + clone": raw_new_tensor,
        "onedist inplace=False": lambda: od.all_reduce(t, inplace=False),
        "onedist, debug mode": lambda: _debug(lambda: od.all_reduce(t)),
    }
    if idist is not None:
        variants["ignite"] = lambda: idist.all_reduce(t)
    if accel is not None:
        variants["accelerate"] = lambda: accel.reduce(t, reduction="sum")
    record(
        "small all_reduce (1 float)", compare(variants, 20 if quick else 50, 5 if quick else 60), "us", 1e6
    )

    # -- large all_reduce bandwidth
    for mb in (1, 16) if quick else (16, 64, 128):
        x = torch.ones(mb * 2**20 // 4)
        iters = 2 if mb >= 64 else 4
        medians = compare(
            {
                "raw": lambda x=x: dist.all_reduce(x),
                "raw again (A/A)": lambda x=x: dist.all_reduce(x),
                "onedist (default)": lambda x=x: od.all_reduce(x),
                "raw + clone": lambda x=x: dist.all_reduce(x.clone()),
                "onedist inplace=False": lambda x=x: od.all_reduce(x, inplace=False),
            },
            iters,
            3 if quick else 15,
        )
        record(f"all_reduce {mb} MB", medians, "ms", 1e3, bytes_=mb * 2**20)

    # -- dict of 100 scalar metrics
    metrics = {f"metric_{i:03d}": torch.tensor(float(i + rank)) for i in range(100)}
    keys = sorted(metrics)

    def raw_stacked() -> dict[str, torch.Tensor]:
        buf = torch.stack([metrics[k] for k in keys])
        dist.all_reduce(buf)
        return dict(zip(keys, buf.unbind()))

    def raw_leafwise() -> dict[str, torch.Tensor]:
        out = {}
        for k in keys:
            v = metrics[k].clone()
            dist.all_reduce(v)
            out[k] = v
        return out

    variants = {
        "raw": raw_stacked,
        "onedist": lambda: od.all_reduce(metrics),
        "raw leaf by leaf": raw_leafwise,
    }
    floats = {k: float(v) for k, v in metrics.items()}
    variants["onedist (Python floats)"] = lambda: od.all_reduce(floats)
    if idist is not None:
        variants["ignite (leaf by leaf)"] = lambda: {
            k: idist.all_reduce(v.clone()) for k, v in metrics.items()
        }
    if accel is not None:
        variants["accelerate"] = lambda: accel.reduce(metrics, reduction="sum")
    record(
        "dict of 100 scalar metrics", compare(variants, 10 if quick else 20, 3 if quick else 25), "us", 1e6
    )

    # -- uneven all_gather
    for rows in (1_000, 1_000_000) if quick else (1_000, 100_000, 1_000_000, 4_000_000):
        mine = torch.full((rows * (rank + 1) // world,), float(rank))
        iters = 3 if rows >= 1_000_000 else 20
        assert torch.equal(od.all_gather(mine), pad_then_gather(mine, world))
        medians = compare(
            {"raw": lambda m=mine: pad_then_gather(m, world), "onedist": lambda m=mine: od.all_gather(m)},
            iters,
            3 if quick else 5,
        )
        record(f"uneven all_gather {rows:,} floats (raw = pad-then-gather)", medians, "us", 1e6)

    # -- objects
    obj = {"rank": rank, "name": f"worker-{rank}", "stats": [0.1 * i for i in range(20)]}

    def raw_gather_object() -> list[Any]:
        out: list[Any] = [None] * world
        dist.all_gather_object(out, obj)
        return out

    def raw_broadcast_object() -> Any:
        box = [obj if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    variants = {"raw": raw_gather_object, "onedist": lambda: od.all_gather_object(obj)}
    if accel is not None:
        variants["accelerate"] = lambda: accel.gather_object([obj])
    record(
        "object all_gather (small dict)",
        compare(variants, 50 if quick else 200, 3 if quick else 5),
        "us",
        1e6,
    )
    mine = obj if rank == 0 else None
    variants = {"raw": raw_broadcast_object, "onedist": lambda: od.broadcast_object(mine)}
    record(
        "object broadcast (small dict)", compare(variants, 50 if quick else 200, 3 if quick else 5), "us", 1e6
    )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (smoke run)")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "shm", "mpi"], help="the CPU backend")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    # a CPU benchmark: on a GPU machine, keep every variant (and onedist's device()) on CPU
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    results = od.spawn(args.backend, run, args=(args,), nproc_per_node=args.world_size)[0]
    print(
        f"onedist {od.__version__}, torch {torch.__version__}, {args.backend}, world size {args.world_size}, "
        f"{os.cpu_count()} CPUs"
    )
    for case, rows in results.items():
        print(f"\n{case}")
        for name, row in rows.items():
            unit = next(k for k in row if k not in ("ratio_to_raw", "GB/s"))
            extra = f"  {row['GB/s']:.2f} GB/s" if "GB/s" in row else ""
            print(f"  {name:26s} {row[unit]:10.1f} {unit}   x{row['ratio_to_raw']:.3f} of raw{extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "backend": args.backend,
                    "world_size": args.world_size,
                    "torch": torch.__version__,
                    "results": results,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
