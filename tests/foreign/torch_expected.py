"""What torch's distributed tests may not pass on onedist's backends, each with its reason.

``EXEMPT``: tests that cannot apply to a backend, keyed by test name (every pass) or
``<pass>::<test>``; each entry is ``(backends, reason)``, backends a space-separated list of
``shm``/``mpi4py``.

``KNOWN_FAILURES``: failures not yet fixed, keyed by ``<pass>::<test>`` (passes: fork-ws2,
fork-ws3, mpirun-ws2; see torch_suite.py), ``(backends, reason)``. Strict: a listed test that
passes fails the run, so this list only shrinks.
"""

from __future__ import annotations

_MONITORED = (
    "shm mpi4py",
    "torch implements monitored_barrier for gloo only: dist.monitored_barrier raises 'only "
    "implemented for GLOO backend' for any other backend name, before the backend is asked",
)

EXEMPT: dict[str, tuple[str, str]] = {
    "test_monitored_barrier_gloo": _MONITORED,
    "test_monitored_barrier_gloo_rank_0_timeout": _MONITORED,
    "test_monitored_barrier_gloo_subgroup": _MONITORED,
}

KNOWN_FAILURES: dict[str, tuple[str, str]] = {}
