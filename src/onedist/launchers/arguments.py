"""The launch arguments, declared once: each one's name, type, default, torchrun flag, ``PET_*``
variable, ignite's name and rule.

Every front end is derived from this table: :func:`onedist.spawn`'s keywords and
:class:`~.spec.LaunchSpec`'s fields are its names in its order (``tests/test_architecture.py``
compares them), ``Parallel`` takes the arguments its :attr:`Argument.parallel` says, ``onedist
run``'s parser adds each :attr:`Argument.flags` (:func:`add_flags`) and :mod:`.pet` reads each
:attr:`Argument.variable`. A rule is a function of this module, written once and named by the
argument it bounds; the front ends' checks in :mod:`.spec` call it and word the error as their
users know it (spawn's, ignite's, a flag's or a ``PET_*`` variable's). ``tests/test_architecture.py``
fails on a launch argument listed elsewhere, or a bound on one compared anywhere else.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

from .._injection import ALLOWED as INJECTION_ALLOWED, ENV as INJECTION_ENV
from .._net import LOOPBACK, is_loopback
from .._recovery import ALLOWED as RECOVERY_ALLOWED, LIVE, MODES as RECOVERY_MODES
from ..errors import OnedistValueError

__all__ = [
    "AGREED",
    "ARGUMENTS",
    "ENDPOINT",
    "LAUNCH_ARGUMENTS",
    "RUN_ONLY_ARGUMENTS",
    "SHAPE",
    "START_METHODS",
    "Argument",
    "add_flags",
    "at_least_one",
    "from_keywords",
    "in_port_range",
    "known_start_method",
    "live_without_restarts",
    "min_not_above_max",
    "needs_c10d",
    "needed_with_nodes",
    "node_rank_below",
    "not_allowed",
    "not_negative",
    "numbered_by_rendezvous",
    "own_launcher_violation",
    "parallel_arguments",
    "recovery_mode",
    "rendezvous_conf",
]


#: how a worker process is made: multiprocessing's start methods (``onedist run``: "fork" forks
#: its workers from the launcher, the others start a new interpreter each)
START_METHODS = ("spawn", "fork", "forkserver")


# ============================================================================ the rules, once each
def at_least_one(value: int) -> bool:
    """``nproc_per_node`` and ``nnodes``: a count of processes or nodes."""
    return value >= 1


def not_negative(value: int) -> bool:
    """``max_restarts`` (and ``--node-rank`` before ``--nnodes`` bounds it)."""
    return value >= 0


def known_start_method(value: Any) -> bool:
    """``start_method``: how a worker process is made (:data:`START_METHODS`)."""
    return value in START_METHODS


def node_rank_below(node_rank: int, nnodes: int) -> bool:
    """``node_rank``: this node's index among ``nnodes``."""
    return 0 <= node_rank < nnodes


def in_port_range(port: int) -> bool:
    """``master_port``: a TCP port number (0, "any free port", is spelled None)."""
    return 1 <= port <= 65535


def needed_with_nodes(nnodes: int, value: Any) -> bool:
    """``master_addr`` and ``master_port`` on several nodes: every node must be given the same one,
    so None (pick one here) is refused."""
    return nnodes > 1 and value is None


def min_not_above_max(low: int, high: int) -> bool:
    """``nnodes`` as ``MIN:MAX`` (an elastic job): the fewest nodes it runs with, then the most."""
    return low <= high


def needs_c10d(nnodes: int, max_nnodes: int, rdzv_backend: str) -> bool:
    """``nnodes`` as ``MIN:MAX`` with ``MIN != MAX``: the nodes come and go, so they meet through
    torch's c10d rendezvous (``--rdzv-backend c10d``); the static one is refused."""
    return nnodes != max_nnodes and rdzv_backend != "c10d"


def numbered_by_rendezvous(nnodes: int, max_nnodes: int, rdzv_backend: str, node_rank: Any) -> bool:
    """Whether torch's c10d rendezvous numbers the nodes as they arrive (``onedist run``'s elastic
    launcher, :mod:`.elastic`): ``--rdzv-backend c10d`` with ``MIN != MAX``, or with several nodes
    and no ``--node-rank`` (as torchrun numbers them); with a ``--node-rank`` on every node, a fixed
    count stays static."""
    return rdzv_backend == "c10d" and (nnodes != max_nnodes or needed_with_nodes(nnodes, node_rank))


