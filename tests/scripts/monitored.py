"""A monitored loop (tests/test_monitoring.py): od.progress over a loader, od.Throughput and
od.log_metrics to a CSV file, the same under ``python`` (serial) and ``onedist run -n N``.

    python monitored.py OUT_DIR none          # one process
    onedist run -n 3 monitored.py OUT_DIR shm
    onedist run -n 2 monitored.py OUT_DIR gloo fail   # rank 1 raises at step 6
    onedist run -n 2 monitored.py OUT_DIR gloo preempted   # waits after step 5 for a SIGTERM

In ``preempted`` every rank waits after step 5 (``OUT_DIR/waiting`` says so) until the job is
ended by SIGTERM, as a scheduler preempting it would (SLURM signals every task): onedist prints
where each rank was and ends it by the signal, without Python's exit handlers. A logger that
buffers until it is saved or closed (as Lightning's CSVLogger does) joins the others and writes
``buffered-<rank>.json`` only then (the main process is the one that logs).

The loggers are not closed by the script: the exit of the process closes them (after a failure
of another rank too). A TensorBoard logger joins the CSV one when tensorboard is installed.

60 numbers in 10 global batches of 6 (split over the ranks by auto_dataloader, without
shuffling): the metrics logged per step (the batch's sum, size and largest number over every
rank) are the same at any world size. The main process prints ``RESULT {json}`` at the end.
"""

from __future__ import annotations

import json
import sys
import time
from importlib.util import find_spec

import torch
from torch.utils.data import TensorDataset

import onedist as od


class Buffered:
    """A logger that keeps its rows in memory until it is saved or closed."""

    def __init__(self, path: str) -> None:
        self.path, self.rows = path, []

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.rows.append([step, metrics["sum"]])

    def close(self) -> None:
        with open(self.path, "w") as f:
            json.dump(self.rows, f)


def main(local_rank: int, out_dir: str, mode: str = "") -> None:
    loader = od.auto_dataloader(TensorDataset(torch.arange(60.0)), batch_size=6, shuffle=False)
    throughput = od.Throughput(every=5)
    windows = []
    # flush_s: the CSV rows reach the file only when the loggers are closed (at the exit, or
    # before onedist ends the rank), which the tests check
    csv_logger = od.CSVLogger(out_dir, flush_s=3600)
    targets = [csv_logger, *([od.TensorBoardLogger(out_dir)] if find_spec("tensorboard") else [])]
    if mode == "preempted":
        targets.append(Buffered(f"{out_dir}/buffered-{od.get_rank()}.json"))
    od.loggers(*targets)
    bar = od.progress(loader, desc="train", unit="batch", every_s=0.2)
    start = time.perf_counter()
    for step, (x,) in enumerate(bar, 1):
        if mode == "fail" and step == 6 and od.get_rank() == 1:
            raise RuntimeError("rank 1 fails at step 6")
        if mode == "preempted" and step == 6:
            open(f"{out_dir}/waiting", "w").close()
            while True:  # until the SIGTERM
                time.sleep(0.05)
        time.sleep(0.05)
        metrics = {"sum": x.sum(), "count": len(x), "largest": x.max()}
        logged = od.log_metrics(metrics, step, reduce={"sum": "sum", "count": "sum", "largest": "max"})
        bar.set_postfix(largest=logged["largest"])
        rates = throughput.update(len(x))
        if rates is not None:
            windows.append(rates.samples)
    wall = time.perf_counter() - start
    if od.is_main_process():
        print("RESULT " + json.dumps({"wall": wall, "windows": windows, "world_size": od.get_world_size()}))


if __name__ == "__main__":
    backend = None if sys.argv[2] == "none" else sys.argv[2]
    with od.Parallel(backend=backend) as parallel:
        parallel.run(main, sys.argv[1], *sys.argv[3:])
