"""Restarts agreed between the launchers of several nodes (``onedist run --nnodes N --max-restarts K``).

Node 0's launcher hosts a small store for the whole job (a ``TCPStore`` on ``--master-port``)
that every node's launcher joins; the workers' own rendezvous moves to a fresh port per attempt,
which node 0 binds and publishes, so no key of a failed attempt reaches the next (as on one node).
Each attempt, through that store:

1. every launcher arrives at ``arrived/<a>`` (a barrier: no node starts attempt ``a`` while
   another still runs attempt ``a - 1``) and reads the attempt's port;
2. while its workers run, a launcher whose worker failed, or that got SIGINT/SIGTERM, sets
   ``stop/<a>``; every launcher polls it and stops its own workers;
3. each launcher writes what happened on its node (``result/<a>/<node>``: its failures, a signal)
   and waits for every node's; all then take the same decision from the same records: every node
   succeeded (done), a worker failed and restarts are left (restart), or the job ends.

Each launcher also bumps ``beat/<node>`` every :data:`BEAT_S` from a thread of its own: a node whose
counter stopped for :data:`LOST_S` (its launcher was killed, its host is gone) ends the job on
every other node with a message naming it, instead of a wait without end. A node whose launcher
hosts the store (node 0) going away is seen at once: the store's connection fails.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Optional

from .._net import rendezvous_port
from .arguments import AGREED, ARGUMENTS
from .launcher import restart_verdict
from .report import Failure

__all__ = ["BEAT_S", "LOST_S", "Agents", "AgentsError", "Verdict"]

BEAT_S = 0.5  # how often each launcher says it is alive
LOST_S = 5.0  # a launcher silent this long is gone (a stop of workers takes at most 3 s: no false alarm)
POLL_S = 0.1  # how often a launcher reads the store while it waits or its workers run
OP_TIMEOUT = timedelta(seconds=10)  # one store operation, once every node joined
_PREFIX = "onedist-agents/"
_TRACEBACK_CHARS = 4000  # of each failure's traceback sent to the other nodes


class AgentsError(RuntimeError):
    """The launchers of the job cannot agree any more (a node went away, different flags)."""


@dataclass
class Verdict:
    """What every node does after an attempt: ``action`` "done", "restart" or "end"; the
    failures of every node (this node's first); ``why`` the job ends, when not for this node's
    own failure (None otherwise)."""

    action: str
    failures: list[Failure] = field(default_factory=list)
    why: Optional[str] = None


def _store(host: str, port: int, timeout: timedelta, listen_fd: Optional[int] = None) -> Any:
    import torch.distributed as dist

    tcp_store: Any = dist.TCPStore  # type: ignore[attr-defined]  # re-exported without __all__
    if listen_fd is None:
        return tcp_store(host, port, None, False, timeout=timeout, use_libuv=True)
    return tcp_store(host, port, None, True, timeout=timeout, wait_for_workers=False,
                     master_listen_fd=listen_fd, use_libuv=True)  # fmt: skip


class Agents:
    """This node's launcher among the job's launchers (see the module's docstring).

    Node 0 binds ``master_port`` and serves the store; the others connect to it, waiting up to
    ``join_timeout`` seconds for node 0 to start. Raises :class:`AgentsError` when the nodes were
    given different ``--nnodes`` or ``--max-restarts``, or the port is taken on node 0.
    """

    def __init__(
        self,
        master_addr: str,
        master_port: int,
        node_rank: int,
        nnodes: int,
        max_restarts: int,
        run_id: str,
        join_timeout: float = 600.0,
    ) -> None:
        self.addr, self.port = master_addr, master_port
        self.node_rank, self.nnodes, self.max_restarts = node_rank, nnodes, max_restarts
        self._seen: dict[int, tuple[int, float]] = {}  # node -> (its beat counter, when it changed)
        self._next_poll = 0.0
        self._stopped = False  # this node asked every node to stop this attempt
        self._closing = threading.Event()
        where = f"the launchers' store at {master_addr}:{master_port} (--master-addr:--master-port)"
        timeout = timedelta(seconds=join_timeout)
        if node_rank == 0:
            try:
                _, sock = rendezvous_port(master_addr, master_port, host_store=True, what="--master-port")
            except OSError as e:
                raise AgentsError(e.strerror or str(e)) from e
            assert sock is not None  # host_store=True always binds
            self._server = _store(master_addr, master_port, timeout, sock.detach())
            self.store = _store(master_addr, master_port, timeout)
            self.store.set(_PREFIX + "config", json.dumps(self._config(run_id)))
        else:
            self._server = None
            try:
                self.store = _store(master_addr, master_port, timeout)
                config = json.loads(self.store.get(_PREFIX + "config"))
            except Exception as e:
                raise AgentsError(
                    f"node {node_rank} could not reach {where} within {join_timeout:.0f} s ({e})\n"
                    "HINT: start node 0's `onedist run` too, with the same --master-addr/--master-port"
                ) from e
            self.run_id: str = config["run_id"]
        self.store.set_timeout(OP_TIMEOUT)
        # a request to a store whose server is gone makes torch print a C++ stack trace: ask this
        # idle connection first
        from ..failures.channel import ServerProbe  # here: failures imports torch (see run.py)

        self._probe = ServerProbe(self.store)
        if node_rank != 0:
            try:
                self._check_config(config)
            except AgentsError as e:
                self.abort(e)  # node 0 waits for this node: tell it why it will not come
                raise
        self._beat_store = _store(master_addr, master_port, OP_TIMEOUT)
        self._beats = threading.Thread(target=self._beat, name="onedist-agent-beat", daemon=True)
        self._beats.start()

    def _config(self, run_id: str) -> dict[str, Any]:
        self.run_id = run_id
        return {**{flag: getattr(self, flag) for flag in AGREED}, "run_id": run_id}

    def _check_config(self, config: dict[str, Any]) -> None:
        for flag in AGREED:
            mine = getattr(self, flag)
            if config[flag] != mine:
                name = ARGUMENTS[flag].flag
                raise AgentsError(
                    f"{name}={mine} on node {self.node_rank} differs from node 0's {name}={config[flag]}; "
                    f"allowed: the same {name} on every node"
                )

    def _beat(self) -> None:
        key = f"{_PREFIX}beat/{self.node_rank}"
        while not self._closing.wait(BEAT_S):
            try:
                if self._probe.gone():
                    return  # node 0 went away: the main thread reports it
                self._beat_store.add(key, 1)
            except Exception:
                return

    # ------------------------------------------------------------------ the store, with a watch on peers
    def _call(self, what: str, op: str, *args: Any) -> Any:
        error: Optional[Exception] = None
        if not self._probe.gone():
            try:
                return getattr(self.store, op)(*args)
            except Exception as e:
                error = e
        raise AgentsError(
            f"node 0's launcher, which hosts the launchers' store at {self.addr}:{self.port}, went "
            f"away while this node {what}{f' ({type(error).__name__}: {error})' if error else ''}; "
            "the job ends"
        ) from error

    def _check_peers(self, what: str) -> None:
        """Raise :class:`AgentsError` when a node's launcher has been silent for :data:`LOST_S`."""
        now = time.monotonic()
        for node in range(self.nnodes):
            if node == self.node_rank:
                continue
            beat = int(self._call(what, "add", f"{_PREFIX}beat/{node}", 0))
            last = self._seen.get(node)
            if last is None or last[0] != beat:
                self._seen[node] = (beat, now)
            elif beat > 0 and now - last[1] > LOST_S:  # 0: not started yet (the join timeout applies)
                raise AgentsError(
                    f"node {node}'s launcher has not answered for {now - last[1]:.0f} s while this node "
                    f"{what}: it was killed or its host is gone; the job ends"
                )

    def _check_abort(self, what: str) -> None:
        """Raise the error of a node that gave up (:meth:`abort`)."""
        if self._call(what, "check", [_PREFIX + "abort"]):
            raise AgentsError(self._call(what, "get", _PREFIX + "abort").decode())

    def abort(self, error: AgentsError) -> None:
        """Tell the other nodes' launchers that this one gives up, and why (best effort)."""
        try:
            if not self._probe.gone():
                self.store.compare_set(_PREFIX + "abort", "", f"node {self.node_rank}: {error}")
        except Exception:
            pass

    def _wait_for(self, keys: list[str], what: str, timeout: Optional[float] = None) -> bool:
        """Wait until every key exists (peers watched); False when ``timeout`` passed first."""
        start = time.monotonic()
        while not self._call(what, "check", keys):
            self._check_abort(what)
            self._check_peers(what)
            if timeout is not None and time.monotonic() - start > timeout:
                return False
            time.sleep(POLL_S)
        return True

    # ------------------------------------------------------------------ one attempt
    def begin(self, attempt: int, port: Optional[int]) -> int:
        """Publish (node 0: ``port``, bound already) or read the workers' port of ``attempt``,
        after every node arrived; the port."""
        what = f"waited for every node to start attempt {attempt}"
        key = f"{_PREFIX}port/{attempt}"
        if port is not None:
            self._call(what, "set", key, str(port))
        self._call(what, "set", f"{_PREFIX}arrived/{attempt}/{self.node_rank}", "1")
        self._wait_for([f"{_PREFIX}arrived/{attempt}/{n}" for n in range(self.nnodes)], what)
        self._stopped = False
        return int(self._call(what, "get", key))

    def should_stop(self, attempt: int, failed_here: bool, signalled: bool) -> bool:
        """Whether this node's workers must stop: another node asked. A failure or a signal here
        asks every node (called often while the workers run; reads the store every POLL_S)."""
        what = f"ran attempt {attempt}"
        key = f"{_PREFIX}stop/{attempt}"
        if (failed_here or signalled) and not self._stopped:
            self._stopped = True
            self._call(what, "set", key, str(self.node_rank))
        now = time.monotonic()
        if now < self._next_poll:
            return False
        self._next_poll = now + POLL_S
        self._check_abort(what)
        self._check_peers(what)
        return not self._stopped and bool(self._call(what, "check", [key]))

    def verdict(self, attempt: int, failures: list[Failure], signum: Optional[int]) -> Verdict:
        """Tell the other nodes how this node's attempt ended (``signum``: the signal this launcher
        got), wait for theirs, and decide."""
        what = f"waited for the other nodes to end attempt {attempt}"
        self.should_stop(attempt, bool(failures), signum is not None)
        mine = {"failures": [_failure_record(f) for f in failures], "signal": signum}
        self._call(what, "set", f"{_PREFIX}result/{attempt}/{self.node_rank}", json.dumps(mine))
        keys = [f"{_PREFIX}result/{attempt}/{n}" for n in range(self.nnodes)]
        self._wait_for(keys, what)
        results = [json.loads(self._call(what, "get", k)) for k in keys]
        self._call(what, "set", f"{_PREFIX}read/{attempt}/{self.node_rank}", "1")
        verdict = self._decide(attempt, results)
        if verdict.action != "restart" and self.node_rank == 0:
            # the store goes with this launcher: let the others read the results first (a node
            # gone meanwhile changes nothing: the verdict is taken)
            try:
                self._wait_for([f"{_PREFIX}read/{attempt}/{n}" for n in range(self.nnodes)], what, LOST_S)
            except AgentsError:
                pass
        return verdict

    def _decide(self, attempt: int, results: list[dict[str, Any]]) -> Verdict:
        """The same decision on every node, from every node's record of ``attempt``."""
        order = [self.node_rank, *(n for n in range(self.nnodes) if n != self.node_rank)]
        nodes = [(n, _failure_of(r)) for n in order for r in results[n]["failures"]]
        failures = [f for _, f in nodes]
        signalled = [(n, r["signal"]) for n, r in enumerate(results) if r["signal"] is not None]
        failed = not all(f.stopped for f in failures)  # a worker's own failure, on some node
        action = restart_verdict(attempt, self.max_restarts, failed=failed, signalled=bool(signalled))
        if signalled:  # Ctrl-C or SIGTERM to one launcher ends the job, as on one node
            node, signum = signalled[0]
            name = signal.Signals(signum).name
            why = f"onedist run: node {node}'s launcher was stopped by {name}; the job ends, no restart\n"
            return Verdict(action, failures, None if node == self.node_rank else why)
        if action != "end":
            return Verdict(action, failures)
        causes = [nf for nf in nodes if not nf[1].secondary] or [nf for nf in nodes if not nf[1].stopped]
        node, cause = causes[0]
        why = (
            f"onedist run: on node {node}, {cause.headline()}; no restart is left ({self.max_restarts} "
            f"of {self.max_restarts} made): the job ends\n"
        )
        return Verdict("end", failures, None if node == self.node_rank else why)

    def close(self) -> None:
        """Stop the heartbeat and leave the store (node 0: stop serving it)."""
        self._closing.set()
        self._beats.join(timeout=2 * BEAT_S)
        self._probe.close()
        self._beat_store = self.store = self._server = None


def _failure_record(f: Failure) -> dict[str, Any]:
    record = asdict(f)
    if f.traceback:
        record["traceback"] = f.traceback[-_TRACEBACK_CHARS:]
    return record


def _failure_of(record: dict[str, Any]) -> Failure:
    return Failure(**record)
