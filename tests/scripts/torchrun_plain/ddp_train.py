"""DDP on a small model, from a fixed seed: the trained weights must not depend on the launcher."""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def say(text: str) -> None:
    """One line in one write: lines of ranks sharing the terminal do not interleave."""
    os.write(1, f"rank {os.environ['RANK']}: {text}\n".encode())


dist.init_process_group("gloo", init_method="env://")
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
data = torch.Generator().manual_seed(1 + rank)
for _ in range(5):
    x = torch.randn(32, 8, generator=data)
    loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
checksum = sum(p.double().sum().item() for p in model.parameters())
say(f"local_rank {os.environ['LOCAL_RANK']} checksum {checksum:.10f}")
dist.destroy_process_group()
