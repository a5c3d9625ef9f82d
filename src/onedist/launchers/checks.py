"""Launch arguments that a way of starting workers cannot honour, refused before anything starts."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, Optional

from ..errors import bad_type, bad_value

__all__ = ["check_one_host_launch", "check_picklable"]


def check_picklable(fn: Callable[..., Any], how: str) -> None:
    """Raise the standard error when ``fn`` cannot be pickled for workers started ``how``."""
    try:
        pickle.dumps(fn)
    except Exception as e:
        raise bad_type(
            "spawn",
            "fn",
            fn,
            "a function defined at the top level of a module",
            hint=f"{how} must pickle fn ({e}); move it to module level, or use start_method='fork'",
        ) from e


def check_one_host_launch(
    backend: str,
    hint: str,
    *,
    nnodes: int,
    node_rank: int,
    master_addr: str,
    master_port: Optional[int],
    init_method: Optional[str],
    start_method: str,
) -> None:
    """The spawn arguments a backend that starts its workers with its own launcher on this host
    (``horovod.run``, ``mpirun``) cannot honour: each raises, naming the value and ``hint``."""
    from .._net import is_loopback

    for arg, value, allowed, ok in (
        ("nnodes", nnodes, "1", nnodes == 1),
        ("node_rank", node_rank, "0", node_rank == 0),
        ("master_addr", master_addr, "a loopback address ('127.0.0.1')", is_loopback(master_addr)),
        ("master_port", master_port, "None", master_port is None),
        ("init_method", init_method, "None or 'env://'", init_method in (None, "env://")),
        ("start_method", start_method, "'spawn'", start_method == "spawn"),
    ):
        if not ok:
            raise bad_value("spawn", arg, value, f"{allowed} with backend {backend!r}", hint=hint)
