"""torchrun's ``PET_*`` variables as the defaults of ``onedist run``'s flags, as torchrun reads them.

torchrun declares most flags with ``action=env`` (``torch/distributed/argparse_util.py``): the flag
``--foo-bar`` defaults to the variable ``PET_FOO_BAR``, and a flag on the command line wins over
it. Kubernetes operators start torchrun with only these variables set (Kubeflow Trainer v2 sets
``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``,
``PET_MASTER_PORT`` and no flag), so ``onedist run`` reads the same variables for the same flags.
Each variable and its conversion are declared with its flag (``launchers/arguments.py``); every
value is converted here and checked with its flag's rules (``launchers/run_spec.py``); a bad one is
named with its variable, so a typo in a pod spec does not surface as a message about a flag nobody
typed.

Example:
    >>> import argparse
    >>> args = argparse.Namespace(nproc_per_node=None, nnodes="2", node_rank=None)
    >>> taken = apply_pet_defaults(args, {"PET_NPROC_PER_NODE": "2", "PET_NNODES": "4"})
    >>> (args.nproc_per_node, args.nnodes, args.node_rank, taken)
    ('2', '2', None, {'nproc_per_node': 'PET_NPROC_PER_NODE'})
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from .arguments import ARGUMENTS, ENDPOINT, Argument, not_allowed

__all__ = [
    "IGNORED",
    "PET_FLAGS",
    "apply_pet_defaults",
    "flag_or_variable",
    "ignored_variables",
]

#: onedist run's flags that torchrun reads from a ``PET_*`` variable when the flag is not given
#: (torch/distributed/run.py, ``action=env`` / ``check_env``), by dest: the declared arguments
#: with a :attr:`~.arguments.Argument.variable` (launchers/arguments.py)
PET_FLAGS: dict[str, Argument] = {a.name: a for a in ARGUMENTS.values() if a.variable}

#: torchrun's other ``PET_*`` variables: their flags change how torchrun's agent logs, waits or
#: binds, which onedist run does its own way; a set one is reported, not silently dropped
IGNORED = (
    "PET_MONITOR_INTERVAL",
    "PET_START_METHOD",
    "PET_EVENT_LOG_HANDLER",
    "PET_RUN_PATH",
    "PET_LOG_DIR",
    "PET_REDIRECTS",
    "PET_LOCAL_RANKS_FILTER",
    "PET_DUPLICATE_STDOUT_FILTERS",
    "PET_DUPLICATE_STDERR_FILTERS",
    "PET_LOCAL_ADDR",
    "PET_SIGNALS_TO_HANDLE",
    "PET_SHUTDOWN_TIMEOUT",
    "PET_VIRTUAL_LOCAL_RANK",
)


def apply_pet_defaults(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, str]:
    """Fill each flag of :data:`PET_FLAGS` that is None in ``args`` (not given) from its variable,
    else torchrun's default; returns ``{dest: variable}`` for the values taken from the environment.

    Raises OnedistValueError naming the variable, its value and what is allowed for a bad value,
    and for ``PET_NO_PYTHON`` switched on (the target would be a program, not a Python script).
    Between ``--rdzv-endpoint`` and ``--master-addr``/``--master-port`` a flag wins over a
    variable, and of two variables ``PET_RDZV_ENDPOINT`` wins, as in torchrun.

    Example:
        >>> import argparse
        >>> args = argparse.Namespace(master_addr="node0", master_port=None, rdzv_endpoint=None)
        >>> apply_pet_defaults(args, {"PET_MASTER_PORT": "29500", "PET_RDZV_ENDPOINT": "ep:1"})
        {'master_port': 'PET_MASTER_PORT'}
        >>> (args.master_addr, args.master_port, args.rdzv_endpoint)
        ('node0', 29500, None)
    """
    if environ.get("PET_NO_PYTHON", "0").strip() not in ("", "0"):
        value = environ["PET_NO_PYTHON"]
        raise not_allowed("PET_NO_PYTHON", value, "0 or unset (onedist run starts Python scripts)")
    given = {dest for dest in PET_FLAGS if getattr(args, dest, None) is not None}
    taken: dict[str, str] = {}
    for dest, flag in PET_FLAGS.items():
        if not hasattr(args, dest) or dest in given:
            continue
        value = flag.run_default
        if flag.variable in environ:
            parsed = flag.from_variable(environ[flag.variable])
            if parsed is not None:
                value = parsed
                taken[dest] = flag.variable
        setattr(args, dest, value)
    master_given = given & set(ENDPOINT)
    if "rdzv_endpoint" in taken and master_given:
        args.rdzv_endpoint = None  # the flag the user typed wins over the pod's variable
        del taken["rdzv_endpoint"]
    elif getattr(args, "rdzv_endpoint", None) is not None and not master_given:
        for dest in ENDPOINT:  # torchrun uses the endpoint when it has one
            if dest in taken:
                setattr(args, dest, PET_FLAGS[dest].run_default)
                del taken[dest]
    return taken


def flag_or_variable(args: argparse.Namespace, dest: str) -> str:
    """How to name the source of ``args.<dest>`` in a message: its ``PET_*`` variable when the
    value came from there (``args.from_environment``), else its flag.

    Example:
        >>> import argparse
        >>> args = argparse.Namespace(from_environment={"nnodes": "PET_NNODES"})
        >>> flag_or_variable(args, "nnodes"), flag_or_variable(args, "node_rank")
        ('PET_NNODES', '--node-rank')
    """
    taken: dict[str, str] = getattr(args, "from_environment", {})
    return taken.get(dest) or ARGUMENTS[dest].flag


def ignored_variables(environ: Mapping[str, str]) -> list[str]:
    """The :data:`IGNORED` variables that are set, in that order.

    Example:
        >>> ignored_variables({"PET_LOG_DIR": "/tmp/logs", "PET_NNODES": "2"})
        ['PET_LOG_DIR']
    """
    return [name for name in IGNORED if name in environ]
