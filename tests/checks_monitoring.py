"""Checks of od.Throughput and od.log_metrics, run on every rank of a pool (tests/test_monitoring.py).

Each returns what the test compares with a hand count: the rates or values every rank got, the
times each rank measured itself, and the collectives onedist's backend made (recorded on the
backend instance, as tests/checks_join.py does).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import onedist as od

_PRIMITIVES = ("all_reduce_", "reduce_", "broadcast_", "all_gather_into_", "all_gather_uneven_", "barrier_")


@contextmanager
def recorded_collectives() -> Iterator[list[tuple[str, int]]]:
    """Every collective onedist's backend makes inside the block: (primitive, elements)."""
    from onedist.context import current

    backend = current()
    calls: list[tuple[str, int]] = []

    def recorded(name: str) -> Callable[..., Any]:
        plain = getattr(backend, name)

        def call(t: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append((name, t.numel()))
            return plain(t, *args, **kwargs)

        return call

    for name in _PRIMITIVES:
        setattr(backend, name, recorded(name))  # on the instance: del restores the class's
    try:
        yield calls
    finally:
        for name in _PRIMITIVES:
            backend.__dict__.pop(name, None)


def check_throughput_counts(every: int = 5, windows: int = 2) -> dict[str, Any]:
    """Rank r: batches of 4 + r samples, 10 tokens and 1000 FLOPs a sample, a step of 20 + 10r ms.
    The rates of each window, this rank's own times of each window (taken just before the
    update that closes it), and the collectives of each step."""
    r = od.get_rank()
    batch = 4 + r
    make = od.Throughput  # imported here: its first use imports the module (~1 ms)
    od.barrier()
    t0 = time.perf_counter()
    throughput = make(every=every, peak_flops=1e6)
    ends, rates, per_step = [], [], []
    with recorded_collectives() as calls:
        for step in range(every * windows):
            time.sleep(0.02 + 0.01 * r)
            before = len(calls)
            if (step + 1) % every == 0:
                ends.append(time.perf_counter() - t0)
            out = throughput.update(batch, tokens=10 * batch, flops=1000.0 * batch)
            per_step.append(calls[before:])
            if out is not None:
                rates.append(vars(out))
    return {"rank": r, "batch": batch, "ends": ends, "rates": rates, "per_step": per_step}


def check_log_metrics_reduces(directory: str) -> dict[str, Any]:
    """Three steps of metrics that differ per rank, reduced per metric, to a CSV file (and to
    TensorBoard when it is installed); what od.log_metrics returned and the collectives."""
    r = od.get_rank()
    targets: list[Any] = [od.CSVLogger(directory)]
    try:
        targets.append(od.TensorBoardLogger(directory))
    except od.OnedistRuntimeError:
        pass  # tensorboard not installed: the test skips its part
    logged = []
    with od.loggers(*targets), recorded_collectives() as calls:
        for step in range(3):
            metrics = {"loss": 1.0 + r + step, "correct": 10 * r + step, "worst": float(r * step), "lr": 0.1}
            reduce = {"loss": "mean", "correct": "sum", "worst": "max"}
            logged.append(od.log_metrics(metrics, step, reduce=reduce))
        od.log_metrics({"main_only": float(r)}, 3)  # no reduce: rank 0's value, no collective
    return {"logged": logged, "calls": list(calls), "tensorboard": len(targets) == 2}


def check_log_metrics_names_must_match() -> str:
    """Rank r reduces a metric named m<r>: every rank raises CollectiveMismatchError."""
    try:
        od.log_metrics({f"m{od.get_rank()}": 1.0}, 0, reduce="sum")
    except od.CollectiveMismatchError as e:
        return str(e)
    return "no error"


def check_other_ranks_iterate_the_iterable_itself() -> str:
    """The iterator od.progress gives on this rank: the list's own on every rank but 0."""
    return type(iter(od.progress([1, 2], style="lines"))).__name__
