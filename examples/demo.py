"""onedist demo: ranks, an exact metric reduction and an uneven gather on N processes.

The same file runs serially, spawned, and under an external launcher:

    python examples/demo.py --nproc-per-node 2             # spawns 2 gloo workers (CPU)
    python examples/demo.py --nproc-per-node 4 --backend gloo
    torchrun --nproc-per-node 2 examples/demo.py           # torchrun started them: only initialise
    python examples/demo.py --backend none                 # serial

Each rank "evaluates" its own, unevenly sized shard of a fixed synthetic dataset. The accuracy is
reduced exactly across ranks and checked against the single-process computation; the per-sample
scores are gathered without padding.
"""

from __future__ import annotations

import argparse

import torch

import onedist as od

DATASET_SIZE = 1001  # not divisible by 2, 3 or 4: shards differ in size


def shard(rank: int, world_size: int) -> range:
    """This rank's contiguous slice of the dataset (the first ranks get one sample more)."""
    base, extra = divmod(DATASET_SIZE, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def main(local_rank: int, args: argparse.Namespace) -> float:
    log = od.setup_logger("demo", all_ranks=True)
    rank, world_size = od.get_rank(), od.get_world_size()
    log.info(
        "rank %d/%d, local rank %d of %d on node %d/%d (%s), backend %s, device %s",
        rank,
        world_size,
        local_rank,
        od.get_nproc_per_node(),
        od.get_node_rank(),
        od.get_nnodes(),
        od.hostname(),
        od.backend(),
        od.device(),
    )

    generator = torch.Generator().manual_seed(0)  # the same "dataset" on every rank
    scores = torch.rand(DATASET_SIZE, generator=generator, dtype=torch.float64)
    labels = torch.rand(DATASET_SIZE, generator=generator) > 0.5
    mine = torch.tensor(list(shard(rank, world_size)))
    correct = int(((scores[mine] > 0.5) == labels[mine]).sum())

    # one collective for the whole dict; Python ints come back exact
    totals = od.all_reduce({"correct": correct, "samples": len(mine)})
    accuracy = totals["correct"] / totals["samples"]
    # shards have different sizes: gathered without padding, in rank order
    all_scores = od.all_gather(scores[mine])
    hosts = od.all_gather(od.hostname())

    expected = float(((scores > 0.5) == labels).double().mean())
    assert totals["samples"] == DATASET_SIZE and abs(accuracy - expected) < 1e-12, (accuracy, expected)
    assert torch.equal(all_scores, scores)
    if od.is_main_process():
        print(
            f"world size {world_size}: accuracy {accuracy:.4f} over {totals['samples']} samples "
            f"(single-process value {expected:.4f}); gathered {all_scores.numel()} scores from "
            f"shards of {[len(shard(r, world_size)) for r in range(world_size)]}; hosts {hosts}",
            flush=True,
        )
    return accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="onedist demo")
    parser.add_argument("--backend", default="gloo", help="gloo, nccl, auto, or none (serial)")
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=None)
    args = parser.parse_args()
    backend = None if args.backend == "none" else args.backend
    with od.Parallel(backend=backend, nproc_per_node=args.nproc_per_node) as parallel:
        parallel.run(main, args)
