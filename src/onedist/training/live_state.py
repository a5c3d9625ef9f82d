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
import pickle
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from .._recovery import READY_KEY, STARTED_ENV, SUPPORTED_BACKENDS, generation_key, joined, meet, own_key
from ..context import backend, current, regrouped
from ..errors import OnedistError, OnedistRuntimeError, RemoteRankError, bad_value
from ..failures.explain import explain
from .accumulation import set_micro_steps
from .sharding import is_sharded

__all__ = ["OwnState", "Position", "check_live_run", "peer_failed", "recover", "take_ready"]

_c10d: Any = dist.distributed_c10d
#: how long the survivors wait for the launcher to start a replacement
WAIT_S = 300.0

_ready: list[bool] = []  # this process said so (once: a later loop neither counts nor receives)


def _current() -> int:
    """The generation this process's group is in (read on use: a spare worker imports this
    module before it is told its variables)."""
    return joined(os.environ)


@dataclass
class Position:
    """Where a loop of :func:`~onedist.steps` stands: the pass, the batch index in it, and the
    optimizer steps started (a step's first batch, for a rollback)."""

    epoch: int
    index: int
    number: int


#: the values a list of them is kept, and compared, as it is (Python's RNG state: 625 ints)
_PLAIN = (int, float, str, bool, type(None))


