"""What :func:`onedist.join` does for a sharded model (``auto_model(..., sharding="fsdp")``).

Under FSDP2 each rank holds the only copy of its shards: of the parameters, of their gradients and
of the optimizer's state. The ranks still in their loops gather a finished rank's shards in each
forward and backward pass and reduce-scatter gradients into them, so a finished rank cannot stop;
it keeps stepping in the shadow of the others:

* **a shadow step** for each of their forward passes of the model: the forward pass on the last
  batch it had (its random generators forked: it draws nothing), then, if theirs has gradients, a
  backward pass from zero gradients of the outputs. FSDP2 makes the same all-gathers and
  reduce-scatters as on the ranks in their loops, and this rank's part of the gradient is zero, as
  DDP + od.join's finished ranks send zeros: each shard's gradient is the sum over the ranks in
  their loops divided by the world size (or, with ``divide_by_initial_world_size=False``, by their
  number: FSDP2's divide factor, set for the step); a rank that had no batch repeats the one of the
  lowest rank in its loop, sent with the step check where it left;
* **the others' optimizer steps**: each step check after a rank has left is followed by one
  ``broadcast_object`` from the lowest rank in its loop (the lowest one that was, when none is
  left) of the optimizer steps made since the previous check, each with its hyperparameters (what
  an LR scheduler set), and of the model's training mode. A finished rank makes the steps it has
  not made, in order, on its shards: its optimizer steps them with the reduced gradients, as the
  others step theirs, so the optimizer's state is what the ranks in their loops would hold for
  those elements. It sets its gradients to None after each step, and when it leaves its loop
  after a step (the others set theirs to None before the next backward pass);
* **buffers** come from the lowest rank still in its loop (sharding.py's forward hook), as DDP's;
* **od.clip_grad_norm_** of the model, once a rank has left: the ranks in their loops announce it
  in a step check of its own and send ``max_norm`` and ``norm_type`` (one broadcast_object); every
  rank then reduces its shards' norm and clips its shards, as outside od.join.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from ..collectives.joined import JoinedRanks, StepCheck
from ..context import current
from ..errors import OnedistValueError
from ..state import world
from .sharding import is_sharded, is_sharded_optimizer

__all__ = [
    "CLIP_NORM",
    "ShardedRanks",
    "ShardedSteps",
    "check_sharded",
    "clip_in_join",
    "gradient_sync",
    "sharded_hyperparameters",
]

#: a step check's model code for od.clip_grad_norm_ of a sharded model, plus the model's index
#: (above od.join's SAVE_STATE codes)
CLIP_NORM = 1 << 41

#: one optimizer step a rank made: (the optimizer's index, its count of steps in the block, each
#: parameter group's hyperparameters)
Step = tuple[int, int, list[dict[str, Any]]]


def check_sharded(models: Sequence[torch.nn.Module], states: Sequence[Any]) -> None:
    """od.join's objects, checked for what a finished rank needs to step a sharded model."""
    from .syncbn import SyncBatchNorm

    for i, model in enumerate(models):
        if not is_sharded(model):
            continue
        if not any(is_sharded_optimizer(s) for s in states):
            raise OnedistValueError(
                f"onedist.join: models[{i}] is a sharded model (auto_model(sharding='fsdp')), given without "
                "its optimizer; allowed: the sharded model with every optimizer of its parameters (a rank "
                "out of batches steps its own shards for the others)\n"
                "HINT: with od.join(model, optimizer, scheduler): ..."
            )
        norms = [name for name, m in model.named_modules() if isinstance(m, SyncBatchNorm)]
        if norms:
            raise OnedistValueError(
                f"onedist.join: models[{i}] is a sharded model with od.SyncBatchNorm ({norms[0]!r}); "
                "allowed: a sharded model without it (a rank out of batches repeats its last forward "
                "pass, whose statistics would enter the others')\n"
                "HINT: torch.nn.BatchNorm layers (rank 0's buffers, as under DDP), or DDP with SyncBatchNorm"
            )


def gradient_sync(model: torch.nn.Module) -> bool:
    """Whether the sharded ``model``'s next backward pass reduces gradients (False inside
    ``od.no_sync``: FSDP2's ``set_requires_gradient_sync(False)``)."""
    for group in _param_groups(model):
        return bool(group.reduce_grads)
    return True


