"""A script that talks to the launcher's rendezvous store itself, beside the process group."""

import os
from datetime import timedelta

import torch.distributed as dist


def say(text: str) -> None:
    """One line in one write: lines of ranks sharing the terminal do not interleave."""
    os.write(1, f"rank {os.environ['RANK']}: {text}\n".encode())


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
# a client of the rendezvous store at MASTER_ADDR:MASTER_PORT: torchrun's agent hosts it
store = dist.TCPStore(
    os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=60)
)
store.set(f"plain/{rank}", f"hello from {rank}")
store.wait([f"plain/{r}" for r in range(world)])
say(", ".join(store.get(f"plain/{r}").decode() for r in range(world)))
dist.barrier()  # every rank read every key before anyone leaves
dist.destroy_process_group()
