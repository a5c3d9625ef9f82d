"""Where a ``DataLoader`` stands in its pass, saved in a step checkpoint and continued on resume.

torch's ``DataLoader`` keeps no position: its iterator counts the batches it yielded, and a new
iterator (a new pass) starts over. :func:`track` makes a loader remember, for its current pass,
the batches its iterator yielded and the RNG states at the pass's start (before the loader drew
its base seed): the loader's ``_get_iterator`` is replaced on the instance by one that wraps the
iterator in :class:`Counted`; nothing else of the loader changes, its class included.

* :func:`position` is what a checkpoint keeps of a tracked loader: the batches its current pass
  yielded, whether the pass is complete, the RNG states at its start, and its sampler's
  ``state_dict()`` when it has one.
* :func:`continue_from` makes the loader's next pass continue from such a position: an
  :class:`~onedist.DistributedSampler` skips the indices of the batches already yielded (no data
  is loaded for them); another sampler with ``load_state_dict`` gets its saved state; any other
  (torch's ``RandomSampler``, ``SequentialSampler``, a ``batch_sampler``) is fast-forwarded by
  loading and dropping the batches already yielded, after the RNG states at the pass's start are
  set back, so it draws the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from torch.utils.data import DataLoader

from ..errors import OnedistValueError, bad_type
from .rng import rng_state, set_rng_state

__all__ = [
    "Continuation",
    "Counted",
    "PassTracker",
    "check_loader",
    "continue_from",
    "position",
    "track",
    "tracker_of",
]

# the attribute of a tracked loader that holds its PassTracker
_ATTRIBUTE = "_onedist_pass_tracker"


@dataclass
class Continuation:
    """What the next pass of a resumed loader does before the training loop sees a batch."""

    #: the RNG states when the saved pass started (set before the iterator draws its base seed)
    rng_at_start: Optional[dict[str, Any]]
    #: batches to load and drop (a sampler that cannot skip indices)
    skip: int
    #: batches the sampler skips by itself (counted as yielded)
    offset: int
    #: what to run once the iterator is ready (the RNG states of the saved step set back)
    then: Optional[Callable[[], None]]


class PassTracker:
    """What :func:`track` keeps on a loader: the batches its current pass yielded, the RNG states
    at that pass's start, and what its next pass does when it continues a saved one."""

    def __init__(self, original: Callable[[], Any]) -> None:
        self._original = original
        #: batches the current pass yielded (None: no pass started since tracking)
        self.batches: Optional[int] = None
        self.rng_at_start: Optional[dict[str, Any]] = None
        self.continuation: Optional[Continuation] = None
        self.saved: Optional[dict[str, Any]] = None  # the resumed position, until its pass starts

    def new_iterator(self) -> Any:
        """The loader's ``_get_iterator``: a new pass (or the first of persistent workers)."""
        go, self.continuation = self.continuation, None
        self.saved = None
        start = rng_state() if go is None or go.rng_at_start is None else go.rng_at_start
        if go is not None and go.rng_at_start is not None:
            set_rng_state(go.rng_at_start)  # the base seed (and workers' seeds) the saved pass drew
        counted = Counted(self._original(), self)
        self.pass_started(start, 0 if go is None else go.offset)
        if go is not None:
            for _ in range(go.skip):
                next(counted)
            if go.then is not None:
                go.then()
        return counted

    def pass_started(self, rng: dict[str, Any], offset: int) -> None:
        self.rng_at_start, self.batches = rng, offset


class Counted:
    """A loader's iterator that counts the batches it yields into its :class:`PassTracker`."""

    def __init__(self, iterator: Any, tracker: PassTracker) -> None:
        self.iterator = iterator
        self.tracker = tracker

    def __iter__(self) -> Counted:
        return self

    def __next__(self) -> Any:
        batch = next(self.iterator)
        self.tracker.batches = (self.tracker.batches or 0) + 1
        return batch

    def __len__(self) -> int:
        return len(self.iterator)

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        """Persistent workers' next pass (``DataLoader.__iter__`` calls it)."""
        self.tracker.pass_started(rng_state(), 0)
        self.iterator._reset(loader, first_iter)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.iterator, name)


def tracker_of(loader: Any) -> Optional[PassTracker]:
    """The :class:`PassTracker` of a tracked loader, else None.

    Example:
        >>> import torch
        >>> loader = torch.utils.data.DataLoader(range(4))
        >>> tracker_of(loader) is None, tracker_of(track(loader)) is not None
        (True, True)
    """
    tracker = getattr(loader, _ATTRIBUTE, None)
    return tracker if isinstance(tracker, PassTracker) else None


