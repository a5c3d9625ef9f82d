"""A sharded checkpoint's load (issue 51): each rank's files checked in a thread while DCP plans,
no tensor written before every rank's check passed, each tensor read straight into the
parameters. Real gloo ranks: a damaged file changes no rank's parameters and raises
CheckpointCorruptError on every rank naming it; an intact checkpoint loads bit for bit at the world
size that saved it and at others."""

from __future__ import annotations

import io

import pytest
import torch

import checks_sharded_load
from conftest import Runner
from onedist.training.shard_reader import tensor_layout


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    """``layered_model`` saved by 2 ranks (FSDP)."""
    folder = str(tmp_path_factory.mktemp("sharded-load"))
    Runner(2)(checks_sharded_load.save_layered, folder, timeout=120)
    return folder


@pytest.mark.parametrize("loaded_on", [1, 2, 3])
def test_a_sharded_checkpoint_loads_bit_for_bit_each_tensor_read_straight_into_the_parameters(
    saved: str, loaded_on: int
) -> None:
    """Bit-identical to the saved weights (uneven shards, bfloat16) at the saving world size and at
    others; every saved tensor went straight into the parameters (whole rows: FSDP's shards), none
    through DCP's torch.load of a copy."""
    expected = dict(checks_sharded_load.layered_model().named_parameters())
    for rank in Runner(loaded_on)(checks_sharded_load.check_load_is_bit_identical, saved, timeout=120):
        assert rank["whole"].keys() == expected.keys()
        for name, tensor in rank["whole"].items():
            assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name].detach()), name
        assert rank["straight"] > 0 and rank["dcp"] == 0, rank


@pytest.mark.parametrize(
    ("damaged", "how"),
    [
        ("__0_0.distcp", "flip"),
        ("__1_0.distcp", "flip"),
        ("__1_0.distcp", "cut"),
        (".metadata", "flip"),
        ("checksums.json", "cut"),
        ("rest.pt", "flip"),
    ],
)
@pytest.mark.parametrize("loaded_on", [2, 3])
def test_a_damaged_file_changes_no_ranks_parameters_and_is_named_on_every_rank(
    saved: str, damaged: str, how: str, loaded_on: int
) -> None:
    """Whichever rank's share holds the damaged file (at 3 ranks a shard is checked by a rank that
    does not read it), every rank raises CheckpointCorruptError naming it, and every rank's
    parameters are still what they were before the load."""
    out = Runner(loaded_on)(
        checks_sharded_load.check_damage_changes_no_parameter, saved, damaged, how, timeout=120
    )
    for rank in out:
        assert rank["raised"] is not None, rank
        assert rank["unchanged"], rank
        assert rank["file"] in rank["raised"]["message"], rank["raised"]
        assert rank["file"] in rank["raised"]["faults"] or damaged == "rest.pt", rank["raised"]
    assert len({repr(sorted(rank["raised"]["faults"].items())) for rank in out}) == 1, out


# ---------------------------------------------------------------- the layout read from a saved tensor
def _saved(tensor: torch.Tensor) -> io.BytesIO:
    archive = io.BytesIO()
    torch.save(tensor, archive)
    return archive


def test_tensor_layout_finds_a_saved_tensors_bytes() -> None:
    tensor = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    archive = _saved(tensor)
    start, dtype, size, stride, numel = tensor_layout(archive)  # type: ignore[misc]
    assert (dtype, size, stride, numel) == (torch.float64, (3, 4), (4, 1), 12)
    assert archive.getvalue()[start : start + 96] == tensor.numpy().tobytes()


def test_tensor_layout_of_a_view_starts_at_its_offset_and_keeps_its_stride() -> None:
    base = torch.arange(20, dtype=torch.int32)
    start, _, size, stride, numel = tensor_layout(_saved(base[5:11]))  # type: ignore[misc]
    whole, *_ = tensor_layout(_saved(base))  # type: ignore[misc]
    assert (size, stride, numel) == ((6,), (1,), 15)  # torch.save keeps the whole storage
    assert start - whole == 5 * 4
    assert tensor_layout(_saved(base.reshape(4, 5).t()))[2:4] == ((5, 4), (1, 5))  # type: ignore[index]


def test_tensor_layout_refuses_what_is_not_one_plain_tensor() -> None:
    """A parameter, a dict, a tensor subclass: DCP's own read loads those."""
    assert tensor_layout(_saved(torch.nn.Parameter(torch.zeros(2)))) is None
    archive = io.BytesIO()
    torch.save({"a": torch.zeros(2)}, archive)
    assert tensor_layout(archive) is None
    assert tensor_layout(io.BytesIO(b"not an archive")) is None
