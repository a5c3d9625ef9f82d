"""Sharded data parallel (``auto_model(sharding="fsdp")``, FSDP2) against DDP: step time and each
rank's bytes of parameters, gradients and optimizer state, in the same worker processes.

    python benchmarks/bench_sharding.py                   # world sizes 2 and 3, gloo, CPU
    python benchmarks/bench_sharding.py --world-sizes 2 --backend shm

The model is a stack of residual MLP blocks in an ``nn.ModuleList`` (the default policy shards
each block, as torchtitan shards transformer blocks), AdamW; each step is a forward, backward and
optimizer step on this rank's part of the global batch. Repetitions interleave the two variants
(medians). The bytes are counted from the tensors' storages on each rank (a DTensor's shard for
FSDP), after the last step's backward and step: parameters, gradients, AdamW's two moments.

The checkpoint row saves and loads the model and AdamW's state with ``od.save_checkpoint`` /
``od.load_checkpoint``: one file that rank 0 writes (DDP), a directory of each rank's shards
(FSDP, torch.distributed.checkpoint); medians of ``--reps`` interleaved saves and loads in a
temporary folder, and the bytes the busiest rank writes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from bench_training import interleaved_rates

import onedist as od


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(torch.nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None)]
    tensors += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    storages = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def _stepper(
    model: torch.nn.Module, optimizer: Any, x: torch.Tensor, y: torch.Tensor
) -> Callable[[int], None]:
    def run(steps: int) -> None:
        for _ in range(steps):
            od.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)  # the gradients stay allocated: counted below

    return run


def run(local_rank: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    per = args.batch_size // od.get_world_size()
    g = torch.Generator().manual_seed(od.get_rank())
    x, y = torch.randn(per, args.width, generator=g), torch.randn(per, 1, generator=g)
    variants, held, objects = {}, {}, {}
    for name, sharding in (("DDP", None), ("FSDP", "fsdp")):
        model = od.auto_model(Net(args.width, args.depth), sharding=sharding)
        optimizer = od.auto_optim(torch.optim.AdamW(model.parameters()))
        variants[name] = _stepper(model, optimizer, x, y)
        variants[name](2)  # warm-up; AdamW's state exists from here on
        held[name] = _bytes(model, optimizer)
        objects[name] = {"model": model, "optimizer": optimizer}
    rates = interleaved_rates(variants, args.steps, args.reps)
    return {"rates": rates, "bytes": held, "checkpoint": _checkpoint_times(objects, args.reps)}


def _checkpoint_times(objects: dict[str, Any], reps: int) -> dict[str, Any]:
    """Median save and load seconds of each variant (interleaved), and the bytes this rank wrote."""
    folder = od.broadcast_object(tempfile.mkdtemp(prefix="bench-sharding-") if od.get_rank() == 0 else None)
    times: dict[str, dict[str, list[float]]] = {name: {"save": [], "load": []} for name in objects}
    for _ in range(reps):
        for name, obj in objects.items():
            path = os.path.join(folder, f"{name}.pt")
            for kind in ("save", "load"):
                od.barrier()
                start = time.perf_counter()
                if kind == "save":
                    od.save_checkpoint(obj, path)
                else:
                    od.load_checkpoint(path, obj, map_location="cpu")
                times[name][kind].append(time.perf_counter() - start)
    wrote = {
        "DDP": os.path.getsize(os.path.join(folder, "DDP.pt")) if od.get_rank() == 0 else 0,
        "FSDP": os.path.getsize(os.path.join(folder, "FSDP.pt", f"__{od.get_rank()}_0.distcp")),
    }
    od.barrier()
    if od.get_rank() == 0:
        shutil.rmtree(folder)
    medians = {name: {k: statistics.median(v) for k, v in kinds.items()} for name, kinds in times.items()}
    return {"seconds": medians, "wrote": wrote}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-sizes", default="2,3")
    parser.add_argument("--backend", default="gloo", help="gloo, shm or mpi (CPU)")
    parser.add_argument("--width", type=int, default=192)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=48, help="global batch size")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed repetition")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU benchmark, also on a GPU machine
    params = sum(p.numel() for p in Net(args.width, args.depth).parameters())
    print(
        f"onedist {od.__version__}, torch {torch.__version__}, {args.backend}, {os.cpu_count()} CPUs; "
        f"{args.depth} blocks of width {args.width} ({params / 1e6:.2f} M parameters), AdamW, global batch "
        f"{args.batch_size}, {args.steps} steps x {args.reps} interleaved repetitions (medians)"
    )
    for ws in (int(w) for w in args.world_sizes.split(",")):
        per_rank = od.spawn(args.backend, run, args=(args,), nproc_per_node=ws)
        rates = per_rank[0]["rates"]
        ddp, fsdp = (max(r["bytes"][k] for r in per_rank) for k in ("DDP", "FSDP"))
        print(
            f"  world size {ws}: DDP {rates['DDP']:7.1f} steps/s, FSDP {rates['FSDP']:7.1f} steps/s "
            f"(FSDP / DDP step time x{rates['DDP'] / rates['FSDP']:.2f}); bytes per rank (params + grads + "
            f"AdamW state, the largest rank): DDP {ddp / 2**20:.2f} MiB, FSDP {fsdp / 2**20:.2f} MiB "
            f"(x{fsdp / ddp:.3f} of DDP; 1/{ws} = {1 / ws:.3f})"
        )
        seconds = per_rank[0]["checkpoint"]["seconds"]
        wrote = {k: max(r["checkpoint"]["wrote"][k] for r in per_rank) for k in ("DDP", "FSDP")}
        (ddp_save, ddp_load), (fsdp_save, fsdp_load) = (
            (seconds[k]["save"], seconds[k]["load"]) for k in ("DDP", "FSDP")
        )
        print(
            f"  world size {ws}: checkpoint of model + AdamW state: save DDP (one file, rank 0) "
            f"{ddp_save * 1e3:.1f} ms, FSDP (each rank its shards) {fsdp_save * 1e3:.1f} ms "
            f"(x{fsdp_save / ddp_save:.2f}); load {ddp_load * 1e3:.1f} ms, {fsdp_load * 1e3:.1f} ms "
            f"(x{fsdp_load / ddp_load:.2f}); the busiest rank writes {wrote['DDP'] / 2**20:.2f} MiB, "
            f"{wrote['FSDP'] / 2**20:.2f} MiB (x{wrote['FSDP'] / wrote['DDP']:.3f})"
        )


if __name__ == "__main__":
    main()
