"""Where rank, local rank, world size and the node layout come from: the launcher's environment.

"Environment" here means what the launcher that started this process left in ``os.environ``.
Every function is a pure function of an ``environ`` mapping, so it is tested with plain dicts
and, for real, under the launchers that set the variables.

This module reads the variables of torchrun / ``torch.distributed.launch`` (elastic) and of
:func:`onedist.spawn`, which sets the same names. SLURM, Open MPI / PMI, Horovod and LSF
environments are parsed by the launcher layer (see docs/architecture.md).

Example:
    >>> from onedist.environments import layout_from_environ
    >>> env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
    ...        "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"}
    >>> layout_from_environ(env, rank=3, world_size=4)
    PartialLayout(local_rank=0, nproc_per_node=1, node_rank=1, nnodes=2)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

__all__ = ["PartialLayout", "launched_externally", "layout_from_environ"]


@dataclass(frozen=True)
class PartialLayout:
    """What the environment says about this process's place on its node; ``None`` = unknown."""

    local_rank: Optional[int] = None
    nproc_per_node: Optional[int] = None
    node_rank: Optional[int] = None
    nnodes: Optional[int] = None

    def complete(self) -> bool:
        """True when every field is known."""
        return None not in (self.local_rank, self.nproc_per_node, self.node_rank, self.nnodes)


def _int(environ: Mapping[str, str], name: str) -> Optional[int]:
    value = environ.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        return None


def launched_externally(environ: Mapping[str, str]) -> bool:
    """True when a launcher (torchrun, ``onedist.spawn`` workers, ...) set RANK and WORLD_SIZE.

    Example:
        >>> launched_externally({"RANK": "0", "WORLD_SIZE": "2"})
        True
        >>> launched_externally({})
        False
    """
    return _int(environ, "RANK") is not None and _int(environ, "WORLD_SIZE") is not None


def layout_from_environ(environ: Mapping[str, str], rank: int, world_size: int) -> PartialLayout:
    """Read the node layout of this process from torchrun-style variables.

    The variables are only trusted when the RANK / WORLD_SIZE they come with (if present) match
    the live process group, so a stale environment (a group built by hand with other ranks) is
    ignored instead of producing wrong local ranks.

    Args:
        environ: the environment, usually ``os.environ``.
        rank: rank of this process in the live default group.
        world_size: size of the live default group.

    Returns:
        The fields the environment determines; the others are ``None``.

    Example:
        >>> layout_from_environ({"LOCAL_RANK": "1"}, rank=1, world_size=2)
        PartialLayout(local_rank=1, nproc_per_node=None, node_rank=None, nnodes=None)
    """
    env_rank = _int(environ, "RANK")
    env_world = _int(environ, "WORLD_SIZE")
    if (env_rank is not None and env_rank != rank) or (env_world is not None and env_world != world_size):
        return PartialLayout()

    local_rank = _int(environ, "LOCAL_RANK")
    nproc = _int(environ, "LOCAL_WORLD_SIZE")
    node_rank = _int(environ, "GROUP_RANK")
    if node_rank is None:
        node_rank = _int(environ, "NODE_RANK")
    nnodes = _int(environ, "GROUP_WORLD_SIZE")

    if local_rank is not None and not 0 <= local_rank < world_size:
        local_rank = None
    if nproc is not None and not 1 <= nproc <= world_size:
        nproc = None
    if local_rank is not None and nproc is not None and local_rank >= nproc:
        local_rank = nproc = None
    if nnodes is not None and not 1 <= nnodes <= world_size:
        nnodes = None
    if node_rank is not None and (node_rank < 0 or (nnodes is not None and node_rank >= nnodes)):
        node_rank = None
    if (nproc is not None and nproc == world_size) or nnodes == 1:
        # every rank is on this node: the rest follows without asking anyone
        nproc, nnodes, node_rank = world_size, 1, 0
    return PartialLayout(local_rank, nproc, node_rank, nnodes)
