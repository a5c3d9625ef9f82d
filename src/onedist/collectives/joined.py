"""The collectives' side of :func:`onedist.join`: which ranks are still in the loop, and what a
collective becomes once one has left.

Inside the context every rank that still trains announces each step with one small collective on
the default group, the *step check*: an all_reduce (MAX) of ``world_size + 4`` int64s, where rank
``r`` sets element ``r`` to 1 while it is in its loop and the others carry what the step will do
(which model's forward, whether its backward reduces gradients) or why the ranks raise. A rank that
has left its loop answers the step checks with zeros (see :mod:`onedist.training.join`), so the
ranks still in the loop learn from the next check who has left. From then on a collective on the
default group goes to the group of the ranks still in the loop: a SUM is over them (what a
finished rank's zeros would give), a MEAN divides by their number, an ``all_gather`` returns their
values only, a barrier waits for them. A call that needs a finished rank (a broadcast from it, a
group that includes it, a send to it) raises :class:`~onedist.JoinedRankError` at once, on every
rank in the loop; the finished ranks raise it from the next step check.

The check is issued asynchronously and read at the next collective (a CUDA tensor is not waited
for in the forward pass); outside :func:`onedist.join` none of this runs.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..backends import Backend, Work
from ..context import current
from ..errors import JoinedRankError
from ..state import world
from .guard import STEP_CHECK, CallRecord, guarded

__all__ = ["JoinedRanks", "StepCheck", "step_check"]

#: the calls whose refusal travels in a step check (its code is the index + 1)
REFUSED_CALLS = (
    "broadcast",
    "broadcast_object",
    "scatter",
    "reduce",
    "gather",
    "send",
    "recv",
    "isend",
    "irecv",
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "barrier",
    "a collective",
)


@dataclass(frozen=True)
class StepCheck:
    """What one step check said: the ranks in their loops and what their step does."""

    active: tuple[int, ...]
    #: 1 + the index of the model whose forward starts the step (0: none, a rank leaving)
    model: int
    #: that forward's backward reduces gradients (DDP's ``require_backward_grad_sync``)
    sync: bool
    #: that forward runs with autograd on (DDP rebuilds its buckets then)
    grad: bool
    #: the refusal the ranks in the loop raise (0: none): 1 + an index of :data:`REFUSED_CALLS`
    refused: int
    #: the finished rank that call needed
    needed: int

    def error(self, left: tuple[int, ...], active: tuple[int, ...]) -> JoinedRankError:
        """The refusal the ranks in the loop raised, as every other rank raises it."""
        call = REFUSED_CALLS[self.refused - 1] if 0 < self.refused <= len(REFUSED_CALLS) else "a collective"
        return refusal(call, self.needed, left, active)


def refusal(call: str, needed: int, left: tuple[int, ...], active: tuple[int, ...]) -> JoinedRankError:
    """The error of a call that needs rank ``needed``, which has left its loop inside od.join."""
    return JoinedRankError(
        f"onedist.{call}: needs rank {needed}, which has left its loop inside onedist.join "
        f"(ranks still in their loops: {list(active)}; finished: {list(left)}); a finished rank "
        "answers only the collectives that need nothing of its own: all_reduce, all_gather, "
        "barrier, broadcast from a rank still in its loop, and DDP's gradient reduction\n"
        "HINT: broadcast from a rank that is still training (the lowest in "
        "od.join's ranks_in_loop()), or move the call after the `with od.join(...)` block",
        call=call,
        rank=needed,
    )


@guarded(STEP_CHECK, 1)
def step_check(flags: torch.Tensor, async_op: bool = False) -> Optional[Work]:
    """One step check on the default group (see the module docstring); ``flags`` is reduced in place."""
    return current().all_reduce_(flags, "MAX", None, async_op)


def new_flags(
    b: Backend, in_loop: bool, model: int = 0, sync: bool = False, grad: bool = False, refused: int = 0
) -> torch.Tensor:
    """This rank's contribution to a step check (``refused``: the refusal's code, as read back by
    :func:`read_flags`)."""
    flags = torch.zeros(b.world_size + 4, dtype=torch.int64)
    flags[b.world_size :] = torch.tensor([model, int(sync), int(grad), refused])
    if in_loop:
        flags[b.rank] = 1
    return flags.to(b.comm_device(flags.device, "all_reduce"))


def read_flags(flags: torch.Tensor, world_size: int) -> StepCheck:
    """A reduced step check as a :class:`StepCheck`."""
    values = flags.tolist()
    active = tuple(r for r in range(world_size) if values[r])
    model, sync, grad, code = values[world_size:]
    return StepCheck(active, model, bool(sync), bool(grad), code // world_size, code % world_size)


class JoinedRanks:
    """What the collectives need of an :func:`onedist.join` context: who is still in the loop, and
    the group of those ranks once one has left (:data:`onedist.state.world`'s ``join``)."""

    def __init__(self, b: Backend) -> None:
        self.backend = b
        self.active: tuple[int, ...] = tuple(range(b.world_size))
        self.left: tuple[int, ...] = ()
        #: the group of the ranks in their loops (None while every rank is)
        self.group: Any = None
        self._pending: Optional[tuple[Work, torch.Tensor, CallRecord]] = None
        #: the refusal some rank in its loop raised (as this rank raises it), once one did
        self.refused: Optional[JoinedRankError] = None

    # ------------------------------------------------------------------ step checks
    def announce(self, model: int, sync: bool, grad: bool, wait: bool) -> None:
        """A step of this rank's loop begins (its model's forward): one step check, read later."""
        self.settle()
        flags = new_flags(self.backend, True, model, sync, grad)
        work = step_check(flags, async_op=True)
        # what this rank waits in when it reads the check, for the stall check (its number as posted)
        record = CallRecord(
            STEP_CHECK, (flags,), {}, {}, sys._getframe(1), world.world_calls, None, time.monotonic()
        )
        self._pending = (work, flags, record) if work is not None else None
        if work is None:
            self._read(flags, True)
        elif wait:
            self.settle()

    def settle(self, raise_refusal: bool = True) -> None:
        """Read the step check in flight, if any: who has left; ranks that raised (then this
        rank raises too, unless it is leaving: it answers first, see :meth:`answer`)."""
        if self._pending is None:
            return
        work, flags, record = self._pending
        self._pending = None
        outer, world.call = world.call, record
        try:
            work.wait()
        finally:
            world.call = outer
        self._read(flags, raise_refusal)

    def answer(self, error: Optional[JoinedRankError] = None) -> StepCheck:
        """One step check as a rank out of its loop (``error``: it left raising that): what the
        ranks still in theirs do next. A refusal they raised is kept in :attr:`refused`."""
        self.settle(raise_refusal=False)
        code = 0
        if error is not None:
            calls = REFUSED_CALLS
            index = calls.index(error.call) if error.call in calls else len(calls) - 1
            code = (index + 1) * self.backend.world_size + error.rank
        flags = new_flags(self.backend, False, refused=code)
        step_check(flags)
        return self._read(flags, False)

    def _read(self, flags: torch.Tensor, raise_refusal: bool) -> StepCheck:
        check = read_flags(flags, self.backend.world_size)
        if check.refused and self.refused is None:
            self.refused = check.error(self.left, self.active)
        self.update(check)
        if check.refused and raise_refusal:  # ranks in the loop raised: this one stops too
            raise check.error(self.left, self.active)
        return check

    def update(self, check: StepCheck) -> None:
        """Take the ranks in their loops from a step check (the group of them, when it shrank)."""
        if check.active == self.active or not check.active:
            return
        self.active = check.active
        self.left = tuple(r for r in range(self.backend.world_size) if r not in check.active)
        self.group = self.backend.new_group(check.active) if self.backend.rank in check.active else None

    # ------------------------------------------------------------------ what a collective becomes
    def route(
        self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], group_arg: int
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments of collective ``name`` with the default group replaced by the ranks in the
        loop; raises :class:`~onedist.JoinedRankError` for a group that needs a finished rank (a
        ``src``/``dst`` that left is refused by :meth:`check_peer`, as every peer argument is)."""
        self.settle()
        if not self.left:
            return args, kwargs
        given = kwargs.get("group", args[group_arg] if len(args) > group_arg else None)
        if given is not None:
            ranks = self._ranks_of(given)
            gone = [r for r in ranks if r in self.left]
            if gone and len(ranks) < self.backend.world_size:  # a group of every rank is the default one
                raise refusal(name, gone[0], self.left, self.active)
            if not gone:
                return args, kwargs
        if len(args) > group_arg:
            return (*args[:group_arg], self.group, *args[group_arg + 1 :]), kwargs
        return args, {**kwargs, "group": self.group}

    def check_peer(self, name: str, peer: int) -> None:
        """A point-to-point call to or from ``peer``: refused when it has left its loop."""
        self.settle()
        if peer in self.left:
            raise refusal(name, peer, self.left, self.active)

    def _ranks_of(self, group: Any) -> tuple[int, ...]:
        if isinstance(group, (list, tuple, range)):
            return tuple(group)
        try:
            return self.backend.group_ranks(group)
        except Exception:  # not a group: the collective names it
            return ()
