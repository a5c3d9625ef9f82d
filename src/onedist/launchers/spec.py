"""The arguments of one launch, checked in one place: :class:`LaunchSpec` and its front ends.

The arguments themselves, their defaults, flags, variables and rules are declared in
:mod:`.arguments`; :class:`LaunchSpec`'s fields are its launch arguments
(``tests/test_architecture.py`` compares them). Here each front end checks them with the declared
rules and words the error as its users know it.

:meth:`LaunchSpec.build` checks the launch arguments of :func:`onedist.spawn` and of ``Parallel``'s
launches, those a backend's own launcher cannot honour included (mpirun, horovod.run and xmp.spawn
start the workers of one host); every launcher then takes the spec, never the arguments one by
one. Beside it, the same rules in the words ``Parallel``'s users know: its checks at construction,
in ignite's order and words. ``onedist run`` starts a script, not a function: its flags are
checked by :mod:`.run_spec` (:class:`~.run_spec.RunSpec`), naming the flag or the ``PET_*``
variable a value came from. Each error names the argument, the value given and what is allowed.
``tests/test_architecture.py`` fails on a check of a launch argument outside these two modules,
and on a bound of one compared outside :mod:`.arguments`.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

from .._net import LOOPBACK, tcp_init_would_hang
from .._recovery import LIVE
from ..errors import (
    BackendUnavailableError,
    LaunchArgumentError,
    OnedistTypeError,
    OnedistValueError,
    bad_type,
    bad_value,
)
from .arguments import (
    ARGUMENTS,
    ENDPOINT,
    LAUNCH_ARGUMENTS,
    SHAPE,
    START_METHODS,
    at_least_one,
    in_port_range,
    known_start_method,
    needed_with_nodes,
    node_rank_below,
    not_negative,
    own_launcher_violation,
    parallel_arguments,
    recovery_mode,
)

__all__ = [
    "LaunchSpec",
    "OWN_LAUNCHERS",
    "START_METHODS",
    "available_start_methods",
    "check_against_launcher",
    "check_max_restarts",
    "check_recovery",
    "check_no_spawn_args",
    "check_parallel_args",
    "check_parallel_kwargs",
    "check_serial_args",
    "check_xla_device_count",
    "port_number",
]


#: backends whose workers a launcher of their own starts, on one host: the hint their errors give
OWN_LAUNCHERS = {
    "mpi": "spawn('mpi', ...) starts the ranks on this host through mpirun, which connects them "
    "itself; for several hosts run `mpirun -np N -H host1:n1,host2:n2 python script.py` "
    "(Parallel(backend='mpi') then only initialises)",
    "horovod": "spawn('horovod', ...) starts the processes through horovod.run, which picks its own "
    "rendezvous; for several hosts pass hosts='host1:n1,host2:n2' (nproc_per_node is then "
    "the total), or run `horovodrun -np N -H host1:n1,host2:n2 python script.py` "
    "(Parallel(backend='horovod') then only initialises)",
    "xla-tpu": "xmp.spawn starts the replicas of this host and PJRT finds the other hosts of a "
    "TPU slice itself: run the same script on every host (e.g. `gcloud compute tpus tpu-vm "
    "ssh NAME --worker=all --command='python train.py'`) with nnodes=1",
}


@dataclass(frozen=True)
class LaunchSpec:
    """What :func:`onedist.spawn` (or ``Parallel``) was asked to start, after its checks:
    ``backend`` is the name ``initialize`` will get in each worker (``"auto"`` resolved),
    ``timeout`` a timedelta or None. Build one with :meth:`build`."""

    backend: str
    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = LOOPBACK
    master_port: Optional[int] = None
    init_method: Optional[str] = None
    timeout: Optional[timedelta] = None
    start_method: str = "spawn"
    hosts: Optional[str] = None
    max_restarts: int = 0
    recovery: str = "restart"

    @classmethod
    def build(cls, given: Mapping[str, Any], *, caller: str = "spawn") -> LaunchSpec:
        """Check the launch arguments ``given`` (by their declared names; one not given takes its
        declared default) and return their spec: ``"auto"`` resolved for this launch, the backend
        available here, ``timeout`` as a timedelta. ``caller``: the public function the timeout
        error names; ``"Parallel"`` also takes ``start_method="subprocess"``.

        Raises:
            OnedistValueError / OnedistTypeError: an argument is not allowed (the message names
                it, the value and what is allowed).
            BackendUnavailableError: the backend cannot run here.
        """
        values = {a.name: given.get(a.name, a.default) for a in LAUNCH_ARGUMENTS}
        assert set(given) <= set(values), f"not launch arguments: {set(given) - set(values)}"
        _check_fn_args(values)
        _check_shape(values)
        _check_rendezvous(values)
        _check_start(values, caller)
        restarts = values["max_restarts"]
        check_max_restarts("spawn", restarts, nnodes=values["nnodes"], start_method=values["start_method"])
        check_recovery("spawn", values["recovery"])
        from ..context import backend_class, check_timeout, resolve_backend_name

        name = resolve_backend_name(values["backend"], values["nnodes"], values["nproc_per_node"])
        backend_class(name)  # initialize's error for a backend unknown or not installed here
        values.update(
            backend=name,
            timeout=check_timeout(caller, values["timeout"]),
            args=tuple(values["args"]),
            kwargs=dict(values["kwargs"] or {}),
        )
        spec = cls(**values)
        if name in OWN_LAUNCHERS and spec.start_method != "subprocess":
            _check_own_launcher(spec)
        return spec

    @property
    def own_launcher(self) -> bool:
        """The backend's own launcher starts the workers (mpirun for ``"mpi"`` beyond one process,
        horovod.run, xmp.spawn); a world of one ``"mpi"`` process is onedist's to start."""
        if self.backend not in OWN_LAUNCHERS or self.start_method == "subprocess":
            return False
        return not (self.backend == "mpi" and self.world_size == 1)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def env_rendezvous(self) -> bool:
        """The workers meet through torchrun's variables (``env://``, the default), not a URL."""
        return self.init_method is None or self.init_method.startswith("env://")

    def rank(self, local_rank: int) -> int:
        """The global rank of ``local_rank`` on this node."""
        return self.node_rank * self.nproc_per_node + local_rank

    def check_rendezvous_port(self) -> None:
        """onedist's own launcher (torch.distributed backends): several nodes meet at one fixed port."""
        if needed_with_nodes(self.nnodes, self.master_port) and self.env_rendezvous:
            raise bad_value(
                "spawn",
                "master_port",
                None,
                "a port number when nnodes > 1 (every node must use the same one)",
                hint="pass master_addr=<node 0's address> and master_port=<free port on node 0> "
                "on every node",
            )


