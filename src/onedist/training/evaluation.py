"""Exact distributed evaluation: every rank's results, back in dataset order, each sample once.

A ``DistributedSampler`` pads the last round with the first samples so that every rank gets the
same number; gathering predictions naively then counts those samples twice (an inflated or
deflated metric that differs with the world size), and the gathered rows are in rank-interleaved
order. :func:`all_gather_eval` knows which dataset index every row is (from the loader's sampler,
or from ``indices``), so it returns the results for the whole dataset exactly once, in order.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Optional

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler as _TorchDistributedSampler,
    Sampler,
    SequentialSampler,
)

from ..errors import (
    CollectiveMismatchError,
    OnedistError,
    OnedistValueError,
    RemoteRankError,
    bad_type,
    bad_value,
)
from .samplers import DistributedEvalSampler, DistributedProxySampler, rank_indices

__all__ = ["all_gather_eval"]

_FUNC = "all_gather_eval"
_KNOWN = (_TorchDistributedSampler, DistributedEvalSampler, DistributedProxySampler, SequentialSampler)
_VALUES_ALLOWED = (
    "a tensor whose first dimension is the sample, or a dict/tuple/list (nested) of such tensors"
)
_ORDER_HINT = (
    "evaluate with onedist.auto_dataloader(dataset, ..., evaluation=True), or a DataLoader whose sampler "
    "is a torch/onedist DistributedSampler, or pass indices= (the dataset index of each of this rank's rows)"
)


class _Payload(NamedTuple):
    """What each rank sends, in one collective."""

    error: Optional[str]  # this rank could not prepare its part: the others raise RemoteRankError
    signature: Any  # the structure of ``values``, with each leaf's dtype and trailing shape
    leaves: list[torch.Tensor]
    rows: int
    indices: Optional[torch.Tensor]  # int64, one per row; None when the order is unknown
    total: Optional[int]  # the dataset size when the sampler knows it


def all_gather_eval(values: Any, loader: Any = None, *, indices: Any = None) -> Any:
    """Every rank's evaluation results, for the whole dataset, each sample once, in dataset order.

    Each rank computed ``values`` (predictions, targets, losses, ...) for its share of the
    evaluation dataset. Every rank gets back the results of all ranks: row ``i`` of each tensor is
    dataset sample ``i``, and the samples a ``DistributedSampler`` repeated to pad the last round
    appear once, so a metric computed on the result equals the one-process metric exactly.

    Which dataset sample each row is comes from ``loader`` (its sampler is replayed: torch's and
    onedist's ``DistributedSampler`` with any shuffle/seed/epoch, :class:`onedist.DistributedEvalSampler`,
    :class:`onedist.DistributedProxySampler`, a ``SequentialSampler``) or from ``indices``.
    The whole exchange is one ``all_gather`` (results and indices together), whatever the
    number of tensors.

    Args:
        values: a tensor whose first dimension is the sample (rows in the order the loader gave
            them), or a dict/tuple/list (nested) of such tensors, all with the same number of rows.
            Every rank passes the same structure, dtypes and trailing dimensions; a rank that got
            no samples passes empty tensors (first dimension 0).
        loader: the evaluation ``DataLoader`` (from :func:`onedist.auto_dataloader` or your own,
            with a distributed sampler), or its sampler. Use ``drop_last=False``: every sample of
            the dataset must have a row.
        indices: instead of ``loader``, the dataset index of each of this rank's rows (a 1-D
            integer tensor, a list of ints, or a list of such tensors, one per batch); works with
            any sampler.

    Returns:
        ``values``' structure with every tensor holding the rows of all ranks, on this rank's
        device: ``len(dataset)`` rows in dataset order when the sampler knows its dataset; with
        ``indices`` (or a ``DistributedProxySampler``) one row per distinct index, in increasing
        index order (dataset order; ``max(index) + 1`` rows when the indices are ``0..max``).
        Rows sharing an index (padding) are assumed equal: the first, in rank order, is kept.
        With one process and neither ``loader`` nor ``indices``, ``values`` itself; with one
        process and a loader whose order cannot be replayed (``auto_dataloader(...,
        shuffle=True)`` gives a plain shuffled ``DataLoader`` then), ``values`` in the loader's
        order, with a warning (distributed, that is an error: pass ``indices``).

    Raises:
        OnedistValueError: on every rank, when a rank's number of rows differs from the number of
            samples its sampler gave it (a loader with ``drop_last=True``), when the results do not
            cover the dataset (a sampler with ``drop_last=True``), or when neither ``loader`` nor
            ``indices`` is given in a distributed run (a plain gather would count the padding).
        CollectiveMismatchError: on every rank, when the ranks' structures, dtypes or trailing
            dimensions differ.
        RemoteRankError: on the other ranks, when one rank's ``values``/``loader``/``indices``
            are unusable (that rank raises the error itself).

    Example:
        >>> import torch, onedist as od
        >>> data = torch.utils.data.TensorDataset(torch.arange(10.0), torch.arange(10) % 3)
        >>> loader = od.auto_dataloader(data, batch_size=4, evaluation=True)
        >>> preds, labels = [], []
        >>> for x, y in loader:
        ...     preds.append((x % 3).long())
        ...     labels.append(y)
        >>> out = od.all_gather_eval({"pred": torch.cat(preds), "label": torch.cat(labels)}, loader)
        >>> len(out["pred"]), (out["pred"] == out["label"]).float().mean().item()   # any world size
        (10, 1.0)
    """
    from ..collectives import all_gather_object
    from ..context import current

    world = current().world_size
    if _nothing_to_gather(loader, indices, world):
        return values
    local_error: Optional[BaseException] = None
    try:
        payload = _prepare(values, loader, indices, world)
    except Exception as e:  # any failure: the other ranks must learn it rather than wait
        local_error = e
        payload = _Payload(f"{type(e).__name__}: {e}", None, [], 0, None, None)

    parts: list[_Payload] = [payload] if world == 1 else all_gather_object(payload)
    _raise_remote_errors(parts, local_error)
    return _assemble(values, parts, loader)


def _nothing_to_gather(loader: Any, indices: Any, world: int) -> bool:
    """True in a serial run given neither ``loader`` nor ``indices``; raises on a bad combination."""
    if loader is not None and indices is not None:
        raise bad_value(
            _FUNC, "indices", _short(indices), "None when loader is given (pass one of loader and indices)"
        )
    if loader is None and indices is None:
        if world == 1:
            return True
        raise bad_value(
            _FUNC,
            "loader",
            None,
            "a DataLoader or a sampler (or indices=...) in a distributed run",
            hint="without them the padding samples of a DistributedSampler would be counted twice and the "
            "rows would be in rank order; pass the evaluation loader: all_gather_eval(values, loader)",
        )
    return False


# ============================================================================ this rank's part
def _prepare(values: Any, loader: Any, indices: Any, world: int) -> _Payload:
    leaves: list[torch.Tensor] = []
    signature = _flatten(values, "", leaves)
    if not leaves:
        raise bad_value(_FUNC, "values", _short(values), f"{_VALUES_ALLOWED} (it holds no tensor)")
    rows = leaves[0].shape[0]
    for leaf in leaves[1:]:
        if leaf.shape[0] != rows:
            raise bad_value(
                _FUNC,
                "values",
                _describe(values),
                "tensors with the same first dimension (one row per sample) in every entry",
            )
    total: Optional[int] = None
    if indices is not None:
        idx: Optional[torch.Tensor] = _as_indices(indices)
    else:
        sampler, batch_loader = _find_sampler(loader)
        idx, total = _sampler_indices(sampler)
        if idx is None:
            if world > 1:
                raise bad_value(
                    _FUNC,
                    "loader",
                    _short(loader),
                    "a DataLoader or sampler whose order can be replayed (a torch or onedist "
                    f"DistributedSampler, DistributedEvalSampler, DistributedProxySampler); its sampler is "
                    f"a {type(sampler).__name__}, which does not tell which samples this rank's rows are",
                    hint=_ORDER_HINT,
                )
            _check_serial_count(rows, sampler, batch_loader)
            warnings.warn(
                f"onedist.all_gather_eval: the loader's {type(sampler).__name__} does not tell which "
                "samples it yielded, so the results are returned in the loader's order, not in "
                "dataset order. Use shuffle=False (or evaluation=True) for evaluation, or pass indices=.",
                stacklevel=3,
            )
    return _Payload(None, signature, leaves, rows, idx, total)


def _flatten(value: Any, path: str, leaves: list[torch.Tensor]) -> Any:
    """Append the tensors of ``value`` to ``leaves`` (dict keys sorted); return its signature."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise bad_value(
                _FUNC,
                f"values{path}",
                value,
                _VALUES_ALLOWED,
                hint="a 0-dim tensor has no sample dimension; collect per-sample results (e.g. "
                "loss(reduction='none')), or reduce scalars with onedist.all_reduce",
            )
        leaves.append(_dense(value))
        return ("T", str(value.dtype), tuple(value.shape[1:]))
    if isinstance(value, Mapping):
        keys = _sorted_keys(value)
        return ("M", tuple(keys), tuple(_flatten(value[k], f"{path}[{k!r}]", leaves) for k in keys))
    if isinstance(value, (list, tuple)):
        return ("S", len(value), tuple(_flatten(v, f"{path}[{i}]", leaves) for i, v in enumerate(value)))
    raise bad_type(_FUNC, f"values{path}", value, _VALUES_ALLOWED)


