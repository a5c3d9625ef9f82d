"""Training that resumes: step checkpoints in one directory, and the newest one loaded back.

* :func:`save_training_state` writes ``<directory>/step_<step:08d>.pt`` through
  :func:`~onedist.save_checkpoint` (one rank writes, atomically): the model (unwrapped), the
  optimizer, an LR scheduler, the sampler's epoch and position, and every rank's RNG states
  (torch CPU, CUDA when available, Python's ``random``, NumPy's when installed).
* :func:`resume` finds the newest of those files, loads it back into the same objects, and
  returns the step to continue from: 0 when there is none, so a fresh start and a restart under
  ``onedist run --max-restarts N`` share one code path.

A sharded model (``auto_model(sharding="fsdp")``) makes each step's checkpoint a directory of the
same name, every rank writing its shards (``save_checkpoint``); ``resume`` loads it at the same or
another world size.

Only checkpoints with their final name count: ``save_checkpoint`` writes a temporary file (or
directory) and renames it when complete, so a write cut short (a killed rank) leaves a ``.tmp``
that is never loaded; both functions delete such leftovers once their writer is gone
(:func:`remove_stale_temp_files`). A step whose checkpoint is damaged (its checksum does not
match, it is cut short or unreadable) is skipped for the newest intact one, on every rank alike,
and renamed aside to ``<name>.corrupt``; only when no step is intact does ``resume`` raise.
"""

from __future__ import annotations

import logging
import os
import random
import re
from pathlib import Path
from typing import Any, Optional

import torch

from ..errors import CheckpointCorruptError, bad_type, bad_value
from ..log import log_shown
from .checkpoint import PathLike, load_checkpoint, save_checkpoint
from .files import remove_stale_temporaries

__all__ = ["checkpoint_path", "remove_stale_temp_files", "resume", "save_training_state"]

logger = logging.getLogger("onedist")

_NAME = re.compile(r"step_(\d{8,})\.pt")
# save_checkpoint's temporary file for a step checkpoint: .step_<step>.pt.<writer pid>.<12 hex>.tmp
_TEMP = re.compile(r"\.step_\d{8,}\.pt\.(\d+)\.[0-9a-f]{12}\.tmp")


def checkpoint_path(directory: PathLike, step: int) -> Path:
    """The file of step ``step``'s checkpoint in ``directory``: ``step_<step:08d>.pt``.

    Example:
        >>> import onedist as od
        >>> str(od.checkpoint_path("/tmp/run", 120))
        '/tmp/run/step_00000120.pt'
    """
    return _directory("checkpoint_path", directory) / f"step_{_step('checkpoint_path', step):08d}.pt"


def save_training_state(
    directory: PathLike,
    step: int,
    *,
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    sampler: Any = None,
    rank: int = 0,
) -> Path:
    """Save what :func:`resume` needs to continue after ``step`` steps, bit for bit.

    Writes :func:`checkpoint_path` ``(directory, step)`` with :func:`~onedist.save_checkpoint`
    (``rank`` writes, atomically; every rank returns once the file exists). Every rank must call
    it: each rank's RNG states travel to the writer in one small gather, because ranks may draw
    different random numbers (dropout on different data).

    Args:
        directory: the folder of this run's checkpoints (created if missing).
        step: the number of optimizer steps done, an int >= 0.
        model: a model, wrapped (DDP) or not; saved unwrapped.
        optimizer: an optimizer (anything with ``state_dict()``).
        scheduler: an LR scheduler (anything with ``state_dict()``).
        sampler: onedist's :class:`~onedist.DistributedSampler`: its epoch and position. Save
            mid-epoch only with ``num_workers=0`` (see its ``state_dict``).
        rank: the global rank that writes.

    Returns:
        The checkpoint's path.

    Example:
        >>> import torch, onedist as od
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> od.save_training_state("/tmp/od-resume-doc", 5, model=model, optimizer=opt).name
        'step_00000005.pt'
    """
    from ..collectives import all_gather_object
    from ..context import get_rank, get_world_size

    func = "save_training_state"
    target = checkpoint_path(directory, step)
    _check_objects(func, model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler)
    rng = _rng_state()
    rngs = [rng] if get_world_size() == 1 else [_own_tensors(r) for r in all_gather_object(rng)]
    state: dict[str, Any] = {"step": step, "rng": rngs}
    for key, value in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler)):
        if value is not None:
            state[key] = value
    if sampler is not None:
        state["sampler"] = sampler.state_dict()
    if get_rank() == rank:
        remove_stale_temp_files(target.parent)
    save_checkpoint(state, target, rank=rank)
    return target