def rendezvous_conf(text: str) -> Optional[dict[str, str]]:
    """``--rdzv-conf``'s ``KEY=VALUE,...`` (torchrun's) as a dict; None when it is not that shape.

    Example:
        >>> rendezvous_conf("join_timeout=60,last_call_timeout=1"), rendezvous_conf(""), rendezvous_conf("x")
        ({'join_timeout': '60', 'last_call_timeout': '1'}, {}, None)
    """
    pairs = [item.partition("=") for item in text.split(",") if item.strip()]
    if any(not key.strip() or not sep for key, sep, _ in pairs):
        return None
    return {key.strip(): value.strip() for key, _, value in pairs}


def recovery_mode(value: Any) -> bool:
    """``recovery``: one of the modes (:data:`onedist._recovery.MODES`)."""
    return isinstance(value, str) and value in RECOVERY_MODES


def live_without_restarts(recovery: str, max_restarts: int) -> bool:
    """``recovery="live"`` replaces a dead rank at most ``max_restarts`` times: 0 would replace
    none, so it is refused (``max_restarts`` is an int >= 0 by its own rule)."""
    return recovery == LIVE and not max_restarts


def own_launcher_violation(backend: str, values: Mapping[str, Any]) -> Optional[tuple[str, str]]:
    """The first argument of ``values`` (a launch's, by name) that the backend's own launcher
    (mpirun, horovod.run, xmp.spawn: the processes of this host) cannot honour, and what it
    allows there; None when it can honour them all."""
    xla = backend == "xla-tpu"
    init_method = values["init_method"]
    for name, allowed, ok in (
        ("nnodes", "1", values["nnodes"] == 1),
        ("node_rank", "0", values["node_rank"] == 0),
        ("master_addr", "a loopback address ('127.0.0.1')", is_loopback(values["master_addr"])),
        ("master_port", "None", values["master_port"] is None),
        ("init_method", "None" if xla else "None or 'env://'",
         init_method is None or (not xla and init_method == "env://")),
        ("timeout", "None (XLA collectives take no timeout)", not xla or values["timeout"] is None),
        ("start_method", "'spawn'", xla or values["start_method"] == "spawn"),
    ):  # fmt: skip
        if not ok:
            return name, allowed
    return None


# ============================================================================ a PET_* variable's text
def not_allowed(name: str, value: Any, allowed: str) -> OnedistValueError:
    """``<name>=<value> is not allowed; allowed: ...``, with the HINT of a ``PET_*`` variable when
    ``name`` is one: the error of a flag or variable of ``onedist run``."""
    return OnedistValueError(f"{name}={value!r} is not allowed; allowed: {allowed}" + _variable_hint(name))


def _variable_hint(name: str) -> str:
    """The HINT line of an error about ``name`` when it is a ``PET_*`` variable (else nothing): in a
    pod, nobody typed it."""
    if not name.startswith("PET_"):
        return ""
    return (
        f"\nHINT: torchrun reads {name} as the default of its flag, and so does onedist run; fix or unset "
        "the variable (in a Kubernetes pod: the job's spec), or pass the flag, which wins"
    )


def _int(variable: str, text: str, allowed: str) -> int:
    """The variable's text as an int (its range is the argument's rule, checked with the flag's)."""
    try:
        return int(text)
    except ValueError:
        raise not_allowed(variable, text, allowed) from None


def _text(variable: str, text: str, allowed: str) -> Optional[str]:
    return text.strip() or None  # torchrun's default for --rdzv-endpoint is "": the same as unset


def _switch(variable: str, text: str, allowed: str) -> bool:
    # torchrun's check_env reads bool(int(value)); Kubeflow's elasticPolicy.standalone sets
    # PET_STANDALONE to "" to switch it on (training-operator pkg/controller.v1/pytorch/elastic.go)
    if not text.strip():
        return True
    try:
        return bool(int(text))
    except ValueError:
        raise not_allowed(variable, text, allowed) from None


def _tee(variable: str, text: str, allowed: str) -> str:
    if re.fullmatch(r"[0-3]|\d+:[0-3](,\d+:[0-3])*", text) is None:
        raise not_allowed(variable, text, allowed)
    return text


