"""Launch arguments that a way of starting workers cannot honour, refused before anything starts."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

from ..errors import bad_type, bad_value
from .spec import LaunchSpec

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


def check_one_host_launch(spec: LaunchSpec, hint: str) -> None:
    """The spawn arguments a backend that starts its workers with its own launcher on this host
    (``horovod.run``, ``mpirun``) cannot honour: each raises, naming the value and ``hint``."""
    from .._net import is_loopback

    for arg, value, allowed, ok in (
        ("nnodes", spec.nnodes, "1", spec.nnodes == 1),
        ("node_rank", spec.node_rank, "0", spec.node_rank == 0),
        ("master_addr", spec.master_addr, "a loopback address ('127.0.0.1')", is_loopback(spec.master_addr)),
        ("master_port", spec.master_port, "None", spec.master_port is None),
        ("init_method", spec.init_method, "None or 'env://'", spec.init_method in (None, "env://")),
        ("start_method", spec.start_method, "'spawn'", spec.start_method == "spawn"),
    ):
        if not ok:
            raise bad_value("spawn", arg, value, f"{allowed} with backend {spec.backend!r}", hint=hint)