class OwnState:
    """What only this rank knows of a step's start, kept in the launcher's store (which outlives
    the rank) for its replacement: its RNG states (ranks may draw from streams of their own) and,
    where they are its own, its module's buffers (every rank's without DDP's ``broadcast_buffers``,
    else rank 0's alone: the others take rank 0's at the next forward pass). One store write per
    step: :meth:`publish` at the optimizer step (the next step's start: a death right after it
    finds it there) and again at the step's start when that moved the RNG states."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.key = own_key(dist.get_rank())
        broadcast = isinstance(model, torch.nn.parallel.DistributedDataParallel) and model.broadcast_buffers
        self.buffers = not broadcast or dist.get_rank() == 0
        self.published: Optional[tuple[int, dict[str, Any]]] = None

    def publish(self, number: int, rng: dict[str, Any], module: torch.nn.Module) -> None:
        """This rank's state at the start of step ``number``: ``rng`` and ``module``'s buffers."""
        if self.published is not None and self.published[0] == number and _same(self.published[1], rng):
            return
        buffers = list(module.buffers()) if self.buffers else None
        # pickled with its tensors as bytes: 0.09 ms for the digits model's 12.5 kB, where
        # torch.save took 0.43 ms (its zip archive), of a 20-30 ms step
        record = {"number": number, "rng": _bare(rng), "buffers": _bare(buffers)}
        _raw_store().set(self.key, pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL))
        self.published = (number, rng)


@dataclass
class _Tensor:
    """A CPU tensor as plain bytes (pickled without torch's machinery)."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


def _bare(value: Any) -> Any:
    """``value`` with each tensor a :class:`_Tensor` (lists, tuples and dicts walked)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return _Tensor(str(t.dtype).removeprefix("torch."), tuple(t.shape), data)
    if isinstance(value, dict):
        return {k: _bare(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not all(type(v) in _PLAIN for v in value):
        return type(value)(_bare(v) for v in value)
    return value  # Python's RNG state, 625 ints: as it is


def _dressed(value: Any) -> Any:
    """What :func:`_bare` took apart, with its tensors again."""
    if isinstance(value, _Tensor):
        dtype = getattr(torch, value.dtype)
        if not value.data:
            return torch.empty(value.shape, dtype=dtype)
        return torch.frombuffer(bytearray(value.data), dtype=dtype).reshape(value.shape)
    if isinstance(value, dict):
        return {k: _dressed(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not all(type(v) in _PLAIN for v in value):
        return type(value)(_dressed(v) for v in value)
    return value


def _same(a: Any, b: Any) -> bool:
    """RNG states equal (tensors compared by value)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if all(type(x) in _PLAIN for x in a):  # Python's RNG state, 625 ints: compared at once
            return list(a) == list(b)
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _own_state(number: int) -> Optional[dict[str, Any]]:
    """What the rank this replacement replaces kept of the start of step ``number`` (see
    :class:`OwnState`); None when its latest is of another step (it died between an optimizer step
    and the next step's start after a draw) or it kept none."""
    store, key = _raw_store(), own_key(dist.get_rank())
    if not store.check([key]):
        return None
    record: dict[str, Any] = _dressed(pickle.loads(store.get(key)))  # the launcher's store: trusted
    return record if record["number"] == number else None


def check_live_run(model: torch.nn.Module) -> None:
    """Refuse, at once, a loop live recovery cannot take back: another backend than gloo or shm
    (or torch's plain gloo group, ``ONEDIST_RECORD=0``), a sharded model (FSDP2)."""
    name = backend()
    group = _c10d._get_default_group() if dist.is_initialized() else None
    if name not in SUPPORTED_BACKENDS or not hasattr(group, "rejoin"):
        plain = " (torch's own gloo group: ONEDIST_RECORD=0)" if name in SUPPORTED_BACKENDS else ""
        shown = name + plain if name else name
        raise bad_value(
            "steps",
            "backend",
            shown,
            f"{', '.join(repr(b) for b in SUPPORTED_BACKENDS)} (onedist's recorded gloo group, its "
            "shared-memory group) under recovery='live': its group can be made again with a replacement "
            "on the same store",
            hint="run with `onedist run --backend gloo --recovery live` (or --backend shm), or leave "
            "--recovery at 'restart' (every worker restarted, resuming with od.resume); ONEDIST_RECORD=0 "
            "gives plain gloo, which cannot be made again",
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


def peer_failed(error: BaseException) -> bool:
    """``error``, raised inside a step, is a peer's death: onedist's :class:`RemoteRankError` (a
    collective of onedist's, a DDP backward on the recorded gloo group), or a backend's error that
    onedist explains as one (:func:`~onedist.failures.explain.explain`: shm's "rank 1 (pid ..)
    exited", raised as is by DDP's buffer broadcast in its forward, or inside its backward)."""
    if isinstance(error, RemoteRankError):
        return True
    if not isinstance(error, RuntimeError) or isinstance(error, OnedistError):
        return False  # a timeout, a mismatch, the user's own error: not recovered
    return isinstance(explain("steps", error, None, time.monotonic()), RemoteRankError)


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
        number = meet(store, number)  # a later generation when another rank died meanwhile
    except Exception as e:
        raise OnedistRuntimeError(
            f"onedist.steps: a rank failed and no replacement was started, or did not meet the "
            f"others, within {WAIT_S:.0f} s ({e}).\nHINT: live recovery needs `onedist run "
            "--recovery live` with restarts left (--max-restarts)"
        ) from e
    _c10d._get_default_group().rejoin(number)
    regrouped()
    took = time.monotonic() - began
    _exchange(model, objects, {"position": start, "rng": rng, "micro": micro}, rejoined_s=took)


def _bucket_order(model: torch.nn.Module) -> Optional[list[list[int]]]:
    """DDP's gradient buckets now, each as its parameters' indices in its order: after its first
    iterations DDP rebuilds them in the order the gradients became ready."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return None
    ddp: Any = model  # DDP's private steps are untyped
    index = {id(p): i for i, p in enumerate(ddp._build_params_for_reducer()[0])}
    buckets = ddp.reducer._get_zeros_like_grad_buckets()
    return [[index[id(p)] for p in bucket.parameters()] for bucket in buckets]


def _fresh_reducer(model: torch.nn.Module, buckets: Optional[list[list[int]]]) -> None:
    """A new DDP reducer (DDP's own constructor steps) with ``buckets``, the survivors' (each
    parameter in the same bucket at the same place: gloo's ring sums an element in an order that
    depends on its place in the bucket, so the same sums, bit for bit, as before the failure), its
    communication hooks registered again, and onedist's step count of the model from 0: the same on
    every rank of the new group, which rebuild their buckets together after it."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return
    ddp: Any = model  # DDP's private steps are untyped
    parameters, sparse = ddp._build_params_for_reducer()
    names = ddp._build_debug_param_to_name_mapping(parameters)
    assign = dist._compute_bucket_assignment_by_size  # type: ignore[attr-defined]
    if buckets is not None and sorted(i for b in buckets for i in b) == list(range(len(parameters))):

        def survivors(*args: Any, **kwargs: Any) -> Any:  # DDP reverses the list it gets
            return list(reversed(buckets)), [ddp.bucket_bytes_cap] * len(buckets)

        dist._compute_bucket_assignment_by_size = survivors  # type: ignore[attr-defined]
    try:
        ddp._ddp_init_helper(parameters, sparse, names, ddp.static_graph)
    finally:
        dist._compute_bucket_assignment_by_size = assign  # type: ignore[attr-defined]
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
    rng, own = state["rng"], _own_state(position.number + 1)
    if own is not None:  # the dead rank's own RNG states (and buffers) at the step's start
        rng = own["rng"]
        with torch.no_grad():
            for b, kept in zip(objects["model"].buffers(), own["buffers"] or []):
                b.copy_(kept)
    started = float(os.environ.get(STARTED_ENV, "0") or 0)
    startup = f"{time.time() - sent_s - started:.2f} s after its start, " if started else ""
    whose = "its own RNG states" if own is not None else f"rank {source}'s RNG states (none of its own kept)"
    sys.stderr.write(
        f"onedist: live recovery: rank {dist.get_rank()} (generation {_current()}) received the state "
        f"of step {position.number + 1} from rank {source}, {startup}in {sent_s:.3f} s; {whose}\n"
    )
    return {"position": position, "rng": rng, "order": state["order"]}
