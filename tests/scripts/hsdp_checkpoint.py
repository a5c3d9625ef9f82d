"""checks_hsdp's meta-init and checkpoint check under a real launcher on several nodes:
``onedist run --nnodes 2 -n 2 ... hsdp_checkpoint.py BACKEND DIR`` on each node (DIR on a file
system every node sees). Prints ``RESULT`` and a JSON list (rank 0): what each rank's check
returned."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: checks_hsdp

import checks_hsdp
import onedist as od


def hsdp(local_rank: int, folder: str) -> Any:
    return od.all_gather_object(
        {"node": od.hostname(), **checks_hsdp.check_hsdp_meta_init_and_checkpoint_resume(folder)}
    )


def main() -> None:
    with od.Parallel(backend=sys.argv[1]) as parallel:
        result = parallel.run(hsdp, sys.argv[2])
    if os.environ.get("RANK", "0") == "0":  # one line (onedist run prefixes it)
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
