"""What putting every call on record costs (issue 49): the same calls on a recorded gloo group and on
torch's plain gloo group, in the same worker processes, interleaved (``--backend mpi``: onedist's
mpi4py group with and without its record, ``ONEDIST_RECORD=0``, started through mpirun;
``--backend horovod``: Horovod's own ``hvd.*`` calls with onedist's record installed and removed
between repetitions, in the same processes started through ``horovod.run``).

    python benchmarks/bench_recording.py                     # 2 gloo ranks, CPU
    python benchmarks/bench_recording.py --bind              # each rank bound to one CPU (mpirun's way)
    python benchmarks/bench_recording.py --backend mpi       # 2 mpi4py ranks under mpirun
    python benchmarks/bench_recording.py --backend horovod   # 2 Horovod ranks (gloo controller)
    python benchmarks/bench_recording.py --json out.json

Rows (each a ratio to the plain group: 1.00 = free):
  dist.all_reduce, 1 float       torch.distributed's function on each group; on gloo also a Python
                                 group that only forwards to gloo (what torch calling a Python
                                 group costs at all, before anything is recorded)
  dist.all_reduce, 64 KiB        the same, 16384 floats (the record's cost is per call)
  od.all_reduce, 1 float         onedist's, on each group (``group=``)
  DDP step                       forward, backward (the gradient buckets), SGD step of an MLP
                                 (128 -> 256 -> 256 -> 2, 64 samples a rank): DDP over each group
The A/A row (the plain group against a second plain group) is the noise floor. The groups are
made anew for each of ``--blocks`` blocks of ``--reps`` repetitions (in a rotating order), so that
no variant keeps one set of gloo threads' placement for a whole run. Horovod's rows:
``hvd.allreduce`` of 1 float and of 64 KiB (unnamed, as most scripts call it), and a step of
``hvd.DistributedOptimizer`` on the same MLP; each ratio is to the record removed, with the CPU
time of the rank's process (Horovod's background thread included) beside the wall time.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_collectives import timeit

import onedist as od
from onedist.backends._pygroup import NamedGroup
from onedist.backends.recorded import gloo as recorded_gloo

_c10d: Any = dist.distributed_c10d


class _Forwarding(NamedGroup):
    """A Python process group that hands each all_reduce to gloo and records nothing."""

    def __init__(self, options: Any, backend_options: Any = None) -> None:
        super().__init__(options.group_rank, options.group_size)
        store = _c10d.PrefixStore("forward/", options.store)
        self.inner = _c10d.ProcessGroupGloo(store, options.group_rank, options.group_size, options.timeout)

    def getBackendName(self) -> str:
        return "onedist-forward"

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self.inner.allreduce(tensors, opts or _c10d.AllreduceOptions())


def _mlp() -> torch.nn.Module:
    """The model of the DDP step rows (MLP 128-256-256-2), the same weights every time."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(128, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 2),
    )


def _ddp_step(group: Any) -> Callable[[], None]:
    mlp = _mlp()
    model = torch.nn.parallel.DistributedDataParallel(mlp, process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 128), torch.randint(0, 2, (64,))

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def _groups(backend: str, block: int) -> tuple[Any, ...]:
    """A recorded group, two plain ones of ``backend`` and, on gloo, a forwarding one, made in an
    order that rotates with ``block`` (a group's threads land where they land: each block's
    groups are new, so that no variant keeps one placement's luck)."""
    if backend == "gloo":
        recorded_gloo.register()
        if "onedist-forward" not in dist.Backend.backend_list:
            dist.Backend.register_backend("onedist-forward", _Forwarding, extended_api=True, devices=["cpu"])
        names = [recorded_gloo.NAME, "gloo", "gloo", "onedist-forward"]
        made = {i: dist.new_group(backend=names[i]) for i in [(block + k) % 4 for k in range(4)]}
        return tuple(made[i] for i in range(4))
    recorded = dist.new_group()  # the default group's backend (mpi4py): recorded unless switched off
    os.environ["ONEDIST_RECORD"] = "0"  # read as the group is made
    try:
        return recorded, dist.new_group(), dist.new_group(), None
    finally:
        del os.environ["ONEDIST_RECORD"]


