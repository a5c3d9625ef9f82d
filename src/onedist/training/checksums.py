"""CRC-32 checksums of checkpoint files: computed from the bytes as they are written, checked before
torch reads a byte of them.

* :class:`Crc32Writer` stands between a writer (``torch.save``, torch.distributed.checkpoint) and
  its file: every byte passes through it, so the checksum is that of the exact bytes written.
* :func:`save_with_checksum` is ``torch.save`` through it, then a 60-byte record at the end:
  ``\\nonedist checksum: crc32 <8 hex> of <16 hex> bytes\\n``. Zip readers, torch's included, find
  a zip from its end record and ignore what follows, so a plain ``torch.load`` still reads the file.
* :func:`verify_file` reads the file once (a memory map, hashed in threads) and compares: True when
  the CRC-32 matches, False when the file has no record (an older onedist's, or another tool's),
  :class:`~onedist.CheckpointCorruptError` naming the file and the mismatch otherwise.
* :func:`load_verified` is ``torch.load`` of a file once it is verified. On the CPU (a file of
  64 MiB or more), the hash pass is also the copy: each tensor's bytes are read into memory of its
  own and hashed while still in the cache (:class:`HashedCopies`), the rest of the file is hashed
  between them, and only a file whose CRC-32 matches is unpickled (``mmap=True``, its tensors then
  moved onto the copies). Elsewhere (a GPU, a smaller file) the file is hashed, then loaded mapped
  and each storage copied once (:func:`own_memory` says why). A file without a record
  loads as before, with a warning; when torch cannot read it and it is not a whole zip archive,
  it is damaged: CheckpointCorruptError, not torch's "failed finding central directory".
* :func:`load_mapped` is the same load with the tensors left on the file's mapped pages, for a
  caller that copies parts of them (each rank's shards: :mod:`.full_checkpoint`) and then drops
  them, which unmaps the file; :func:`own_memory` copies the rest into memory of its own.

The hash pass maps the file and hands each 4 MiB back to the page cache once hashed
(``MADV_DONTNEED``): a process's resident memory grows by a few MiB during it, not by the file.

Why CRC-32: on 200 MB in memory zlib.crc32 ran at 2.3 GB/s here, zlib.adler32 at 1.8, hashlib's
sha256 and sha1 at 1.2, blake2b at 1.05, md5 at 0.8 (``benchmarks/bench_checkpoint.py`` prints
them); every Python has it; it catches every burst of up to 32 flipped bits and misses other damage
with a chance of 2^-32. It guards against bad disks and torn copies, not against forged files.
ISA-L's CRC-32 (``isal``, a dependency where it has wheels: Linux x86_64 and aarch64) is the same
function at 12-13 GB/s from memory and 90 GB/s from the cache (carry-less multiplication); without
it, zlib's is used (:data:`CRC32_BY` says which). Files written with either verify with the other.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import re
import sys
import zipfile
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, Optional

import torch

from ..errors import CheckpointCorruptError

__all__ = [
    "CRC32_BY",
    "RECORD_SIZE",
    "Crc32Writer",
    "HashedCopies",
    "corrupt",
    "crc32",
    "crc32_combine",
    "crc32_of",
    "load_mapped",
    "load_verified",
    "own_memory",
    "save_with_checksum",
    "verify_file",
    "without_torchs_own_crc",
]

logger = logging.getLogger("onedist")

_RECORD = re.compile(rb"\nonedist checksum: crc32 ([0-9a-f]{8}) of ([0-9a-f]{16}) bytes\n")
_MAGIC = b"onedist checksum:"
_ZIP_END = b"PK\x05\x06"  # a zip's end record: 22 bytes when it has no comment (torch writes none)
_ZIP_END_SIZE = 22
_TENSOR_MEMBER = re.compile(r"(?:.*/)?data/\d+")  # torch's zip: one member per storage
# one thread hashes each 32 MiB: both CRC-32s let go of the GIL, so the threads run at once
_SEGMENT = 32 << 20
# ... in steps of 4 MiB, each handed back to the page cache once hashed
_STEP = 4 << 20
_POLY = 0xEDB88320  # CRC-32's polynomial, bit-reversed (zlib's)
# a checked load reads each tensor's bytes in parts of 256 KiB, each hashed while still in the
# cache: +4 ms on 200 MB with ISA-L's CRC-32, against +15 ms for a pass over them afterwards
_PART = 256 << 10
# ... the tensors of this size or more: a smaller one is hashed with the bytes around it and copied
# after the check (on 3000 tensors of 16 KiB, reading each into its own memory cost 6 us a tensor)
_COPIED = _PART
# ... in a file of 64 MiB or more: reading the zip's directory costs 3.6 us a member (11 ms for 3000
# tensors of 16 KiB: x1.12 the CPU time of the load before), more than hashing as it copies saves
# on a small file (0.055 ms a MB); a smaller file is hashed, then loaded mapped and copied
_COPIES_FROM = 64 << 20


def _fastest_crc32() -> tuple[Callable[..., int], str]:
    """ISA-L's CRC-32 where ``isal`` is installed, else zlib's: the same function (zlib's polynomial,
    initial value and final XOR), so either verifies what the other wrote."""
    try:
        from isal import isal_zlib
    except ImportError:
        return zlib.crc32, "zlib"
    return isal_zlib.crc32, "isal"


#: ``crc32(data, value=0)``: zlib.crc32's result, computed by ISA-L's where it is installed; which
#: one is :data:`CRC32_BY` ("isal" or "zlib")
crc32, CRC32_BY = _fastest_crc32()


def _record(crc: int, size: int) -> bytes:
    return b"\nonedist checksum: crc32 %08x of %016x bytes\n" % (crc, size)


#: the bytes the checksum record adds at the end of a file
RECORD_SIZE = len(_record(0, 0))


class Crc32Writer:
    """A binary file's writing side that keeps the CRC-32 and the count of the bytes written
    through it (``crc``, ``size``), for ``torch.save`` and torch.distributed.checkpoint.

    An ``OSError`` of the file (a full disk) is kept in ``error``: torch.save replaces it by its own
    "unexpected pos" RuntimeError, which does not say what happened.

    Example:
        >>> import io, zlib
        >>> w = Crc32Writer(io.BytesIO())
        >>> w.write(b"abc"), w.size, w.crc == zlib.crc32(b"abc")
        (3, 3, True)
    """

    def __init__(self, file: Any) -> None:
        self.file = file
        self.crc = 0
        self.size = 0
        self.error: Optional[OSError] = None

    def write(self, data: Any) -> int:
        try:
            written: int = self.file.write(data)
        except OSError as e:
            self.error = e
            raise
        self.crc = crc32(data, self.crc)
        self.size += memoryview(data).nbytes
        return written

    def tell(self) -> int:
        position: int = self.file.tell()
        return position

    def fileno(self) -> int:
        number: int = self.file.fileno()
        return number

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def save_with_checksum(state: Any, file: BinaryIO) -> None:
    """``torch.save(state, file)``, then the checksum record of the bytes it wrote.

    Example:
        >>> import io, torch
        >>> buffer = io.BytesIO()
        >>> save_with_checksum({"w": torch.ones(2)}, buffer)
        >>> buffer.getvalue()[-RECORD_SIZE:].startswith(b"\\nonedist checksum: crc32 ")
        True
    """
    writer = Crc32Writer(file)
    try:
        with without_torchs_own_crc():
            torch.save(state, writer)  # type: ignore[arg-type]  # it writes to anything with write()
    except Exception:
        if writer.error is not None:
            raise writer.error from None
        raise
    file.write(_record(writer.crc, writer.size))


@contextlib.contextmanager
def without_torchs_own_crc() -> Iterator[None]:
    """torch.save computes a CRC-32 of each zip entry that torch.load never checks; onedist's covers
    every byte. Measured on 200 MB: torch's took 130 ms of a 310 ms save, zlib's 90 ms, ISA-L's 15;
    without torch's the save with onedist's checksum takes less time than torch's own save
    (benchmarks/bench_checkpoint.py). An older torch without the switch computes both.

    Example:
        >>> import io, torch
        >>> buffer = io.BytesIO()
        >>> with without_torchs_own_crc():
        ...     torch.save(torch.ones(2), buffer)
        >>> torch.load(io.BytesIO(buffer.getvalue()))
        tensor([1., 1.])
    """
    try:
        from torch.utils.serialization import config
    except ImportError:
        yield
        return
    if not hasattr(getattr(config, "save", None), "compute_crc32"):
        yield
        return
    with config.patch({"save.compute_crc32": False}):  # type: ignore[attr-defined]  # set up at import
        yield


def verify_file(path: Path) -> bool:
    """Whether ``path``'s bytes match its checksum record: True, or False when it has none (a
    file of an older onedist or another tool). Raises CheckpointCorruptError, naming the file and
    the mismatch, when they differ, the file was cut short or its record is damaged.

    Example:
        >>> import tempfile, torch
        >>> path = Path(tempfile.mkdtemp()) / "a.pt"
        >>> with open(path, "wb") as f:
        ...     save_with_checksum({"w": torch.ones(2)}, f)
        >>> verify_file(path)
        True
    """
    return _check(path, crc32_of)


def _check(path: Path, crc_of: Callable[[BinaryIO, int], int]) -> bool:
    """:func:`verify_file`, the bytes hashed by ``crc_of(file, length)``."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise corrupt(path, "it is empty")
            recorded = _read_record(f, size, path)
            if recorded is None:
                return False
            crc, covered = recorded
            if covered != size - RECORD_SIZE:
                raise corrupt(
                    path,
                    f"it has {size - RECORD_SIZE} bytes before its checksum record, which says it was "
                    f"written with {covered}",
                )
            actual = crc_of(f, covered)
    except OSError as e:  # a bad sector (EIO), no permission to read: nothing can be verified
        raise corrupt(path, f"it cannot be read: {type(e).__name__}: {e}") from e
    except ValueError as e:  # mmap: the file shrank after its size was read
        raise corrupt(path, f"it changed while it was read ({e})") from e
    if actual != crc:
        raise corrupt(
            path,
            f"the CRC-32 of its {covered} bytes is {actual:08x}, the checksum written with it says {crc:08x}",
        )
    return True


