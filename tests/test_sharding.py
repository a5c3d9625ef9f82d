"""auto_model(sharding="fsdp") (FSDP2), its sharded checkpoints and od.clip_grad_norm_, serially,
on gloo pools of 1-3 ranks and shm pools of 2 and 3 (conftest's training_world); mpi4py under
mpirun runs the same checks in test_mpi.py."""

from __future__ import annotations

import pytest

import checks_sharded_checkpoint
import checks_sharding
from conftest import Runner
from onedist.backends.shm import supported as shm_supported


@pytest.mark.parametrize("clip", [False, True], ids=["plain", "clipped"])
def test_fsdp_trains_like_ddp_on_a_fraction_of_the_bytes(training_world, clip):
    out = training_world(
        checks_sharding.check_fsdp_trains_like_ddp_on_a_fraction_of_the_bytes, clip, timeout=120
    )
    assert all(o["relative_difference"] <= 1e-5 for o in out), out
    assert all(o["bytes"] <= o["ddp_bytes"] / training_world.world_size * 1.1 for o in out), out


def test_bad_sharding_arguments_raise_naming_them(training_world):
    training_world(checks_sharding.check_sharding_arguments)


def test_full_state_dict_exports_the_whole_model(training_world, tmp_path):
    training_world(checks_sharding.check_full_state_dict_exports, str(tmp_path))


def test_accumulation_on_a_sharded_model_reduce_scatters_once_per_window(training_world):
    out = training_world(checks_sharding.check_accumulation_on_a_sharded_model, timeout=120)
    assert all(o["relative_difference"] <= 1e-5 for o in out), out


def test_every_rank_starts_from_rank_0s_weights(training_world):
    training_world(checks_sharding.check_every_rank_starts_from_rank_0s_weights)


def test_sharded_checkpoint_resumes_bit_for_bit_and_holds_each_ranks_share(training_world, tmp_path):
    out = training_world(
        checks_sharded_checkpoint.check_sharded_checkpoint_round_trip, str(tmp_path), timeout=120
    )
    assert len(out[0]["files"]) == (training_world.world_size if training_world.world_size > 1 else 0), out[0]


def test_a_failed_sharded_save_raises_on_every_rank(training_world, tmp_path):
    training_world(checks_sharded_checkpoint.check_failed_sharded_save_raises_on_every_rank, str(tmp_path))


@pytest.mark.parametrize("n", [2, 3])
def test_a_failed_shard_write_raises_on_every_rank(n, tmp_path):
    said = Runner(n)(checks_sharded_checkpoint.check_a_failed_shard_write_raises_on_every_rank, str(tmp_path))
    for text in said:  # DCP's error names the rank whose write failed, and that rank's error
        assert text.startswith("CheckpointException") and f"(RANK {n - 1})" in text, said
        assert "No space left on device" in text, said


def test_resume_never_loads_a_torn_sharded_save(training_world, tmp_path):
    training_world(
        checks_sharded_checkpoint.check_resume_skips_a_torn_sharded_save, str(tmp_path), timeout=120
    )


@pytest.mark.parametrize("backend", ["gloo", "shm"])
@pytest.mark.parametrize("saved_on, loaded_on", [(2, 3), (3, 2)], ids=["2to3", "3to2"])
def test_a_sharded_checkpoint_loads_at_another_world_size(backend, saved_on, loaded_on, tmp_path):
    """DCP reshards: saved on 2 ranks, loaded on 3 (and back), the whole weights and optimizer state
    are the saving run's exactly."""
    if backend == "shm" and not shm_supported():
        pytest.skip("the shm backend needs Linux memfd_create (onedist.backends.shm.supported())")
    Runner(saved_on, backend)(
        checks_sharded_checkpoint.check_save_for_another_world, str(tmp_path), timeout=120
    )
    steps = Runner(loaded_on, backend)(
        checks_sharded_checkpoint.check_load_at_another_world, str(tmp_path), timeout=120
    )
    assert steps == [4] * loaded_on


def test_buffers_follow_rank_0_as_under_ddp(training_world):
    training_world(checks_sharding.check_buffers_follow_rank_0_as_under_ddp)


@pytest.mark.parametrize(
    "kwargs, needed",
    [
        ({"sharding": "fsdp"}, "sharding='fsdp' needs torch >= 2.6"),
        ({"precision": "16-mixed"}, "needs torch >= 2.3"),
    ],
)
def test_a_feature_newer_than_this_torch_raises_naming_the_release(monkeypatch, kwargs, needed):
    """On torch 2.2 (its version string set here: the check reads only that), sharding and
    "16-mixed" raise at once naming the release they need, instead of an ImportError or
    AttributeError deep inside."""
    import torch

    import onedist as od

    monkeypatch.setattr(torch, "__version__", "2.2.2+cpu")
    with pytest.raises(od.OnedistValueError) as raised:
        od.auto_model(torch.nn.Linear(2, 2), **kwargs)
    assert "what torch 2.2.2+cpu has" in str(raised.value) and needed in str(raised.value), raised.value


