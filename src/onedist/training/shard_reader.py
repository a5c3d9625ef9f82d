"""The reader a sharded checkpoint loads through: torch.distributed.checkpoint's (DCP's)
``FileSystemReader``, gated on the check of its files, and reading each tensor straight into the
live parameters.

* The gate. DCP writes each tensor into the live (sharded) parameters as it reads it, so a damaged
  shard must be found before any rank reads one. Each rank's :class:`~.shard_checksums.ShardCheck`
  runs in a thread while DCP reads its metadata and plans; :meth:`CheckedReader.prepare_local_plan`
  waits for it and hands its faults to DCP's planning collective (the plan's ``storage_data``), the
  coordinator joins them into every rank's plan, and :meth:`CheckedReader.read_data` reads nothing
  when any rank found one: no rank's parameters change. The faults ride on DCP's own collective;
  there is none more.
* The read. DCP reads each saved tensor (a ``torch.save`` archive within the shard file) into new
  memory with ``torch.load``, then copies it into the parameter: two copies, and new memory for each
  tensor. Here a contiguous tensor whose stored bytes are one run of the file (its whole chunk, or
  rows of it: FSDP's shards at another world size) is read once, straight into the parameter's
  memory, once its layout (``data.pkl``: dtype, size, stride) matches the parameter's. Anything else
  (a tensor that is narrowed across columns, another dtype, a non-contiguous target, a stream
  transform, bytes) goes through DCP's own code.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import io
import math
import os
import pickle
import sys
import warnings
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .shard_checksums import ShardCheck

__all__ = ["CheckedReader", "read_straight", "tensor_layout"]


class CheckedReader(FileSystemReader):
    """DCP's reader of the directory ``check`` checks: the faults of every rank agreed on in DCP's
    planning before any byte is read into a tensor; tensors read straight into the parameters."""

    def __init__(self, path: str, check: ShardCheck) -> None:
        super().__init__(path)
        self.check = check

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.check.early:  # the list or .metadata damaged: an empty plan; the faults follow
            return Metadata(state_dict_metadata={}, storage_data={})
        return super().read_metadata(*args, **kwargs)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # this rank's faults travel to the coordinator in DCP's planning collective
        return dataclasses.replace(plan, storage_data=self.check.faults())

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        faults = {where: fault for plan in plans for where, fault in (plan.storage_data or {}).items()}
        return [dataclasses.replace(plan, storage_data=faults) for plan in plans]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if plan.storage_data:  # every rank's plan holds them all: every rank stops here, unread
            raise RuntimeError(f"onedist.load_checkpoint: damaged files, nothing read: {plan.storage_data}")
        rest = []
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in by_file.items():
            with open(os.path.join(self.path, relative_path), "rb", buffering=0) as f:
                rest += [item for item in items if not read_straight(f, self.storage_data, item, planner)]
        if rest:
            return super().read_data(dataclasses.replace(plan, items=rest), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done


def read_straight(f: io.FileIO, storage_data: Any, item: ReadItem, planner: LoadPlanner) -> bool:
    """Read ``item``'s bytes from ``f`` straight into its target tensor: False (nothing read) when
    they are not one run of the file matching the target (DCP's own read then does it)."""
    info = storage_data[item.storage_index]
    if item.type != LoadItemType.TENSOR or info.transform_descriptors:
        return False
    layout = tensor_layout(_Slice(f, info.offset, info.length))
    if layout is None:
        return False
    start, dtype, size, stride, numel = layout
    if tuple(stride) != _contiguous(size) or len(item.lengths) != len(size):
        return False
    # rows [o, o + n) of a contiguous tensor, whole in every other dimension: one run of bytes
    if any(o != 0 for o in item.storage_offsets[1:]) or list(item.lengths[1:]) != list(size[1:]):
        return False
    first = item.storage_offsets[0] * stride[0] if size else 0
    count = math.prod(item.lengths)
    if first + count > numel:
        return False
    target = planner.resolve_tensor(item).detach()
    if target.device.type != "cpu" or target.dtype != dtype or not target.is_contiguous():
        return False
    if list(target.shape) != list(item.lengths):
        return False
    at, nbytes = start + first * target.element_size(), count * target.element_size()
    if at + nbytes > info.length:  # not within this tensor's archive (a file loaded unverified)
        return False
    if nbytes:
        _read_into(f, info.offset + at, target.reshape(-1).view(torch.uint8).numpy())
    planner.commit_tensor(item, target)
    return True


def _contiguous(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(size):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _read_into(f: io.FileIO, offset: int, into: Any) -> None:
    """``len(into)`` bytes of ``f`` from ``offset`` into ``into`` (a writable buffer)."""
    view = memoryview(into).cast("B")
    f.seek(offset)
    while view:
        got = f.readinto(view)
        if not got:
            raise EOFError(f"the shard file ended {len(view)} bytes early")
        view = view[got:]


class _Slice(io.RawIOBase):
    """``length`` bytes of the open file ``f`` from ``offset``, as a file of their own (one saved
    tensor's archive within a shard file)."""

    def __init__(self, f: io.FileIO, offset: int, length: int) -> None:
        super().__init__()
        self.f, self.offset, self.length, self.at = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.at = offset + (0 if whence == io.SEEK_SET else self.at if whence == io.SEEK_CUR else self.length)
        return self.at

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")[: max(0, self.length - self.at)]
        got = os.preadv(self.f.fileno(), [view], self.offset + self.at) if len(view) else 0
        self.at += got
        return got


Layout = tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...], int]


