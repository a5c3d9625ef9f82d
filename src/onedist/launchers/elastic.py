"""Elastic membership for ``onedist run --nnodes MIN:MAX --rdzv-backend c10d``: nodes that leave and
join, through torch's own c10d rendezvous (the protocol torchrun's agents speak).

Each node's launcher holds one of torch's rendezvous handlers
(``torch.distributed.elastic.rendezvous``: :class:`RendezvousParameters` and the ``c10d`` handler,
a ``DynamicRendezvousHandler`` over a ``TCPStore`` that the node named by ``--rdzv-endpoint``
hosts). Before each start of its workers it joins the next round (``next_rendezvous``), as
torchrun's agent does, and learns its node rank and the node count of the round; the workers'
ranks then follow torchrun's agent too (each node's worker count published under
``torchelastic/role_info/<node>``, node 0 writing every node's first rank under
``torchelastic/assigned_ranks/<node>``), so a torchrun node and an ``onedist run`` node can be
nodes of one job. The workers' rendezvous is a fresh store per round on the round's node 0,
whose address and port that node publishes in the round's keys ``MASTER_ADDR`` /
``MASTER_PORT`` (torch's ``RendezvousStoreInfo``; the store torch would otherwise share across
rounds keeps a first round's address on the other nodes, and a node that joins later waits for
keys no node writes again: seen with torch 2.13's own torchrun).

While the workers run, the launcher asks the rendezvous every :data:`POLL_S` whether a node waits to
join (``num_nodes_waiting``); one does: this node's workers are stopped and started again in the
next round, with it. A node that leaves (its launcher killed, its host gone) stops renewing its
keep-alive; the other nodes' workers fail at their next collective with the peer gone, and their
launchers meet again without it once torch's rendezvous has dropped it (``keep_alive_interval`` x
``keep_alive_max_attempt`` seconds, 5 x 3 by default) and ``last_call_timeout`` has passed. Neither
counts as a restart: only a failure of this node's own workers uses one of ``--max-restarts``
(:func:`~.launcher.restart_verdict`). When the workers of every node end well, the nodes wait for
each other (torchrun's exit barrier) and the rendezvous is closed; a node that ends with a
failure closes it too (the other nodes then end at their next round), one stopped by a signal
only leaves.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import time
from collections.abc import Mapping
from typing import Any, Optional

from .._net import rendezvous_port
from .launcher import restart_verdict
from .nodes import AgentsError
from .report import Failure
from .run_spec import RunSpec

__all__ = ["POLL_S", "Membership", "assign_ranks"]

POLL_S = 0.5  # how often a launcher asks the rendezvous whether a node waits to join
#: torch's switch between one store shared by every round (its default) and a port per round
NO_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
EXIT_BARRIER = "torchelastic/agent/terminal_state"  # torchrun's key prefix (agent/server/api.py)
EXIT_BARRIER_S = 300.0  # torchrun's exit_barrier_timeout
_ROLE_INFO = "torchelastic/role_info/"
_ASSIGNED = "torchelastic/assigned_ranks/"


def assign_ranks(store: Any, node: int, nodes: int, role: str, nproc: int) -> tuple[int, int]:
    """This node's first worker rank and the world size of the round, by torchrun's agent's
    protocol (``SimpleElasticAgent._assign_worker_ranks``, its general path): every node writes
    its role and worker count, node 0 reads them all and writes each node's ranks.

    Example:
        >>> from torch.distributed import HashStore
        >>> assign_ranks(HashStore(), 0, 1, "default", 4)
        (0, 4)
    """
    if os.environ.get("TORCH_ELASTIC_WORKER_IDENTICAL", "0") == "1":  # torchrun's fast path
        return node * nproc, nodes * nproc
    store.set(f"{_ROLE_INFO}{node}", json.dumps({"role": role, "rank": node, "local_world_size": nproc}))
    if node == 0:
        infos = [json.loads(b) for b in store.multi_get([f"{_ROLE_INFO}{n}" for n in range(nodes)])]
        total = sum(i["local_world_size"] for i in infos)
        role_sizes: dict[str, int] = {}
        for i in infos:
            role_sizes[i["role"]] = role_sizes.get(i["role"], 0) + i["local_world_size"]
        base, role_base, values = 0, dict.fromkeys(role_sizes, 0), []
        for i in infos:
            values.append(json.dumps([base, total, role_base[i["role"]], role_sizes[i["role"]]]))
            base += i["local_world_size"]
            role_base[i["role"]] += i["local_world_size"]
        store.multi_set([f"{_ASSIGNED}{n}" for n in range(nodes)], values)
    first, world, _, _ = json.loads(store.get(f"{_ASSIGNED}{node}"))
    return int(first), int(world)


class Membership:
    """This node's launcher in an elastic job: ``spec`` as ``onedist run`` checked it (``nnodes``:
    the fewest nodes, ``master_addr``/``master_port``: ``--rdzv-endpoint``, ``run_id``:
    ``--rdzv-id``), ``max_nodes`` the most, ``conf`` torch's rendezvous settings
    (``--rdzv-conf``). Nothing connects before :meth:`begin`."""

    def __init__(self, spec: RunSpec, max_nodes: int, conf: Mapping[str, str]) -> None:
        self.spec, self.max_nodes, self.conf = spec, max_nodes, dict(conf)
        self.handler: Any = None
        self.store: Any = None  # the round's keys (a PrefixStore over the rendezvous store)
        self.nodes: Optional[int] = None  # the node count of the round the workers run in
        self.joining = False  # the workers were stopped for a node that waits to join
        #: blocked in torch's rendezvous or the exit barrier (a signal then ends the wait: see run.py)
        self.waiting = False
        self._next_poll = 0.0

    @property
    def endpoint(self) -> str:
        return f"{self.spec.master_addr}:{self.spec.master_port}"

    def _connect(self) -> None:
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

        try:
            params = RendezvousParameters(
                "c10d", self.endpoint, self.spec.run_id, self.spec.nnodes, self.max_nodes, **self.conf
            )
            # the node whose host name or address is the endpoint's hosts the store, as in torchrun
            self.handler = get_rendezvous_handler(params)
        except Exception as e:
            raise AgentsError(
                f"the c10d rendezvous at {self.endpoint} (--rdzv-endpoint) could not be joined "
                f"({type(e).__name__}: {e})\nHINT: start the node that --rdzv-endpoint names, give every "
                "node the same --rdzv-endpoint and --rdzv-id, and check --rdzv-conf"
            ) from e

    def begin(self) -> tuple[RunSpec, int, Optional[socket.socket]]:
        """Join the next round (waiting for at least ``nnodes`` nodes, ``last_call_timeout`` for
        more): this node's spec in it (node rank, node count, node 0's address), the workers'
        port and, on the round's node 0, the socket bound on it for their store."""
        from torch.distributed.elastic.rendezvous import RendezvousClosedError

        if self.handler is None:
            self._connect()
        previous = os.environ.get(NO_SHARED_STORE)
        os.environ[NO_SHARED_STORE] = "1"  # a port per round (see the module); set back below
        self.waiting = True
        try:
            info = self.handler.next_rendezvous()
        except AgentsError:  # a signal while waiting (run.py's handler)
            raise
        except RendezvousClosedError:
            raise AgentsError(
                f"the job's c10d rendezvous (--rdzv-id {self.spec.run_id}) is closed: the job ended, or "
                "another node ended it with a failure"
            ) from None
        except Exception as e:
            raise AgentsError(
                f"the c10d rendezvous at {self.endpoint} failed ({type(e).__name__}: {e})\nHINT: "
                f"at least {self.spec.nnodes} nodes (--nnodes MIN) must join within join_timeout "
                "(--rdzv-conf, 600 s by default)"
            ) from e
        finally:
            self.waiting = False
            if previous is None:
                os.environ.pop(NO_SHARED_STORE, None)
            else:
                os.environ[NO_SHARED_STORE] = previous
        self.store, node, nodes = info.store, info.rank, info.world_size
        nproc = self.spec.nproc_per_node
        first, world = assign_ranks(self.store, node, nodes, self.spec.role, nproc)
        if (first, world) != (node * nproc, nodes * nproc):
            raise AgentsError(
                f"the nodes of this elastic job start different numbers of workers (this node "
                f"{nproc}, {world} in all on {nodes} nodes); allowed: the same --nproc-per-node on every node"
            )
        master = info.bootstrap_store_info
        sock = None
        if node == 0:  # the port torch's rendezvous published for this round: bound at once
            try:
                _, sock = rendezvous_port("", master.master_port, host_store=True, what="MASTER_PORT")
            except OSError as e:
                raise AgentsError(f"the workers' store port of this round: {e.strerror or e}") from e
        self._say_round(node, nodes, world)
        self.nodes, self.joining = nodes, False
        spec = dataclasses.replace(self.spec, node_rank=node, nnodes=nodes, master_addr=master.master_addr)
        return spec, master.master_port, sock

    def _say_round(self, node: int, nodes: int, world: int) -> None:
        change = "" if self.nodes in (None, nodes) else f" (was {self.nodes})"
        sys.stderr.write(
            f"onedist run: c10d rendezvous '{self.spec.run_id}': {nodes} nodes{change}, this one node "
            f"{node}; world size {world}\n"
        )
        sys.stderr.flush()

    def should_stop(self) -> bool:
        """Whether this node's workers must stop so that a node waiting to join can (asked every
        :data:`POLL_S` while the workers run)."""
        now = time.monotonic()
        if self.joining or now < self._next_poll:
            return self.joining
        self._next_poll = now + POLL_S
        try:
            waiting = self.handler.num_nodes_waiting()
        except Exception as e:
            raise AgentsError(
                f"the c10d rendezvous at {self.endpoint} went away while the workers ran "
                f"({type(e).__name__}: {e}): the node that hosts it ended; the job ends"
            ) from e
        if waiting:
            sys.stderr.write(f"onedist run: {waiting} node(s) wait to join: the workers restart with them\n")
            self.joining = True
        return self.joining

    def verdict(
        self, failures: list[Failure], code: int, signalled: bool, restarts: tuple[int, int]
    ) -> tuple[str, bool]:
        """After the workers ended (exit status ``code``): "done", "restart" or "end", and whether
        the restart is one of ``--max-restarts`` (``restarts``: those used, the most). A restart
        for a node that joins, or after failures that were only consequences of another node's
        (a peer gone, a remote rank's error), is not counted; the job's end is carried out here
        (the exit barrier after a success, the rendezvous closed unless a signal ended it)."""
        own = code != 0 and not all(f.secondary for f in failures)
        rejoin = self.joining or (code != 0 and not own)
        used, most = restarts
        action = restart_verdict(used, most, failed=own, signalled=signalled, rejoin=rejoin)
        if action == "restart":
            why = "a worker failed" if own else "a node joins" if self.joining else "a node left or failed"
            counted = f"restart {used + 1} of {most}" if own else "not counted in --max-restarts"
            sys.stderr.write(f"onedist run: {why}: the workers restart in the next round ({counted})\n")
        elif action == "done":
            self._exit_barrier()
        if action != "restart" and not signalled:
            self._close()
        return action, own and action == "restart"

    def _exit_barrier(self) -> None:
        """Wait for every node of the round to end well (torchrun's exit barrier)."""
        from torch.distributed.elastic.utils.store import barrier

        self.waiting = True
        try:
            barrier(self.store, self.nodes or 1, key_prefix=EXIT_BARRIER, barrier_timeout=EXIT_BARRIER_S)
        except AgentsError:  # a signal while waiting
            raise
        except Exception as e:  # as torchrun: the node's own result stands
            sys.stderr.write(f"onedist run: the other nodes did not end in {EXIT_BARRIER_S:.0f} s ({e})\n")
        finally:
            self.waiting = False

    def _close(self) -> None:
        try:
            self.handler.shutdown()
        except Exception:
            pass

    def close(self) -> None:
        """Leave the rendezvous' objects (its keep-alive timer holds the handler weakly and ends
        with it; the rendezvous stays open for the other nodes unless :meth:`verdict` closed it)."""
        self.handler = self.store = None
