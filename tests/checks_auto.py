"""auto_model / auto_optim / auto_dataloader checks, run on every rank (serially or in a gloo pool)."""

from __future__ import annotations

import copy
import warnings

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, WeightedRandomSampler

import onedist as od
from onedist.errors import OnedistTypeError, OnedistValueError

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4
SAMPLES = 48


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 6, generator=g)
    y = (x[:, :3].sum(1) > 0).long()
    return TensorDataset(x, y)


def _net(batchnorm: bool) -> torch.nn.Module:
    torch.manual_seed(1)
    layers: list[torch.nn.Module] = [torch.nn.Linear(6, 8)]
    if batchnorm:
        layers.append(torch.nn.BatchNorm1d(8))
    layers += [torch.nn.ReLU(), torch.nn.Linear(8, 2)]
    return torch.nn.Sequential(*layers)


def _train(model: torch.nn.Module, loader, steps: int, opt=None) -> torch.nn.Module:
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    model.train()
    done = 0
    while done < steps:
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            done += 1
            if done == steps:
                break
    return model


def check_training_equals_one_process(batchnorm: bool) -> None:
    """N processes, global batch B split by auto_dataloader == one process with batch B (to 1e-5)."""
    data = _data()
    reference = _train(_net(batchnorm), DataLoader(data, batch_size=GLOBAL_BATCH), steps=6)

    # onedist's SyncBatchNorm (auto_model's sync_bn=True is torch's: CUDA only, as in ignite)
    model = od.auto_model(od.convert_sync_batchnorm(_net(True)) if batchnorm else _net(False))
    loader = od.auto_dataloader(data, batch_size=GLOBAL_BATCH, shuffle=False)
    assert loader.batch_size == GLOBAL_BATCH // od.get_world_size()
    opt = od.auto_optim(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9))
    _train(model, loader, steps=6, opt=opt)

    inner = od.unwrap(model)
    if od.get_world_size() > 1:
        assert isinstance(model, DDP) and model.device_ids is None  # CPU: no device_ids
        if batchnorm:
            assert isinstance(inner[1], od.SyncBatchNorm)  # torch's is GPU-only
    else:
        assert model is inner
    ours = inner.state_dict()
    for name, value in reference.state_dict().items():
        assert torch.allclose(ours[name].float(), value.float(), atol=1e-5, rtol=0), (name, ours[name], value)


def check_ddp_kwargs_pass_through() -> None:
    model = od.auto_model(
        _net(False),
        find_unused_parameters=True,
        bucket_cap_mb=1,
        gradient_as_bucket_view=True,
        static_graph=False,
    )
    if od.get_world_size() > 1:
        assert model.find_unused_parameters is True
        assert model.bucket_bytes_cap == 1024 * 1024
        assert model.gradient_as_bucket_view is True
    for bad, allowed in (
        ({"find_unused_params": True}, "find_unused_parameters"),
        ({"device_ids": [0]}, "sets it"),
    ):
        try:
            od.auto_model(_net(False), **bad)
        except OnedistValueError as e:
            assert next(iter(bad)) in str(e) and allowed in str(e), str(e)
        else:
            raise AssertionError(f"auto_model accepted {bad}")
    for bad_model, arg in (("not a model", "model"), (torch.nn.DataParallel(_net(False)), "model")):
        try:
            od.auto_model(bad_model)  # type: ignore[arg-type]
        except OnedistTypeError as e:
            assert arg in str(e)
        else:
            raise AssertionError("auto_model accepted a bad model")


def _same_on_every_rank(model: torch.nn.Module) -> None:
    flat = torch.cat([p.detach().reshape(-1) for p in od.unwrap(model).parameters()])
    gathered = od.all_gather(flat.unsqueeze(0))
    assert all(torch.equal(gathered[0], row) for row in gathered), "ranks' parameters differ"


