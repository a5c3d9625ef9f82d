"""Recovery: the time from a rank's death to the next completed step, live recovery vs today's
restart, on the same script (the digits example's training under ``od.steps``,
tests/scripts/live_digits.py), interleaved; and what ``od.steps`` costs a step meanwhile:

    python benchmarks/bench_recovery.py             # 3 repetitions of each, 3 ranks, gloo
    python benchmarks/bench_recovery.py --reps 5 --step 20 --epochs 2 --backend shm
    python benchmarks/bench_recovery.py --overhead  # od.steps' cost per step (no failure)

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

``--overhead``: no failure; the same training under ``onedist run --recovery live`` with
``od.steps`` (each step's start marked: RNG states and buffers copied, the rank's own state kept in
the launcher's store) and without it (``live_digits.py --plain``: the same loop over the loader),
interleaved; the time per step is rank 0's, from its 10th completed step to its last.
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


def _lines(argv: list[str]) -> list[tuple[float, str]]:
    """Run ``argv``; its output lines, each with when it arrived here."""
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
    return lines


def one_run(live: bool, step: int, epochs: int, backend: str) -> dict[str, float]:
    """One run with rank 1 killed after its ``step``-th step: the seconds from the kill to the
    next completed step, and for live recovery the replacement's start-up and state transfer."""
    with tempfile.TemporaryDirectory() as tmp:
        mode = ["--recovery", "live"] if live else []
        script_args = [] if live else ["--checkpoint-dir", tmp]
        lines = _lines([
            sys.executable, "-m", "onedist", "run", "-n", "3", "--backend", backend, "--max-restarts", "1",
            *mode, "--inject-failure", f"rank=1,step={step}", SCRIPT, "--epochs", str(epochs), *script_args,
        ])  # fmt: skip
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


def step_time(plain: bool, epochs: int, backend: str) -> float:
    """Seconds per step of one run without a failure, under ``--recovery live``: with ``od.steps``,
    or (``plain``) the same loop without it; rank 0's, from its 10th completed step to its last."""
    lines = _lines([
        sys.executable, "-m", "onedist", "run", "-n", "3", "--backend", backend, "--max-restarts", "1",
        "--recovery", "live", SCRIPT, "--epochs", str(epochs), *(["--plain"] if plain else []),
    ])  # fmt: skip
    done = sorted((int(m.group(1)), float(m.group(2))) for _, line in lines if (m := STEP.search(line)))
    (first, t0), (last, t1) = done[9], done[-1]
    return (t1 - t0) / (last - first)


def step_work_ms(reps: int = 300) -> dict[str, float]:
    """What a live od.steps step adds, timed in this process (one rank, a store of its own): the
    step's start marked (RNG states and the module's buffers copied), the rank's own state
    published at the optimizer step (RNG states read, pickled, written to the store), and the
    check at the next step's start that it has not moved (the digits model)."""
    import datetime
    import timeit

    import torch.distributed as dist

    sys.path.insert(0, str(Path(SCRIPT).resolve().parents[2] / "examples"))
    import digits

    from onedist.training.live_state import OwnState, _same
    from onedist.training.rng import rng_state

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = digits.Net()
        own = OwnState(model)
        rng = rng_state()

        def publish() -> None:
            own.published = None  # as at each optimizer step: a new step's state
            own.publish(1, rng_state(), model)

        parts = {
            "mark (RNG states, buffers copied)": lambda: (rng_state(), [b.clone() for b in model.buffers()]),
            "publish at the optimizer step": publish,
            "check at the step's start": lambda: _same(rng, rng_state()),
        }
        return {name: timeit.timeit(fn, number=reps) / reps * 1e3 for name, fn in parts.items()}
    finally:
        dist.destroy_process_group()


def overhead(reps: int, epochs: int, backend: str) -> None:
    """od.steps' cost per step: with it and without it, interleaved (see the module doc)."""
    for name, ms in step_work_ms().items():
        print(f"in one process: {name}: {ms:.3f} ms", flush=True)
    times: dict[str, list[float]] = {"od.steps": [], "plain": []}
    for rep in range(reps):
        for mode in times:
            times[mode].append(step_time(mode == "plain", epochs, backend))
            print(f"rep {rep} {mode:9s} {times[mode][-1] * 1e3:.3f} ms/step", flush=True)
    med = {m: statistics.median(t) for m, t in times.items()}
    print(f"\nper step, median of {reps} ({backend}, 3 ranks): od.steps {med['od.steps'] * 1e3:.3f} ms, "
          f"plain {med['plain'] * 1e3:.3f} ms, ratio {med['od.steps'] / med['plain']:.3f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=3, help="runs of each mode, interleaved")
    parser.add_argument("--step", type=int, default=35, help="rank 1 dies after this optimizer step")
    parser.add_argument("--epochs", type=int, default=3, help="passes over the digits (23 steps each)")
    parser.add_argument("--backend", default="gloo", choices=("gloo", "shm"))
    parser.add_argument("--overhead", action="store_true", help="od.steps' cost per step, no failure")
    args = parser.parse_args()
    if args.overhead:
        overhead(args.reps, args.epochs, args.backend)
        return
    results: dict[str, list[dict[str, float]]] = {"live": [], "restart": []}
    for rep in range(args.reps):
        for mode in ("live", "restart"):
            r = one_run(mode == "live", args.step, args.epochs, args.backend)
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