def track(loader: Any, func: str = "resume") -> Any:
    """Make ``loader`` (a torch ``DataLoader``) remember its current pass; returns it.

    Example:
        >>> import torch
        >>> loader = track(torch.utils.data.DataLoader(range(6), batch_size=2))
        >>> it = iter(loader); _ = next(it)
        >>> position(loader)["batches"]
        1
    """
    check_loader(func, loader)
    if tracker_of(loader) is None:
        tracker = PassTracker(loader._get_iterator)
        setattr(loader, _ATTRIBUTE, tracker)
        loader._get_iterator = tracker.new_iterator
    return loader


def check_loader(func: str, loader: Any) -> None:
    """Raise, naming ``func``'s argument, unless ``loader`` is a torch ``DataLoader``.

    Example:
        >>> check_loader("resume", [1, 2])
        Traceback (most recent call last):
        ...
        onedist.errors.OnedistTypeError: onedist.resume: loader has type list ([1, 2]); allowed: ...
    """
    if not isinstance(loader, DataLoader):
        raise bad_type(
            func,
            "loader",
            loader,
            "a torch.utils.data.DataLoader (what od.auto_dataloader returns) or None",
            hint="pass loader.sampler as sampler= for a loader of another kind whose sampler is an "
            "od.DistributedSampler",
        )


def position(loader: Any) -> dict[str, Any]:
    """Where ``loader`` (tracked) stands: what a checkpoint keeps of it.

    Example:
        >>> import torch
        >>> loader = track(torch.utils.data.DataLoader(range(6), batch_size=2))
        >>> for batch in loader:
        ...     pass
        >>> p = position(loader); p["batches"], p["done"]
        (3, True)
    """
    tracker = tracker_of(loader)
    if tracker is None:
        raise OnedistValueError(
            "onedist.save_training_state: loader= was never given to od.resume, so the batches "
            "its current pass yielded are unknown\nHINT: call od.resume(directory, ..., "
            "loader=loader) before the training loop (it returns 0 on a fresh start)"
        )
    if tracker.saved is not None:  # resumed, and its pass has not started again yet
        return tracker.saved
    yielded = tracker.batches
    sampler = loader.sampler
    has_state = callable(getattr(sampler, "state_dict", None))
    return {
        "batches": 0 if yielded is None else yielded,
        "done": yielded is not None and yielded >= _length(loader),
        "rng_at_start": tracker.rng_at_start if yielded is not None else None,
        "sampler": sampler.state_dict() if has_state else None,
    }


def _length(loader: Any) -> float:
    try:
        return len(loader)
    except TypeError:  # an IterableDataset: a pass ends when its iterator does
        return float("inf")


def continue_from(loader: Any, saved: dict[str, Any], same_world: bool, then: Callable[[], None]) -> bool:
    """Make ``loader``'s next pass continue from ``saved`` (:func:`position`); ``then`` runs when
    that pass is ready (mid-pass) or now (the pass was complete). Whether ``then`` was deferred.

    Example:
        >>> import torch
        >>> loader = track(torch.utils.data.DataLoader(range(6), batch_size=2))
        >>> saved = {"batches": 1, "done": False, "rng_at_start": None, "sampler": None}
        >>> continue_from(loader, saved, True, lambda: None), [b.tolist() for b in loader]
        (True, [[2, 3], [4, 5]])
    """
    from .samplers import DistributedSampler

    tracker = tracker_of(track(loader))
    assert tracker is not None
    sampler = loader.sampler
    ours = isinstance(sampler, DistributedSampler) and loader.batch_size is not None
    epoch = int((saved["sampler"] or {}).get("epoch", 0)) if ours else 0  # {}: saved by another sampler
    if saved["done"]:
        if ours:  # the next pass is the next epoch
            sampler.load_state_dict({"epoch": epoch, "position": sampler.num_samples})
        elif saved["sampler"] is not None and callable(getattr(sampler, "load_state_dict", None)):
            sampler.load_state_dict(saved["sampler"])
        then()
        return False
    batches, skip = int(saved["batches"]), 0
    if ours:
        indices = min(batches * loader.batch_size, sampler.num_samples)
        sampler.load_state_dict({"epoch": epoch, "position": indices})
    elif saved["sampler"] is not None and callable(getattr(sampler, "load_state_dict", None)):
        sampler.load_state_dict(saved["sampler"])
    else:
        skip = batches
    rng_at_start = saved["rng_at_start"] if same_world else None
    tracker.continuation = Continuation(rng_at_start, skip, batches - skip, then)
    tracker.saved = dict(saved)
    return True