def load_verified(path: Path, location: Any, weights_only: bool) -> Any:
    """``torch.load`` of ``path`` once its bytes matched its checksum record, every tensor in memory
    of its own; a file without a checksum record is loaded as it is, with a warning on rank 0.
    Raises CheckpointCorruptError for a damaged file, and torch's own error for an intact one
    torch refuses (``weights_only``). Nothing is unpickled before every byte was checked.

    Example:
        >>> import tempfile, torch
        >>> path = Path(tempfile.mkdtemp()) / "a.pt"
        >>> with open(path, "wb") as f:
        ...     save_with_checksum({"w": torch.ones(2)}, f)
        >>> load_verified(path, "cpu", True)["w"]
        tensor([1., 1.])
    """
    copies = HashedCopies() if _is_cpu(location) and _size(path) >= _COPIES_FROM else None
    if _check(path, copies or crc32_of):
        try:
            # mapped: torch reads the pickle only; the tensors then go onto the verified copies
            # (on a GPU, torch copies them there from the pages just hashed)
            loaded = torch.load(path, map_location=location, weights_only=weights_only, mmap=True)
        except (RuntimeError, OSError):
            if _mappable(path):  # torch's own error, not the file system's
                raise
            return torch.load(path, map_location=location, weights_only=weights_only)
        return copies.adopt(loaded) if copies is not None else own_memory(loaded)
    try:
        state = torch.load(path, map_location=location, weights_only=weights_only)
    except Exception as e:
        fault = _damage(path)
        if fault is None:  # a whole zip archive: torch refuses its content, not damaged bytes
            raise
        raise _unreadable(path, fault, e) from e
    _warn_unverified(path)
    return state


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # _check says why
        return 0