def _sorted_keys(m: Mapping[Any, Any]) -> list[Any]:
    try:
        return sorted(m)
    except TypeError:
        return list(m)


def _as_indices(indices: Any) -> torch.Tensor:
    allowed = "a 1-D integer tensor, a list of ints, or a list of 1-D integer tensors (one per batch)"
    try:
        if isinstance(indices, torch.Tensor):
            idx = indices
        elif (
            isinstance(indices, (list, tuple))
            and indices
            and all(isinstance(i, torch.Tensor) for i in indices)
        ):
            idx = torch.cat([i.reshape(-1) for i in indices])
        elif isinstance(indices, (Sequence, range)) and not isinstance(indices, (str, bytes)):
            idx = torch.as_tensor(list(indices), dtype=torch.int64)
        else:
            idx = torch.as_tensor(indices)
    except (TypeError, ValueError, RuntimeError) as e:
        raise bad_type(_FUNC, "indices", indices, allowed) from e
    if idx.dim() != 1 or idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
        raise bad_type(_FUNC, "indices", indices, allowed)
    return _dense(idx.to(device="cpu", dtype=torch.int64))


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, contiguous, with a unit stride even when it has one element (a slice such as
    ``x[r::w]`` of one element counts as contiguous with stride ``w``, which the wire cannot view)."""
    t = t.detach()
    if t.numel() == 1:
        return t.clone(memory_format=torch.contiguous_format)
    return t.contiguous()


def _find_sampler(loader: Any) -> tuple[Any, Optional[DataLoader[Any]]]:
    """The sampler whose order the loader's rows follow, and the DataLoader (None for a sampler)."""
    obj = loader
    for _ in range(8):
        if isinstance(obj, DataLoader):
            bs = obj.batch_sampler
            if bs is None:  # batch_size=None: one sample per item, in the sampler's order
                return obj.sampler, obj
            if isinstance(bs, BatchSampler) and type(bs).__iter__ is BatchSampler.__iter__:
                return bs.sampler, obj
            raise bad_value(
                _FUNC,
                "loader",
                _short(loader),
                "a DataLoader whose batches follow its sampler's order (torch's BatchSampler); its "
                f"batch_sampler is a {type(bs).__name__}, whose order onedist cannot replay",
                hint="pass indices= (the dataset index of each of this rank's rows)",
            )
        if isinstance(obj, BatchSampler) and type(obj).__iter__ is BatchSampler.__iter__:
            return obj.sampler, None
        if isinstance(obj, Sampler):
            return obj, None
        inner = getattr(obj, "_loader", None)  # device loaders (torch_xla's MpDeviceLoader) wrap one
        if inner is None or inner is obj:
            break
        obj = inner
    raise bad_type(_FUNC, "loader", loader, "a DataLoader or a sampler", hint=_ORDER_HINT)


