"""Every query, collective and helper, checked on real gloo process groups of 1-4 ranks and serially."""

from __future__ import annotations

import torch

import checks


def test_queries(world):
    out = world(checks.check_queries)
    assert [o["rank"] for o in out] == list(range(world.world_size))


def test_all_reduce_every_op_and_dtype(world):
    world(checks.check_all_reduce_ops_and_dtypes)


def test_all_reduce_layout_device_inplace_async(world):
    world(checks.check_all_reduce_layout_device_inplace_async)


def test_all_reduce_numbers_are_exact(world):
    world(checks.check_all_reduce_numbers_exact)


def test_python_numbers_take_either_way_alike(world):
    world(checks.check_python_numbers_take_either_way_alike)


def test_large_objects_travel_whole(world):
    assert world(checks.check_large_objects_travel_whole) == [{"sent_intact": True}] * world.world_size


def test_a_large_pickle_is_its_own_wire_block():
    """A large value without tensors is pickled once, into the memory round 2 sends as it is:
    the meta is a view of that block (no concatenated copy), padded to the wire's alignment."""
    from onedist.collectives import wire

    packed = wire.pack({"blob": b"z" * 2**20}, torch.device("cpu"))
    assert packed.kind == wire.K_PICKLE and not packed.tensors
    assert isinstance(packed.meta, memoryview) and packed.block is not None
    assert len(packed.block) == wire.align(len(packed.meta)) and packed.meta.obj is packed.block.obj
    _, _, rest = wire.split_meta(packed.kind, packed.meta)
    assert wire.unpack(packed.kind, rest, []) == {"blob": b"z" * 2**20}


def test_all_reduce_nested_one_collective_per_dtype(world):
    world(checks.check_all_reduce_nested_one_collective_per_dtype)


def test_reduce(world):
    world(checks.check_reduce)


def test_all_gather_tensors_even_and_uneven(world):
    world(checks.check_all_gather_tensors)


def test_all_gather_tensor_fast_paths(world):
    assert world(checks.check_all_gather_tensor_fast_paths) == ["ok"] * world.world_size


def test_all_gather_slot_follows_the_values(world):
    sizes = world(checks.check_all_gather_slot_follows_the_values)
    assert all(s == sizes[0] for s in sizes), sizes  # every rank sized each call the same


def test_all_gather_numbers_strings_objects_nested(world):
    world(checks.check_all_gather_values)


def test_all_gather_mismatch_raises_on_every_rank(multi):
    assert multi(checks.check_all_gather_mismatch_raises_everywhere) == ["ok"] * multi.world_size


def test_broadcast(world):
    world(checks.check_broadcast)


def test_broadcast_source_error_reaches_every_rank(multi):
    multi(checks.check_broadcast_source_error)


def test_gather(world):
    world(checks.check_gather)


def test_scatter(world):
    world(checks.check_scatter)


def test_groups_barrier_local_group(world):
    world(checks.check_groups)


def test_send_recv(world):
    world(checks.check_p2p)


def test_helpers(world, tmp_path):
    world(checks.check_helpers, str(tmp_path))


def test_one_rank_first_failure_reaches_waiting_ranks(multi):
    multi(checks.check_one_rank_first_failure)


def test_logger_rank_filter(world, tmp_path):
    world(checks.check_logger, str(tmp_path / "log"))


def test_all_gather_object_returns_one_entry_per_rank(world):
    world(checks.check_all_gather_object)


def test_detectron2_differentiable_collectives_and_local_group(world):
    world(checks.check_detectron2_differentiable_collectives_and_local_group)


def test_bad_arguments_raise_clear_errors_without_communicating(world):
    world(checks.check_argument_errors)


def test_one_element_strided_tensors(world):
    world(checks.check_one_element_strided_tensors)
