"""What the start_method="subprocess" test scripts run on every rank (tests/test_reexec.py).

REEXEC_FAIL_RANK / REEXEC_FAIL_HOW (raise, exit) make one rank fail after the first collectives,
while the others wait in a barrier. REEXEC_STUCK_RANK makes that rank swallow every exception and
stay in fn (the parent's os._exit fallback). REEXEC_SLEEP_RANK makes that rank sleep 60 s while the
others wait in a barrier (signals sent to the parent).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from agree import describe  # tests/scripts is on sys.path: the package's parent, or the script's dir

import onedist as od


def work(out_dir: str, local_rank: int, offset: int) -> dict[str, Any]:
    info = describe(local_rank)
    info["offset_sum"] = od.all_reduce(offset + od.get_rank())
    info["child"] = os.environ.get("ONEDIST_REEXEC") == "1"
    with open(os.path.join(out_dir, f"{info['rank']}.json"), "w") as f:
        json.dump(info, f)
    rank = info["rank"]
    if os.environ.get("REEXEC_FAIL_RANK") == str(rank):
        with open(os.path.join(out_dir, "failed_at"), "w") as f:
            f.write(str(time.time()))
        if os.environ.get("REEXEC_FAIL_HOW", "raise") == "exit":
            os._exit(3)
        raise RuntimeError(f"rank {rank} failed on purpose")
    if os.environ.get("REEXEC_STUCK_RANK") == str(rank):
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                od.barrier()
                time.sleep(60)
            except BaseException:  # swallows even the WorkerFailedError onedist raises here
                pass
    if os.environ.get("REEXEC_SLEEP_RANK") == str(rank):  # the others wait in the barrier
        with open(os.path.join(out_dir, "sleeping"), "w") as f:
            f.write(str(time.time()))
        time.sleep(60)
    od.barrier()
    return info


def write_result(out_dir: str, result: Any) -> None:
    """In the process that was started by the test (not a re-executed child): record run's result."""
    if os.environ.get("ONEDIST_REEXEC") != "1":
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(result, f)