def _sampler_indices(sampler: Any) -> tuple[Optional[torch.Tensor], Optional[int]]:
    """The dataset indices this rank's sampler yielded this epoch, and the dataset size if known."""
    if not isinstance(sampler, _KNOWN):
        return None, None
    if isinstance(sampler, SequentialSampler):
        n = len(sampler)
        return torch.arange(n, dtype=torch.int64), n
    own = rank_indices(sampler, sampler.rank)
    if own is None:  # pragma: no cover - rank_indices knows every other type of _KNOWN
        return None, None
    dataset = getattr(sampler, "dataset", None)
    total = len(dataset) if dataset is not None and hasattr(dataset, "__len__") else None
    return torch.tensor(own, dtype=torch.int64), total


def _check_serial_count(rows: int, sampler: Any, loader: Optional[DataLoader[Any]]) -> None:
    try:
        expected = len(sampler)
    except TypeError:
        return
    if rows != expected:
        raise bad_value(
            _FUNC,
            "loader",
            _loader_text(loader, sampler),
            f"a loader whose {expected} samples all have a row; values has {rows} rows",
            hint=_drop_last_hint(loader),
        )


# ============================================================================ all ranks' parts
def _raise_remote_errors(parts: list[_Payload], local_error: Optional[BaseException]) -> None:
    if local_error is not None:
        raise local_error
    for rank, part in enumerate(parts):
        if part.error is not None:
            raise RemoteRankError(
                f"onedist.{_FUNC}: rank {rank} could not prepare its results, so no rank can "
                f"assemble them. Its error: {part.error}",
                rank=rank,
            )