def _check_fn_args(values: Mapping[str, Any]) -> None:
    if not isinstance(values["backend"], str):
        raise _bad_type("backend", values)
    if not callable(values["fn"]):
        raise _bad_type("fn", values)
    if not isinstance(values["args"], (tuple, list)):
        raise _bad_type("args", values)
    if values["kwargs"] is not None and not isinstance(values["kwargs"], Mapping):
        raise _bad_type("kwargs", values)


def _bad_type(name: str, values: Mapping[str, Any]) -> OnedistTypeError:
    """spawn's error for the argument ``name`` of ``values`` (named by spawn's keyword)."""
    arg = ARGUMENTS[name]
    return bad_type("spawn", arg.spawn_keyword, values[name], arg.allowed)


def _check_shape(values: Mapping[str, Any]) -> None:
    for name in SHAPE:
        if not isinstance(values[name], int) or isinstance(values[name], bool):
            raise bad_type("spawn", name, values[name], "int")
    for name in SHAPE:  # the counts, as declared: at least one
        if ARGUMENTS[name].rule is at_least_one and not at_least_one(values[name]):
            raise bad_value("spawn", name, values[name], ARGUMENTS[name].allowed)
    nnodes, node_rank = values["nnodes"], values["node_rank"]
    if not node_rank_below(node_rank, nnodes):
        raise bad_value("spawn", "node_rank", node_rank, f"0..{nnodes - 1} (nnodes={nnodes})")