def _any(variable: str, text: str, allowed: str) -> str:
    return text


# ============================================================================ the declaration
@dataclass(frozen=True)
class Argument:
    """One launch argument, as every front end names, converts and checks it."""

    #: LaunchSpec's field, ``onedist run``'s dest (and spawn's keyword unless :attr:`keyword`)
    name: str
    #: the annotation of LaunchSpec's (or RunSpec's) field
    type: str
    #: spawn's default
    default: Any = None
    #: spawn's (and ignite's) keyword when it differs from :attr:`name`
    keyword: Optional[str] = None
    #: how ``Parallel`` takes it: "spawn" (a keyword of spawn mode, compared with an external
    #: launcher's value), "init" (a keyword of every mode), "spawn_kwargs" (in ``**spawn_kwargs``);
    #: None: ``run``'s ``func``, ``*args``, ``**kwargs``
    parallel: Optional[str] = None
    #: what the errors of spawn and Parallel say is allowed
    allowed: str = ""
    #: the function of this module that bounds the value alone
    rule: Optional[Callable[[Any], bool]] = None
    #: the functions of this module that bound it together with other arguments
    ties: tuple[Callable[..., bool], ...] = ()
    #: ``onedist run``'s option strings (torchrun's); empty: no flag
    flags: tuple[str, ...] = ()
    #: the ``PET_*`` variable torchrun reads as the flag's default; empty: none
    variable: str = ""
    #: torchrun's default, when neither the flag nor the variable is given
    run_default: Any = None
    #: what the flag (or variable) allows, when it is not :attr:`allowed`
    flag_allowed: Optional[str] = None
    #: the variable's text as the flag's value: ``(variable, text, allowed) -> value``
    from_text: Callable[[str, str, str], Any] = _any
    #: argparse's ``type`` of the flag (None: the text)
    cli_type: Optional[Callable[[str], Any]] = None
    #: a flag without a value (argparse's ``store_true``)
    switch: bool = False
    #: the flag's ``--help`` line
    help: str = ""

    @property
    def spawn_keyword(self) -> str:
        """The keyword :func:`onedist.spawn` (and ignite's ``spawn``) takes it by."""
        return self.keyword or self.name

    @property
    def flag(self) -> str:
        """The flag an error names (torchrun's dashed spelling)."""
        return "--" + self.name.replace("_", "-")

    @property
    def flag_text(self) -> str:
        """What the flag (or its variable) allows, as its errors say."""
        return self.flag_allowed or self.allowed

    def from_variable(self, text: str) -> Any:
        """The text of :attr:`variable` as the flag's value (an error names the variable)."""
        return self.from_text(self.variable, text, self.flag_text)


_RESTARTS = "an int >= 0 (how many times the workers are started again after one fails)"
_SWITCH = "an int (0 = off, anything else = on) or empty (on)"
_NNODES = "N or MIN:MAX with 1 <= MIN <= MAX (MIN != MAX: an elastic job, with --rdzv-backend c10d)"

