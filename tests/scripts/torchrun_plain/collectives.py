"""torch's env:// path, default and new groups, collectives and point-to-point, as a user writes them."""

import os

import torch
import torch.distributed as dist


def say(text: str) -> None:
    """One line in one write: lines of ranks sharing the terminal do not interleave."""
    os.write(1, f"rank {os.environ['RANK']}: {text}\n".encode())


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
say(f"all_reduce {t.item()}")
b = torch.tensor([rank * 10])
dist.broadcast(b, src=world - 1)
say(f"broadcast {b.item()}")
parts = [torch.zeros(2) for _ in range(world)]
dist.all_gather(parts, torch.full((2,), float(rank)))
say(f"all_gather {[p.tolist() for p in parts]}")
objs = [None] * world
dist.all_gather_object(objs, {"rank": rank, "name": f"r{rank}"})
say(f"all_gather_object {objs}")
evens = dist.new_group(list(range(0, world, 2)))
if rank % 2 == 0:
    e = torch.tensor([1])
    dist.all_reduce(e, group=evens)
    say(f"evens {e.item()}")
if world > 1:
    if rank == 0:
        dist.send(torch.tensor([42]), dst=1)
    elif rank == 1:
        got = torch.zeros(1, dtype=torch.int64)
        dist.recv(got, src=0)
        say(f"recv {got.item()}")
dist.barrier()
dist.destroy_process_group()
say("done")
