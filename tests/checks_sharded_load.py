"""Checks of a sharded checkpoint's load (issue 51), run on every rank of a pool: a damaged file
changes no rank's parameters, an intact one loads bit for bit, each tensor read straight into the
parameters (``tests/test_sharded_load_check.py``)."""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

import onedist as od
from checks_integrity import flip_middle_bit
from onedist.training import shard_reader


def layered_model() -> torch.nn.Module:
    """Uneven rows for every world size tried (7, 5 and 11: FSDP pads the last rank's shard), a
    bfloat16 layer, a bias: the seed fixes the values."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList(
        [torch.nn.Linear(10, 7), torch.nn.Linear(7, 5), torch.nn.Linear(5, 11)]
    )
    model.blocks[1].to(torch.bfloat16)
    return model


def _sharded() -> torch.nn.Module:
    model = od.auto_model(layered_model(), sharding="fsdp")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)  # not what was saved: a load that writes anything shows
    return model


def _local(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's shards (the whole tensors where one rank is not sharded)."""
    return [getattr(p, "to_local", p.detach)().detach().clone() for p in model.parameters()]


def save_layered(folder: str) -> None:
    """``layered_model``'s weights, sharded over this pool's ranks, to ``folder``/c."""
    model = od.auto_model(layered_model(), sharding="fsdp")
    od.save_checkpoint({"model": model}, os.path.join(folder, "c"))


def check_load_is_bit_identical(folder: str) -> dict[str, Any]:
    """``folder``/c loaded into a model of sevens at this world size: its whole tensors (to compare
    with ``layered_model``'s), and how many saved tensors were read straight into the parameters
    and how many through DCP's own read."""
    counts = {"straight": 0, "dcp": 0}
    read = shard_reader.read_straight

    def counted(*args: Any) -> bool:
        straight = read(*args)
        counts["straight" if straight else "dcp"] += 1
        return straight

    shard_reader.read_straight = counted  # type: ignore[assignment]
    try:
        model = _sharded()
        od.load_checkpoint(os.path.join(folder, "c"), {"model": model})
    finally:
        shard_reader.read_straight = read  # type: ignore[assignment]
    whole = {name: getattr(p, "full_tensor", p.detach)().detach() for name, p in model.named_parameters()}
    return {"whole": whole, **counts}


def check_damage_changes_no_parameter(folder: str, damaged: str, how: str) -> dict[str, Any]:
    """A copy of ``folder``/c with its file ``damaged`` cut short (``how`` "cut") or one bit
    flipped in its middle ("flip"), loaded into a model of sevens: what this rank raised, and
    whether its parameters are still all sevens."""
    copy = os.path.join(folder, f"damaged-{damaged}-{how}-on-{od.get_world_size()}")
    if od.get_rank() == 0:
        shutil.copytree(os.path.join(folder, "c"), copy)
        path = os.path.join(copy, damaged)
        if how == "cut":
            os.truncate(path, os.path.getsize(path) - 1)
        else:
            flip_middle_bit(path)
    od.barrier()
    model = _sharded()
    before = _local(model)
    try:
        od.load_checkpoint(copy, {"model": model})
    except od.CheckpointCorruptError as e:
        raised: Any = {"message": str(e), "faults": e.faults}
    else:
        raised = None
    unchanged = all(torch.equal(a, b) for a, b in zip(before, _local(model)))
    od.barrier()
    if od.get_rank() == 0:
        shutil.rmtree(copy)
    return {"raised": raised, "unchanged": unchanged, "file": os.path.join(copy, damaged)}
