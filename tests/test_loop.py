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


def test_accumulate_without_a_loader_runs_windows_on_across_epochs():
    import torch

    import onedist as od

    model = od.auto_model(torch.nn.Linear(2, 1))
    epochs = {}
    for loader in (None, "given"):
        batches = [torch.ones(1, 2)] * 6
        seen = []
        for _ in range(2):  # two epochs of 6 batches, windows of 4
            for x in batches:
                with od.accumulate(model, every=4, loader=batches if loader else None) as window:
                    od.backward(model(x).sum() / window.size)
                seen.append((window.index, window.size, window.sync))
        epochs[loader] = seen
        od.training.accumulation._counters.pop(model)  # each way counts from 0
    # without it the second epoch finishes the window the first one left open
    assert [i for i, _, _ in epochs[None]] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3], epochs[None]
    assert {s for _, s, _ in epochs[None]} == {4}
    assert [sync for _, _, sync in epochs[None]] == [False, False, False, True] * 3
    # with it each epoch ends its window: 4, then 2
    assert [i for i, _, _ in epochs["given"]] == [0, 1, 2, 3, 0, 1] * 2, epochs["given"]
    assert [s for _, s, _ in epochs["given"]] == [4, 4, 4, 4, 2, 2] * 2


def test_the_precision_error_ends_with_its_hint():
    import torch

    import onedist as od

    with pytest.raises(od.OnedistValueError) as raised:
        od.auto_model(torch.nn.Linear(2, 2), precision="16-mixed")
    assert str(raised.value) == (  # the page's text, serially on CPU
        "onedist.auto_model: precision='16-mixed' is not allowed; allowed: '32', 'bf16-mixed', 'bf16-true' "
        "on device 'cpu' with backend 'serial'\n"
        "HINT: float16 training needs CUDA (and a backend with the GradScaler path): use 'bf16-mixed'"
    )


def test_16_mixed_is_refused_with_sharding(monkeypatch):
    """Where the device allows "16-mixed" (CUDA: its allowance is set here), sharding refuses it."""
    import torch

    import onedist as od
    from onedist.training import precision

    monkeypatch.setattr(precision, "_allowed", lambda device, backend: ("32", "bf16-mixed", "16-mixed"))
    monkeypatch.setattr(precision, "_scaler", None)  # should it not raise, no scaler stays behind
    with pytest.raises(od.OnedistValueError) as raised:
        od.auto_model(torch.nn.Linear(2, 2), precision="16-mixed", sharding="fsdp")
    assert (
        "precision='16-mixed' is not allowed; allowed: '32', 'bf16-mixed' or 'bf16-true' with sharding='fsdp'"
        in str(raised.value)
    )


def test_clip_grad_norm_under_16_mixed_unscales_through_the_optimizer(cpu_scaler):
    import torch

    import onedist as od

    model = torch.nn.Linear(3, 1)
    optimizer = od.auto_optim(torch.optim.SGD(model.parameters(), lr=0.1))
    before = model.weight.detach().clone()
    od.backward(model(torch.ones(2, 3)).sum())  # gradients 2 (weight: 3, bias: 1): norm 4, scaled
    with pytest.raises(
        od.OnedistValueError, match=r"optimizer=None is not allowed.*\nHINT: .*unscaled first"
    ):
        od.clip_grad_norm_(model, max_norm=1.0)
    assert torch.equal(model.weight.grad, torch.full((1, 3), 2.0 * 2**10))  # untouched
    norm = od.clip_grad_norm_(model, max_norm=1.0, optimizer=optimizer)
    assert float(norm) == 4.0  # the unscaled norm, before clipping
    optimizer.step()  # does not unscale a second time: the clipped gradient 2 / 4 is applied
    assert torch.allclose(model.weight, before - 0.1 * 0.5)


def test_the_scalers_state_is_not_in_a_checkpoint(cpu_scaler, tmp_path):
    import torch

    import onedist as od
    from onedist.training import precision

    model = torch.nn.Linear(3, 1)
    optimizer = od.auto_optim(torch.optim.SGD(model.parameters(), lr=0.1))
    for scale_input in (float("inf"), 1.0):  # inf gradients: the next od.backward lowers the scale
        od.backward(model(torch.ones(2, 3) * scale_input).sum())
        optimizer.step()
        optimizer.zero_grad()
    assert cpu_scaler.get_scale() == 2.0**9
    path = tmp_path / "ckpt.pt"
    od.save_checkpoint({"model": model, "optimizer": optimizer}, path)

    def keys(value):
        if isinstance(value, dict):
            return {str(k) for k in value} | {k for v in value.values() for k in keys(v)}
        return set()

    saved = keys(torch.load(path))
    assert not any("scale" in k or "growth" in k for k in saved), saved
    # a restart: a new process's scaler, which loading the checkpoint leaves at its initial scale
    precision._scaler, precision._stepped = None, False
    fresh = precision.apply_precision(torch.nn.Linear(3, 1), "16-mixed", torch.device("cpu"))
    od.load_checkpoint(
        path, {"model": fresh, "optimizer": od.auto_optim(torch.optim.SGD(fresh.parameters()))}
    )
    assert precision.active_scaler().get_scale() == 2.0**16


def test_16_mixed_is_refused_with_horovod_where_cuda_allows_it():
    """auto_model's precision check for a CUDA device (no GPU here: the check itself, which needs
    none): "16-mixed" is allowed with nccl and refused with Horovod, naming what Horovod allows."""
    import torch

    import onedist as od
    from onedist.training.precision import check_precision

    cuda = torch.device("cuda")
    assert check_precision("16-mixed", cuda, "nccl") == "16-mixed"
    with pytest.raises(od.OnedistValueError) as raised:
        check_precision("16-mixed", cuda, "horovod")
    assert str(raised.value).startswith(
        "onedist.auto_model: precision='16-mixed' is not allowed; allowed: '32'"
    ) and "on device 'cuda' with backend 'horovod'" in str(raised.value), raised.value


@pytest.mark.parametrize(
    ("backend", "bf16_true"),
    [(None, True), ("gloo", True), ("shm", True), ("mpi", True), ("horovod", False), ("xla-tpu", False)],
)
def test_bf16_true_is_offered_where_it_was_built(backend, bf16_true):
    """By the backends' real names (od.backend()'s): XLA's is "xla-tpu", and a refusal keyed on
    "xla" once let bf16 parameters through XLA's optimizer path, which was never built."""
    import torch

    from onedist.training.precision import _allowed

    assert ("bf16-true" in _allowed(torch.device("cpu"), backend)) is bf16_true
