"""The TCP connections a process group opened, and breaking them to end the collective in flight.

gloo cannot cancel a collective: ``ProcessGroup.abort()`` and ``shutdown()`` leave an operation that
waits for a peer waiting (measured on torch 2.13), and its only timeout is the group's (30 minutes by
default). What does end it at once is its connection going away: shutting down the group's sockets
makes the pending operation raise "Connection closed by peer" on this rank and on the peers it was
connected to. onedist does that only after it found the ranks blocked in different collectives,
when the group is lost anyway (see :mod:`onedist.failures.stall`).

The sockets are the ones that appeared while the group was made (listed from ``/proc/self/fd``):
never the user's, nor the rendezvous store's. Only connected TCP sockets are shut down: gloo
aborts the process when its listening socket fails.
"""

from __future__ import annotations

import os
import socket

__all__ = ["break_connections", "socket_fds"]


def socket_fds() -> frozenset[int]:
    """The file descriptors of this process that are sockets (empty where /proc is missing)."""
    found = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return frozenset()
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                found.add(int(name))
        except (OSError, ValueError):
            pass
    return frozenset(found)


def break_connections(fds: frozenset[int], keep_port: int = -1) -> int:
    """Shut down the connected TCP sockets among ``fds`` that are not connections to or from port
    ``keep_port`` (the store's); returns how many. A descriptor closed and reused since is skipped when it is
    no longer a connected TCP socket."""
    broken = 0
    for fd in sorted(fds):
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                continue
            peer = sock.getpeername()
            if keep_port in (peer[1], sock.getsockname()[1]):  # a client of the store, or its server
                continue
            sock.shutdown(socket.SHUT_RDWR)  # the socket itself, so gloo's descriptor too
            broken += 1
        except OSError:
            continue  # a listening or already closed socket
        finally:
            sock.close()  # only the duplicate
    return broken
