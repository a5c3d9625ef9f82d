"""``onedist run``'s launch arguments, checked in one place: :class:`RunSpec` and its checks.

The flags are torchrun's, each defaulting to its ``PET_*`` variable (:mod:`.pet` converts the
variable's text) and declared with its rules in :mod:`.arguments`. :func:`check_run_values` checks
each value (every run needs it, in place under srun or mpirun too); :meth:`RunSpec.build` checks
them together for a run that starts workers here. An error names the flag, or the variable the
value came from (``onedist run: <error>``, exit 2). The other front ends' checks (``spawn``,
``Parallel``) are :mod:`.spec`'s; ``tests/test_architecture.py`` fails on a check of a launch
argument anywhere else.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import os
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from .._injection import parse as parse_injection
from .._net import LOOPBACK
from .._recovery import LIVE, SUPPORTED_BACKENDS as SUPPORTED_RECOVERY_BACKENDS
from ..errors import BackendUnavailableError, OnedistValueError
from .arguments import (
    ARGUMENTS,
    at_least_one,
    in_port_range,
    known_start_method,
    live_without_restarts,
    min_not_above_max,
    needed_with_nodes,
    needs_c10d,
    node_rank_below,
    not_allowed,
    numbered_by_rendezvous,
    recovery_mode,
    rendezvous_conf,
)
from .pet import flag_or_variable

__all__ = ["RunSpec", "check_run_nproc_against", "check_run_values", "run_command", "visible_gpus"]


@dataclass(frozen=True)
class RunSpec:
    """What ``onedist run`` starts on this node, after its checks: torchrun's flags as typed
    values, each given, taken from its ``PET_*`` variable, or torchrun's default. ``command``: a
    worker's arguments after ``python`` (``script.py ...`` or ``-m module ...``); ``run_id``: the
    run's ``TORCHELASTIC_RUN_ID``, one for every attempt. Build one with :meth:`build`."""

    command: tuple[str, ...]
    nproc_per_node: int
    run_id: str
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = LOOPBACK
    master_port: Optional[int] = None
    max_restarts: int = 0
    backend: Optional[str] = None
    role: str = "default"
    inject_failure: Optional[str] = None
    recovery: str = "restart"
    start_method: str = "fork"

    @classmethod
    def build(cls, args: argparse.Namespace, nproc: int) -> RunSpec:
        """The spec of a run that starts its workers here, from ``onedist run``'s parsed flags
        after :func:`check_run_values` (which gave ``nproc``): the node flags checked together
        (``--rdzv-endpoint`` as address and port), and ``--backend`` checked before any worker
        starts rather than in each of them.

        Raises:
            OnedistValueError: a flag (or its ``PET_*`` variable) is not allowed with the others.
            BackendUnavailableError: ``--backend`` cannot run here.

        Example:
            >>> from onedist.launchers.pet import apply_pet_defaults
            >>> from onedist.launchers.run import build_parser
            >>> argv = ["--rdzv-endpoint", "node0", "--nnodes", "2", "--node-rank", "1", "-n", "4",
            ...         "-m", "pkg.train", "--lr", "0.1"]
            >>> args = build_parser().parse_args(argv)
            >>> args.from_environment = apply_pet_defaults(args, {"PET_MAX_RESTARTS": "3"})
            >>> spec = RunSpec.build(args, check_run_values(args))
            >>> spec.command, spec.master_addr, spec.master_port, spec.world_size, spec.max_restarts
            (('-m', 'pkg.train', '--lr', '0.1'), 'node0', 29400, 8, 3)
        """
        _check_run_nodes(args)
        _check_run_recovery(args, nproc)
        _check_run_backend(args.backend, args.nnodes, nproc)
        # each field that is a declared argument takes its flag's value
        flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.name in ARGUMENTS}
        run_id = args.rdzv_id or f"onedist-{uuid.uuid4().hex[:12]}"
        return cls(**{**flags, "nproc_per_node": nproc}, command=run_command(args), run_id=run_id)

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def run_command(args: argparse.Namespace) -> tuple[str, ...]:
    """What ``onedist run`` runs, as the arguments after ``python``: ``script.py ...`` or
    ``-m module ...``; the same in place (under srun, mpirun) as in the workers it starts."""
    target = ("-m", args.target) if args.module else (args.target,)
    return (*target, *args.args)


def visible_gpus(environ: Optional[dict[str, str]] = None) -> int:
    """GPUs this process may use, without importing torch (CUDA_VISIBLE_DEVICES or /dev/nvidiaN)."""
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return len(glob.glob("/dev/nvidia[0-9]*"))