def _check_rendezvous(values: Mapping[str, Any]) -> None:
    master_addr, master_port = (values[name] for name in ENDPOINT)
    init_method = values["init_method"]
    if not isinstance(master_addr, str) or not master_addr:
        raise bad_type("spawn", "master_addr", master_addr, ARGUMENTS["master_addr"].allowed)
    if master_port is not None and (
        not isinstance(master_port, int) or isinstance(master_port, bool) or not in_port_range(master_port)
    ):
        raise bad_value("spawn", "master_port", master_port, ARGUMENTS["master_port"].allowed)
    if init_method is not None and (
        not isinstance(init_method, str) or not init_method.startswith(("env://", "tcp://", "file://"))
    ):
        raise bad_value("spawn", "init_method", init_method, ARGUMENTS["init_method"].allowed)


def available_start_methods() -> list[str]:
    """The start methods of :data:`START_METHODS` this platform has."""
    return [m for m in START_METHODS if m in multiprocessing.get_all_start_methods()]


def _check_start(values: Mapping[str, Any], caller: str) -> None:
    backend, start_method, hosts = values["backend"], values["start_method"], values["hosts"]
    subprocess = caller == "Parallel" and start_method == "subprocess"  # Parallel's re-exec
    if not subprocess and start_method not in available_start_methods():
        raise bad_value("spawn", "start_method", start_method, available_start_methods())
    if hosts is not None and backend != "horovod":
        raise bad_value(
            "spawn",
            "hosts",
            hosts,
            f"None with backend {backend!r}",
            hint="hosts is horovod.run's host list, for backend 'horovod'; other backends run "
            "spawn once per node, with nnodes, node_rank and master_addr",
        )


def check_recovery(func: str, value: Any, launched: bool = False) -> None:
    """``recovery`` of ``spawn`` / ``Parallel``: a mode's name; ``"live"`` is ``onedist run``'s
    (its launcher hosts the store the replacement joins, and runs a script the replacement runs
    again), refused for the workers spawn would start (``launched``: a launcher started this
    process, and ``Parallel`` only initialises: its recovery applies)."""
    allowed = ARGUMENTS["recovery"].allowed
    if not isinstance(value, str):
        raise bad_type(func, "recovery", value, allowed)
    if not recovery_mode(value):
        raise bad_value(func, "recovery", value, allowed)
    if value == LIVE and not launched:
        raise bad_value(
            func,
            "recovery",
            value,
            "'restart' here; 'live' is supported under `onedist run` only (its launcher hosts the store "
            "a replacement joins and starts the script again for one rank)",
            hint="start the script with `onedist run -n N --backend gloo --max-restarts K --recovery live "
            "train.py`, its loop under od.steps",
        )


def check_max_restarts(func: str, value: Any, *, nnodes: Any = 1, start_method: Any = "spawn") -> None:
    """``max_restarts`` of ``spawn`` / ``Parallel``: an int >= 0, and 0 where the workers cannot be
    restarted from here (several nodes: the nodes would have to agree; the re-exec start method:
    this process is rank 0 itself)."""
    allowed = ARGUMENTS["max_restarts"].allowed
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad_type(func, "max_restarts", value, allowed)
    if not not_negative(value):
        raise bad_value(func, "max_restarts", value, allowed)
    if value and nnodes != 1:
        raise bad_value(
            func,
            "max_restarts",
            value,
            f"0 with nnodes={nnodes}: restarts over several nodes must be agreed between them",
            hint="start each node with `onedist run --nnodes N --node-rank K --max-restarts N ...`, "
            "whose launchers agree on each restart",
        )
    if value and start_method == "subprocess":
        raise bad_value(
            func,
            "max_restarts",
            value,
            "0 with start_method='subprocess' (this process is rank 0 itself: it cannot restart it)",
            hint="use start_method 'spawn' or 'fork', or `onedist run --max-restarts N script.py`",
        )


def _check_own_launcher(spec: LaunchSpec) -> None:
    """What the backend's own launcher cannot honour: restarts (restart the whole job from
    outside), and, for a world of more than one, anything beyond this host's processes."""
    if spec.max_restarts:
        raise bad_value(
            "spawn",
            "max_restarts",
            spec.max_restarts,
            f"0 with backend {spec.backend!r}, whose workers its own launcher starts",
            hint="restart the whole job from outside (e.g. a loop around mpirun), with od.resume",
        )
    hint = OWN_LAUNCHERS[spec.backend]
    if spec.backend == "horovod" and spec.nnodes != 1:  # (before the others) ignite's words and error type
        raise bad_value(
            "spawn",
            "nnodes",
            spec.nnodes,
            "1 with backend 'horovod'",
            hint=hint,
            says="For multi-node configuration, please set 'hosts' argument instead",
            error=LaunchArgumentError,
        )
    if spec.backend == "horovod" and spec.hosts is not None:
        _check_hosts(spec.hosts, spec.nproc_per_node)
    if not spec.own_launcher:  # a world of one "mpi" process: onedist's process launcher starts it
        return
    refused = own_launcher_violation(spec.backend, vars(spec))
    if refused is not None:
        name, allowed = refused
        allowed += f" with backend {spec.backend!r}"
        raise bad_value("spawn", name, getattr(spec, name), allowed, hint=hint)


