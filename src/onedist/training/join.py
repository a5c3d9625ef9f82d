"""Uneven data: :func:`join`, under which ranks that run out of batches keep answering their peers.

When ranks get different numbers of batches, the rank with more waits in DDP's gradient reduction
or in the loop's next ``od.all_reduce`` for a rank that has left the loop. torch's
``torch.distributed.algorithms.Join`` covers DDP's gradients only; inside :func:`join` a finished
rank also answers the collectives the loop makes itself:

* each forward pass of a joined model starts a step: one small collective, the step check
  (:mod:`onedist.collectives.joined`), from which every rank learns who has left;
* a finished rank waits in step checks; for a step whose backward reduces DDP's gradients it
  matches DDP's bucket all_reduces with zeros, as torch's Join does (the gradients are the sum
  over the ranks in their loops, divided by the world size, or by their number with
  ``divide_by_initial_world_size=False``);
* onedist's collectives on the default group go to the group of the ranks in their loops (a SUM
  over them, a MEAN of them, an all_gather of their values, SyncBatchNorm's statistics of their
  batches); a call that needs a finished rank raises :class:`~onedist.JoinedRankError` on every rank;
* when every rank has left, the finished ranks take the last one's parameters, buffers and the
  state of each optimizer (or other object with ``state_dict``) given to :func:`join`, since they
  stopped stepping; when no rank left early, nothing is sent;
* a sharded model (FSDP2) needs its finished ranks' shards in every step: they keep stepping in
  the shadow of the others (:mod:`onedist.training.join_sharded`), and keep their shards of the
  parameters and of the optimizer's state at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch.nn.parallel import DistributedDataParallel

from ..collectives.joined import JoinedRanks
from ..context import current
from ..errors import JoinedRankError, OnedistRuntimeError, OnedistValueError, bad_type
from ..state import world
from .join_sharded import (
    CLIP_NORM,
    ShardedRanks,
    ShardedSteps,
    check_sharded,
    gradient_sync,
    sharded_hyperparameters,
)
from .sharding import is_sharded

__all__ = ["SAVE_STATE", "Join", "gather_rank_states", "join"]

#: the backends whose groups od.join narrows to the ranks in their loops (torch.distributed's)
_SUPPORTED = ("gloo", "nccl", "shm", "mpi")

#: a step check's model code, plus the writer's rank, for od.save_training_state: the ranks out of
#: their loops send their state to the writer (a model's code is 1 + its index: far below this)
SAVE_STATE = 1 << 40


def join(*objects: Any, divide_by_initial_world_size: bool = True) -> Join:
    """Let ranks with fewer batches leave the loop while the others finish theirs.

    Put the training loop inside ``with od.join(model, optimizer):``. A rank that runs out of
    batches leaves its loop and waits at the end of the block, answering what the others still do:
    DDP's gradient reduction (with zeros, as ``torch.distributed.algorithms.Join``), a sharded
    model's gathers and gradient reductions (a shadow step on its last batch, with zero
    gradients, and the others' optimizer steps on its shards), and onedist's
    ``all_reduce`` (over the ranks still in their loops: a SUM of theirs, a MEAN of theirs),
    ``all_gather`` (their values only), ``barrier``, ``broadcast`` from a rank in its loop and
    :class:`~onedist.SyncBatchNorm`. The block ends on every rank when the last one leaves its loop.

    Each forward pass of a model given here starts a step: one small all_reduce. The forward pass
    must come before the step's other collectives (a collective before it, on a step a rank has
    already left, cannot be told apart from the step check). One process: nothing happens.

    Args:
        *objects: the models whose forward passes start the steps (what :func:`~onedist.auto_model`
            returned: DDP, sharded or a plain module), then optimizers, LR schedulers, gradient
            scalers: anything with ``state_dict``/``load_state_dict``. After a rank left early,
            every rank ends with the state of the last rank to leave for each of them (a finished
            rank's optimizer missed the others' last steps); a sharded model's optimizer keeps
            each rank's shards, which every rank stepped (give every optimizer of its parameters).
        divide_by_initial_world_size: DDP's gradients are divided by the world size (True, as in
            torch's Join: a finished rank counts as a zero gradient), or by the number of ranks
            still in their loops (False: the mean over them).

    Returns:
        The context manager; ``ranks_in_loop()`` inside it tells which ranks are still in their
        loops (as of the last step check).

    Raises:
        OnedistValueError: no model given, a sharded (FSDP) model without its optimizer or with
            od.SyncBatchNorm, or a backend that cannot narrow its groups (Horovod, XLA).
        JoinedRankError: a collective needs a rank that has left its loop (on every rank).

    Example:
        >>> import torch, onedist as od
        >>> def train(local_rank):
        ...     torch.manual_seed(0)
        ...     model = od.auto_model(torch.nn.Linear(2, 1))
        ...     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ...     batches = [torch.ones(4, 2)] * (2 + od.get_rank())     # rank 1 has one more
        ...     seen = 0
        ...     with od.join(model, optimizer):
        ...         for x in batches:
        ...             optimizer.zero_grad()
        ...             model(x).sum().backward()
        ...             optimizer.step()
        ...             seen += od.all_reduce(len(x))         # rows of the ranks still in their loops
        ...     return seen                        # rank 0: 8 + 8; rank 1: 8 + 8 + 4 (rank 0 had left)
        >>> if __name__ == "__main__":
        ...     print(od.spawn("gloo", train, nproc_per_node=2, start_method="fork"))
        [16, 20]
    """
    return Join(objects, divide_by_initial_world_size)


class Join:
    """The context :func:`join` returns.

    Example:
        >>> import torch, onedist as od
        >>> model = od.auto_model(torch.nn.Linear(2, 1))
        >>> with od.join(model) as block:
        ...     block.ranks_in_loop()                   # one process: only this one
        (0,)
    """

    def __init__(self, objects: Sequence[Any], divide_by_initial_world_size: bool) -> None:
        if not isinstance(divide_by_initial_world_size, bool):
            raise bad_type("join", "divide_by_initial_world_size", divide_by_initial_world_size, "a bool")
        self._models = [o for o in objects if isinstance(o, torch.nn.Module)]
        self._states = [o for o in objects if not isinstance(o, torch.nn.Module)]
        for i, obj in enumerate(objects):
            _check_object(i, obj)
        if not self._models:
            raise OnedistValueError(
                "onedist.join: needs the model (the module whose forward pass starts each step), got "
                f"{[type(o).__name__ for o in objects]}\nHINT: with od.join(model, optimizer): ..."
            )
        check_sharded(self._models, self._states)
        self._ddps = [_ddp_of(m) for m in self._models]
        shards = any(is_sharded(m) for m in self._models)
        self._steps = (
            ShardedSteps(self._models, self._states, divide_by_initial_world_size, _to_every_rank)
            if shards
            else None
        )
        self._divide_by_world = divide_by_initial_world_size
        self._ranks: Optional[JoinedRanks] = None
        self._hooks: list[Any] = []
        # broadcast_buffers: DDP's attribute up to torch 2.12, a property of forward_sync_buffers since
        self._buffer_sync = [d is not None and d.broadcast_buffers for d in self._ddps]

    def ranks_in_loop(self) -> tuple[int, ...]:
        """The global ranks still in their loops, as of the last step check (every rank before
        the first one has left; ``(0,)`` in one process)."""
        if self._ranks is None:
            return tuple(range(current().world_size))
        self._ranks.settle()
        return self._ranks.active

    # ------------------------------------------------------------------ entering
    def __enter__(self) -> Join:
        b = current()
        if world.join is not None:
            raise OnedistRuntimeError("onedist.join: already inside an od.join block (they do not nest)")
        if b.world_size == 1:
            return self
        if b.model_name != "native-dist":
            raise OnedistValueError(
                f"onedist.join: backend={b.backend!r} is not supported; allowed: {list(_SUPPORTED)} "
                "(od.join narrows the default group to the ranks still in their loops, which "
                "Horovod and XLA cannot)\nHINT: give every rank the same number of batches there "
                "(auto_dataloader pads the last one; drop_last=True drops it)"
            )
        self._ranks = JoinedRanks(b) if self._steps is None else ShardedRanks(b, self._steps)
        world.join = self._ranks
        for i, model in enumerate(self._models):
            hook = self._step_hook(i)
            self._hooks.append(model.register_forward_pre_hook(hook, prepend=True, with_kwargs=True))
        if self._steps is not None:
            self._steps.enter()
        return self

    def _step_hook(self, index: int) -> Any:
        def step(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
            self._start_step(index, args, kwargs)

        return step

    def _start_step(self, index: int, args: Any, kwargs: Any) -> None:
        """One step of this rank's loop begins with model ``index``'s forward pass."""
        ranks = self._ranks
        assert ranks is not None
        ddp = self._ddps[index]
        grad = torch.is_grad_enabled()
        if self._steps is not None:  # a sharded model in the block: each step check is read at once
            self._steps.record(index, args, kwargs)
            ranks.settle()
            before = ranks.active
            sync = grad and (
                gradient_sync(self._models[index]) if self._steps.sharded[index] else sync_of(ddp)
            )
            ranks.announce(index + 1, sync, grad, wait=True)
            self._steps.after_check(ranks, before, index, self._models[index].training)
        sync = grad and sync_of(ddp)
        buffers = (
            self._buffer_sync[index]
            and ddp is not None
            and ddp.require_forward_param_sync
            and len(ddp.modules_buffers) > 0
        )
        divisor = sync and not self._divide_by_world
        if self._steps is None:
            ranks.announce(index + 1, sync, grad, wait=buffers or divisor)
        if ddp is None:
            return
        if buffers:  # DDP broadcasts them from rank 0: from the lowest rank in its loop instead
            ddp.broadcast_buffers = not ranks.left
            if ranks.left:
                _broadcast_tensors(list(ddp.modules_buffers), ranks.active[0], ranks.group)
        if divisor:  # DDP's reducer divides by this work's result: the ranks in their loops
            ddp.reducer._set_forward_pass_work_handle(_done_work(len(ranks.active), ddp.device), False)

    # ------------------------------------------------------------------ leaving
    def __exit__(self, kind: Optional[type[BaseException]], exc: Optional[BaseException], tb: Any) -> None:
        ranks = self._ranks
        if ranks is None:
            return
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        try:
            if exc is None or isinstance(exc, JoinedRankError):  # the others may still need this rank
                self._answer_until_all_left(ranks, exc)
        finally:
            world.join = None
            self._ranks = None
            self._restore()
        if exc is None and ranks.refused is not None:  # ranks in their loops raised it
            raise ranks.refused
        if exc is None and len(ranks.active) < current().world_size:
            self._take_last_state(max(ranks.active))

    def _answer_until_all_left(self, ranks: JoinedRanks, error: Optional[JoinedRankError]) -> None:
        """Answer the step checks of the ranks still in their loops until every rank has left
        (``error``: this rank left raising it; the others raise it from their next step check)."""
        steps = self._steps
        if steps is not None:
            steps.leave()
        while True:
            ranks.settle(raise_refusal=False)
            before = ranks.active
            check = ranks.answer(error)
            if check.model >= CLIP_NORM and check.active and steps is not None and ranks.refused is None:
                steps.clip(ranks, check.model - CLIP_NORM, None)  # od.clip_grad_norm_ of a sharded model
                continue
            if check.model >= SAVE_STATE and check.active:  # a step checkpoint: state to the writer
                from .run_state import rank_state

                _gather_from_every_rank(rank_state(self._models[0], None), check.model - SAVE_STATE, ranks)
                continue
            training = False
            if steps is not None and ranks.refused is None:  # the others' optimizer steps, made here
                training = steps.after_check(ranks, before, check.model - 1, None)
            if not check.active:
                return
            index = check.model - 1
            ddp = self._ddps[index] if check.model else None
            if ddp is not None:
                _match_ddp_step(ddp, check.grad, check.sync)
            elif steps is not None and check.model and steps.sharded[index] and ranks.refused is None:
                steps.shadow(index, check, training)

    def _restore(self) -> None:
        if self._steps is not None:
            self._steps.exit()
        for ddp, synced in zip(self._ddps, self._buffer_sync):
            if ddp is not None:
                ddp.broadcast_buffers = synced
                if not self._divide_by_world:  # the reducer keeps the last divisor it was given
                    work = _done_work(current().world_size, ddp.device)
                    ddp.reducer._set_forward_pass_work_handle(work, True)

    def _take_last_state(self, src: int) -> None:
        """Every rank takes rank ``src``'s model and objects (it left last; the others stopped
        stepping when they left)."""
        from ..collectives import broadcast_object

        for model in self._models:  # a sharded model's shards: each rank stepped its own
            _broadcast_tensors(
                [*([] if is_sharded(model) else model.parameters()), *model.buffers()], src, None
            )
        for obj in self._states:
            mine = sharded_hyperparameters(obj)  # its shards' state is each rank's own
            if mine is not None:  # the last rank's hyperparameters (what its scheduler set last)
                groups = broadcast_object(mine, src=src)
                for group, values in zip(obj.param_groups, groups):
                    group.update(values)
                continue
            state = broadcast_object(obj.state_dict() if current().rank == src else None, src=src)
            if current().rank != src:
                obj.load_state_dict(state)


# ---------------------------------------------------------------------------- step checkpoints
def gather_rank_states(state: Any, dst: int) -> list[Any]:
    """Every rank's ``state`` on rank ``dst`` (``[]`` elsewhere): one :func:`~onedist.gather`.

    Inside :func:`join` after ranks left their loops, those ranks send theirs too: the ranks in
    their loops announce the save in one step check, which the finished ranks answer by sending
    what :func:`~onedist.training.run_state.rank_state` gives there (their RNG states are those
    they left with: a finished rank draws no random number). ``dst`` must be in its loop.

    Example:
        >>> gather_rank_states({"rank": 0}, dst=0)
        [{'rank': 0}]
    """
    from ..collectives import gather

    ranks = world.join if isinstance(world.join, JoinedRanks) else None
    if ranks is not None:
        ranks.settle()
    if ranks is None or not ranks.left or dst in ranks.left:  # a writer that left: gather refuses
        return gather(state, dst=dst)
    ranks.announce(SAVE_STATE + dst, False, False, wait=True)
    return _gather_from_every_rank(state, dst, ranks)


def _to_every_rank(value: Any, src: int) -> Any:
    """Rank ``src``'s ``value`` on every rank of the default group (one broadcast_object), past the
    narrowing to the ranks in their loops."""
    from ..collectives import broadcast_object

    ranks, world.join = world.join, None
    try:
        return broadcast_object(value, src=src)
    finally:
        world.join = ranks


def _gather_from_every_rank(state: Any, dst: int, ranks: JoinedRanks) -> list[Any]:
    """One gather on the whole default group, past the narrowing to the ranks in their loops."""
    from ..collectives import gather

    world.join = None
    try:
        return gather(state, dst=dst)
    finally:
        world.join = ranks


# ---------------------------------------------------------------------------- helpers
def _check_object(index: int, obj: Any) -> None:
    arg = f"objects[{index}]"
    if isinstance(obj, torch.nn.Module):
        return
    if type(obj).__name__ == "ZeroRedundancyOptimizer":
        raise OnedistValueError(
            f"onedist.join: {arg} is a ZeroRedundancyOptimizer, whose step needs every rank's shard; "
            "od.join supports optimizers whose step is local"
        )
    if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
        raise bad_type(
            "join",
            arg,
            obj,
            "a model (torch.nn.Module), or an optimizer, scheduler or scaler (state_dict/load_state_dict)",
        )


def _ddp_of(model: torch.nn.Module) -> Optional[DistributedDataParallel]:
    """The DDP wrapper in ``model`` (itself, torch.compile's wrapper of it, or one inside), if any."""
    for module in model.modules():
        if isinstance(module, DistributedDataParallel):
            return module
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, DistributedDataParallel) else None


