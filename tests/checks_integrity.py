"""Damaged checkpoints and failed saves on every rank of a gloo pool: load_checkpoint raises naming
the file, resume falls back to the newest intact step with its exact values, a save that cannot
write says why and leaves the previous checkpoint and no temporary file.

Each check returns what the test compares across ranks."""

from __future__ import annotations

import errno
import io
import logging
import os
import zipfile
from typing import Any

import torch

import onedist as od
from checks import onedist_log
from checks_sharded_checkpoint import _step as sharded_step, _trained as trained_sharded, _whole
from onedist.training import checksums

# how each damage is made to step 2's file (rank 0 makes it; every rank then loads)
DAMAGES = [
    "truncated",  # the first half only
    "empty",
    "tail_cut",  # the last 1000 bytes gone: the zip's directory with them
    "record_cut",  # the last 20 bytes gone: the zip is whole, the checksum record is not
    "tensor_bit",  # one bit of the optimizer's momentum buffer
    "weight_bit",  # one bit of the Linear's weight
    "pickle_bit",  # one bit of the pickled structure (data.pkl)
    "directory_bit",  # one bit of the zip's central directory
]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _two_steps(folder: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, torch.Tensor]]:
    """Steps 1 and 2 of a training with momentum, each saved; what step 1 saved (weight, momentum,
    this rank's torch RNG state)."""
    model = _model()
    optimizer = _sgd(model)
    torch.manual_seed(10 + od.get_rank())  # each rank's RNG its own, as with dropout on its data
    saved: dict[str, torch.Tensor] = {}
    for step in (1, 2):
        model(torch.full((2, 4), float(step))).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        od.save_training_state(folder, step, model=model, optimizer=optimizer)
        if step == 1:
            saved = {
                "weight": model.weight.detach().clone(),
                "momentum": optimizer.state[model.weight]["momentum_buffer"].clone(),
                "rng": torch.get_rng_state(),
            }
    return model, optimizer, saved


def _flip(data: bytearray, at: int) -> None:
    data[at] ^= 0x10


def flip_middle_bit(path: str) -> None:
    """Flip the lowest bit of the byte in the middle of the file at ``path``, in place."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 1]))


def _member_offset(data: bytes, suffix: str) -> tuple[int, int]:
    """Where the data of the zip member whose name ends with ``suffix`` starts, and its size."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(suffix))
    local = info.header_offset
    name_length, extra_length = (int.from_bytes(data[local + k : local + k + 2], "little") for k in (26, 28))
    return local + 30 + name_length + extra_length, info.file_size


