"""One-file checkpoints and sharded models (issue 52, point 2), run on every rank of a pool:
od.load_checkpoint of one file into a model built under od.init_module(empty_init=True) and
sharded reads only each rank's shards' bytes; od.full_state_dict and save_checkpoint(full=True)
gather to one rank a tensor at a time. Memory is measured per rank from /proc/self/status."""

from __future__ import annotations

import math
import os
import re
import time
from typing import Any

import torch

import onedist as od
from checks_large_models import Big, Net

WIDTH, DEPTH = 4096, 4  # Big: 4 bias-free 4096 x 4096 layers, 256 MiB of float32, 64 MiB each
# what a rank's peak may grow by beyond its 2/N: 16 MiB, and up to 2 page-cache folios (<= 2 MiB
# each on x86-64) of file pages around each end of each tensor's chunk, mapped with it
FIXED, PER_TENSOR = 16 * 2**20, 4 * 2**20
ROWS, STEPS, LR = 6, 3, 2.0


def write_big_checkpoint(path: str, plain: bool) -> int:
    """A Big model's weights, each layer ``randn / sqrt(width)`` (activations keep their size
    through the 16 layers, so 3 steps move every weight), as od.save_checkpoint writes it (with
    its CRC-32) or as a plain torch.save state dict; its bytes."""
    g = torch.Generator().manual_seed(52)
    state = {
        f"layers.{i}.weight": torch.randn(WIDTH, WIDTH, generator=g) / math.sqrt(WIDTH) for i in range(DEPTH)
    }
    if plain:
        torch.save(state, path)
    else:
        od.save_checkpoint(state, path)
    return sum(t.numel() * t.element_size() for t in state.values())


def status() -> dict[str, int]:
    """/proc/self/status's memory fields, in bytes: VmRSS (resident now), VmHWM (its peak since the
    last reset), RssAnon (memory of the process's own), RssFile (mapped file pages resident)."""
    with open("/proc/self/status") as f:
        text = f.read()
    return {
        k: int(re.search(rf"^{k}:\s+(\d+) kB", text, re.M).group(1)) * 1024  # type: ignore[union-attr]
        for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")
    }


