"""A function the chosen start method cannot carry to the workers, refused before anything starts."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

from ..errors import bad_type

__all__ = ["check_picklable"]


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
