"""The file-system steps of an atomic checkpoint write, shared by file and directory checkpoints.

A checkpoint is written under a temporary name beside its target and renamed onto it only when
complete. The temporary name carries the writer's pid (``.<name>.<pid>.<12 hex>.tmp``), so
:func:`onedist.training.resume.remove_stale_temp_files` can tell a write still going on from one
whose writer is gone.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

__all__ = ["fsync_dir", "temporary_beside"]


def temporary_beside(target: Path) -> Path:
    """A new, unused name for a temporary file or directory in ``target``'s folder.

    Example:
        >>> from pathlib import Path
        >>> temporary_beside(Path("/tmp/run/step_00000005.pt")).name.startswith(".step_00000005.pt.")
        True
    """
    return target.parent / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (best effort: not every platform/filesystem allows it).

    Example:
        >>> fsync_dir(Path("/tmp"))
    """
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