def reset_peak() -> dict[str, int]:
    """Reset this process's VmHWM to its VmRSS (Linux: clear_refs 5); the fields now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch (inputs, targets)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, WIDTH, generator=g)


def _train(model: torch.nn.Module, rows: slice) -> None:
    optimizer = od.auto_optim(torch.optim.SGD(model.parameters(), lr=LR))
    for step in range(STEPS):
        x, y = _batch(step)
        od.backward(torch.nn.functional.mse_loss(model(x[rows]), y[rows]))
        optimizer.step()
        optimizer.zero_grad()


def _mapped(path: str) -> bool:
    """Whether this process maps the file at ``path`` (its full path: a pool's worker may still map
    another test's file of the same name)."""
    with open("/proc/self/maps") as f:
        return any(line.rstrip("\n").endswith(" " + os.path.realpath(path)) for line in f)


def _unmapped_within_a_sample(path: str) -> bool:
    """Whether the file at ``path`` is unmapped now or within 1 s: the failure watcher samples the
    main thread's stack once a second (``sys._current_frames``), and a sample taken as the load
    returned holds the load's frames, the mapped tensors with them, until its walk ends (full runs
    under load saw the file still mapped right after the load now and then; never alone). A mapping
    kept longer than one sample is a leak and fails."""
    deadline = time.monotonic() + 1.0
    while _mapped(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _warm_up(path: str) -> None:
    """A small model through the same path first: what importing FSDP2, DTensor and torch.load's
    mapping code costs once is not counted."""
    torch.manual_seed(0)
    small = Net()
    if od.get_rank() == 0:
        torch.save(small.state_dict(), path)
    od.barrier()
    with od.init_module(empty_init=True):
        net = Net()
    od.load_checkpoint(path, od.auto_model(net, sharding="fsdp", init_weights=False))
    od.full_state_dict(od.auto_model(Net(), sharding="fsdp"))


def check_a_one_file_checkpoint_loads_into_shards_reading_only_their_bytes(
    path: str, total: int, workdir: str
) -> dict[str, Any]:
    """Build Big under init_module(empty_init=True), shard it (init_weights=False), load the
    one-file checkpoint ``path``: the peak RSS (VmHWM: the process's own memory and the file pages
    it maps) grows by at most 2/N of the model + 16 MiB + 4 MiB a tensor; after it the shards hold 1/N and the
    file is no longer mapped. od.full_state_dict gives the file's tensors back on rank 0 with a
    peak growth of the model once + (2 + 1/N) layers + 16 MiB there, (2 + 1/N) layers + 16 MiB on
    the others (the gather buffer: a layer and this rank's share; the backend's copy: a layer);
    save_checkpoint(full=True) writes them for the same peaks. 3 SGD steps then give the weights of
    the same steps in one process from the same file (<= 1e-5)."""
    ws, rank = od.get_world_size(), od.get_rank()
    layer = total // DEPTH
    _warm_up(os.path.join(workdir, "small.pt"))
    start = reset_peak()
    with od.init_module(empty_init=True):
        net = Big(DEPTH, WIDTH)
    model = od.auto_model(net, sharding="fsdp", init_weights=False)
    od.load_checkpoint(path, model)
    after = status()
    loaded = after["VmHWM"] - start["VmRSS"]
    held = sum(p.to_local().untyped_storage().nbytes() for p in model.parameters())  # type: ignore[operator]
    assert _unmapped_within_a_sample(path)
    assert held <= total / ws * 1.01, (held, total)
    assert loaded <= 2 * total / ws + FIXED + PER_TENSOR * DEPTH, (loaded, total)

    # the gather buffer (1 + 1/N of the largest tensor) and the backend's own copy of it (gloo's)
    allowed = (total if rank == 0 else 0) + layer * (2 + 1 / ws) + 16 * 2**20
    begin = reset_peak()
    full = od.full_state_dict(model)
    gathered = status()["VmHWM"] - begin["VmRSS"]
    if rank == 0:
        file = torch.load(path, weights_only=True, mmap=True)
        assert list(full) == list(file) and all(torch.equal(full[k], file[k]) for k in file)
        del file
    del full
    saved_to = os.path.join(workdir, "full.pt")
    begin = reset_peak()
    od.save_checkpoint({"model": model, "steps": STEPS}, saved_to, full=True)
    saved = status()["VmHWM"] - begin["VmRSS"]
    assert gathered <= allowed and saved <= allowed, (gathered, saved, allowed)
    if rank == 0:
        written = torch.load(saved_to, weights_only=True, mmap=True)
        file = torch.load(path, weights_only=True, mmap=True)
        assert written["steps"] == STEPS and all(torch.equal(written["model"][k], file[k]) for k in file)
        del written, file

    per = ROWS // ws
    _train(model, slice(rank * per, (rank + 1) * per))
    full = od.full_state_dict(model)
    worst = moved = 0.0
    if rank == 0:  # the same 3 steps in one process, from the same file
        with torch.device("meta"):
            serial = Big(DEPTH, WIDTH)
        serial.load_state_dict(torch.load(path, weights_only=True), assign=True)
        first = serial.layers[0].weight.detach().clone()
        _train_serially(serial)
        want = serial.state_dict()
        worst = max(float((full[k] - want[k]).abs().max()) for k in want)
        moved = float((want["layers.0.weight"] - first).abs().max())
        assert worst <= 1e-5 and moved >= 1e-3, (worst, moved)
    return {
        "total": total,
        "held": held,
        "build_shard_load_peak_growth": loaded,
        "overhead_over_2_of_N": int(loaded - 2 * total / ws),
        "allowed_overhead": FIXED + PER_TENSOR * DEPTH,
        "rss_anon_growth_after_load": after["RssAnon"] - start["RssAnon"],
        "rss_file_growth_after_load": after["RssFile"] - start["RssFile"],
        "full_state_dict_peak_growth": gathered,
        "save_full_peak_growth": saved,
        "max_difference": worst,
        "moved": moved,
    }


def _train_serially(model: torch.nn.Module) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = _batch(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def check_one_file_checkpoints_and_sharded_models(workdir: str) -> None:
    """A small Net: a one-file checkpoint with another value and "module."-prefixed keys loads into
    a sharded model in a dict and gives back the model's live state dict (DTensors), the file
    unmapped; save_checkpoint(full=True) writes what full_state_dict gathers, and
    that loads back. Bad inputs raise on every rank naming the argument, the value and what is
    allowed, before any live object changes."""
    torch.manual_seed(4)
    serial = Net()
    path, full_path = os.path.join(workdir, "one.pt"), os.path.join(workdir, "full.pt")
    state = {"model": {"module." + k: v for k, v in serial.state_dict().items()}, "epoch": 7}
    od.save_checkpoint(state, path)
    with od.init_module(empty_init=True):
        net = Net()
    model = od.auto_model(net, sharding="fsdp", init_weights=False)
    ckpt = od.load_checkpoint(path, {"model": model})
    assert ckpt["epoch"] == 7 and type(ckpt["model"]["head.weight"]).__name__ == "DTensor", ckpt
    assert _unmapped_within_a_sample(path)
    got = od.full_state_dict(model)
    if od.get_rank() == 0:
        assert all(torch.equal(got[k], v) for k, v in serial.state_dict().items())
    od.save_checkpoint({"model": model, "epoch": 8}, full_path, full=True)
    written = od.load_checkpoint(full_path)
    assert written["epoch"] == 8 and all(
        torch.equal(written["model"][k], v) for k, v in serial.state_dict().items()
    )
    optimizer = od.auto_optim(torch.optim.AdamW(model.parameters()))
    od.backward(model(torch.zeros(2, 3, dtype=torch.long)).sum())
    optimizer.step()
    before = {k: v.clone() for k, v in od.full_state_dict(model).items()}
    bad_state = {k: v for k, v in serial.state_dict().items() if k != "head.bias"}
    od.save_checkpoint({"model": bad_state}, os.path.join(workdir, "missing.pt"))
    wrong = dict(serial.state_dict(), **{"head.weight": torch.zeros(3, 3)})
    od.save_checkpoint(wrong, os.path.join(workdir, "shape.pt"))
    trained = Net()
    opt_state = torch.optim.AdamW(trained.parameters())
    trained(torch.zeros(1, 2, dtype=torch.long)).sum().backward()
    opt_state.step()
    od.save_checkpoint({"model": trained, "optimizer": opt_state}, os.path.join(workdir, "opt.pt"))
    cases: list[tuple[Any, str]] = [
        (
            lambda: od.load_checkpoint(path, {"net": model}),
            r"to\['net'\]='FSDPNet' is not allowed; allowed: a key of the checkpoint .* "
            r"\(it has \['epoch', 'model'\]\)",
        ),
        (
            lambda: od.load_checkpoint(os.path.join(workdir, "shape.pt"), {"model": model}),
            r"(?s)to\['model'\]='FSDPNet' is not allowed.*HINT: the checkpoint is one model's state dict: "
            r"pass the model itself",
        ),
        (
            lambda: od.load_checkpoint(os.path.join(workdir, "missing.pt"), {"model": model}),
            r"the checkpoint's entry for to\['model'\]='a state dict of \d+ keys' is not allowed; allowed: "
            r"the model's keys; missing: \['head.bias'\], unexpected: \[\]",
        ),
        (
            lambda: od.load_checkpoint(os.path.join(workdir, "shape.pt"), model),
            r"the checkpoint's 'head.weight' for to='shape \(3, 3\)' is not allowed; allowed: a tensor of "
            r"the model's shape \(5, 24\)",
        ),
        (
            lambda: od.load_checkpoint(path, {"model": model}, map_location=lambda s, loc: s),
            r"map_location=<function .*> is not allowed; allowed: a device \(a str or torch.device\) when",
        ),
        (
            lambda: od.load_checkpoint(
                os.path.join(workdir, "opt.pt"), {"model": model, "optimizer": optimizer}
            ),
            r"(?s)to\['optimizer'\]='AdamW' is not allowed; allowed: an optimizer without saved "
            r"state.*HINT: an unsharded run's optimizer state",
        ),
        (
            lambda: od.save_checkpoint({"model": model}, full_path, full=1),
            r"full has type int \(1\); allowed: a bool",
        ),
        (
            lambda: od.save_checkpoint({"model": model, "opt": optimizer}, full_path, full=True),
            r"(?s)full=True is not allowed; allowed: False when `obj` holds a sharded model's optimizer.*"
            r"the optimizer at \['opt'\]",
        ),
    ]
    for call, pattern in cases:
        try:
            call()
        except (od.OnedistValueError, od.OnedistTypeError, od.RemoteRankError) as e:
            assert re.search(pattern, str(e)), (pattern, str(e))
        else:
            raise AssertionError(f"no error for {pattern}")
    after = od.full_state_dict(model)
    assert all(torch.equal(before[k], after[k]) for k in before)  # no refused load changed it
