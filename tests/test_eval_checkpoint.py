"""all_gather_eval and the checkpoints, on real gloo process groups of 1-4 ranks and serially."""

from __future__ import annotations

import pytest

import checks_eval


@pytest.mark.parametrize("kind", ["eval", "padded", "auto_shuffle", "user_shuffle", "proxy"])
def test_eval_exact_in_dataset_order(world, kind):
    accuracies = world(checks_eval.check_eval_exact, kind)
    assert accuracies == [checks_eval.serial_accuracy()] * world.world_size


def test_eval_indices(world):
    out = world(checks_eval.check_eval_indices)
    assert out == [list(range(0, 800, 20))] * world.world_size


def test_eval_without_loader(world):
    world(checks_eval.check_eval_serial_passthrough_and_errors)


def test_eval_mismatch_raises_on_every_rank(world):
    assert world(checks_eval.check_eval_mismatch_raises_everywhere) == ["ok"] * world.world_size


def test_checkpoint_roundtrip_one_writer(world, tmp_path):
    writes = world(checks_eval.check_checkpoint_roundtrip, str(tmp_path))
    assert writes == [1] + [0] * (world.world_size - 1)


def test_checkpoint_prefixes_and_single_object(world, tmp_path):
    world(checks_eval.check_checkpoint_prefix_and_single_object, str(tmp_path))


def test_checkpoint_errors_raise_on_every_rank(world, tmp_path):
    assert world(checks_eval.check_checkpoint_errors_everywhere, str(tmp_path)) == ["ok"] * world.world_size


class _Custom:  # a pickled class instance: what weights_only=True refuses
    def __init__(self) -> None:
        self.value = 3


def test_load_checkpoint_loads_only_weights_unless_told(tmp_path):
    import torch

    import onedist as od

    path = tmp_path / "custom.pt"
    od.save_checkpoint({"weights": torch.ones(2), "custom": _Custom()}, path)
    with pytest.raises(Exception, match="(?i)weights_only"):
        od.load_checkpoint(path)
    assert od.load_checkpoint(path, weights_only=False)["custom"].value == 3


def test_save_checkpoint_with_fabrics_argument_order_says_to_swap_them(tmp_path):
    """Fabric's ``save(path, state)`` has the path first: the error says so and shows the call."""
    import onedist as od

    path = str(tmp_path / "last.pt")
    with pytest.raises(od.OnedistTypeError) as info:
        od.save_checkpoint(path, {"epoch": 3})  # type: ignore[arg-type]
    text = str(info.value)
    assert "path has type dict" in text and f"od.save_checkpoint(state, {path!r})" in text, text
    assert not (tmp_path / "last.pt").exists()