def _assemble(values: Any, parts: list[_Payload], loader: Any) -> Any:
    """Check the parts (identically on every rank, so every rank raises alike) and merge them."""
    reference = parts[0].signature
    if any(p.signature != reference for p in parts):
        lines = "\n".join(f"  rank {r}: {_signature_text(p.signature)}" for r, p in enumerate(parts))
        raise CollectiveMismatchError(
            f"onedist.{_FUNC}: the ranks passed values of different structures, dtypes or trailing "
            f"dimensions (each tensor: dtype[trailing dims]):\n{lines}"
        )
    known = [p.indices is not None for p in parts]
    if not all(known):  # serial, with a sampler whose order is unknown (warned in _prepare)
        return values
    counts = [p.rows for p in parts]
    expected = [int(p.indices.numel()) for p in parts if p.indices is not None]
    if counts != expected:
        first = next(r for r in range(len(parts)) if counts[r] != expected[r])
        if loader is not None:
            raise OnedistValueError(
                f"onedist.{_FUNC}: the results do not match the samples the loader gave: rank {first} has "
                f"{counts[first]} rows for the {expected[first]} samples its sampler gave it (rows per rank: "
                f"{counts}; samples per rank: {expected}); loader={_loader_text(*_safe_find(loader))}"
                f"\nHINT: {_drop_last_hint(_safe_find(loader)[0])}"
            )
        raise OnedistValueError(
            f"onedist.{_FUNC}: indices must give one dataset index per row of values: rank {first} has "
            f"{counts[first]} rows and {expected[first]} indices (rows per rank: {counts}; indices per "
            f"rank: {expected})"
        )
    totals = {p.total for p in parts}
    if len(totals) > 1:
        raise CollectiveMismatchError(
            f"onedist.{_FUNC}: the ranks' samplers have datasets of different sizes: "
            + ", ".join(f"rank {r}: {p.total}" for r, p in enumerate(parts))
        )
    total = parts[0].total
    all_idx = torch.cat([p.indices for p in parts if p.indices is not None])
    positions = _positions(all_idx, total, loader)

    out_leaves: list[torch.Tensor] = []
    local_leaves: list[torch.Tensor] = []
    _flatten(values, "", local_leaves)
    for j, local in enumerate(local_leaves):
        pieces = [p.leaves[j].to(local.device) for p in parts]
        merged = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        out_leaves.append(merged.index_select(0, positions.to(local.device)))
    return _rebuild(values, iter(out_leaves))


