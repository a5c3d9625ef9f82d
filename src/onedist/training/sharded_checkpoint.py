"""Sharded checkpoints: a directory that every rank writes its own shards into, read back at any
world size.

A checkpoint whose objects include a sharded model (``auto_model(sharding="fsdp")``) is written by
:func:`save_sharded` as a directory at the checkpoint's path (the way Lightning Fabric saves FSDP
checkpoints), through torch.distributed.checkpoint (DCP):

* the sharded models' state dicts and their optimizers' (keyed by parameter name, so they load
  into another world size: DCP reads each rank's part of every saved shard) go to DCP's files,
  each rank writing only its own shards: no rank ever holds the whole model;
* everything else (an epoch, a config, RNG states, an LR scheduler, unsharded models) goes to
  ``rest.pt``, written by one rank with ``torch.save``, where each DCP entry is a placeholder.

The directory is written under a temporary name in the same folder and renamed to the path only
when every rank's shards, DCP's metadata and ``rest.pt`` are complete, so a save cut short (a killed
rank) is never loaded. Every file carries a CRC-32 computed as it is written: ``rest.pt`` its own
record, DCP's files a list in ``checksums.json`` (:mod:`.shard_checksums`), all checked before a
load reads them. :func:`load_sharded` loads such a directory into live objects: a sharded
model at the same or another world size, or an unsharded one (each rank then reads the whole
tensors), with the optimizer paired to its model by its parameters.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import bad_type, bad_value
from .checksums import load_verified, save_with_checksum, without_torchs_own_crc
from .files import fsync_dir, remove_stale_temporaries, temporaries_of, temporary_beside, write_failed
from .outcomes import on_every_rank, on_writer
from .sharding import is_sharded, is_sharded_optimizer

__all__ = ["REST", "holds_sharded", "is_sharded_checkpoint", "load_sharded", "save_sharded"]

#: the file of a sharded checkpoint's directory that holds everything but the DCP entries
REST = "rest.pt"
# what stands in rest.pt for an entry stored in the DCP files (followed by the entry's key)
_PLACEHOLDER = "onedist.sharded_checkpoint:"


def holds_sharded(obj: Any) -> bool:
    """Whether ``obj`` (searched through dicts, lists and tuples) holds a sharded model."""
    if isinstance(obj, Mapping):
        return any(holds_sharded(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(holds_sharded(v) for v in obj)
    return is_sharded(obj)


def is_sharded_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a directory :func:`save_sharded` completed."""
    return path.is_dir() and (path / REST).is_file()


# ============================================================================ save
def save_sharded(obj: Any, target: Path, writer: int, state_of: Any) -> None:
    """Write ``obj`` as a sharded checkpoint directory at ``target``; every rank must call it.

    ``writer`` writes ``rest.pt`` and renames the directory into place; ``state_of`` turns the
    unsharded values into what ``torch.save`` gets (checkpoint.py's ``_state_of``).
    """
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    from ..collectives import all_gather_object
    from ..context import current
    from .shard_checksums import ChecksummedFileSystem

    rank, world_size = current().rank, current().world_size
    entries: dict[str, Any] = {}
    rest = _split(obj, "", _models_of(obj), entries, state_of)
    temporary: str = on_writer(
        writer,
        lambda: str(_make_temporary(target)),
        f"onedist.save_checkpoint: rank {writer} could not create the sharded checkpoint's "
        f"directory beside {str(target)!r}",
    )
    storage = FileSystemWriter(temporary)
    storage.fs = files = ChecksummedFileSystem()  # each file's CRC-32, as DCP writes it
    try:  # every rank's shards; DCP raises on every rank when one rank's write fails
        # a replicated tensor (a buffer) is written once: rank 0's, the copy DDP-like training keeps
        planner = DefaultSavePlanner(dedup_save_to_lowest_rank=True)
        with _quiet_without_process_group() as no_dist, without_torchs_own_crc():
            save(entries, storage_writer=storage, planner=planner, no_dist=no_dist)
    except BaseException:
        if rank == writer:
            shutil.rmtree(temporary, ignore_errors=True)
        raise
    digests = files.digests
    if world_size > 1:
        digests = {name: d for found in all_gather_object(files.digests) for name, d in found.items()}
    on_writer(  # returning means the directory is in place
        writer,
        lambda: _finish(rest, digests, Path(temporary), target),
        f"onedist.save_checkpoint: rank {writer} could not complete the sharded checkpoint {str(target)!r}",
    )


@contextlib.contextmanager
def _quiet_without_process_group() -> Iterator[bool]:
    """Whether there is no process group (a serial run, or one process loading a checkpoint to
    look at it): DCP then reads and writes without collectives, and its warning that it assumes
    so is silenced here, where that is the intent."""
    import torch.distributed as dist

    no_dist = not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield no_dist