def _bind(local_rank: int) -> None:
    """Bind this process and its threads to one CPU, as ``mpirun`` (``--bind-to core``) and
    ``srun --cpu-bind=cores`` bind each rank."""
    allowed = sorted(os.sched_getaffinity(0))
    cpu = {allowed[local_rank % len(allowed)]}
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), cpu)


def _cases(groups: tuple[Any, ...]) -> dict[str, dict[str, Callable[[], Any]]]:
    recorded, plain, plain_again, forwarding = groups
    t, big = torch.ones(1), torch.ones(16384)
    cases: dict[str, dict[str, Callable[[], Any]]] = {
        "dist.all_reduce, 1 float": {
            "plain": lambda: dist.all_reduce(t, group=plain),
            "recorded": lambda: dist.all_reduce(t, group=recorded),
            "plain again (A/A)": lambda: dist.all_reduce(t, group=plain_again),
        },
        "dist.all_reduce, 64 KiB": {
            "plain": lambda: dist.all_reduce(big, group=plain),
            "recorded": lambda: dist.all_reduce(big, group=recorded),
        },
        "od.all_reduce, 1 float": {
            "plain": lambda: od.all_reduce(t, group=plain),
            "recorded": lambda: od.all_reduce(t, group=recorded),
        },
        "DDP step": {"plain": _ddp_step(plain), "recorded": _ddp_step(recorded)},
    }
    if forwarding is not None:
        cases["dist.all_reduce, 1 float"]["forwarding only"] = lambda: dist.all_reduce(t, group=forwarding)
    return cases


def run(local_rank: int, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)
    if args.bind:
        _bind(local_rank)
    iters = {"DDP step": args.iters // 10}
    ratios: dict[str, dict[str, list[float]]] = {}
    plain_seconds: dict[str, list[float]] = {}
    for block in range(args.blocks):
        groups = _groups(args.backend, block)
        for case, variants in _cases(groups).items():
            seconds = paired(variants, iters.get(case, args.iters), args.reps, block)
            plain_seconds.setdefault(case, []).extend(seconds["plain"])
            for name, each in seconds.items():
                ratios.setdefault(case, {}).setdefault(name, []).extend(
                    s / p for s, p in zip(each, seconds["plain"])
                )
        if args.backend == "gloo":  # mpi4py's groups are kept (made 3 a block)
            for group in groups:
                dist.destroy_process_group(group)
    return {case: _summary(rows, plain_seconds[case]) for case, rows in ratios.items()}


def paired(
    variants: dict[str, Callable[[], Any]], iters: int, reps: int, shift: int = 0
) -> dict[str, list[float]]:
    """Each variant's seconds a call in each of ``reps`` repetitions, the order of the variants
    rotating every repetition (from ``shift``)."""
    names = list(variants)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        k = (rep + shift) % len(names)
        for name in names[k:] + names[:k]:
            seconds[name].append(timeit(variants[name], iters))
    return seconds


def _summary(ratios: dict[str, list[float]], plain: list[float]) -> dict[str, float]:
    """The median of each variant's ratios to the plain group in the same repetition, with its
    quartiles ("<name> q1", "<name> q3"); "plain, us": the plain group's median microseconds a call.
    Pairing within a repetition takes out what drifts between repetitions; most of the noise is
    within one (the quartiles: about ±15 % for a 1-float call on 2 busy cores)."""
    row: dict[str, float] = {}
    for name, each in ratios.items():
        q1, median, q3 = statistics.quantiles(each, n=4)
        row.update({name: median, f"{name} q1": q1, f"{name} q3": q3})
    row["plain, us"] = statistics.median(plain) * 1e6
    return row


# ---------------------------------------------------------------------------- --backend horovod
def _hvd_timeit(hvd: Any, fn: Callable[[], Any], iters: int) -> tuple[float, float]:
    """Wall and CPU seconds per call of ``fn``, both ranks starting together; rank 0's view."""
    fn()
    hvd.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(iters):
        fn()
    hvd.barrier()
    return (time.perf_counter() - t0) / iters, (time.process_time() - c0) / iters


class _Submit:
    """``hvd.allreduce_async`` of 1 float, submitted ``iters`` times and timed alone (the calling
    thread's cost, which the record adds to; Horovod's round trip, which noise dominates on a busy
    machine, is not in it); its CPU time is the calling thread's (``thread_time``: Horovod's
    background thread works meanwhile). The handles are synchronised after the clock stops."""

    def __init__(self, hvd: Any) -> None:
        self.hvd, self.t = hvd, torch.ones(1)

    def timeit(self, iters: int) -> tuple[float, float]:
        hvd = self.hvd
        hvd.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        handles = [hvd.allreduce_async(self.t) for _ in range(iters)]
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        for h in handles:
            hvd.synchronize(h)
        return wall / iters, cpu / iters


def _hvd_cases(hvd: Any) -> dict[str, Callable[[int], tuple[float, float]]]:
    """Each case as a function timing ``iters`` calls: (wall, CPU) seconds per call."""
    t, big = torch.ones(1), torch.ones(16384)
    mlp = _mlp()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(mlp.parameters(), lr=0.01), mlp.named_parameters())
    x, y = torch.randn(64, 128), torch.randint(0, 2, (64,))

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(mlp(x), y).backward()
        opt.step()

    calls: dict[str, Callable[[], Any]] = {
        "hvd.allreduce, 1 float": lambda: hvd.allreduce(t),
        "hvd.allreduce, 64 KiB": lambda: hvd.allreduce(big),
        "DistributedOptimizer step": step,
    }
    cases = {"hvd.allreduce_async submitted, 1 float": _Submit(hvd).timeit}
    cases.update({name: functools.partial(_hvd_timeit, hvd, fn) for name, fn in calls.items()})
    return cases