def _positions(all_idx: torch.Tensor, total: Optional[int], loader: Any) -> torch.Tensor:
    """For each output row, the position in the gathered rows of the first row with its index."""
    if all_idx.numel() and int(all_idx.min()) < 0:
        raise bad_value(
            _FUNC, "indices", f"negative index {int(all_idx.min())}", "dataset indices (ints >= 0)"
        )
    order = torch.argsort(all_idx, stable=True)
    ordered = all_idx[order]
    first = torch.ones(ordered.numel(), dtype=torch.bool)
    if ordered.numel() > 1:
        first[1:] = ordered[1:] != ordered[:-1]
    unique = ordered[first]
    if total is not None:
        inside = unique[unique < total]
        if inside.numel() != total or inside.numel() != unique.numel():
            covered = torch.zeros(total, dtype=torch.bool)
            covered[inside] = True
            missing = (~covered).nonzero().flatten()[:5].tolist()
            beyond = unique[unique >= total][:5].tolist()
            detail = f"missing e.g. {missing}" if missing else f"indices out of range e.g. {beyond}"
            raise OnedistValueError(
                f"onedist.{_FUNC}: the ranks' results cover {inside.numel()} of the {total} samples of the "
                f"dataset ({detail}); loader={_loader_text(*_safe_find(loader))}"
                "\nHINT: the sampler leaves samples out (DistributedSampler(drop_last=True)); use "
                "drop_last=False for evaluation"
            )
    return order[first]


def _rebuild(value: Any, leaves: Iterator[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return next(leaves)
    if isinstance(value, Mapping):
        done = {k: _rebuild(value[k], leaves) for k in _sorted_keys(value)}
        items = {k: done[k] for k in value}  # the caller's key order
        if type(value) is dict:
            return items
        try:
            return type(value)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if isinstance(value, tuple):
        seq = [_rebuild(v, leaves) for v in value]
        return type(value)(*seq) if hasattr(value, "_fields") else type(value)(seq)
    return [_rebuild(v, leaves) for v in value]


# ============================================================================ messages
def _safe_find(loader: Any) -> tuple[Optional[DataLoader[Any]], Any]:
    try:
        sampler, dl = _find_sampler(loader)
    except OnedistError:
        return None, loader
    return dl, sampler


def _loader_text(loader: Optional[DataLoader[Any]], sampler: Any) -> str:
    if loader is None:
        return f"a {type(sampler).__name__}"
    return (
        f"DataLoader(sampler={type(sampler).__name__}, batch_size={loader.batch_size}, "
        f"drop_last={loader.drop_last})"
    )


def _drop_last_hint(loader: Optional[DataLoader[Any]]) -> str:
    if loader is not None and loader.drop_last:
        return (
            "the loader drops its last incomplete batch (drop_last=True); use drop_last=False for "
            "evaluation, so that every sample has a row"
        )
    return (
        "use drop_last=False for evaluation, run every rank over the whole loader, and pass one row per "
        "sample (in the loader's order)"
    )


def _signature_text(sig: Any) -> str:
    if sig is None:
        return "?"
    kind = sig[0]
    if kind == "T":
        return f"{sig[1].replace('torch.', '')}{list(sig[2])}"
    if kind == "M":
        return "{" + ", ".join(f"{k!r}: {_signature_text(s)}" for k, s in zip(sig[1], sig[2])) + "}"
    return "(" + ", ".join(_signature_text(s) for s in sig[2]) + ")"


def _describe(values: Any) -> str:
    leaves: list[torch.Tensor] = []
    try:
        sig = _flatten(values, "", leaves)
    except OnedistError:
        return _short(values)
    return f"{_signature_text(sig)} with rows {[t.shape[0] for t in leaves]}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
