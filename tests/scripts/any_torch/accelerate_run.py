"""Accelerate on CPU under torchrun: ``accelerate_run.py BACKEND ROUTE STEPS [WIDTH]``.

ROUTE ``kwargs``: ``Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend=BACKEND)])``;
``preinit``: ``dist.init_process_group(BACKEND)`` first, which Accelerate adopts. Prints, per
rank, ``rank R loss L params P`` and ``rank R step_ms T`` as lightning_run.py, or ``rank R
refused: ...`` when Accelerate rejects the backend.
"""

import itertools
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, set_seed
from torch.utils.data import DataLoader, TensorDataset

backend, route, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
width = int(sys.argv[4]) if len(sys.argv) > 4 else 32
if route == "preinit":
    dist.init_process_group(backend)
handlers = [InitProcessGroupKwargs(backend=backend)] if route == "kwargs" else []
try:
    accelerator = Accelerator(cpu=True, kwargs_handlers=handlers)
except ValueError as e:
    print(f"rank {os.environ['RANK']} refused: {e}|", flush=True)
    sys.exit(0)
set_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
data = TensorDataset(torch.randn(64 * steps, 32), torch.randn(64 * steps, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=16))
times, last = [], float("nan")
for _, (x, y) in zip(range(steps), loader):
    times.append(time.perf_counter())
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    last = loss.item()
rank = accelerator.process_index
assert dist.get_backend() == backend
params = sum(p.detach().double().sum().item() for p in model.parameters())
print(f"rank {rank} loss {last!r} params {params!r}|", flush=True)
gaps = [b - a for a, b in itertools.pairwise(times[2:])]  # the first steps warm up
print(f"rank {rank} step_ms {statistics.median(gaps) * 1e3 if gaps else float('nan'):.3f}|", flush=True)
accelerator.end_training()  # destroys the process group
