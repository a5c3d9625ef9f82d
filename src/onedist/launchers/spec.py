"""The arguments of one launch, as the launchers take them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

__all__ = ["LaunchSpec"]


@dataclass(frozen=True)
class LaunchSpec:
    """What :func:`onedist.spawn` was asked to start, after its checks: ``backend`` is the name
    ``initialize`` will get in each worker (``"auto"`` resolved), ``timeout`` a timedelta or None."""

    backend: str
    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: Optional[int] = None
    init_method: Optional[str] = None
    timeout: Optional[timedelta] = None
    start_method: str = "spawn"
    hosts: Optional[str] = None