def resume(
    directory: PathLike,
    *,
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    sampler: Any = None,
) -> int:
    """Load the newest checkpoint of ``directory`` back; the step to continue from (0: none).

    The newest is the ``step_<n>.pt`` with the largest ``n`` (:func:`save_training_state`'s
    names; temporary files of an interrupted write are ignored). Its state goes back into the
    objects given (a DDP model's module; the same objects ``save_training_state`` got), and this
    rank's RNG states are restored: at once, or, when ``sampler`` was saved mid-epoch, when its
    next pass starts, after the ``DataLoader`` drew its base seed from the global RNG as it did
    at that epoch's start. Rank 0 logs the step. Every rank must call it (rank 0 lists the
    files, one small broadcast).

    A damaged newest step (its checksum does not match, it is cut short, empty or unreadable on
    any rank: :class:`~onedist.CheckpointCorruptError`) is skipped on every rank alike for the
    newest intact one; rank 0 then renames each skipped file to ``<name>.corrupt`` (kept for a
    look, never loaded) and logs a warning naming it and its fault.

    Args:
        directory: the folder :func:`save_training_state` writes to; it need not exist yet.
        model: the model to load into (a DDP model's module is loaded), or None.
        optimizer: the optimizer to load into, or None.
        scheduler: the LR scheduler to load into, or None.
        sampler: onedist's :class:`~onedist.DistributedSampler`: continues at the saved epoch and
            position, or None.

    Returns:
        The step of the checkpoint loaded, or 0 when there is none.

    Raises:
        CheckpointCorruptError: on every rank when there are checkpoints and none is intact,
            listing each file and its fault (the files stay where they are).

    Example:
        >>> import torch, onedist as od
        >>> model = torch.nn.Linear(4, 2)
        >>> od.save_training_state("/tmp/od-resume-doc", 7, model=model)
        PosixPath('/tmp/od-resume-doc/step_00000007.pt')
        >>> fresh = torch.nn.Linear(4, 2)
        >>> od.resume("/tmp/od-resume-doc", model=fresh), torch.equal(fresh.weight, model.weight)
        (7, True)
        >>> od.resume("/tmp/od-resume-doc/empty", model=fresh)
        0
    """
    from ..collectives import broadcast_object
    from ..context import get_rank, get_world_size

    func = "resume"
    folder = _directory(func, directory)
    _check_objects(func, model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler)
    if get_rank() == 0:  # the ranks of a job share the folder: one of them cleans it
        remove_stale_temp_files(folder)
    steps = steps_newest_first(folder)
    if get_world_size() > 1:
        steps = broadcast_object(steps, src=0)  # every rank tries the files rank 0 listed
    if not steps:
        if get_rank() == 0:
            log_shown(logger, logging.INFO, "onedist.resume: no checkpoint in %s; starting at step 0", folder)
        return 0
    live = {
        k: v
        for k, v in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler))
        if v is not None
    }
    step, path, state = _newest_intact(folder, steps, live)
    _restore_rng(state, path, sampler)
    if get_rank() == 0:
        log_shown(logger, logging.INFO, "onedist.resume: resumed from step %d (%s)", step, path)
    return step


def _newest_intact(folder: Path, steps: list[int], live: dict[str, Any]) -> tuple[int, Path, Any]:
    """The newest step whose checkpoint loads intact into ``live``: (step, path, state).

    load_checkpoint raises CheckpointCorruptError on every rank when any rank found the file
    damaged, so every rank skips the same steps. The skipped files are set aside once one step
    loaded; with none intact they stay, and every rank raises listing them."""
    skipped: dict[Path, dict[str, str]] = {}
    for step in steps:
        path = checkpoint_path(folder, step)
        try:
            state = load_checkpoint(path, live, map_location="cpu")
        except CheckpointCorruptError as e:
            skipped[path] = e.faults
            continue
        _set_aside(skipped, step)
        return step, path, state
    faults = {where: fault for found in skipped.values() for where, fault in found.items()}
    listing = "".join(f"\n  {where}: {fault}" for where, fault in faults.items())
    raise CheckpointCorruptError(
        f"onedist.resume: none of the {len(steps)} checkpoint(s) in {str(folder)!r} is intact:{listing}\n"
        "HINT: they are left in place; copy an intact checkpoint there, or move them away to start at step 0",
        faults,
    )


def _set_aside(skipped: dict[Path, dict[str, str]], step: int) -> None:
    """Rank 0 renames each damaged checkpoint to ``<name>.corrupt`` and says why it was skipped."""
    from ..context import get_rank

    if get_rank() != 0:
        return
    for path, faults in skipped.items():
        aside = _unused(path.with_name(path.name + ".corrupt"))
        try:
            os.replace(path, aside)
            kept = f"kept as {aside.name}"
        except OSError as e:
            kept = f"left in place (renaming it failed: {e})"
        why = "; ".join(
            fault if where == str(path) else f"{where}: {fault}" for where, fault in faults.items()
        )
        logger.warning(
            "onedist.resume: skipped the damaged %s (%s); %s; resuming from step %d", path, why, kept, step
        )