def check_comm_hooks(hook: str) -> dict:
    data = _data()
    kwargs: dict = {"comm_hook": hook}
    if hook == "powersgd":
        kwargs["comm_hook_kwargs"] = {"start_powerSGD_iter": 2, "matrix_approximation_rank": 1}
    if hook == "post_localsgd":
        kwargs["comm_hook_kwargs"] = {"start_localSGD_iter": 2}
        kwargs["model_averaging_period"] = 2
    if hook == "powersgd+fp16":
        kwargs = {
            "comm_hook": "powersgd",
            "comm_wrapper": "fp16",
            "comm_hook_kwargs": {"start_powerSGD_iter": 2},
        }
    model = od.auto_model(_net(False), **kwargs)
    opt = od.auto_optim(torch.optim.SGD(model.parameters(), lr=0.2))
    serial = _net(False)
    reference = _train(
        serial,
        DataLoader(data, batch_size=GLOBAL_BATCH),
        steps=4,
        opt=torch.optim.SGD(serial.parameters(), lr=0.2),
    )
    _train(model, od.auto_dataloader(data, batch_size=GLOBAL_BATCH, shuffle=False), steps=4, opt=opt)
    _same_on_every_rank(model)
    diff = max(
        (a - b).abs().max().item() for a, b in zip(od.unwrap(model).parameters(), reference.parameters())
    )
    state = opt.state_dict()
    opt.load_state_dict(state)
    return {"optimizer": type(opt).__name__, "max_diff_to_serial": diff}


def check_comm_hook_errors() -> None:
    cases = [
        ({"comm_hook": "fp8"}, "comm_hook"),
        ({"comm_hook": "powersgd", "comm_hook_kwargs": {"rank": 1}}, "comm_hook_kwargs"),
        ({"comm_hook": "fp16", "model_averaging_period": 2}, "model_averaging_period"),
        ({"comm_hook": "post_localsgd"}, "model_averaging_period"),
        ({"comm_wrapper": "fp16"}, "comm_wrapper"),
        ({"comm_hook": "powersgd", "comm_wrapper": "int4"}, "comm_wrapper"),
    ]
    for kwargs, name in cases:
        try:
            od.auto_model(_net(False), **kwargs)
        except OnedistValueError as e:
            assert name in str(e), (kwargs, str(e))
        else:
            if od.get_world_size() > 1:
                raise AssertionError(f"auto_model accepted {kwargs}")


