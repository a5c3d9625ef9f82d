"""A shm group whose ranks are on several hosts: shared memory within each host, gloo across.

Each host's ranks get a shm group of their own, and the first rank of each host joins the other
hosts' first ranks in a gloo group; all_reduce, broadcast and barrier go through both levels.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch._C._distributed_c10d as _c10d
import torch.distributed as dist

from .._pygroup import OrderedGroup, averages, flat as _flat
from .protocol import ShmError

logger = logging.getLogger("onedist")


def _host_id() -> str:
    """This host's identity: hostname and boot id (two containers on one kernel share memory).

    ``ONEDIST_SHM_HOST`` replaces it: containers that share memory but not a hostname can say so,
    and tests split one machine into "hosts" with it.
    """
    given = os.environ.get("ONEDIST_SHM_HOST")
    if given:
        return given
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def ranks_by_host(store: Any, rank: int, size: int) -> list[list[int]]:
    """The group's ranks by host, hosts in the order of their first rank."""
    store.set(f"onedist-shm/host/{rank}", _host_id())
    ids = [store.get(f"onedist-shm/host/{r}").decode() for r in range(size)]
    hosts: dict[str, list[int]] = {}
    for r, host in enumerate(ids):
        hosts.setdefault(host, []).append(r)
    return list(hosts.values())


class TwoLevels(OrderedGroup):
    """The levels of :class:`~.group.ShmProcessGroup` over several hosts (set up by ``_hierarchy``
    from its ``__init__``; ``_local`` and ``_leaders`` stay None on one host)."""

    _rank: int
    _size: int
    _local: Any
    _leaders: Any
    _hosts: list[list[int]]

    def _hierarchy(self, store: Any, hosts: list[list[int]], timeout: timedelta) -> None:
        """Two levels for a group over several hosts: shm among each host's ranks, gloo among one
        rank per host. all_reduce, broadcast and barrier go through both; the rest goes to gloo."""
        self._hosts = hosts
        index = next(i for i, h in enumerate(hosts) if self._rank in h)
        mine = hosts[index]
        if len(mine) > 1:
            local_store = _c10d.PrefixStore(f"onedist-shm/host-{index}", store)
            group: Any = type(self)  # ShmProcessGroup, which builds on this class
            self._local = group(local_store, mine.index(self._rank), len(mine), timeout)
            self._local._shown_as = mine
        if self._rank == mine[0]:
            leader_store = _c10d.PrefixStore("onedist-shm/leaders", store)
            self._leaders = dist.ProcessGroupGloo(leader_store, index, len(hosts), timeout)
        logger.info(
            "onedist shm: the group spans %d hosts; shared memory within each, gloo across (this host: "
            "group ranks %s)",
            len(hosts),
            mine,
        )

    @property
    def _hierarchical(self) -> bool:
        return bool(self._hosts)

    def _in_local(self, method: Callable[..., Any], *args: Any) -> None:
        """One step on this host's shm group (a failure marks its segment for the host's peers)."""
        if self._local is not None:
            try:
                self._local._poisoning(method.__get__(self._local), *args)
            except ShmError as e:
                if e.culprit is not None:  # the host group's rank, as a rank of this group
                    e.culprit = self._hosts[self._host_of(self._rank)][e.culprit]
                raise

    def _host_of(self, rank: int) -> int:
        return next(i for i, h in enumerate(self._hosts) if rank in h)

    def _hier_all_reduce(self, t: torch.Tensor, op: Any) -> None:
        """Reduce to each host's first rank over shm, all_reduce among those over gloo, then
        broadcast back over shm: every rank gets the same bits."""
        flat, writeback = _flat(t)
        if flat.numel() == 0:  # the host's ranks still meet (see _all_reduce_one); nothing crosses hosts
            self._in_local(type(self)._all_reduce_one, flat, op, None)
            return
        average = averages(op)
        if average:  # summed through both levels, divided by the whole group's size at the end
            op = dist.ReduceOp.SUM
        self._in_local(type(self)._all_reduce_one, flat, op, 0)
        if self._leaders is not None:
            opts = _c10d.AllreduceOptions()
            opts.reduceOp = op
            self._leaders.allreduce([flat], opts).wait()
        self._in_local(type(self)._broadcast_one, flat, 0)
        if average:
            flat.div_(self._size)
        if writeback:
            t.copy_(flat.view(t.shape))

    def _hier_broadcast(self, t: torch.Tensor, root: int) -> None:
        flat, writeback = _flat(t)
        if flat.numel() == 0:  # the host's ranks still meet (see _phases); nothing crosses hosts
            self._in_local(type(self)._broadcast_one, flat, 0)
            return
        source_host = self._host_of(root)
        home = source_host == self._host_of(self._rank)
        if home:  # the root's host first: its first rank then holds the data
            self._in_local(type(self)._broadcast_one, flat, self._hosts[source_host].index(root))
        if self._leaders is not None:
            opts = _c10d.BroadcastOptions()
            opts.rootRank = source_host
            self._leaders.broadcast([flat], opts).wait()
        if not home:
            self._in_local(type(self)._broadcast_one, flat, 0)
        if writeback and self._rank != root:
            t.copy_(flat.view(t.shape))

    def _hier_barrier(self) -> None:
        self._in_local(type(self)._barrier_call)
        if self._leaders is not None:
            self._leaders.barrier(_c10d.BarrierOptions()).wait()
        self._in_local(type(self)._barrier_call)
