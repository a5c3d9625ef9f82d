"""Recovery: the time from a rank's death to the next completed step, live recovery vs today's
restart, on the same script (the digits example's training under ``od.steps``,
tests/scripts/live_digits.py), interleaved:

    python benchmarks/bench_recovery.py             # 3 repetitions of each, 3 ranks, gloo
    python benchmarks/bench_recovery.py --reps 5 --step 20 --epochs 2

* live: ``onedist run -n 3 --backend gloo --max-restarts 1 --recovery live --inject-failure
  rank=1,step=S``: the survivors roll back their step, rank 1 alone is started again (the spare
  the launcher keeps warm, when it is ready) and receives the state from rank 0 (no checkpoint
  file);
* restart: ``onedist run -n 3 --backend gloo --max-restarts 1 --inject-failure rank=1,step=S`` with a
  step checkpoint after every step (``od.save_training_state``; ``od.resume`` at start): every
  worker is stopped, started again, and resumes from the newest checkpoint (no step is lost that
  a less frequent checkpoint would lose: restart's best case).

The kill is when the injected rank's line ("ends itself by SIGKILL") arrives here; the next step
is the first step beyond S that rank 0 completes (its ``step N done <time>`` line, its own clock,
the same machine): a restart that resumes from step S-1's checkpoint does step S again first.
For live recovery the replacement's start-up (from the launcher's handing it the rank to its first
collective: the script's own imports and set-up, ``initialize``) and the state transfer (its
broadcast) are printed separately, from its log line. Timings are as noisy as the machine: run it
on a quiet one, and compare only the ratio of one run.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SCRIPT = str(Path(__file__).resolve().parent.parent / "tests" / "scripts" / "live_digits.py")
KILLED = "ends itself by SIGKILL"
STEP = re.compile(r"step (\d+) done (\d+\.\d+)")
RECEIVED = re.compile(
    r"received the state of step \d+ from rank \d+, ([\d.]+) s after its start, in ([\d.]+) s"
)


def _read(stream: object, lines: list[tuple[float, str]]) -> None:
    for line in iter(stream.readline, ""):  # type: ignore[attr-defined]
        lines.append((time.time(), line))


def one_run(live: bool, step: int, epochs: int) -> dict[str, float]:
    """One run with rank 1 killed after its ``step``-th step: the seconds from the kill to the
    next completed step, and for live recovery the replacement's start-up and state transfer."""
    with tempfile.TemporaryDirectory() as tmp:
        mode = ["--recovery", "live"] if live else []
        script_args = [] if live else ["--checkpoint-dir", tmp]
        argv = [
            sys.executable, "-m", "onedist", "run", "-n", "3", "--backend", "gloo", "--max-restarts", "1",
            *mode, "--inject-failure", f"rank=1,step={step}", SCRIPT, "--epochs", str(epochs), *script_args,
        ]  # fmt: skip
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines: list[tuple[float, str]] = []
        readers = [threading.Thread(target=_read, args=(s, lines)) for s in (proc.stdout, proc.stderr)]
        for r in readers:
            r.start()
        code = proc.wait(timeout=600)
        for r in readers:
            r.join()
    if code != 0:
        raise SystemExit("".join(line for _, line in lines[-40:]))
    killed = next(t for t, line in lines if KILLED in line)
    # the first step beyond the one the kill came after (a restart may do that one again)
    after = min(float(m.group(2)) for _, line in lines if (m := STEP.search(line)) and int(m.group(1)) > step)
    out = {"kill_to_next_step_s": after - killed}
    received = next((m for _, line in lines if (m := RECEIVED.search(line))), None)
    if live:
        assert received is not None, "no replacement received the state"
        out["replacement_startup_s"] = float(received.group(1))
        out["state_transfer_s"] = float(received.group(2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=3, help="runs of each mode, interleaved")
    parser.add_argument("--step", type=int, default=35, help="rank 1 dies after this optimizer step")
    parser.add_argument("--epochs", type=int, default=3, help="passes over the digits (23 steps each)")
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {"live": [], "restart": []}
    for rep in range(args.reps):
        for mode in ("live", "restart"):
            r = one_run(mode == "live", args.step, args.epochs)
            results[mode].append(r)
            shown = ", ".join(f"{k} {v:.3f}" for k, v in r.items())
            print(f"rep {rep} {mode:8s} {shown}", flush=True)
    med = {m: statistics.median(r["kill_to_next_step_s"] for r in rs) for m, rs in results.items()}
    ratio = med["live"] / med["restart"]
    print(f"\nkill -> next completed step, median of {args.reps}: live {med['live']:.2f} s, "
          f"restart {med['restart']:.2f} s, ratio live/restart {ratio:.2f}")  # fmt: skip
    for key in ("replacement_startup_s", "state_transfer_s"):
        print(f"live: {key} median {statistics.median(r[key] for r in results['live']):.3f} s")


if __name__ == "__main__":
    main()