def _is_cpu(location: Any) -> bool:
    """Whether ``map_location`` puts every tensor on the CPU (a dict or a function: not known)."""
    if not isinstance(location, (str, torch.device)):
        return False
    try:
        return torch.device(location).type == "cpu"
    except RuntimeError:  # not a device: torch.load says so
        return False


def _unreadable(path: Path, fault: str, error: BaseException) -> CheckpointCorruptError:
    """The error for a file without a checksum record that torch cannot read (``error``) and that
    is not a whole zip archive (``fault``)."""
    said = (str(error).splitlines() or [""])[0]
    return corrupt(
        path,
        f"{fault}; torch cannot read it ({type(error).__name__}: {said}), and it has no checksum record "
        "(it was cut short, or written by an older onedist or another tool)",
    )


def load_mapped(path: Path, weights_only: bool) -> Any:
    """``torch.load`` of ``path`` on the CPU once :func:`verify_file` found it intact, its tensors
    left on the file's mapped pages (``mmap=True``): nothing of them is read until it is used, and
    the file is unmapped once the last of them is dropped. For a caller that keeps parts of the
    tensors (each rank's shards) and copies what it keeps (:func:`own_memory` copies the rest). A
    file without a checksum record loads mapped too, with :func:`load_verified`'s warning, or read
    whole where it cannot be mapped (a file system that cannot, torch's format before 1.6). Raises
    as :func:`load_verified`.

    Example:
        >>> import tempfile, torch
        >>> path = Path(tempfile.mkdtemp()) / "a.pt"
        >>> with open(path, "wb") as f:
        ...     save_with_checksum({"w": torch.arange(6.0)}, f)
        >>> mapped = load_mapped(path, True)
        >>> mapped["w"][4:].clone()   # reads these 8 bytes of the file only
        tensor([4., 5.])
        >>> del mapped                # the file is unmapped
    """
    intact = verify_file(path)
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
    except Exception as e:
        fault = _damage(path)
        if fault is None and _mappable(path):  # a whole zip torch maps: it refuses the content
            raise
        try:  # not mappable here, or torch's older format: read whole
            loaded = torch.load(path, map_location="cpu", weights_only=weights_only)
        except Exception:
            if intact or fault is None:
                raise
            raise _unreadable(path, fault, e) from e
    if not intact:
        _warn_unverified(path)
    return loaded


