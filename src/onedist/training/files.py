"""The file-system steps of an atomic checkpoint write, shared by file and directory checkpoints.

A checkpoint is written under a temporary name beside its target and renamed onto it only when
complete. The temporary name carries the writer's pid (``.<name>.<pid>.<12 hex>.tmp``), so
:func:`remove_stale_temporaries` can tell a write still going on from one whose writer is gone.
A write that fails raises :func:`write_failed`'s error: the path, what the errno means, the fix.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import uuid
from pathlib import Path

__all__ = ["fsync_dir", "remove_stale_temporaries", "temporaries_of", "temporary_beside", "write_failed"]


def temporary_beside(target: Path) -> Path:
    """A new, unused name for a temporary file or directory in ``target``'s folder.

    Example:
        >>> from pathlib import Path
        >>> temporary_beside(Path("/tmp/run/step_00000005.pt")).name.startswith(".step_00000005.pt.")
        True
    """
    return target.parent / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"


def temporaries_of(target: Path) -> re.Pattern[str]:
    """The names :func:`temporary_beside` gives in ``target``'s folder (group 1: the writer's pid).

    Example:
        >>> temporaries_of(Path("/tmp/last.pt")).fullmatch(".last.pt.77.0123456789ab.tmp").group(1)
        '77'
    """
    return re.compile(rf"\.{re.escape(target.name)}\.(\d+)\.[0-9a-f]{{12}}\.tmp")


def remove_stale_temporaries(directory: Path, names: re.Pattern[str]) -> list[str]:
    """Delete the temporary files (or directories) in ``directory`` whose names match ``names``
    and whose writer (the pid in group 1) no longer runs on this host; the names deleted.

    A writer killed during its write leaves its temporary behind: never loaded, but as large as a
    checkpoint. One whose writer runs, or whose pid is another user's process, is kept. Best
    effort: a folder or file this process may not read or delete is left as it is (the save that
    follows says so, if it cannot write either).

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> dead = 2**22 + 1  # above the kernel's largest pid: no such process
        >>> (folder / f".last.pt.{dead}.0123456789ab.tmp").write_bytes(b"torn")
        4
        >>> remove_stale_temporaries(folder, temporaries_of(folder / "last.pt"))
        ['.last.pt.4194305.0123456789ab.tmp']
    """
    try:
        found = os.listdir(directory)
    except OSError:  # none yet, or not ours to read
        return []
    removed = []
    for name in sorted(found):
        match = names.fullmatch(name)
        if match is None or _process_exists(int(match.group(1))):
            continue
        try:
            _remove(os.path.join(directory, name))
        except OSError:  # gone already, or not ours to delete
            continue
        removed.append(name)
    return removed


def _remove(path: str) -> None:
    """Delete a temporary file, or a sharded checkpoint's temporary directory."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # no such process (or no such pid at all)
        return False
    except PermissionError:
        return True  # another user's process: not ours to judge
    return True


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


# what each errno a checkpoint write meets means for the user, and the fix
_FIXES = {
    errno.ENOSPC: "the file system holding {dir} is full: free space there, or save to another one",
    errno.EDQUOT: "the disk quota for {dir} is used up: free space there, or save elsewhere",
    errno.EACCES: "this process may not write in {dir}: check its permissions, or save elsewhere",
    errno.EPERM: "this process may not write in {dir}: check its permissions, or save elsewhere",
    errno.EROFS: "{dir} is on a read-only file system: save to a writable one",
}


def write_failed(func: str, target: Path, error: OSError) -> OSError:
    """The error for a write of ``target`` that failed with ``error`` (not raised here): an
    ``OSError`` of the same errno (so the same class: ``PermissionError`` for EACCES) naming the
    path, the errno and its meaning, that nothing was left behind, and the fix.

    Example:
        >>> full = OSError(errno.ENOSPC, "No space left on device")
        >>> print(write_failed("save_checkpoint", Path("/ckpt/last.pt"), full))
        [Errno 28] onedist.save_checkpoint: could not write '/ckpt/last.pt': ENOSPC (No space left ...
        HINT: the file system holding '/ckpt' is full: free space there, or save to another one
    """
    if error.errno is None:
        return error
    name = errno.errorcode.get(error.errno, f"errno {error.errno}")
    fix = _FIXES.get(error.errno, "check the path, or save elsewhere").format(dir=repr(str(target.parent)))
    return OSError(
        error.errno,
        f"onedist.{func}: could not write {str(target)!r}: {name} ({os.strerror(error.errno)}); the "
        f"checkpoint there, if any, is unchanged and no temporary file is left\nHINT: {fix}",
    )