def tensor_layout(archive: Any) -> Optional[Layout]:
    """Where the tensor that ``torch.save`` wrote to ``archive`` (a seekable file) lies: (offset of
    its storage's bytes within ``archive`` plus its storage offset in bytes, dtype, size, stride,
    the elements the storage holds from there); None for anything but one plain tensor in this
    machine's byte order.

    Example:
        >>> import io, torch
        >>> saved = io.BytesIO()
        >>> torch.save(torch.zeros(3, 2), saved)
        >>> tensor_layout(saved)[1:]
        (torch.float32, (3, 2), (2, 1), 6)
    """
    try:
        archive.seek(0)
        reader: Any = torch._C.PyTorchFileReader(archive)  # its stubs lack has_record, get_record_offset
        saved_on = reader.get_record("byteorder").decode() if reader.has_record("byteorder") else "little"
        if saved_on != sys.byteorder:
            return None
        rebuilt = _LayoutUnpickler(io.BytesIO(reader.get_record("data.pkl"))).load()
        if not isinstance(rebuilt, _Rebuilt):
            return None
        key, dtype, numel = rebuilt.storage
        offset = reader.get_record_offset(f"data/{key}")
    except (pickle.UnpicklingError, RuntimeError, ValueError, TypeError, AttributeError, KeyError):
        return None
    itemsize = torch.empty((), dtype=dtype).element_size()
    return (
        offset + rebuilt.storage_offset * itemsize,
        dtype,
        tuple(rebuilt.size),
        tuple(rebuilt.stride),
        numel - rebuilt.storage_offset,
    )


@dataclasses.dataclass
class _Rebuilt:
    storage: tuple[str, torch.dtype, int]
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_tensor_v2(storage: Any, storage_offset: int, size: Any, stride: Any, *_: Any) -> _Rebuilt:
    return _Rebuilt(storage, storage_offset, tuple(size), tuple(stride))


@functools.cache
def _storage_dtypes() -> dict[str, torch.dtype]:
    """The dtype of each typed storage class a ``torch.save`` pickle names (``FloatStorage``...),
    read once: reading it warns that typed storages are deprecated."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kinds = [getattr(torch, name) for name in dir(torch) if name.endswith("Storage")]
        return {
            kind.__name__: kind.dtype
            for kind in kinds
            if isinstance(getattr(kind, "dtype", None), torch.dtype)
        }


class _LayoutUnpickler(pickle.Unpickler):
    """A ``torch.save`` pickle of one tensor read for its layout only: any other object (a tensor
    subclass, a parameter, a quantized tensor) is refused, and DCP's own read loads it."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor_v2
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _storage_dtypes():
            return _storage_dtypes()[name]
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> tuple[str, torch.dtype, int]:
        kind, dtype, key, _location, numel = pid
        if kind != "storage" or not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(repr(pid))
        return str(key), dtype, int(numel)
