"""Environment variables a backend sets for the user, and their restoration at ``finalize``.

One place for both, so that every variable onedist sets that the environment did not is logged
(never a silent rewrite of ``os.environ``) and gets its previous value back at ``finalize``.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

logger = logging.getLogger("onedist")


def set_env(name: str, value: str, env_set: dict[str, Optional[str]]) -> None:
    env_set.setdefault(name, os.environ.get(name))
    os.environ[name] = value
    logger.info("onedist set %s=%s (the environment did not set it)", name, value)


def restore_env(env_set: dict[str, Optional[str]]) -> None:
    for name, previous in env_set.items():
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous
    env_set.clear()