def _split(
    value: Any, key: str, models: list[torch.nn.Module], entries: dict[str, Any], state_of: Any
) -> Any:
    """``value`` for rest.pt: each sharded model, and each optimizer of one, moved to ``entries``
    (its state dict keyed by parameter names) and replaced by a placeholder."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from .wrappers import unwrap

    if is_sharded(value):
        entries[key] = get_model_state_dict(unwrap(value))
        return _PLACEHOLDER + key
    if isinstance(value, torch.optim.Optimizer) and is_sharded_optimizer(value):
        entries[key] = get_optimizer_state_dict(_model_of(value, models, "save_checkpoint", key), value)
        return _PLACEHOLDER + key
    if isinstance(value, Mapping):
        return {k: _split(v, _join(key, k), models, entries, state_of) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_split(v, _join(key, i), models, entries, state_of) for i, v in enumerate(value)]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return state_of(value)


def _join(key: str, part: Any) -> str:
    return f"{key}.{part}" if key else str(part)


def _models_of(obj: Any) -> list[torch.nn.Module]:
    """Every model in ``obj`` (dicts, lists and tuples searched), unwrapped."""
    from .wrappers import unwrap

    if isinstance(obj, torch.nn.Module):
        return [unwrap(obj)]
    if isinstance(obj, Mapping):
        return [m for v in obj.values() for m in _models_of(v)]
    if isinstance(obj, (list, tuple)):
        return [m for v in obj for m in _models_of(v)]
    return []


def _model_of(
    optimizer: torch.optim.Optimizer, models: list[torch.nn.Module], func: str, key: str
) -> torch.nn.Module:
    """The model whose parameters ``optimizer`` steps (its state dict is keyed by their names)."""
    first = next(p for group in optimizer.param_groups for p in group["params"])
    for model in models:
        if any(p is first for p in model.parameters()):
            return model
    raise bad_value(
        func,
        f"the optimizer at {key!r}",
        type(optimizer).__name__,
        "an optimizer saved or loaded together with its model (its state is keyed by the model's "
        "parameter names)",
        hint=f"pass the model too: {func}({{'model': model, 'optimizer': optimizer}}, ...)",
    )


def _make_temporary(target: Path) -> Path:
    """A new directory beside ``target`` whose name resume's clean-up recognises (the pid is the
    writer's: the directory is stale once that process is gone)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(target.parent, temporaries_of(target))  # those of writers killed before
        temporary = temporary_beside(target)
        temporary.mkdir()
    except OSError as e:
        raise write_failed("save_checkpoint", target, e) from e
    return temporary


def _finish(rest: Any, digests: dict[str, tuple[int, int]], temporary: Path, target: Path) -> None:
    """:func:`_complete`, or the temporary directory removed when it fails."""
    try:
        _complete(rest, digests, temporary, target)
    except BaseException as e:
        shutil.rmtree(temporary, ignore_errors=True)
        if isinstance(e, OSError):
            raise write_failed("save_checkpoint", target, e) from e
        raise


def _complete(rest: Any, digests: dict[str, tuple[int, int]], temporary: Path, target: Path) -> None:
    """rest.pt and the shards' checksums into the complete directory, then the directory renamed
    to ``target``."""
    from .shard_checksums import write_manifest

    with open(temporary / REST, "xb") as f:
        save_with_checksum(rest, f)
        f.flush()
        os.fsync(f.fileno())
    write_manifest(temporary, digests)
    fsync_dir(temporary)
    if os.path.lexists(target):  # a directory cannot replace another in one rename: move it aside
        old = temporary_beside(target)  # a crash before the rmtree leaves it for resume's clean-up
        os.rename(target, old)
        os.rename(temporary, target)
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    else:
        os.rename(temporary, target)
    fsync_dir(target.parent)


# ============================================================================ load
def load_sharded(target: Path, to: Any, location: Any, weights_only: bool, load_into: Any) -> Any:
    """Load the sharded checkpoint directory ``target`` into ``to``'s objects; the checkpoint
    (``rest.pt``'s values, each DCP entry replaced by the state dict loaded). Every rank calls it.

    ``load_into(live, saved, where)`` loads the other entries (checkpoint.py's loader)."""
    from .shard_checksums import ShardCheck

    check = ShardCheck(target)  # each rank's share of the files, hashed while the load plans
    try:
        rest, plan = on_every_rank(lambda: _plan(target, to, location, weights_only), _load_failed)
    except BaseException:
        check.faults()  # no thread left reading the files when rest.pt failed
        raise
    _load_checked(target, check, {key: template for key, (_, template, _) in plan.items()})
    return on_every_rank(lambda: _apply(plan, rest, to, load_into), _load_failed)