def damage(path: str, kind: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Damage the checkpoint file ``path`` as ``kind`` says (model and optimizer: what it holds)."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    record = checksums.RECORD_SIZE
    if kind == "truncated":
        data = data[: len(data) // 2]
    elif kind == "empty":
        data = bytearray()
    elif kind == "tail_cut":
        data = data[:-1000]
    elif kind == "record_cut":
        data = data[:-20]
    elif kind in ("tensor_bit", "weight_bit"):
        tensor = optimizer.state[model.weight]["momentum_buffer"] if kind == "tensor_bit" else model.weight
        found = bytes(data).find(tensor.detach().numpy().tobytes())
        assert found > 0, kind
        _flip(data, found + 5)
    elif kind == "pickle_bit":
        start, size = _member_offset(bytes(data[:-record]), "data.pkl")
        _flip(data, start + size // 2)
    elif kind == "directory_bit":
        _flip(data, len(data) - record - 40)
    else:
        raise AssertionError(kind)
    with open(path, "wb") as f:
        f.write(data)


def check_a_damaged_newest_step(folder: str, kind: str) -> dict[str, Any]:
    """Step 2 damaged as ``kind``: load_checkpoint raises CheckpointCorruptError on every rank naming
    it; resume skips it for step 1, with step 1's weight, momentum and RNG state exactly, and sets
    it aside; rank 0 warns, naming it."""
    model, optimizer, saved = _two_steps(folder)
    newest = str(od.checkpoint_path(folder, 2))
    if od.get_rank() == 0:
        damage(newest, kind, model, optimizer)
    od.barrier()
    untouched = torch.nn.Linear(4, 3)
    before = untouched.weight.detach().clone()
    try:
        od.load_checkpoint(newest, {"model": untouched})
    except od.CheckpointCorruptError as e:
        raised = {"message": str(e), "faults": e.faults}
    else:
        raise AssertionError(f"{kind}: load_checkpoint loaded the damaged {newest}")
    assert torch.equal(untouched.weight, before), "a failed load changed the live model"
    fresh = _model()
    fresh_optimizer = _sgd(fresh)
    torch.manual_seed(1000)  # a restarted process's RNG is elsewhere
    with onedist_log(logging.WARNING) as records:
        step = od.resume(folder, model=fresh, optimizer=fresh_optimizer)
    assert step == 1, step
    assert torch.equal(fresh.weight, saved["weight"]), "the weight differs from step 1's"
    assert torch.equal(fresh_optimizer.state[fresh.weight]["momentum_buffer"], saved["momentum"])
    assert torch.equal(torch.get_rng_state(), saved["rng"]), "the RNG state differs from step 1's"
    od.barrier()  # rank 0 has set the damaged file aside
    return {**raised, "listing": sorted(os.listdir(folder)), "warnings": [r.getMessage() for r in records]}


def check_ranks_agree_when_one_rank_sees_damage(folder: str) -> dict[str, Any]:
    """Only the last rank finds step 2 damaged (its read fails): every rank raises
    CheckpointCorruptError from load_checkpoint, and every rank's resume loads step 1."""
    _, _, saved = _two_steps(folder)
    newest = od.checkpoint_path(folder, 2)
    plain = checksums._check  # every verification (verify_file, load_verified) goes through it
    seen_damaged = od.get_rank() == od.get_world_size() - 1

    def damaged_here(path: Any, crc_of: Any) -> bool:
        if str(path) == str(newest):
            raise checksums.corrupt(path, "it cannot be read: OSError: [Errno 5] Input/output error")
        return plain(path, crc_of)

    if seen_damaged:
        checksums._check = damaged_here
    try:
        try:
            od.load_checkpoint(newest)
        except od.CheckpointCorruptError as e:
            faults = e.faults
        else:
            raise AssertionError("load_checkpoint loaded a file one rank found damaged")
        fresh = _model()
        step = od.resume(folder, model=fresh)
    finally:
        checksums._check = plain
    assert torch.equal(fresh.weight, saved["weight"])
    return {"faults": faults, "step": step}


def check_no_intact_step_raises_listing_each(folder: str) -> dict[str, Any]:
    """Both steps damaged: resume raises on every rank, listing both files and their faults; the
    files stay where they are."""
    model, optimizer, _ = _two_steps(folder)
    if od.get_rank() == 0:
        damage(str(od.checkpoint_path(folder, 2)), "weight_bit", model, optimizer)
        damage(str(od.checkpoint_path(folder, 1)), "empty", model, optimizer)
    od.barrier()
    try:
        od.resume(folder, model=_model())
    except od.CheckpointCorruptError as e:
        said = {"message": str(e), "faults": e.faults}
    else:
        raise AssertionError("resume returned with no intact step")
    od.barrier()
    return {**said, "listing": sorted(os.listdir(folder))}


def check_a_damaged_shard(folder: str) -> dict[str, Any]:
    """A sharded (FSDP) step 2 with one bit flipped in the last rank's ``.distcp`` file: load_checkpoint
    raises on every rank naming that file; resume loads step 1's weights exactly."""
    model, optimizer = trained_sharded(1)
    od.save_training_state(folder, 1, model=model, optimizer=optimizer)
    at_step_1 = _whole(model)
    sharded_step(model, optimizer, 1)
    od.save_training_state(folder, 2, model=model, optimizer=optimizer)
    shard = os.path.join(od.checkpoint_path(folder, 2), f"__{od.get_world_size() - 1}_0.distcp")
    if od.get_rank() == 0:
        flip_middle_bit(shard)
    od.barrier()
    fresh, fresh_optimizer = trained_sharded(0)
    try:
        od.load_checkpoint(od.checkpoint_path(folder, 2), {"model": fresh, "optimizer": fresh_optimizer})
    except od.CheckpointCorruptError as e:
        raised = {"message": str(e), "faults": e.faults, "shard": shard}
    else:
        raise AssertionError("load_checkpoint loaded a damaged shard")
    assert od.resume(folder, model=fresh, optimizer=fresh_optimizer) == 1
    assert torch.equal(_whole(fresh), at_step_1), "the weights differ from step 1's"
    od.barrier()
    listing = sorted(os.listdir(folder))
    aside = f"{od.checkpoint_path(folder, 2)}.corrupt"
    if od.get_rank() == 0:
        os.remove(os.path.join(od.checkpoint_path(folder, 1), "checksums.json"))  # as an older onedist's
        os.truncate(os.path.join(aside, "__0_0.distcp"), 100)  # and two more damages: cut, missing
        os.remove(os.path.join(aside, ".metadata"))
    od.barrier()
    try:
        od.load_checkpoint(aside, {"model": fresh})
    except od.CheckpointCorruptError as e:
        more = e.faults
    else:
        raise AssertionError("load_checkpoint loaded a cut shard")
    with onedist_log(logging.WARNING) as records:
        od.load_checkpoint(od.checkpoint_path(folder, 1), {"model": fresh})
    assert torch.equal(_whole(fresh), at_step_1)
    unverified = [r.getMessage() for r in records]
    return {**raised, "listing": listing, "unverified": unverified, "more": more}


def save_the_previous(folder: str) -> None:
    """The checkpoints a failed save must leave intact: step 1, and ``last.pt``."""
    model = _model()
    od.save_training_state(folder, 1, model=model)
    od.save_checkpoint({"weight": model.weight}, os.path.join(folder, "last.pt"))


def check_a_save_that_cannot_write(folder: str, fault: str) -> list[str]:
    """The writer cannot write step 2, nor ``last.pt`` again (``fault``: "full": the folder is a 1
    MiB tmpfs and the checkpoint is larger; "denied": the writer runs as another user;
    "read-only": the test remounted the folder so): every rank raises, naming the path and the
    errno's meaning; the previous checkpoints are intact and no temporary file is left. Returns
    what this rank raised, for each save."""
    said = []
    for save in (
        lambda: od.save_training_state(folder, 2, model=torch.nn.Linear(1024, 512)),  # 2 MiB
        lambda: od.save_checkpoint({"weight": torch.zeros(512, 1024)}, os.path.join(folder, "last.pt")),
    ):
        with _as_another_user(fault == "denied" and od.get_rank() == 0):
            try:
                save()
            except (OSError, od.RemoteRankError) as e:
                said.append(f"{type(e).__name__}: {e}")
            else:
                raise AssertionError(f"{fault}: the save did not raise")
    od.barrier()
    assert sorted(os.listdir(folder)) == ["last.pt", "step_00000001.pt"], os.listdir(folder)
    model = _model()
    assert torch.equal(od.load_checkpoint(os.path.join(folder, "last.pt"))["weight"], model.weight)
    fresh = torch.nn.Linear(4, 3)
    assert od.resume(folder, model=fresh) == 1 and torch.equal(fresh.weight, model.weight)
    return said


class _as_another_user:
    """Write as uid 65534 inside the block (root may write anywhere): the effective uid only, so
    the process becomes root again after it."""

    def __init__(self, active: bool) -> None:
        self.active = active

    def __enter__(self) -> None:
        if self.active:
            os.seteuid(65534)

    def __exit__(self, *exc: Any) -> None:
        if self.active:
            os.seteuid(0)


#: the errno each fault of check_a_save_that_cannot_write meets
ERRNOS = {"full": errno.ENOSPC, "denied": errno.EACCES, "read-only": errno.EROFS}
