"""Worker functions for spawn / Parallel tests (module level, so 'spawn' can import them)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import onedist as od
from launch_env import strip_launcher_vars


def report(local_rank: int, tag: str = "") -> dict:
    return {
        "tag": tag,
        "local_rank_arg": local_rank,
        "rank": od.get_rank(),
        "world_size": od.get_world_size(),
        "local_rank": od.get_local_rank(),
        "nproc_per_node": od.get_nproc_per_node(),
        "nnodes": od.get_nnodes(),
        "node_rank": od.get_node_rank(),
        "backend": od.backend(),
        "sum": od.all_reduce(od.get_rank()),
        "gathered": od.all_gather(od.get_rank()),
        "pid": os.getpid(),
    }


def fail_on(local_rank: int, bad_rank: int, how: str) -> None:
    if od.get_rank() == bad_rank:
        time.sleep(0.2)
        if how == "raise":
            raise ValueError(f"boom on rank {bad_rank}")
        if how == "exit":
            os._exit(3)
        if how == "sys.exit":
            sys.exit(3)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
    od.all_reduce(torch.ones(1))  # the others wait here for the failed rank
    od.barrier()


def unpicklable_on_rank_1(local_rank: int) -> object:
    return (lambda: local_rank) if od.get_rank() == 1 else local_rank


def exit_zero(local_rank: int) -> str:
    raise SystemExit(0)


def user_group(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """A process group made by the user (no onedist call before), under torch.multiprocessing."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    if rank == 1:
        # first onedist query on one rank only, while rank 0 is busy: must not block
        t0 = time.monotonic()
        info = (od.get_rank(), od.get_world_size(), od.backend(), od.model_name())
        elapsed = time.monotonic() - t0
        with open(os.path.join(out_dir, "first_query"), "w") as f:
            f.write(f"{info}|{elapsed:.3f}")
    dist.barrier()  # rank 0 arrives here only now: rank 1's queries did not need it
    od.sync()  # every rank publishes its node
    dist.barrier()
    if rank == world_size - 1:  # local layout asked by one rank alone: no collective needed
        with open(os.path.join(out_dir, "layout"), "w") as f:
            f.write(repr((od.get_local_rank(), od.get_nproc_per_node(), od.get_nnodes(), od.get_node_rank())))
    assert od.all_reduce(1) == world_size
    assert od.all_gather(rank) == list(range(world_size))
    dist.barrier()
    dist.destroy_process_group()
    assert od.get_world_size() == 1 and od.model_name() == "serial"  # noticed the destroy


def uneven_nodes(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Ranks 0-2 say they are on node 0, rank 3 on node 1 (only GROUP_RANK set, as some launchers do):
    the rest of the layout comes from what the ranks published, and is exact for 3 + 1."""
    strip_launcher_vars("NODE_RANK")
    os.environ["GROUP_RANK"] = "0" if rank < 3 else "1"
    od.initialize("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    layout = (od.get_local_rank(), od.get_nproc_per_node(), od.get_node_rank(), od.get_nnodes())
    local = od.get_local_process_group()
    local_sum = od.all_reduce(1, group=local)
    with open(os.path.join(out_dir, f"{rank}"), "w") as f:
        f.write(repr((*layout, local_sum)))
    od.barrier()
    od.finalize()


def listeners(local_rank: int) -> list[str]:
    """The TCP addresses this worker listens on, after a collective (store and gloo are up)."""
    from netutil import listening

    od.all_reduce(1)
    found = listening(os.getpid())
    od.barrier()
    return found


def env_var(local_rank: int, name: str) -> str | None:
    return os.environ.get(name)


def large_collectives(local_rank: int) -> float:
    """Collectives of 1 MiB and more (a Python process group runs them on its own thread), then
    return without finalizing: the worker must exit cleanly."""
    big = torch.full((1 << 18,), float(od.get_rank() + 1))
    dist.all_reduce(big)
    dist.broadcast(big, src=1)
    out = torch.empty(big.numel() * od.get_world_size())
    dist.all_gather_into_tensor(out, big)
    dist.reduce_scatter_tensor(big, out)
    return float(big[0])


def mpi_report(local_rank: int, x: int) -> tuple:
    """Under spawn("mpi"): what this rank sees, and one all_reduce."""
    return (
        od.get_rank(),
        od.get_world_size(),
        od.backend(),
        local_rank,
        od.get_local_rank(),
        od.all_reduce(x),
    )


def fail_on_rank_1_after_the_others_return(local_rank: int) -> int:
    if od.get_rank() == 1:
        time.sleep(1.5)
        raise ValueError("late failure on rank 1")
    return od.get_rank()


def fail_on_rank_1(local_rank: int) -> None:
    if od.get_rank() == 1:
        raise ValueError("bad input on rank 1")
    od.barrier()


def finalize_while_gloo_is_busy(local_rank: int) -> dict:
    """A group that outlives destroy_process_group (DDP holds it, as torch's does for good) and a
    Python callback still napping on one of gloo's worker threads when rank 0 finalizes: finalize
    must return only once that thread is idle again (else it may take the GIL while the
    interpreter finalizes, which can abort the process after the work succeeded)."""
    import threading

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    model(torch.randn(8, 4)).sum().backward()
    napped, on_gloo_thread = threading.Event(), []

    def napping(fut: torch.futures.Future) -> None:
        on_gloo_thread.append(threading.current_thread() is not threading.main_thread())
        for _ in range(300):  # 0.3 s or more, sleeping in short steps
            time.sleep(0.001)
        napped.set()

    if od.get_rank() == 1:
        time.sleep(0.3)  # so rank 0's all_reduce is still running when its callback is added
    work = dist.all_reduce(torch.ones(4), async_op=True)
    if od.get_rank() == 0:
        work.get_future().then(napping)  # runs on the gloo thread that completes the all_reduce
    dist.all_reduce(torch.ones(1))  # on gloo's other thread; rank 0 never waits for the first
    od.finalize()
    tasks = Path("/proc/self/task")
    gloo_threads = sum((task / "comm").read_text().strip() == "pt_gloo_runloop" for task in tasks.iterdir())
    return {"on_gloo_thread": any(on_gloo_thread), "napped": napped.is_set(), "gloo_threads": gloo_threads}
