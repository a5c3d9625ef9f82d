"""The key-value store onedist starts beside Horovod, and the send / recv it carries.

Horovod has no point-to-point operation, and no side channel for failure reports: with more
than one process, onedist starts a TCPStore hosted by rank 0 (:func:`start_side_store`), keeps it
on rank 0 until every rank finalised, and carries send / recv through it
(:class:`StoreMessages`): exact, with tags and ``src=None``, for control messages and small
tensors.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional

import torch

from ..errors import OnedistRuntimeError
from .interface import Backend, Work

_LOOPBACK = "127.0.0.1"
_FINALIZE_WAIT_S = 30.0  # rank 0 keeps the side store this long for ranks still finishing
_P2P_KEY = "onedist/p2p/{}/{}>{}/{}/{}"  # group, src, dst, tag, sequence number
_CHUNK = 4 << 20  # bytes per store value (TCPStore refuses values over 8 MiB)
_DONE_KEY = "onedist/hvd-finalized"
_FAILED_COUNT = "onedist/failed-count"  # failures/channel.py's key: stop waiting for ranks that failed


class _StoreWork:
    """A send or receive through the side store; ``wait()`` runs the receive."""

    __slots__ = ("_run",)

    def __init__(self, run: Optional[Callable[[], Any]]) -> None:
        self._run = run

    def wait(self) -> bool:
        if self._run is not None:
            run, self._run = self._run, None
            run()
        return True

    def is_completed(self) -> bool:
        return self._run is None


class StoreMessages(Backend):
    """The side store's part of :class:`~onedist.backends.horovod.HorovodBackend`: point-to-point
    messages, and rank 0 keeping the store until every rank finalised."""

    _store: Any
    _sent: dict[tuple[str, int, int], int]
    _received: dict[tuple[str, int, int], int]

    def _keep_store_for_others(self) -> None:
        """Rank 0 hosts the store: keep it until every rank finalised (a message sent to a rank
        that has not received it yet is still delivered), at most 30 s, less when a rank failed."""
        store = self._store
        try:
            store.add(_DONE_KEY, 1)
            if self.rank != 0:
                return
            deadline = time.monotonic() + _FINALIZE_WAIT_S
            while time.monotonic() < deadline:
                if int(store.add(_DONE_KEY, 0)) >= self.world_size or int(store.add(_FAILED_COUNT, 0)) > 0:
                    return
                time.sleep(0.01)
        except Exception:  # a peer's store connection broke: the job is ending
            return

    # ------------------------------------------------------------------ point to point (side store)
    def _p2p_store(self, func: str) -> Any:
        if self._store is None:
            raise OnedistRuntimeError(
                f"onedist.{func}: Horovod has no point-to-point operations; onedist carries them through the "
                "key-value store it starts with the context, and this context was created outside onedist "
                "(hvd.init()) or has one process\nHINT: let onedist initialise Horovod "
                "(onedist.initialize('horovod')), or use a collective (broadcast / scatter with src=...)"
            )
        return self._store

    def _group_key(self, group: Any) -> str:
        return "w" if group is None else "-".join(map(str, self.group_ranks(group)))

    def send_(self, t: torch.Tensor, dst: int, group: Any, tag: int, async_op: bool) -> Optional[Work]:
        store = self._p2p_store("send")
        gk = self._group_key(group)
        slot = (gk, dst, tag)
        n = self._sent.get(slot, 0)
        self._sent[slot] = n + 1
        key = _P2P_KEY.format(gk, self.rank, dst, tag, n)
        raw = t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        data = memoryview(raw)
        # the store takes values up to 8 MiB: chunks first, then the header that announces them
        for i, start in enumerate(range(0, len(data), _CHUNK)):
            store.set(f"{key}/{i}", bytes(data[start : start + _CHUNK]))
        store.set(key, str(len(data)))
        return _StoreWork(None) if async_op else None

    def recv_(self, t: torch.Tensor, src: Optional[int], group: Any, tag: int, async_op: bool) -> Any:
        store = self._p2p_store("recv")
        gk = self._group_key(group)
        posted: Optional[tuple[str, int]] = None
        if src is not None:  # the message's place in the (src, tag) sequence is taken when posted
            slot = (gk, src, tag)
            n = self._received.get(slot, 0)
            self._received[slot] = n + 1
            posted = (_P2P_KEY.format(gk, src, self.rank, tag, n), src)
        result: list[int] = []

        def receive() -> None:
            key, sender = posted if posted is not None else self._any_source(store, gk, group, tag)
            total = int(store.get(key))
            store.delete_key(key)
            nbytes = t.numel() * t.element_size()
            out = t.reshape(-1).view(torch.uint8) if nbytes == total else None
            for i, start in enumerate(range(0, total, _CHUNK)):
                chunk = store.get(f"{key}/{i}")
                store.delete_key(f"{key}/{i}")
                if out is not None:
                    out[start : start + len(chunk)].copy_(
                        torch.frombuffer(bytearray(chunk), dtype=torch.uint8)
                    )
            if out is None:
                raise OnedistRuntimeError(
                    f"onedist.recv (rank {self.rank}): rank {sender} sent {total} bytes with tag "
                    f"{tag}, but the receive buffer holds {nbytes} ({tuple(t.shape)}, {t.dtype})\n"
                    "HINT: receive into a tensor of the sent shape and dtype"
                )
            result.append(sender)

        if async_op:
            return _StoreWork(receive)
        receive()
        return result[0]

    def _any_source(self, store: Any, gk: str, group: Any, tag: int) -> tuple[str, int]:
        """The next message with ``tag`` from any rank of the group (``recv(src=None)``): poll."""
        peers = [r for r in self.group_ranks(group) if r != self.rank]
        limit = store.timeout.total_seconds()
        start = time.monotonic()
        pause = 0.0005
        while True:
            for peer in peers:
                n = self._received.get((gk, peer, tag), 0)
                key = _P2P_KEY.format(gk, peer, self.rank, tag, n)
                if store.check([key]):
                    self._received[(gk, peer, tag)] = n + 1
                    return key, peer
            if time.monotonic() - start > limit:
                raise OnedistRuntimeError(
                    f"onedist.recv (rank {self.rank}): timed out after {limit:.0f} s waiting for a message "
                    f"with tag {tag} from any of ranks {peers}"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.02)


def start_side_store(hvd: Any, timeout: Optional[timedelta]) -> Any:
    """A TCPStore hosted by rank 0, for failure reports and point-to-point messages.

    One node: on 127.0.0.1 (no port opened to the network). Several: on every interface of rank
    0's host, reached by the name horovodrun used for it (HOROVOD_HOSTNAME). Its address travels
    in one Horovod broadcast.
    """
    import torch.distributed as dist

    from .._net import listen_socket

    _TCPStore: Any = getattr(dist, "TCPStore", None)  # re-exported by torch.distributed without __all__

    rank, size = int(hvd.rank()), int(hvd.size())
    single = int(hvd.local_size()) == size
    store_timeout = timeout or timedelta(minutes=30)
    info = torch.zeros(256, dtype=torch.uint8)
    store = None
    if rank == 0:
        host = _LOOPBACK if single else (os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname())
        sock = listen_socket(_LOOPBACK if single else "", 0)
        port = sock.getsockname()[1]
        store = _TCPStore(
            host,
            port,
            size,
            True,
            timeout=store_timeout,
            wait_for_workers=False,
            master_listen_fd=sock.detach(),
            use_libuv=True,
        )
        text = json.dumps([host, port]).encode()
        info[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    hvd.broadcast_(info, root_rank=0, name="onedist.side-store")
    if rank != 0:
        host, port = json.loads(bytes(info.numpy()).rstrip(b"\0"))
        store = _TCPStore(host, port, size, False, timeout=store_timeout)
    return store
