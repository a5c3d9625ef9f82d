"""One-file checkpoints and sharded models: a whole checkpoint read into each rank's shards, and a
sharded model written as one file, never the whole model twice on a rank.

* :func:`load_into_shards`: :func:`~onedist.load_checkpoint` of a one-file checkpoint (what
  ``save_checkpoint`` writes for an unsharded model, with ``full=True``, or a plain ``torch.save``
  state dict) into ``to`` that holds a sharded model. Each rank verifies the file's CRC-32 (a pass
  over a memory map that hands each 4 MiB back once hashed), loads it with ``mmap=True`` (nothing
  read yet) and copies into each DTensor's local shard only its chunk of the saved tensor
  (:func:`~onedist.training.meta_init.chunk_of`: a view; FSDP2's ``Shard(0)`` chunk is one run of
  the file's bytes). Nothing of the model is copied whole; the other values (an epoch, an
  unsharded model) are copied into memory of their own; the file is unmapped before it returns.
  A rank's peak is its shards plus the file pages of its chunks while they are copied: 2/N of
  the model and a fixed overhead (docs/training.md, "Models larger than one rank").
* :func:`gathered`: ``save_checkpoint(..., full=True)``'s state, each sharded model's state dict
  gathered to the writer one tensor at a time
  (:func:`~onedist.training.sharding.gather_state_dict`).
"""

from __future__ import annotations

import gc
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..errors import bad_type, bad_value
from .checksums import own_memory
from .meta_init import chunk_of
from .outcomes import on_every_rank
from .sharding import gather_state_dict, is_sharded, is_sharded_optimizer

__all__ = ["WRAPPER_PREFIXES", "gathered", "load_into_shards", "strip_prefixes"]

#: prefixes that wrappers add to every key of a module's state dict (DDP / DataParallel, torch.compile)
WRAPPER_PREFIXES = ("module.", "_orig_mod.")

Path_ = tuple[Any, ...]  # where a value sits in ``to`` (dict keys and list indices)


# ============================================================================ load
def load_into_shards(
    to: Any, read: Callable[[], Any], location: Any, load_into: Callable[[Any, Any, str], None], name: str
) -> Any:
    """Load the one-file checkpoint ``read()`` returns mapped (checksums.load_mapped) into ``to``,
    which holds a sharded model: each rank copies its chunks into its shards, ``load_into(live,
    saved, where)`` loads the rest (checkpoint.py's loader). The checkpoint, each sharded model's
    entry its live state dict (DTensors), as for a sharded checkpoint. Every rank calls it.

    Example:
        >>> import tempfile, torch
        >>> from pathlib import Path
        >>> from onedist.training.checksums import load_mapped
        >>> path = tempfile.mkdtemp() + "/w.pt"
        >>> torch.save({"weight": torch.ones(2, 2), "bias": torch.zeros(2)}, path)
        >>> net = torch.nn.Linear(2, 2)  # not sharded here (one process): loaded as usual
        >>> loaded = load_into_shards(net, lambda: load_mapped(Path(path), True), "cpu",
        ...                           lambda live, saved, where: live.load_state_dict(saved), path)
        >>> sorted(loaded), float(net.weight.detach().sum())
        (['bias', 'weight'], 4.0)
    """
    if not isinstance(location, (str, torch.device)):
        raise bad_value(
            "load_checkpoint",
            "map_location",
            location,
            "a device (a str or torch.device) when `to` holds a sharded model: its shards are "
            "copied onto the model's device, the other values onto map_location",
        )
    loaded = _load(to, read, torch.device(location), load_into, name)
    gc.collect()  # a reference cycle that reaches a mapped tensor would keep the file mapped
    return loaded


def _load(to: Any, read: Callable[[], Any], device: torch.device, load_into: Any, name: str) -> Any:
    failed = f"onedist.load_checkpoint: rank {{}} could not load {name!r}"
    mapped = on_every_rank(read, failed.format)
    # every check before any copy: a load that fails changes no live object
    plan = on_every_rank(lambda: _plan(to, mapped, name), (failed + " into `to`").format)
    # what it returns holds nothing of the file: the mapping goes with this frame
    return on_every_rank(lambda: _fill(to, mapped, plan, device, load_into), (failed + " into `to`").format)


