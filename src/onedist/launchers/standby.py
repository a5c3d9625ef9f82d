"""A spare worker of ``onedist run --recovery live``: started ahead, it imports torch and onedist,
then waits; when a rank dies, the launcher hands it that rank's variables and it runs the script
as that rank (:mod:`.bootstrap`). The replacement then skips Python's and torch's start-up, the
largest part of a new worker's.

``python -m onedist.launchers.standby script.py args...`` reads one line of JSON on stdin, the
variables to set (``RANK``, ``LOCAL_RANK``, ``MASTER_PORT``, its generation, ...), and runs the
script with them; end of input (the launcher is done with it) ends it quietly.
"""

from __future__ import annotations

import json
import os
import sys

__all__ = ["main"]


def main() -> None:
    """Entry point (see the module doc)."""
    # what a new worker would spend its first seconds on (DDP's constructor imports torch._dynamo)
    import torch._dynamo
    import torch.distributed
    import torch.nn.parallel
    import torch.optim.lr_scheduler
    import torch.utils.data  # noqa: F401  (imported to have it loaded)

    import onedist.context
    import onedist.training.auto
    import onedist.training.live_steps  # noqa: F401

    line = sys.stdin.readline()
    if not line.strip():
        return
    os.environ.update(json.loads(line))
    from .bootstrap import main as run

    run()  # as bootstrap's own main: sys.argv[1:] is the script and its arguments


if __name__ == "__main__":
    main()