def _check_hosts(hosts: Any, nproc: int) -> None:
    """``hosts`` as horovod.run takes it: "host:slots" items, comma-separated, with at least
    ``nproc`` slots in all."""
    allowed = ARGUMENTS["hosts"].allowed
    if not isinstance(hosts, str):
        raise bad_type("spawn", "hosts", hosts, allowed)
    slots = 0
    for item in hosts.split(","):
        name, _, count = item.strip().rpartition(":")
        if not name or not count.isdigit() or int(count) < 1:
            raise bad_value("spawn", "hosts", hosts, allowed)
        slots += int(count)
    if slots < nproc:
        raise bad_value(
            "spawn",
            "hosts",
            hosts,
            f"hosts with at least nproc_per_node={nproc} slots in all (these have {slots})",
            hint="with hosts, nproc_per_node is the number of processes over all hosts",
        )


def check_xla_device_count(nproc_per_node: int, devices: int, device_type: str) -> None:
    """``nproc_per_node`` of an XLA launch against the devices of this host, which only the
    replicas xmp.spawn started can count (torch_xla forbids xmp.spawn once this process used XLA)."""
    if devices != nproc_per_node:
        raise bad_value(
            "spawn",
            "nproc_per_node",
            nproc_per_node,
            f"1 or {devices}, the number of XLA devices on this host (PJRT_DEVICE={device_type})",
        )


# ============================================================================ Parallel's arguments
# Checked when Parallel is constructed, in ignite's order and with its words: an ignite user's
# ``try``/``pytest.raises(match=...)`` keeps working (each message holds the phrase ignite raises,
# "Unknown backend", "should positive", ..., then onedist's "given / allowed / HINT").

#: Parallel's keywords for spawn mode (a serial run takes none; a launcher's values must match them)
SPAWN_ARGS = parallel_arguments("spawn")
#: Parallel's ``**spawn_kwargs``
SPAWN_KWARGS = parallel_arguments("spawn_kwargs")


def _ignite_error(ignite_words: str, arg: str, value: Any, allowed: str, hint: str = "") -> OnedistValueError:
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
    from ..backends import available_backends

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
                raise _ignite_error(
                    f"If backend is None, argument '{name}' should be also None, but given {value}",
                    name,
                    value,
                    "None when backend is None (serial run)",
                    "pass backend='gloo' (CPU) or 'nccl' (GPU) to run distributed",
                )
    tcp = isinstance(init_method, str) and init_method.startswith("tcp://")
    if tcp and hosts_rank0 and tcp_init_would_hang(init_method):
        raise _ignite_error(
            f"TCP initialization via init_method='{init_method}' will hang. To fix this, please configure "
            "MASTER_ADDR and MASTER_PORT in the environment and use 'env://' (or omit init_method).",
            "init_method",
            init_method,
            "'env://', 'file:///path', or 'tcp://host:port' where host is an address of this machine",
        )
    if backend is not None and spawn_args["nproc_per_node"] is not None:
        _check_spawn_shape(init_method, spawn_args)