def run_horovod(local_rank: int, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Each case with the record on, off, and off again (A/A), the three interleaved in rotating
    order; the record is installed or removed between repetitions (its nonce allreduce untimed)."""
    import horovod.torch as hvd

    from onedist.backends.recorded import horovod_calls

    torch.set_num_threads(1)
    states = ("plain", "recorded", "plain again (A/A)")
    results: dict[str, dict[str, float]] = {}
    for case, timed in _hvd_cases(hvd).items():
        iters = args.iters // 10 if "step" in case else args.iters
        wall: dict[str, list[float]] = {k: [] for k in states}
        cpu: dict[str, list[float]] = {k: [] for k in states}
        for rep in range(args.reps * args.blocks):
            for state in states[rep % 3 :] + states[: rep % 3]:
                if state == "recorded":
                    horovod_calls.install(hvd)
                w, c = timed(iters)
                horovod_calls.uninstall()
                wall[state].append(w)
                cpu[state].append(c)
        base, base_cpu = statistics.median(wall["plain"]), statistics.median(cpu["plain"])
        results[case] = {k: statistics.median(v) / base for k, v in wall.items()}
        results[case]["recorded, CPU"] = statistics.median(cpu["recorded"]) / base_cpu
        results[case]["plain, us"] = base * 1e6
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=("gloo", "mpi", "horovod"), default="gloo")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--iters", type=int, default=300, help="calls per timed repetition (DDP: a tenth)")
    parser.add_argument("--reps", type=int, default=6, help="repetitions per block of new groups")
    parser.add_argument("--blocks", type=int, default=8, help="blocks, each with groups made anew")
    parser.add_argument("--bind", action="store_true", help="bind each rank to one CPU (as mpirun does)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    worker = run_horovod if args.backend == "horovod" else run
    results = od.spawn(args.backend, worker, args=(args,), nproc_per_node=args.world_size)[0]
    bound = ", each bound to one CPU" if args.bind else ""
    ranks = f"{args.world_size} ranks{bound}"
    where = f"torch {torch.__version__}, {args.backend}, {ranks}, {os.cpu_count()} CPUs"
    lines = [f"{where}; x the plain group"]
    for case, row in results.items():
        lines.append(f"{case} (plain: {row.pop('plain, us'):.1f} us)")
        for name, ratio in row.items():
            if name.endswith((" q1", " q3")):
                continue
            spread = f"  [{row[name + ' q1']:.3f}-{row[name + ' q3']:.3f}]" if name + " q1" in row else ""
            lines.append(f"  {name:24s} x{ratio:.3f}{spread}")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"torch": torch.__version__, "backend": args.backend, "ranks": args.world_size, **results}
            )
        )


if __name__ == "__main__":
    main()
