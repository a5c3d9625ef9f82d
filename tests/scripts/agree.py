"""The script every launcher test runs: each rank writes what it sees to OUT_DIR/<rank>.json.

python agree.py OUT_DIR [NPROC]        # spawns NPROC workers (Parallel)
onedist run -n 2 agree.py OUT_DIR      # the launcher started them: Parallel only initialises
torchrun / mpirun / srun ... agree.py OUT_DIR
"""

import json
import os
import sys
import time

import onedist as od


def describe(local_rank: int) -> dict:
    """What this rank sees (one all_reduce and one all_gather included)."""
    return {
        "rank": od.get_rank(),
        "world_size": od.get_world_size(),
        "local_rank": od.get_local_rank(),
        "local_rank_arg": local_rank,
        "nproc_per_node": od.get_nproc_per_node(),
        "node_rank": od.get_node_rank(),
        "nnodes": od.get_nnodes(),
        "hostname": od.hostname(),
        "backend": od.backend(),
        "sum": od.all_reduce(1),
        "ranks": od.all_gather(od.get_rank()),
        "pid": os.getpid(),
        **_shm_layout(),
    }


def _shm_layout() -> dict:
    """backend shm: the hosts its world group spans, and a large all_reduce and broadcast through it."""
    if od.backend() != "shm":
        return {}
    import torch
    import torch.distributed as dist

    big = torch.full((3_000_000,), float(od.get_rank() + 1))  # 12 MB: chunked through the segments
    od.all_reduce(big, inplace=True)
    src = od.broadcast(torch.arange(1000.0) * od.get_world_size(), src=od.get_world_size() - 1)
    n = od.get_world_size()
    return {
        "shm_hosts": dist.group.WORLD._hosts,
        "shm_sum_ok": bool(torch.all(big == n * (n + 1) / 2)),
        "shm_broadcast_ok": bool(torch.equal(src, torch.arange(1000.0) * n)),
    }


def main(local_rank: int, out_dir: str) -> None:
    info = describe(local_rank)
    with open(os.path.join(out_dir, f"{info['rank']}.json"), "w") as f:
        json.dump(info, f)
    print(f"rank {info['rank']} of {info['world_size']} done", flush=True)
    if os.environ.get("AGREE_FAIL_RANK") == str(info["rank"]):
        how = os.environ.get("AGREE_FAIL_HOW", "raise")
        with open(os.path.join(out_dir, "failed_at"), "w") as f:
            f.write(str(time.time()))
        if how == "raise":
            raise RuntimeError(f"rank {info['rank']} failed on purpose")
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), 9)
    if os.environ.get("AGREE_SLEEP"):
        time.sleep(float(os.environ["AGREE_SLEEP"]))
    od.barrier()


if __name__ == "__main__":
    nproc = int(sys.argv[2]) if len(sys.argv) > 2 else None
    with od.Parallel(backend=os.environ.get("AGREE_BACKEND", "gloo"), nproc_per_node=nproc) as parallel:
        parallel.run(main, sys.argv[1])
