"""Checkpoints that work the same in every world: one rank writes atomically, every rank loads.

* :func:`save_checkpoint` turns models (wrapped or not), optimizers, LR schedulers, GradScalers
  (anything with ``state_dict()``) into state dicts, writes them from one rank to a temporary file
  that replaces the target only when complete, and returns on every rank once the file is there.
* :func:`load_checkpoint` loads on every rank onto :func:`onedist.device` and can load the state
  dicts back into live objects: a checkpoint of a DDP model loads into a plain one and back.

Every file ends with the CRC-32 of its bytes, computed as they are written and checked before
torch reads them (:mod:`.checksums`): a damaged file raises :class:`~onedist.CheckpointCorruptError`
on every rank instead of loading wrong values. A failure on one rank (no space left, a missing
file) raises on every rank instead of leaving the others waiting in the next collective.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Union

import torch

from ..errors import OnedistError, bad_type, bad_value
from .checksums import load_mapped, load_verified, save_with_checksum
from .files import fsync_dir, remove_stale_temporaries, temporaries_of, temporary_beside, write_failed
from .full_checkpoint import gathered, load_into_shards, strip_prefixes
from .outcomes import on_every_rank, on_writer
from .sharded_checkpoint import holds_sharded, is_sharded_checkpoint, load_sharded, save_sharded

__all__ = ["CheckpointNotFoundError", "load_checkpoint", "save_checkpoint"]

PathLike = Union[str, "os.PathLike[str]"]


class CheckpointNotFoundError(OnedistError, FileNotFoundError):
    """:func:`load_checkpoint` found no file at the path (raised on every rank that lacks it)."""


# ============================================================================ save
def save_checkpoint(obj: Any, path: PathLike, *, rank: int = 0, full: bool = False) -> None:
    """Write ``obj`` to ``path`` from one rank, atomically; every rank returns once it is written.

    Each value of ``obj`` (a dict, searched through nested dicts/lists/tuples; or a single
    object) that has a ``state_dict()`` is replaced by it: a model, DDP/DataParallel-wrapped or
    not, saves the state of the module inside (:func:`onedist.unwrap`), so its keys carry no
    ``module.`` prefix; optimizers, LR schedulers, GradScalers save theirs. Other values (epoch,
    config, tensors) are saved as they are.

    Only ``rank`` writes: ``torch.save`` to a temporary file in the same directory (created if
    missing), followed by the CRC-32 of every byte written (checked by :func:`load_checkpoint`),
    ``fsync``, then ``os.replace`` onto ``path``, so a crash never leaves a truncated checkpoint
    behind; temporary files of ``path`` whose writer was killed are deleted first. One small
    collective then tells every rank the outcome: all return after the file exists, or all raise
    if the write failed (the writer its own error, the others :class:`~onedist.RemoteRankError`).
    A full disk, a missing permission or a read-only file system raises an ``OSError`` of that
    errno naming ``path``, what the errno means and the fix; the file at ``path`` is then
    unchanged and no temporary file is left. Every rank must call it.

    A sharded model (``auto_model(sharding="fsdp")``) in ``obj`` makes ``path`` a directory that
    every rank writes its own shards into (torch.distributed.checkpoint), its optimizer's state
    included: no rank gathers the whole model, and it loads at another world size. The other
    values go to ``rest.pt`` in it; the directory, too, appears at ``path`` only when complete
    (docs/training.md, "Sharded checkpoints"). With ``full=True`` a sharded model is gathered to
    ``rank`` one tensor at a time instead (``rank`` holds the model once, the others one tensor)
    and ``path`` is one file, as for an unsharded model: an export, which loads into a model in
    one process, into DDP, or into a sharded model (:func:`load_checkpoint` reads each rank's
    shards of it); a sharded model's optimizer is refused there (its state stays sharded).

    Args:
        obj: what to save, usually a dict such as ``{"model": model, "optimizer": opt, "epoch": 3}``.
        path: the file (a directory, for a sharded model) to write.
        rank: the global rank that writes (the others need not build the state dicts).
        full: with a sharded model in ``obj``: False (default) writes a sharded checkpoint, True one
            file with the whole model. Without one, the file is one either way.

    Example:
        >>> import torch, onedist as od
        >>> model = od.auto_model(torch.nn.Linear(4, 2))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> od.save_checkpoint({"model": model, "optimizer": opt, "epoch": 3}, "/tmp/ckpt/last.pt")
        >>> od.load_checkpoint("/tmp/ckpt/last.pt")["epoch"]
        3
    """
    from ..context import current

    b = current()
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise bad_type("save_checkpoint", "rank", rank, "an int (the global rank that writes)")
    if not 0 <= rank < b.world_size:
        raise bad_value("save_checkpoint", "rank", rank, f"a global rank in 0..{b.world_size - 1}")
    if isinstance(obj, (str, os.PathLike)) and not isinstance(path, (str, os.PathLike)):
        raise bad_type(
            "save_checkpoint",
            "path",
            path,
            "a file path (str or os.PathLike)",
            hint=f"the arguments are (obj, path), as torch.save's; Fabric's save(path, state) has them "
            f"the other way round: od.save_checkpoint(state, {os.fspath(obj)!r})",
        )
    if not isinstance(full, bool):
        raise bad_type("save_checkpoint", "full", full, "a bool (True: a sharded model as one file)")
    target = _check_path("save_checkpoint", path)
    sharded = holds_sharded(obj)
    if sharded and not full:  # every rank writes its shards into a directory at path
        save_sharded(obj, target, rank, _state_of)
        return
    if b.world_size == 1:
        _write(_state_of(obj), target)
        return
    state = gathered(obj, rank, _state_of) if sharded else None  # to the writer, a tensor at a time
    # every rank waits here until the writer is done: returning means the file exists
    on_writer(
        rank,
        lambda: _write(state if sharded else _state_of(obj), target),
        f"onedist.save_checkpoint: rank {rank} could not write the checkpoint {str(target)!r}",
    )


def _check_path(func: str, path: Any) -> Path:
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise bad_type(func, "path", path, "a file path (str or os.PathLike)")
    return Path(os.fspath(path))


def _state_of(value: Any) -> Any:
    """``value`` with every object that has a ``state_dict()`` replaced by it (containers searched)."""
    from .wrappers import unwrap

    if isinstance(value, torch.nn.Module):
        return unwrap(value).state_dict()
    if _has_method(value, "state_dict"):
        return value.state_dict()
    if isinstance(value, Mapping):
        return {k: _state_of(v) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_state_of(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_state_of(v) for v in value)
    return value


def _has_method(value: Any, name: str) -> bool:
    return not isinstance(value, type) and callable(getattr(value, name, None))


def _write(state: Any, target: Path) -> None:
    """``state`` to ``target`` through a temporary file, with its checksum; an OSError (a full disk,
    no permission, a read-only file system) raised as :func:`write_failed`'s clear one."""
    try:
        _write_atomically(state, target)
    except OSError as e:
        raise write_failed("save_checkpoint", target, e) from e