def own_memory(loaded: Any) -> Any:
    """``loaded`` with every tensor it holds (in dicts, lists, tuples, sets and objects' attributes)
    moved from the file's mapped pages to memory of its own, one copy per storage (tensors that
    shared one still do: tied weights stay tied). A tensor left on the file's pages (an
    optimizer's state, which its ``load_state_dict`` keeps as it is, the returned values) would
    change, or end the process with SIGBUS, when the file is rewritten in place (``torch.save`` to
    the same path, a copy over it) while training runs on. Measured on 200 MB with zlib's CRC-32
    after a separate hash pass: the load took x1.3 the time of ``torch.load`` + ``load_state_dict``
    without a checksum (x0.6-0.7 with the tensors left on the mapped pages, x1.4 when torch read the
    file again after the hash); a load onto the CPU now copies as it hashes (:class:`HashedCopies`).

    Example:
        >>> import torch
        >>> w = torch.ones(3)
        >>> before = w.data_ptr()
        >>> state = own_memory({"w": w, "tied": w[1:]})  # the same tensors, in a copy of their storage
        >>> state["w"].data_ptr() != before, state["tied"].data_ptr() == state["w"].data_ptr() + 4
        (True, True)
    """
    return _move(_cpu_tensors(loaded), loaded, {})


def _cpu_tensors(loaded: Any) -> list[torch.Tensor]:
    """The tensors on the CPU in ``loaded``, in its dicts, lists, tuples, sets and objects."""
    tensors: list[torch.Tensor] = []
    seen: set[int] = set()

    def visit(value: Any) -> None:
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            if value.device.type == "cpu" and value.layout == torch.strided:
                tensors.append(value)
            return
        if isinstance(value, dict):
            items: Any = value.values()
        elif isinstance(value, (list, tuple, set, frozenset)):
            items = value
        else:
            items = getattr(value, "__dict__", {}).values()
        for item in items:
            visit(item)

    visit(loaded)
    return tensors


