"""Diagnose the launch environment for ``onedist info``: the network path to the master, and warnings.

Everything here is a function of an ``environ`` mapping plus small probes (name resolution, the
route to an address, this host's interfaces, a TCP connect) that callers may replace, so every
check is unit-testable with plain dicts. Each probe has a short timeout, so ``onedist info``
answers in well under a second even when MASTER_ADDR is unroutable. No torch import.

* :func:`network_report`: which interface and local IP this host uses to reach the master, what
  gloo and NCCL will bind to (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` or their defaults),
  whether the master answers on MASTER_PORT, and the interfaces of this host.
* :func:`warnings`: the mistakes that make a launch hang or fail, each one sentence and a
  ``HINT:`` with the fix.

Example:
    >>> from onedist._diagnose import network_report, warnings
    >>> report = network_report({"MASTER_ADDR": "127.0.0.1"})
    >>> report["master_addr"], report["source_ip"], report["interface"]   # Linux names loopback lo
    ('127.0.0.1', '127.0.0.1', 'lo')
    >>> warnings({"RANK": "0"}, network={})  # doctest: +ELLIPSIS
    ['RANK is set but WORLD_SIZE is not...']
"""

from __future__ import annotations

import errno
import ipaddress
import shutil
import socket
import struct
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from ._net import is_loopback
from .environments import ClusterEnv, detect_cluster, expand_nodelist, kubernetes_warnings

__all__ = [
    "CONNECT_TIMEOUT",
    "RESOLVE_TIMEOUT",
    "IfnameSpec",
    "interface_for",
    "list_interfaces",
    "network_report",
    "nccl_default_interfaces",
    "parse_ifname_spec",
    "probe_tcp",
    "resolve",
    "route_source",
    "warnings",
]

#: seconds one name lookup may take (a lookup still running after that is abandoned)
RESOLVE_TIMEOUT = 0.25
#: seconds the TCP probe of MASTER_ADDR:MASTER_PORT may take
CONNECT_TIMEOUT = 0.4

_SIOCGIFADDR = 0x8915  # Linux ioctl: the IPv4 address of an interface
_UNREACHABLE = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT, getattr(errno, "EHOSTDOWN", -1)}
_REACHABLE = {errno.ECONNREFUSED, errno.ECONNRESET}
_DEFAULT_MASTER = "127.0.0.1"

Resolver = Callable[[str], list[str]]
Router = Callable[[str], str]
Connector = Callable[[str, int, float], None]
InterfaceLister = Callable[[], Optional[dict[str, list[str]]]]


# ============================================================================ probes
def _ip_literal(host: str) -> Optional[str]:
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return None


def resolve(host: str, timeout: float = RESOLVE_TIMEOUT) -> list[str]:
    """The addresses ``host`` resolves to (``socket.getaddrinfo``), in the resolver's order.

    An IP literal is returned as is, without a lookup. The lookup runs in a daemon thread so a
    slow DNS server cannot stall the caller: after ``timeout`` seconds it raises TimeoutError.
    Raises OSError (``socket.gaierror``) when the name does not resolve.

    Example:
        >>> resolve("127.0.0.1")
        ['127.0.0.1']
        >>> "127.0.0.1" in resolve("localhost")
        True
    """
    literal = _ip_literal(host)
    if literal is not None:
        return [literal]
    answer: list[Any] = []

    def lookup() -> None:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            answer.append([str(info[4][0]) for info in infos])
        except OSError as e:
            answer.append(e)

    thread = threading.Thread(target=lookup, name="onedist-resolve", daemon=True)
    thread.start()
    thread.join(timeout)
    if not answer:
        raise TimeoutError(errno.ETIMEDOUT, f"no answer from the resolver within {timeout:g} s")
    if isinstance(answer[0], OSError):
        raise answer[0]
    return list(dict.fromkeys(answer[0]))  # unique, in order


def route_source(address: str) -> str:
    """The local IP this host sends from to reach ``address`` (an IP literal).

    Connects a UDP socket (which sends no packet, it only asks the kernel for a route) and reads
    the local address it got. Raises OSError (ENETUNREACH) when there is no route.

    Example:
        >>> route_source("127.0.0.1")
        '127.0.0.1'
    """
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((address, 9))
        return str(s.getsockname()[0])


