"""A plain torch script for torchrun (or mpirun) that names onedist's backend, never onedist.

The default group is ``shm`` (or argv[1]); a gloo group over the same ranks computes everything
again, and each rank prints ``rank R ok ...|`` when both agree bit for bit (``|`` ends what a rank says:
the ranks share torchrun's output pipe, and one rank's line may land inside another's).
"""

import os
import sys

import torch
import torch.distributed as dist

if "RANK" not in os.environ:  # mpirun: torch's env:// rendezvous from Open MPI's variables
    os.environ["RANK"] = os.environ["OMPI_COMM_WORLD_RANK"]
    os.environ["WORLD_SIZE"] = os.environ["OMPI_COMM_WORLD_SIZE"]
    os.environ["MASTER_ADDR"] = "127.0.0.1"  # MASTER_PORT: the caller's
# torch registered the name at `import torch`, importing no more of onedist than that
assert "onedist.backends" not in sys.modules, sorted(m for m in sys.modules if m.startswith("onedist"))
dist.init_process_group(sys.argv[1] if len(sys.argv) > 1 else "shm")
rank, world = dist.get_rank(), dist.get_world_size()
gloo = dist.new_group(backend="gloo")


def collectives(group: dist.ProcessGroup) -> list[torch.Tensor]:
    x = torch.arange(1000, dtype=torch.float32) * (rank + 1) / 7
    dist.all_reduce(x, group=group)
    parts = [torch.empty(3, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(parts, torch.full((3,), rank + 0.5, dtype=torch.float64), group=group)
    b = torch.randn(17, generator=torch.Generator().manual_seed(rank))
    dist.broadcast(b, src=1, group=group)
    return [x, *parts, b]


def ddp_step(group: dist.ProcessGroup) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    ddp(data).square().mean().backward()
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


default = dist.group.WORLD
assert default is not None
for name, fn in (("collectives", collectives), ("ddp", ddp_step)):
    ours, theirs = fn(default), fn(gloo)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), f"rank {rank}: {name} differs from gloo"
print(f"rank {rank} ok backend={dist.get_backend()} world={world}|", flush=True)
dist.destroy_process_group()
