"""Lightning's and Accelerate's DDP step time on onedist's ``shm`` against gloo (2 CPU ranks).

    python benchmarks/bench_frameworks_shm.py [--rounds 3] [--steps 30] [--widths 32 32768]

Each round launches, under ``torchrun --standalone --nproc-per-node 2``, the training scripts the
tests run (tests/scripts/any_torch: Lightning's ``DDPStrategy(process_group_backend=...)``,
Accelerate adopting a group made by ``dist.init_process_group``) once per framework, width and
backend, gloo and shm alternating, so both see the same machine load. A script reports each rank's
median step time after two warm-up steps; a launch counts the slower rank. The report gives, per
row, the median over rounds of each backend and the ratio gloo / shm (above 1: shm is faster).
``width`` is the hidden layer of the model (34 x width + 1 parameters and as many gradients to
all-reduce per step: 32 is latency, 32768 about 4.5 MB).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "tests" / "scripts" / "any_torch"
FRAMEWORKS = {"lightning": ("lightning_run.py",), "accelerate": ("accelerate_run.py",)}


def step_ms(framework: str, backend: str, steps: int, width: int) -> float:
    """One launch: the slower rank's median step time, in ms."""
    script = FRAMEWORKS[framework][0]
    args = [backend, str(steps), str(width)]
    if framework == "accelerate":
        args.insert(1, "preinit")  # Accelerate refuses the name in InitProcessGroupKwargs on CPU
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        script,
        *args,
    ]
    done = subprocess.run(cmd, cwd=SCRIPTS, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{framework} on {backend} failed:\n{done.stderr[-3000:]}")
    times = [float(t) for t in re.findall(r"rank \d+ step_ms ([0-9.]+)\|", done.stdout)]
    if len(times) != 2:
        raise RuntimeError(f"{framework} on {backend}: no step times in\n{done.stdout[-2000:]}")
    return max(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--widths", type=int, nargs="+", default=[32, 32768])
    parser.add_argument("--frameworks", nargs="+", choices=sorted(FRAMEWORKS), default=sorted(FRAMEWORKS))
    args = parser.parse_args()
    rows: dict[tuple[str, int], dict[str, list[float]]] = {}
    for _ in range(args.rounds):
        for framework in args.frameworks:
            for width in args.widths:
                row = rows.setdefault((framework, width), {"gloo": [], "shm": []})
                for backend in ("gloo", "shm"):  # interleaved: both see the same load
                    row[backend].append(step_ms(framework, backend, args.steps, width))
    print(f"{'framework':<11} {'width':>6} {'gloo ms':>8} {'shm ms':>8} {'gloo/shm':>8}")
    report = []
    for (framework, width), row in rows.items():
        gloo, shm = statistics.median(row["gloo"]), statistics.median(row["shm"])
        print(f"{framework:<11} {width:>6} {gloo:>8.2f} {shm:>8.2f} {gloo / shm:>8.2f}")
        report.append({"framework": framework, "width": width, "gloo_ms": row["gloo"], "shm_ms": row["shm"]})
    print(json.dumps(report))


if __name__ == "__main__":
    main()
