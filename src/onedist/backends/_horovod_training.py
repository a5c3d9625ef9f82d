"""The Horovod backend's training objects: rank 0's model and optimizer state on every rank, and
``hvd.DistributedOptimizer`` around the user's optimizer (``auto_model`` / ``auto_optim``)."""

from __future__ import annotations

import contextlib
import io
import sys
import weakref
from collections.abc import Iterator
from typing import Any, Optional

import torch

from ..errors import bad_type, bad_value
from .interface import Backend, Work

# hvd.DistributedOptimizer's keyword arguments that auto_optim passes through
_OPTIM_KWARGS = (
    "named_parameters",
    "compression",
    "backward_passes_per_step",
    "op",
    "gradient_predivide_factor",
    "num_groups",
    "groups",
    "sparse_as_dense",
)
_HVD_OPTIMIZER_MODULE = "horovod.torch.optimizer"


class HorovodTraining(Backend):
    """``prepare_model`` and ``wrap_optimizer`` of :class:`~onedist.backends.horovod.HorovodBackend`,
    on its broadcast."""

    _hvd: Any
    exchangers: weakref.WeakSet[Any]

    # ------------------------------------------------------------------ training objects
    model_parallelism = "own"

    def prepare_model(
        self, model: torch.nn.Module, sync_bn: bool, hooks: dict[str, Any], ddp_kwargs: dict[str, Any]
    ) -> torch.nn.Module:
        """Broadcast rank 0's parameters and buffers; no wrapper (gradients are averaged by the
        optimizer, see :meth:`wrap_optimizer`). With ``sync_bn`` the BatchNorm layers are
        :class:`onedist.SyncBatchNorm` already (``sync_bn_by_onedist``: auto_model converted them).
        DDP keyword arguments are checked and have no effect."""
        if hooks:
            name = sorted(hooks)[0]
            raise bad_value(
                "auto_model",
                name,
                hooks[name],
                "not given with backend 'horovod' (DDP communication hooks)",
                hint="with Horovod, compress gradients with od.auto_optim(optimizer, compression='fp16')",
            )
        self.broadcast_tensors_(list(model.state_dict().values()), src=0)
        return model

    def broadcast_tensors_(self, tensors: list[torch.Tensor], src: int) -> None:
        """Broadcast every tensor in place from global rank ``src`` (one concurrent round)."""
        works: list[Optional[Work]] = []
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        seen: set[tuple[int, int]] = set()
        with torch.no_grad():
            for t in tensors:
                key = (t.data_ptr(), t.numel())
                if t.numel() == 0 or key in seen:  # tied weights: once
                    continue
                seen.add(key)
                dev = self.comm_device(t.device, "broadcast")
                buf = t if (t.device == dev and t.is_contiguous()) else t.detach().to(dev).contiguous()
                if buf is not t:
                    copies.append((t, buf))
                works.append(self.broadcast_(buf, src, None, True))
            for w in works:
                if w is not None:
                    w.wait()
            for t, buf in copies:
                t.copy_(buf)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> torch.optim.Optimizer:
        """``hvd.DistributedOptimizer`` around ``optimizer`` (gradients averaged over the ranks at
        ``step()``), with rank 0's state and hyperparameters on every rank."""
        hvd = self._hvd
        # hvd.DistributedOptimizer builds a class from the optimizer's class and a copy of its own
        # methods (no common base class): recognise it by the module they come from
        if type(optimizer).__module__ == _HVD_OPTIMIZER_MODULE:
            raise bad_type(
                "auto_optim",
                "optimizer",
                optimizer,
                "an optimizer not wrapped by horovod yet",
                hint="pass the plain torch optimizer; auto_optim wraps it in hvd.DistributedOptimizer",
            )
        hvd_kwargs = _optimizer_kwargs(hvd, kwargs)
        state = optimizer.state_dict()
        wrapped: torch.optim.Optimizer = hvd.DistributedOptimizer(optimizer, **hvd_kwargs)
        if state["state"]:
            wrapped.load_state_dict(state)  # hvd.DistributedOptimizer starts from an empty state
        self.broadcast_optimizer_state_(wrapped, src=0)
        self.exchangers.add(wrapped)
        return wrapped

    @contextlib.contextmanager
    def skip_gradient_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """Hold back the allreduce that ``hvd.DistributedOptimizer``'s hook starts when a parameter's
        gradient is ready, for the backward passes inside; the first pass after exchanges the sum.

        Horovod counts backward passes per parameter (``backward_passes_per_step``): inside, the
        count never reaches zero; after, it is one, so the next pass reaches zero and starts the
        allreduce, and ``step()`` waits for it (a ``step()`` without that pass exchanges once, in
        ``synchronize()``). Parameters that no DistributedOptimizer holds exchange nothing."""
        params = [p for p in model.parameters() if p.requires_grad]
        held = []
        for optimizer in list(self.exchangers):
            held_ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
            mine = [p for p in params if id(p) in held_ids]
            if not mine:  # another model's optimizer
                continue
            delays = getattr(optimizer, "_allreduce_delay", None)
            if delays is None or hasattr(optimizer, "_starting_models"):  # Adasum: a delta per step
                raise bad_value(
                    "no_sync",
                    "model",
                    type(model).__name__,
                    "a model whose optimizer is hvd.DistributedOptimizer with op 'average' or 'sum'",
                    hint="Adasum combines each step's parameter deltas, not gradients: accumulate with "
                    "auto_optim(..., backward_passes_per_step=k) instead",
                )
            held += [(delays, p) for p in mine]
        for delays, p in held:
            delays[p] = sys.maxsize
        try:
            yield
        finally:
            for delays, p in held:
                delays[p] = 1

    def broadcast_optimizer_state_(self, optimizer: torch.optim.Optimizer, src: int) -> None:
        """Load rank ``src``'s ``optimizer.state_dict()`` (state and hyperparameters) on every rank.

        Unlike ``hvd.broadcast_optimizer_state``, no step with zero gradients is taken to create
        the state (which would apply weight decay and advance Adam's step count): the state
        travels as it is, empty or not.
        """
        payload = torch.empty(0, dtype=torch.uint8)
        if self.rank == src:
            buffer = io.BytesIO()
            torch.save(optimizer.state_dict(), buffer)
            payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        self.broadcast_(size, src, None, False)
        if self.rank != src:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self.broadcast_(payload, src, None, False)
        if self.rank != src:
            state = torch.load(io.BytesIO(payload.numpy().tobytes()), map_location="cpu", weights_only=False)
            optimizer.load_state_dict(state)


