"""Distributed samplers: reshuffle each epoch without ``set_epoch``, wrap any sampler, evaluate unpadded.

* :class:`DistributedSampler` is torch's, except that each new pass over it starts the next epoch
  on its own, so forgetting ``set_epoch`` no longer repeats the same order every epoch. Calling
  ``set_epoch(e)`` still works and wins (do it when resuming).
* :class:`DistributedProxySampler` gives each rank its share of what any sampler yields (a
  ``WeightedRandomSampler``, a custom one), the same draw on every rank.
* :class:`DistributedEvalSampler` shards a dataset without padding: every sample is seen exactly
  once, so gathered predictions have no duplicates (ranks may get one sample more than others).

:func:`auto_dataloader <onedist.training.auto.auto_dataloader>` picks these for you.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sized
from typing import Any, Optional

import torch
from torch.utils.data import DistributedSampler as _TorchDistributedSampler, Sampler

from ..errors import bad_type, bad_value

__all__ = ["DistributedEvalSampler", "DistributedProxySampler", "DistributedSampler", "rank_indices"]


def _world(num_replicas: Optional[int], rank: Optional[int], where: str) -> tuple[int, int]:
    from ..context import get_rank, get_world_size

    n = get_world_size() if num_replicas is None else num_replicas
    r = get_rank() if rank is None else rank
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise bad_value(where, "num_replicas", n, "an int >= 1")
    if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < n:
        raise bad_value(where, "rank", r, f"an int in 0..{n - 1}")
    return n, r


class _AutoEpoch:
    """Mixin: the second and later passes advance ``epoch`` unless ``set_epoch`` was called since."""

    epoch: int
    _passes: int
    _epoch_set: bool

    def _next_pass(self) -> None:
        if self._passes > 0 and not self._epoch_set:
            self.epoch += 1
        self._epoch_set = False
        self._passes += 1

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next pass (a different shuffle per epoch, the same on every rank)."""
        self.epoch = epoch
        self._epoch_set = True


