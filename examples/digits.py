"""Train a small CNN on scikit-learn's handwritten digits (1,797 8x8 images, bundled: no download).

The only distributed lines are onedist's; the same file runs on every backend and launcher:

    python examples/digits.py --backend none                     # one process, no process group
    python examples/digits.py --nproc-per-node 2                 # spawns 2 workers (gloo on CPU)
    onedist run -n 2 examples/digits.py
    torchrun --nproc-per-node 2 examples/digits.py
    srun -n 2 python examples/digits.py                          # SLURM
    mpirun -np 2 python examples/digits.py                       # Open MPI
    python examples/digits.py --backend shm --nproc-per-node 4   # shared memory (one host)
    python examples/digits.py --nproc-per-node 2 --accumulate 4 --precision bf16-mixed
    python examples/digits.py --nproc-per-node 2 --sharding fsdp      # FSDP2: 1/2 of the model per rank
    python examples/digits.py --nproc-per-node 3 --uneven        # ranks with fewer batches: od.join
    python examples/digits.py --nproc-per-node 2 --log-dir runs  # metrics to runs/metrics.csv (+ TensorBoard)
    python examples/digits.py --backend nccl --nproc-per-node 4  # GPUs
    mpirun -np 3 python examples/digits.py --backend mpi         # MPI itself (mpi4py)
    horovodrun -np 2 -H localhost:2 --gloo python examples/digits.py --backend horovod
    PJRT_DEVICE=CPU python examples/digits.py --backend xla-tpu  # torch_xla (XLA device)

It prints the loss, exact test accuracy and the job's samples/s per epoch (rank 0), with one
progress display for the job on stderr (od.progress), checks at the end that every rank holds the
same parameters, and exits non-zero when they differ or when the final test accuracy is below
--target (0.95).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import onedist as od


def load_digits() -> tuple[Any, Any]:
    """scikit-learn's digits as ``sklearn.datasets.load_digits()`` gives them: images (N x 8 x 8,
    values 0-16) and labels. Read from the file scikit-learn ships: importing sklearn.datasets
    (scipy, pandas) costs every worker ~2 CPU-s, more than importing torch."""
    sklearn = importlib.util.find_spec("sklearn")  # found, not imported
    if sklearn is None:
        raise ImportError("examples/digits.py needs scikit-learn: pip install scikit-learn")
    path = Path(sklearn.origin or "").parent / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():  # a scikit-learn that keeps it elsewhere
        from sklearn.datasets import load_digits as sklearn_digits

        digits = sklearn_digits()
        return digits.images, digits.target
    import numpy as np  # scikit-learn's dependency

    data = np.loadtxt(path, delimiter=",")  # 64 pixels, then the label, per row
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


def datasets(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    images, labels = load_digits()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0  # N x 1 x 8 x 8, in [0, 1]
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    test, train = order[:360], order[360:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 64 x 4 x 4
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.2), nn.Linear(64 * 16, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def flops_per_batch(batch_size: int) -> int:
    """The FLOPs of one training step (forward and backward) on ``batch_size`` samples, counted on
    the meta device: nothing is computed."""
    with torch.device("meta"):
        net, x, y = Net(), torch.empty(batch_size, 1, 8, 8), torch.zeros(batch_size, dtype=torch.long)
    return od.measure_flops(net, x, loss_fn=lambda out: F.cross_entropy(out, y))


def evaluate(model: nn.Module, loader: Any) -> float:
    model.eval()
    preds, targets = [], []
    with torch.no_grad():
        for x, y in loader:
            preds.append(model(x.to(od.device())).argmax(1).cpu())
            targets.append(y.cpu())  # a device loader (XLA) gives batches on the device
    # every test sample exactly once, in dataset order, on every rank
    gathered = od.all_gather_eval({"pred": torch.cat(preds), "target": torch.cat(targets)}, loader)
    return (gathered["pred"] == gathered["target"]).double().mean().item()


def train_epoch(
    model: nn.Module, optimizer: Any, scheduler: Any, loader: Any, epoch: int, args: Any, throughput: Any
) -> Any:
    """One pass over this rank's share of the data (the rest of it, in a resumed epoch)."""
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64)
    seen = 0
    steps = len(loader) if args.max_steps is None else min(len(loader), args.max_steps)
    first = args.step - (epoch - 1) * steps  # > 0 when this epoch resumes from a checkpoint
    if args.uneven:  # as a sharded stream would: rank r gets world_size - 1 - r batches fewer
        steps -= od.get_world_size() - 1 - od.get_rank()
    # od.join: a rank out of batches answers the others' collectives until every rank is done
    joined = od.join(model, optimizer, scheduler) if args.uneven else contextlib.nullcontext()
    with joined:
        # the job's progress on rank 0 (every rank's batches), nothing on the others
        bar = od.progress(loader, desc=f"epoch {epoch}", unit="batch")
        for i, (x, y) in enumerate(bar, start=first):  # reshuffles every epoch
            if i == steps:
                break
            loss = train_step(model, optimizer, scheduler, x, y, i, steps, args)
            loss_sum += loss.detach().double().cpu() * len(y)
            seen += len(y)
            bar.set_postfix(loss=loss.detach())  # this rank's; read when shown
            throughput.update(len(y))  # counted here, exchanged once at the epoch's end
            args.step += 1  # batches done (a checkpoint falls on a window's end: every % k == 0)
            if args.checkpoint_every and args.step % args.checkpoint_every == 0 and i + 1 < steps:
                save_state(model, optimizer, scheduler, loader, args)  # the epoch's end saves below
    return od.all_reduce({"loss": loss_sum, "seen": seen})  # one collective for both


