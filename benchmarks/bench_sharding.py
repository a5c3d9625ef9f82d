"""Sharded data parallel (``auto_model(sharding="fsdp")``, FSDP2) against DDP: step time and each
rank's bytes of parameters, gradients and optimizer state, in the same worker processes.

    python benchmarks/bench_sharding.py                   # the large model, then the small one
    python benchmarks/bench_sharding.py --parts small --world-sizes 2 --backend shm
    python benchmarks/bench_sharding.py --parts large --tune     # + FSDP2's other choices
    python benchmarks/bench_sharding.py --parts memory           # activation checkpointing, bf16-true
    python benchmarks/bench_sharding.py --parts exchange --reps 9   # one 100 MB gather and scatter
    python benchmarks/bench_sharding.py --parts heap              # glibc's heap: time and memory

The model is a stack of residual MLP blocks in an ``nn.ModuleList`` (the default policy shards
each block, as torchtitan shards transformer blocks), AdamW; each step is a forward, backward and
optimizer step on this rank's part of the global batch. Repetitions interleave the two variants
(medians). The bytes are counted from the tensors' storages on each rank (a DTensor's shard for
FSDP), after the last step's backward and step: parameters, gradients, AdamW's two moments.

The large part (issue 52): 6 blocks of width 1024 (50.4 M parameters) on 2 ranks: DDP, onedist's
sharded step, Lightning Fabric's (``ModelParallelStrategy`` + ``fully_shard`` per block and root),
onedist's on a plain gloo mesh and on a group of its own without the reads between local ranks
(``ONEDIST_CMA=0``), interleaved (``--tune``: FSDP2's other choices, then all again in workers
with glibc's default heap, ``ONEDIST_CPU_HEAP=0``); each repetition's time over DDP's and Fabric's
(median and range) and rank 0's CPU time a step. The memory part: each rank's peak RSS with
activation checkpointing and bf16-true against the plain sharded run.

The small part: the checkpoint row saves and loads the model and AdamW's state with
``od.save_checkpoint`` / ``od.load_checkpoint``: one file that rank 0 writes (DDP), a directory of
each rank's shards (FSDP, torch.distributed.checkpoint); medians of ``--reps`` interleaved saves and
loads in a temporary folder, and the bytes the busiest rank writes.
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
from unittest.mock import patch

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


def _rank_batch(batch_size: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of a global batch of ``batch_size`` random samples (its own seed)."""
    per = batch_size // od.get_world_size()
    g = torch.Generator().manual_seed(od.get_rank())
    return torch.randn(per, width, generator=g), torch.randn(per, 1, generator=g)


def run(local_rank: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    x, y = _rank_batch(args.batch_size, args.width)
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


# ---------------------------------------------------------------------------- the large model (issue 52)
def _fabric_stepper(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor) -> Callable[[int], None]:
    """Lightning Fabric's FSDP2 step, as its docs write it: ``ModelParallelStrategy`` with a
    ``parallelize_fn`` that calls ``fully_shard`` on each block, then on the root; ``fabric.backward``.
    Its mesh is on a plain gloo group (``backend="gloo"`` named: not on onedist's record), which is
    what a Fabric user has: only the process group is shared with onedist's workers."""
    import torch.distributed as dist
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(dist.new_group(backend="gloo"), "cpu")

    def parallelize(model: torch.nn.Module, _: Any) -> torch.nn.Module:
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    ws = od.get_world_size()
    strategy = ModelParallelStrategy(parallelize, data_parallel_size=ws, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=ws, strategy=strategy)
    fabric.launch()  # the processes exist (LOCAL_RANK is set): Fabric joins onedist's group
    model = fabric.setup_module(Net(args.width, args.depth))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))

    def run(steps: int) -> None:
        for _ in range(steps):
            fabric.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)

    return run


def _prefetch(model: torch.nn.Module) -> None:
    """FSDP2's explicit prefetch: each block asks for the next block's all-gather in the forward
    (the previous block's in the backward) before it computes."""
    blocks = list(od.unwrap(model).blocks)
    for i, block in enumerate(blocks):
        if i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch([blocks[i + 1]])
        if i > 0:
            block.set_modules_to_backward_prefetch([blocks[i - 1]])


