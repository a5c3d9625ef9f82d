"""onedist broken on purpose: the proof that a foreign-suite run judged against a recorded control
(:mod:`reference`) still catches a regression.

Each runner that uses a recorded control first runs a few tests with one of these breaks in
onedist's side and fails unless they fail (its "self-check" line); ``--sabotage`` breaks the whole
run the same way.
"""

from __future__ import annotations

from typing import Any

#: what a runner sets in onedist's side of a sabotaged run
ENV_VAR = "ONEDIST_SUITE_SABOTAGE"


def break_onedist_api() -> None:
    """``get_world_size()`` answers one more than the truth, through the names ignite's modules
    take from onedist (``ignite.distributed.get_world_size`` is onedist's: onedist.ignite_alias)."""
    import onedist

    real = onedist.get_world_size

    def one_too_many() -> int:
        return int(real()) + 1

    onedist.get_world_size = one_too_many


def break_shm_group() -> None:
    """onedist's shm group gathers each rank's input plus 1 (``all_gather``): wrong values, and no
    error anywhere (torch's all_gather tests compare the values; most of its all_reduce tests do
    not, at torch 2.13)."""
    from onedist.backends.shm.group import ShmProcessGroup

    real = ShmProcessGroup.allgather

    def allgather(self: Any, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        for t in inputs:
            t.add_(1)
        return real(self, outputs, inputs) if opts is None else real(self, outputs, inputs, opts)

    ShmProcessGroup.allgather = allgather  # type: ignore[method-assign]
