"""CUDA and NCCL paths, on a real GPU. Every test here is skipped on a machine without CUDA
(CI has none); they were run on a lent H100 machine, see the session notes / CHANGELOG.

    python -m pytest tests/test_gpu.py -v          # on a machine with an NVIDIA GPU

The workers are real processes started by ``od.Parallel`` with the nccl backend.
"""

from __future__ import annotations

import pytest
import torch

import onedist as od

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)"),
]


def _net(batchnorm: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(16, 32)]
    if batchnorm:
        layers.append(torch.nn.BatchNorm1d(32))
    layers += [torch.nn.ReLU(), torch.nn.Linear(32, 4)]
    return torch.nn.Sequential(*layers)


def _data(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)


def _step(
    net: torch.nn.Module,
    opt: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    x: torch.Tensor,
    y: torch.Tensor,
) -> float:
    """One training step (float16 autocast when ``scaler`` is enabled); the loss."""
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.float16, enabled=scaler.is_enabled()):
        loss = torch.nn.functional.cross_entropy(net(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss.item()


def _queries_and_collectives(local_rank: int) -> dict:
    dev = od.device()
    t = torch.arange(4.0, device=dev)
    summed = od.all_reduce(t.clone())
    inplace = torch.ones(2, device=dev)
    return {
        "in_place": od.all_reduce(inplace) is inplace and inplace.tolist() == [1.0, 1.0],
        "copy_untouched": od.all_reduce(inplace, inplace=False) is not inplace,
        "backend": od.backend(),
        "device": str(dev),
        "current": torch.cuda.current_device(),
        "tensor_sum": summed.tolist(),
        "tensor_device": str(summed.device),
        "number": od.all_reduce(3),
        "mean": od.all_reduce(3, "MEAN"),
        "strings": od.all_gather("gpu"),
        "object": od.broadcast_object({"a": [1, 2]} if od.get_rank() == 0 else None, src=0),
        "gathered": [x.tolist() for x in od.all_gather(torch.ones(2, device=dev))],
        "uneven": [x.shape[0] for x in od.all_gather_tensors_with_shapes(torch.ones(3, device=dev), [[3]])],
        "barrier": od.barrier() is None,
    }


def test_nccl_world_size_1_queries_and_collectives() -> None:
    with od.Parallel(backend="nccl", nproc_per_node=1) as parallel:
        res = parallel.run(_queries_and_collectives)
    assert res["backend"] == "nccl"
    assert res["device"] == "cuda:0" and res["current"] == 0
    assert res["tensor_sum"] == [0.0, 1.0, 2.0, 3.0] and res["tensor_device"] == "cuda:0"
    assert res["in_place"] and res["copy_untouched"]
    assert res["number"] == 3 and res["mean"] == 3.0
    assert res["strings"] == ["gpu"] and res["object"] == {"a": [1, 2]}
    assert res["gathered"] == [1.0, 1.0] and res["uneven"] == [3]
    assert res["barrier"]


def _split_training(local_rank: int, amp: bool, batchnorm: bool) -> dict:
    """auto_* with global batch 16 split across ranks vs one plain model with batch 16, on cuda."""
    x, y = _data()
    world, rank = od.get_world_size(), od.get_rank()
    model = od.auto_model(_net(batchnorm), sync_bn=batchnorm)
    opt = od.auto_optim(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    ref = _net(batchnorm).cuda()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    scalers = [torch.amp.GradScaler("cuda", enabled=amp) for _ in range(2)]
    dev = od.device()
    for step in range(6):
        xb, yb = x[step * 16 % 64 :][:16].to(dev), y[step * 16 % 64 :][:16].to(dev)
        share = slice(rank * 16 // world, (rank + 1) * 16 // world)
        for net, o, sc, xs, ys in (
            (model, opt, scalers[0], xb[share], yb[share]),
            (ref, ref_opt, scalers[1], xb, yb),
        ):
            _step(net, o, sc, xs, ys)
    inner = od.unwrap(model)
    ours, theirs = inner.state_dict(), ref.state_dict()
    return {
        "type": type(model).__name__,
        "device_ids": list(getattr(model, "device_ids", None) or []),
        "param_device": str(next(model.parameters()).device),
        "syncbn": type(inner[1]).__module__ + "." + type(inner[1]).__name__ if batchnorm else None,
        "max_diff": max(float((ours[k].float() - v.float()).abs().max()) for k, v in theirs.items()),
    }


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
def test_nccl_world_size_1_auto_model_on_gpu_equals_plain_training(amp: bool) -> None:
    """World size 1 on nccl: auto_model moves the model to cuda:0 and, like ignite, does not wrap
    it (DDP over one process only costs time); training equals the plain model's, with AMP too."""
    with od.Parallel(backend="nccl", nproc_per_node=1) as parallel:
        res = parallel.run(_split_training, amp, False)
    assert res["type"] == "Sequential" and res["param_device"] == "cuda:0"
    assert res["max_diff"] < 1e-6, res


@pytest.mark.parametrize(
    "amp,batchnorm", [(False, False), (True, False), (False, True)], ids=["fp32", "amp", "syncbn"]
)
def test_ddp_device_ids_on_gpu_equals_one_process(amp: bool, batchnorm: bool) -> None:
    """Two processes on the one GPU (gloo: NCCL needs a GPU per rank): auto_model gives
    DDP(device_ids=[0]) on cuda:0, torch's SyncBatchNorm when asked, and the global batch split
    across the ranks trains the same parameters as one process with the whole batch (to 1e-5;
    5e-4 under float16 autocast)."""
    with od.Parallel(backend="gloo", nproc_per_node=2) as parallel:
        res = parallel.run(_split_training, amp, batchnorm)
    assert res["type"] == "DistributedDataParallel", res
    assert res["device_ids"] == [0] and res["param_device"] == "cuda:0"
    if batchnorm:
        assert res["syncbn"] == "torch.nn.modules.batchnorm.SyncBatchNorm"
    # fp16 autocast rounds a batch of 8 and one of 16 differently (other GEMM kernels): 5e-5 seen
    assert res["max_diff"] < (5e-4 if amp else 1e-5), res


def _comm_hook(local_rank: int, hook: str) -> dict:
    x, y = _data(16)
    x, y = x.cuda(), y.cuda()
    model = od.auto_model(_net(), comm_hook=hook)
    opt = od.auto_optim(torch.optim.SGD(model.parameters(), lr=0.1))
    no_amp = torch.amp.GradScaler("cuda", enabled=False)
    losses = [_step(model, opt, no_amp, x, y) for _ in range(8)]  # the same batch: the loss must fall
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    spread = od.all_reduce(flat.clone(), "MAX") - od.all_reduce(flat.clone(), "MIN")
    return {"falls": losses[-1] < losses[0], "spread": float(spread.abs().max())}


@pytest.mark.parametrize("hook", ["fp16", "bf16", "powersgd"])
def test_comm_hooks_on_gpu_train_and_keep_ranks_equal(hook: str) -> None:
    with od.Parallel(backend="gloo", nproc_per_node=2) as parallel:
        res = parallel.run(_comm_hook, hook)
    assert res["falls"] and res["spread"] == 0.0, res


def _checkpoint_round_trip(local_rank: int, path: str) -> dict:
    model = od.auto_model(_net())
    od.save_checkpoint({"model": model, "step": 3}, path)
    state = od.load_checkpoint(path)
    return {
        "step": state["step"],
        "devices": sorted({str(v.device) for v in state["model"].values()}),
        "keys_unwrapped": not any(k.startswith("module.") for k in state["model"]),
    }


def test_nccl_checkpoint_maps_to_local_gpu(tmp_path) -> None:
    with od.Parallel(backend="nccl", nproc_per_node=1) as parallel:
        res = parallel.run(_checkpoint_round_trip, str(tmp_path / "ckpt.pt"))
    assert res == {"step": 3, "devices": ["cuda:0"], "keys_unwrapped": True}


def _gloo_cuda(local_rank: int) -> dict:
    t = torch.full((3,), float(od.get_rank() + 1), device=od.device())
    summed = od.all_reduce(t)
    return {
        "device": str(od.device()),
        "in_place": summed is t,  # ignite's semantics: the tensor itself, reduced
        "sum": t.tolist(),
        "ranks": od.all_gather(od.get_rank()),
        "names": od.all_gather(f"r{od.get_rank()}"),
    }


def test_gloo_with_cuda_tensors_two_ranks_share_the_gpu() -> None:
    """gloo with CUDA: both ranks use the one GPU (gloo allows sharing) and reduce cuda tensors."""
    with od.Parallel(backend="gloo", nproc_per_node=2) as parallel:
        res = parallel.run(_gloo_cuda)
    assert res["device"] == "cuda:0"
    assert res["sum"] == [3.0, 3.0, 3.0] and res["ranks"] == [0, 1] and res["names"] == ["r0", "r1"]
    assert res["in_place"]


def _two_on_one(local_rank: int) -> float:
    return float(od.all_reduce(torch.ones(1, device=od.device())))


@pytest.mark.skipif(torch.cuda.device_count() != 1, reason="checks the one-GPU machine")
def test_nccl_two_ranks_on_one_gpu_is_a_clear_error() -> None:
    """NCCL cannot put two ranks on one GPU: onedist says so, naming the GPU count and the fix."""
    with pytest.raises(Exception, match=r"(?s)one GPU.*nproc_per_node"):
        with od.Parallel(backend="nccl", nproc_per_node=2, timeout=60) as parallel:
            parallel.run(_two_on_one)


def _precision_16_mixed(local_rank: int) -> dict:
    """auto_model(precision="16-mixed") + od.backward + auto_optim's scaled step, against the same
    steps written by hand (autocast + GradScaler); then a step on an inf loss is skipped."""
    x, y = _data()
    dev = od.device()
    model = od.auto_model(_net(), precision="16-mixed")
    opt = od.auto_optim(torch.optim.SGD(model.parameters(), lr=0.1))
    ref = _net().to(dev)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda")
    for step in range(5):
        xb, yb = x[step * 8 :][:8].to(dev), y[step * 8 :][:8].to(dev)
        out = model(xb)
        assert out.dtype == torch.float32  # outputs come back as float32
        od.backward(torch.nn.functional.cross_entropy(out, yb))
        opt.step()
        opt.zero_grad()
        ref_opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = ref(xb)
        # the loss on the float32 logits, outside autocast (what auto_model returns; Fabric too):
        # the loss computed inside autocast differs by ~1e-5 after one step (H200, torch 2.11)
        scaler.scale(torch.nn.functional.cross_entropy(logits.float(), yb)).backward()
        scaler.step(ref_opt)
        scaler.update()
    diff = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), ref.parameters()))
    before = [p.detach().clone() for p in model.parameters()]
    bad = torch.full((8, 16), float("inf"), device=dev)
    od.backward(model(bad).sum())  # inf/NaN gradients: the scaled step is skipped
    opt.step()
    opt.zero_grad()
    skipped = all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    od.backward(torch.nn.functional.cross_entropy(model(x[:8].to(dev)), y[:8].to(dev)))
    opt.step()
    moved = not all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    return {"max_diff": diff, "skipped_inf_step": skipped, "next_step_moved": moved}


def test_16_mixed_scales_unscales_and_skips_an_inf_step_on_gpu() -> None:
    """precision="16-mixed" on nccl: bit for bit the parameters of autocast + GradScaler by hand; a step
    whose gradients are inf is skipped (the parameters stay) and the next one trains."""
    with od.Parallel(backend="nccl", nproc_per_node=1) as parallel:
        res = parallel.run(_precision_16_mixed)
    assert res["max_diff"] == 0.0 and res["skipped_inf_step"] and res["next_step_moved"], res


def _sharded_on_gpu(local_rank: int, tmpdir: str) -> dict:
    """checks_sharding's and checks_sharded_checkpoint's checks on nccl (one process: the model is
    not sharded, the checkpoint stays one file; several: FSDP2 and DCP on the GPUs)."""
    import os

    import checks_sharded_checkpoint
    import checks_sharding

    trained = checks_sharding.check_fsdp_trains_like_ddp_on_a_fraction_of_the_bytes(clip=True)
    checks_sharding.check_buffers_follow_rank_0_as_under_ddp()
    folder = os.path.join(tmpdir, "round-trip")
    if od.get_rank() == 0:
        os.makedirs(folder)
    od.barrier()
    saved = checks_sharded_checkpoint.check_sharded_checkpoint_round_trip(folder)
    return {"relative_difference": trained["relative_difference"], "files": len(saved["files"])}


@pytest.mark.parametrize("n", sorted({1, torch.cuda.device_count()}) if torch.cuda.is_available() else [1])
def test_sharding_and_sharded_checkpoints_on_nccl(n: int, tmp_path) -> None:
    """auto_model(sharding="fsdp") trains like DDP and its checkpoint resumes bit for bit on nccl, at
    world size 1 and at the machine's number of GPUs."""
    with od.Parallel(backend="nccl", nproc_per_node=n) as parallel:
        res = parallel.run(_sharded_on_gpu, str(tmp_path))
    assert res["relative_difference"] <= 1e-5 and res["files"] == (n if n > 1 else 0), res


def _uneven_on_gpu(local_rank: int) -> dict:
    import checks_join

    out = checks_join.check_uneven_loop_equals_torch_join(sync_bn=True, divide_by_world=False)
    checks_join.check_broadcast_from_a_finished_rank_raises_everywhere()
    return {"steps": out["steps"], "difference": out["difference"]}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="od.join on nccl needs 2 GPUs (one rank per GPU)")
