"""Small network helpers shared by the backends and the launchers (no torch import)."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from collections.abc import MutableMapping
from typing import Optional
from urllib.parse import urlsplit

__all__ = [
    "LOOPBACK",
    "STORE_FD_ENV",
    "discard_store_fd",
    "free_port",
    "is_loopback",
    "listen_socket",
    "loopback_ifname",
    "rendezvous_port",
    "tcp_init_would_hang",
]

LOOPBACK = "127.0.0.1"

#: a launcher that bound the rendezvous socket itself hands its file descriptor to rank 0 here
STORE_FD_ENV = "ONEDIST_STORE_FD"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it).

    Binding to port 0 and closing leaves a short window in which another program could take the
    port; torchrun's ``--standalone`` has the same window. onedist's own launchers avoid it: they
    keep the socket (:func:`listen_socket`) and hand it to rank 0's store.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def is_loopback(addr: str) -> bool:
    """Whether ``addr`` is a loopback address literal or ``localhost`` (no DNS lookup).

    Example:
        >>> is_loopback("127.0.0.1"), is_loopback("::1"), is_loopback("node0")
        (True, True, False)
    """
    if addr.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(addr.strip("[]").split("%")[0]).is_loopback
    except ValueError:
        return False


def listen_socket(host: str, port: int, *, what: str = "MASTER_PORT") -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port`` 0: the OS picks one) for a rendezvous store.

    ``host`` "" listens on every interface (multi-node); a loopback address listens on loopback
    only, so a one-node job opens no port to the network. Raises OSError with the fix when the port
    is taken.

    Example:
        >>> s = listen_socket("127.0.0.1", 0)
        >>> s.getsockname()[0]
        '127.0.0.1'
        >>> s.close()
    """
    if host.lower().startswith("localhost"):
        host = LOOPBACK
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host.strip("[]"), port))
        s.listen(2048)
    except OSError as e:
        s.close()
        if e.errno == errno.EADDRINUSE:
            raise OSError(
                e.errno,
                f"{what}={port} is already in use on {host or 'this host'}, so rank 0 cannot host the "
                f'rendezvous there\nHINT: pass another free port (e.g. `python -c "import onedist._net as n; '
                f"print(n.free_port(''))\"` on node 0) to every node, or stop what holds it: `ss -ltnp | "
                f"grep :{port}`",
            ) from e
        raise
    return s


def rendezvous_port(
    master_addr: str, master_port: Optional[int], *, host_store: bool, what: str
) -> tuple[int, Optional[socket.socket]]:
    """The rendezvous port a launcher hands to its workers, and the socket when it hosts the store.

    ``host_store`` (this launcher starts rank 0): bind now (loopback only when ``master_addr`` is a
    loopback address) and return the listening socket, for rank 0's store to serve on; raises
    OSError with the fix when the port is taken. Otherwise the given port, or a free one.
    """
    if host_store:
        sock = listen_socket(master_addr if is_loopback(master_addr) else "", master_port or 0, what=what)
        return sock.getsockname()[1], sock
    if master_port is not None:
        return master_port, None
    return free_port(LOOPBACK if is_loopback(master_addr) else ""), None


def discard_store_fd(environ: MutableMapping[str, str]) -> None:
    """Close the socket a launcher handed over in ``ONEDIST_STORE_FD`` if nobody took it (a failed
    initialize), so the port is not held until the process exits."""
    text = environ.pop(STORE_FD_ENV, None)
    if text is not None:
        try:
            os.close(int(text))
        except (OSError, ValueError):
            pass


def loopback_ifname() -> Optional[str]:
    """The name of the loopback interface ("lo" on Linux, "lo0" on macOS), None if unknown."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return next((n for n in names if n.startswith("lo")), None)


def tcp_init_would_hang(init_method: str) -> bool:
    """Whether a ``tcp://host:port`` rendezvous names a host that is not this machine.

    Rank 0 hosts the rendezvous at that address, so another machine's address leaves every rank
    connecting there until the timeout (ignite refuses any tcp:// for that reason). Binding a
    socket to the address tells without sending anything.
    """
    host = urlsplit(init_method).hostname
    if not host:
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return True
    for family, _, _, _, addr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((addr[0], 0))
                return False
            except OSError:
                continue
    return True