#: :func:`onedist.spawn`'s arguments, in its order: :class:`~.spec.LaunchSpec`'s fields
LAUNCH_ARGUMENTS: tuple[Argument, ...] = (
    Argument("backend", "str", parallel="init", allowed="str, e.g. 'gloo', 'nccl' or 'auto'",
             flags=("--backend",),
             help="backend that initialize('auto') resolves to in the workers (sets ONEDIST_BACKEND)"),
    Argument("fn", "Callable[..., Any]", allowed="a callable fn(local_rank, *args, **kwargs)"),
    Argument("args", "tuple[Any, ...]", (), allowed="tuple of positional arguments for fn"),
    Argument("kwargs", "dict[str, Any]", keyword="kwargs_dict",
             allowed="dict of keyword arguments for fn, or None"),
    Argument("nproc_per_node", "int", 1, parallel="spawn", allowed="an int >= 1", rule=at_least_one,
             flags=("-n", "--nproc-per-node", "--nproc_per_node"), variable="PET_NPROC_PER_NODE",
             run_default="1", flag_allowed="an int >= 1, 'auto', 'cpu' or 'gpu'",
             help="workers on this node: a number, 'auto' (one per visible GPU, else 1), 'cpu' (one per "
             "CPU) or 'gpu' (one per visible GPU); default $PET_NPROC_PER_NODE, else 1"),
    Argument("nnodes", "int", 1, parallel="spawn", allowed="an int >= 1", rule=at_least_one,
             ties=(min_not_above_max, needs_c10d, numbered_by_rendezvous),
             flags=("--nnodes",), variable="PET_NNODES", run_default="1", flag_allowed=_NNODES,
             help="number of nodes: N, or MIN:MAX for an elastic job (nodes may leave and join; needs "
             "--rdzv-backend c10d); default $PET_NNODES, else 1"),
    Argument("node_rank", "int", 0, parallel="spawn", rule=not_negative, ties=(node_rank_below,),
             flags=("--node-rank", "--node_rank"), variable="PET_NODE_RANK", flag_allowed="an int >= 0",
             from_text=_int, cli_type=int, help="default $PET_NODE_RANK, else 0"),
    Argument("master_addr", "str", LOOPBACK, parallel="spawn", ties=(needed_with_nodes,),
             allowed="a host name or IP address (str)", flags=("--master-addr", "--master_addr"),
             variable="PET_MASTER_ADDR", run_default=LOOPBACK, from_text=_text,
             help=f"node 0's address; default $PET_MASTER_ADDR, else {LOOPBACK}"),
    Argument("master_port", "Optional[int]", parallel="spawn", rule=in_port_range,
             ties=(needed_with_nodes,),
             allowed="None (pick a free port) or an int in 1..65535",
             flags=("--master-port", "--master_port"), variable="PET_MASTER_PORT",
             flag_allowed="an int in 1..65535", from_text=_int, cli_type=int,
             help="rendezvous port; default $PET_MASTER_PORT, else a free port on 127.0.0.1 (one node)"),
    Argument("init_method", "Optional[str]", parallel="init",
             allowed="None, 'env://', 'tcp://host:port' or 'file:///path'"),
    Argument("timeout", "Optional[timedelta]", parallel="spawn_kwargs"),
    Argument("start_method", "str", "spawn", parallel="spawn_kwargs", rule=known_start_method,
             flags=("--start-method", "--start_method"), variable="PET_START_METHOD", run_default="fork",
             flag_allowed="'fork', 'spawn' or 'forkserver'",
             help="'fork' (default): each worker is forked from this launcher once it imported torch "
             "(where it runs one thread and sees no GPU; else as 'spawn'); 'spawn' or 'forkserver': each "
             "worker is a new interpreter (torchrun's workers), e.g. for a library that must not be loaded "
             "before a fork"),
    Argument("hosts", "Optional[str]", parallel="spawn_kwargs",
             allowed="a str 'host1:slots,host2:slots' (slots: an int >= 1)"),
    Argument("max_restarts", "int", 0, parallel="spawn_kwargs", allowed=_RESTARTS, rule=not_negative,
             flags=("--max-restarts", "--max_restarts"), variable="PET_MAX_RESTARTS", run_default=0,
             flag_allowed="an int >= 0", from_text=_int, cli_type=int,
             help="restart the workers (of every node) up to N times after a failure"),
    Argument("recovery", "str", "restart", parallel="spawn_kwargs", allowed=RECOVERY_ALLOWED,
             rule=recovery_mode, ties=(live_without_restarts,), flags=("--recovery",),
             run_default="restart",
             help="what a failed worker costs: 'restart' (every worker started again, --max-restarts) or "
             "'live' (the survivors keep running; the dead rank alone is started again and gets the state "
             "from a survivor; at most --max-restarts times; needs the loop under od.steps and --backend "
             "gloo)"),
)  # fmt: skip

