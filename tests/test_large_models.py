"""Models larger than one rank (issue 52, points 1 and 3): od.init_module(empty_init=True) and
auto_model's allocation of a meta model (only each rank's shards under sharding="fsdp"),
activation checkpointing, precision="bf16-true" and cpu_offload; serially and on the shared gloo
and shm pools (tests/checks_large_models.py)."""

from __future__ import annotations

import pytest

import checks_large_models
from conftest import Runner
from onedist.backends.shm import supported as shm_supported

BACKENDS = ["gloo"] + (["shm"] if shm_supported() else [])


@pytest.mark.parametrize("sharding", [None, "fsdp"])
@pytest.mark.parametrize("world", ["serial", 2, 3])
def test_a_meta_model_is_initialised_as_one_process_would(world, sharding):
    out = Runner(world)(checks_large_models.check_meta_init_equals_the_serial_init, sharding)
    assert all(o["sharded"] == (sharding == "fsdp" and world != "serial") for o in out), out


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_256_mib_meta_model_allocates_only_each_ranks_shards(backend):
    """3 ranks: building grows each rank's peak RSS by < 16 MiB; sharding and initialising it by at
    most its third + one layer (16 MiB) + 16 MiB; each rank's shards hold a third of the bytes."""
    out = Runner(3, backend)(
        checks_large_models.check_a_large_meta_model_allocates_only_its_shards, timeout=120
    )
    print(backend, out)  # the measured figures, for the record (pytest -s)
    assert all(o["held"] * 3 <= o["total"] * 1.01 for o in out), out


def test_init_weights_false_leaves_the_memory_for_load_checkpoint(tmp_path):
    Runner(2)(
        checks_large_models.check_init_weights_false_leaves_the_memory_for_load_checkpoint, str(tmp_path)
    )


@pytest.mark.parametrize("sharding", [None, "fsdp"])
@pytest.mark.parametrize("world", ["serial", 2])
def test_activation_checkpointing_gives_the_same_gradients_and_keeps_fewer_bytes(world, sharding):
    out = Runner(world)(
        checks_large_models.check_activation_checkpointing_same_loss_fewer_kept_bytes, sharding
    )
    print(world, sharding, out[0])
    assert out[0]["true"] <= 0.6 * out[0]["plain"], out


@pytest.mark.parametrize("sharding", [None, "fsdp"])
@pytest.mark.parametrize("world", ["serial", (2, "gloo"), (2, "shm")], ids=["serial", "gloo-2", "shm-2"])
def test_bf16_true_trains_in_bfloat16_on_half_the_bytes(world, sharding):
    if world != "serial" and world[1] == "shm" and not shm_supported():
        pytest.skip("the shm backend needs Linux memfd_create")
    runner = Runner(world) if world == "serial" else Runner(*world)
    out = runner(checks_large_models.check_bf16_true_trains_in_bfloat16_on_half_the_bytes, sharding)
    print(world, sharding, out[0])


def test_cpu_offload_on_the_cpu_warns_once_and_changes_nothing():
    Runner(2)(checks_large_models.check_cpu_offload_on_the_cpu_warns_once_and_changes_nothing)


@pytest.mark.parametrize("world", ["serial", 2])
def test_bad_large_model_arguments_raise_naming_them(world):
    Runner(world)(checks_large_models.check_large_model_arguments)


def test_options_horovod_and_xla_cannot_carry_are_refused_naming_what_is_supported(monkeypatch):
    """A backend that wraps models its own way (Horovod, XLA: model_parallelism "own"; the serial
    backend made to say so here, as neither runs on this machine) refuses a meta model and
    activation checkpointing at once, naming the backends that carry them; "bf16-true" is not among
    Horovod's and XLA's precisions (checks_sharding runs the same refusals on the real backends)."""
    import torch

    import onedist as od
    from onedist.context import current
    from onedist.training.precision import check_precision

    backend = current()
    monkeypatch.setattr(backend, "model_parallelism", "own")
    with od.init_module(empty_init=True):
        net = checks_large_models.Net()
    for kwargs, text in [
        (
            {"model": net},
            "model='Net on the meta device' is not allowed; allowed: an allocated model with backend",
        ),
        (
            {"model": checks_large_models.Net(), "activation_checkpointing": True},
            "activation_checkpointing=True is not allowed; allowed: None with backend",
        ),
    ]:
        with pytest.raises(od.OnedistValueError) as raised:
            od.auto_model(**kwargs)
        assert text in str(raised.value) and "gloo, nccl, shm, mpi" in str(raised.value), raised.value
    for name in ("horovod", "xla-tpu"):  # the backends' names, od.backend()'s
        with pytest.raises(
            od.OnedistValueError,
            match=r"precision='bf16-true' is not allowed; allowed: '32', 'bf16-mixed' on",
        ):
            check_precision("bf16-true", torch.device("cpu"), name)
