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
(:func:`remove_stale_temp_files`).
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from ..errors import bad_type, bad_value
from ..log import log_shown
from .checkpoint import PathLike, load_checkpoint, save_checkpoint

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
    at that epoch's start. Rank 0 logs the step. Every rank must call it (rank 0 picks the file,
    one small broadcast).

    Args:
        directory: the folder :func:`save_training_state` writes to; it need not exist yet.
        model: the model to load into (a DDP model's module is loaded), or None.
        optimizer: the optimizer to load into, or None.
        scheduler: the LR scheduler to load into, or None.
        sampler: onedist's :class:`~onedist.DistributedSampler`: continues at the saved epoch and
            position, or None.

    Returns:
        The step of the checkpoint loaded, or 0 when there is none.

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
    step = newest_step(folder)
    if get_world_size() > 1:
        step = broadcast_object(step, src=0)  # every rank loads the file rank 0 picked
    if step is None:
        if get_rank() == 0:
            log_shown(logger, logging.INFO, "onedist.resume: no checkpoint in %s; starting at step 0", folder)
        return 0
    live = {
        k: v
        for k, v in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler))
        if v is not None
    }
    path = checkpoint_path(folder, step)
    state = load_checkpoint(path, live, map_location="cpu")
    _restore_rng(state, path, sampler)
    if get_rank() == 0:
        log_shown(logger, logging.INFO, "onedist.resume: resumed from step %d (%s)", step, path)
    return int(step)


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
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return None
    steps = [int(m.group(1)) for m in map(_NAME.fullmatch, names) if m is not None]
    return max(steps, default=None)


def remove_stale_temp_files(directory: PathLike) -> list[str]:
    """Delete the temporary files of step checkpoints whose writer is gone; the names deleted.

    A writer killed during its write (a restart's cause) leaves ``.step_<n>.pt.<pid>.<id>.tmp``
    behind (a directory, for a sharded checkpoint): never loaded, but as large as a checkpoint,
    one more per kill. The pid in the name
    tells whether its writer still runs on this host; a file whose writer runs (or whose pid
    belongs to another user's process) is kept. Other files are never touched.

    Example:
        >>> import os, tempfile
        >>> folder = tempfile.mkdtemp()
        >>> dead = 2**22 + 1  # above the kernel's largest pid: no such process
        >>> open(os.path.join(folder, f".step_00000005.pt.{dead}.0123456789ab.tmp"), "w").close()
        >>> remove_stale_temp_files(folder), os.listdir(folder)
        (['.step_00000005.pt.4194305.0123456789ab.tmp'], [])
    """
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    for name in names:
        m = _TEMP.fullmatch(name)
        if m is None or _process_exists(int(m.group(1))):
            continue
        try:
            _remove(os.path.join(directory, name))
        except FileNotFoundError:
            continue
        removed.append(name)
    if removed:
        log_shown(
            logger,
            logging.INFO,
            "onedist: removed %d temporary file(s) of interrupted checkpoint writes",
            len(removed),
        )
    return removed


def _remove(path: str) -> None:
    """Delete a temporary file, or a sharded checkpoint's temporary directory."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # no such process (or no such pid at all)
        return False
    except PermissionError:
        return True  # another user's process: not ours to judge
    return True


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
