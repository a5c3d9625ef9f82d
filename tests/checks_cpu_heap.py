"""Checks of a sharded model's step on the CPU reusing warm memory (onedist.training.cpu_heap):
run on every rank of a pool of its own (glibc's setting is the process's, and only ever raised)."""

from __future__ import annotations

import os
import resource

import torch

import onedist as od

WIDTH = 3072  # a block's Linear: 9.4 M float32 parameters, 37.8 MB gathered: above glibc's 32 MiB
STEPS = 6


def _faults_a_step() -> float:
    """The page faults of a sharded step, per page it gathers (two blocks, forward and backward),
    over steps 3-8 (the heap settles in a few steps: glibc places the buffers where they fit)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(WIDTH, WIDTH) for _ in range(2)]))
    net.forward = lambda x: net[0][1](net[0][0](x))  # type: ignore[method-assign]
    model = od.auto_model(net, sharding="fsdp")
    optimizer = od.auto_optim(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4, WIDTH)

    def step() -> None:
        od.backward(model(x).square().mean())
        optimizer.step()
        optimizer.zero_grad()

    step()
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(STEPS):
        step()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    gathered = 2 * 2 * (WIDTH * WIDTH + WIDTH) * 4 // resource.getpagesize()
    return faults / gathered / STEPS


def check_a_sharded_step_reuses_warm_memory() -> dict[str, float]:
    """With ``ONEDIST_CPU_HEAP=0`` a step's gathers page-fault their memory in again (glibc's
    default: fresh from the kernel); then, as onedist leaves it by default, they do not."""
    os.environ["ONEDIST_CPU_HEAP"] = "0"
    off = _faults_a_step()
    del os.environ["ONEDIST_CPU_HEAP"]
    return {"off": off, "on": _faults_a_step()}
