"""One-file checkpoints and sharded models (issue 52, point 2): a one-file checkpoint loads into a
model built under od.init_module(empty_init=True) and sharded, each rank reading only its shards'
bytes; od.full_state_dict and save_checkpoint(full=True) gather one tensor at a time. 3 gloo ranks
(od.save_checkpoint's file) and 3 shm ranks (a plain torch.save file); mpi4py in tests/test_mpi.py
(tests/checks_full_checkpoint.py)."""

from __future__ import annotations

import pytest
import torch

import checks_full_checkpoint
from conftest import Runner
from onedist.backends.shm import supported as shm_supported


@pytest.fixture(scope="module")
def big_files(tmp_path_factory):
    """Big's weights written once: by od.save_checkpoint (with its CRC-32) and by torch.save."""
    where = tmp_path_factory.mktemp("big")
    files = {}
    for kind in ("onedist", "torch.save"):
        path = str(where / f"{kind}.pt")
        files[kind] = (path, checks_full_checkpoint.write_big_checkpoint(path, plain=kind == "torch.save"))
    return files


@pytest.mark.parametrize(
    "backend, kind",
    [
        ("gloo", "onedist"),
        pytest.param(
            "shm",
            "torch.save",
            marks=pytest.mark.skipif(not shm_supported(), reason="the shm backend needs Linux memfd_create"),
        ),
    ],
)
def test_a_one_file_checkpoint_loads_into_a_256_mib_meta_model_reading_only_each_ranks_shards(
    backend, kind, big_files, tmp_path
):
    path, total = big_files[kind]
    out = Runner(3, backend)(
        checks_full_checkpoint.check_a_one_file_checkpoint_loads_into_shards_reading_only_their_bytes,
        path,
        total,
        str(tmp_path),
        timeout=180,
    )
    print(backend, kind, out)  # the measured figures, for the record (pytest -s)
    assert out[0]["max_difference"] <= 1e-5 and out[0]["moved"] >= 1e-3, out[0]


@pytest.mark.parametrize("world", [2, 3])
def test_one_file_checkpoints_load_into_sharded_models_and_bad_inputs_raise_naming_them(world, tmp_path):
    Runner(world)(checks_full_checkpoint.check_one_file_checkpoints_and_sharded_models, str(tmp_path))


def test_the_checksum_pass_keeps_the_file_out_of_the_resident_set(tmp_path):
    """verify_file over a 96 MiB file: the peak RSS grows by a few MiB (each 4 MiB hashed is handed
    back to the page cache), not by the file."""
    import os

    from onedist.training.checksums import save_with_checksum, verify_file

    path = tmp_path / "big.pt"
    with open(path, "wb") as f:
        save_with_checksum({"w": torch.randn(24 << 20)}, f)
    start = checks_full_checkpoint.reset_peak()
    assert verify_file(path)
    grown = checks_full_checkpoint.status()["VmHWM"] - start["VmRSS"]
    print(grown)
    assert grown <= 16 * 2**20, grown
    os.unlink(path)
