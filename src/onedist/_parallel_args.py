"""Parallel's argument checks, made when it is constructed, in ignite's order and with its words.

An ignite user's ``try``/``pytest.raises(match=...)`` keeps working: each message holds the
phrase ignite raises ("Unknown backend", "should positive", ...) and onedist's "given / allowed /
HINT" after it.
"""

from __future__ import annotations

from typing import Any, Optional

from ._net import tcp_init_would_hang
from .errors import BackendUnavailableError, OnedistValueError, bad_type

__all__ = ["check_parallel_args", "port_number"]

SPAWN_ARGS = ("nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port")


def _error(ignite_words: str, arg: str, value: Any, allowed: str, hint: str = "") -> OnedistValueError:
    msg = f"onedist.Parallel: {ignite_words}\n  given: {arg}={value!r}; allowed: {allowed}"
    return OnedistValueError(msg + (f"\nHINT: {hint}" if hint else ""))


def port_number(func: str, value: Any) -> Optional[int]:
    """``master_port`` as an int: ignite (and argparse's ``type=str``) pass digit strings too."""
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise bad_type(func, "master_port", value, "None, an int in 1..65535 or a string of digits")


def check_parallel_args(
    backend: Any, init_method: Any, spawn_args: dict[str, Any], hosts_rank0: bool
) -> None:
    """Raise the first problem ignite's ``Parallel`` would raise, in its order. ``hosts_rank0``:
    this process or its workers include global rank 0 (a tcp:// rendezvous is then hosted here)."""
    from .backends import available_backends

    if backend is not None:
        if not isinstance(backend, str):
            raise bad_type("Parallel", "backend", backend, "str, e.g. 'gloo', 'nccl' or 'auto', or None")
        here = available_backends()
        if backend != "auto" and backend not in here:
            raise BackendUnavailableError(
                f"onedist.Parallel: Unknown backend '{backend}'. Available backends: {here}\n"
                f"  given: backend={backend!r}; allowed: {', '.join(repr(b) for b in (*here, 'auto'))} "
                "or None (serial)\nHINT: `onedist info` says what each missing backend needs"
            )
    else:
        for name in SPAWN_ARGS:
            value = spawn_args[name]
            if value is not None:
                raise _error(
                    f"If backend is None, argument '{name}' should be also None, but given {value}",
                    name,
                    value,
                    "None when backend is None (serial run)",
                    "pass backend='gloo' (CPU) or 'nccl' (GPU) to run distributed",
                )
    tcp = isinstance(init_method, str) and init_method.startswith("tcp://")
    if tcp and hosts_rank0 and tcp_init_would_hang(init_method):
        raise _error(
            f"TCP initialization via init_method='{init_method}' will hang. To fix this, please configure "
            "MASTER_ADDR and MASTER_PORT in the environment and use 'env://' (or omit init_method).",
            "init_method",
            init_method,
            "'env://', 'file:///path', or 'tcp://host:port' where host is an address of this machine",
        )
    if backend is not None and spawn_args["nproc_per_node"] is not None:
        _check_spawn_shape(init_method, **spawn_args)


def _check_spawn_shape(
    init_method: Any, nproc_per_node: Any, nnodes: Any, node_rank: Any, master_addr: Any, master_port: Any
) -> None:
    for name, value in (("nproc_per_node", nproc_per_node), ("nnodes", nnodes), ("node_rank", node_rank)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise bad_type("Parallel", name, value, "int")
    if nproc_per_node < 1:
        raise _error(
            f"Argument nproc_per_node should positive, but given {nproc_per_node}",
            "nproc_per_node",
            nproc_per_node,
            "an int >= 1",
        )
    nnodes = 1 if nnodes is None else nnodes
    if nnodes < 1:
        raise _error(f"Argument nnodes should positive, but given {nnodes}", "nnodes", nnodes, "an int >= 1")
    if node_rank is None and nnodes > 1:
        raise _error(
            "If number of nodes larger than one, arguments node_rank should be given",
            "node_rank",
            None,
            f"0..{nnodes - 1} (this node's index)",
        )
    node_rank = 0 if node_rank is None else node_rank
    if not 0 <= node_rank < nnodes:
        raise _error(
            f"Argument node_rank should be between 0 and {nnodes - 1}, but given {node_rank}",
            "node_rank",
            node_rank,
            f"0..{nnodes - 1}",
        )
    if nnodes > 1 and (master_addr is None or master_port is None) and init_method is None:
        raise _error(
            "If number of nodes larger than one, arguments master_addr and master_port or init_method "
            f"should be specified, but given master_addr={master_addr}, master_port={master_port} and "
            f"init_method={init_method}.",
            "master_addr, master_port",
            (master_addr, master_port),
            "node 0's address and a free port on it, the same on every node",
        )