def check_run_values(args: argparse.Namespace) -> int:
    """Each launch flag's value (typed, or taken from its ``PET_*`` variable), converted in place
    (``--nnodes`` to an int); the number of workers ``--nproc-per-node`` asks for. The rules that
    tie flags together are :meth:`RunSpec.build`'s, for the runs that start workers."""
    nproc = _run_nproc(args)
    low, _, high = str(args.nnodes).strip().partition(":")  # Kubeflow's elasticPolicy sets "min:max"
    high = high or low
    numbers = low.isdigit() and high.isdigit() and at_least_one(int(low))
    if not numbers or not min_not_above_max(int(low), int(high)):
        raise _run_error(args, "nnodes", args.nnodes, ARGUMENTS["nnodes"].flag_text)
    if needs_c10d(int(low), int(high), args.rdzv_backend):  # refused at once, in place too
        raise OnedistValueError(
            f"{flag_or_variable(args, 'nnodes')}={args.nnodes} is not allowed with "
            f"{flag_or_variable(args, 'rdzv_backend')}={args.rdzv_backend}; allowed: N, or MIN:MAX with "
            "--rdzv-backend c10d (nodes that leave and join meet again through torch's c10d rendezvous)"
            "\nHINT: add --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID, alike on every node"
        )
    args.nnodes, args.max_nnodes = int(low), int(high)
    for flag in ARGUMENTS.values():  # the int flags, each by its own rule
        value = getattr(args, flag.name, None)
        if flag.cli_type is int and value is not None and flag.rule is not None and not flag.rule(value):
            raise _run_error(args, flag.name, value, flag.flag_text)
    if args.rdzv_backend not in ("static", "c10d"):
        raise _run_error(args, "rdzv_backend", args.rdzv_backend, ARGUMENTS["rdzv_backend"].flag_text)
    if args.inject_failure is not None:
        parse_injection(args.inject_failure, "--inject-failure")  # its error names the flag
    if args.start_method is None:
        args.start_method = ARGUMENTS["start_method"].run_default
    if not known_start_method(args.start_method):
        raise _run_error(args, "start_method", args.start_method, ARGUMENTS["start_method"].flag_text)
    if args.recovery is None:  # no PET_* variable: torchrun has no such flag
        args.recovery = ARGUMENTS["recovery"].run_default
    if not recovery_mode(args.recovery):
        raise _run_error(args, "recovery", args.recovery, ARGUMENTS["recovery"].flag_text)
    return nproc


def _run_error(args: argparse.Namespace, dest: str, value: Any, allowed: str) -> OnedistValueError:
    """:func:`~.pet.not_allowed` naming the flag, or the ``PET_*`` variable the value came from."""
    return not_allowed(flag_or_variable(args, dest), value, allowed)


def _run_nproc(args: argparse.Namespace) -> int:
    """The number of workers ``--nproc-per-node`` asks for (a number, 'auto', 'cpu' or 'gpu')."""
    value = str(args.nproc_per_node)
    if value == "auto":
        return max(1, visible_gpus())
    if value == "cpu":  # as torchrun: one per CPU the OS reports
        return os.cpu_count() or 1
    if value == "gpu":
        if visible_gpus() < 1:
            raise _run_error(args, "nproc_per_node", value, "an int >= 1, 'auto', 'cpu' (no GPU is visible)")
        return visible_gpus()
    if not value.strip().isdigit() or not at_least_one(int(value)):
        raise _run_error(args, "nproc_per_node", value, ARGUMENTS["nproc_per_node"].flag_text)
    return int(value)


def _check_run_nodes(args: argparse.Namespace) -> None:
    """The node flags together, for a run that starts workers: ``--node-rank`` given (0 by default)
    and below ``--nnodes``, ``--rdzv-endpoint`` as master address and port, a fixed port for
    several nodes. After :func:`check_run_values`; for :meth:`RunSpec.build`."""
    name = functools.partial(flag_or_variable, args)
    args.elastic = numbered_by_rendezvous(args.nnodes, args.max_nnodes, args.rdzv_backend, args.node_rank)
    if args.elastic:
        return _check_run_elastic(args)
    if args.node_rank is None:
        args.node_rank = 0
    if args.rdzv_endpoint is not None:
        _run_endpoint(args)
    if not node_rank_below(args.node_rank, args.nnodes):
        raise OnedistValueError(
            f"{name('node_rank')}={args.node_rank} is not allowed with "
            f"{name('nnodes')}={args.nnodes}; allowed: 0..{args.nnodes - 1}"
        )
    if needed_with_nodes(args.nnodes, args.master_port):
        raise OnedistValueError(
            "--master-port is needed with --nnodes > 1 (every node must use the same one); "
            "pass --master-addr=<node 0's address> --master-port=<free port on node 0> on every node"
        )


