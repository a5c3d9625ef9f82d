"""The calls onedist once did not see (issue 49's table) on 2 ranks; each rank writes what it got to
OUT_DIR/<rank>.json: the error (type, message, seconds after the scenario began) and the steps it
completed.

python unseen.py OUT_DIR SCENARIO BACKEND        (under `onedist run` when ONEDIST_UNDER_RUN=1)
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import onedist as od


def _model(unused: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return h[:, :2] if unused else self.b(h)

    return od.auto_model(Net())


def ddp_loop(out: dict, steps: int, skip: int = 0, extra: bool = False, unused: bool = False) -> None:
    """A DDP loop, each optimizer step it completes in ``out["done"]``; rank 1 skips the backward of
    step ``skip``, runs one ``extra`` forward/backward at the end, or leaves parameter b unused."""
    rank = od.get_rank()
    model = _model(unused=unused and rank == 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    done = out["done"] = []
    for step in range(1, steps + 1):
        loss = model(torch.ones(3, 4) * step).sum()
        if rank == 1 and step == skip:
            continue  # the forward ran, its backward does not
        loss.backward()  # unseen: backward
        optimizer.step()
        optimizer.zero_grad()
        done.append(step)
    if extra and rank == 1:
        model(torch.ones(3, 4)).sum().backward()  # unseen: extra backward


def scenario(name: str, out: dict) -> None:
    rank = od.get_rank()
    t = torch.ones(4)
    if name == "ddp_skip":  # rank 1 skips step 2's backward, then both reduce a metric
        ddp_loop(out, 4, skip=2)
        od.all_reduce(t)
    elif name == "ddp_extra":  # rank 1 runs one more forward/backward, then both meet in a barrier
        ddp_loop(out, 2, extra=True)
        od.barrier()  # unseen: extra barrier
    elif name == "ddp_unused":  # rank 1 never uses parameter b (find_unused_parameters=False)
        ddp_loop(out, 3, unused=True)
        od.barrier()
    elif name == "ddp_uneven":  # rank 1 has one batch fewer and leaves the loop without od.join
        ddp_loop(out, 3 - rank)
        od.all_reduce(t)  # unseen: after the loop
    elif name == "plain_alone":  # rank 1 calls torch.distributed.all_reduce alone
        if rank == 1:
            dist.all_reduce(t)  # unseen: plain all_reduce
        od.barrier()  # unseen: plain barrier
    elif name == "async_alone":  # onedist's own asynchronous call against its barrier
        if rank == 1:
            od.all_reduce(t, async_op=True).wait()  # unseen: async all_reduce
        else:
            od.barrier()  # unseen: async barrier
    elif name == "group_alone":  # on a group the script made with dist.new_group
        group = dist.new_group([0, 1])
        if rank == 1:
            dist.all_reduce(t, group=group)  # unseen: group all_reduce
        else:
            dist.barrier(group=group)  # unseen: group barrier
    elif name == "isend_unreceived":  # nobody receives rank 1's send
        if rank == 1:
            dist.isend(t, 0).wait()  # unseen: isend
        od.barrier()  # unseen: isend barrier
    elif name == "isend_unwaited":  # rank 1's small send is neither waited on nor received
        if rank == 1:
            dist.isend(t, 0)  # unseen: unwaited isend
        od.barrier()
    elif name == "group_isend_unwaited":  # the same on a group the script made
        group = dist.new_group([0, 1])
        if rank == 1:
            dist.isend(t, 0, group=group)  # unseen: group unwaited isend
        od.barrier()
    elif name == "ops":  # SUM against MAX: gloo completes both, each with its own reduction
        od.all_reduce(t, op="SUM" if rank == 0 else "MAX")  # unseen: ops
        for _ in range(100):  # computing: nobody waits in a collective
            time.sleep(0.1)
        od.barrier()
    elif name == "slow":  # rank 1 sleeps, then loops in Python, while rank 0 waits: reports, then success
        if rank == 1:
            time.sleep(4.0)  # unseen: sleeping
            end = time.monotonic() + 8.0
            while time.monotonic() < end:  # unseen: spinning
                pass
        od.all_reduce(t)  # unseen: slow all_reduce
    elif name == "hang":  # rank 1 never arrives: only a signal ends it
        open(os.path.join(sys.argv[1], f"hangs-{rank}"), "w").close()  # the test signals after both
        if rank == 1:
            time.sleep(3600)  # unseen: hanging
        od.all_reduce(t)  # unseen: waiting
    else:
        raise ValueError(f"unknown scenario {name!r}")


def main(local_rank: int, out_dir: str, name: str) -> None:
    out: dict = {"error": None}
    start = time.monotonic()
    try:
        od.barrier()  # everyone is up
        start = time.monotonic()
        scenario(name, out)
    except BaseException as e:
        out.update(error=type(e).__name__, message=str(e))
        raise
    finally:
        out["elapsed"] = time.monotonic() - start
        with open(os.path.join(out_dir, f"{od.get_rank()}.json"), "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    out_dir, name, backend = sys.argv[1], sys.argv[2], sys.argv[3]
    if os.environ.get("ONEDIST_UNDER_RUN") == "1":
        od.initialize(backend)
        try:
            main(0, out_dir, name)
        finally:
            od.finalize()
    else:
        # forked from this process, which has torch loaded: the cases are about the calls, not
        # how a worker starts (test_launch and test_spawn_page start them the other ways). Not
        # "hang", whose signal must reach workers as Parallel starts them by default: forked, rank
        # 1 was once woken by rank 0's failure before its own signal, and showed that line instead
        start_method = "spawn" if name == "hang" else "fork"
        with od.Parallel(backend, nproc_per_node=2, start_method=start_method) as parallel:
            parallel.run(main, out_dir, name)