def _write_atomically(state: Any, target: Path) -> None:
    directory = target.parent
    directory.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(directory, temporaries_of(target))  # those of writers killed before
    tmp = temporary_beside(target)
    try:
        with open(tmp, "xb") as f:  # honours the umask, unlike mkstemp's 0600
            save_with_checksum(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    fsync_dir(directory)


# ============================================================================ load
def load_checkpoint(
    path: PathLike,
    to: Any = None,
    *,
    map_location: Any = None,
    weights_only: bool = True,
) -> Any:
    """Load a checkpoint on every rank; optionally load its state dicts into live objects.

    Every rank reads the file (onto :func:`onedist.device` unless ``map_location`` says
    otherwise), then one small collective tells every rank whether all ranks succeeded, so a rank
    that cannot read it makes every rank raise rather than hang in the next collective. Every
    rank must call it.

    Before torch reads a byte, the file's CRC-32 is checked against the one
    :func:`save_checkpoint` wrote: a flipped bit, a file cut short, emptied or unreadable raises
    :class:`~onedist.CheckpointCorruptError` on every rank, naming the file and what did not
    match; nothing is loaded into ``to``. The checked file is read through the memory map that was
    hashed, and every loaded tensor then copied into memory of its own (nothing depends on the
    file afterwards). A file without a checksum (saved before onedist wrote them, or by another tool) loads as
    before, with a warning that it cannot be verified.

    With ``to``, each of its values that has ``load_state_dict`` gets the checkpoint's entry of
    the same key (nested dicts/lists/tuples are followed): a model is loaded into
    :func:`onedist.unwrap` of it, so wrapped and unwrapped models load each other's checkpoints;
    a ``module.`` (or ``_orig_mod.``) prefix on every saved key, as other tools write, is removed
    when the model's own keys lack it. ``to`` may also be a single object (a model) for a
    checkpoint saved from a single object.

    A sharded checkpoint (the directory :func:`save_checkpoint` writes for a sharded model) loads
    its model and optimizer state into live objects of ``to`` only (None when absent): a sharded
    model at any world size, or an unsharded one (each rank reads the whole tensors). DCP pickles
    its index, so ``weights_only`` covers its ``rest.pt`` only: load sharded checkpoints you trust.

    A one-file checkpoint loads into a sharded model in ``to`` with each rank copying only its
    chunks from the mapped file (docs/training.md, "A one-file checkpoint into the shards").

    Args:
        path: the checkpoint file (or a sharded checkpoint's directory).
        to: None, or live objects to load into, e.g. ``{"model": model, "optimizer": opt}``; the
            checkpoint may hold more keys (an epoch, a config), not fewer.
        map_location: passed to ``torch.load``; default :func:`onedist.device`.
        weights_only: passed to ``torch.load``: True (the default) loads tensors, numbers,
            strings, containers; False also loads arbitrary pickled objects (trusted files only).

    Returns:
        The loaded checkpoint (the state dicts, not the live objects).

    Raises:
        CheckpointNotFoundError: on every rank without the file (a ``FileNotFoundError``), naming
            the path; the other ranks raise :class:`~onedist.RemoteRankError`.
        CheckpointCorruptError: on every rank, when any rank finds the file (or a shard of a
            sharded checkpoint) damaged, naming it and what did not match.

    Example:
        >>> import torch, onedist as od
        >>> model = od.auto_model(torch.nn.Linear(4, 2))          # DDP-wrapped when distributed
        >>> od.save_checkpoint({"model": model, "epoch": 3}, "/tmp/ckpt/last.pt")
        >>> fresh = torch.nn.Linear(4, 2)                           # resuming: a plain model
        >>> ckpt = od.load_checkpoint("/tmp/ckpt/last.pt", {"model": fresh})
        >>> ckpt["epoch"] + 1, torch.equal(fresh.weight, od.unwrap(model).weight)
        (4, True)
    """
    from ..context import current, device

    b = current()
    target = _check_path("load_checkpoint", path)
    if not isinstance(weights_only, bool):
        raise bad_type("load_checkpoint", "weights_only", weights_only, "a bool")
    location = device() if map_location is None else map_location
    if is_sharded_checkpoint(target):
        return load_sharded(target, to, location, weights_only, _load_into)
    return _load_file(target, to, b.rank, location, weights_only)


def _load_file(target: Path, to: Any, rank: int, location: Any, weights_only: bool) -> Any:
    """:func:`load_checkpoint` of the one file ``target``."""
    if holds_sharded(to):  # each rank reads its shards' bytes of the file only
        read = functools.partial(_read_here, target, rank, lambda: load_mapped(target, weights_only))
        return load_into_shards(to, read, location, _load_into, str(target))
    state = on_every_rank(
        lambda: _read_here(target, rank, lambda: load_verified(target, location, weights_only)),
        lambda r: f"onedist.load_checkpoint: rank {r} could not load {str(target)!r}",
    )
    if to is not None:  # only once every rank read it intact: a failed load changes no live object
        on_every_rank(
            lambda: _load_into(to, state, "to"),
            lambda r: f"onedist.load_checkpoint: rank {r} could not load {str(target)!r} into `to`",
        )
    return state


def _read_here(target: Path, rank: int, load: Callable[[], Any]) -> Any:
    """This rank's read of ``target`` (``load()``, which checks it against its checksum)."""
    if not target.is_file():
        what = "a directory" if target.is_dir() else "no file"
        raise CheckpointNotFoundError(
            f"onedist.load_checkpoint: there is {what} at {str(target)!r} (rank {rank})\n"
            "HINT: check the path; save_checkpoint returns on every rank only after the file exists, "
            "and every rank must see the same filesystem"
        )
    return load()


def _load_into(live: Any, saved: Any, where: str) -> None:
    from .wrappers import unwrap

    if live is None:  # nothing to load into here (a sharded checkpoint's entry, loaded already)
        return
    if isinstance(live, torch.nn.Module):
        module = unwrap(live)
        if not isinstance(saved, Mapping):
            raise bad_type(
                "load_checkpoint", f"the checkpoint's entry for {where}", saved, "a model state dict"
            )
        module.load_state_dict(strip_prefixes(saved, module))
        return
    if _has_method(live, "load_state_dict"):
        live.load_state_dict(saved)
        return
    if isinstance(live, Mapping):
        if not isinstance(saved, Mapping):
            raise bad_type("load_checkpoint", f"the checkpoint's entry for {where}", saved, "a dict")
        missing = [k for k in live if k not in saved]
        if missing:
            raise bad_value(
                "load_checkpoint",
                where,
                f"keys {list(live)}",
                f"keys of the checkpoint ({sorted(map(str, saved))}); missing: {missing}",
            )
        for k, v in live.items():
            _load_into(v, saved[k], f"{where}[{k!r}]")
        return
    if isinstance(live, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(live):
            raise bad_value(
                "load_checkpoint",
                where,
                f"a {type(live).__name__} of {len(live)}",
                f"the checkpoint's entry: {type(saved).__name__}"
                + (f" of {len(saved)}" if isinstance(saved, (list, tuple)) else ""),
            )
        for i, (v, s) in enumerate(zip(live, saved)):
            _load_into(v, s, f"{where}[{i}]")
        return
    raise bad_type(
        "load_checkpoint",
        where,
        live,
        "objects with load_state_dict (models, optimizers, schedulers, scalers) or containers of them",
        hint="plain values (an epoch, a config) are in the returned checkpoint: ckpt = load_checkpoint(path)",
    )