def sync_of(ddp: Optional[DistributedDataParallel]) -> bool:
    """Whether DDP's next backward pass reduces gradients (no DDP: False)."""
    return ddp is not None and bool(ddp.require_backward_grad_sync)


def _match_ddp_step(ddp: DistributedDataParallel, grad: bool, sync: bool) -> None:
    """On a finished rank, what DDP's forward and backward passes do on the ranks in their loops
    (torch's ``_DDPJoinHook.main_hook`` but for its collectives, which the step check replaces)."""
    if grad:
        ddp.reducer._rebuild_buckets()  # once per training run, as the ranks in their loops do
    ddp.require_forward_param_sync = sync
    if not sync:
        return
    ddp._match_all_reduce_for_bwd_pass()  # type: ignore[no-untyped-call]  # zeros, per bucket
    if ddp.find_unused_parameters:
        ddp._match_unused_params_allreduce()  # type: ignore[no-untyped-call]
    ddp.reducer._push_all_rebuilt_params()


def _broadcast_tensors(tensors: list[torch.Tensor], src: int, group: Any) -> None:
    """Rank ``src``'s values of ``tensors`` on every rank of ``group``: one broadcast per dtype and
    device."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    from ..collectives import broadcast

    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for same in by_kind.values():
            flat = _flatten_dense_tensors([t.detach() for t in same])  # type: ignore[no-untyped-call]
            flat = broadcast(flat, src=src, group=group)
            for t, value in zip(same, _unflatten_dense_tensors(flat, same)):  # type: ignore[no-untyped-call]
                t.copy_(value)


def _done_work(count: int, device: torch.device) -> Any:
    """A finished work whose result is ``[count]``, as DDP's reducer reads its divisor."""
    future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
    future.set_result([torch.tensor([float(count)], device=device)])
    return torch._C._distributed_c10d._create_work_from_future(future)  # type: ignore[attr-defined]