@pytest.mark.parametrize("n", [2, 3])
def test_units_follow_the_policy_and_each_rank_holds_its_rows(n):
    """ModuleList blocks by default, every instance of a set's classes, or where a function says
    True, then the root; rank r holds torch.chunk's r-th rows (fewer on the last ranks); mesh= is
    the mesh the parameters live on."""
    units = Runner(n)(checks_sharding.check_units_by_policy_and_rows_by_rank)[0]
    assert units == {
        "default": ["", "blocks.0", "blocks.1", "blocks.2"],
        "classes": ["", "embed", "blocks.0.linear", "blocks.1.linear", "blocks.2.linear", "head"],
        "function": ["", "embed"],
    }, units


def test_reshard_after_forward_false_saves_the_backward_all_gathers():
    """All-gathers in one forward and backward pass of 3 block units and the root: not given,
    torch's default regathers every unit but the root for the backward pass (2 * 3 + 1); True
    regathers the root too (2 * 4); False gathers each unit once (4)."""
    out = Runner(2)(checks_sharding.check_reshard_after_forward)
    assert out == [{"default": 7, "true": 8, "false": 4}] * 2, out


@pytest.mark.parametrize(
    "units",
    [
        "every-linear",  # the root holds no layer of its own
        "default",  # block units, then the root's own head, which takes their bfloat16 output
    ],
)
def test_bf16_mixed_with_sharding_is_fsdps_mixed_precision(units):
    Runner(2)(checks_sharding.check_bf16_mixed_is_fsdps_mixed_precision, units == "every-linear")


def test_bf16_mixed_with_sharding_runs_batch_norm_in_float32():
    """FSDP2 casts parameters, not buffers: a BatchNorm left in a bfloat16 unit raised 'expected
    scalar type BFloat16 but found Float' (the digits example's CNN did)."""
    seen = Runner(2)(checks_sharding.check_bf16_mixed_runs_batch_norm_in_float32)
    assert seen == [["torch.float32 torch.float32 torch.float32 -> torch.bfloat16"]] * 2, seen


def test_a_sharded_save_over_an_existing_path_moves_it_aside(tmp_path):
    renames = Runner(2)(
        checks_sharding.check_sharded_save_over_an_existing_path_moves_it_aside, str(tmp_path)
    )
    assert renames[1] == [], renames  # only the writer renames
    (old, aside), (temporary, new) = renames[0]
    assert old == new == "ckpt.pt" and aside != temporary, renames[0]
    assert all(t.startswith(".ckpt.pt.") and t.endswith(".tmp") for t in (aside, temporary)), renames[0]


def test_fsdp_and_ddp_round_apart_about_1e_6_with_adamw_and_1e_8_with_sgd():
    """20 steps: AdamW with torch's defaults and SGD (lr 0.01). At 3 ranks DDP's (g / 3 summed) and
    FSDP2's (g summed, / 3) roundings differ; at 2 ranks dividing by 2 is exact: equal weights.
    How far apart depends on a few elements whose gradient is near zero (Adam's step is ~lr
    whatever the gradient's size): 8e-7 and 5e-8 with AdamW on two machines here, 2e-8 with SGD."""
    for n in (2, 3):
        out = Runner(n)(checks_sharding.check_fsdp_and_ddp_rounding_with_adamw_and_sgd, timeout=120)[0]
        if n == 2:
            assert out == {"adamw": 0.0, "sgd": 0.0}, out
        else:
            assert 1e-9 < out["adamw"] <= 3e-6 and 1e-10 < out["sgd"] <= 1e-7, out


@pytest.mark.parametrize("n", [2, 3])
def test_no_sync_on_a_sharded_model_holds_the_whole_models_gradients_until_the_window_ends(n):
    """What sharding saves in gradients is spent again inside od.no_sync (torch's FSDP2 keeps the
    unsharded gradients for the reduce-scatter of the window's last backward pass)."""
    out = Runner(n)(checks_sharding.check_no_sync_holds_the_whole_models_gradients_until_the_window_ends)
    assert all(o["inside"] == o["whole"] and o["after"] <= o["whole"] / n * 1.1 for o in out), out


def test_a_rank_that_runs_one_forward_pass_more_waits_in_its_all_gather():
    out = Runner(2)(checks_sharding.check_a_rank_with_one_forward_pass_more_waits_in_its_all_gather)
    assert out[0] == {} and out[1]["waited"] >= 1.5 and out[1]["in"], out
