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


@pytest.mark.parametrize("n", ["serial", 1, 2])
def test_sync_bn_on_cpu_raises_with_the_fix_or_is_ignored_alone(n):
    from conftest import Runner

    out = Runner(n)(checks_auto.check_sync_bn_on_cpu)
    if n == 2:
        assert all(o["raised"] for o in out), out
    else:
        assert out == [
            {
                "raised": False,
                "logged": [
                    "onedist.auto_model: sync_bn ignored with world size 1 (BatchNorm already sees the batch)"
                ],
            }
        ], out


def test_default_comm_hook_kwargs_and_none_with_a_hook_function():
    """matrix_approximation_rank=1, start_powerSGD_iter=1000, start_localSGD_iter=1000 and this
    node's ranks as the subgroup (every rank here: one node)."""
    from conftest import Runner

    out = Runner(2)(checks_auto.check_default_comm_hook_kwargs)
    assert out == [{"powersgd": [1, 1000], "batched_powersgd": [1, 1000], "post_localsgd": [1000]}] * 2, out


@pytest.mark.parametrize("n", [1, 2])
def test_auto_optim_takes_no_keyword_arguments_on_torch_distributed(n):
    from conftest import Runner

    Runner(n)(checks_auto.check_auto_optim_takes_no_keyword_arguments)


@pytest.mark.parametrize("n", ["serial", 2])
def test_syncbn_makes_one_all_gather_forward_and_one_all_reduce_backward_per_layer(n):
    from conftest import Runner

    out = Runner(n)(checks_auto.check_syncbn_collectives_per_layer)
    per_layer = 2 if n == 2 else 0  # two layers; one process: plain BatchNorm, no collective
    expected = {"forward": ["all_gather"] * per_layer, "backward": ["all_reduce"] * per_layer}
    assert out == [expected] * len(out), out
