"""Misuse scenarios on 2 ranks; each rank writes the error it got to OUT_DIR/<rank>.json.

python misuse.py OUT_DIR SCENARIO [TIMEOUT_S]      (ONEDIST_DEBUG=1 for debug mode)
"""

import json
import os
import sys
import time

import torch

import onedist as od


def scenario(name: str) -> None:
    rank = od.get_rank()
    od.barrier()  # everyone is up
    if name == "reduce_vs_barrier":
        if rank == 0:
            od.all_reduce(torch.ones(3))
        else:
            od.barrier()
    elif name == "shapes":
        od.all_reduce(torch.ones(2 + rank))
    elif name == "dtypes":
        od.all_reduce(torch.ones(3, dtype=torch.float32 if rank == 0 else torch.float64))
    elif name == "only_rank0":
        if rank == 0:
            od.all_reduce(torch.ones(3))
        od.barrier()
    elif name == "one_rank_only":

        @od.one_rank_only()
        def save() -> None:
            od.all_reduce(1)

        save()
    elif name == "crash":
        if rank == 1:
            raise ValueError("rank 1 failed on purpose")
        od.barrier()
    elif name == "slow":
        if rank == 1:
            time.sleep(8)
        assert od.all_reduce(torch.ones(3)).tolist() == [2.0, 2.0, 2.0]
    elif name == "reduce_vs_gather":
        if rank == 0:
            od.all_reduce(torch.ones(4))
        else:
            od.all_gather(torch.ones(3))
        od.barrier()  # gloo may return rank 0's all_reduce against the gather: it then waits here
    elif name == "shapes_then_barrier":  # gloo returns the 2-element call early on rank 0
        od.all_reduce(torch.ones(2 + rank))
        od.barrier()
    elif name == "shapes_last":  # the program's last collective: gloo returns rank 0's early
        od.all_reduce(torch.ones(2 + rank))
        od.finalize()  # where rank 0 learns that rank 1 never got out
    elif name == "finalize_together":
        od.all_reduce(torch.ones(3))
        started = time.monotonic()
        od.finalize()
        FINALIZE_S.append(time.monotonic() - started)
    elif name == "subgroup_reduce_vs_barrier":  # 3 ranks; rank 2 is not in the group
        group = od.new_group([0, 1]) if rank < 2 else None
        if rank == 0:
            od.all_reduce(torch.ones(3), group=group)
        elif rank == 1:
            od.barrier(group=group)
        else:  # stays until the members wrote theirs: spawn stops the job when a worker returns early
            while not all(os.path.exists(os.path.join(sys.argv[1], f"{r}.json")) for r in (0, 1)):
                time.sleep(0.1)
    else:
        plain_scenario(name)


def plain_scenario(name: str) -> None:
    """Scenarios of plain torch.distributed calls, on the group onedist initialised."""
    import torch.distributed as dist

    rank = od.get_rank()
    if name == "plain_reduce_vs_barrier":
        if rank == 0:
            dist.all_reduce(torch.ones(3))
        else:
            dist.barrier()
    elif name == "plain_shapes":
        dist.all_reduce(torch.ones(2 + rank))
        dist.barrier()
    elif name == "ok":
        assert od.all_reduce(torch.ones(3)).tolist() == [2.0, 2.0, 2.0]
        assert od.all_gather(torch.ones(rank + 1)).shape == (3,)
    else:
        raise SystemExit(f"unknown scenario {name}")


FINALIZE_S: list = []  # how long finalize took (scenario finalize_together)


def main(local_rank: int, out_dir: str, name: str) -> None:
    start = time.time()
    rank = od.get_rank()  # a scenario may finalize: then the rank is 0 (serial)
    try:
        scenario(name)
        result = {"error": None}
    except Exception as e:
        result = {"error": type(e).__name__, "message": str(e)}
        result["mismatch"] = isinstance(e, od.CollectiveMismatchError)
        result["chained"] = e.__cause__ is not None  # onedist's explanations stand alone
        result["backend_error"] = type(getattr(e, "backend_error", None)).__name__
        if name == "crash" and rank == 1:
            raise
    result["elapsed"] = time.time() - start
    if FINALIZE_S:
        result["finalize_s"] = FINALIZE_S[0]
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    os._exit(0)  # the group is broken after a failed collective: do not wait in finalize


if __name__ == "__main__":
    out, name = sys.argv[1], sys.argv[2]
    timeout = float(sys.argv[3]) if len(sys.argv) > 3 else 30.0  # 0: torch's default (30 minutes)
    if os.environ.get("MISUSE_UNDER_RUN"):  # started by `onedist run`: initialise here
        od.initialize(os.environ.get("MISUSE_BACKEND", "gloo"), timeout=timeout or None)
        main(od.get_local_rank(), out, name)
    else:
        nproc = int(os.environ.get("MISUSE_NPROC", "2"))
        backend = os.environ.get("MISUSE_BACKEND", "gloo")
        # the scenarios are about the ranks' calls, not how a worker starts (test_launch and
        # test_spawn_page start them the other ways): fork from this process, which has torch
        # loaded, where the backend's workers are this launcher's own
        start = "fork" if backend in ("gloo", "shm") else "spawn"
        od.spawn(
            backend, main, args=(out, name), nproc_per_node=nproc, timeout=timeout or None, start_method=start
        )
