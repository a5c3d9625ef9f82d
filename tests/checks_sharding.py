"""auto_model(sharding="fsdp") checks, run on every rank of a torch.distributed backend (gloo and shm
pools, mpi4py under mpirun) and serially: FSDP2 trains to DDP's weights, holds 1/N of DDP's bytes,
and od.clip_grad_norm_ clips both alike."""

from __future__ import annotations

import re
from typing import Any

import torch

import onedist as od

WIDTH = 24  # every sharded dimension divides by 2 and 3: the shards are even
BATCH = 6  # global batch, over all ranks
STEPS = 20


class Block(torch.nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class Net(torch.nn.Module):
    """A few repeated blocks in a ModuleList (the default policy's units), as a transformer has."""

    def __init__(self, width: int = WIDTH, scale: float = 0.5) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(12, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(3))
        self.head = torch.nn.Linear(width, 6)
        g = torch.Generator().manual_seed(7)  # the same weights in every process and call
        with torch.no_grad():
            for p in self.parameters():
                p.copy_((torch.rand(p.shape, generator=g) - 0.5) * scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of step ``step``'s global batch."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(BATCH, 12, generator=g), torch.randn(BATCH, 6, generator=g)
    per = BATCH // od.get_world_size()
    part = slice(od.get_rank() * per, (od.get_rank() + 1) * per)
    return x[part].to(od.device()), y[part].to(od.device())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard on this rank


def _bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """This rank's bytes of parameters, gradients and optimizer state, from their storages."""
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [
        v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)
    ]
    storages = {}
    for t in tensors:
        local = _local(t)
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def _train(sharding: Any, clip: bool) -> tuple[torch.Tensor, list[float], int, str]:
    model = od.auto_model(Net(), sharding=sharding)
    # torch's AdamW with its defaults (lr 1e-3): Adam's first steps move a weight by ~lr whatever
    # its gradient's size, so a gradient element near 0, where DDP's (sum of g/N) and FSDP's
    # (sum of g, then /N) float32 roundings differ by O(1) relatively, moves by up to lr apart
    optimizer = od.auto_optim(torch.optim.AdamW(model.parameters()))
    norms = []
    for step in range(STEPS):
        x, y = _batch(step)
        od.backward(torch.nn.functional.mse_loss(model(x), y))
        if clip:
            norms.append(float(od.clip_grad_norm_(model, max_norm=0.05)))
        optimizer.step()
        if step == STEPS - 1:
            held = _bytes(model, optimizer)  # with the gradients still there
        optimizer.zero_grad()
    flat = torch.cat(
        [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten() for p in model.parameters()]
    )
    return flat.cpu(), norms, held, type(od.unwrap(model)).__name__


def check_fsdp_trains_like_ddp_on_a_fraction_of_the_bytes(clip: bool) -> dict[str, Any]:
    """AdamW, 20 steps, float32: FSDP2's weights == DDP's (relative difference <= 1e-5); this rank
    holds <= 1/N of DDP's parameter + gradient + optimizer-state bytes, + 10 %; with clipping, the
    same total norms."""
    ddp, ddp_norms, ddp_bytes, _ = _train(None, clip)
    fsdp, fsdp_norms, fsdp_bytes, kind = _train("fsdp", clip)
    ws = od.get_world_size()
    assert (kind == "FSDPNet") == (ws > 1), kind  # fully_shard changes the class; one process: no FSDP
    diff = float((fsdp - ddp).norm() / ddp.norm())
    assert diff <= 1e-5, diff
    moved = float((ddp - torch.cat([p.detach().flatten() for p in Net().parameters()])).norm() / ddp.norm())
    assert moved > 1000 * diff, (moved, diff)  # training moved the weights far more than they differ
    assert fsdp_bytes <= ddp_bytes / ws * 1.1, (fsdp_bytes, ddp_bytes, ws)
    if clip:
        assert all(n > 0.05 for n in ddp_norms[:3]), ddp_norms  # it did clip
        worst = max(abs(a - b) / b for a, b in zip(fsdp_norms, ddp_norms))
        assert worst <= 1e-5, worst
    return {"relative_difference": diff, "bytes": fsdp_bytes, "ddp_bytes": ddp_bytes}


def check_sharding_arguments() -> None:
    """Bad sharding arguments raise naming the argument, the value and what is allowed."""
    cases = [
        ({"sharding": "zero3"}, r"sharding='zero3' is not allowed; allowed: None, 'fsdp'"),
        ({"sharding": 3}, "sharding has type int"),
        (
            {"sharding": "fsdp", "find_unused_parameters": True},
            "with sharding='fsdp': policy, reshard_after_forward",
        ),
        (
            {"sharding": "fsdp", "sync_bn": True},
            "sync_bn=True is not allowed; allowed: False with sharding='fsdp'",
        ),
    ]
    for kwargs, pattern in cases:
        try:
            od.auto_model(Net(), **kwargs)
        except (od.OnedistValueError, od.OnedistTypeError) as e:
            assert re.search(pattern, str(e)), (pattern, str(e))
        else:
            raise AssertionError(f"no error for {kwargs}")
    if od.get_world_size() > 1:  # the policy is only looked at where there is something to shard
        try:
            od.auto_model(Net(), sharding="fsdp", policy=5)
        except od.OnedistTypeError as e:
            assert "policy has type int" in str(e), e
        else:
            raise AssertionError("policy=5 did not raise")
    try:
        od.clip_grad_norm_(Net(), max_norm=0)
    except od.OnedistValueError as e:
        assert "max_norm=0 is not allowed; allowed: a number > 0" in str(e), e
    else:
        raise AssertionError("max_norm=0 did not raise")


def check_sharding_is_refused_where_torch_distributed_does_not_train() -> None:
    """Horovod and XLA: sharding="fsdp" (and "hsdp") raises at once, naming the backends that shard, and
    od.clip_grad_norm_ (their gradients are averaged inside the step) raises too; so do a model
    built under od.init_module(empty_init=True), activation_checkpointing and "bf16-true"."""
    backend = od.backend()
    for sharding in ("fsdp", "hsdp"):
        try:
            od.auto_model(Net(), sharding=sharding)
        except od.OnedistValueError as e:
            assert f"sharding={sharding!r} is not allowed; allowed: None with backend {backend!r}" in str(
                e
            ), e
            assert "gloo, nccl, shm, mpi" in str(e), e
        else:
            raise AssertionError(f"sharding={sharding!r} did not raise on {backend}")
    with od.init_module(empty_init=True):
        meta = Net()
    refusals = [  # issue 52's options: built for torch.distributed and one process
        ({"model": meta}, "model='Net on the meta device' is not allowed; allowed: an allocated model"),
        ({"model": Net(), "activation_checkpointing": True}, "activation_checkpointing=True is not allowed"),
        ({"model": Net(), "precision": "bf16-true"}, "precision='bf16-true' is not allowed"),
    ]
    for kwargs, text in refusals:
        try:
            od.auto_model(**kwargs)
        except od.OnedistValueError as e:
            assert text in str(e), (text, str(e))
        else:
            raise AssertionError(f"{sorted(kwargs)} did not raise on {backend}")
    if od.get_world_size() > 1:
        model = od.auto_model(Net())
        try:
            od.clip_grad_norm_(model, max_norm=1.0)
        except od.OnedistValueError as e:
            assert "averages the gradients inside optimizer.step()" in str(e), e
        else:
            raise AssertionError(f"clip_grad_norm_ did not raise on {backend}")


def check_full_state_dict_exports(tmpdir: str) -> None:
    """od.full_state_dict gives rank 0 the whole model (a sharded one gathered), equal to DDP's;
    the exported dict saves, loads and fills an ordinary model."""
    import os

    models = []
    for sharding in (None, "fsdp"):
        model = od.auto_model(Net(), sharding=sharding)
        optimizer = od.auto_optim(torch.optim.SGD(model.parameters(), lr=0.1))
        for step in range(3):
            x, y = _batch(step)
            od.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        models.append(model)
    ddp_state, fsdp_state = (od.full_state_dict(m) for m in models)
    if od.get_rank() == 0:
        assert list(fsdp_state) == list(ddp_state) == list(Net().state_dict()), list(fsdp_state)
        assert all(t.device.type == "cpu" and type(t) is torch.Tensor for t in fsdp_state.values())
        worst = max(float((fsdp_state[k] - v).abs().max()) for k, v in ddp_state.items())
        assert worst < 1e-6, worst
    else:
        assert fsdp_state == {} and ddp_state == {}
    path = os.path.join(tmpdir, "model.pt")
    od.save_checkpoint({"model": fsdp_state, "step": 3}, path)  # only rank 0's (the writer's) is used
    fresh = Net()
    fresh.load_state_dict(od.load_checkpoint(path, map_location="cpu")["model"])
    full = torch.cat([p.detach().flatten() for p in fresh.parameters()])
    trained = od.all_gather(full)  # every rank loaded the same: rank 0's export
    assert torch.equal(trained.view(od.get_world_size(), -1)[0], full)


def check_accumulation_on_a_sharded_model() -> dict[str, Any]:
    """od.accumulate (od.no_sync underneath) on an FSDP2 model: DDP's weights, and the gradients
    reduce-scattered once per window of 2 micro-batches: as often as in one plain step."""
    import torch.distributed as dist

    calls = [0]
    # FSDP2's reduce-scatter: reduce_scatter_single since torch 2.13, reduce_scatter_tensor before
    name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    plain = getattr(dist, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return plain(*args, **kwargs)

    def train(sharding: Any, every: int) -> tuple[torch.Tensor, list[int]]:
        model = od.auto_model(Net(), sharding=sharding)
        optimizer = od.auto_optim(torch.optim.AdamW(model.parameters()))
        per_window = []
        for step in range(8):
            x, y = _batch(step)
            before = calls[0]
            for part in torch.arange(len(x)).chunk(every):
                with od.accumulate(model, every=every) as window:
                    od.backward(torch.nn.functional.mse_loss(model(x[part]), y[part]) / window.size)
            per_window.append(calls[0] - before)
            optimizer.step()
            optimizer.zero_grad()
        whole = (getattr(p, "full_tensor", lambda p=p: p)() for p in model.parameters())
        return torch.cat([p.detach().flatten() for p in whole]), per_window

    setattr(dist, name, counted)
    try:
        ddp, _ = train(None, 2)
        fsdp, fsdp_windows = train("fsdp", 2)
        _, plain_steps = train("fsdp", 1)
    finally:
        setattr(dist, name, plain)
    diff = float((fsdp - ddp).norm() / ddp.norm())
    assert diff <= 1e-5, diff
    assert fsdp_windows == plain_steps, (fsdp_windows, plain_steps)
    assert (plain_steps[0] > 0) == (od.get_world_size() > 1), plain_steps
    return {"relative_difference": diff, "reduce_scatters_per_window": fsdp_windows[0]}


def check_every_rank_starts_from_rank_0s_weights() -> None:
    """Ranks that built different weights train rank 0's, as under DDP (fully_shard alone would
    keep each rank's own slice, a mix of the ranks' models)."""
    net = Net()
    expected = torch.cat([p.detach().flatten() for p in net.parameters()])
    with torch.no_grad():
        for p in net.parameters():
            p.add_(od.get_rank())  # different on every rank but 0
    model = od.auto_model(net, sharding="fsdp")
    whole = (getattr(p, "full_tensor", lambda p=p: p)() for p in model.parameters())
    got = torch.cat([p.detach().flatten() for p in whole])
    if od.get_world_size() > 1:
        assert torch.equal(got, expected), float((got - expected).abs().max())


class Normed(torch.nn.Module):
    """Net with a BatchNorm between its blocks: buffers (running statistics) that each rank's data moves."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Net()
        self.norm = torch.nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.net(x))


def check_buffers_follow_rank_0_as_under_ddp() -> None:
    """A sharded model's buffers are rank 0's before each training forward, as DDP's are: after
    steps on different data per rank, its running statistics equal DDP's on every rank."""
    buffers = []
    for sharding in (None, "fsdp"):
        model = od.auto_model(Normed(), sharding=sharding)
        optimizer = od.auto_optim(torch.optim.SGD(model.parameters(), lr=0.01))
        for step in range(3):
            x, y = _batch(step)  # each rank its own part of the batch
            od.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        model(_batch(3)[0])  # one more training forward: DDP broadcasts rank 0's first
        buffers.append(torch.cat([b.double().flatten() for b in od.unwrap(model).buffers()]))
    ddp, fsdp = buffers
    assert float((fsdp - ddp).abs().max()) <= 1e-5 * float(ddp.abs().max()), (fsdp, ddp)


def _all_gathers_and_reduce_scatters() -> tuple[Any, str, str]:
    """FSDP2's collectives by name: ``*_single`` since torch 2.13, ``*_tensor`` before."""
    import torch.distributed as dist

    new = hasattr(dist, "all_gather_single")
    return dist, *(
        ("all_gather_single", "reduce_scatter_single")
        if new
        else ("all_gather_into_tensor", "reduce_scatter_tensor")
    )


def check_units_by_policy_and_rows_by_rank() -> dict[str, list[str]]:
    """The units each policy makes (the FSDP2 modules, by name); each parameter's local chunk is
    torch.chunk's of its rows; mesh= is the mesh the parameters live on."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule

    def units(**kwargs: Any) -> list[str]:
        model = od.auto_model(Net(), sharding="fsdp", **kwargs)
        return [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]

    found = {
        "default": units(),
        "classes": units(policy={torch.nn.Linear}),
        "function": units(policy=lambda m: isinstance(m, torch.nn.Linear) and m.in_features == 12),
    }
    ws, rank = od.get_world_size(), od.get_rank()
    odd = od.auto_model(torch.nn.Linear(4, 5), sharding="fsdp")  # 5 rows: uneven chunks
    for p in odd.parameters():
        chunks = torch.chunk(p.full_tensor(), ws, dim=0)
        mine = chunks[rank] if rank < len(chunks) else p.full_tensor()[:0]
        assert torch.equal(p.to_local(), mine), (p.to_local().shape, mine.shape)
    # a name of its own tells the mesh given from the default one, which has none
    mesh = DeviceMesh.from_group(torch.distributed.group.WORLD, "cpu", mesh_dim_names=("given",))
    model = od.auto_model(Net(), sharding="fsdp", mesh=mesh)
    assert all(p.device_mesh.mesh_dim_names == ("given",) for p in model.parameters())
    return found


def check_reshard_after_forward() -> dict[str, int]:
    """All-gathers in one training step (forward and backward) with reshard_after_forward True
    (the default), True given, and False."""
    dist, gather_name, _ = _all_gathers_and_reduce_scatters()
    plain = getattr(dist, gather_name)
    calls = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return plain(*args, **kwargs)

    counts = {}
    setattr(dist, gather_name, counted)
    try:
        for label, kwargs in [
            ("default", {}),
            ("true", {"reshard_after_forward": True}),
            ("false", {"reshard_after_forward": False}),
        ]:
            model = od.auto_model(Net(), sharding="fsdp", **kwargs)
            x, y = _batch(0)
            calls[0] = 0
            od.backward(torch.nn.functional.mse_loss(model(x), y))
            counts[label] = calls[0]
    finally:
        setattr(dist, gather_name, plain)
    return counts


def check_bf16_mixed_is_fsdps_mixed_precision(every_linear: bool) -> None:
    """precision="bf16-mixed" with sharding: the layers compute with bfloat16 parameters and no
    autocast, the gradients are reduce-scattered in float32, the shards, their gradients and the
    outputs are float32."""
    dist, _, scatter_name = _all_gathers_and_reduce_scatters()
    plain = getattr(dist, scatter_name)
    reduced: list[torch.dtype] = []

    def recorded(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        reduced.append(input.dtype)
        return plain(output, input, *args, **kwargs)

    policy = {torch.nn.Linear} if every_linear else None
    model = od.auto_model(Net(), sharding="fsdp", precision="bf16-mixed", policy=policy)
    seen = []
    model.blocks[0].linear.register_forward_pre_hook(
        lambda m, args: seen.append((m.weight.dtype, torch.is_autocast_enabled("cpu")))
    )
    x, y = _batch(0)
    setattr(dist, scatter_name, recorded)
    try:
        out = model(x)
        od.backward(torch.nn.functional.mse_loss(out, y))
    finally:
        setattr(dist, scatter_name, plain)
    assert out.dtype == torch.float32, out.dtype
    assert seen == [(torch.bfloat16, False)], seen
    assert reduced and set(reduced) == {torch.float32}, reduced
    for p in model.parameters():
        assert p.to_local().dtype == torch.float32 and p.grad.to_local().dtype == torch.float32


def check_bf16_mixed_runs_batch_norm_in_float32() -> list[str]:
    """bf16-mixed with sharding on a model with BatchNorm (its running statistics float32 buffers):
    the BatchNorm computes in float32 from a float32 input and hands bfloat16 to the next layer, a
    training step runs, and its running statistics move."""
    net = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
    )
    model = od.auto_model(net, sharding="fsdp", precision="bf16-mixed")
    seen: list[str] = []
    norm = model[1]
    norm.register_forward_hook(
        lambda m, args, out: seen.append(
            f"{args[0].dtype} {m.weight.dtype} {m.running_mean.dtype} -> {out.dtype}"
        )
    )
    before = norm.running_mean.clone()
    out = model(torch.randn(6, 4, generator=torch.Generator().manual_seed(od.get_rank())))
    od.backward(out.float().pow(2).mean())
    assert out.dtype == torch.float32, out.dtype
    assert not torch.equal(norm.running_mean, before)
    return seen


def check_sharded_save_over_an_existing_path_moves_it_aside(tmpdir: str) -> list[list[str]]:
    """A second sharded save to the same path: the old directory is renamed aside, the new one
    renamed in, the old one deleted; the path holds the second save and nothing else is left."""
    import os

    path = os.path.join(tmpdir, "ckpt.pt")
    model = od.auto_model(Net(), sharding="fsdp")
    od.save_checkpoint({"model": model, "step": 1}, path)
    renames: list[list[str]] = []
    plain = os.rename

    def recorded(src: Any, dst: Any) -> None:
        renames.append([os.path.basename(src), os.path.basename(dst)])
        plain(src, dst)

    os.rename = recorded  # type: ignore[assignment]
    try:
        od.save_checkpoint({"model": model, "step": 2}, path)
    finally:
        os.rename = plain  # type: ignore[assignment]
    assert sorted(os.listdir(tmpdir)) == ["ckpt.pt"], os.listdir(tmpdir)
    assert od.load_checkpoint(path)["step"] == 2
    return [r for r in renames if "ckpt.pt" in r[0] + r[1]]  # DCP renames its own files too


def _fsdp_minus_ddp(optimizer: Any, steps: int) -> float:
    """The relative difference of FSDP2's weights to DDP's after ``steps`` steps of ``optimizer``."""
    weights = []
    for sharding in (None, "fsdp"):
        model = od.auto_model(Net(), sharding=sharding)
        opt = od.auto_optim(optimizer(model.parameters()))
        for step in range(steps):
            x, y = _batch(step)
            od.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
        whole = (getattr(p, "full_tensor", lambda p=p: p)() for p in model.parameters())
        weights.append(torch.cat([p.detach().flatten() for p in whole]))
    ddp, fsdp = weights
    return float((fsdp - ddp).norm() / ddp.norm())


def check_fsdp_and_ddp_rounding_with_adamw_and_sgd() -> dict[str, float]:
    """20 steps of AdamW with torch's defaults, and of SGD: how far FSDP2's weights are from DDP's."""
    return {
        "adamw": _fsdp_minus_ddp(torch.optim.AdamW, STEPS),
        "sgd": _fsdp_minus_ddp(lambda params: torch.optim.SGD(params, lr=0.01), STEPS),
    }


def _gradient_bytes(model: torch.nn.Module) -> int:
    """This rank's bytes of gradients: its shards' ``.grad`` and the unsharded gradients FSDP2
    holds for a later reduce-scatter (each FSDPParam's, torch's own record of them)."""
    from torch.distributed.fsdp import FSDPModule

    grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        for param in group.fsdp_params if group is not None else ():
            grads.append(param.unsharded_accumulated_grad)
            grads.append(getattr(getattr(param, "_unsharded_param", None), "grad", None))
    storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in grads if g is not None}
    return sum(storages.values())


def check_no_sync_holds_the_whole_models_gradients_until_the_window_ends() -> dict[str, int]:
    """A window of 3 micro-batches on a sharded model: after each backward pass inside od.no_sync
    this rank holds the whole model's gradients (the bytes DDP holds), after the window's last
    one its 1/N share."""
    model = od.auto_model(Net(), sharding="fsdp")
    whole = sum(p.numel() * p.element_size() for p in model.parameters())  # p.shape: the whole parameter
    held = []
    for i in range(3):
        x, y = _batch(i)
        with od.no_sync(model, enabled=i < 2):
            od.backward(torch.nn.functional.mse_loss(model(x), y) / 3)
        held.append(_gradient_bytes(model))
    ws = od.get_world_size()
    assert held[:2] == [whole, whole], (held, whole)
    assert held[2] <= whole / ws * 1.1, (held, whole, ws)
    return {"whole": whole, "inside": held[0], "after": held[2]}


def check_a_rank_with_one_forward_pass_more_waits_in_its_all_gather() -> dict[str, Any]:
    """Rank 1 runs one forward pass (under no_grad) more than rank 0, which then computes outside
    any collective for 2 s before it runs that pass too: rank 1's pass waits all that time, inside
    an all-gather of FSDP2's (its main thread's stack, looked at after 1 s)."""
    import sys
    import threading
    import time

    model = od.auto_model(Net(), sharding="fsdp")
    x, _ = _batch(0)
    with torch.no_grad():
        model(x)  # every rank: one pass each
    if od.get_rank() == 0:
        time.sleep(2.0)  # not in any collective
        with torch.no_grad():
            model(x)  # the pass rank 1 waits for
        return {}
    main, stack = threading.main_thread().ident, []

    def look() -> None:
        time.sleep(1.0)
        frame = sys._current_frames().get(main)
        while frame is not None:
            stack.append(frame.f_code.co_name)
            frame = frame.f_back

    looker = threading.Thread(target=look)
    looker.start()
    start = time.monotonic()
    with torch.no_grad():
        model(x)  # one pass more than rank 0 has made so far
    waited = time.monotonic() - start
    looker.join()
    assert waited >= 1.5, waited
    assert any("all_gather" in name for name in stack), stack
    return {"waited": waited, "in": [name for name in stack if "all_gather" in name]}


def check_hsdp_trains_like_ddp() -> dict[str, Any]:
    """sharding="hsdp": AdamW, 20 steps, float32: DDP's weights (relative difference <= 1e-5, as
    "fsdp"); each parameter is sharded over this node's ranks and replicated across the nodes (a
    2-D mesh (nnodes, nproc_per_node), on one node the world's 1-D mesh: "fsdp"'s, the same
    weights bit for bit); this rank holds <= 1/nproc_per_node of DDP's bytes, + 10 %."""
    ddp, _, ddp_bytes, _ = _train(None, False)
    hsdp, _, hsdp_bytes, kind = _train("hsdp", False)
    nnodes, nproc = od.get_nnodes(), od.get_nproc_per_node()
    probe = od.auto_model(Net(), sharding="hsdp")
    weight = probe.blocks[0].linear.weight
    mesh = list(weight.device_mesh.shape)
    placements = [type(p).__name__ for p in weight.placements]
    if nnodes > 1:
        assert mesh == [nnodes, nproc] and placements == ["Replicate", "Shard"], (mesh, placements)
        # this rank's copy of its shard is its node's neighbour's: the same rows on every node
        rows = od.all_gather_object(weight.to_local().tolist())
        assert all(rows[r] == rows[r % nproc] for r in range(len(rows))), rows
        assert rows[0] != rows[1], "the ranks of a node hold different rows"
    else:
        assert mesh == [od.get_world_size()] and placements == ["Shard"], (mesh, placements)
        fsdp, _, _, _ = _train("fsdp", False)
        assert torch.equal(hsdp, fsdp), float((hsdp - fsdp).abs().max())
    diff = float((hsdp - ddp).norm() / ddp.norm())
    assert diff <= 1e-5, diff
    assert kind == "FSDPNet", kind
    assert hsdp_bytes <= ddp_bytes / nproc * 1.1, (hsdp_bytes, ddp_bytes, nproc)
    return {"mesh": mesh, "relative_difference": diff, "bytes": hsdp_bytes, "ddp_bytes": ddp_bytes}
