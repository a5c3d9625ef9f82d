"""The exceptions onedist raises.

Every exception derives from :class:`OnedistError` and from the built-in exception it means
(``ValueError``, ``TypeError``, ``RuntimeError``, ``TimeoutError``), so code written against
ignite.distributed or torch.distributed that catches the built-ins keeps working.

Messages say what was given, what is allowed and, where there is one, the fix (after
``HINT:``).

Example:
    >>> import onedist as od
    >>> try:
    ...     od.initialize("glooo")
    ... except od.OnedistValueError as e:
    ...     print(str(e).splitlines()[0])
    onedist.initialize: Backend should be one of ...: backend='glooo' is not a known backend; allowed: ...
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterable
from types import FrameType, TracebackType
from typing import Any, Optional

__all__ = [
    "BackendUnavailableError",
    "CheckpointCorruptError",
    "CollectiveMismatchError",
    "JoinedRankError",
    "LaunchArgumentError",
    "OnedistError",
    "OnedistRuntimeError",
    "OnedistTimeoutError",
    "OnedistTypeError",
    "OnedistValueError",
    "RemoteRankError",
    "WorkerFailedError",
]


class OnedistError(Exception):
    """Base class of every exception raised by onedist.

    Attributes:
        backend_error: when onedist's collective translated a backend's exception into this one
            (a peer's failure, a timeout), that exception, else None. It is kept here rather than
            chained, so that a traceback shows the user's call and onedist's explanation, not
            the backend's internals ("Connection closed by peer").
    """

    backend_error: Optional[BaseException] = None


class OnedistValueError(OnedistError, ValueError):
    """An argument has a value that is not allowed."""


class OnedistTypeError(OnedistError, TypeError):
    """An argument has a type that is not allowed."""


class OnedistRuntimeError(OnedistError, RuntimeError):
    """The distributed context is not in a state that allows the call."""


class OnedistTimeoutError(OnedistError, TimeoutError):
    """Something did not happen within its timeout."""


class LaunchArgumentError(OnedistValueError, RuntimeError):
    """A launch argument the backend's own launcher cannot honour (e.g. ``nnodes=2`` for Horovod,
    whose ``horovod.run`` takes a host list instead). A ValueError, and a RuntimeError as
    ignite.distributed raises for the same calls."""


class BackendUnavailableError(OnedistValueError):
    """The requested backend is unknown or not installed on this machine."""


class CollectiveMismatchError(OnedistRuntimeError):
    """The ranks called a collective with inputs that cannot be combined.

    Raised on every rank of the group with the same message (each rank sees what every rank
    passed), instead of a hang or an abort deep inside the communication library.
    """


class JoinedRankError(OnedistRuntimeError):
    """Inside :func:`onedist.join`, a collective needs a rank that has left its loop (a broadcast
    from it, a group that includes it, a send to it). Raised on every rank: at once on the ranks
    still in their loops, from the next step check on the finished ones.

    Attributes:
        call: the collective's name.
        rank: the finished rank it needed.
    """

    def __init__(self, message: str, call: str, rank: int) -> None:
        super().__init__(message)
        self.call = call
        self.rank = rank


class CheckpointCorruptError(OnedistRuntimeError):
    """A checkpoint is damaged or cannot be read: its bytes differ from the checksum written with
    them, it is cut short, or reading it fails. Raised on every rank, naming each file and what did
    not match; a RuntimeError, as torch's own errors for an unreadable file are.

    Attributes:
        faults: each damaged file (a sharded checkpoint's shard file within its directory) and its
            fault; :func:`onedist.resume` lists every step it tried when none was intact.

    Example:
        >>> import torch, onedist as od
        >>> path = "/tmp/od-corrupt-doc/last.pt"
        >>> od.save_checkpoint({"weight": torch.zeros(4)}, path)
        >>> with open(path, "r+b") as f:  # one bit flipped, 100 bytes before the end
        ...     _ = f.seek(-100, 2)
        ...     byte = f.read(1)[0]
        ...     _ = f.seek(-100, 2)
        ...     _ = f.write(bytes([byte ^ 1]))
        >>> try:
        ...     od.load_checkpoint(path)
        ... except od.CheckpointCorruptError as e:
        ...     print(list(e.faults), e.faults[path].split(" is ")[0])
        ['/tmp/od-corrupt-doc/last.pt'] the CRC-32 of its ... bytes
    """

    def __init__(self, message: str, faults: dict[str, str]) -> None:
        super().__init__(message)
        self.faults = dict(faults)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.faults))


class RemoteRankError(OnedistRuntimeError):
    """Another rank failed while preparing its part of a collective.

    Attributes:
        rank: the rank that failed.
    """

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class WorkerFailedError(OnedistRuntimeError):
    """A worker process started by :func:`onedist.spawn` or :class:`onedist.Parallel` failed.

    Attributes:
        rank: global rank of the worker whose failure came first.
        local_rank: its local rank.
        exitcode: its exit code (negative: killed by that signal), or ``None``.
        remote_traceback: the formatted traceback of its exception, if it raised one.
    """

    def __init__(
        self,
        message: str,
        rank: int,
        local_rank: int,
        exitcode: Optional[int],
        remote_traceback: Optional[str],
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.local_rank = local_rank
        self.exitcode = exitcode
        self.remote_traceback = remote_traceback


def _fmt_allowed(allowed: Iterable[Any]) -> str:
    return ", ".join(repr(a) for a in allowed)


def bad_value(
    func: str,
    arg: str,
    value: Any,
    allowed: str | Iterable[Any],
    hint: Optional[str] = None,
    says: Optional[str] = None,
    error: type[OnedistValueError] = OnedistValueError,
) -> OnedistValueError:
    """Build the standard "bad argument value" error (not raised here). ``says``: the words
    ignite.distributed uses for this error, which its users' code may match on; they lead.
    ``error``: the class, for a more specific ValueError."""
    allowed_text = allowed if isinstance(allowed, str) else _fmt_allowed(allowed)
    lead = f"{says}: " if says else ""
    msg = f"onedist.{func}: {lead}{arg}={value!r} is not allowed; allowed: {allowed_text}"
    if hint:
        msg += f"\nHINT: {hint}"
    return error(msg)


def bad_type(
    func: str, arg: str, value: Any, allowed: str, hint: Optional[str] = None, says: Optional[str] = None
) -> OnedistTypeError:
    """Build the standard "bad argument type" error (not raised here); ``says`` as for :func:`bad_value`."""
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    lead = f"{says}: " if says else ""
    msg = f"onedist.{func}: {lead}{arg} has type {type(value).__name__} ({shown}); allowed: {allowed}"
    if hint:
        msg += f"\nHINT: {hint}"
    return OnedistTypeError(msg)


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_traceback(tb: Optional[TracebackType]) -> Optional[TracebackType]:
    """``tb`` without its leading frames of onedist and runpy: the launcher code that called the
    user's function or script. A worker's traceback then starts where the user's code does, as
    ``python train.py`` prints it. An error raised by onedist itself keeps every frame."""
    head = tb
    while head is not None and _launcher_frame(head.tb_frame.f_code.co_filename):
        head = head.tb_next
    return head if head is not None else tb


def _launcher_frame(filename: str) -> bool:
    runpy = filename == "<frozen runpy>" or filename.endswith(f"{os.sep}runpy.py")
    return runpy or filename.startswith(_PACKAGE)


def user_frame(frame: Optional[FrameType], *also: str) -> Optional[FrameType]:
    """The first frame from ``frame`` outward that is not in onedist's files (any subpackage), nor
    under the directories ``also``: where the user called onedist; None when there is none."""
    skip = (_PACKAGE, *also)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(skip):
        frame = frame.f_back
    return frame


def call_site(frame: Optional[FrameType]) -> str:
    """``file:line`` of ``frame`` (``<unknown>`` for None)."""
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def format_user_traceback(exc: BaseException, tb: Optional[TracebackType] = None) -> str:
    """The traceback of ``exc`` as Python prints it, from the user's first frame (see
    :func:`user_traceback`)."""
    return "".join(traceback.format_exception(type(exc), exc, user_traceback(tb or exc.__traceback__)))
