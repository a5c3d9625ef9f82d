"""A onedist script under torchrun whose rank 1 fails (tests/test_launch.py).

    torchrun --standalone --nproc-per-node 2 launchpage_torchrun.py OUT_DIR raise|exit|kill

Every rank writes ``OUT_DIR/<rank>.json`` once the group formed: ``OMP_NUM_THREADS`` and torch's
thread count, and whether this process or its parent (torchrun's agent) holds the socket that
listens on ``MASTER_PORT`` (the rendezvous store). Then rank 1 raises ``ValueError``, calls
``sys.exit(3)`` or SIGKILLs itself while rank 0 waits in a barrier.
"""

import json
import os
import signal
import sys

import torch

import onedist as od


def _listening_sockets(port: int) -> set[str]:
    """The inodes of the sockets that listen on ``port`` (/proc/net/tcp and tcp6)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    inodes.add(inode)
    return inodes


def _holds(pid: int, inodes: set[str]) -> bool:
    """Whether process ``pid`` has one of the sockets ``inodes`` open."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[len("socket:[") : -1] in inodes:
            return True
    return False


def main(local_rank: int, out: str, how: str) -> None:
    store = _listening_sockets(int(os.environ["MASTER_PORT"]))
    facts = {
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "threads": torch.get_num_threads(),
        "store_listener_here": _holds(os.getpid(), store),
        "store_listener_parent": _holds(os.getppid(), store),
    }
    with open(os.path.join(out, f"{od.get_rank()}.json"), "w") as f:
        json.dump(facts, f)
    od.barrier()
    if od.get_rank() == 1:
        if how == "raise":
            raise ValueError("rank 1 failed on purpose")
        if how == "exit":
            sys.exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    od.barrier()


if __name__ == "__main__":
    with od.Parallel(backend="gloo") as parallel:
        parallel.run(main, sys.argv[1], sys.argv[2])