def _unused(path: Path) -> Path:
    """``path``, or ``path.2``, ``path.3``... : the first that does not exist."""
    candidate, n = path, 1
    while os.path.lexists(candidate):
        n += 1
        candidate = path.with_name(f"{path.name}.{n}")
    return candidate


def _restore_rng(state: dict[str, Any], path: Path, sampler: Any) -> None:
    """This rank's RNG states back: at once, or when ``sampler``'s resumed pass starts."""
    from ..context import get_rank, get_world_size

    rngs = state["rng"]
    rng = rngs[get_rank()] if len(rngs) == get_world_size() else None
    if rng is None and get_rank() == 0:
        logger.warning(
            "onedist.resume: %s was saved by %d ranks, this run has %d: the RNG states are not restored",
            path,
            len(rngs),
            get_world_size(),
        )

    def restore_rng() -> None:
        if rng is not None:
            _set_rng_state(rng)

    if sampler is not None and "sampler" in state:
        sampler.load_state_dict(state["sampler"], at_start=restore_rng)
    else:
        restore_rng()


def newest_step(directory: PathLike) -> Optional[int]:
    """The largest step with a complete checkpoint in ``directory`` (None: none, or no directory).

    Example:
        >>> newest_step("/tmp/od-resume-doc/none-here") is None
        True
    """
    steps = steps_newest_first(directory)
    return steps[0] if steps else None


def steps_newest_first(directory: PathLike) -> list[int]:
    """The steps with a complete checkpoint in ``directory``, the largest first.

    Example:
        >>> steps_newest_first("/tmp/od-resume-doc/none-here")
        []
    """
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted((int(m.group(1)) for m in map(_NAME.fullmatch, names) if m is not None), reverse=True)


def remove_stale_temp_files(directory: PathLike) -> list[str]:
    """Delete the temporary files of step checkpoints whose writer is gone; the names deleted.

    A writer killed during its write (a restart's cause) leaves ``.step_<n>.pt.<pid>.<id>.tmp``
    behind (a directory, for a sharded checkpoint): never loaded, but as large as a checkpoint,
    one more per kill. The pid in the name tells whether its writer still runs on this host; a
    file whose writer runs (or whose pid belongs to another user's process) is kept. Other files
    are never touched.

    Example:
        >>> import os, tempfile
        >>> folder = tempfile.mkdtemp()
        >>> dead = 2**22 + 1  # above the kernel's largest pid: no such process
        >>> open(os.path.join(folder, f".step_00000005.pt.{dead}.0123456789ab.tmp"), "w").close()
        >>> remove_stale_temp_files(folder), os.listdir(folder)
        (['.step_00000005.pt.4194305.0123456789ab.tmp'], [])
    """
    removed = remove_stale_temporaries(Path(os.fspath(directory)), _TEMP)
    if removed:
        log_shown(
            logger,
            logging.INFO,
            "onedist: removed %d temporary file(s) of interrupted checkpoint writes",
            len(removed),
        )
    return removed


def _directory(func: str, directory: Any) -> Path:
    if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
        raise bad_type(func, "directory", directory, "a directory path (str or os.PathLike)")
    return Path(os.fspath(directory))


def _step(func: str, step: Any) -> int:
    if not isinstance(step, int) or isinstance(step, bool):
        raise bad_type(func, "step", step, "an int >= 0 (the number of optimizer steps done)")
    if step < 0:
        raise bad_value(func, "step", step, "an int >= 0 (the number of optimizer steps done)")
    return step


def _check_objects(func: str, **objects: Any) -> None:
    from .samplers import DistributedSampler

    for name, value in objects.items():
        if value is None:
            continue
        if name == "sampler":
            if not isinstance(value, DistributedSampler):
                raise bad_type(
                    func,
                    "sampler",
                    value,
                    "onedist.DistributedSampler (it knows its epoch and position) or None",
                    hint="od.auto_dataloader(dataset, shuffle=True) gives one: loader.sampler",
                )
        elif name == "model" and not isinstance(value, torch.nn.Module):
            raise bad_type(func, "model", value, "a torch.nn.Module (DDP-wrapped or not) or None")
        elif not callable(getattr(value, "state_dict", None)) or not callable(
            getattr(value, "load_state_dict", None)
        ):
            raise bad_type(func, name, value, "an object with state_dict() and load_state_dict(), or None")


def _rng_state() -> dict[str, Any]:
    """This process's RNG states, in types ``torch.load(weights_only=True)`` reads back."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state["numpy"] = [kind, torch.from_numpy(np.array(keys)), int(pos), int(has_gauss), float(cached)]
    return state


def _own_tensors(value: Any) -> Any:
    """``value`` with each tensor copied into storage of its own: a gathered tensor may be a view
    into one buffer of every rank's bytes, which ``torch.set_rng_state`` misreads (segfault)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _own_tensors(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_own_tensors(v) for v in value)
    return value


def _set_rng_state(state: dict[str, Any]) -> None:
    state = _own_tensors(state)
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            return
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy(), pos, has_gauss, cached))
