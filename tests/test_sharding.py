"""auto_model(sharding="fsdp") (FSDP2) and od.clip_grad_norm_, serially, on gloo pools of 1-3 ranks
and shm pools of 2 and 3 (conftest's training_world); mpi4py under mpirun runs the same checks in
test_mpi.py."""

from __future__ import annotations

import pytest

import checks_sharding


@pytest.mark.parametrize("clip", [False, True], ids=["plain", "clipped"])
def test_fsdp_trains_like_ddp_on_a_fraction_of_the_bytes(training_world, clip):
    out = training_world(
        checks_sharding.check_fsdp_trains_like_ddp_on_a_fraction_of_the_bytes, clip, timeout=120
    )
    assert all(o["relative_difference"] <= 1e-5 for o in out), out
    assert all(o["bytes"] <= o["ddp_bytes"] / training_world.world_size * 1.1 for o in out), out


def test_bad_sharding_arguments_raise_naming_them(training_world):
    training_world(checks_sharding.check_sharding_arguments)


def test_full_state_dict_exports_and_checkpoints_refuse_shards(training_world, tmp_path):
    training_world(checks_sharding.check_full_state_dict_exports_and_checkpoints_refuse_shards, str(tmp_path))


def test_accumulation_on_a_sharded_model_reduce_scatters_once_per_window(training_world):
    out = training_world(checks_sharding.check_accumulation_on_a_sharded_model, timeout=120)
    assert all(o["relative_difference"] <= 1e-5 for o in out), out


def test_every_rank_starts_from_rank_0s_weights(training_world):
    training_world(checks_sharding.check_every_rank_starts_from_rank_0s_weights)


def test_resume_refuses_a_sharded_model_at_once(training_world, tmp_path):
    training_world(checks_sharding.check_resume_refuses_a_sharded_model_at_once, str(tmp_path / "none-yet"))
