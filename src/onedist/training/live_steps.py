"""``od.steps``: the training loop says what a step is, so that a failed rank costs one step.

Under ``onedist run --recovery live`` (:mod:`onedist._recovery`), a rank that dies is replaced
alone: the survivors learn of it at their next collective (a :class:`~onedist.RemoteRankError`
inside a step, or a backend's error onedist explains as a peer's death), roll back to the start of
that step (its gradients dropped, the RNG states, the accumulation count and the batches of its
window set back), make the group again with the replacement, and one of them sends it the whole
training state in one broadcast (:mod:`.live_state`), while the replacement takes the dead rank's
own RNG states (and rank 0's buffers) from the launcher's store, where each rank keeps them at each
step; every rank then runs the failed step again. Without ``--recovery live`` (or
in one process) :func:`steps` only iterates: a failure ends the run as before (restarted by
``--max-restarts``).

What a step is: one optimizer step, i.e. one batch, or one window of :func:`~onedist.accumulate`
(its micro-batches are kept until the window closes, and replayed after a rollback).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .._recovery import is_live
from ..errors import bad_type, bad_value
from .accumulation import micro_steps, set_micro_steps
from .live_state import OwnState, Position, check_live_run, peer_failed, recover, take_ready
from .rng import rng_state, set_rng_state
from .wrappers import unwrap

__all__ = ["Step", "Steps", "steps"]


@dataclass
class _Mark:
    """Where the current step started: what a rollback sets back."""

    position: Position
    rng: dict[str, Any]
    micro: Optional[tuple[int, bool]]
    #: the module's buffers (a forward pass moves BatchNorm's running statistics)
    buffers: list[torch.Tensor]
    #: optimizer steps made in this process when the step started
    stepped: int


_stepped = [0]  # optimizer steps made in this process (counted once live recovery is on)
_hook: list[Any] = []
_active: list[Steps] = []  # the loop under live recovery whose state an optimizer step publishes


def _count_optimizer_steps(loop: Steps) -> None:
    """Count optimizer steps (after each), and before each publish ``loop``'s own state of the
    next step (:class:`~.live_state.OwnState`: a death right after the step finds it kept)."""
    _active[:] = [loop]
    if not _hook:

        def count(optimizer: Any, args: Any, kwargs: Any) -> None:
            _stepped[0] += 1

        def publish(optimizer: Any, args: Any, kwargs: Any) -> None:
            if _active:
                _active[0].publish(1)

        _hook.append(register_optimizer_step_post_hook(count))
        _hook.append(register_optimizer_step_pre_hook(publish))


class Step:
    """One micro-step of :func:`steps`: its batch and where it stands. Use it as a context
    manager around everything the step does (forward, backward, the optimizer step): under live
    recovery a peer's failure inside it is taken back, and the loop goes on with the same step."""

    def __init__(self, owner: Steps, batch: Any, position: Position) -> None:
        self._owner = owner
        #: the batch the loader gave
        self.batch = batch
        #: the pass over the loader this batch belongs to (from 0)
        self.epoch = position.epoch
        #: the batch's index in its pass (from 0)
        self.index = position.index
        #: the optimizer step this micro-step belongs to (from 1)
        self.number = position.number

    @property
    def last_of_epoch(self) -> bool:
        """This is the last batch of its pass."""
        return self.index == self._owner.length - 1

    def __enter__(self) -> Any:
        return self.batch

    def __exit__(
        self, kind: Optional[type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> bool:
        if exc is None or not self._owner.live or not peer_failed(exc):
            return False
        self._owner.failed = exc  # the next step of the loop recovers, then runs this step again
        return True


class Steps:
    """The iterator :func:`steps` returns (see there)."""

    def __init__(
        self, loader: Any, model: torch.nn.Module, optimizer: Any, scheduler: Any, epochs: int, state: Any
    ) -> None:
        self.loader, self.model, self.epochs = loader, model, epochs
        self.objects = {"model": unwrap(model), "optimizer": optimizer, "scheduler": scheduler, **state}
        self.length = len(loader)
        self.live = is_live(os.environ) and torch.distributed.is_initialized()
        self.own: Optional[OwnState] = None
        if self.live:
            check_live_run(model)
            self.own = OwnState(model)
            _count_optimizer_steps(self)
        self.failed: Optional[BaseException] = None
        self.position = Position(epoch=0, index=0, number=0)
        self._iterator: Optional[Iterator[Any]] = None
        self._window: list[tuple[Position, Any]] = []  # the current step's micro-batches
        self._replay: deque[tuple[Position, Any]] = deque()
        self._mark: Optional[_Mark] = None
        self._ready = False

    def __iter__(self) -> Steps:
        return self

    def __next__(self) -> Step:
        if self.live and not self._ready:
            self._ready = True
            received = take_ready(self.model, self.objects)  # a replacement gets the state here
            if received is not None:
                self._continue_at(received)
        if self.failed is not None:
            self._roll_back()
        position, batch = self._next_batch()
        micro = micro_steps(self.model)
        if micro is None or not micro[1]:  # no window open: a new step starts here
            position.number += 1
            self.position.number = position.number
            if self.live:
                buffers = [b.detach().clone() for b in self.objects["model"].buffers()]
                self._mark = _Mark(Position(**vars(position)), rng_state(), micro, buffers, _stepped[0])
                self._window = []
                self.publish(0, self._mark.rng)
        if self.live:
            self._window.append((position, batch))
        return Step(self, batch, position)

    def publish(self, ahead: int, rng: Optional[dict[str, Any]] = None) -> None:
        """This rank's own state of the start of the loop's step number + ``ahead`` (1: at an
        optimizer step, the next step's) into the launcher's store (:class:`~.live_state.OwnState`)."""
        if self.own is not None:
            self.own.publish(self.position.number + ahead, rng or rng_state(), self.objects["model"])

    def _next_batch(self) -> tuple[Position, Any]:
        if self._replay:  # the failed step's batches again, counted anew
            position, batch = self._replay.popleft()
            return Position(position.epoch, position.index, self.position.number), batch
        while True:
            if self._iterator is None:
                if self.position.epoch >= self.epochs:
                    raise StopIteration
                self._start_pass(self.position.epoch)
            assert self._iterator is not None
            try:
                batch = next(self._iterator)
            except StopIteration:
                self._iterator = None
                self.position = Position(self.position.epoch + 1, 0, self.position.number)
                continue
            position = Position(**vars(self.position))
            self.position.index += 1
            return position, batch

    def _start_pass(self, epoch: int) -> None:
        sampler: Any = getattr(self.loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)  # the same order for a replacement that starts mid-run
        self._iterator = iter(self.loader)

    def _roll_back(self) -> None:
        """Back to the start of the failed step, then the group made again (:func:`recover`). A
        failure after the step's optimizer step (a collective of its own after it) finds the
        step done: the loop goes on from the next one."""
        mark, self.failed = self._mark, None
        assert mark is not None  # a step failed: one started
        module = self.objects["model"]
        for p in module.parameters():
            p.grad = None
        if _stepped[0] != mark.stepped:
            self._window = []
            here = Position(**vars(self.position))
            recover(self.model, self.objects, here, rng_state(), micro_steps(self.model))
            return
        with torch.no_grad():
            for b, saved in zip(module.buffers(), mark.buffers):
                b.copy_(saved)
        if mark.micro is not None:
            set_micro_steps(self.model, *mark.micro)
        set_rng_state(mark.rng)
        self._replay = deque(self._window)
        self._window = []
        start = Position(mark.position.epoch, mark.position.index, mark.position.number - 1)
        recover(self.model, self.objects, start, mark.rng, mark.micro)
        self.position.number = start.number

    def _continue_at(self, received: Mapping[str, Any]) -> None:
        """A replacement: its loader moved to the step the survivors run again, the RNG set."""
        start: Position = received["position"]
        self.position = Position(start.epoch, 0, start.number)
        if start.epoch < self.epochs:
            self._start_pass(start.epoch)
            assert self._iterator is not None
            for _ in range(start.index):  # loaded and dropped (a sampler's own skip: later)
                next(self._iterator)
            self.position.index = start.index
        set_rng_state(received["rng"])


def steps(
    loader: Any,
    model: torch.nn.Module,
    optimizer: Any,
    *,
    scheduler: Any = None,
    epochs: int = 1,
    state: Optional[Mapping[str, Any]] = None,
) -> Steps:
    """The training loop's steps, over ``epochs`` passes of ``loader``: what live recovery
    takes back and runs again when a rank dies (``onedist run --recovery live``).

    Each item is a :class:`Step`; wrap everything the step does in ``with step as batch:``.
    Under live recovery a peer's failure inside that block is caught: the survivors roll back to
    the start of the step (one batch, or one :func:`~onedist.accumulate` window), the launcher
    starts a replacement for the dead rank only, and the replacement receives ``model``,
    ``optimizer``, ``scheduler``, every object of ``state`` (anything with ``state_dict`` and
    ``load_state_dict``: a GradScaler, a meter), the RNG states, the accumulation count and the
    loader's position from a survivor in one broadcast (the dead rank's own RNG states, and rank
    0's buffers, from the launcher's store); the loop then goes on with the failed step on every
    rank. Without live recovery it only iterates (each pass calls the sampler's
    ``set_epoch(epoch)`` when it has one), serially too.

    Args:
        loader: the training ``DataLoader`` (anything with ``len()`` and ``iter()``).
        model: the model :func:`~onedist.auto_model` returned.
        optimizer: its optimizer.
        scheduler: its learning-rate scheduler, if any.
        epochs: how many passes over ``loader`` (an int >= 1).
        state: other objects a replacement must receive, by name (each with ``state_dict()``
            and ``load_state_dict()``).

    Example:
        >>> import torch, onedist as od
        >>> model = od.auto_model(torch.nn.Linear(4, 1))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> loader = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)
        >>> for step in od.steps(loader, model, opt, epochs=2):
        ...     with step as x:
        ...         model(x).sum().backward()
        ...         opt.step(); opt.zero_grad()
        >>> step.epoch, step.index, step.number, step.last_of_epoch
        (1, 3, 8, True)
    """
    if not isinstance(model, torch.nn.Module):
        raise bad_type("steps", "model", model, "a torch.nn.Module (the model auto_model returned)")
    if not hasattr(loader, "__len__") or not hasattr(loader, "__iter__"):
        raise bad_type("steps", "loader", loader, "a DataLoader (an object with len() and iter())")
    if not isinstance(epochs, int) or isinstance(epochs, bool):
        raise bad_type("steps", "epochs", epochs, "an int >= 1")
    if epochs < 1:
        raise bad_value("steps", "epochs", epochs, "an int >= 1")
    objects = dict(state or {})
    for name, value in objects.items():
        if not (hasattr(value, "state_dict") and hasattr(value, "load_state_dict")):
            raise bad_type(
                "steps", f"state[{name!r}]", value, "an object with state_dict() and load_state_dict()"
            )
    return Steps(loader, model, optimizer, scheduler, epochs, objects)
