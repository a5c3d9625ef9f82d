"""Holding back torch's C++ noise about a store whose server is gone, while a failure is explained."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any, Optional

#: the first line of torch's C++ warning (with its stack trace) for a store request that failed
#: because the store's server is gone, e.g. ``[rank2]:[W1123 18:11:03.646544557 TCPStore.cpp:125]
#: [c10d] recvValue failed on SocketImpl(...): Connection reset by peer``
_STORE_NOISE = re.compile(r"^(\[rank\d+\]:)?\[[WE]\d{4} [\d:.]+ TCPStore\.cpp:\d+\] \[c10d\] ")


_STORE_NOISE_TAIL = ("Exception raised from ", "frame #", "<omitting python frames>")


_holding_stderr = threading.Lock()


def without_store_noise(text: str) -> str:
    """``text`` without torch's C++ warnings about store requests whose server is gone (each a
    line, an "Exception raised from" line and a C++ stack trace, then a blank line).

    >>> noise = "[W1123 18:11:03.6 TCPStore.cpp:125] [c10d] recvValue failed\\nframe #0: f\\n\\n"
    >>> without_store_noise("mine\\n" + noise + "mine too\\n")
    'mine\\nmine too\\n'
    """
    kept: list[str] = []
    skipping = False
    for line in text.splitlines(keepends=True):
        if _STORE_NOISE.match(line):
            skipping = True
            continue
        if skipping:
            if line.startswith(_STORE_NOISE_TAIL):
                continue
            skipping = False
            if not line.strip():
                continue
        kept.append(line)
    return "".join(kept)


class _Held:
    """fd 2 while :func:`store_noise_held_back` holds it: the real stderr's duplicate, and the
    file that receives what is written meanwhile."""

    lock = threading.Lock()
    saved: Optional[int] = None
    file: Any = None


@contextlib.contextmanager
def store_noise_held_back() -> Iterator[None]:
    """Hold back what this process writes to stderr (fd 2: Python and C++ alike) meanwhile, and
    write it afterwards without torch's warnings about a store whose server is gone.

    The explanation of a failure asks the rendezvous store for the other ranks' reports; the store's
    host (rank 0 under spawn and ``onedist run``) may exit between onedist's check that it is there
    and the request, and torch then prints a 20-line C++ stack trace before this rank's error,
    which reads as if this rank had failed first. The request itself raises, and onedist handles
    that. Nested or concurrent uses hold back once; a thread that ends the process meanwhile calls
    :func:`release_stderr` first."""
    if not _holding_stderr.acquire(blocking=False):
        yield
        return
    try:
        with _Held.lock:
            try:
                sys.stderr.flush()
                saved = os.dup(2)
            except (OSError, ValueError, AttributeError):
                saved = None
            if saved is not None:
                _Held.file = tempfile.TemporaryFile()  # noqa: SIM115 (release_stderr closes it)
                os.dup2(_Held.file.fileno(), 2)
                _Held.saved = saved
        try:
            yield
        finally:
            release_stderr()
    finally:
        _holding_stderr.release()


def release_stderr() -> None:
    """Give fd 2 back now, with what was held back (see :func:`store_noise_held_back`); nothing
    when it is not held. Call it before ``os._exit``, which would lose what is held."""
    with _Held.lock:
        if _Held.saved is None:
            return
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(_Held.saved, 2)
        os.close(_Held.saved)
        _Held.saved = None
        held, _Held.file = _Held.file, None
        with contextlib.suppress(OSError):
            held.seek(0)
            text = without_store_noise(held.read().decode(errors="replace"))
            if text:
                os.write(2, text.encode())
        held.close()
