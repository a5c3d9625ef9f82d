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

Each rank's own state (:mod:`.run_state`: its RNG states, its loader's position, the count of
:func:`~onedist.accumulate` and an open window's gradients) is gathered to the writer and given
back to the same rank. At another world size than the saving run's, the model, optimizer,
scheduler, extra state, step and count of micro-steps are restored exactly; the RNG states and an
open window's gradients are not (rank 0 warns), and the loader continues after as many batches
as rank 0's had yielded (which samples those are depends on the world size).
"""

from __future__ import annotations

import logging
import os
import pickle
import re
from pathlib import Path
from typing import Any, Optional

import torch

from ..errors import CheckpointCorruptError, bad_type, bad_value
from ..log import log_shown
from .checkpoint import PathLike, load_checkpoint, save_checkpoint
from .files import remove_stale_temporaries
from .positions import track
from .rng import own_tensors, set_rng_state

__all__ = ["Resumed", "checkpoint_path", "remove_stale_temp_files", "resume", "save_training_state"]

logger = logging.getLogger("onedist")

_NAME = re.compile(r"step_(\d{8,})\.pt")
# save_checkpoint's temporary file for a step checkpoint: .step_<step>.pt.<writer pid>.<12 hex>.tmp
_TEMP = re.compile(r"\.step_\d{8,}\.pt\.(\d+)\.[0-9a-f]{12}\.tmp")
# an extra value that is not plain data is kept pickled, as this one-key dict
_PICKLED = "onedist.pickled"


def checkpoint_path(directory: PathLike, step: int) -> Path:
    """The file of step ``step``'s checkpoint in ``directory``: ``step_<step:08d>.pt``.

    Example:
        >>> import onedist as od
        >>> str(od.checkpoint_path("/tmp/run", 120))
        '/tmp/run/step_00000120.pt'
    """
    return _directory("checkpoint_path", directory) / f"step_{_step('checkpoint_path', step):08d}.pt"


class Resumed(int):
    """The step :func:`resume` continues from: an ``int``, with the extra values it brought back.

    Attributes:
        extra: each extra value :func:`save_training_state` saved, by its keyword (an object given
            to ``resume`` under that keyword has its state loaded and is the value), and each
            keyword given to ``resume`` that the checkpoint lacks (a fresh start: all of them),
            with the value given.

    Example:
        >>> step = Resumed(7, {"epoch": 2})
        >>> step + 1, step.extra["epoch"]
        (8, 2)
    """

    extra: dict[str, Any]

    def __new__(cls, step: int, extra: Optional[dict[str, Any]] = None) -> Resumed:
        resumed = super().__new__(cls, step)
        resumed.extra = dict(extra or {})
        return resumed


def save_training_state(
    directory: PathLike,
    step: int,
    *,
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    sampler: Any = None,
    loader: Any = None,
    rank: int = 0,
    **extra: Any,
) -> Path:
    """Save what :func:`resume` needs to continue after ``step`` steps, bit for bit.

    Writes :func:`checkpoint_path` ``(directory, step)`` with :func:`~onedist.save_checkpoint`
    (``rank`` writes, atomically; every rank returns once the file exists). Every rank must call
    it: each rank's own state travels to the writer in one gather: its RNG states (ranks draw
    different random numbers), its loader's position, :func:`~onedist.accumulate`'s count for
    ``model`` and, when saved inside an accumulation window, the gradients it accumulated there
    (its own micro-batches'; the checkpoint then holds one copy of them per rank). Inside
    :func:`~onedist.join` after ranks left their loops, those ranks send theirs too.

    Args:
        directory: the folder of this run's checkpoints (created if missing).
        step: the number of optimizer steps done, an int >= 0.
        model: a model, wrapped (DDP) or not; saved unwrapped.
        optimizer: an optimizer (anything with ``state_dict()``).
        scheduler: an LR scheduler (anything with ``state_dict()``).
        sampler: onedist's :class:`~onedist.DistributedSampler`: its epoch and position. Save
            mid-epoch only with ``num_workers=0`` (see its ``state_dict``); ``loader`` has none
            of these limits.
        loader: the training ``DataLoader`` (:func:`~onedist.auto_dataloader`'s or your own),
            given to :func:`resume` at the run's start: the batches its current pass yielded,
            its sampler's state, the RNG states at the pass's start.
        rank: the global rank that writes.
        **extra: more state, by name: objects with ``state_dict()`` (an EMA model, a GradScaler,
            a metric) save their state dict; other values (an epoch, a best score, a dict) are
            saved as they are, pickled when they are not plain data (numbers, strings, bytes,
            tensors, and lists, tuples and dicts of them).

    Returns:
        The checkpoint's path.

    Example:
        >>> import torch, onedist as od
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> od.save_training_state("/tmp/od-resume-doc", 5, model=model, optimizer=opt, best=0.5).name
        'step_00000005.pt'
    """
    from ..context import get_rank, get_world_size
    from .join import gather_rank_states
    from .positions import check_loader
    from .run_state import rank_state

    func = "save_training_state"
    target = checkpoint_path(directory, step)
    _check_objects(func, model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler)
    if loader is not None:
        check_loader(func, loader)
    saved_extra = {name: _extra_value(func, name, value) for name, value in extra.items()}
    here = rank_state(model, loader)
    ranks = [here] if get_world_size() == 1 else gather_rank_states(here, dst=rank)
    state: dict[str, Any] = {"step": step, "ranks": [own_tensors(r) for r in ranks]}
    for key, value in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler)):
        if value is not None:
            state[key] = value
    if sampler is not None:
        state["sampler"] = sampler.state_dict()
    if saved_extra:
        state["extra"] = saved_extra
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
    loader: Any = None,
    **extra: Any,
) -> Resumed:
    """Load the newest checkpoint of ``directory`` back; the step to continue from (0: none).

    The newest is the ``step_<n>.pt`` with the largest ``n`` (:func:`save_training_state`'s
    names; temporary files of an interrupted write are ignored). Its state goes back into the
    objects given (a DDP model's module; the same objects ``save_training_state`` got), and this
    rank's own state comes back: :func:`~onedist.accumulate`'s count and an open window's
    gradients, and its RNG states, at once or, when ``loader`` (or ``sampler``) was saved
    mid-epoch, when the loader's next pass starts, after the ``DataLoader`` drew its base seed
    from the global RNG as it did at that epoch's start (at another world size, what is each
    rank's own is not restored: see the module). Rank 0 logs the step. Every rank must call it.

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
        loader: the training ``DataLoader``: its next pass continues where the saved run's was
            (give it on a fresh start too: from then on it counts the batches it yields, which
            :func:`save_training_state` saves).
        **extra: the extra state saved by name: an object with ``load_state_dict`` gets its saved
            state (a warning when the checkpoint has none); another value is the default.

    Returns:
        The step of the checkpoint loaded, or 0 when there is none: a :class:`Resumed`, an ``int``
        whose ``extra`` holds the extra values.

    Raises:
        CheckpointCorruptError: on every rank when there are checkpoints and none is intact,
            listing each file and its fault (the files stay where they are).

    Example:
        >>> import torch, onedist as od
        >>> model = torch.nn.Linear(4, 2)
        >>> od.save_training_state("/tmp/od-resume-doc", 7, model=model, epoch=2)
        PosixPath('/tmp/od-resume-doc/step_00000007.pt')
        >>> fresh = torch.nn.Linear(4, 2)
        >>> step = od.resume("/tmp/od-resume-doc", model=fresh, epoch=0)
        >>> step, step.extra["epoch"], torch.equal(fresh.weight, model.weight)
        (7, 2, True)
        >>> od.resume("/tmp/od-resume-doc/empty", model=fresh, epoch=0).extra
        {'epoch': 0}
    """
    from ..context import get_rank

    func = "resume"
    folder = _directory(func, directory)
    _check_objects(func, model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler)
    if loader is not None:
        track(loader, func)
    steps = _listed_by_rank_0(folder)
    if not steps:
        if get_rank() == 0:
            log_shown(logger, logging.INFO, "onedist.resume: no checkpoint in %s; starting at step 0", folder)
        return Resumed(0, extra)
    objects = (("model", model), ("optimizer", optimizer), ("scheduler", scheduler))
    live = {k: v for k, v in objects if v is not None}
    step, path, state = _newest_intact(folder, steps, live)
    values = _restore_extra(state, path, extra)
    _restore_ranks(state, path, model, sampler, loader)
    if get_rank() == 0:
        log_shown(logger, logging.INFO, "onedist.resume: resumed from step %d (%s)", step, path)
    return Resumed(step, values)


def _listed_by_rank_0(folder: Path) -> list[int]:
    """The steps of ``folder``, newest first, as rank 0 lists them after cleaning the folder (the
    ranks of a job share it: one of them cleans it; every rank tries the files rank 0 listed)."""
    from ..collectives import broadcast_object
    from ..context import get_rank, get_world_size

    if get_rank() == 0:
        remove_stale_temp_files(folder)
    steps = steps_newest_first(folder)
    return broadcast_object(steps, src=0) if get_world_size() > 1 else steps


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


def _restore_ranks(state: dict[str, Any], path: Path, model: Any, sampler: Any, loader: Any) -> None:
    """This rank's own state back (:mod:`.run_state`); its RNG states at once, or when the
    loader's (or sampler's) resumed pass starts."""
    from ..context import get_rank, get_world_size
    from .accumulation import restore_pending_gradients, set_micro_steps
    from .positions import continue_from
    from .samplers import DistributedSampler

    entries = state.get("ranks")
    if entries is None:  # saved by onedist 0.x before issue 51: RNG states only
        entries = [{"rng": rng} for rng in state.get("rng", [])]
    same = len(entries) == get_world_size()
    mine: Optional[dict[str, Any]] = entries[get_rank()] if same else None
    here = mine if mine is not None else (entries[0] if entries else {})
    if not same and get_rank() == 0:
        window = (
            " nor the gradients of the open accumulation window"
            if any("gradients" in e for e in entries)
            else ""
        )
        logger.warning(
            "onedist.resume: %s was saved by %d ranks, this run has %d: the RNG states are not restored%s",
            path,
            len(entries),
            get_world_size(),
            window,
        )

    def restore_rng() -> None:
        if mine is not None:
            set_rng_state(mine["rng"])

    if model is not None and "micro_steps" in here:
        calls, open_window = here["micro_steps"]
        set_micro_steps(model, int(calls), bool(open_window))
        if mine is not None and "gradients" in mine:
            restore_pending_gradients(model, mine["gradients"])
    if sampler is None and loader is not None and isinstance(loader.sampler, DistributedSampler):
        sampler = loader.sampler
    if loader is not None and "loader" in here:
        continue_from(loader, here["loader"], same, restore_rng)
    elif sampler is not None and "sampler" in state:
        sampler.load_state_dict(state["sampler"], at_start=restore_rng)
    else:
        restore_rng()


def _extra_value(func: str, name: str, value: Any) -> Any:
    """What the checkpoint keeps of extra ``name``: the object (save_checkpoint saves its state
    dict), a plain value as it is, anything else pickled."""
    if not isinstance(value, type) and callable(getattr(value, "state_dict", None)):
        return value
    if _plain(value):
        return value
    try:
        return {_PICKLED: pickle.dumps(value)}
    except Exception as e:
        raise bad_value(
            func, name, value, f"an object with state_dict() or a picklable value (pickling it raised {e!r})"
        ) from e


def _plain(value: Any) -> bool:
    """Whether ``torch.load(weights_only=True)`` reads ``value`` back as it is."""
    if (
        value is None
        or type(value) in (bool, int, float, str, bytes, complex)
        or isinstance(value, torch.Tensor)
    ):
        return True
    if type(value) in (list, tuple):
        return all(_plain(v) for v in value)
    if type(value) is dict:
        return all(type(k) in (str, int) and _plain(v) for k, v in value.items())
    return False


def _restore_extra(state: dict[str, Any], path: Path, given: dict[str, Any]) -> dict[str, Any]:
    """The extra values: the saved ones (loaded into the objects given for them), then the
    defaults given for names the checkpoint lacks."""
    from ..context import get_rank
    from .wrappers import unwrap

    saved = state.get("extra") or {}
    values: dict[str, Any] = {}
    for name, value in saved.items():
        if isinstance(value, dict) and set(value) == {_PICKLED}:
            value = pickle.loads(value[_PICKLED])  # saved by this run's own save_training_state
        values[name] = value
    for name, obj in given.items():
        stateful = not isinstance(obj, type) and callable(getattr(obj, "load_state_dict", None))
        if name in saved and stateful:
            target = unwrap(obj) if isinstance(obj, torch.nn.Module) else obj
            target.load_state_dict(values[name])
            values[name] = obj
        elif name not in saved:
            values[name] = obj
            if stateful and get_rank() == 0:
                logger.warning(
                    "onedist.resume: %s holds no %r (its extra state: %s): %s was left as it was",
                    path,
                    name,
                    sorted(saved),
                    name,
                )
    return values


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
