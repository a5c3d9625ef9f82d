"""Lightning DDP on CPU under torchrun: ``lightning_run.py BACKEND STEPS [WIDTH]``.

Prints, per rank, ``rank R loss L params P`` (the last step's loss and a checksum of the weights)
and ``rank R step_ms T`` (median time of the steps after the first two).
"""

import itertools
import statistics
import sys
import time

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

backend, steps = sys.argv[1], int(sys.argv[2])
width = int(sys.argv[3]) if len(sys.argv) > 3 else 32


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
        self.times: list[float] = []
        self.last = float("nan")

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.last = loss.item()
        return loss

    def on_train_batch_start(self, batch: object, index: int) -> None:
        self.times.append(time.perf_counter())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


L.seed_everything(0, verbose=False)
data = TensorDataset(torch.randn(64 * steps, 32), torch.randn(64 * steps, 1))
model = Model()
trainer = L.Trainer(
    accelerator="cpu",
    devices=2,
    strategy=DDPStrategy(process_group_backend=backend),
    max_steps=steps,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(model, DataLoader(data, batch_size=16))
rank = trainer.global_rank
params = sum(p.detach().double().sum().item() for p in model.parameters())
assert torch.distributed.get_backend() == backend
print(f"rank {rank} loss {model.last!r} params {params!r}|", flush=True)
gaps = [b - a for a, b in itertools.pairwise(model.times[2:])]  # the first steps warm up
torch.distributed.destroy_process_group()  # before exit: a live gloo group may abort teardown
print(f"rank {rank} step_ms {statistics.median(gaps) * 1e3 if gaps else float('nan'):.3f}|", flush=True)
