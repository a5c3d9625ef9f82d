"""A rank of a :class:`launchpool.LaunchPool`: started by a real launcher (mpirun, horovodrun),
it initialises onedist with the launcher's environment, connects back to the test process and
runs the checks it is sent until told to stop.

Usage: ``<launcher> python pool_worker.py HOST PORT AUTHKEY_HEX BACKEND``
"""

from __future__ import annotations

import sys
import traceback
from multiprocessing.connection import Client


def main() -> None:
    host, port, authkey, backend = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3]), sys.argv[4]
    import torch

    import onedist as od
    from distpool import serve

    torch.set_num_threads(1)
    conn = Client((host, port), authkey=authkey)
    try:
        od.initialize(backend, timeout=120)
    except BaseException:
        conn.send(("init-failed", traceback.format_exc()))
        raise
    conn.send(("ready", od.get_rank()))
    serve(conn)  # tests/ is on PYTHONPATH: the pool's loop, shared with distpool's forked ranks
    od.finalize()
    conn.close()


if __name__ == "__main__":
    main()