def _ipv4_of(name: str) -> list[str]:
    """The IPv4 address of one interface (SIOCGIFADDR: the primary one); [] when unknown."""
    if not sys.platform.startswith("linux"):
        return []
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Linux has fcntl
        return []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:  # EADDRNOTAVAIL: no IPv4 address
            return []
    return [socket.inet_ntoa(packed[20:24])]


def list_interfaces() -> Optional[dict[str, list[str]]]:
    """This host's network interfaces and their IPv4 addresses; None when they cannot be listed.

    Names come from ``socket.if_nameindex``; addresses from the SIOCGIFADDR ioctl on Linux (the
    primary IPv4 address of each interface; elsewhere the lists are empty).

    Example:
        >>> list_interfaces()["lo"]                           # and e.g. 'eth0': ['192.0.2.2']
        ['127.0.0.1']
    """
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return None
    return {name: _ipv4_of(name) for name in names}


def interface_for(ip: Optional[str], interfaces: Optional[Mapping[str, Sequence[str]]]) -> Optional[str]:
    """The name of the interface that holds ``ip``; None when unknown.

    A loopback address that no interface lists (``127.0.0.2``, ``::1``) maps to the interface that
    holds 127.0.0.1, or to the one named ``lo`` / ``lo0``.

    Example:
        >>> interface_for("127.0.0.1", {"lo": ["127.0.0.1"], "eth0": ["192.0.2.2"]})
        'lo'
        >>> interface_for("::1", {"lo": ["127.0.0.1"]})
        'lo'
        >>> interface_for("10.0.0.1", {"lo": ["127.0.0.1"]}) is None
        True
    """
    if ip is None or not interfaces:
        return None
    bare = ip.split("%")[0]
    for name, addresses in interfaces.items():
        if bare in addresses:
            return name
    if is_loopback(bare):
        for name, addresses in interfaces.items():
            if any(is_loopback(a) for a in addresses):
                return name
        return next((n for n in ("lo", "lo0") if n in interfaces), None)
    return None


def _tcp_connect(host: str, port: int, timeout: float) -> None:
    with socket.create_connection((host, port), timeout=timeout):
        pass


def probe_tcp(
    host: str, port: int, timeout: float = CONNECT_TIMEOUT, connect: Connector = _tcp_connect
) -> dict[str, Any]:
    """Try a TCP connection to ``host:port`` and say whether the host is reachable.

    ``connect(host, port, timeout)`` opens and closes a connection or raises OSError. A refused
    connection means the host answered: reachable (nothing listening yet is normal before the
    job starts). A timeout, EHOSTUNREACH or ENETUNREACH means it is not. The result is a dict:
    ``result`` ("open", "refused", "timeout" or an errno name), ``reachable`` (True, False, or
    None when the error says nothing about it), ``errno`` and ``detail``.

    Example:
        >>> def refuse(host, port, timeout):
        ...     raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
        >>> probe_tcp("10.0.0.1", 29500, connect=refuse)["reachable"]
        True
    """
    try:
        connect(host, port, timeout)
    except TimeoutError as e:
        return {
            "result": "timeout",
            "reachable": False,
            "errno": "ETIMEDOUT",
            "detail": str(e) or "timed out",
        }
    except OSError as e:
        name = errno.errorcode.get(e.errno, str(e.errno)) if e.errno is not None else None
        if e.errno in _REACHABLE:
            reachable: Optional[bool] = True
        elif e.errno in _UNREACHABLE:
            reachable = False
        else:
            reachable = None
        result = "refused" if e.errno == errno.ECONNREFUSED else (name or "error")
        return {"result": result, "reachable": reachable, "errno": name, "detail": e.strerror or str(e)}
    return {"result": "open", "reachable": True, "errno": None, "detail": "something is listening"}