def _param_groups(model: torch.nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [group for m in model.modules() if isinstance(m, FSDPModule) for group in _groups_of(m)]


def _groups_of(module: Any) -> list[Any]:
    """An FSDP module's parameter groups: a list on torch 2.13 (``_fsdp_param_groups``), one group
    or None on 2.9, the XLA venv's (``_fsdp_param_group``, which 2.13 still answers too)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


class ShardedSteps:
    """od.join's side of the sharded models among its objects (see the module docstring)."""

    def __init__(
        self,
        models: Sequence[torch.nn.Module],
        states: Sequence[Any],
        divide_by_world: bool,
        send: Callable[[Any, int], Any],
    ) -> None:
        self.models = list(models)
        #: ``send(value, src)``: rank ``src``'s value on every rank, those out of their loops too
        self.send = send
        self.sharded = [is_sharded(m) for m in self.models]
        #: the optimizers of sharded parameters (the others' state is the last rank's at the end)
        self.optimizers = [s for s in states if is_sharded_optimizer(s)]
        self.divide_by_world = divide_by_world
        #: each optimizer's steps inside the block, made or mirrored
        self.counts = [0] * len(self.optimizers)
        #: the steps made since the last step check
        self.log: list[Step] = []
        #: the last forward pass's arguments of each sharded model (what a shadow step repeats)
        self.inputs: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        self._hooks: list[Any] = []
        self._divided = False

    def enter(self) -> None:
        for i, optimizer in enumerate(self.optimizers):
            self._hooks.append(optimizer.register_step_post_hook(self._stepped(i)))

    def _stepped(self, index: int) -> Any:
        def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            self.counts[index] += 1
            self.log.append((index, self.counts[index], _hyperparameters(optimizer)))

        return hook

    def record(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Model ``index``'s forward pass on a rank in its loop: kept for its shadow steps."""
        if self.sharded[index]:
            self.inputs[index] = (args, kwargs)

    # ------------------------------------------------------------------ every step check
    def after_check(
        self, ranks: JoinedRanks, before: tuple[int, ...], index: int, training: Optional[bool]
    ) -> bool:
        """After a step check for model ``index`` (``before``: the ranks in their loops until it),
        once some rank is out of its loop: the lowest rank in its loop sends the optimizer steps
        made since the previous check, its training mode and, when a rank has just left, this
        forward pass's arguments (for a rank that had no batch); every rank out of its loop makes
        the steps it missed, and takes FSDP2's divide factor for the step. Returns the training
        mode of the ranks in their loops."""
        log, self.log = self.log, []
        world_size = current().world_size
        if len(before) == world_size and len(ranks.active) == world_size:
            return bool(training)
        src = min(ranks.active or before)
        payload = None
        if current().rank == src:
            fresh = ranks.active and ranks.active != before and index in self.inputs
            payload = {"steps": log, "training": training, "inputs": self.inputs[index] if fresh else None}
        sent = self.send(payload, src)
        for optimizer, count, groups in sent["steps"]:
            if count > self.counts[optimizer]:  # a step made while this rank was out of its loop
                self._mirror(self.optimizers[optimizer], groups)
        self.log = []
        if sent["inputs"] is not None and index not in self.inputs:  # this rank had no batch
            self.inputs[index] = sent["inputs"]
        if not self.divide_by_world and ranks.active:
            self._divide(len(ranks.active) if len(ranks.active) < world_size else None)
        return bool(sent["training"])

    def _mirror(self, optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
        for group, values in zip(optimizer.param_groups, groups):
            for key, value in values.items():
                if isinstance(group.get(key), torch.Tensor):
                    group[key].copy_(value)
                else:
                    group[key] = value
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def _divide(self, factor: Optional[int]) -> None:
        """FSDP2 divides the reduced gradients by ``factor`` (None: by the world size, its default)."""
        if factor is None and not self._divided:
            return
        self._divided = factor is not None
        for group in (g for m, s in zip(self.models, self.sharded) if s for g in _param_groups(m)):
            group.gradient_divide_factor = None if factor is None else float(factor)
            group.force_sum_reduction_for_comms = factor is not None  # gloo has no PREMUL_SUM

    # ------------------------------------------------------------------ a finished rank
    def leave(self) -> None:
        """This rank leaves its loop: after an optimizer step its gradients are spent; inside an
        accumulation window (``od.no_sync``) its local gradients are dropped, as DDP + od.join's
        finished ranks send zeros whatever they accumulated."""
        if self.log:  # steps since the last step check
            for optimizer in self.optimizers:
                optimizer.zero_grad(set_to_none=True)
        for group in (g for m, s in zip(self.models, self.sharded) if s for g in _param_groups(m)):
            for param in group.fsdp_params:
                param.unsharded_accumulated_grad = None
                unsharded = getattr(param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None

    def shadow(self, index: int, check: StepCheck, training: bool) -> None:
        """Sharded model ``index``'s step on a finished rank: its forward pass on the last batch
        this rank had, and a backward pass from zeros when the others' has one."""
        model = self.models[index]
        args, kwargs = self.inputs[index]
        model.set_requires_gradient_sync(check.sync)  # type: ignore[operator]
        mode = model.training
        model.train(training)
        try:
            with _forked_rng(model), torch.set_grad_enabled(check.grad):
                out = model(*args, **kwargs)
                outputs = [t for t in _tensors(out) if t.requires_grad]
                if check.grad and outputs:
                    torch.autograd.backward(outputs, [torch.zeros_like(t) for t in outputs])
        finally:
            model.train(mode)

    def clip(self, ranks: JoinedRanks, index: int, limits: Optional[tuple[float, float]]) -> torch.Tensor:
        """od.clip_grad_norm_ of sharded model ``index`` on every rank (``limits``: ``max_norm`` and
        ``norm_type`` on the ranks in their loops, None on the others)."""
        max_norm, norm_type = self.send(limits, min(ranks.active))
        params = [p for p in self.models[index].parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)  # type: ignore[misc]
        full = getattr(total, "full_tensor", None)  # the shards' norm, reduced over the ranks
        if full is not None:
            total = full()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def exit(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.inputs = {}
        self._divide(None)
        for model, sharded in zip(self.models, self.sharded):
            if sharded:
                model.set_requires_gradient_sync(True)  # type: ignore[operator]


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's hyperparameters (all but its parameters), as of now."""
    return [
        {
            k: v.detach().clone() if isinstance(v, torch.Tensor) else v
            for k, v in group.items()
            if k != "params"
        }
        for group in optimizer.param_groups
    ]


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a forward pass's output (nested tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() or value.is_complex() else []
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _forked_rng(model: torch.nn.Module) -> Any:
    """The shadow step's random draws (dropout) on copies of this rank's generators."""
    local = next((p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()), None)
    device = local.device if local is not None else torch.device("cpu")
    if device.type == "cpu":
        return torch.random.fork_rng(devices=[])
    return torch.random.fork_rng(devices=[device], device_type=device.type)


def sharded_hyperparameters(optimizer: Any) -> Optional[list[dict[str, Any]]]:
    """A sharded optimizer's hyperparameters (its state stays on each rank: every rank stepped
    its shards); None for any other object."""
    return _hyperparameters(optimizer) if is_sharded_optimizer(optimizer) else None


class ShardedRanks(JoinedRanks):
    """The ranks of an od.join block that holds a sharded model, with its shadow steps."""

    def __init__(self, b: Any, steps: ShardedSteps) -> None:
        super().__init__(b)
        self.steps = steps


def clip_in_join(model: torch.nn.Module, max_norm: float, norm_type: float) -> Optional[torch.Tensor]:
    """od.clip_grad_norm_ of sharded ``model`` inside od.join once a rank has left its loop: the
    total norm before clipping, on every rank (None elsewhere: the caller clips as usual)."""
    ranks = world.join
    if not isinstance(ranks, ShardedRanks):
        return None
    ranks.settle()
    if not ranks.left:
        return None
    from .wrappers import unwrap

    found = [i for i, m in enumerate(ranks.steps.models) if m is model or unwrap(m) is unwrap(model)]
    if not found:
        raise OnedistValueError(
            f"onedist.clip_grad_norm_: model={type(model).__name__} is a sharded model that is not one "
            "of od.join's; allowed inside od.join once a rank has left: the sharded models given to "
            "od.join (a finished rank clips its shards of them)\nHINT: with od.join(model, optimizer): ..."
        )
    ranks.announce(CLIP_NORM + found[0], False, False, wait=True)
    return ranks.steps.clip(ranks, found[0], (max_norm, norm_type))