def _optimizer_kwargs(hvd: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Check auto_optim's keyword arguments for ``hvd.DistributedOptimizer``; strings name
    compressions ("none", "fp16") and ops ("average", "sum", "adasum")."""
    out = dict(kwargs)
    for name, value in kwargs.items():
        if name not in _OPTIM_KWARGS:
            raise bad_value(
                "auto_optim",
                name,
                value,
                "keyword arguments of hvd.DistributedOptimizer: " + ", ".join(_OPTIM_KWARGS),
            )
    if "compression" in out:
        value = out["compression"]
        names = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}
        if isinstance(value, str):
            if value.lower() not in names:
                raise bad_value(
                    "auto_optim", "compression", value, ["none", "fp16"], hint="or hvd.Compression.fp16"
                )
            out["compression"] = names[value.lower()]
        elif not (isinstance(value, type) and hasattr(value, "compress") and hasattr(value, "decompress")):
            raise bad_type("auto_optim", "compression", value, "'none', 'fp16' or a horovod Compressor class")
    if "op" in out:
        value = out["op"]
        ops = {"average": hvd.Average, "mean": hvd.Average, "sum": hvd.Sum, "adasum": hvd.Adasum}
        if isinstance(value, str):
            if value.lower() not in ops:
                raise bad_value(
                    "auto_optim",
                    "op",
                    value,
                    ["average", "sum", "adasum"],
                    hint="or hvd.Average / hvd.Sum / hvd.Adasum",
                )
            out["op"] = ops[value.lower()]
        elif value not in (hvd.Average, hvd.Sum, hvd.Adasum):
            raise bad_value(
                "auto_optim", "op", value, "'average', 'sum', 'adasum' or hvd.Average / hvd.Sum / hvd.Adasum"
            )
    if "backward_passes_per_step" in out:
        value = out["backward_passes_per_step"]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise bad_value("auto_optim", "backward_passes_per_step", value, "an int >= 1")
    if "gradient_predivide_factor" in out:
        value = out["gradient_predivide_factor"]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise bad_value("auto_optim", "gradient_predivide_factor", value, "a number > 0")
        if value != 1.0 and out.get("op", hvd.Average) != hvd.Average:
            raise bad_value(
                "auto_optim",
                "gradient_predivide_factor",
                value,
                "1.0 unless op is 'average' (Horovod's rule)",
            )
    return out