def check_dataloader_splits() -> dict:
    world, rank = od.get_world_size(), od.get_rank()
    data = _data()
    loader = od.auto_dataloader(data, batch_size=GLOBAL_BATCH, num_workers=2, shuffle=True)
    assert loader.batch_size == GLOBAL_BATCH // world
    nproc = od.get_nproc_per_node()  # workers are per node: split when there are enough (ignite's rule)
    assert loader.num_workers == (-(-2 // nproc) if world > 1 and nproc <= 2 else 2)
    if world == 1:
        return {"sampler": type(loader.sampler).__name__}
    assert isinstance(loader.sampler, od.DistributedSampler) and loader.sampler.shuffle
    # each pass reshuffles with no set_epoch call; every rank agrees on the order
    loader.num_workers = 0
    epochs = [torch.cat([x for x, _ in loader]) for _ in range(2)]
    assert not torch.equal(epochs[0], epochs[1])
    firsts = od.all_gather(torch.stack([e[:, 0] for e in epochs]).unsqueeze(0))  # world x 2 x n
    for e in range(2):  # one epoch over all ranks = the whole dataset, each sample once
        seen = torch.sort(firsts[:, e].reshape(-1)).values
        assert torch.equal(seen, torch.sort(data.tensors[0][:, 0]).values), e
    # set_epoch still wins
    loader.sampler.set_epoch(0)
    assert torch.equal(torch.cat([x for x, _ in loader]), epochs[0])

    # a user's sampler is wrapped: one shared draw, each rank a share
    weighted = WeightedRandomSampler(torch.ones(SAMPLES), num_samples=SAMPLES)
    proxy = od.auto_dataloader(data, batch_size=GLOBAL_BATCH, sampler=weighted)
    assert isinstance(proxy.sampler, od.DistributedProxySampler)
    assert len(proxy.sampler) == -(-SAMPLES // world)
    # evaluation: no padding, every sample once
    ev = od.auto_dataloader(data, batch_size=5, evaluation=True)
    assert isinstance(ev.sampler, od.DistributedEvalSampler)
    counts = od.all_gather(torch.tensor([len(ev.sampler)]))
    assert int(counts.sum()) == SAMPLES
    # no sampler: shuffled by default, as ignite's
    assert od.auto_dataloader(data, batch_size=GLOBAL_BATCH).sampler.shuffle
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        od.auto_dataloader(data, batch_size=GLOBAL_BATCH + 1)
        od.auto_dataloader(_Stream(), batch_size=GLOBAL_BATCH)
        od.auto_dataloader(data, batch_sampler=[[0, 1], [2, 3]])
        small = od.auto_dataloader(data, batch_size=world - 1)  # not split, as in ignite
        wrong = torch.utils.data.DistributedSampler(data, num_replicas=world + 1, rank=(rank + 1) % world)
        assert od.auto_dataloader(data, batch_size=4, sampler=wrong).sampler is wrong
    assert small.batch_size == world - 1
    text = [str(w.message) for w in caught]
    assert any("not divisible by the world size" in t for t in text), text
    assert any("IterableDataset" in t for t in text), text
    assert any("Found batch_sampler in provided kwargs" in t for t in text), text
    assert any(f"batch_size={world - 1} is smaller than the world size {world}" in t for t in text), text
    assert any(f"rank={(rank + 1) % world}, but process rank is {rank}" in t for t in text), text
    assert any(f"num_replicas={world + 1}, but world size is {world}" in t for t in text), text
    for kwargs, name in (
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": 4, "num_workers": -1}, "num_workers"),
        ({"batch_size": 4, "sampler": weighted, "shuffle": True}, "shuffle"),
        ({"batch_size": 4, "evaluation": True, "shuffle": True}, "shuffle"),
    ):
        try:
            od.auto_dataloader(data, **kwargs)
        except (OnedistValueError, OnedistTypeError) as e:
            assert name in str(e), (kwargs, str(e))
        else:
            raise AssertionError(f"auto_dataloader accepted {kwargs}")
    return {"sampler": type(loader.sampler).__name__, "rank": rank}


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(10))


def check_auto_optim_serial_identity() -> None:
    model = od.auto_model(_net(False))
    opt = torch.optim.Adam(model.parameters())
    wrapped = od.auto_optim(opt)
    assert wrapped is opt
    state = copy.deepcopy(wrapped.state_dict())
    wrapped.load_state_dict(state)
    try:
        od.auto_optim("sgd")  # type: ignore[arg-type]
    except OnedistTypeError as e:
        assert "optimizer" in str(e)
    else:
        raise AssertionError("auto_optim accepted a string")


def check_syncbn_uneven_batches_equal_one_batchnorm() -> None:
    """Ranks with different batch sizes (2, 3, 4, ...): outputs, input grads, weight grads and running
    stats equal one BatchNorm2d over the concatenated batch."""
    world, rank = od.get_world_size(), od.get_rank()
    sizes = [2 + r for r in range(world)]
    g = torch.Generator().manual_seed(5)
    x_all = torch.randn(sum(sizes), 3, 4, 4, generator=g) * 3 + 1
    w_all = torch.randn(sum(sizes), 3, 4, 4, generator=g)
    start = sum(sizes[:rank])
    part = slice(start, start + sizes[rank])

    ref = torch.nn.BatchNorm2d(3)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5, generator=g)
        ref.bias.uniform_(-0.5, 0.5, generator=g)
    sync = od.convert_sync_batchnorm(copy.deepcopy(ref))
    assert isinstance(sync, od.SyncBatchNorm)

    x_ref = x_all.clone().requires_grad_()
    (ref(x_ref) * w_all).sum().backward()
    x = x_all[part].clone().requires_grad_()
    out = sync(x)
    (out * w_all[part]).sum().backward()

    tol = {"atol": 1e-5, "rtol": 1e-5}
    with torch.no_grad():
        ref_eval = copy.deepcopy(ref).train()
        ref_eval.running_mean.zero_(), ref_eval.running_var.fill_(1), ref_eval.num_batches_tracked.zero_()
        expected = ref_eval(x_all)[part]
    assert torch.allclose(out, expected, **tol)
    assert torch.allclose(x.grad, x_ref.grad[part], **tol)
    grads = od.all_reduce(torch.cat([sync.weight.grad, sync.bias.grad]))
    assert torch.allclose(grads, torch.cat([ref.weight.grad, ref.bias.grad]), **tol)
    assert torch.allclose(sync.running_mean, ref.running_mean, **tol)
    assert torch.allclose(sync.running_var, ref.running_var, **tol)
    sync.eval()
    assert torch.allclose(sync(x_all[part]), ref.eval()(x_all[part]), **tol)


def check_sync_bn_on_cpu() -> dict:
    """auto_model(sync_bn=True) on CPU: with several processes torch's SyncBatchNorm cannot run,
    so it raises ValueError with the fix; with one, the flag is ignored and logged at INFO."""
    import logging

    from checks import onedist_log

    with onedist_log(logging.INFO) as records:
        try:
            model = od.auto_model(_net(True), sync_bn=True)
        except ValueError as e:
            assert od.get_world_size() > 1, e
            assert "SyncBatchNorm layers only work with GPU modules" in str(e), e
            assert "od.convert_sync_batchnorm(model) before auto_model" in str(e), e
            return {"raised": True, "logged": [r.getMessage() for r in records]}
    assert od.get_world_size() == 1
    assert type(model[1]) is torch.nn.BatchNorm1d, type(model[1])  # not converted
    return {"raised": False, "logged": [r.getMessage() for r in records if r.levelno == logging.INFO]}


def check_default_comm_hook_kwargs() -> dict:
    """The states auto_model registers without comm_hook_kwargs; a hook function takes
    comm_hook_state, and comm_hook_kwargs with it is refused."""
    import torch.distributed as dist

    states = {}
    for hook in ("powersgd", "batched_powersgd"):
        _, state = od.auto_model(_net(False), comm_hook=hook)._comm_hooks[0]
        states[hook] = [state.matrix_approximation_rank, state.start_powerSGD_iter]
    model = od.auto_model(_net(False), comm_hook="post_localsgd", model_averaging_period=2)
    _, state = model._comm_hooks[0]
    node = od.get_node_rank() * od.get_nproc_per_node()
    assert dist.get_process_group_ranks(state.subgroup) == list(range(node, node + od.get_nproc_per_node()))
    states["post_localsgd"] = [state.start_localSGD_iter]

    def hook(state, bucket):  # no annotations: DDP checks them as objects
        return torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook(state, bucket)

    mine = object()
    assert od.auto_model(_net(False), comm_hook=hook, comm_hook_state=mine)._comm_hooks == [(hook, mine)]
    try:
        od.auto_model(_net(False), comm_hook=hook, comm_hook_kwargs={"matrix_approximation_rank": 2})
    except OnedistValueError as e:
        assert "comm_hook_kwargs={'matrix_approximation_rank': 2} is not allowed" in str(e), e
        assert "pass comm_hook_state" in str(e), e
    else:
        raise AssertionError("comm_hook_kwargs with a hook function was accepted")
    return states


def check_auto_optim_takes_no_keyword_arguments() -> None:
    optimizer = torch.optim.SGD(od.auto_model(_net(False)).parameters(), lr=0.1)
    try:
        od.auto_optim(optimizer, backward_passes_per_step=2)
    except OnedistValueError as e:
        allowed = f"allowed: no keyword arguments with backend {od.backend()!r}"
        assert f"backward_passes_per_step=2 is not allowed; {allowed}" in str(e), e
    else:
        raise AssertionError("auto_optim accepted a keyword argument")


def check_syncbn_collectives_per_layer() -> dict:
    """Two od.SyncBatchNorm layers: the collectives onedist makes in a training forward pass and
    in its backward pass, by name (the layers call onedist.collectives' functions)."""
    import onedist.collectives as collectives

    calls: list[str] = []
    plain = {name: getattr(collectives, name) for name in ("all_gather", "all_reduce")}

    def recorded(name: str):
        def call(*args, **kwargs):
            calls.append(name)
            return plain[name](*args, **kwargs)

        return call

    net = od.convert_sync_batchnorm(
        torch.nn.Sequential(
            torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)
        )
    )
    x = torch.randn(3, 6)
    for name in plain:
        setattr(collectives, name, recorded(name))
    try:
        out = net(x)
        forward = list(calls)
        out.pow(2).sum().backward()
        backward = calls[len(forward) :]
    finally:
        for name, fn in plain.items():
            setattr(collectives, name, fn)
    return {"forward": forward, "backward": backward}
