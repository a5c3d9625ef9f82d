"""The serial backend: one process, no communication, same semantics.

Every collective goes through the same code in :mod:`onedist.collectives` as in a distributed
run, so a script behaves identically at world size 1 (results are copies, MEAN divides by 1).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

import torch

from ..errors import OnedistRuntimeError
from .interface import NATIVE_REDUCE_DTYPES, Backend, Layout, Work

__all__ = ["SerialBackend"]


class SerialBackend(Backend):
    """No distributed context: rank 0 of 1."""

    model_name = "serial"
    cpu_reduce_dtypes = NATIVE_REDUCE_DTYPES | {torch.int16}  # no library: int16 needs no widening

    def __init__(self) -> None:
        super().__init__(None, 0, 1)
        self._groups: dict[tuple[int, ...], list[int]] = {}

    @classmethod
    def available_backends(cls) -> tuple[str, ...]:
        return ()

    @classmethod
    def context_active(cls) -> bool:
        return False

    @classmethod
    def create_from_context(cls) -> Optional[Backend]:
        return cls()

    @classmethod
    def create_from_backend(
        cls,
        backend: str,
        *,
        timeout: Optional[timedelta],
        init_method: Optional[str],
        rank: Optional[int],
        world_size: Optional[int],
        **kwargs: Any,
    ) -> Backend:
        return cls()

    def is_stale(self) -> bool:
        # Stale as soon as any other backend reports a context made outside onedist.
        from .registry import external_context_active

        return external_context_active()

    def finalize(self) -> None:
        pass

    def layout(self) -> Layout:
        return Layout(0, 1, 0, 1)

    def device(self) -> torch.device:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def new_group(self, ranks: tuple[int, ...], **kwargs: Any) -> Any:
        # as ignite's serial model: the ranks themselves (one list per ranks, as groups are cached)
        return self._groups.setdefault(ranks, list(ranks))

    def group_ranks(self, group: Any) -> tuple[int, ...]:
        return (0,)

    def group_rank(self, group: Any) -> int:
        if group is not None and not isinstance(group, (list, tuple)):
            raise TypeError(f"not a group of the serial backend: {group!r}")  # the caller words it
        return 0

    def object_group(self, group: Any) -> Any:
        return group

    def local_group(self) -> Any:
        return self.new_group((0,))

    def comm_device(self, device: torch.device, op: str) -> torch.device:
        return device

    def all_reduce_(self, t: torch.Tensor, op: str, group: Any, async_op: bool) -> Optional[Work]:
        return None

    def reduce_(self, t: torch.Tensor, dst: int, op: str, group: Any, async_op: bool) -> Optional[Work]:
        return None

    def broadcast_(self, t: torch.Tensor, src: int, group: Any, async_op: bool) -> Optional[Work]:
        return None

    def all_gather_into_(
        self, out: torch.Tensor, t: torch.Tensor, group: Any, async_op: bool
    ) -> Optional[Work]:
        out.view(-1).copy_(t.view(-1))
        return None

    def all_to_all_single_(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: Any,
        async_op: bool,
    ) -> Optional[Work]:
        out.copy_(inp)
        return None

    def barrier_(self, group: Any, async_op: bool) -> Optional[Work]:
        return None

    def send_(self, t: torch.Tensor, dst: int, group: Any, tag: int, async_op: bool) -> Optional[Work]:
        raise OnedistRuntimeError(
            "onedist.send: there is no other rank to send to (no distributed context, world size 1)"
        )

    def recv_(self, t: torch.Tensor, src: Optional[int], group: Any, tag: int, async_op: bool) -> Any:
        raise OnedistRuntimeError(
            "onedist.recv: there is no other rank to receive from (no distributed context, world size 1)"
        )
