"""The training loop on every backend: gradient accumulation (od.no_sync, od.accumulate) and mixed
precision (auto_model(precision=...), od.backward), serially and on gloo and shm pools of 1-3
ranks. mpirun (mpi4py), horovodrun and XLA run the same checks in test_mpi.py, test_horovod.py
and test_xla.py; the CUDA path (float16 with the GradScaler) in test_gpu.py."""

from __future__ import annotations

import pytest

import checks_loop
from conftest import Runner


@pytest.mark.parametrize("counted_by", ["no_sync", "accumulate"])
def test_accumulating_k_micro_batches_equals_one_step_on_the_k_fold_batch(training_world, counted_by):
    out = training_world(checks_loop.check_accumulation_equals_the_big_batch, counted_by == "accumulate")
    assert all(o["relative_difference"] <= 1e-6 for o in out), out
    # one exchange per window: as many as one plain step (DDP's one bucket here), none alone
    assert {o["exchanges_per_window"] for o in out} == {1 if training_world.world_size > 1 else 0}, out


def test_bad_loop_arguments_raise_naming_them(training_world):
    training_world(checks_loop.check_no_sync_and_accumulate_arguments)


def test_bf16_mixed_computes_in_bfloat16_and_keeps_float32_state(training_world):
    out = training_world(checks_loop.check_bf16_mixed_runs_the_forward_in_bfloat16)
    assert all(o["relative_difference_to_fp32"] < 0.05 for o in out), out


def test_precision_the_device_cannot_do_raises(training_world):
    training_world(checks_loop.check_precision_arguments)


@pytest.fixture
def cpu_scaler():
    """The "16-mixed" scaler, on the CPU (CUDA's path in test_gpu.py): torch's real GradScaler
    drives od.backward and auto_optim's step the same way on either device."""
    import torch

    from onedist.training import precision

    precision._scaler, precision._stepped = torch.amp.GradScaler("cpu", init_scale=2.0**10), False
    yield precision._scaler
    precision._scaler, precision._stepped = None, False


def test_the_scaler_skips_an_inf_step_then_lowers_the_scale_once_for_all_optimizers(cpu_scaler):
    import torch

    import onedist as od

    first, second = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    optimizers = [od.auto_optim(torch.optim.SGD(m.parameters(), lr=0.1)) for m in (first, second)]
    x = torch.ones(2, 3)

    def step(scale_input: float) -> None:
        od.backward(first(x * scale_input).sum() + second(x).sum())
        for opt in optimizers:
            opt.step()
            opt.zero_grad()

    before = [p.detach().clone() for p in first.parameters()]
    step(1.0)
    assert cpu_scaler.get_scale() == 2.0**10  # updated at the next backward, not inside step()
    moved = [p.detach().clone() for p in first.parameters()]
    assert not torch.equal(moved[0], before[0])
    # the unscaled gradient was applied: weight - lr * 2 (d/dw of the sum over 2 rows of ones)
    assert torch.allclose(moved[0], before[0] - 0.1 * 2.0)
    step(float("inf"))  # inf gradients in the first model: its step is skipped
    assert all(torch.equal(p, m) for p, m in zip(first.parameters(), moved))
    step(1.0)  # its backward lowers the scale once (two optimizers stepped), then both train
    assert cpu_scaler.get_scale() == 2.0**9
    assert not torch.equal(next(first.parameters()), moved[0])


@pytest.mark.parametrize("alias", ["32-true", 32])
def test_precision_aliases_of_32_change_nothing(alias):
    import torch

    import onedist as od

    model = torch.nn.Linear(4, 2)
    assert od.auto_model(model, precision=alias) is model and not model._forward_pre_hooks
    assert model(torch.ones(1, 4)).dtype == torch.float32
    with pytest.raises(
        od.OnedistValueError, match=r"precision='33' is not allowed; allowed: '32', 'bf16-mixed'"
    ):
        od.auto_model(torch.nn.Linear(4, 2), precision="33")


def test_no_sync_looks_through_torch_compile():
    Runner(2)(checks_loop.check_no_sync_looks_through_torch_compile)
