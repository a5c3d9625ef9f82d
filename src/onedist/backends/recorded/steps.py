"""DDP's gradient buckets of different steps never meet: each step's buckets travel apart.

``DistributedDataParallel`` reduces a step's gradients in buckets, from its C++ reducer, during
``loss.backward()``. When one rank skips a backward (or runs an extra one, or leaves its loop
early), every bucket still finds a partner on the other ranks, one step off: the ranks average
gradients of different steps and nothing fails, or a bucket meets a collective of another size and
gloo aborts the process. The buckets cannot tell which step they belong to; the forward passes can:
a correct program runs the same forward passes with gradients, model by model, on every rank (what
DDP itself counts, ``reducer.prepare_for_forward``).

So on a recorded group (:mod:`.gloo`), :func:`install` patches DDP to count each model's forward
passes with gradients (and gradient sync: not under ``no_sync``), and the collectives of a backward
go, by the parity of that count, to one of two gloo groups of their own (``buckets``), apart from
each other and from the group's other calls. Buckets of steps one apart, or a bucket against any
other collective, then never pair: the ranks wait, and the stall check names each rank's call and
step (:mod:`onedist.failures.stall`, 3-4 s). No gradient of another step is averaged, and no size
mismatch aborts gloo. A finished rank matching its peers' buckets (torch's ``Join``, ``od.join``:
``_match_all_reduce_for_bwd_pass``) counts each matched step as its peers count their forward passes.

Cost: nothing is exchanged; two more gloo groups per recorded group (one thread each). Steps an
even number apart still pair (a rank that skipped two backwards). A model with a Python
communication hook (PowerSGD, fp16) is not counted: its hook's calls may run in future callbacks on
gloo's threads, outside the backward on one rank and inside it on another. A forward pass with gradients
that only some ranks make (an evaluation outside ``torch.no_grad()``) shifts that model's count:
its next backward waits, and the stall check names it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from . import calls
from .calls import CallLog, describe

__all__ = ["install", "step_of_call"]

_current_node: Callable[[], Any] = getattr(torch._C, "_current_autograd_node", lambda: None)


def install() -> None:
    """Patch ``DistributedDataParallel`` once per process (see the module doc); the patched
    methods do what they did, and count."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if getattr(DDP._pre_forward, "_onedist_counts", False):
        return
    pre_forward: Any = DDP._pre_forward
    match: Any = DDP._match_all_reduce_for_bwd_pass

    @functools.wraps(pre_forward)
    def _pre_forward(self: Any, *inputs: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            _count(self)
        return pre_forward(self, *inputs, **kwargs)

    @functools.wraps(match)
    def _match_all_reduce_for_bwd_pass(self: Any) -> Any:
        log = _count(self)
        if log is None:
            return match(self)
        log.shadowing += 1  # these calls are made outside a backward, for the peers' backward
        try:
            return match(self)
        finally:
            log.shadowing -= 1

    _pre_forward._onedist_counts = True  # type: ignore[attr-defined]
    DDP._pre_forward = _pre_forward  # type: ignore[method-assign]
    DDP._match_all_reduce_for_bwd_pass = _match_all_reduce_for_bwd_pass  # type: ignore[method-assign]


def _count(ddp: Any) -> Any:
    """One more step of ``ddp``'s: the step its group's next backward calls belong to."""
    log = getattr(ddp.process_group, "calls", None)
    if not isinstance(log, CallLog):
        return None
    if getattr(ddp, "_comm_hooks", None):
        # a Python communication hook (PowerSGD) makes its later calls in future callbacks, which
        # run inline inside the backward on one rank and on gloo's thread after it on another:
        # routed by step they went to different gloo groups and paired a bucket's P with another
        # call (a load-dependent false mismatch). Its calls stay on the group's own gloo group.
        log.ddp_step = 0
        return log
    ddp._onedist_steps = getattr(ddp, "_onedist_steps", 0) + 1
    log.ddp_step = ddp._onedist_steps
    return log


def step_of_call(log: CallLog) -> int:
    """The DDP step a collective about to start belongs to: inside a backward (or a finished rank's
    matching of one), the step of the DDP model that ran the last forward pass; else 0. The first
    such call of a backward queues :func:`_wait_step` at its end."""
    step = log.ddp_step
    if not step:
        return 0
    if log.shadowing:
        return step
    if _current_node() is None:
        return 0
    if log.waited_step != step:
        log.waited_step = step
        engine: Any = torch.autograd.Variable._execution_engine
        engine.queue_callback(functools.partial(_wait_step, log, step))
    return step


def _wait_step(log: CallLog, step: int) -> None:
    """A final callback of the backward, queued before DDP's own (which waits for the buckets and
    would raise the transport's "Connection closed by peer"): wait for the step's calls, so that a
    failed one raises onedist's explanation (the stall verdict, a failed peer's error)."""
    for entry, work in list(log.pending):
        if entry.step == step and work is not None:
            try:
                work.wait()
            except Exception as e:
                raise calls.explain_failure(describe(entry.sig, entry.step), e, entry.started) from None
