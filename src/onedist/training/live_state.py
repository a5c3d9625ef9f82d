"""Live recovery's group and state: the group made again with a replacement, and the training
state sent to it from a survivor in one broadcast (no checkpoint file). :mod:`.live_steps` decides when.

The group object stays the same (DDP and the collectives hold it): onedist's gloo group
(:class:`~onedist.backends.recorded.gloo.RecordedGloo`) makes its gloo connections again under the
new generation's prefix of the same store (:meth:`~onedist.backends.recorded.gloo.RecordedGloo.rejoin`),
so no port is bound again. DDP gets a fresh reducer on every rank, so that the survivors' and the
replacement's rebuild their buckets at the same iteration, with the same collective.
"""

from __future__ import annotations

import io
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from .._recovery import READY_KEY, STARTED_ENV, SUPPORTED_BACKENDS, generation, generation_key
from ..context import backend, current, regrouped
from ..errors import OnedistRuntimeError, bad_value
from .accumulation import set_micro_steps
from .sharding import is_sharded

__all__ = ["Position", "check_live_run", "recover", "take_ready"]

_c10d: Any = dist.distributed_c10d
#: how long the survivors wait for the launcher to start a replacement
WAIT_S = 300.0

_generation: list[int] = []  # the generation this process's group is in (read on first use:
# a spare worker imports this module before it is told its variables)


_ready: list[bool] = []  # this process said so (once: a later loop neither counts nor receives)


def _current() -> int:
    if not _generation:
        _generation.append(generation(os.environ))
    return _generation[0]


@dataclass
class Position:
    """Where a loop of :func:`~onedist.steps` stands: the pass, the batch index in it, and the
    optimizer steps started (a step's first batch, for a rollback)."""

    epoch: int
    index: int
    number: int


def check_live_run(model: torch.nn.Module) -> None:
    """Refuse, at once, a loop live recovery cannot take back: another backend than gloo, a
    sharded model (FSDP2)."""
    name = backend()
    group = _c10d._get_default_group() if dist.is_initialized() else None
    if name not in SUPPORTED_BACKENDS or not hasattr(group, "rejoin"):
        raise bad_value(
            "steps",
            "backend",
            name,
            f"{', '.join(repr(b) for b in SUPPORTED_BACKENDS)} (onedist's recorded gloo group) under "
            "recovery='live': its group can be made again with a replacement on the same store",
            hint="run with `onedist run --backend gloo --recovery live`, or leave --recovery at 'restart' "
            "(every worker restarted, resuming with od.resume); ONEDIST_RECORD=0 gives plain gloo, "
            "which cannot be made again",
        )
    if is_sharded(getattr(model, "module", model)) or is_sharded(model):
        raise bad_value(
            "steps",
            "model",
            type(model).__name__ + " (sharded: FSDP2)",
            "a DistributedDataParallel model (auto_model without sharding) under recovery='live': a "
            "dead rank's shards exist nowhere else",
            hint="use --recovery restart with od.save_training_state / od.resume for a sharded model",
        )


def _raw_store() -> Any:
    """The launcher's store itself (the keys :mod:`onedist._recovery` names), under the prefixes."""
    store = _c10d._get_default_store()
    while isinstance(store, _c10d.PrefixStore):
        store = store.underlying_store
    return store


def take_ready(model: torch.nn.Module, objects: Mapping[str, Any]) -> Optional[dict[str, Any]]:
    """The first step of this process's first loop: say the launcher may replace this rank
    alone; a replacement receives the state here (what :func:`_exchange` returns), a first worker
    (or a later loop) gets None."""
    if _ready:
        return None
    _ready.append(True)
    _raw_store().add(READY_KEY, 1)
    if _current() == 0:
        return None
    return _exchange(model, objects, None)


def recover(
    model: torch.nn.Module, objects: Mapping[str, Any], start: Position, rng: Any, micro: Any
) -> None:
    """A survivor, rolled back to ``start``: wait for the launcher's replacement, make the group
    again with it, and send it the state if this rank is the one chosen."""
    number = _current() + 1
    store = _raw_store()
    began = time.monotonic()
    # the survivors still blocked in the failed step's collective (with this rank, not the dead
    # one) learn of the failure now: their connections to this rank go away
    current().break_pending()
    try:
        store.wait([generation_key(number)], timedelta(seconds=WAIT_S))
    except Exception as e:
        raise OnedistRuntimeError(
            f"onedist.steps: a rank failed and no replacement was started within {WAIT_S:.0f} s "
            f"({e}).\nHINT: live recovery needs `onedist run --recovery live` with restarts left "
            "(--max-restarts)"
        ) from e
    _c10d._get_default_group().rejoin(number)
    _generation[0] = number
    regrouped()
    took = time.monotonic() - began
    _exchange(model, objects, {"position": start, "rng": rng, "micro": micro}, rejoined_s=took)


