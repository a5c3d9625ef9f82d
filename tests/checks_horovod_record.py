"""Programs run on every rank of ``horovodrun -np 2 --gloo`` by tests/test_horovod_record.py: raw
``hvd.*`` calls (and ``hvd.DistributedOptimizer``'s) on record, compared across ranks.

``python -c "import checks_horovod_record as c; c.main('alone')"``; each case marks the lines the
reports must name with a ``# site: <name>`` comment (:func:`site_line` finds them).
"""

from __future__ import annotations

import sys
import time

import torch

import onedist as od


def site_line(name: str) -> int:
    """The line of this file marked ``# site: name``."""
    with open(__file__, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.rstrip().endswith(f"# site: {name}"):
                return n
    raise LookupError(name)


def main(case: str) -> None:
    import horovod.torch as hvd

    od.initialize("horovod")
    rank = od.get_rank()
    t = torch.ones(4)
    hvd.allreduce(t)  # a few calls both ranks make: numbered alike
    od.all_reduce(t)
    hvd.broadcast_(t, 0)
    finalized = globals()[f"_case_{case}"](hvd, rank, t)
    print(f"rank {rank}: {case} done", flush=True)
    if not finalized:
        od.finalize()


def _case_alone(hvd, rank: int, t: torch.Tensor) -> None:
    if rank == 1:
        hvd.allreduce(t)  # site: alone
    else:
        od.barrier()  # site: barrier


def _case_other_op(hvd, rank: int, t: torch.Tensor) -> None:
    if rank == 1:
        hvd.allreduce(t, op=hvd.Sum)  # site: allreduce
    else:
        hvd.allgather(t)  # site: allgather


def _case_optimizer(hvd, rank: int, t: torch.Tensor) -> None:
    """Rank 0 skips the second step and goes on to od.barrier; rank 1's gradients wait for it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(2):
        if rank == 0 and step == 1:
            break
        opt.zero_grad()
        model(torch.ones(3, 4)).sum().backward()  # site: backward
        opt.step()
    od.barrier()  # site: optimizer barrier


def _case_slow(hvd, rank: int, t: torch.Tensor) -> None:
    """Rank 1 sleeps while rank 0 waits in hvd.allreduce: a stall report, then both go on."""
    if rank == 1:
        time.sleep(9)  # site: sleep
    hvd.allreduce(t)  # site: waits


def _case_join(hvd, rank: int, t: torch.Tensor) -> None:
    """Uneven data: rank 1 makes three more allreduces before hvd.join (rank 0 waits there); after
    the join the ranks are numbered alike again, and a lone call is a mismatch."""
    if rank == 1:
        time.sleep(6)
        for _ in range(3):
            hvd.allreduce(t, name="metric")
    hvd.join()  # site: join
    od.all_reduce(t)
    if rank == 1:
        hvd.allgather(t)  # site: after join
    else:
        od.barrier()  # site: barrier after join


def _case_restored(hvd, rank: int, t: torch.Tensor) -> bool:
    """The functions are wrapped while onedist's Horovod context lives, Horovod's own again after."""
    import horovod.torch.mpi_ops as mpi_ops

    assert hasattr(mpi_ops._allreduce_async, "__wrapped__")
    assert hasattr(mpi_ops.mpi_lib.horovod_torch_barrier, "__wrapped__")
    od.finalize()
    assert not hasattr(mpi_ops._allreduce_async, "__wrapped__")
    assert not hasattr(mpi_ops.mpi_lib.horovod_torch_barrier, "__wrapped__")
    return True


def _case_off(hvd, rank: int, t: torch.Tensor) -> None:
    """ONEDIST_RECORD=0: nothing wrapped."""
    import horovod.torch.mpi_ops as mpi_ops

    assert not hasattr(mpi_ops._allreduce_async, "__wrapped__")


if __name__ == "__main__":
    main(sys.argv[1])