def _move(tensors: list[torch.Tensor], loaded: Any, onto: dict[int, Any]) -> Any:
    """Each of ``tensors`` onto ``onto[its storage's address]``, or a copy of its storage (made once
    per storage), in place; ``loaded``."""
    with torch.no_grad():
        for t in tensors:
            storage = t.untyped_storage()
            own = onto.get(storage.data_ptr())
            if own is None:
                own = onto[storage.data_ptr()] = storage.clone()  # type: ignore[no-untyped-call]
            t.set_(own, t.storage_offset(), t.size(), t.stride())
    return loaded


class HashedCopies:
    """The hash pass of a load onto the CPU, which is also its copy: the bytes of each tensor of
    256 KiB or more (a ``data/<n>`` member of torch's zip) are read into memory of their own, each
    256 KiB hashed while still in the cache; the bytes between them (zip headers, the pickle,
    smaller tensors) are hashed as they come. So the file is read once; :meth:`adopt` then moves
    the tensors torch unpickled onto these copies, and copies the small ones. A ``crc_of`` for
    :func:`_check`: every byte is hashed, in the file's order, by the same CRC-32 as the record's.

    Example:
        >>> import tempfile, torch
        >>> path = Path(tempfile.mkdtemp()) / "a.pt"
        >>> with open(path, "wb") as f:
        ...     save_with_checksum({"w": torch.arange(2.0**16), "b": torch.ones(2)}, f)
        >>> copies = HashedCopies()
        >>> _check(path, copies), [storage.nbytes() for storage in copies.storages.values()]
        (True, [262144])
        >>> copies.adopt(torch.load(path, weights_only=True, mmap=True))["w"][-2:]
        tensor([65534., 65535.])
    """

    def __init__(self) -> None:
        self.storages: dict[int, torch.UntypedStorage] = {}  # by the file offset of its bytes

    def __call__(self, file: BinaryIO, length: int) -> int:
        fd, crc, at = file.fileno(), 0, 0
        for start, size in _tensor_members(file, length):
            crc = _read_hashed(fd, at, start - at, crc)
            own = torch.empty(size, dtype=torch.uint8).untyped_storage()
            # its memory as a buffer for os.preadv and the CRC (kept alive by self.storages)
            into = memoryview((ctypes.c_ubyte * size).from_address(own.data_ptr()))
            crc = _read_hashed(fd, start, size, crc, into)
            self.storages[start] = own
            at = start + size
        return _read_hashed(fd, at, length - at, crc)

    def adopt(self, loaded: Any) -> Any:
        """``loaded`` (``torch.load(mmap=True)`` of the file just hashed) with each tensor moved onto
        the copy of its bytes, the smaller ones onto copies made now, as :func:`own_memory` does;
        when they do not pair up (a layout this does not know), every storage is copied now."""
        tensors = _cpu_tensors(loaded)
        sizes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        addresses = sorted(at for at, size in sizes.items() if size >= _COPIED)
        offsets = sorted(self.storages)
        # torch maps the whole file once: each storage lies at the mapping's start + its offset
        pairs = list(zip(addresses, offsets))
        paired = len(addresses) == len(offsets) and all(
            a - o == addresses[0] - offsets[0] and sizes[a] == self.storages[o].nbytes() for a, o in pairs
        )
        return _move(tensors, loaded, {a: self.storages[o] for a, o in pairs} if paired else {})


def _tensor_members(file: BinaryIO, length: int) -> list[tuple[int, int]]:
    """Where the bytes of each tensor storage of 256 KiB or more in torch's zip ``file`` start, and
    how many, in the file's order and within its first ``length`` bytes; none when its zip cannot
    be read (it is then hashed whole, and found damaged) or holds another byte order's (torch
    swaps those)."""
    try:
        with zipfile.ZipFile(file) as archive:
            members = sorted(archive.infolist(), key=lambda m: m.header_offset)
    except Exception:  # whatever a damaged zip raises: its bytes are hashed all the same
        return []
    spans: list[tuple[int, int]] = []
    for m in members:
        tensor = _TENSOR_MEMBER.fullmatch(m.filename) and m.file_size >= _COPIED
        if not (tensor or m.filename.endswith("/byteorder")) or m.compress_type != zipfile.ZIP_STORED:
            continue
        start = _data_offset(file.fileno(), m)
        if start is None:
            continue
        saved_as = os.pread(file.fileno(), m.file_size, start) if m.filename.endswith("/byteorder") else None
        if saved_as not in (None, sys.byteorder.encode()):
            return []
        end = spans[-1][0] + spans[-1][1] if spans else 0  # where the previous one's bytes end
        if tensor and m.file_size <= length - start and end <= start:
            spans.append((start, m.file_size))
    return spans