def _plan(to: Any, mapped: Any, name: str) -> dict[Path_, tuple[torch.nn.Module, dict[str, Any], Any]]:
    """For each sharded model of ``to``: (the module, its live state dict, the saved one), checked."""
    from .wrappers import unwrap

    plan: dict[Path_, tuple[torch.nn.Module, dict[str, Any], Any]] = {}
    for path, live in _leaves(to):
        where = "to" + "".join(f"[{p!r}]" for p in path)
        found, saved = _at(mapped, path)
        if is_sharded(live):
            if not found:
                raise bad_value(
                    "load_checkpoint",
                    where,
                    type(unwrap(live)).__name__,
                    f"a key of the checkpoint {name!r} ({_keys(mapped)})",
                    hint=_one_model(mapped),
                )
            module = unwrap(live)
            saved = strip_prefixes(_state_dict_of(saved, where), module)
            own = module.state_dict()
            _check_keys(own, saved, where)
            plan[path] = (module, own, saved)
        elif is_sharded_optimizer(live) and found and isinstance(saved, Mapping) and saved.get("state"):
            raise bad_value(
                "load_checkpoint",
                where,
                type(live).__name__,
                "an optimizer without saved state, or not in `to`, when loading a one-file "
                "checkpoint into a sharded model",
                hint="an unsharded run's optimizer state does not load into a sharded model's "
                "optimizer: leave the optimizer out of `to` (it starts afresh), or resume from a sharded "
                "checkpoint (save_checkpoint of the sharded model and its optimizer)",
            )
    return plan


def _fill(
    to: Any,
    mapped: Any,
    plan: dict[Path_, tuple[torch.nn.Module, dict[str, Any], Any]],
    location: torch.device,
    load_into: Callable[[Any, Any, str], None],
) -> Any:
    """Each rank's chunks into its shards, the rest owned and loaded; the checkpoint."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for _, own, saved in plan.values():
            for key, t in own.items():
                if isinstance(t, DTensor):  # only this rank's chunk of the file's tensor is read
                    t.to_local().copy_(chunk_of(saved[key], t))
                else:  # a buffer, whole on every rank
                    t.copy_(saved[key])
    rest = own_memory(_replaced(mapped, dict.fromkeys(plan)))
    if location.type != "cpu":
        rest = _to(rest, location)
    if () not in plan:
        load_into(_replaced(to, dict.fromkeys(plan)), rest, "to")
    return _replaced(rest, {path: own for path, (_, own, _) in plan.items()})


def _leaves(value: Any, path: Path_ = ()) -> list[tuple[Path_, Any]]:
    """Every value of ``to`` that is not a dict, list or tuple, with where it sits."""
    if isinstance(value, Mapping):
        return [leaf for k, v in value.items() for leaf in _leaves(v, (*path, k))]
    if isinstance(value, (list, tuple)):
        return [leaf for i, v in enumerate(value) for leaf in _leaves(v, (*path, i))]
    return [(path, value)]


def _at(value: Any, path: Path_) -> tuple[bool, Any]:
    """Whether ``value`` has an entry at ``path``, and the entry."""
    for part in path:
        listed = isinstance(value, (list, tuple)) and isinstance(part, int) and part < len(value)
        if listed or (isinstance(value, Mapping) and part in value):
            value = value[part]
        else:
            return False, None
    return True, value


def _keys(value: Any) -> str:
    if isinstance(value, Mapping):
        return f"it has {sorted(map(str, value))[:12]}"
    return f"it holds a {type(value).__name__}"


def _one_model(mapped: Any) -> Any:
    """The fix when the checkpoint is one model's state dict (every value a tensor)."""
    if isinstance(mapped, Mapping) and mapped and all(isinstance(v, torch.Tensor) for v in mapped.values()):
        return "the checkpoint is one model's state dict: pass the model itself: load_checkpoint(path, model)"
    return None


