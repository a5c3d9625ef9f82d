"""sharding="hsdp" with what a large model needs: a model built under
``od.init_module(empty_init=True)`` and a sharded checkpoint saved and resumed. Run on every rank
(tests/scripts/hsdp_checkpoint.py on two network-namespace nodes; a gloo pool on one node)."""

from __future__ import annotations

import os
from typing import Any

import torch

import checks_large_models
import onedist as od
from checks_sharded_checkpoint import _step, _whole, wide


def _trained(sharding: str, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = od.auto_model(wide(), sharding=sharding)
    optimizer = od.auto_optim(torch.optim.AdamW(model.parameters(), lr=0.01))
    for step in range(steps):
        _step(model, optimizer, step)
    return model, optimizer


def check_hsdp_meta_init_and_checkpoint_resume(tmpdir: str) -> dict[str, Any]:
    """Under hsdp: a model built on the meta device is initialised as the serial build (the
    check of tests/checks_large_models.py); a sharded checkpoint of the model and its AdamW, loaded
    into a fresh hsdp model, gives the uninterrupted run's weights after 3 more steps, bit for bit,
    and also loads into an fsdp model (another mesh) with the same weights."""
    meta = checks_large_models.check_meta_init_equals_the_serial_init("hsdp")
    assert meta["sharded"], meta
    path = os.path.join(tmpdir, "hsdp.pt")
    model, optimizer = _trained("hsdp", 3)
    mesh = list(od.unwrap(model).blocks[0].linear.weight.device_mesh.shape)
    od.save_checkpoint({"model": model, "optimizer": optimizer, "step": 3}, path)
    at_save = _whole(model)
    for step in range(3, 6):
        _step(model, optimizer, step)
    fresh, fresh_optimizer = _trained("hsdp", 0)
    ckpt = od.load_checkpoint(path, {"model": fresh, "optimizer": fresh_optimizer})
    assert ckpt["step"] == 3, ckpt["step"]
    for step in range(3, 6):
        _step(fresh, fresh_optimizer, step)
    assert torch.equal(_whole(fresh), _whole(model)), "resumed training differs from the uninterrupted run"
    flat, _ = _trained("fsdp", 0)
    od.load_checkpoint(path, {"model": flat})
    assert torch.equal(_whole(flat), at_save)
    return {"mesh": mesh, "output_difference": meta["output_difference"]}
