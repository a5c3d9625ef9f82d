"""The ``env://`` rendezvous of the torch.distributed backends (gloo, nccl, shm, mpi).

What ``initialize`` needs from the environment before ``init_process_group``: the variables a
launcher left (translated from srun / mpirun / horovodrun / jsrun, or a group of one), the
rendezvous store made here so that rank 0 controls where it listens, and the wait for every rank
to join it, naming the ones missing.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from dataclasses import replace
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from .._net import (
    LOOPBACK,
    STORE_FD_ENV,
    free_port,
    is_loopback,
    listen_socket,
    loopback_ifname,
    rendezvous_port,
    tcp_init_would_hang,
)
from ..environments import ClusterEnv, detect_cluster, pod_start_problem
from ..errors import (
    OnedistRuntimeError,
    OnedistTimeoutError,
    OnedistValueError,
    RemoteRankError,
    call_site,
    user_frame,
)
from ._environ import set_env

logger = logging.getLogger("onedist")

_TCPStore: Any = getattr(dist, "TCPStore", None)  # torch.distributed re-exports it without __all__

#: set on an error that no peer should wait to hear of: rank 0's store went away, or RANK and
#: WORLD_SIZE are not this process's (a pod that needed a launcher: every pod finds it alike)
_NOBODY_TO_TELL = "_onedist_nobody_to_tell"


def prepare_env_rendezvous(
    rank: Optional[int], world_size: Optional[int], env_set: dict[str, Optional[str]]
) -> None:
    """Check (and complete) what ``env://`` needs from the environment.

    torchrun sets every variable. Under srun / mpirun / horovodrun / jsrun the launcher's own
    variables are translated (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, ...). A
    process no launcher started becomes a group of one on 127.0.0.1 and a free port.
    """
    env = os.environ
    problem = pod_start_problem(env) if rank is None and world_size is None else None
    if problem is not None:  # a pod that needed torchrun / onedist run: it would hang or train alone
        error = OnedistValueError(f"onedist.initialize: {problem}")
        setattr(error, _NOBODY_TO_TELL, True)  # its RANK and WORLD_SIZE are not ranks
        raise error
    if rank is None and world_size is None and "RANK" not in env and "WORLD_SIZE" not in env:
        cluster = detect_cluster(env)
        if cluster is not None:
            cluster = _agree_master(cluster)
            if cluster.master_addr is None:
                raise _no_master_error(cluster)
            for name, value in cluster.rendezvous_env().items():
                if name not in env:
                    set_env(name, value, env_set)
        else:
            # a plain `python script.py`: a group of one process, as ignite does
            set_env("RANK", "0", env_set)
            set_env("WORLD_SIZE", "1", env_set)
            if "LOCAL_RANK" not in env:
                set_env("LOCAL_RANK", "0", env_set)
    env_rank = rank if rank is not None else env.get("RANK")
    env_world = world_size if world_size is not None else env.get("WORLD_SIZE")
    if env_rank is None or env_world is None:
        missing = "RANK" if env_rank is None else "WORLD_SIZE"
        raise OnedistValueError(
            f"onedist.initialize: init_method='env://' needs both RANK and WORLD_SIZE; {missing} is "
            "not set (neither in the environment nor as an argument)\n"
            "HINT: start the script with torchrun / onedist run / srun / mpirun, or pass rank= and "
            "world_size="
        )
    single = str(env_world) == "1"
    for name, default in (("MASTER_ADDR", LOOPBACK), ("MASTER_PORT", None)):
        if name not in env:
            if not single:
                _ignite_default(name, env_world, env_set)
                continue
            if name == "MASTER_PORT" and str(env.get("RANK", rank)) == "0":
                # a group of one: hold the port from now on (no window for another program)
                sock = listen_socket(LOOPBACK, 0)
                set_env(name, str(sock.getsockname()[1]), env_set)
                env[STORE_FD_ENV] = str(sock.detach())
            else:
                set_env(name, default or str(free_port()), env_set)


def _no_master_error(cluster: ClusterEnv) -> OnedistValueError:
    """A launcher's environment that does not say where rank 0 runs (MPI over several nodes, or
    PMI variables without the local layout): what to pass instead."""
    several = (cluster.nnodes or 1) > 1 or (cluster.nproc_per_node or cluster.world_size) < cluster.world_size
    return OnedistValueError(
        f"onedist.initialize: the {cluster.name} environment (rank {cluster.rank} of {cluster.world_size}"
        f"{', over several nodes' if several else ''}) does not say where rank 0 runs, so the "
        "rendezvous address is unknown\n"
        "HINT: pass it to every rank, e.g. `mpirun -x MASTER_ADDR=<host of rank 0> "
        "-x MASTER_PORT=<port> ...`, or install mpi4py (onedist then asks rank 0)"
    )


def rank_world_from_env(rank: Optional[int], world_size: Optional[int]) -> tuple[int, int]:
    """``rank``/``world_size`` for a tcp:// or file:// rendezvous: as given, else what the
    launcher that started this process says, else a group of one (as in ignite)."""
    cluster = detect_cluster(os.environ)
    if rank is None:
        rank = cluster.rank if cluster is not None else 0
    if world_size is None:
        world_size = cluster.world_size if cluster is not None else 1
    return rank, world_size


def check_tcp_host(init_method: str) -> None:
    """Rank 0 hosts a tcp:// rendezvous: another machine's address would leave every rank
    connecting there until the timeout, so refuse it now (ignite refuses every tcp://)."""
    if tcp_init_would_hang(init_method):
        raise OnedistValueError(
            f"onedist.initialize: TCP initialization via init_method='{init_method}' will hang: rank 0 "
            "hosts the rendezvous, and that host is not an address of this machine. To fix this, please "
            "configure MASTER_ADDR and MASTER_PORT in the environment and use 'env://' (or omit "
            "init_method), or give an address of rank 0's machine"
        )


# what ignite.distributed puts in the environment when several processes name no rendezvous
_IGNITE_RENDEZVOUS = {"MASTER_ADDR": LOOPBACK, "MASTER_PORT": "15000"}


def _ignite_default(name: str, env_world: Any, env_set: dict[str, Optional[str]]) -> None:
    """Several processes and no ``name``: ignite's default (127.0.0.1:15000), which every process
    of one host computes alike, unless the environment says the job spans several nodes."""
    nnodes = _nnodes_from_env(os.environ)
    if nnodes is not None and nnodes > 1:
        raise OnedistValueError(
            f"onedist.initialize: init_method='env://' with world size {env_world} over {nnodes} nodes "
            f"needs {name} in the environment; it is not set\n"
            "HINT: export MASTER_ADDR=<host of rank 0> MASTER_PORT=<free port>, or use "
            "init_method='tcp://host:port' / 'file:///shared/path'"
        )
    set_env(name, _IGNITE_RENDEZVOUS[name], env_set)


def _nnodes_from_env(env: Any) -> Optional[int]:
    cluster = detect_cluster(env)
    if cluster is None:
        return None
    if cluster.nnodes is not None:
        return cluster.nnodes
    if cluster.nproc_per_node:
        return -(-cluster.world_size // cluster.nproc_per_node)
    return None


def env_store(
    backend: str,
    timeout: Optional[timedelta],
    rank: Optional[int],
    world_size: Optional[int],
    env_set: dict[str, Optional[str]],
) -> tuple[Any, Optional[int], Optional[int]]:
    """The rendezvous store of ``env://``, made here so that rank 0 controls where it listens.

    torch's own ``env://`` store listens on every interface. Here rank 0 listens on MASTER_ADDR
    itself when that is a loopback address (a one-host job opens no port to the network; gloo is
    pinned to the loopback interface too, unless GLOO_SOCKET_IFNAME says otherwise), on every
    interface otherwise, or on the socket a onedist launcher bound already and handed over in
    ``ONEDIST_STORE_FD`` (no window in which another program can take the port). A port in use
    is reported with the fix. Under an agent store (TORCHELASTIC_USE_AGENT_STORE: torchrun's and
    ``onedist run``'s launcher hosts it) every rank connects to it, as torch's own path does.
    """
    env = os.environ
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() in ("1", "true")
    rank = int(env["RANK"]) if rank is None else rank
    world_size = int(env["WORLD_SIZE"]) if world_size is None else world_size
    addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    loopback = is_loopback(addr)
    # gloo, and the gloo groups beside shm and nccl (objects, CPU tensors), bind through gloo too
    uses_gloo = "gloo" in backend or backend in ("shm", "nccl")
    if loopback and uses_gloo and "GLOO_SOCKET_IFNAME" not in env:
        ifname = loopback_ifname()
        if ifname is not None:
            set_env("GLOO_SOCKET_IFNAME", ifname, env_set)
    fd_text = env.pop(STORE_FD_ENV, None)
    store_timeout = timeout or dist.default_pg_timeout
    if rank != 0 or agent_store:
        host = "the launcher's store on node 0" if agent_store else "rank 0"
        try:
            store = _TCPStore(addr, port, world_size, False, timeout=store_timeout)
        except (RuntimeError, OSError) as e:
            raise OnedistTimeoutError(
                f"onedist.initialize (rank {rank} of {world_size}): the rendezvous host, {host} at "
                f"{addr}:{port} (MASTER_ADDR:MASTER_PORT), did not answer within "
                f"{store_timeout.total_seconds():.0f} s ({e}).\nHINT: check that {host} started, that every "
                "rank was given the same MASTER_ADDR and MASTER_PORT, and that this host reaches it "
                "(`onedist info` tests the route)"
            ) from e
    else:
        if fd_text is not None:
            fd = int(fd_text)
        else:
            try:
                _, sock = rendezvous_port(addr, port, host_store=True, what="MASTER_PORT")
                assert sock is not None  # host_store=True always binds
                fd = sock.detach()
            except OSError as e:
                raise OnedistRuntimeError(f"onedist.initialize (rank 0): {e.strerror or e}") from e
        store = _TCPStore(
            addr,
            port,
            world_size,
            True,
            timeout=store_timeout,
            wait_for_workers=False,
            master_listen_fd=fd,
            use_libuv=True,
        )
    try:
        _join(store, rank, world_size, store_timeout)
    except Exception as e:
        # rank 0's store was up: one that no longer listens when this failure is announced went
        # away and will not come back, so announce_init_failure does not wait for it
        setattr(e, _STORE_REACHED, True)
        raise
    # the same key prefix torch's env:// path adds, so groups made either way look alike
    return dist.distributed_c10d.PrefixStore("default_pg", store), rank, world_size


_JOIN_KEY = "onedist/joined/{}"
_JOIN_LOG_S = 30.0
_JOIN_POLL_S = 0.5  # how often a joining rank asks whether a peer failed in initialize
_FAILED_KEY = "onedist/init-failed/{}"
_FAILED_COUNT = "onedist/init-failed-count"
_READ_KEY = "onedist/init-failed-read/{}"
#: set on an error raised after this rank reached rank 0's store (see announce_init_failure)
_STORE_REACHED = "_onedist_rendezvous_store_reached"
_REACHED_CONNECT_S = 1.0  # how long a rank that reached the store before tries to reach it again
_HOLD_S = 10.0  # how long a failed rank 0 hosts the store for its peers to read why
# how long a failed rank tries to reach rank 0's store: as long as rank 0 holds it, because rank 0
# may come up seconds later (its imports lag on a loaded machine); at 3 s, a healthy rank 0 that
# came 4 s late never heard of the failure and waited for the whole rendezvous timeout
_ANNOUNCE_CONNECT_S = _HOLD_S


def _join(store: Any, rank: int, world_size: int, timeout: timedelta) -> None:
    """Wait until every rank reached the store; say which ranks are missing while waiting, and at the end.

    torch's own wait says "1/4 clients joined" after the full timeout; this names the ranks, logs
    them every 30 s, and raises :class:`OnedistTimeoutError` with them. A rank that failed in
    ``initialize`` before it joined says so in the store (:func:`announce_init_failure`): the
    others raise its error as a :class:`~onedist.RemoteRankError` within a second.
    """
    store.set(_JOIN_KEY.format(rank), "1")
    keys = [_JOIN_KEY.format(r) for r in range(world_size)]
    start = last_log = time.monotonic()
    pause = 0.005
    # polled with check(), not wait(): each wait that times out makes torch print two warnings
    while not _joined(store, keys, rank, world_size):
        waited = time.monotonic() - start
        if waited >= timeout.total_seconds():
            missing = _missing(store, keys, rank, world_size)
            raise OnedistTimeoutError(
                f"onedist.initialize (rank {rank} of {world_size}): ranks {missing} did not join the "
                f"rendezvous within {waited:.0f} s.\nHINT: check that they were started (a launcher that "
                "failed on some node), and that WORLD_SIZE is the number of processes actually started"
            )
        if time.monotonic() - last_log >= _JOIN_LOG_S:
            last_log = time.monotonic()
            missing = _missing(store, keys, rank, world_size)
            logger.warning(
                "onedist.initialize: rank %d has waited %.0f s for ranks %s to join the rendezvous",
                rank,
                waited,
                missing,
            )
        time.sleep(pause)
        pause = min(pause * 2, _JOIN_POLL_S)


def _joined(store: Any, keys: list[str], rank: int, world_size: int) -> bool:
    """Whether every rank joined; raises the error of a rank that failed in initialize instead."""
    try:
        if store.check(keys):
            return True
        failed = int(store.add(_FAILED_COUNT, 0))
    except Exception as e:
        raise _host_gone(rank, world_size, e) from e
    if failed:
        raise _peer_failure(store, rank, world_size)
    return False


def _missing(store: Any, keys: list[str], rank: int, world_size: int) -> list[int]:
    """The ranks that have not joined yet."""
    try:
        return [r for r, k in enumerate(keys) if not store.check([k])]
    except Exception as e:
        raise _host_gone(rank, world_size, e) from e


def _host_gone(rank: int, world_size: int, e: Exception) -> OnedistRuntimeError:
    """The error of a rank whose rendezvous host stopped answering while it waited to join."""
    gone = OnedistRuntimeError(
        f"onedist.initialize (rank {rank} of {world_size}): the rendezvous host (rank 0) went "
        f"away while this rank waited for the others to join ({e}).\nHINT: look at rank 0's "
        "output: it failed or timed out first"
    )
    setattr(gone, _NOBODY_TO_TELL, True)  # announce_init_failure returns at once
    return gone


def _peer_failure(store: Any, rank: int, world_size: int) -> RemoteRankError:
    """The error of the first rank that announced its failure in initialize (its receipt given)."""
    for r in range(world_size):
        key = _FAILED_KEY.format(r)
        if r != rank and store.check([key]):
            report = json.loads(store.get(key))
            store.set(_READ_KEY.format(rank), "1")
            return RemoteRankError(
                f"onedist.initialize (rank {rank} of {world_size}): rank {r} failed in initialize, so the "
                f"group cannot form. Its error, at {report['site']}:\n{report['type']}: {report['message']}",
                r,
            )
    return RemoteRankError(
        f"onedist.initialize (rank {rank} of {world_size}): a rank failed in initialize", -1
    )


def announce_init_failure(exc: BaseException) -> None:
    """Tell the ranks waiting for this one in the ``env://`` rendezvous that it failed in initialize.

    Without this, a peer waits for the rank to join until the store's timeout (30 minutes by
    default). Best effort and bounded: another rank connects to rank 0's store and writes its
    error; rank 0, whose store did not exist yet, hosts it on MASTER_PORT and keeps
    it up until every peer has read the error, at most 10 s; another rank tries for as long (rank 0
    may start later), or for 1 s where it had reached rank 0's store in this rendezvous already
    (a store that stopped listening went away), and not at all where it saw the store go or
    where RANK and WORLD_SIZE are a pod's, not a rank's (every pod then fails alike). Nothing
    without the variables of ``env://`` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or in a
    group of one.
    """
    if getattr(exc, _NOBODY_TO_TELL, False):
        return
    env = os.environ
    try:
        rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
        addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    except (KeyError, ValueError):
        return
    if world_size <= 1 or not 0 <= rank < world_size:
        return
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() in ("1", "true")
    hosting = rank == 0 and not agent_store
    # a rank that never reached rank 0's store waits for it as long as rank 0 would hold it (it
    # may start late); one that reached it before tries briefly: the store may have gone for good
    connect_s = _REACHED_CONNECT_S if getattr(exc, _STORE_REACHED, False) else _ANNOUNCE_CONNECT_S
    try:
        store = _failure_store(addr, port, world_size, hosting, connect_s)
        report = {
            "type": type(exc).__name__,
            "message": str(exc),
            "site": call_site(user_frame(sys._getframe(1))),
        }
        store.set(_FAILED_KEY.format(rank), json.dumps(report))
        store.add(_FAILED_COUNT, 1)
        if hosting:
            _hold_for_peers(store, world_size)
    except Exception:
        pass  # the peers then wait for their own timeout, as before


def _hold_for_peers(store: Any, world_size: int) -> None:
    """On a failed rank 0, which hosts the store: stay until every peer has read the error or
    announced its own failure (every rank failing alike, e.g. a backend missing everywhere),
    at most 10 s."""
    deadline = time.monotonic() + _HOLD_S
    waiting = set(range(1, world_size))
    while waiting and time.monotonic() < deadline:
        waiting = {
            r
            for r in waiting
            if not store.check([_READ_KEY.format(r)]) and not store.check([_FAILED_KEY.format(r)])
        }
        if waiting:
            time.sleep(0.05)


def _failure_store(addr: str, port: int, world_size: int, hosting: bool, connect_s: float) -> Any:
    timeout = timedelta(seconds=_HOLD_S if hosting else connect_s)
    if not hosting:
        _wait_for_listener(addr, port, timeout.total_seconds())
        return _TCPStore(addr, port, world_size, False, timeout=timeout)
    fd_text = os.environ.pop(STORE_FD_ENV, None)  # the socket a onedist launcher bound for rank 0
    if fd_text is None:
        _, sock = rendezvous_port(addr, port, host_store=True, what="MASTER_PORT")
        assert sock is not None
        fd_text = str(sock.detach())
    return _TCPStore(
        addr,
        port,
        world_size,
        True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=int(fd_text),
        use_libuv=True,
    )


def _wait_for_listener(addr: str, port: int, seconds: float) -> None:
    """Return once something listens on ``addr:port``; OSError after ``seconds``. Polled with plain
    sockets: a TCPStore client waiting for a store that is not up yet retries beyond its timeout
    (twice it, measured) and prints a C++ stack trace at each try."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection((addr, port), timeout=max(0.1, deadline - time.monotonic())).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


_MPI_ENVIRONMENTS = ("openmpi", "mvapich", "mpich")


def _agree_master(cluster: ClusterEnv) -> ClusterEnv:
    """Under MPI, ask rank 0 (through mpi4py, when installed) for its host and a free port.

    MPI environments do not name rank 0's host, and a port derived from the job id could be taken;
    one MPI broadcast settles both. Without mpi4py the derived values (or MASTER_ADDR/PORT) stand.
    """
    if cluster.name not in _MPI_ENVIRONMENTS or not (
        cluster.master_addr is None or cluster.master_port is None or cluster.master_port_derived
    ):
        return cluster
    import warnings

    with warnings.catch_warnings():
        # mpi4py built for another MPI than the launcher's (Open MPI's under MPICH's mpiexec): it
        # warns "suspicious MPI execution environment", and MPI there would be a singleton anyway
        warnings.filterwarnings("error", "suspicious MPI execution environment", RuntimeWarning)
        try:
            from .mpi import prepare_environment

            prepare_environment()  # before MPI starts
            from mpi4py import MPI
        except (ImportError, RuntimeWarning):
            return cluster
    comm = MPI.COMM_WORLD
    if comm.Get_size() != cluster.world_size:
        return cluster
    single = cluster.nnodes == 1
    offer = None
    if comm.Get_rank() == 0:
        offer = (LOOPBACK if single else socket.gethostname(), free_port(LOOPBACK if single else ""))
    addr, port = comm.bcast(offer, root=0)
    return replace(
        cluster, master_addr=cluster.master_addr or addr, master_port=port, master_port_derived=False
    )