def _replaced(value: Any, new: dict[Path_, Any], path: Path_ = ()) -> Any:
    """``value`` with the entries at ``new``'s paths replaced (new containers along the way only)."""
    if path in new:
        return new[path]
    if not any(p[: len(path)] == path for p in new):
        return value
    if isinstance(value, Mapping):
        return {k: _replaced(v, new, (*path, k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_replaced(v, new, (*path, i)) for i, v in enumerate(value)]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def _to(value: Any, location: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(location)
    if isinstance(value, Mapping):
        return {k: _to(v, location) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_to(v, location) for v in value)
    return value


def _state_dict_of(saved: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(saved, Mapping):
        raise bad_type("load_checkpoint", f"the checkpoint's entry for {where}", saved, "a model state dict")
    return saved


def _check_keys(own: Mapping[str, Any], saved: Mapping[str, Any], where: str) -> None:
    """The saved state dict has the model's keys, tensors of its shapes (as ``load_state_dict``'s
    strict check; dtypes are cast on the copy)."""
    missing = [k for k in own if k not in saved]
    unexpected = [k for k in saved if k not in own]
    if missing or unexpected:
        raise bad_value(
            "load_checkpoint",
            f"the checkpoint's entry for {where}",
            f"a state dict of {len(saved)} keys",
            f"the model's keys; missing: {missing[:8]}, unexpected: {unexpected[:8]}",
        )
    for key, t in own.items():
        value = saved[key]
        if not isinstance(t, torch.Tensor):
            raise bad_value(
                "load_checkpoint",
                where,
                f"a model whose state dict holds {type(t).__name__} at {key!r}",
                "a model whose state dict holds tensors only (extra state loads from a sharded checkpoint)",
            )
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(t.shape):
            shown = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise bad_value(
                "load_checkpoint",
                f"the checkpoint's {key!r} for {where}",
                shown,
                f"a tensor of the model's shape {tuple(t.shape)}",
            )


def strip_prefixes(saved: Mapping[str, Any], module: torch.nn.Module) -> Mapping[str, Any]:
    """``saved`` without the wrapper prefixes that every saved key has and the module's own keys lack.

    Example:
        >>> import torch
        >>> saved = {"module.weight": torch.ones(1, 1), "module.bias": torch.ones(1)}
        >>> list(strip_prefixes(saved, torch.nn.Linear(1, 1)))
        ['weight', 'bias']
    """
    own = list(module.state_dict().keys())
    keys = list(saved.keys())
    stripped: list[str] = []
    while keys:
        prefix = next(
            (
                p
                for p in WRAPPER_PREFIXES
                if all(isinstance(k, str) and k.startswith(p) for k in keys)
                and not (own and all(k.startswith(p) for k in own))
            ),
            None,
        )
        if prefix is None:
            break
        keys = [k[len(prefix) :] for k in keys]
        stripped.append(prefix)
    if not stripped:
        return saved
    out: OrderedDict[str, Any] = OrderedDict(zip(keys, saved.values()))
    metadata = getattr(saved, "_metadata", None)
    if metadata is not None:  # per-module versions, read by some modules' _load_from_state_dict
        renamed: OrderedDict[str, Any] = OrderedDict()
        for key, value in metadata.items():
            for p in stripped:
                key = "" if key == p[:-1] else key[len(p) :] if key.startswith(p) else key
            renamed.setdefault(key, value)
        out._metadata = renamed  # type: ignore[attr-defined]
    return out


# ============================================================================ save
def gathered(obj: Any, writer: int, state_of: Callable[[Any], Any]) -> Any:
    """``save_checkpoint(obj, path, rank=writer, full=True)``'s state on ``writer`` (None on the
    others): each sharded model's whole state dict, gathered one tensor at a time, the other values
    ``state_of(value)`` (checkpoint.py's). A sharded model's optimizer is refused before anything
    is gathered. Every rank calls it.

    Example:
        >>> import torch
        >>> sorted(gathered({"model": torch.nn.Linear(2, 1), "epoch": 3}, 0, lambda v: v))
        ['epoch', 'model']
    """
    from ..context import current

    for path, live in _leaves(obj):
        if is_sharded_optimizer(live):
            raise bad_value(
                "save_checkpoint",
                "full",
                True,
                "False when `obj` holds a sharded model's optimizer",
                hint=f"full=True writes a sharded model's weights as one file (an export); the "
                f"optimizer at {list(path)} has sharded state: save it in a sharded checkpoint "
                "(full=False), or leave it out",
            )
    keep = current().rank == writer

    def build(value: Any) -> Any:
        if is_sharded(value):
            return gather_state_dict(value, writer)  # a collective per tensor: every rank
        if isinstance(value, Mapping):
            return {k: build(v) for k, v in value.items()}
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*(build(v) for v in value))
        if isinstance(value, (list, tuple)):
            return type(value)(build(v) for v in value)
        return state_of(value) if keep else None

    state = build(obj)
    return state if keep else None