# ============================================================================ interface names
@dataclass(frozen=True)
class IfnameSpec:
    """A parsed ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` value.

    gloo takes a comma list of exact interface names. NCCL takes a comma list of name *prefixes*;
    a leading ``^`` excludes the listed interfaces instead, and a leading ``=`` (after any ``^``)
    makes the names exact.
    """

    names: tuple[str, ...]
    exclude: bool = False
    exact: bool = False

    def matches(self, ifname: str) -> bool:
        """Whether the library would consider interface ``ifname``."""
        hit = any(ifname == n if self.exact else ifname.startswith(n) for n in self.names)
        return hit != self.exclude

    def select(self, ifnames: Sequence[str]) -> list[str]:
        """The interfaces among ``ifnames`` the library would consider, in order."""
        return [n for n in ifnames if self.matches(n)]


def parse_ifname_spec(value: str, *, nccl: bool = True) -> IfnameSpec:
    """Parse an interface selection: NCCL syntax (``nccl=True``) or gloo's list of exact names.

    Example:
        >>> parse_ifname_spec("^docker,lo")
        IfnameSpec(names=('docker', 'lo'), exclude=True, exact=False)
        >>> parse_ifname_spec("=eth0").select(["eth0", "eth01"])
        ['eth0']
        >>> parse_ifname_spec("eth").select(["lo", "eth0", "eth1"])
        ['eth0', 'eth1']
        >>> parse_ifname_spec("eth0,ib0", nccl=False)
        IfnameSpec(names=('eth0', 'ib0'), exclude=False, exact=True)
    """
    text = value.strip()
    exclude = exact = False
    if nccl:
        if text.startswith("^"):
            exclude, text = True, text[1:]
        if text.startswith("="):
            exact, text = True, text[1:]
    else:
        exact = True
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    return IfnameSpec(names, exclude=exclude, exact=exact)


def nccl_default_interfaces(interfaces: Mapping[str, Sequence[str]]) -> list[str]:
    """The interfaces NCCL picks when NCCL_SOCKET_IFNAME is unset (its order, simplified).

    NCCL takes ``ib*`` interfaces first, then anything but ``docker*`` and ``lo*``, then
    ``docker*``, then ``lo*``; only interfaces with an address count (here: an IPv4 address; the
    NCCL_COMM_ID subnet match is not modelled).

    Example:
        >>> nccl_default_interfaces({"lo": ["127.0.0.1"], "docker0": ["172.17.0.1"], "eth0": ["10.0.0.2"]})
        ['eth0']
    """
    with_address = [name for name, addresses in interfaces.items() if addresses]
    for spec in ("ib", "^docker,lo", "docker", "lo"):
        chosen = parse_ifname_spec(spec).select(with_address)
        if chosen:
            return chosen
    return []


# ============================================================================ the report
def _int(environ: Mapping[str, str], *names: str) -> Optional[int]:
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            try:
                return int(value)
            except ValueError:
                continue
    return None


def _detect(environ: Mapping[str, str]) -> Optional[ClusterEnv]:
    try:
        return detect_cluster(environ)
    except Exception:  # a malformed SLURM node list or tasks-per-node: diagnose the rest anyway
        return None