def _large_variants(
    args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor
) -> dict[str, Callable[[int], None]]:
    """DDP, onedist's sharded step, Fabric's, onedist's on a plain gloo group; with ``--tune`` FSDP2's
    other choices on onedist."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    def onedist(
        sharding: Any = "fsdp", prefetch: bool = False, last_kept: bool = False, **options: Any
    ) -> Callable[[int], None]:
        model = od.auto_model(Net(args.width, args.depth), sharding=sharding, **options)
        if prefetch:
            _prefetch(model)
        if last_kept:  # torchtitan's choice: the backward gathers the last block again at once
            od.unwrap(model).blocks[-1].set_reshard_after_forward(False)
        return _stepper(model, od.auto_optim(torch.optim.AdamW(model.parameters())), x, y)

    variants = {"DDP": onedist(None), "onedist": onedist()}
    try:  # the test extra installs lightning; without it the Fabric row is left out
        variants["Fabric"] = _fabric_stepper(args, x, y)
    except ImportError:
        pass
    # onedist's step on torch's plain gloo group (what Fabric has): what onedist's group adds
    plain = DeviceMesh.from_group(dist.new_group(backend="gloo"), "cpu")
    variants["onedist, plain gloo mesh"] = onedist(mesh=plain)
    # onedist's group without the reads between local ranks: the exchanges through gloo's sockets
    with patch.dict(os.environ, {"ONEDIST_CMA": "0"}):  # a recorded group: its links read it now
        sockets = DeviceMesh.from_group(dist.new_group(), "cpu")
    variants["onedist, ONEDIST_CMA=0"] = onedist(mesh=sockets)
    if args.tune:
        variants["onedist, prefetch"] = onedist(prefetch=True)
        variants["onedist, last block kept after the forward"] = onedist(last_kept=True)
        variants["onedist, reshard_after_forward=False"] = onedist(reshard_after_forward=False)
        variants["onedist, root only"] = onedist(policy=lambda m: False)
    return variants


def run_large(local_rank: int, args: argparse.Namespace) -> dict[str, Any]:
    """Each variant's seconds and CPU seconds a step, per interleaved repetition."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    x, y = _rank_batch(args.large_batch_size, args.width)
    variants = _large_variants(args, x, y)
    for step in variants.values():
        step(2)  # warm-up; AdamW's state exists from here on
    wall: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for rep in range(args.reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            variants[name](args.large_steps)
            dist.barrier()
            wall[name].append((time.perf_counter() - t0) / args.large_steps)
            cpu[name].append((time.process_time() - c0) / args.large_steps)
    return {"wall": wall, "cpu": cpu}


def report_large(args: argparse.Namespace) -> None:
    """The large model's step times and their ratios (per repetition, then the median)."""
    params = sum(p.numel() for p in Net(args.width, args.depth).parameters())
    print(
        f"large: {args.depth} blocks of width {args.width} ({params / 1e6:.1f} M parameters), AdamW, global "
        f"batch {args.large_batch_size}, {args.large_steps} steps x {args.reps} interleaved repetitions, "
        f"{args.backend}, world size 2; load average {os.getloadavg()[0]:.1f} at the start"
    )
    _print_large(od.spawn(args.backend, run_large, args=(args,), nproc_per_node=2)[0])
    if args.tune:  # glibc's default heap: each step's gathered buffers fresh from the kernel
        print("  the same with ONEDIST_CPU_HEAP=0 (a run of its own: glibc's setting is the process's)")
        with patch.dict(os.environ, {"ONEDIST_CPU_HEAP": "0"}):
            _print_large(od.spawn(args.backend, run_large, args=(args,), nproc_per_node=2)[0])
    print(f"  load average {os.getloadavg()[0]:.1f} at the end")


def _print_large(out: dict[str, Any]) -> None:
    """Each variant's median step, its ratios to DDP and Fabric (per repetition, then the median)."""
    wall, cpu = out["wall"], out["cpu"]
    for name in wall:
        ratios = []
        for base in [b for b in ("DDP", "Fabric") if b in wall]:  # per repetition, timed together
            r = [a / b for a, b in zip(wall[name], wall[base])]
            ratios.append(f"/ {base} x{statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})")
        print(
            f"  {name:38s} {statistics.median(wall[name]) * 1e3:7.1f} ms a step (rank 0 CPU "
            f"{statistics.median(cpu[name]) * 1e3:6.1f} ms); " + ", ".join(ratios)
        )


# ---------------------------------------------------------------------------- the CPU heap (issue 52)
def run_heap(local_rank: int, args: argparse.Namespace) -> dict[str, float]:
    """onedist's sharded step of the large model alone, 2 warm-up steps then ``--steps``: its
    median time, and this rank's peak RSS and RSS at the end (MiB)."""
    torch.set_num_threads(1)
    x, y = _rank_batch(args.large_batch_size, args.width)
    model = od.auto_model(Net(args.width, args.depth), sharding="fsdp")
    step = _stepper(model, od.auto_optim(torch.optim.AdamW(model.parameters())), x, y)
    step(2)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step(1)
        times.append(time.perf_counter() - start)
    mib = 1 << 20
    return {
        "step": statistics.median(times),
        "peak": _status("VmHWM") / mib,
        "resident": _status("VmRSS") / mib,
    }


def report_heap(args: argparse.Namespace) -> None:
    """The step with glibc's heap as onedist sets it and as glibc has it, in workers of their own."""
    print(
        f"the sharded step, {args.steps} steps after 2; each setting in workers of its own "
        "(glibc's setting is the process's)"
    )
    for setting in ("1", "0"):
        with patch.dict(os.environ, {"ONEDIST_CPU_HEAP": setting}):
            out = od.spawn(args.backend, run_heap, args=(args,), nproc_per_node=2)
        shown = "; ".join(
            f"rank {r}: {o['step'] * 1e3:.0f} ms a step, peak RSS {o['peak']:.0f} MiB, "
            f"at the end {o['resident']:.0f} MiB"
            for r, o in enumerate(out)
        )
        print(f"  ONEDIST_CPU_HEAP={setting}: {shown}")


# ---------------------------------------------------------------------------- one exchange (issue 52)
def run_exchange(local_rank: int, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """A 100 MB all_gather_into_tensor and reduce_scatter_tensor (float32) on onedist's group (its
    ranks read each other), on one of its groups made with ``ONEDIST_CMA=0`` (gloo's sockets) and
    on torch's plain gloo group, interleaved: the median seconds of each."""
    import torch.distributed as dist

    with patch.dict(os.environ, {"ONEDIST_CMA": "0"}):
        sockets = dist.new_group()
    groups = {
        "onedist": None,
        "onedist, ONEDIST_CMA=0": sockets,
        "torch's gloo": dist.new_group(backend="gloo"),
    }
    n = od.get_world_size()
    whole = torch.ones(25_000_000)  # 100 MB
    part = torch.ones(whole.numel() // n)
    times: dict[str, dict[str, list[float]]] = {g: {"all_gather": [], "reduce_scatter": []} for g in groups}
    for _ in range(args.reps + 1):  # the first: warm-up
        for name, group in groups.items():
            for kind in ("all_gather", "reduce_scatter"):
                dist.barrier()
                start = time.perf_counter()
                if kind == "all_gather":
                    dist.all_gather_into_tensor(whole, part, group=group)
                else:
                    dist.reduce_scatter_tensor(part, whole, group=group)
                times[name][kind].append(time.perf_counter() - start)
    return {g: {k: statistics.median(v[1:]) for k, v in kinds.items()} for g, kinds in times.items()}


def report_exchange(args: argparse.Namespace) -> None:
    print(f"one exchange of 100 MB, 2 ranks, {args.reps} interleaved repetitions (medians)")
    out = od.spawn("gloo", run_exchange, args=(args,), nproc_per_node=2)[0]
    base = out["torch's gloo"]
    for name, kinds in out.items():
        shown = ", ".join(
            f"{k} {v * 1e3:6.1f} ms (x{base[k] / v:.2f} torch's speed)" for k, v in kinds.items()
        )
        print(f"  {name:24s} {shown}")


# ---------------------------------------------------------------------------- peak memory (issue 52)
#: the sharded variants whose memory is compared: auto_model's options
MEMORY_VARIANTS: dict[str, dict[str, Any]] = {
    "sharded, float32": {},
    "activation checkpointing": {"activation_checkpointing": True},
    "bf16-true": {"precision": "bf16-true"},
    "activation checkpointing + bf16-true": {"activation_checkpointing": True, "precision": "bf16-true"},
    "reshard_after_forward=False": {"reshard_after_forward": False},  # the faster step's price
}


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS: now, VmHWM: the peak since the last reset)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _reset_peak() -> int:
    """Reset this process's peak RSS (Linux: clear_refs 5) and return the RSS now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def run_memory(local_rank: int, args: argparse.Namespace) -> dict[str, Any]:
    """Each sharded variant, one after the other in this process (after one unreported run of the
    first, which pays the one-off costs): its peak RSS above the RSS before it was built (under
    ``od.init_module(empty_init=True)``), sharded and stepped twice; the peak of its second step
    above the RSS before that step; its bytes at rest (parameters, gradients, AdamW's state)."""
    import gc

    torch.set_num_threads(1)
    per = args.memory_batch_size // od.get_world_size()
    g = torch.Generator().manual_seed(od.get_rank())
    x, y = torch.randn(per, args.width, generator=g), torch.randn(per, 1, generator=g)
    out: dict[str, Any] = {}
    for name, options in [("warm-up", {}), *MEMORY_VARIANTS.items()]:  # the first pays one-off costs
        gc.collect()
        od.barrier()
        start = _reset_peak()
        with od.init_module(empty_init=True):
            net = Net(args.width, args.depth)
        model = od.auto_model(net, sharding="fsdp", **options)
        optimizer = od.auto_optim(torch.optim.AdamW(model.parameters()))
        step = _stepper(model, optimizer, x, y)
        step(1)
        whole = _status("VmHWM") - start
        before_step = _reset_peak()
        step(1)
        out[name] = {
            "peak": max(whole, _status("VmHWM") - start),
            "step": _status("VmHWM") - before_step,
            "rest": _bytes(model, optimizer),
        }
        del model, optimizer, step, net
    del out["warm-up"]
    return out


def report_memory(args: argparse.Namespace) -> None:
    """The peak memory of activation checkpointing and bf16-true against the plain sharded run."""
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # freed tensors leave the RSS at once (glibc)
    print(
        f"memory: the large model, 2 {args.backend} ranks, global batch {args.memory_batch_size}; "
        "MALLOC_MMAP_THRESHOLD_=65536 set for the workers (the RSS then falls when a tensor is freed)"
    )
    per_rank = od.spawn(args.backend, run_memory, args=(args,), nproc_per_node=2)
    del os.environ["MALLOC_MMAP_THRESHOLD_"]
    keys = ("peak", "step", "rest")
    base = {k: max(r["sharded, float32"][k] for r in per_rank) for k in keys}
    for name in MEMORY_VARIANTS:
        got = {k: max(r[name][k] for r in per_rank) for k in keys}
        print(
            f"  {name:38s} peak {got['peak'] / 2**20:7.1f} MiB (x{got['peak'] / base['peak']:.2f}), "
            f"one step's peak {got['step'] / 2**20:7.1f} MiB (x{got['step'] / base['step']:.2f}), at rest "
            f"{got['rest'] / 2**20:7.1f} MiB (x{got['rest'] / base['rest']:.2f}); the largest rank"
        )


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
    parser.add_argument("--parts", default="small,large", help="small, large, memory, exchange, heap")
    parser.add_argument("--large-width", type=int, default=1024)
    parser.add_argument("--large-depth", type=int, default=6)
    parser.add_argument("--large-batch-size", type=int, default=32, help="global batch size")
    parser.add_argument("--large-steps", type=int, default=3, help="steps per timed repetition")
    parser.add_argument("--memory-batch-size", type=int, default=256, help="global batch (memory)")
    parser.add_argument("--tune", action="store_true", help="also FSDP2's other choices (large)")
    args = parser.parse_args()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU benchmark, also on a GPU machine
    parts = args.parts.split(",")
    large = argparse.Namespace(**{**vars(args), "width": args.large_width, "depth": args.large_depth})
    if "large" in parts:
        report_large(large)
    if "memory" in parts:
        report_memory(large)
    if "exchange" in parts:
        report_exchange(args)
    if "heap" in parts:
        report_heap(large)
    if "small" not in parts:
        return
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
