"""``od.Throughput``: the job's samples/s, tokens/s, FLOP/s and utilisation, over every rank.

Each rank counts its own steps locally; every ``every`` steps (and at :meth:`Throughput.compute`)
the ranks exchange their counts and their window's time in one all_gather of a row of 7 float64s
from each rank (:func:`~onedist.training.rank_rows.rank_rows`), none in between. The window's rate is
the job's: the samples of every rank over the slowest rank's time, so ranks with uneven batches
count right. ``od.measure_flops`` counts a model's FLOPs per batch with
``torch.utils.flop_counter.FlopCounterMode``; with the device's peak (``od.peak_flops``, or given)
the utilisation follows: FLOP/s over the peak of every rank's device.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch

from ..errors import bad_type, bad_value
from .peak_flops import peak_flops as device_peak
from .rank_rows import rank_rows

__all__ = ["Rates", "Throughput", "measure_flops"]


@dataclass(frozen=True)
class Rates:
    """One window of :class:`Throughput`, over every rank (the same on every rank).

    Attributes:
        steps: the steps of the window (counted on rank 0).
        elapsed_s: the window's time, seconds: the slowest rank's.
        samples: the samples of every rank in the window.
        samples_per_s: ``samples / elapsed_s``.
        tokens_per_s: every rank's tokens over ``elapsed_s``; None when no rank gave tokens.
        flops_per_s: every rank's FLOPs over ``elapsed_s``; None without FLOPs.
        utilisation: ``flops_per_s`` over the peak of all the ranks' devices together (0 to 1);
            None when the FLOPs or the peak are not known (on a CPU).
        total_samples: the samples of every rank since the Throughput was made.
    """

    steps: int
    elapsed_s: float
    samples: int
    samples_per_s: float
    tokens_per_s: Optional[float]
    flops_per_s: Optional[float]
    utilisation: Optional[float]
    total_samples: int

    def as_dict(self) -> dict[str, float]:
        """The rates that are known, by name, for :func:`onedist.log_metrics`.

        Example:
            >>> import onedist as od
            >>> od.Rates(10, 2.0, 640, 320.0, None, None, None, 640).as_dict()
            {'samples_per_s': 320.0}
        """
        names = ("samples_per_s", "tokens_per_s", "flops_per_s", "utilisation")
        return {k: float(v) for k, v in asdict(self).items() if k in names and v is not None}


class Throughput:
    """Count samples, tokens and FLOPs per step; the job's rates every ``every`` steps.

    Make it on every rank, call :meth:`update` after every step on every rank: it returns the
    window's :class:`Rates` on each ``every``-th call (one small collective, on every rank) and
    None on the others (no collective). :meth:`compute` closes a window early (at an epoch's end).
    The first window starts when the Throughput is made.

    Args:
        every: steps per window; None: windows end only at :meth:`compute`.
        flops_per_batch: FLOPs of one step on one rank (:func:`measure_flops`), counted when
            :meth:`update` is given none.
        peak_flops: the peak FLOP/s of one rank's device; None: :func:`onedist.peak_flops` of
            :func:`onedist.device` in ``dtype`` (None on a CPU: no utilisation).
        dtype: the dtype the model computes in, for the peak.

    Example:
        >>> import onedist as od
        >>> throughput = od.Throughput(every=2, flops_per_batch=1e9, peak_flops=1e12)
        >>> throughput.update(samples=64)       # step 1: None, and no collective
        >>> rates = throughput.update(samples=64)
        >>> rates.samples, rates.total_samples, rates.samples_per_s > 0, 0 < rates.utilisation
        (128, 128, True, True)
    """

    def __init__(
        self,
        every: Optional[int] = 100,
        *,
        flops_per_batch: Optional[float] = None,
        peak_flops: Optional[float] = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise bad_value("Throughput", "every", every, "None or an int >= 1 (steps per window)")
        _check_number("Throughput", "flops_per_batch", flops_per_batch)
        _check_number("Throughput", "peak_flops", peak_flops)
        if peak_flops is not None and not peak_flops > 0:
            raise bad_value("Throughput", "peak_flops", peak_flops, "None or a number > 0 (FLOP/s)")
        self.every, self.flops_per_batch = every, flops_per_batch
        self.peak = peak_flops if peak_flops is not None else device_peak(None, dtype)
        self.total_samples = 0
        self.last: Optional[Rates] = None
        self._reset(time.perf_counter())

    def _reset(self, now: float) -> None:
        self.started = now
        self.steps, self.samples, self.tokens, self.flops = 0, 0, 0, 0.0
        self.has_tokens = self.has_flops = False

    def update(
        self, samples: int, tokens: Optional[int] = None, flops: Optional[float] = None
    ) -> Optional[Rates]:
        """Count one step of this rank: ``samples`` (its batch size), ``tokens`` and ``flops``
        (None: ``flops_per_batch``). Returns the window's rates on every ``every``-th call."""
        # (an int's exact class first: this runs every step, right after the step)
        if (samples.__class__ is not int or samples < 0) and (
            isinstance(samples, bool) or not isinstance(samples, int) or samples < 0
        ):
            raise bad_value("Throughput.update", "samples", samples, "an int >= 0 (this rank's batch size)")
        if tokens is not None:
            if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
                raise bad_value("Throughput.update", "tokens", tokens, "None or an int >= 0")
            self.tokens += tokens
            self.has_tokens = True
        if flops is None:
            flops = self.flops_per_batch
        else:
            _check_number("Throughput.update", "flops", flops)
        if flops is not None:
            self.flops += flops
            self.has_flops = True
        self.samples += samples
        steps = self.steps = self.steps + 1
        if self.every is not None and steps >= self.every:
            return self.compute()
        return None

    def compute(self) -> Rates:
        """End the window now: its rates over every rank (one collective; call it on every rank)."""
        now = time.perf_counter()
        local = [self.steps, self.samples, self.tokens, self.has_tokens, self.flops, self.has_flops]
        # as Python numbers at once: a torch call per sum or maximum cost more than the numbers
        rows = rank_rows([*local, now - self.started]).tolist()
        sums = [sum(column) for column in zip(*rows)]
        elapsed = max(row[6] for row in rows)
        samples = round(sums[1])
        self.total_samples += samples
        per_s = 1.0 / elapsed if elapsed > 0 else 0.0
        flops_per_s = sums[4] * per_s if sums[5] else None
        peak = None if self.peak is None else self.peak * len(rows)
        self.last = Rates(
            steps=round(rows[0][0]),
            elapsed_s=elapsed,
            samples=samples,
            samples_per_s=samples * per_s,
            tokens_per_s=sums[2] * per_s if sums[3] else None,
            flops_per_s=flops_per_s,
            utilisation=flops_per_s / peak if flops_per_s is not None and peak else None,
            total_samples=self.total_samples,
        )
        self._reset(now)  # the next window starts where this one ended: no time is left out
        return self.last


def _check_number(func: str, arg: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
        raise bad_value(func, arg, value, "None or a number >= 0")


def measure_flops(
    model: torch.nn.Module, *inputs: Any, loss_fn: Optional[Callable[[Any], torch.Tensor]] = None
) -> int:
    """The FLOPs of ``model(*inputs)`` (and of ``loss_fn(output).backward()`` when given), counted by
    ``torch.utils.flop_counter.FlopCounterMode`` (a matmul of m x k by k x n counts 2mkn).

    It runs the passes: on a model made on the meta device (``od.init_module(empty_init=True)``)
    with meta inputs it computes nothing. The model's gradients are left as they were; a wrapper
    (DDP) is looked through, so no gradient is exchanged.

    Example:
        >>> import torch, onedist as od
        >>> model = torch.nn.Linear(100, 10, bias=False)
        >>> od.measure_flops(model, torch.ones(64, 100))                  # 2 x 64 x 100 x 10
        128000
        >>> od.measure_flops(model, torch.ones(64, 100), loss_fn=lambda out: out.sum())
        256000
    """
    from torch.utils.flop_counter import FlopCounterMode

    from .wrappers import unwrap

    if not isinstance(model, torch.nn.Module):
        raise bad_type("measure_flops", "model", model, "a torch.nn.Module")
    if loss_fn is not None and not callable(loss_fn):
        raise bad_type("measure_flops", "loss_fn", loss_fn, "None or a function of the output to a loss")
    inner = unwrap(model)
    grads = [(p, p.grad) for p in inner.parameters()]
    for p, _ in grads:
        p.grad = None  # the backward accumulates into a gradient that is there
    try:
        with FlopCounterMode(display=False) as counter:
            out = inner(*inputs)
            if loss_fn is not None:
                loss: Any = loss_fn(out)
                loss.backward()
    finally:
        for p, g in grads:
            p.grad = g
    return int(counter.get_total_flops())