#: ``onedist run``'s other torchrun flags (a script's launch has them, a function's has not)
RUN_ONLY_ARGUMENTS: tuple[Argument, ...] = (
    Argument("standalone", "bool", flags=("--standalone",), switch=True, variable="PET_STANDALONE",
             run_default=False, from_text=_switch, flag_allowed=_SWITCH,
             help="one node, free port on 127.0.0.1 (the default)"),
    Argument("rdzv_endpoint", "Optional[str]", flags=("--rdzv-endpoint", "--rdzv_endpoint"),
             variable="PET_RDZV_ENDPOINT", from_text=_text,
             flag_allowed="HOST[:PORT] (PORT 0, a free port, on one node only)",
             help="torchrun's HOST[:PORT] of node 0's store (port 29400 by default): "
             "--master-addr/--master-port"),
    Argument("rdzv_backend", "str", flags=("--rdzv-backend", "--rdzv_backend"), variable="PET_RDZV_BACKEND",
             run_default="static", flag_allowed="'static', 'c10d'",
             help="'static' (--node-rank on each node) or 'c10d' (torch's rendezvous at --rdzv-endpoint "
             "numbers the nodes as they arrive; with --nnodes MIN:MAX nodes may leave and join)"),
    Argument("rdzv_id", "Optional[str]", flags=("--rdzv-id", "--rdzv_id"), variable="PET_RDZV_ID",
             help="run id (TORCHELASTIC_RUN_ID); with c10d the id every node of the job gives"),
    Argument("rdzv_conf", "str", flags=("--rdzv-conf", "--rdzv_conf"), variable="PET_RDZV_CONF",
             run_default="", flag_allowed="KEY=VALUE,... (torch's c10d rendezvous settings, e.g. "
             "join_timeout=600,last_call_timeout=30,keep_alive_interval=5,keep_alive_max_attempt=3)",
             help="c10d rendezvous settings KEY=VALUE,... (torchrun's --rdzv-conf)"),
    Argument("role", "str", flags=("--role",), variable="PET_ROLE", run_default="default",
             help="the workers' ROLE_NAME (torchrun's --role)"),
    Argument("tee", "str", flags=("-t", "--tee"), variable="PET_TEE", run_default="0", from_text=_tee,
             flag_allowed="0, 1, 2, 3 or LOCAL_RANK:N,... with N in 0..3 (torchrun's --tee)",
             help="accepted for torchrun's command lines (TorchX passes it): the output is always shown "
             "here"),
    Argument("module", "bool", flags=("-m", "--module"), switch=True, variable="PET_MODULE",
             run_default=False, from_text=_switch, flag_allowed=_SWITCH,
             help="run the target as a module (python -m)"),
    Argument("inject_failure", "Optional[str]", flags=("--inject-failure",), flag_allowed=INJECTION_ALLOWED,
             help="rank=R,step=S[,signal=NAME][,restart=N]: rank R kills itself (SIGKILL) after its S-th "
             f"optimizer step, on the first attempt (restart=N: the N-th restart); sets {INJECTION_ENV}"),
)  # fmt: skip

#: the arguments that shape the world of a launch (checked as ints, one rule each)
SHAPE = ("nproc_per_node", "nnodes", "node_rank")
#: the arguments ``--rdzv-endpoint HOST[:PORT]`` gives together (a flag of either wins over it)
ENDPOINT = ("master_addr", "master_port")
#: the flags every node's ``onedist run`` must be given alike when the nodes agree on restarts
AGREED = ("nnodes", "max_restarts")

#: every declared argument, by name
ARGUMENTS: dict[str, Argument] = {a.name: a for a in (*LAUNCH_ARGUMENTS, *RUN_ONLY_ARGUMENTS)}


def parallel_arguments(how: str) -> tuple[str, ...]:
    """The names ``Parallel`` takes ``how`` (see :attr:`Argument.parallel`), in spawn's order."""
    return tuple(a.name for a in LAUNCH_ARGUMENTS if a.parallel == how)


def from_keywords(given: Mapping[str, Any]) -> dict[str, Any]:
    """spawn's keywords (``kwargs_dict``, ...) as the arguments' names; a keyword that is not
    there takes the argument's default."""
    return {a.name: given.get(a.spawn_keyword, a.default) for a in LAUNCH_ARGUMENTS}


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add the flag of every declared argument that has one to ``onedist run``'s ``parser``. Each
    defaults to None: :func:`~.pet.apply_pet_defaults` tells a flag that was given from one that
    was not, and fills the rest from the environment."""
    for a in ARGUMENTS.values():
        if not a.flags:
            continue
        if a.switch:
            parser.add_argument(*a.flags, dest=a.name, action="store_true", default=None, help=a.help)
        elif a.cli_type is not None:
            parser.add_argument(*a.flags, dest=a.name, type=a.cli_type, default=None, help=a.help)
        else:
            parser.add_argument(*a.flags, dest=a.name, default=None, help=a.help)
