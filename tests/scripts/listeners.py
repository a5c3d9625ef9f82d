"""Each rank writes the TCP addresses its process listens on to OUT_DIR/<rank>.json, after one collective.

python listeners.py OUT_DIR            # under onedist run / torchrun
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import onedist as od
from netutil import listening


def main(local_rank: int, out_dir: str) -> None:
    od.all_reduce(1)
    info = {"rank": od.get_rank(), "listening": listening(os.getpid()), "pid": os.getpid()}
    with open(os.path.join(out_dir, f"{od.get_rank()}.json"), "w") as f:
        json.dump(info, f)
    od.barrier()


if __name__ == "__main__":
    with od.Parallel(backend="gloo") as parallel:
        parallel.run(main, sys.argv[1])
