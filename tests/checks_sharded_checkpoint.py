"""Sharded checkpoints (torch.distributed.checkpoint under od.save_checkpoint / od.load_checkpoint /
od.resume), run on every rank of gloo and shm pools and under mpirun, and serially (where a model is
never sharded and the checkpoint stays one file)."""

from __future__ import annotations

import os
import re
from typing import Any

import torch

import onedist as od
from checks_sharding import Net, _batch

OPTIMIZER_STATE = ("exp_avg", "exp_avg_sq")
WIDTH = 384  # divides by 2 and 3


def wide() -> torch.nn.Module:
    """checks_sharding's Net, wide enough that tensor bytes, not file overhead, fill the files."""
    return Net(WIDTH, scale=0.1)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    x, y = _batch(step)
    od.backward(torch.nn.functional.mse_loss(model(x), y))
    optimizer.step()
    optimizer.zero_grad()


def _trained(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = od.auto_model(wide(), sharding="fsdp")
    optimizer = od.auto_optim(torch.optim.AdamW(model.parameters(), lr=0.01))
    for step in range(steps):
        _step(model, optimizer, step)
    return model, optimizer


def _whole(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter, whole (a sharded one gathered), in one flat tensor on every rank."""
    tensors = (getattr(p, "full_tensor", lambda p=p: p)() for p in od.unwrap(model).parameters())
    return torch.cat([t.detach().flatten().cpu() for t in tensors])


def _state_bytes() -> int:
    """The whole model's parameter and optimizer-state bytes (what DDP holds on every rank)."""
    per_parameter = sum(p.numel() * p.element_size() for p in wide().parameters())
    return per_parameter * (1 + len(OPTIMIZER_STATE))


def check_sharded_checkpoint_round_trip(tmpdir: str) -> dict[str, Any]:
    """save_checkpoint of a sharded model and its AdamW writes a directory in which each rank's file
    holds its share only; loaded into a fresh sharded model and optimizer, 3 more steps give the
    uninterrupted run's weights bit for bit; the directory also loads into an unsharded model (each
    rank reads the whole tensors) and without live objects (their entries come back as None)."""
    path = os.path.join(tmpdir, "ckpt.pt")
    model, optimizer = _trained(3)
    od.save_checkpoint({"model": model, "optimizer": optimizer, "step": 3}, path)
    at_save = _whole(model)
    assert os.listdir(tmpdir) == ["ckpt.pt"], os.listdir(tmpdir)  # no temporary left beside it
    ws, files = od.get_world_size(), {}
    if ws > 1:
        files = {n: os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".distcp")}
        assert len(files) == ws, files  # one file of shards per rank
        share = _state_bytes() / ws
        assert all(size <= share * 1.1 for size in files.values()), (files, share)
    for step in range(3, 6):
        _step(model, optimizer, step)
    fresh, fresh_optimizer = _trained(0)
    ckpt = od.load_checkpoint(path, {"model": fresh, "optimizer": fresh_optimizer})
    assert ckpt["step"] == 3, ckpt["step"]
    for step in range(3, 6):
        _step(fresh, fresh_optimizer, step)
    assert torch.equal(_whole(fresh), _whole(model)), "resumed training differs from the uninterrupted run"

    plain = wide()  # unsharded, and the checkpoint's weights are not wide()'s
    od.load_checkpoint(path, {"model": plain})
    assert torch.equal(torch.cat([p.detach().flatten() for p in plain.parameters()]), at_save)
    saved = od.load_checkpoint(path)
    assert saved["step"] == 3 and (ws == 1 or saved["model"] is None), saved
    _check_keys_with_dots_and_ints(tmpdir, model, optimizer)
    return {"files": files}


def _check_keys_with_dots_and_ints(tmpdir: str, model: torch.nn.Module, optimizer: Any) -> None:
    """Entries found by their keys themselves: a dotted key, an int key, a list position."""
    path = os.path.join(tmpdir, "keys.pt")
    od.save_checkpoint({"run.main": model, 3: [optimizer], "epoch": 1}, path)
    fresh, fresh_optimizer = _trained(0)
    ckpt = od.load_checkpoint(path, {"run.main": fresh, 3: [fresh_optimizer]})
    assert ckpt["epoch"] == 1 and torch.equal(_whole(fresh), _whole(model))
    _step(model, optimizer, 6)
    _step(fresh, fresh_optimizer, 6)  # the same step only from the same AdamW state
    assert torch.equal(_whole(fresh), _whole(model))


def check_failed_sharded_save_raises_on_every_rank(tmpdir: str) -> None:
    """A sharded save the writer cannot start (its folder is a file) raises on every rank: the
    writer its own error, the others RemoteRankError naming the writer; nothing is left behind."""
    blocker = os.path.join(tmpdir, "a-file")
    if od.get_rank() == 0:
        open(blocker, "w").close()
    od.barrier()
    model, optimizer = _trained(0)
    try:
        od.save_checkpoint({"model": model, "optimizer": optimizer}, os.path.join(blocker, "ckpt.pt"))
    except od.RemoteRankError as e:
        assert od.get_rank() != 0 and "rank 0 could not create" in str(e), e
    except (FileExistsError, NotADirectoryError) as e:
        assert od.get_rank() == 0 or od.get_world_size() == 1, e
    else:
        raise AssertionError("a save into a file's path did not raise")
    assert sorted(os.listdir(tmpdir)) == ["a-file"], os.listdir(tmpdir)


def check_a_failed_shard_write_raises_on_every_rank(tmpdir: str) -> str:
    """The last rank's shard write fails (a full disk, say) once the directory exists: DCP gathers
    every rank's write result, so every rank raises, naming that rank; the writer removes the
    temporary directory, nothing is at the path, and the group is still in step."""
    from torch.distributed.checkpoint import FileSystemWriter

    last = od.get_world_size() - 1
    plain = FileSystemWriter.write_data

    def full_disk(self: Any, plan: Any, planner: Any) -> Any:
        raise OSError(28, "No space left on device")

    model, optimizer = _trained(0)
    if od.get_rank() == last:
        FileSystemWriter.write_data = full_disk  # type: ignore[method-assign]
    try:
        od.save_checkpoint({"model": model, "optimizer": optimizer}, os.path.join(tmpdir, "ckpt.pt"))
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        said = f"{type(e).__name__}: {e}"
    else:
        said = "no error"
    finally:
        FileSystemWriter.write_data = plain  # type: ignore[method-assign]
    od.barrier()
    assert os.listdir(tmpdir) == [], os.listdir(tmpdir)
    assert od.all_reduce(1) == od.get_world_size()
    return said


def check_save_for_another_world(tmpdir: str) -> None:
    """Trains and saves a sharded checkpoint, and (rank 0) the whole model and optimizer state
    for :func:`check_load_at_another_world` to compare with."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    model, optimizer = _trained(4)
    od.save_checkpoint({"model": model, "optimizer": optimizer, "step": 4}, os.path.join(tmpdir, "ckpt.pt"))
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_optimizer_state_dict(od.unwrap(model), optimizer, options=full)
    od.save_checkpoint(
        {"model": od.full_state_dict(model), "optimizer": state.get("state", {})},
        os.path.join(tmpdir, "full.pt"),
    )


def check_load_at_another_world(tmpdir: str) -> int:
    """The checkpoint of :func:`check_save_for_another_world`, saved at another world size, loads
    (DCP reshards): od.full_state_dict and the whole optimizer state equal the saving run's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    model, optimizer = _trained(0)
    ckpt = od.load_checkpoint(os.path.join(tmpdir, "ckpt.pt"), {"model": model, "optimizer": optimizer})
    expected = od.load_checkpoint(os.path.join(tmpdir, "full.pt"), map_location="cpu")
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_optimizer_state_dict(od.unwrap(model), optimizer, options=full).get("state", {})
    got = od.full_state_dict(model)
    if od.get_rank() == 0:
        assert list(got) == list(expected["model"]), list(got)
        assert all(torch.equal(got[k], v) for k, v in expected["model"].items()), "weights differ"
        for name, saved in expected["optimizer"].items():
            for key in OPTIMIZER_STATE:
                assert torch.equal(state[name][key], saved[key]), (name, key)
    return int(ckpt["step"])


def check_resume_skips_a_torn_sharded_save(tmpdir: str) -> None:
    """od.resume of sharded step checkpoints: a newer step's directory left half-written under its
    temporary name (its writer killed) is never loaded, and is removed once its writer is gone."""
    model, optimizer = _trained(2)
    od.save_training_state(tmpdir, 2, model=model, optimizer=optimizer)
    torn = os.path.join(tmpdir, f".step_00000004.pt.{2**22 + 1}.0123456789ab.tmp")  # no such pid
    if od.get_rank() == 0:
        os.makedirs(torn)
        open(os.path.join(torn, "__0_0.distcp"), "wb").close()
    od.barrier()
    fresh, fresh_optimizer = _trained(0)
    assert od.resume(tmpdir, model=fresh, optimizer=fresh_optimizer) == 2
    assert torch.equal(_whole(fresh), _whole(model))
    assert not os.path.exists(torn)
    assert re.fullmatch(r"step_00000002\.pt", " ".join(sorted(os.listdir(tmpdir)))), os.listdir(tmpdir)