def _bucket_order(model: torch.nn.Module) -> Optional[list[int]]:
    """The order of DDP's gradient buckets now (the parameters' indices, bucket by bucket): after
    its first iterations DDP rebuilds them in the order the gradients became ready."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return None
    ddp: Any = model  # DDP's private steps are untyped
    index = {id(p): i for i, p in enumerate(ddp._build_params_for_reducer()[0])}
    buckets = ddp.reducer._get_zeros_like_grad_buckets()
    return [index[id(p)] for bucket in buckets for p in bucket.parameters()]


def _fresh_reducer(model: torch.nn.Module, order: Optional[list[int]]) -> None:
    """A new DDP reducer (DDP's own constructor steps) whose buckets hold the parameters in
    ``order`` (the survivors' rebuilt buckets: the same sums, bit for bit, as before the failure),
    its communication hooks registered again, and onedist's step count of the model from 0: the
    same on every rank of the new group, which rebuild their buckets together after it."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return
    ddp: Any = model  # DDP's private steps are untyped
    parameters, sparse = ddp._build_params_for_reducer()
    if order is not None and sorted(order) == list(range(len(parameters))):
        parameters, sparse = [parameters[i] for i in order], [sparse[i] for i in order]
    names = ddp._build_debug_param_to_name_mapping(parameters)
    ddp._ddp_init_helper(parameters, sparse, names, ddp.static_graph)
    for hook, hook_state in ddp._comm_hooks:
        dist._register_comm_hook(ddp.reducer, hook_state, hook)  # type: ignore[attr-defined]
    ddp._onedist_steps = 0  # onedist.backends.recorded.steps counts from here on every rank


def _exchange(
    model: torch.nn.Module,
    objects: Mapping[str, Any],
    mine: Optional[dict[str, Any]],
    rejoined_s: float = 0.0,
) -> Optional[dict[str, Any]]:
    """Every rank of the new group: agree on the step, and one rank that has the state sends it
    (``mine``: this rank's start of the step; None on a replacement, which receives it)."""
    order = _bucket_order(model) if mine is not None else None
    began = time.monotonic()
    start = mine["position"] if mine is not None else Position(-1, -1, -1)
    row = torch.tensor([int(mine is None), start.epoch, start.index, start.number], dtype=torch.int64)
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row)
    givers = [r for r, t in enumerate(rows) if int(t[0]) == 0]
    if not givers or len({tuple(rows[r][1:].tolist()) for r in givers}) != 1:
        raise OnedistRuntimeError(
            "onedist.steps: live recovery cannot continue: the surviving ranks are at different steps "
            f"({ {r: rows[r][1:].tolist() for r in givers} }: [epoch, index, step])"
        )
    source = givers[0]
    payload = _pack(objects, {**mine, "order": order}) if dist.get_rank() == source and mine else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(size, source)
    data = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if payload
        else torch.empty(int(size), dtype=torch.uint8)
    )
    dist.broadcast(data, source)
    sent_s = time.monotonic() - began
    if dist.get_rank() == source:
        sys.stderr.write(
            f"onedist: live recovery: rank {source} sent the state of step {start.number + 1} "
            f"({int(size) / 2**20:.2f} MB) in {sent_s:.3f} s; group made again in {rejoined_s:.3f} s\n"
        )
    if mine is not None:
        _fresh_reducer(model, order)
        return None
    received = _unpack(model, objects, data, source, sent_s)
    _fresh_reducer(model, received["order"])
    return received


def _pack(objects: Mapping[str, Any], mine: Mapping[str, Any]) -> bytes:
    state = {
        "objects": {name: obj.state_dict() for name, obj in objects.items() if obj is not None},
        "position": vars(mine["position"]),
        "rng": mine["rng"],
        "micro": mine["micro"],
        "order": mine["order"],
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def _unpack(
    model: torch.nn.Module, objects: Mapping[str, Any], data: torch.Tensor, source: int, sent_s: float
) -> dict[str, Any]:
    state = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False)
    for name, obj in objects.items():
        if obj is not None:
            obj.load_state_dict(state["objects"][name])
    if state["micro"] is not None:
        set_micro_steps(model, *state["micro"])
    position = Position(**state["position"])
    started = float(os.environ.get(STARTED_ENV, "0") or 0)
    startup = f"{time.time() - sent_s - started:.2f} s after its start, " if started else ""
    sys.stderr.write(
        f"onedist: live recovery: rank {dist.get_rank()} (generation {_current()}) received the state "
        f"of step {position.number + 1} from rank {source}, {startup}in {sent_s:.3f} s\n"
    )
    return {"position": position, "rng": state["rng"], "order": state["order"]}