class DistributedSampler(_AutoEpoch, _TorchDistributedSampler):  # type: ignore[type-arg]
    """torch's ``DistributedSampler`` that reshuffles on every pass, with or without ``set_epoch``.

    Rank and world size default to onedist's (so it also works serially, as a plain sampler).
    Like torch's, it pads the last round with the first samples so every rank gets the same count;
    use :class:`DistributedEvalSampler` for evaluation.

    Example:
        >>> import onedist as od
        >>> s = od.DistributedSampler(range(8), num_replicas=2, rank=0, shuffle=True, seed=1)
        >>> first, second = list(s), list(s)   # two epochs, no set_epoch call
        >>> first != second, s.epoch
        (True, 1)
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        n, r = _world(num_replicas, rank, "DistributedSampler")
        super().__init__(dataset, num_replicas=n, rank=r, shuffle=shuffle, seed=seed, drop_last=drop_last)  # type: ignore[arg-type]
        self._passes = 0
        self._epoch_set = False
        self._position = 0  # indices handed out in the current pass
        self._start = 0  # the next pass skips this many (a resumed pass)
        self._at_start: Optional[Callable[[], None]] = None  # run when the resumed pass starts

    def __iter__(self) -> Iterator[int]:
        self._next_pass()
        start, self._start = self._start, 0
        at_start, self._at_start = self._at_start, None
        indices = list(super().__iter__())[start:]
        if at_start is not None:
            # a DataLoader draws its base seed from the global RNG between creating its iterator
            # and this call: restoring the RNG here, not earlier, keeps a resumed run bit-identical
            at_start()
        return self._counted(indices, start)

    def _counted(self, indices: list[int], start: int) -> Iterator[int]:
        self._position = start
        for i in indices:
            self._position += 1
            yield i

    def state_dict(self) -> dict[str, int]:
        """Where this rank is: the epoch and the indices handed out in its pass (for a checkpoint).

        The position counts what the sampler handed to the ``DataLoader``; with ``num_workers > 0``
        the loader fetches batches ahead, so save mid-epoch states with ``num_workers=0`` only.

        Example:
            >>> import onedist as od
            >>> s = od.DistributedSampler(range(8), num_replicas=2, rank=0)
            >>> it = iter(s); _ = next(it), next(it)
            >>> s.state_dict()
            {'epoch': 0, 'position': 2}
        """
        return {"epoch": int(self.epoch), "position": int(self._position)}

    def load_state_dict(
        self, state: Mapping[str, int], at_start: Optional[Callable[[], None]] = None
    ) -> None:
        """Continue from ``state`` (:meth:`state_dict`): the next pass is its epoch from its position,
        or the next epoch from the start when its pass was complete. ``at_start`` runs when that
        pass starts (after the ``DataLoader`` drew its seed), or now when the next pass starts afresh.

        Example:
            >>> import onedist as od
            >>> s = od.DistributedSampler(range(8), num_replicas=2, rank=0)
            >>> full = list(s)
            >>> s2 = od.DistributedSampler(range(8), num_replicas=2, rank=0)
            >>> s2.load_state_dict({"epoch": 0, "position": 1})
            >>> list(s2) == full[1:]
            True
        """
        if not isinstance(state, Mapping) or not all(
            isinstance(state.get(k), int) and state[k] >= 0 for k in ("epoch", "position")
        ):
            raise bad_value(
                "DistributedSampler.load_state_dict",
                "state",
                state,
                "{'epoch': int >= 0, 'position': int >= 0}",
            )
        done = state["position"] >= self.num_samples
        self.set_epoch(state["epoch"] + 1 if done else state["epoch"])
        self._start = 0 if done else state["position"]
        self._position = 0
        self._at_start = None if done else at_start
        if done and at_start is not None:  # the next pass starts afresh, as it did in the saved run
            at_start()


class DistributedProxySampler(_AutoEpoch, Sampler[int]):
    """Each rank's share of what ``sampler`` yields: any sampler, made distributed.

    Every pass draws the wrapped sampler's full sequence under a random seed derived from
    ``seed + epoch`` (the same on every rank, the global RNG untouched), pads it to a multiple of
    the world size with its first items, and keeps every ``num_replicas``-th item from ``rank``.

    Example:
        >>> import torch, onedist as od
        >>> weighted = torch.utils.data.WeightedRandomSampler([0.1, 0.9, 0.5, 0.5], num_samples=6)
        >>> s = od.DistributedProxySampler(weighted, num_replicas=2, rank=1)
        >>> len(s), len(list(s))
        (3, 3)
    """

    def __init__(
        self,
        sampler: Sampler[Any],
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        seed: int = 0,
    ) -> None:
        func = "DistributedProxySampler"
        if not isinstance(sampler, Sampler) and not hasattr(sampler, "__iter__"):
            raise bad_type(
                func,
                "sampler",
                sampler,
                "a torch.utils.data.Sampler",
                says="Argument sampler should be instance of torch Sampler",
            )
        if not hasattr(sampler, "__len__"):
            raise bad_type(
                func,
                "sampler",
                sampler,
                "a sampler with __len__ (every rank must know how many items there are)",
                says="Argument sampler should have length",
            )
        if isinstance(sampler, (_TorchDistributedSampler, DistributedEvalSampler, DistributedProxySampler)):
            raise bad_type(
                func,
                "sampler",
                sampler,
                "a sampler over the whole dataset (this class gives each rank its share of it)",
                hint="use the distributed sampler as it is",
                says="Argument sampler must not be a distributed sampler already",
            )
        self.sampler = sampler
        self.num_replicas, self.rank = _world(num_replicas, rank, "DistributedProxySampler")
        self.seed = seed
        self.epoch = 0
        self._passes = 0
        self._epoch_set = False
        self.num_samples = math.ceil(len(sampler) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[Any]:
        self._next_pass()
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(self.epoch)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + self.epoch)
            indices = list(self.sampler)
        if len(indices) != len(self.sampler):
            raise bad_value(
                "DistributedProxySampler",
                "sampler",
                self.sampler,
                f"a sampler that yields len(sampler)={len(self.sampler)} items; it yielded {len(indices)}",
            )
        if indices:
            indices += (indices * math.ceil(self.total_size / len(indices)))[: self.total_size - len(indices)]
        return iter(indices[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


class DistributedEvalSampler(Sampler[int]):
    """Shards ``range(len(dataset))`` over the ranks without padding: each sample exactly once.

    Rank ``r`` gets indices ``r, r + N, r + 2N, ...`` (the same interleaving as
    ``DistributedSampler`` with ``shuffle=False``), so ranks differ by at most one sample. Gather
    results with :func:`onedist.all_gather_eval`, which restores dataset order. Do not run a
    collective per batch with it (ranks may have one batch more than others); gather at the end.

    Example:
        >>> import onedist as od
        >>> [list(od.DistributedEvalSampler(range(5), num_replicas=2, rank=r)) for r in (0, 1)]
        [[0, 2, 4], [1, 3]]
    """

    def __init__(
        self, dataset: Sized, num_replicas: Optional[int] = None, rank: Optional[int] = None
    ) -> None:
        if not hasattr(dataset, "__len__"):
            raise bad_type("DistributedEvalSampler", "dataset", dataset, "a dataset with __len__")
        self.dataset = dataset
        self.num_replicas, self.rank = _world(num_replicas, rank, "DistributedEvalSampler")
        self.total = len(dataset)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.total, self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, self.total, self.num_replicas))

    def set_epoch(self, epoch: int) -> None:
        """Accepted for symmetry with the training samplers; evaluation order does not change."""


def rank_indices(sampler: Sampler[Any], rank: int) -> Optional[list[int]]:
    """The dataset indices ``sampler`` would yield on ``rank`` this epoch, or None if unknown.

    Works for torch's and onedist's ``DistributedSampler`` (any shuffle/seed/epoch),
    :class:`DistributedEvalSampler` and :class:`DistributedProxySampler` (for deterministic wrapped
    samplers): a copy with another rank replays the same draw. Used to put gathered results back
    in dataset order and drop the padding duplicates.

    Example:
        >>> import onedist as od
        >>> rank_indices(od.DistributedEvalSampler(range(5), num_replicas=2, rank=0), 1)
        [1, 3]
    """
    import copy

    if isinstance(sampler, (_TorchDistributedSampler, DistributedEvalSampler, DistributedProxySampler)):
        other = copy.copy(sampler)
        other.rank = rank
        if isinstance(other, _AutoEpoch):
            # replay the pass that produced this epoch's order, without advancing the original
            other._passes, other._epoch_set = 0, True
        return [int(i) for i in other]
    return None
