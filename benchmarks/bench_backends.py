"""onedist's collectives on each backend, side by side with gloo, in the same launched processes.

Start it with the launcher the backends need; each backend is initialised in turn in the same
processes (``initialize`` -> cases -> ``finalize``), so the rows compare backends on the same
machine, processes and tensors:

    mpirun -np 2 python benchmarks/bench_backends.py --backends gloo mpi
    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/bench_backends.py --backends gloo horovod
    torchrun --nproc-per-node 2 benchmarks/bench_backends.py --backends gloo shm

Rows: one case on one backend, through onedist (``od.all_reduce(t, inplace=True)``, ...) and,
where the backend is a library of its own, through that library directly ("raw": mpi4py's
``Allreduce`` on the tensor's memory, Horovod's ``allreduce_``, ``dist.all_reduce`` on gloo), so
the report shows both how the backend compares with gloo and what onedist costs on top of it.
Ratios are gloo's median time over the row's (above 1: faster than gloo).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
import onedist as od

MB = 1 << 20


def timeit(fn: Callable[[], Any], iters: int, reps: int) -> float:
    """Median over ``reps`` of the mean time of ``iters`` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(reps):
        od.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - start) / iters)
    return statistics.median(times)


def raw_all_reduce(backend: str) -> Optional[Callable[[torch.Tensor], Any]]:
    """The backend library's own in-place SUM all_reduce of a CPU float tensor, if it has one."""
    if backend == "mpi":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD

        def mpi(t: torch.Tensor) -> Any:
            return comm.Allreduce(MPI.IN_PLACE, [t.numpy(), MPI.FLOAT], MPI.SUM)

        return mpi
    if backend == "horovod":
        import horovod.torch as hvd

        return lambda t: hvd.allreduce_(t, op=hvd.Sum)
    if backend in ("gloo", "shm"):
        import torch.distributed as dist

        return lambda t: dist.all_reduce(t)
    return None


def cases(quick: bool) -> list[tuple[str, int]]:
    sizes = [("all_reduce 1 float", 4), ("all_reduce 1 MB", MB), ("all_reduce 16 MB", 16 * MB)]
    if not quick:
        sizes.append(("all_reduce 128 MB", 128 * MB))
    return sizes


def measure(backend: str, args: argparse.Namespace) -> dict[str, float]:
    """Seconds per call of every case on ``backend`` (initialised here, finalised after)."""
    od.initialize(backend)
    try:
        out: dict[str, float] = {}
        raw = raw_all_reduce(backend)
        for name, nbytes in cases(args.quick):
            t = torch.ones(nbytes // 4)
            iters = 200 if nbytes < MB else max(2, int(64 * MB // nbytes))
            out[f"{name} (onedist)"] = timeit(lambda t=t: od.all_reduce(t, inplace=True), iters, args.reps)
            if raw is not None:
                out[f"{name} (raw)"] = timeit(lambda t=t: raw(t), iters, args.reps)
        r = od.get_rank()
        uneven = torch.ones((r + 1) * 64 * 1024)  # rank r sends (r + 1) * 256 KB
        out["all_gather uneven (onedist)"] = timeit(lambda: od.all_gather(uneven), 20, args.reps)
        big = torch.ones(4 * MB)  # 16 MB
        out["broadcast 16 MB (onedist)"] = timeit(lambda: od.broadcast(big, src=0), 10, args.reps)
        metrics = {f"m{i}": torch.tensor(float(i)) for i in range(100)}
        out["dict of 100 metrics (onedist)"] = timeit(lambda: od.all_reduce(metrics), 50, args.reps)
        out["barrier (onedist)"] = timeit(od.barrier, 200, args.reps)
        return out
    finally:
        od.finalize()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--backends", nargs="+", default=["gloo", "mpi"], help="backends; the first is the reference"
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="no 128 MB case (smoke run)")
    parser.add_argument("--json", help="also write the results here (rank 0)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {b: measure(b, args) for b in args.backends}
    rank = int(
        os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("HOROVOD_RANK", "0")))
    )
    if rank != 0:
        return
    ref_name = args.backends[0]
    ref = results[ref_name]
    world = (
        os.environ.get("WORLD_SIZE")
        or os.environ.get("OMPI_COMM_WORLD_SIZE")
        or os.environ.get("HOROVOD_SIZE")
    )
    threads = torch.get_num_threads()
    print(f"world size {world}, {threads} torch thread(s) per rank; ratio = {ref_name} time / row time")
    print(f"{'case':34s} {'backend':9s} {'time':>12s} {'rate':>11s} {'vs ' + ref_name:>9s}")
    sizes = dict(cases(False))
    for case in ref:
        for backend in args.backends:
            t = results[backend].get(case)
            if t is None:
                continue
            base = case.rsplit(" (", 1)[0]
            nbytes = sizes.get(base, 0)
            rate = f"{nbytes / t / 1e9:8.2f} GB/s" if nbytes >= MB else ""
            # raw rows compare with the reference's onedist row of the same case
            ref_t = ref.get(case) or ref.get(f"{base} (onedist)")
            ratio = f"{ref_t / t:8.2f}x" if ref_t else ""
            print(f"{case:34s} {backend:9s} {t * 1e6:9.1f} us {rate:>11s} {ratio:>9s}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world_size": world, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
