"""``TorchTrainer``'s function in tests/test_ray.py: tests/scripts/ray_train.py's ``train_loop``
(the unchanged script), with a record of what a worker sees around it, in ``config["out"]``:

- ``setup<RANK>.json``, before the script runs: which of torchrun's variables Ray set, and the
  timeout of the process group Ray made;
- ``after<RANK>.json``, once the script's function returned (its ``od.Parallel`` adopted Ray's
  group and left it): whether Ray's group is still there and still sums (an all_reduce of
  ones), ``od.restart_count()``, the working directory the function started in, and with
  ``config["info"]``, on rank 0, the output of ``python -m onedist info --json`` started here;
- ``failed<RANK>.json`` when the script raised here: the exception's type and module, the time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import ray_train
import torch
import torch.distributed as dist

import onedist as od

VARIABLES = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
             "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_TORCH_DEVICE"]  # fmt: skip


def train_loop(config: dict[str, Any]) -> None:
    out, rank, cwd = Path(config["out"]), os.environ["RANK"], os.getcwd()
    options = dist.group.WORLD._get_backend(torch.device("cpu")).options  # the group Ray made
    setup = {
        "variables": [v for v in VARIABLES if v in os.environ],
        "timeout_s": options._timeout.total_seconds(),
    }
    (out / f"setup{rank}.json").write_text(json.dumps(setup))
    try:
        ray_train.train_loop(config)
    except BaseException as e:
        failed = {"type": type(e).__name__, "module": type(e).__module__, "message": str(e)[:500]}
        (out / f"failed{rank}.json").write_text(json.dumps({**failed, "time": time.time()}))
        raise
    facts: dict[str, Any] = {
        "group_alive": dist.is_initialized(),
        "restart_count": od.restart_count(),
        "cwd": cwd,
    }
    if facts["group_alive"]:
        ones = torch.ones(1)
        dist.all_reduce(ones)
        facts["all_reduce"] = ones.item()
    if config.get("info") and rank == "0":
        info = subprocess.run(
            [sys.executable, "-m", "onedist", "info", "--json"], capture_output=True, text=True, timeout=120
        )
        facts["info"] = json.loads(info.stdout) if info.returncode == 0 else info.stderr
    (out / f"after{rank}.json").write_text(json.dumps(facts))
