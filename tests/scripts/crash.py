"""agree.py under every launcher, plus a record of every process that runs this file.

    python crash.py OUT_DIR [NPROC]     # Parallel spawns NPROC workers
    onedist run / torchrun / srun / mpirun ... crash.py OUT_DIR

Each process that runs (or, as a spawned worker, imports) this file first writes OUT_DIR/pids/<pid>
(its start time, then its argv): the test checks that every one of them is gone once the launcher
has returned, even a worker whose cmdline does not name OUT_DIR (multiprocessing's spawn_main).
Failing on purpose is agree.py's: AGREE_FAIL_RANK / AGREE_FAIL_HOW (raise | exit | kill) after the
first collectives, with OUT_DIR/failed_at holding the time of the failure, while the other ranks
wait in a barrier.
"""

import os
import sys


def _start_time() -> str:
    """This process's start time (field 22 of /proc/self/stat): tells a reused pid from this one."""
    try:
        with open("/proc/self/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


if len(sys.argv) > 1:  # in a spawned worker sys.argv is the parent's, set before this import
    _pids = os.path.join(sys.argv[1], "pids")
    os.makedirs(_pids, exist_ok=True)
    with open(os.path.join(_pids, str(os.getpid())), "w") as _f:
        _f.write(_start_time() + "\n" + " ".join(sys.argv) + "\n")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import agree  # noqa: E402

import onedist as od  # noqa: E402

if __name__ == "__main__":
    nproc = int(sys.argv[2]) if len(sys.argv) > 2 else None
    with od.Parallel(backend="gloo", nproc_per_node=nproc) as parallel:
        parallel.run(agree.main, sys.argv[1])