def _check_run_elastic(args: argparse.Namespace) -> None:
    """A run whose nodes torch's c10d rendezvous numbers (:mod:`.elastic`): its endpoint (a fixed
    port), no ``--node-rank``, settings of the ``KEY=VALUE`` shape, ``--recovery restart``."""
    with_c10d = " with --rdzv-backend c10d, which numbers the nodes as they arrive"
    if args.node_rank is not None:
        raise _run_error(args, "node_rank", args.node_rank, "none" + with_c10d)
    if args.rdzv_endpoint is None:
        raise _run_error(args, "rdzv_endpoint", None, "HOST:PORT of the rendezvous store's node" + with_c10d)
    if args.recovery == LIVE:  # a replacement joins a group whose size is fixed
        raise _run_error(args, "recovery", LIVE, "'restart'" + with_c10d + " (--nnodes MIN:MAX)")
    if rendezvous_conf(args.rdzv_conf) is None:
        raise _run_error(args, "rdzv_conf", args.rdzv_conf, ARGUMENTS["rdzv_conf"].flag_text)
    _run_endpoint(args, args.max_nnodes)
    args.node_rank, args.rdzv_id = 0, args.rdzv_id or "none"  # torchrun's default run id


def _run_endpoint(args: argparse.Namespace, nodes: Optional[int] = None) -> None:
    """``--rdzv-endpoint HOST[:PORT]`` as ``--master-addr`` and ``--master-port``."""
    if args.master_port is not None or args.master_addr != LOOPBACK:
        raise OnedistValueError(
            "--rdzv-endpoint and --master-addr/--master-port name the same thing: pass one"
        )
    host, colon, port = args.rdzv_endpoint.rpartition(":")
    if not colon:  # torchrun's default port
        host, port = args.rdzv_endpoint, "29400"
    number = int(port) if port.isdigit() else -1  # 0: a free port, spelled None as master_port
    port_ok = number == 0 or in_port_range(number)
    if not host or not port_ok or needed_with_nodes(nodes or args.nnodes, number or None):
        raise _run_error(args, "rdzv_endpoint", args.rdzv_endpoint, ARGUMENTS["rdzv_endpoint"].flag_text)
    # port 0: a free one, as torchrun picks (TorchX's dist.ddp passes localhost:0 on one node)
    args.master_addr, args.master_port = host, int(port) or None


def check_run_nproc_against(nproc: int, env: Any) -> None:
    """``--nproc-per-node`` under a launcher ``env`` that started this process (its workers exist)."""
    if nproc > 1 and env.nproc_per_node not in (None, nproc):
        raise OnedistValueError(
            f"--nproc-per-node={nproc} disagrees with the {env.name} launcher that started this "
            f"process ({env.nproc_per_node} per node); it started the workers already: drop the flag"
        )


def _check_run_recovery(args: argparse.Namespace, nproc: int) -> None:
    """``--recovery live`` with what it needs: restarts left to replace a rank with, one node, and
    a backend whose group can be made again (gloo, shm); refused before any worker starts."""
    if args.recovery != LIVE:
        return
    if live_without_restarts(args.recovery, args.max_restarts):
        restarts = flag_or_variable(args, "max_restarts")
        raise OnedistValueError(
            f"--recovery=live replaces a dead rank at most --max-restarts times: {restarts}="
            f"{args.max_restarts} is not allowed with it; allowed: an int >= 1"
        )
    if args.nnodes != 1:
        raise OnedistValueError(
            f"--recovery=live is not allowed with {flag_or_variable(args, 'nnodes')}={args.nnodes}; "
            "allowed: 1 (one node: its launcher starts the replacement)"
        )
    from ..context import resolve_backend_name

    name = resolve_backend_name(args.backend or "auto", args.nnodes, nproc)
    if name not in SUPPORTED_RECOVERY_BACKENDS:
        raise OnedistValueError(
            f"--recovery=live is not allowed with backend {name!r}"
            f"{'' if args.backend else ' (what --backend auto resolves to here)'}; allowed: "
            f"{', '.join(repr(b) for b in SUPPORTED_RECOVERY_BACKENDS)} (a group made again with a "
            "replacement on the same store; nccl, mpi, horovod and xla-tpu are not)\n"
            "HINT: pass --backend gloo (or shm: one host's ranks)"
        )


def _check_run_backend(backend: Optional[str], nnodes: int, nproc: int) -> None:
    """``--backend``: a name the workers' ``initialize`` will take (``auto`` resolved as it will
    be there), checked before any worker starts rather than in each of them."""
    if backend:
        from ..context import backend_class, resolve_backend_name

        try:
            backend_class(resolve_backend_name(backend, nnodes, nproc))
        except BackendUnavailableError as e:  # initialize's words, after the flag's
            raise BackendUnavailableError(f"--backend={backend!r} cannot start the workers: {e}") from None