def _check_spawn_shape(init_method: Any, spawn_args: Mapping[str, Any]) -> None:
    for name in SHAPE:
        value = spawn_args[name]
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise bad_type("Parallel", name, value, "int")
    nproc_per_node = spawn_args["nproc_per_node"]
    if not at_least_one(nproc_per_node):
        raise _ignite_error(
            f"Argument nproc_per_node should positive, but given {nproc_per_node}",
            "nproc_per_node",
            nproc_per_node,
            ARGUMENTS["nproc_per_node"].allowed,
        )
    nnodes = 1 if spawn_args["nnodes"] is None else spawn_args["nnodes"]
    if not at_least_one(nnodes):
        raise _ignite_error(
            f"Argument nnodes should positive, but given {nnodes}",
            "nnodes",
            nnodes,
            ARGUMENTS["nnodes"].allowed,
        )
    if needed_with_nodes(nnodes, spawn_args["node_rank"]):
        raise _ignite_error(
            "If number of nodes larger than one, arguments node_rank should be given",
            "node_rank",
            None,
            f"0..{nnodes - 1} (this node's index)",
        )
    node_rank = 0 if spawn_args["node_rank"] is None else spawn_args["node_rank"]
    if not node_rank_below(node_rank, nnodes):
        raise _ignite_error(
            f"Argument node_rank should be between 0 and {nnodes - 1}, but given {node_rank}",
            "node_rank",
            node_rank,
            f"0..{nnodes - 1}",
        )
    _check_spawn_endpoint(init_method, nnodes, spawn_args)


def _check_spawn_endpoint(init_method: Any, nnodes: int, spawn_args: Mapping[str, Any]) -> None:
    """Several nodes meet at node 0's address and port, the same on every node, or an init_method."""
    master_addr, master_port = (spawn_args[name] for name in ENDPOINT)
    if init_method is None and any(needed_with_nodes(nnodes, spawn_args[name]) for name in ENDPOINT):
        raise _ignite_error(
            "If number of nodes larger than one, arguments master_addr and master_port or init_method "
            f"should be specified, but given master_addr={master_addr}, master_port={master_port} and "
            f"init_method={init_method}.",
            "master_addr, master_port",
            (master_addr, master_port),
            "node 0's address and a free port on it, the same on every node",
        )


def check_parallel_kwargs(spawn_kwargs: Mapping[str, Any]) -> None:
    """Parallel's ``**spawn_kwargs``: only :data:`SPAWN_KWARGS`, the start method one of spawn's
    or "subprocess", no ``hosts`` with "subprocess"; ``max_restarts`` is :func:`check_max_restarts`'s."""
    unknown = sorted(set(spawn_kwargs) - set(SPAWN_KWARGS))
    if unknown:
        raise bad_value(
            "Parallel", unknown[0], spawn_kwargs[unknown[0]], "keyword arguments " + ", ".join(SPAWN_KWARGS)
        )
    method = spawn_kwargs.get("start_method", "spawn")
    if method != "subprocess" and not known_start_method(method):
        raise bad_value("Parallel", "start_method", method, [*available_start_methods(), "subprocess"])
    if method == "subprocess" and spawn_kwargs.get("hosts") is not None:
        raise bad_value(
            "Parallel",
            "hosts",
            spawn_kwargs["hosts"],
            "None with start_method='subprocess' (hosts is for backend 'horovod', whose "
            "workers horovod.run starts)",
        )


def check_serial_args(init_method: Any) -> None:
    """``Parallel(backend=None)``: a serial run takes no ``init_method``."""
    if init_method is not None:
        raise bad_value(
            "Parallel",
            "init_method",
            init_method,
            "None when backend is None (serial run)",
            hint="pass backend='gloo' (CPU) or 'nccl' (GPU) to run distributed",
        )


def check_no_spawn_args(given: Mapping[str, Any]) -> None:
    """Parallel without ``nproc_per_node`` and without a launcher: no other spawn argument."""
    if given:
        first = next(iter(given))
        raise bad_value("Parallel", first, given[first], "None unless nproc_per_node is given (spawn mode)")


def check_against_launcher(given: Mapping[str, Any], env: Any) -> None:
    """Parallel's spawn arguments ``given`` under a launcher that started the processes already
    (``env``: the detected environment, or None for a group the user made): each must match it."""
    if env is None:  # a group created by the user: nothing to compare with
        return
    # the environment's fields carry the arguments' names; a port the launcher did not set is not one
    expected = {name: getattr(env, name) for name in SPAWN_ARGS}
    if env.master_port_derived:
        expected["master_port"] = None
    for key, value in given.items():
        known = expected.get(key)
        if known is not None and str(value) != str(known):
            raise bad_value(
                "Parallel",
                key,
                value,
                f"{known!r}, the value the launcher that started this process set",
                hint="an external launcher (torchrun, srun, ...) already started the processes; drop the "
                "spawn arguments or make them match",
            )