def _slurm_first_node(environ: Mapping[str, str]) -> Optional[str]:
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist or not (environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")):
        return None
    try:
        hosts = expand_nodelist(nodelist)
    except Exception:  # hostlist.BadHostlist: report nothing rather than fail
        return None
    return hosts[0] if hosts else None


def _nnodes(environ: Mapping[str, str], env: Optional[ClusterEnv]) -> Optional[int]:
    """How many nodes the job spans, as far as the environment says."""
    if env is not None:
        if env.nnodes is not None:
            return env.nnodes
        if env.nproc_per_node is not None and env.world_size > env.nproc_per_node:
            return 2  # more ranks than on this node: at least two nodes
        return None
    return _int(environ, "GROUP_WORLD_SIZE", "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")


def _error_text(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno is not None and e.strerror:
        name = errno.errorcode.get(e.errno)
        if name is not None and not isinstance(e, socket.gaierror):
            return f"{name}: {e.strerror}"
        return e.strerror
    return str(e) or type(e).__name__


def _resolve_all(host: str, resolver: Resolver) -> tuple[list[str], Optional[str]]:
    try:
        return resolver(host), None
    except OSError as e:
        return [], _error_text(e)


def _master(environ: Mapping[str, str]) -> tuple[str, str, Optional[int]]:
    """The master's address, where it came from, and its port (None when unknown)."""
    env = _detect(environ)
    if environ.get("MASTER_ADDR"):
        master, master_source = environ["MASTER_ADDR"], "MASTER_ADDR"
    elif env is not None and env.master_addr:
        master, master_source = env.master_addr, f"detected environment ({env.name})"
    elif _slurm_first_node(environ) is not None:
        # an sbatch script / salloc shell: the tasks srun starts will rendezvous on the first node
        master, master_source = str(_slurm_first_node(environ)), "first node of SLURM_JOB_NODELIST"
    else:
        master, master_source = _DEFAULT_MASTER, "default"
    port = _int(environ, "MASTER_PORT")
    if port is None and env is not None:
        port = env.master_port
    return master, master_source, port


def _route(target: Optional[str], router: Router) -> tuple[Optional[str], Optional[str]]:
    """The local source IP toward ``target`` and the error that prevented finding it."""
    if target is None:
        return None, None
    try:
        return router(target), None
    except OSError as e:
        return None, _error_text(e)


def network_report(
    environ: Mapping[str, str],
    *,
    resolver: Resolver = resolve,
    router: Router = route_source,
    interfaces: InterfaceLister = list_interfaces,
    connect: Connector = _tcp_connect,
    hostname: Callable[[], str] = socket.gethostname,
    connect_timeout: float = CONNECT_TIMEOUT,
) -> dict[str, Any]:
    """How this host would reach the master, and what gloo and NCCL would bind to.

    The master is MASTER_ADDR, else the address the detected launcher environment gives (the
    first SLURM node, ...), else 127.0.0.1. Its address is resolved, the local source IP toward it
    found (UDP connect: no packet is sent) and mapped to an interface. When a port is known
    (MASTER_PORT or the detected environment's), a TCP connect with ``connect_timeout`` says
    whether the host answers. Every probe is an argument so tests can replace it; the result is
    JSON-serializable.

    Keys: ``master_addr``, ``master_addr_source``, ``master_port``, ``resolved``,
    ``resolve_error``, ``source_ip``, ``route_error``, ``interface`` (toward the master),
    ``master_probe`` (see :func:`probe_tcp`, or None), ``hostname``, ``hostname_addresses``,
    ``gloo`` and ``nccl`` (``interface``, ``source``, and for a variable that is set ``exists`` /
    ``missing`` / ``selected``), ``interfaces`` (name → IPv4 addresses, None when unknown).

    Example:
        >>> report = network_report(
        ...     {"MASTER_ADDR": "10.0.0.1", "GLOO_SOCKET_IFNAME": "eth9"},
        ...     resolver=lambda host: [host],
        ...     router=lambda ip: "10.0.0.2",
        ...     interfaces=lambda: {"lo": ["127.0.0.1"], "eth0": ["10.0.0.2"]},
        ...     hostname=lambda: "node1",
        ... )
        >>> report["interface"], report["gloo"]["interface"], report["gloo"]["missing"]
        ('eth0', 'eth9', ['eth9'])
    """
    master, master_source, port = _master(environ)
    resolved, resolve_error = _resolve_all(master, resolver)
    ipv4 = [a for a in resolved if ":" not in a]
    target: Optional[str] = (ipv4 or resolved)[0] if resolved else None
    source_ip, route_error = _route(target, router)
    ifaces = interfaces()
    probe: Optional[dict[str, Any]] = None
    if target is not None and port is not None and route_error is None:
        probe = {"address": target, "port": port, "timeout_s": connect_timeout}
        probe.update(probe_tcp(target, port, connect_timeout, connect))

    host = hostname()
    host_addresses, host_error = _resolve_all(host, resolver)

    return {
        "master_addr": master,
        "master_addr_source": master_source,
        "master_port": port,
        "resolved": resolved,
        "resolve_error": resolve_error,
        "source_ip": source_ip,
        "route_error": route_error,
        "interface": interface_for(source_ip, ifaces),
        "master_probe": probe,
        "hostname": host,
        "hostname_addresses": host_addresses,
        "hostname_error": host_error,
        "gloo": _gloo_report(environ, master, host_addresses, ifaces),
        "nccl": _nccl_report(environ, ifaces),
        "interfaces": ifaces,
    }


def _gloo_report(
    environ: Mapping[str, str],
    master: str,
    host_addresses: Sequence[str],
    ifaces: Optional[Mapping[str, Sequence[str]]],
) -> dict[str, Any]:
    value = environ.get("GLOO_SOCKET_IFNAME")
    if value:
        names = list(parse_ifname_spec(value, nccl=False).names)
        missing = None if ifaces is None else [n for n in names if n not in ifaces]
        return {
            "interface": value,
            "source": "GLOO_SOCKET_IFNAME",
            "exists": None if missing is None else not missing,
            "missing": missing,
        }
    if is_loopback(master):
        # onedist.initialize pins gloo to loopback when MASTER_ADDR is a loopback address
        return {
            "interface": interface_for("127.0.0.1", ifaces),
            "address": "127.0.0.1",
            "source": "onedist (MASTER_ADDR is loopback)",
        }
    if host_addresses:
        # torch's gloo binds to the first address this host's name resolves to
        local = [a for a in host_addresses if ":" not in a] or list(host_addresses)
        return {"interface": interface_for(local[0], ifaces), "address": local[0], "source": "hostname"}
    return {
        "interface": interface_for("127.0.0.1", ifaces),
        "address": "127.0.0.1",
        "source": "loopback fallback (the hostname does not resolve)",
    }


def _nccl_report(environ: Mapping[str, str], ifaces: Optional[Mapping[str, Sequence[str]]]) -> dict[str, Any]:
    value = environ.get("NCCL_SOCKET_IFNAME")
    if value:
        spec = parse_ifname_spec(value, nccl=True)
        selected = None if ifaces is None else spec.select(list(ifaces))
        return {
            "interface": value,
            "source": "NCCL_SOCKET_IFNAME",
            "exists": None if selected is None else bool(selected),
            "selected": selected,
        }
    selected = None if ifaces is None else nccl_default_interfaces(ifaces)
    return {
        "interface": selected[0] if selected else None,
        "source": "NCCL default (ib*, then not docker*/lo*)",
        "selected": selected,
    }


# ============================================================================ warnings
def warnings(
    environ: Mapping[str, str],
    *,
    network: Optional[Mapping[str, Any]] = None,
    available_backends: Optional[Sequence[str]] = None,
    gpu_count: Optional[int] = None,
    which: Optional[Callable[[str], Optional[str]]] = None,
) -> list[str]:
    """What in this launch environment will make a run hang or fail; [] when nothing does.

    Each warning is one sentence and a ``HINT:`` with the fix. ``network`` is a
    :func:`network_report` (computed with the real probes when None). A check whose input is
    None (``available_backends``, ``gpu_count``) is skipped. ``which`` finds a program (default:
    ``shutil.which`` on the environ's PATH).

    Example:
        >>> warnings({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
        ...          network={})
        []
        >>> found = warnings({"ONEDIST_BACKEND": "nccl"}, network={}, available_backends=["gloo"])
        >>> found  # doctest: +ELLIPSIS
        ["ONEDIST_BACKEND='nccl' is not available here (available: gloo)...]
    """
    if network is None:
        network = network_report(environ)
    if which is None:
        path = environ.get("PATH")

        def which(program: str) -> Optional[str]:
            return shutil.which(program, path=path)

    env = _detect(environ)
    found: list[str] = []
    found += srun_warnings(environ, env, which)
    found += _partial_environment_warnings(environ)
    found += _master_warnings(environ, env, network)
    found += _ifname_warnings(environ, env, network)
    found += _backend_warnings(environ, available_backends, gpu_count)
    found += kubernetes_warnings(environ)
    return found


def srun_warnings(
    environ: Mapping[str, str], env: Optional[ClusterEnv], which: Callable[[str], Optional[str]]
) -> list[str]:
    """The warning for a process of a SLURM job with several tasks that srun did not start."""
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    tasks = _int(environ, "SLURM_NTASKS", "SLURM_NPROCS")
    in_step = "SLURM_STEP_ID" in environ or "SLURM_STEPID" in environ
    # an sbatch script (or an salloc shell) has the job's variables but no step; another launcher
    # (torchrun, mpirun) inside the allocation is a launch too
    if not job or in_step or env is not None or tasks is None or tasks <= 1 or which("srun") is None:
        return []
    return [
        f"SLURM job {job} has {tasks} tasks but this process was not started by srun: a script "
        f"started like this runs as 1 process, not {tasks}; "
        "HINT: start it with `srun python train.py` or `srun onedist run train.py`"
    ]


def _partial_environment_warnings(environ: Mapping[str, str]) -> list[str]:
    found: list[str] = []
    values: dict[str, int] = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE"):
        text = environ.get(name)
        if text is None:
            continue
        try:
            values[name] = int(text)
        except ValueError:
            found.append(
                f"{name}={text!r} is not an integer, so the launcher environment is ignored; "
                f"HINT: unset {name} or set it to an integer"
            )
    fix = (
        "HINT: set RANK and WORLD_SIZE together (with MASTER_ADDR and MASTER_PORT) or neither; "
        "torchrun and onedist run set all of them"
    )
    for have, lack in (("RANK", "WORLD_SIZE"), ("WORLD_SIZE", "RANK")):
        if have in environ and lack not in environ:
            found.append(
                f"{have} is set but {lack} is not: an incomplete torchrun-style environment, on "
                f"which onedist.initialize fails; {fix}"
            )
    for index, size in (
        ("RANK", "WORLD_SIZE"),
        ("LOCAL_RANK", "LOCAL_WORLD_SIZE"),
        ("GROUP_RANK", "GROUP_WORLD_SIZE"),
    ):
        if index in values and size in values and not 0 <= values[index] < values[size]:
            found.append(
                f"{index}={values[index]} is outside 0..{size}-1 ({size}={values[size]}): the launcher "
                f"variables contradict each other; HINT: {index} must be below {size}; unset stale "
                "values left by an earlier launch (e.g. exported in a job script)"
            )
    if (
        "LOCAL_WORLD_SIZE" in values
        and "WORLD_SIZE" in values
        and values["LOCAL_WORLD_SIZE"] > values["WORLD_SIZE"]
    ):
        found.append(
            f"LOCAL_WORLD_SIZE={values['LOCAL_WORLD_SIZE']} is larger than "
            f"WORLD_SIZE={values['WORLD_SIZE']}: more processes on this node than in the whole job; "
            "HINT: unset stale launcher variables, or start with torchrun / onedist run, which set "
            "them consistently"
        )
    if values.get("WORLD_SIZE", 1) > 1 and "RANK" in values:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not environ.get(name):
                found.append(
                    f"RANK and WORLD_SIZE={values['WORLD_SIZE']} are set but {name} is not: env:// "
                    f"rendezvous cannot start; HINT: export MASTER_ADDR=<host of rank 0> "
                    "MASTER_PORT=<free port> on every rank, or start with torchrun / onedist run"
                )
    return found


def _master_warnings(
    environ: Mapping[str, str], env: Optional[ClusterEnv], network: Mapping[str, Any]
) -> list[str]:
    found: list[str] = []
    master = network.get("master_addr")
    if not master:
        return found
    source = network.get("master_addr_source", "MASTER_ADDR")
    named = master if source == "MASTER_ADDR" else f"{master} ({source})"
    slurm_fix = (
        '`export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)` under SLURM'
    )
    nnodes = _nnodes(environ, env)
    if source != "default" and nnodes is not None and nnodes > 1 and is_loopback(master):
        found.append(
            f"MASTER_ADDR={master} is a loopback address but the job spans {nnodes} nodes, so this "
            "will hang: other nodes cannot reach loopback; HINT: set MASTER_ADDR to the host name or IP "
            "of rank 0's node, reachable from every node (torchrun / onedist run --master-addr, or "
            f"{slurm_fix})"
        )
    if network.get("resolve_error"):
        found.append(
            f"MASTER_ADDR {named} does not resolve on this host ({network['resolve_error']}); "
            "HINT: use a host name every node can resolve, or rank 0's IP address, e.g. "
            f"{slurm_fix}"
        )
        return found
    if network.get("route_error"):
        found.append(
            f"MASTER_ADDR {named} is unreachable from this host: no route ({network['route_error']}); "
            "HINT: use an address of rank 0's node on a network this node shares (see the "
            "interfaces in `onedist info`)"
        )
        return found
    probe = network.get("master_probe")
    if probe and probe.get("reachable") is False:
        how = (
            f"ETIMEDOUT: no answer within {probe.get('timeout_s', CONNECT_TIMEOUT):g} s"
            if probe.get("result") == "timeout"
            else f"{probe.get('errno')}: {probe.get('detail')}"
        )
        found.append(
            f"MASTER_ADDR {named} port {probe.get('port')} is unreachable from this host ({how}): "
            "the rendezvous will wait until it times out; HINT: check that MASTER_ADDR is an address "
            "of rank 0's node on a network this node shares (not a public or container-internal "
            f"address) and that no firewall drops port {probe.get('port')}"
        )
    return found


def _ifname_warnings(
    environ: Mapping[str, str], env: Optional[ClusterEnv], network: Mapping[str, Any]
) -> list[str]:
    found: list[str] = []
    ifaces = network.get("interfaces")
    here = ", ".join(ifaces) if ifaces else "none listed"
    route_iface = network.get("interface")
    example = route_iface if route_iface else (next(iter(ifaces)) if ifaces else "eth0")
    gloo = network.get("gloo") or {}
    if gloo.get("source") == "GLOO_SOCKET_IFNAME" and gloo.get("missing"):
        missing = ", ".join(gloo["missing"])
        found.append(
            f"GLOO_SOCKET_IFNAME={gloo['interface']} names interface(s) that do not exist on this host "
            f"({missing}; interfaces here: {here}): gloo fails to start; HINT: `export "
            f"GLOO_SOCKET_IFNAME={example}` (the interface toward MASTER_ADDR), or unset it"
        )
    nccl = network.get("nccl") or {}
    if nccl.get("source") == "NCCL_SOCKET_IFNAME" and nccl.get("exists") is False:
        found.append(
            f"NCCL_SOCKET_IFNAME={nccl['interface']} matches no interface on this host (interfaces here: "
            f"{here}): NCCL fails with 'no socket interface found'; HINT: `export "
            f"NCCL_SOCKET_IFNAME={example}`; NCCL reads names as prefixes ('eth' matches eth0), "
            "'=eth0' is exact, '^docker,lo' excludes"
        )
    nnodes = _nnodes(environ, env)
    address = gloo.get("address")
    if (
        gloo.get("source") == "hostname"
        and nnodes is not None
        and nnodes > 1
        and address
        and is_loopback(address)
    ):
        found.append(
            f"this host's name {network.get('hostname')!r} resolves to the loopback address {address}, "
            f"which gloo binds to, but the job spans {nnodes} nodes: other nodes cannot connect and the "
            f"first collective hangs; HINT: `export GLOO_SOCKET_IFNAME={example}` (the interface "
            "toward MASTER_ADDR), or map the host name to its network address in /etc/hosts"
        )
    return found


def _backend_warnings(
    environ: Mapping[str, str], available_backends: Optional[Sequence[str]], gpu_count: Optional[int]
) -> list[str]:
    found: list[str] = []
    chosen = environ.get("ONEDIST_BACKEND")
    if chosen and chosen != "auto" and available_backends is not None and chosen not in available_backends:
        listed = ", ".join(available_backends) or "none"
        good = available_backends[0] if available_backends else "gloo"
        found.append(
            f"ONEDIST_BACKEND={chosen!r} is not available here (available: {listed}): "
            f"onedist.initialize('auto') will try it and fail; HINT: `export ONEDIST_BACKEND={good}` "
            f"(or `onedist run --backend {good}`), or unset it to choose automatically"
        )
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    # "" and "-1" hide every GPU on purpose: nothing to warn about
    if visible is not None and visible.strip() not in ("", "-1") and gpu_count == 0:
        found.append(
            f"CUDA_VISIBLE_DEVICES={visible} but torch sees no GPU (a CPU-only torch build, no "
            "driver, or device ids that do not exist on this node); HINT: check `nvidia-smi` and "
            "`python -c 'import torch; print(torch.version.cuda)'`, or unset CUDA_VISIBLE_DEVICES "
            "for a CPU run"
        )
    return found
