"""auto_model / auto_optim / auto_dataloader on real gloo process groups of 1-4 ranks and serially."""

from __future__ import annotations

import pytest

import checks_auto


@pytest.mark.parametrize("batchnorm", [False, True], ids=["plain", "sync_bn"])
def test_training_equals_one_process(world, batchnorm):
    world(checks_auto.check_training_equals_one_process, batchnorm)


def test_ddp_kwargs_pass_through_and_bad_kwargs(world):
    world(checks_auto.check_ddp_kwargs_pass_through)


@pytest.mark.parametrize(
    "hook", ["fp16", "bf16", "powersgd", "powersgd+fp16", "batched_powersgd", "post_localsgd"]
)
def test_comm_hooks(multi, hook):
    out = multi(checks_auto.check_comm_hooks, hook)
    expected = "PostLocalSGDOptimizer" if hook == "post_localsgd" else "SGD"
    assert all(o["optimizer"] == expected for o in out)
    # compression changes the numbers a little, not the training
    assert all(o["max_diff_to_serial"] < 0.05 for o in out), out


def test_comm_hook_errors(world):
    world(checks_auto.check_comm_hook_errors)


def test_dataloader_splits_shards_and_reshuffles(world):
    out = world(checks_auto.check_dataloader_splits)
    if world.world_size == 1:  # one process: no sampler added, and shuffle=True is a RandomSampler
        assert out[0]["sampler"] == "RandomSampler", out


def test_auto_optim_identity_and_state_dict(world):
    world(checks_auto.check_auto_optim_serial_identity)


def test_syncbn_uneven_batches_equal_one_batchnorm(world):
    world(checks_auto.check_syncbn_uneven_batches_equal_one_batchnorm)


def test_unwrap_looks_through_torch_compile():
    import torch

    import onedist as od

    inner = torch.nn.Linear(2, 2)
    compiled = torch.compile(torch.nn.DataParallel(inner))  # compiles lazily: nothing runs here
    assert od.unwrap(compiled) is inner
