"""Saves cut short by SIGKILL: for each point named on the command line, a job of 2 gloo ranks
under od.Parallel saves step 1 and last.pt intact in ``<root>/<point>``, then starts another save
and a rank is killed:

  writer-mid-write      rank 0 (the writer), once it wrote the first KiB of step 2's file
  writer-before-rename  rank 0, once last.pt's temporary file is complete, before its rename
  other-rank            rank 1, while rank 0 writes step 2's file (the launcher then stops rank 0)

    python killed_saves.py ROOT POINT [POINT ...]

Prints one line per point: the point, then what the kill left in its folder.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

import torch

import onedist as od
from onedist.training import checksums

plain_write = checksums.Crc32Writer.write


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def written_then(after: Any) -> Any:
    """Crc32Writer.write that calls ``after`` once the first KiB is on disk."""

    def write(self: checksums.Crc32Writer, data: Any) -> int:
        written = plain_write(self, data)
        if self.size > 1024:
            self.file.flush()
            after()
        return written

    return write


def job(local_rank: int, folder: str, point: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    od.save_training_state(folder, 1, model=model)
    od.save_checkpoint({"weight": model.weight}, os.path.join(folder, "last.pt"))
    writing = os.path.join(folder, "..", f"{point}.writing")
    if od.get_rank() == 0 and point == "writer-mid-write":
        checksums.Crc32Writer.write = written_then(kill_self)  # type: ignore[method-assign]
    if od.get_rank() == 0 and point == "other-rank":
        checksums.Crc32Writer.write = written_then(  # type: ignore[method-assign]
            lambda: (open(writing, "w").close(), time.sleep(60))
        )
    if od.get_rank() == 0 and point == "writer-before-rename":
        os.replace = lambda *args: kill_self()  # type: ignore[assignment]
    if od.get_rank() == 1 and point == "other-rank":  # killed from a thread, waiting in the save

        def kill_once_writing() -> None:
            while not os.path.exists(writing):
                time.sleep(0.01)
            kill_self()

        threading.Thread(target=kill_once_writing, daemon=True).start()
    if point == "writer-before-rename":
        od.save_checkpoint({"weight": torch.zeros(64, 64)}, os.path.join(folder, "last.pt"))
    else:
        od.save_training_state(folder, 2, model=torch.nn.Linear(64, 64))


if __name__ == "__main__":
    root, points = sys.argv[1], sys.argv[2:]
    for point in points:
        folder = os.path.join(root, point)
        try:
            with od.Parallel(backend="gloo", nproc_per_node=2) as parallel:
                parallel.run(job, folder, point)
        except od.WorkerFailedError:
            print(point, *sorted(os.listdir(folder)), flush=True)
        else:
            print(point, "no rank was killed", flush=True)