def train_step(
    model: nn.Module, optimizer: Any, scheduler: Any, x: Any, y: Any, i: int, steps: int, args: Any
) -> torch.Tensor:
    """Batch ``i`` of the epoch's ``steps``: its forward and backward pass, and the optimizer step
    at the end of a window of ``args.accumulate`` batches (fewer at the epoch's end)."""
    k = args.accumulate
    x, y = x.to(od.device()), y.to(od.device())
    window = min(k, steps - (i - i % k))
    last = i % k == window - 1
    with od.no_sync(model, enabled=not last):  # one gradient exchange per window
        loss = F.cross_entropy(model(x), y)
        od.backward(loss / window)  # the gradient of the window's mean loss
    if last:
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return loss


def save_state(model: nn.Module, optimizer: Any, scheduler: Any, loader: Any, args: Any) -> None:
    if args.checkpoint_dir:
        sampler = loader.sampler if isinstance(loader.sampler, od.DistributedSampler) else None
        od.save_training_state(
            args.checkpoint_dir,
            args.step,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            sampler=sampler,
        )


def training(local_rank: int, args: argparse.Namespace) -> float:
    torch.manual_seed(args.seed)
    train_set, test_set = datasets()
    train_loader = od.auto_dataloader(train_set, batch_size=args.batch_size, shuffle=True)
    test_loader = od.auto_dataloader(test_set, batch_size=256, evaluation=True)
    # onedist's SyncBatchNorm runs on any device (auto_model's sync_bn=True is torch's, CUDA only)
    net = od.convert_sync_batchnorm(Net()) if args.sync_bn else Net()
    model = od.auto_model(net, precision=args.precision, sharding=args.sharding)
    optimizer = od.auto_optim(torch.optim.AdamW(model.parameters(), lr=args.lr))
    optimizer_steps = -(-len(train_loader) // args.accumulate)  # per epoch
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, epochs=args.epochs, steps_per_epoch=optimizer_steps
    )
    args.step = 0  # batches done
    if args.checkpoint_dir:  # 0 on a fresh start; after a restart, the newest checkpoint's step
        sampler = train_loader.sampler if isinstance(train_loader.sampler, od.DistributedSampler) else None
        args.step = od.resume(
            args.checkpoint_dir, model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler
        )
    if od.is_main_process():
        if args.step:
            print(f"resumed from step {args.step} (restart {od.restart_count()})", flush=True)
        od.show_config()
        print(
            f"train {len(train_set)} / test {len(test_set)} samples, global batch {args.batch_size}"
            f" x {args.accumulate} accumulated, precision {args.precision}",
            flush=True,
        )
    accuracy = None
    log_dir = getattr(args, "log_dir", None)
    if log_dir:  # rank 0 writes; TensorBoard too when it is installed
        board = [od.TensorBoardLogger(log_dir)] if importlib.util.find_spec("tensorboard") else []
        od.loggers(od.CSVLogger(log_dir), *board)  # flushed and closed at exit, after a failure too
    per_rank_batch = args.batch_size // od.get_world_size()
    for epoch in range(args.step // len(train_loader) + 1, args.epochs + 1):
        start = time.perf_counter()
        throughput = od.Throughput(every=None, flops_per_batch=flops_per_batch(per_rank_batch))
        totals = train_epoch(model, optimizer, scheduler, train_loader, epoch, args, throughput)
        rates = throughput.compute()  # one small collective: every rank's samples
        accuracy = evaluate(model, test_loader)
        save_state(model, optimizer, scheduler, train_loader, args)  # after evaluate: its RNG draw too
        loss = float(totals["loss"]) / max(1, totals["seen"])
        od.log_metrics({"train_loss": loss, "test_accuracy": accuracy, **rates.as_dict()}, step=epoch)
        if od.is_main_process():
            print(
                f"epoch {epoch:2d}  train loss {loss:.4f}  test accuracy {accuracy:.4f}  "
                f"({time.perf_counter() - start:.1f} s, {rates.samples_per_s:.0f} samples/s)",
                flush=True,
            )
    if accuracy is None:  # resumed from the last epoch's checkpoint: nothing left to train
        accuracy = evaluate(model, test_loader)
    if args.save_final:  # a sharded model is gathered for rank 0 to write
        od.save_checkpoint({"model": od.full_state_dict(model) if args.sharding else model}, args.save_final)
    # every rank must hold the same model: compare a checksum of the parameters across ranks
    whole = (getattr(p, "full_tensor", lambda p=p: p)() for p in od.unwrap(model).parameters())
    checksum = float(sum(p.detach().double().sum().cpu() for p in whole))
    checksums = od.all_gather(checksum)
    same = len(set(checksums)) == 1
    if od.is_main_process():
        verdict = "identical" if same else f"DIFFERENT {checksums}"
        print(f"parameters {verdict} on {len(checksums)} process(es)", flush=True)
        print(f"final test accuracy {accuracy:.4f} over {od.get_world_size()} process(es)", flush=True)
    return accuracy if same else -1.0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--backend",
        default="auto",
        help="gloo, nccl, shm, mpi, xla-tpu, auto, or none (serial); see onedist info",
    )
    parser.add_argument("--nproc-per-node", type=int, default=None, help="workers to spawn (no launcher)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--sync-bn", action="store_true", help="synchronise BatchNorm statistics over ranks")
    parser.add_argument(
        "--accumulate", type=int, default=1, help="batches per optimizer step (gradient accumulation)"
    )
    parser.add_argument(
        "--precision", default="32", help="32, bf16-mixed, or 16-mixed (CUDA): auto_model's precision"
    )
    parser.add_argument("--sharding", default=None, help="fsdp: shard the model over the ranks (FSDP2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=None, help="stop each epoch after this many steps")
    parser.add_argument("--target", type=float, default=0.95, help="exit 1 below this final test accuracy")
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="save the training state here at each epoch's end and resume from the newest one "
        "(onedist run --max-restarts N restarts the workers after a failure)",
    )
    parser.add_argument("--checkpoint-every", type=int, default=0, help="also save every K steps (0: no)")
    parser.add_argument("--save-final", default=None, help="write the final model's state dict here")
    parser.add_argument(
        "--uneven", action="store_true", help="rank r trains on world_size - 1 - r batches fewer (od.join)"
    )
    parser.add_argument(
        "--log-dir",
        default=None,
        help="log each epoch's metrics to DIR/metrics.csv (and TensorBoard if installed)",
    )
    args = parser.parse_args()
    if args.checkpoint_dir and args.max_steps is not None:
        parser.error("--max-steps cannot be combined with --checkpoint-dir (a cut epoch cannot be resumed)")
    if args.checkpoint_every < 0:
        parser.error(f"--checkpoint-every={args.checkpoint_every} is not allowed; allowed: an int >= 0")
    if args.accumulate < 1:
        parser.error(f"--accumulate={args.accumulate} is not allowed; allowed: an int >= 1")
    if args.checkpoint_every % args.accumulate:
        parser.error(
            f"--checkpoint-every={args.checkpoint_every} is not allowed with --accumulate={args.accumulate}; "
            "allowed: a multiple of --accumulate (a checkpoint falls between two windows)"
        )
    if args.uneven and (args.checkpoint_dir or args.sharding):
        parser.error("--uneven cannot be combined with --checkpoint-dir or --sharding (see od.join)")
    backend = None if args.backend in ("none", "serial") else args.backend
    with od.Parallel(backend=backend, nproc_per_node=args.nproc_per_node) as parallel:
        accuracy = parallel.run(training, args)
    return 0 if accuracy >= args.target else 1


if __name__ == "__main__":
    sys.exit(main())