def _load_checked(target: Path, check: Any, entries: dict[str, Any]) -> None:
    """DCP's load of ``entries`` from ``target`` through a :class:`~.shard_reader.CheckedReader`: no
    tensor changes unless every rank's share of the files matched; CheckpointCorruptError on every
    rank naming each damaged file otherwise."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import load

    from ..collectives import all_gather_object
    from ..context import current
    from .shard_reader import CheckedReader

    try:
        with _quiet_without_process_group() as no_dist:  # DCP raises on every rank when one fails
            load(entries, storage_reader=CheckedReader(str(target), check), no_dist=no_dist)
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        faults = check.faults()
        if isinstance(e, CheckpointException) and current().world_size > 1:  # raised on every rank
            faults = {k: v for found in all_gather_object(faults) for k, v in found.items()}
        if faults:
            raise check.error(faults) from e
        raise


def _load_failed(rank: int) -> str:
    return f"onedist.load_checkpoint: rank {rank} failed"


def _plan(
    target: Path, to: Any, location: Any, weights_only: bool
) -> tuple[Any, dict[str, tuple[Any, Any, Any]]]:
    """rest.pt, and for each DCP entry: (the live object, the state dict DCP fills, its model)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from .wrappers import unwrap

    rest = load_verified(target / REST, location, weights_only)
    models = _models_of(to)
    plan: dict[str, tuple[Any, Any, Any]] = {}
    for key, path in _placeholders(rest):
        live = _find(to, path)
        if live is None:  # not asked for: it comes back as None (it loads only into a live object)
            continue
        if isinstance(live, torch.nn.Module):
            plan[key] = (live, get_model_state_dict(unwrap(live)), None)
        elif isinstance(live, torch.optim.Optimizer):
            model = _model_of(live, models, "load_checkpoint", key)
            # on a fresh optimizer torch builds its state first (a step with zero gradients)
            plan[key] = (live, get_optimizer_state_dict(model, live), model)
        else:
            raise bad_type(
                "load_checkpoint",
                f"to[{key!r}]" if key else "to",
                live,
                f"the live model or optimizer to load the sharded entry {key!r} of {str(target)!r} into",
                hint="a sharded checkpoint's model and optimizer state load only into live objects: "
                "load_checkpoint(path, {'model': model, 'optimizer': optimizer})",
            )
    return rest, plan


def _placeholders(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[str, tuple[Any, ...]]]:
    """Each DCP entry's key, and where its placeholder sits in rest.pt (the dict keys and list
    indices themselves: a key may hold a dot, or be an int)."""
    if isinstance(value, str) and value.startswith(_PLACEHOLDER):
        return [(value[len(_PLACEHOLDER) :], path)]
    if isinstance(value, Mapping):
        return [p for k, v in value.items() for p in _placeholders(v, (*path, k))]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in _placeholders(v, (*path, i))]
    return []


def _find(to: Any, path: tuple[Any, ...]) -> Any:
    """The object of ``to`` at ``path``, or None."""
    live = to
    for part in path:
        found = (isinstance(live, Mapping) and part in live) or (
            isinstance(live, (list, tuple)) and isinstance(part, int) and part < len(live)
        )
        if not found:
            return None
        live = live[part]
    return live


def _apply(plan: dict[str, tuple[Any, Any, Any]], rest: Any, to: Any, load_into: Any) -> Any:
    """The loaded state dicts set into their live objects; the other entries loaded as
    load_checkpoint loads a file's; the checkpoint with the state dicts in place."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    from .wrappers import unwrap

    for live, state, model in plan.values():
        if model is None:
            set_model_state_dict(unwrap(live), state)
        else:
            set_optimizer_state_dict(model, live, state)
    loaded = _filled(rest, "", {key: state for key, (_, state, _) in plan.items()})
    if to is not None and "" not in plan:  # "": the checkpoint is one sharded model, loaded above
        load_into(_without(to, plan), _without(loaded, plan), "to")
    return loaded


def _filled(value: Any, key: str, states: dict[str, Any]) -> Any:
    if isinstance(value, str) and value.startswith(_PLACEHOLDER):
        return states.get(value[len(_PLACEHOLDER) :])
    if isinstance(value, Mapping):
        return {k: _filled(v, _join(key, k), states) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_filled(v, _join(key, i), states) for i, v in enumerate(value)]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def _without(value: Any, plan: dict[str, Any], key: str = "") -> Any:
    """``value`` with the DCP entries (already loaded) left out of dicts and None in lists (which
    load_checkpoint's loader skips): what is left for that loader."""
    if isinstance(value, Mapping):
        return {k: _without(v, plan, _join(key, k)) for k, v in value.items() if _join(key, k) not in plan}
    if isinstance(value, (list, tuple)):
        return [
            None if _join(key, i) in plan else _without(v, plan, _join(key, i)) for i, v in enumerate(value)
        ]
    return value
