"""Startup: how long it takes to start 2 workers that initialise gloo, all_reduce once and exit.

Every launcher runs the same trivial work, interleaved, and the report gives medians, the ratio
to torchrun and the CPU time of the launch with its workers:

    python benchmarks/bench_startup.py             # 5 repetitions, world size 2
    python benchmarks/bench_startup.py --reps 9 --nproc 4

Launchers: ``onedist run -n N`` (its workers forked, and with ``--start-method spawn``),
``torchrun --nproc-per-node N``, ``torch.multiprocessing.spawn``
(a script calling it), and ``onedist.spawn`` (a script calling it, start method "spawn" and
"forkserver"); then the second ``onedist.spawn`` of a script that calls it twice, timed alone
(a sweep, a notebook, a test suite: the fork server, torch loaded, is already there).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

WORKER = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()
    dist.destroy_process_group()
    """
)

MP_SPAWN = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp

    def work(rank, world, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        t = torch.ones(1)
        dist.all_reduce(t)
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(work, args=(int(sys.argv[1]), int(sys.argv[2])), nprocs=int(sys.argv[1]))
    """
)

OD_SPAWN = textwrap.dedent(
    """
    import sys, torch, onedist as od

    def work(local_rank):
        od.all_reduce(torch.ones(1))

    if __name__ == "__main__":
        od.spawn("gloo", work, nproc_per_node=int(sys.argv[1]), start_method=sys.argv[2])
    """
)

# a program that starts workers again (a sweep, a notebook, a test suite): its second od.spawn
OD_SPAWN_AGAIN = textwrap.dedent(
    """
    import sys, time, torch, onedist as od

    def work(local_rank):
        od.all_reduce(torch.ones(1))

    if __name__ == "__main__":
        od.spawn("gloo", work, nproc_per_node=int(sys.argv[1]), start_method=sys.argv[2])
        start = time.perf_counter()
        od.spawn("gloo", work, nproc_per_node=int(sys.argv[1]), start_method=sys.argv[2])
        print(time.perf_counter() - start)
    """
)


def _children_cpu() -> float:
    """CPU seconds of the ended processes this one waited for (a launcher's workers included)."""
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    from onedist._net import free_port

    n = str(args.nproc)
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        scripts = (("worker.py", WORKER), ("mp_spawn.py", MP_SPAWN), ("od_spawn.py", OD_SPAWN))
        for name, text in (*scripts, ("od_spawn_again.py", OD_SPAWN_AGAIN)):
            files[name] = os.path.join(tmp, name)
            with open(files[name], "w") as f:
                f.write(text)
        py = sys.executable
        run = [py, "-m", "onedist", "run", "-n", n]
        commands = {
            "torchrun": lambda: [
                py,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                n,
                "--master-port",
                str(free_port()),
                files["worker.py"],
            ],
            "onedist run": lambda: [*run, files["worker.py"]],
            "onedist run --start-method spawn": lambda: [*run, "--start-method", "spawn", files["worker.py"]],
            "torch.multiprocessing.spawn": lambda: [py, files["mp_spawn.py"], n, str(free_port())],
            "onedist.spawn": lambda: [py, files["od_spawn.py"], n, "spawn"],
            "onedist.spawn (forkserver)": lambda: [py, files["od_spawn.py"], n, "forkserver"],
        }
        again = {method: [py, files["od_spawn_again.py"], n, method] for method in ("spawn", "forkserver")}
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        }
        samples: dict[str, list[float]] = {k: [] for k in commands}
        cpu: dict[str, list[float]] = {k: [] for k in commands}  # of the launch and its workers
        seconds_again: dict[str, list[float]] = {method: [] for method in again}
        names = list(commands)
        for rep in range(args.reps):
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                t0, cpu0 = time.perf_counter(), _children_cpu()
                proc = subprocess.run(commands[name](), capture_output=True, text=True, env=env, timeout=300)
                elapsed = time.perf_counter() - t0
                if proc.returncode != 0:
                    raise SystemExit(f"{name} failed:\n{proc.stdout}\n{proc.stderr}")
                samples[name].append(elapsed)
                cpu[name].append(_children_cpu() - cpu0)
            for method, command in again.items():  # the second call's own time, as the script measured it
                proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
                if proc.returncode != 0:
                    raise SystemExit(f"od.spawn twice ({method}) failed:\n{proc.stdout}\n{proc.stderr}")
                seconds_again[method].append(float(proc.stdout.split()[-1]))
    t_import = []
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run([py, "-c", "import torch"], check=True)
        t_import.append(time.perf_counter() - t0)
    ref = statistics.median(samples["torchrun"])
    print(
        f"start {n} workers (init gloo + one all_reduce + exit), {os.cpu_count()} CPUs, median of {args.reps}"
    )
    label = "python -c 'import torch'"
    print(f"  {label:34s} {statistics.median(t_import):6.2f} s")
    for name, values in samples.items():
        med = statistics.median(values)
        seconds = statistics.median(cpu[name])
        print(f"  {name:34s} {med:6.2f} s   x{med / ref:.2f} of torchrun   {seconds:5.2f} CPU-s")
    for method, values in seconds_again.items():
        label = f"2nd od.spawn ({method})"
        print(f"  {label:34s} {statistics.median(values):6.2f} s   (the call alone, after a first)")


if __name__ == "__main__":
    main()