def _data_offset(fd: int, member: zipfile.ZipInfo) -> Optional[int]:
    """Where ``member``'s bytes start: after its local header (30 bytes, its name, an extra field
    that torch uses to align them). None when no local header is there."""
    header = os.pread(fd, 30, member.header_offset)
    if len(header) < 30 or not header.startswith(b"PK\x03\x04"):
        return None
    name_length, extra_length = (int.from_bytes(header[at : at + 2], "little") for at in (26, 28))
    return member.header_offset + 30 + name_length + extra_length


def _read_hashed(fd: int, start: int, size: int, crc: int, into: Optional[memoryview] = None) -> int:
    """``crc`` extended by the CRC-32 of the ``size`` bytes of ``fd`` at ``start``: read into
    ``into`` (or a buffer of one part) a part at a time, each hashed while still in the cache."""
    view = (into if into is not None else memoryview(bytearray(min(_PART, size)))).cast("B")
    done = 0
    while done < size:
        part = view[done : done + _PART] if into is not None else view[: min(_PART, size - done)]
        got = os.preadv(fd, [part], start + done)
        if got == 0:
            raise ValueError(f"the file ended {size - done} bytes early")
        crc = crc32(part[:got], crc)
        done += got
    return crc


def _mappable(path: Path) -> bool:
    """Whether ``path``'s file system maps files into memory (not every FUSE one does)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ):
            return True
    except (OSError, ValueError):
        return False


def _damage(path: Path) -> Optional[str]:
    """What is wrong with a file that has no checksum record (None: it is a whole zip archive)."""
    try:
        with zipfile.ZipFile(path):
            return None
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        return f"it is not a whole zip archive, torch's format ({e})"


def _warn_unverified(path: Path) -> None:
    from ..context import get_rank

    if get_rank() == 0:
        logger.warning(
            "onedist.load_checkpoint: %s has no checksum (written before onedist wrote them, or by "
            "another tool): loaded without verification",
            path,
        )


def _read_record(f: BinaryIO, size: int, path: Path) -> Optional[tuple[int, int]]:
    """The (CRC-32, size) of the record at the end of ``f``; None when it has none."""
    f.seek(max(0, size - 4096))
    tail = f.read()
    found = _RECORD.fullmatch(tail[-RECORD_SIZE:])
    if found is not None:
        return int(found.group(1), 16), int(found.group(2), 16)
    at = tail.rfind(b"\n" + _MAGIC)
    if at < 0 and tail[-RECORD_SIZE - _ZIP_END_SIZE :].startswith(_ZIP_END):
        at = len(tail) - RECORD_SIZE  # the zip ends where a record starts: its first bytes are damaged
    if at < 0:
        return None
    if len(tail) - at < RECORD_SIZE:
        missing = RECORD_SIZE - (len(tail) - at)
        raise corrupt(path, f"it was cut short: the last {missing} bytes of its checksum record are missing")
    if len(tail) - at > RECORD_SIZE:
        raise corrupt(path, f"{len(tail) - at - RECORD_SIZE} bytes were added after its checksum record")
    raise corrupt(path, "the checksum record at its end is damaged")


def corrupt(path: Path, fault: str) -> CheckpointCorruptError:
    """The error for the damaged file ``path`` (not raised here).

    Example:
        >>> error = corrupt(Path("/ckpt/last.pt"), "it is empty")
        >>> print(error.faults)
        {'/ckpt/last.pt': 'it is empty'}
        >>> print(str(error).splitlines()[0])
        onedist.load_checkpoint: the checkpoint file '/ckpt/last.pt' is damaged: it is empty
    """
    return CheckpointCorruptError(
        f"onedist.load_checkpoint: the checkpoint file {str(path)!r} is damaged: {fault}\n"
        "HINT: it changed after onedist wrote it (a bad disk, a torn or unfinished copy); load an "
        "earlier checkpoint, or copy it again from an intact one",
        {str(path): fault},
    )


# ============================================================================ CRC-32 of a file
def crc32_of(file: BinaryIO, length: int) -> int:
    """The CRC-32 of the first ``length`` bytes of the open ``file``: one memory map, hashed in
    threads (one per 32 MiB, at most 4) whose results are combined in order.

    Example:
        >>> import tempfile, zlib
        >>> with tempfile.TemporaryFile() as f:
        ...     _ = f.write(b"0123456789")
        ...     f.flush()
        ...     crc32_of(f, 4) == zlib.crc32(b"0123")
        True
    """
    if length == 0:
        return 0
    try:
        mapped = mmap.mmap(file.fileno(), length, access=mmap.ACCESS_READ)
    except OSError:  # a file system that cannot map files (some FUSE ones): read them instead
        return _crc32_by_reading(file, length)
    with mapped:
        advise = getattr(mapped, "madvise", None)
        if advise is not None:
            advise(mmap.MADV_SEQUENTIAL)
        done = advise and getattr(mmap, "MADV_DONTNEED", None)

        def hashed(start: int, size: int) -> None:  # those pages out of this process's memory
            if done and advise is not None:
                advise(done, start, size)

        with memoryview(mapped) as view:
            return _crc32_in_threads(view, hashed)


def _crc32_by_reading(file: BinaryIO, length: int) -> int:
    crc = 0
    file.seek(0)
    while length > 0:
        chunk = file.read(min(_SEGMENT, length))
        if not chunk:
            raise ValueError(f"the file ended {length} bytes early")
        crc = crc32(chunk, crc)
        length -= len(chunk)
    return crc


def _crc32_in_threads(view: memoryview, hashed: Callable[[int, int], None]) -> int:
    """The CRC-32 of ``view``, one thread per 32 MiB, each in steps of 4 MiB: ``hashed(start,
    size)`` after each step (a mapped file's pages are then handed back: page cache, not the
    process's resident memory, which the file would otherwise fill while it is hashed)."""
    starts = range(0, len(view), _SEGMENT)

    def segment(start: int) -> int:
        crc, end = 0, min(start + _SEGMENT, len(view))
        for at in range(start, end, _STEP):
            size = min(_STEP, end - at)
            with view[at : at + size] as part:
                crc = crc32(part, crc)
            hashed(at, size)
        return crc

    with ThreadPoolExecutor(max(1, min(4, len(starts), len(os.sched_getaffinity(0))))) as pool:
        crcs = list(pool.map(segment, starts))
    crc = crcs[0]
    for start, part in zip(starts[1:], crcs[1:]):
        crc = crc32_combine(crc, part, min(_SEGMENT, len(view) - start))
    return crc


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """The CRC-32 of ``a + b`` from ``crc1`` (of ``a``), ``crc2`` (of ``b``) and ``len(b)``: zlib's
    ``crc32_combine`` (1.2.12's, by powers of x modulo the polynomial), which Python's zlib lacks.

    Example:
        >>> import zlib
        >>> crc32_combine(zlib.crc32(b"hello "), zlib.crc32(b"world"), 5) == zlib.crc32(b"hello world")
        True
    """
    return _multiply(_x_to_the_8n(length2), crc1) ^ crc2


def _multiply(a: int, b: int) -> int:
    """a * b modulo the CRC-32 polynomial (bit-reversed polynomials)."""
    product = 0
    bit = 1 << 31
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _powers() -> list[int]:
    """x^(2^k) modulo the polynomial, k = 0..31."""
    powers = [1 << 30]  # x^1
    for _ in range(31):
        powers.append(_multiply(powers[-1], powers[-1]))
    return powers


_X_TO_2K = _powers()


def _x_to_the_8n(n: int) -> int:
    """x^(8n) modulo the polynomial: what appending ``n`` zero bytes multiplies a CRC by."""
    power, k = 1 << 31, 3  # x^0; 8n = n * 2^3
    while n:
        if n & 1:
            power = _multiply(_X_TO_2K[k & 31], power)
        n >>= 1
        k += 1
    return power
