"""Which TCP addresses a process listens on, read from /proc (no ss/netstat needed)."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from pathlib import Path


def _addr(hex_addr: str, v6: bool) -> str:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if v6:  # four little-endian 32-bit words
        raw = b"".join(struct.pack("<I", w) for w in struct.unpack(">4I", raw))
        ip = str(ipaddress.IPv6Address(raw))
    else:
        ip = socket.inet_ntoa(struct.pack("<I", int(host, 16)))
    return f"{ip}:{int(port, 16)}"


def listening(pid: int) -> list[str]:
    """``["127.0.0.1:4242", ...]``: the TCP sockets process ``pid`` has in LISTEN state."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, v6 in (("tcp", False), ("tcp6", True)):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A = LISTEN
                found.append(_addr(cols[1], v6))
    return found


def is_loopback_listener(addr: str) -> bool:
    ip = addr.rsplit(":", 1)[0]
    return ipaddress.ip_address(ip).is_loopback
