"""Checksums of a sharded checkpoint's files: each rank's shards hashed as torch.distributed.checkpoint
(DCP) writes them, every file checked before DCP reads it into a tensor.

* :class:`ChecksummedFileSystem` is DCP's ``FileSystem`` with every file it writes passing through
  a :class:`~onedist.training.checksums.Crc32Writer`: each rank keeps the CRC-32 and size of the
  files it wrote (its ``__<rank>_0.distcp``; rank 0 also DCP's ``.metadata``).
* :func:`write_manifest` writes them, gathered from every rank, to ``checksums.json`` in the
  directory (``rest.pt`` carries its own checksum record).
* :class:`ShardCheck` checks every listed file as a load begins, each rank a share (its own shard
  file when the world size is the saving one's), in a thread while the load plans; the load's
  reader (:mod:`.shard_reader`) lets no rank write a tensor before every rank's share matched, and a
  damaged file raises :class:`~onedist.CheckpointCorruptError` on every rank, naming the directory
  and the file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from torch.distributed.checkpoint.filesystem import FileSystem

from ..errors import CheckpointCorruptError
from .checksums import Crc32Writer, corrupt, crc32_of

__all__ = ["MANIFEST", "ChecksummedFileSystem", "ShardCheck", "write_manifest"]

logger = logging.getLogger("onedist")

#: the file of a sharded checkpoint's directory that lists the CRC-32 and size of DCP's files
MANIFEST = "checksums.json"
_FORMAT = "onedist checksums 1"
_OWN_SHARD = re.compile(r"__(\d+)_\d+\.distcp")
_METADATA = ".metadata"  # DCP's plan of the files, which every rank reads


class ChecksummedFileSystem(FileSystem):
    """DCP's file system, keeping ``digests``: each file written -> (CRC-32, size), by file name.

    Example:
        >>> import tempfile
        >>> fs = ChecksummedFileSystem()
        >>> with fs.create_stream(Path(tempfile.mkdtemp()) / "a.distcp", "wb") as stream:
        ...     _ = stream.write(b"abc")
        >>> fs.digests
        {'a.distcp': (891568578, 3)}
    """

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, tuple[int, int]] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            writer = Crc32Writer(stream)
            yield writer
        self.digests[Path(path).name] = (writer.crc, writer.size)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        digest = self.digests.pop(Path(path).name, None)  # DCP writes .metadata.tmp, then renames it
        if digest is not None:
            self.digests[Path(new_path).name] = digest


def write_manifest(directory: Path, digests: dict[str, tuple[int, int]]) -> None:
    """``checksums.json`` in ``directory``: the CRC-32 and size of each file in ``digests``.

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> write_manifest(folder, {"__0_0.distcp": (891568578, 3)})
        >>> json.loads((folder / MANIFEST).read_text())["files"]
        {'__0_0.distcp': {'crc32': '352441c2', 'size': 3}}
    """
    files = {name: {"crc32": f"{crc:08x}", "size": size} for name, (crc, size) in sorted(digests.items())}
    with open(directory / MANIFEST, "x") as f:
        json.dump({"format": _FORMAT, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


class ShardCheck:
    """The check of a sharded checkpoint's files, begun as a load begins: ``checksums.json`` and DCP's
    ``.metadata`` are checked at once (every rank; DCP reads them next), this rank's share of the
    shards (:func:`_share`) in a thread of its own, while the load reads ``rest.pt``, DCP's metadata
    and plans. :meth:`faults` waits for it; the load writes no tensor before every rank's faults are
    known (:class:`~onedist.training.shard_reader.CheckedReader`). Every rank makes one.

    ``verified`` is False when there is no list (a directory of an older onedist: its shards load
    unverified, with a warning on rank 0).

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> _ = (folder / "__0_0.distcp").write_bytes(b"abc")
        >>> write_manifest(folder, {"__0_0.distcp": (891568578, 3)})
        >>> check = ShardCheck(folder)
        >>> check.verified, check.faults()
        (True, {})
    """

    def __init__(self, directory: Path) -> None:
        from ..context import current

        b = current()
        self.directory = directory
        #: the faults found before the thread started: the list's, DCP's ``.metadata``'s
        self.early: dict[str, str] = {}
        listed: Optional[dict[str, tuple[int, int]]] = None
        try:
            listed = _read_manifest(directory)
        except CheckpointCorruptError as e:
            self.early.update(e.faults)
        self.verified = listed is not None
        if listed is None and not self.early and b.rank == 0:
            logger.warning(
                "onedist.load_checkpoint: %s has no %s (written before onedist wrote them): its shards are "
                "loaded without verification",
                directory,
                MANIFEST,
            )
        listed = listed or {}
        if _METADATA in listed:  # every rank reads it next (DCP's plan): none may unpickle it unchecked
            self._note(_METADATA, *listed[_METADATA])
        self._found: dict[str, str] = {}
        share = [name for name in _share(listed, b.rank, b.world_size) if name != _METADATA]
        self._thread = threading.Thread(
            target=self._check, args=(share, listed), name="onedist-shard-check", daemon=True
        )
        self._thread.start()

    def _note(self, name: str, crc: int, size: int) -> None:
        fault = _fault_of(self.directory / name, crc, size)
        if fault is not None:
            self.early[str(self.directory / name)] = fault

    def _check(self, share: list[str], listed: dict[str, tuple[int, int]]) -> None:
        for name in share:  # the CRC-32 lets go of the GIL: the load's planning runs meanwhile
            fault = _fault_of(self.directory / name, *listed[name])
            if fault is not None:
                self._found[str(self.directory / name)] = fault

    def faults(self) -> dict[str, str]:
        """This rank's share of the faults (each damaged file and what did not match), once its
        check is done: empty when its share is intact."""
        self._thread.join()
        return {**self.early, **self._found}

    def error(self, faults: dict[str, str]) -> CheckpointCorruptError:
        """The error every rank raises on ``faults`` (those of every rank)."""
        listing = "".join(f"\n  {where}: {fault}" for where, fault in sorted(faults.items()))
        return CheckpointCorruptError(
            f"onedist.load_checkpoint: the sharded checkpoint {str(self.directory)!r} is damaged:{listing}\n"
            "HINT: a file changed after onedist wrote it (a bad disk, a torn or unfinished copy); load "
            "an earlier checkpoint, or copy it again from an intact one",
            faults,
        )


def _read_manifest(directory: Path) -> Optional[dict[str, tuple[int, int]]]:
    """name -> (CRC-32, size) of ``directory``'s list; None when it has none."""
    path = directory / MANIFEST
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise corrupt(path, f"it cannot be read: {type(e).__name__}: {e}") from e
    try:
        manifest = json.loads(text)
        if manifest["format"] != _FORMAT:
            raise ValueError(f"format {manifest['format']!r}, expected {_FORMAT!r}")
        return {name: (int(d["crc32"], 16), int(d["size"])) for name, d in manifest["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise corrupt(path, f"it is not a valid list of checksums ({type(e).__name__}: {e})") from e


def _share(listed: dict[str, tuple[int, int]], rank: int, world_size: int) -> list[str]:
    """The files this rank checks: its own shard file (``__<rank>_0.distcp``, which DCP reads next
    at the saving world size), and every world_size-th of the others."""
    own, others = [], []
    for name in sorted(listed):
        shard = _OWN_SHARD.fullmatch(name)
        if shard is None or int(shard.group(1)) >= world_size:
            others.append(name)
        elif int(shard.group(1)) == rank:
            own.append(name)
    return own + others[rank::world_size]


def _fault_of(path: Path, crc: int, size: int) -> Optional[str]:
    """What does not match in ``path`` (None: it is intact)."""
    try:
        with open(path, "rb") as f:
            found = os.fstat(f.fileno()).st_size
            if found != size:
                return f"it has {found} bytes, {size} were written"
            actual = crc32_of(f, size)
    except FileNotFoundError:
        return "it is missing"
    except OSError as e:
        return f"it cannot be read: {type(e).__name__}: {e}"
    if actual != crc:
        return f"the CRC-32 of its {size} bytes is {actual:08x}, the checksum written with it says {crc:08x}"
    return None