def test_uneven_data_inside_od_join_on_nccl() -> None:
    """od.join on nccl (tests/checks_join.py): rank r with 10 + 3r batches, SyncBatchNorm, a metrics
    all_reduce and an all_gather every step; torch's Join's weights; a refused broadcast."""
    n = min(torch.cuda.device_count(), 3)
    with od.Parallel(backend="nccl", nproc_per_node=n) as parallel:
        res = parallel.run(_uneven_on_gpu)
    assert res["steps"] == 10 and res["difference"] <= 1e-5, res


def _large_models_on_gpu(local_rank: int) -> dict:
    """tests/checks_large_models.py on the GPUs: a meta model initialised as the same build on the
    GPU would be (the CUDA generator draws) and bf16-true; with several GPUs, cpu_offload=True
    keeping the shards on the CPU. (Activation checkpointing's bit-for-bit check stays on the CPU:
    an embedding's backward pass on CUDA adds with atomics, in no fixed order.)"""
    import checks_large_models

    sharding = "fsdp" if od.get_world_size() > 1 else None
    out = checks_large_models.check_meta_init_equals_the_serial_init(sharding)
    if torch.cuda.is_bf16_supported():
        checks_large_models.check_bf16_true_trains_in_bfloat16_on_half_the_bytes(sharding)
    if od.get_world_size() > 1:
        out.update(checks_large_models.check_cpu_offload_keeps_the_shards_on_the_cpu())
    return out


@pytest.mark.parametrize("n", sorted({1, torch.cuda.device_count()}) if torch.cuda.is_available() else [1])
def test_large_model_options_on_nccl(n: int) -> None:
    """init_module + auto_model and bf16-true on nccl at world size 1 and at
    the machine's number of GPUs; cpu_offload=True (FSDP2's CPUOffloadPolicy) where there are 2 or
    more GPUs to shard over (nccl takes one rank per GPU)."""
    with od.Parallel(backend="nccl", nproc_per_node=n) as parallel:
        res = parallel.run(_large_models_on_gpu)
    assert res["output_difference"] <= 1e-6, res
    if n > 1:
        assert res["max_difference"] <= 1e-5, res
