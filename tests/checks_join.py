"""od.join's checks (uneven data), run on every rank of any backend: serially, in gloo/shm pools,
and under mpirun (test_join.py, test_mpi.py).

Rank r has ``10 + 3r`` batches of 4 samples, drawn from its own seed, so every rank can replay the
whole run alone: ``_reference`` computes what torch's ``Join`` gives (at each step the gradient of
the ranks still in their loops, summed and divided by the world size or by their number), and the
metric sums of a serial pass over every batch.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

import onedist as od

ROWS = 4


def batches_of(rank: int, count: Optional[int] = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    n = 10 + 3 * rank if count is None else count
    return [(torch.randn(ROWS, 3, generator=g), torch.randn(ROWS, 1, generator=g)) for _ in range(n)]


def _net(sync_bn: bool) -> torch.nn.Module:
    g = torch.Generator().manual_seed(3)
    middle = torch.nn.BatchNorm1d(5) if sync_bn else torch.nn.Tanh()
    net = torch.nn.Sequential(torch.nn.Linear(3, 5), middle, torch.nn.Linear(5, 1))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.rand(p.shape, generator=g) - 0.5)
    return net


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _reference(world_size: int, sync_bn: bool, divide_by_world: bool) -> dict[str, Any]:
    """torch's Join replayed in one process: the weights, and each step's metric sums."""
    net = _net(sync_bn)
    optimizer = _optimizer(net)
    data = [batches_of(r) for r in range(world_size)]
    sums: list[dict[str, float]] = []
    for step in range(max(len(d) for d in data)):
        active = [r for r in range(world_size) if step < len(data[r])]
        xs = torch.cat([data[r][step][0] for r in active])  # SyncBatchNorm: statistics of them all
        ys = torch.cat([data[r][step][1] for r in active])
        optimizer.zero_grad()
        per_rank = torch.nn.functional.mse_loss(net(xs), ys, reduction="none").view(len(active), ROWS).mean(1)
        per_rank.sum().backward()  # DDP: the sum of the ranks' gradients ...
        for p in net.parameters():  # ... divided by the world size, or by the ranks in their loops
            p.grad /= world_size if divide_by_world else len(active)
        optimizer.step()
        sums.append({"loss": float((per_rank.detach().double() * ROWS).sum()), "n": ROWS * len(active)})
    return {"weights": [p.detach() for p in net.parameters()], "buffers": list(net.buffers()), "sums": sums}


def check_uneven_loop_equals_torch_join(sync_bn: bool, divide_by_world: bool) -> dict[str, Any]:
    """The loop the issue names: a DDP model, an od.all_reduce of a metrics dict every step and an
    od.all_gather of each step's predictions, rank r with 10 + 3r batches."""
    rank, world_size = od.get_rank(), od.get_world_size()
    net = od.convert_sync_batchnorm(_net(sync_bn)) if sync_bn else _net(sync_bn)
    model = od.auto_model(net)
    optimizer = _optimizer(model)
    totals = {"loss": 0.0, "n": 0}
    steps, gathered = 0, []
    start = time.perf_counter()
    dev = od.device()  # CPU, or this rank's GPU on nccl (tests/test_gpu.py)
    with od.join(model, optimizer, divide_by_initial_world_size=divide_by_world):
        for x, y in batches_of(rank):
            optimizer.zero_grad()
            out = model(x.to(dev))
            loss = torch.nn.functional.mse_loss(out, y.to(dev))
            loss.backward()
            optimizer.step()
            metrics = od.all_reduce({"loss": loss.item() * len(x), "n": len(x)})
            totals = {k: totals[k] + metrics[k] for k in totals}
            rows = od.all_gather(
                torch.cat([out.detach(), torch.full((len(x), 1), float(rank), device=dev)], 1)
            )
            gathered.append(sorted({int(r) for r in rows[:, 1].tolist()}))
            steps += 1
    seconds = time.perf_counter() - start
    ref = _reference(world_size, sync_bn, divide_by_world)
    expected = {k: sum(s[k] for s in ref["sums"][:steps]) for k in totals}
    for k in totals:
        assert abs(totals[k] - expected[k]) <= 1e-6 * max(1.0, abs(expected[k])), (k, totals, expected)
    for step, ranks in enumerate(gathered):  # the samples of the ranks still in their loops, exactly
        assert ranks == [r for r in range(world_size) if step < 10 + 3 * r], (step, ranks)
    weights = [p.detach().cpu() for p in od.unwrap(model).parameters()]
    diff = max(float((a - b).abs().max()) for a, b in zip(weights, ref["weights"]))
    assert diff <= 1e-6, diff
    for mine, theirs in zip(od.unwrap(model).buffers(), ref["buffers"]):  # the last rank's statistics
        assert torch.allclose(mine.cpu().double(), theirs.double(), atol=1e-6), (mine, theirs)
    same = od.all_gather(torch.cat([w.reshape(-1) for w in weights]).reshape(1, -1).to(dev)).cpu()
    assert bool((same == same[0]).all()), "the ranks hold different weights after od.join"
    return {"steps": steps, "seconds": seconds, "difference": diff, "weights": [w.tolist() for w in weights]}


def check_torch_join_on_the_same_batches() -> list[Any]:
    """torch.distributed.algorithms.Join with a plain DDP on the same batches (gloo): its weights."""
    import torch.distributed as dist
    from torch.distributed.algorithms.join import Join

    model = torch.nn.parallel.DistributedDataParallel(_net(False))
    optimizer = _optimizer(model)
    with Join([model]):
        for x, y in batches_of(dist.get_rank()):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
    return [p.detach().tolist() for p in model.module.parameters()]


def check_even_loop_is_untouched() -> dict[str, Any]:
    """Every rank with the same number of batches: the same weights as without od.join, and the
    block adds one step check per forward pass and nothing at its end."""
    results = []
    for joined in (False, True):
        model = od.auto_model(_net(False))
        optimizer = _optimizer(model)
        block = od.join(model, optimizer) if joined else _nothing()
        with block:
            for x, y in batches_of(od.get_rank(), count=6):
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))
    return {"equal": True}


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def check_broadcast_from_a_finished_rank_raises_everywhere() -> dict[str, Any]:
    """Rank 0 leaves first; the others then broadcast from it: every rank raises JoinedRankError
    (the others at the call, rank 0 from its next step check), and the pool stays usable."""
    rank = od.get_rank()
    model = od.auto_model(_net(False))
    start = time.perf_counter()
    error: Optional[BaseException] = None
    try:
        with od.join(model):
            for step, (x, _) in enumerate(batches_of(rank, count=3 + rank)):
                model(x.to(od.device())).sum().backward()
                od.broadcast(torch.tensor([step]), src=0)
    except od.JoinedRankError as e:
        error = e
    seconds = time.perf_counter() - start
    assert isinstance(error, od.JoinedRankError), error
    assert error.call == "broadcast" and error.rank == 0, (error.call, error.rank)
    assert "needs rank 0, which has left its loop" in str(error), str(error)
    assert od.all_reduce(1) == od.get_world_size()  # the group is whole again
    try:  # the object form names itself
        with od.join(model):
            for x, _ in batches_of(rank, count=3 + rank):
                model(x.to(od.device())).sum().backward()
                od.broadcast_object("hi" if rank == 0 else None, src=0)
    except od.JoinedRankError as e:
        assert e.call == "broadcast_object" and e.rank == 0, (e.call, e.rank)
    else:
        raise AssertionError("broadcast_object from a finished rank was not refused")
    return {"seconds": seconds, "message": str(error)}


def check_calls_that_need_a_finished_rank_raise() -> list[str]:
    """A group that includes a finished rank, and a send to it, raise at once on the ranks in
    their loops (and on the finished rank from its next step check)."""
    rank, world_size = od.get_rank(), od.get_world_size()
    model = od.auto_model(_net(False))
    messages = []
    for call in ("group", "send"):
        try:
            with od.join(model):
                for x, _ in batches_of(rank, count=2 + rank):
                    model(x.to(od.device())).sum().backward()
                    if call == "group":
                        od.all_reduce(torch.ones(1), group=list(range(world_size - 1)) or [0])
                    elif rank == 1:  # rank 0 receives while it is in its loop
                        od.send(torch.ones(1), dst=0)
                    elif rank == 0:
                        od.recv(torch.empty(1), src=1)
        except od.JoinedRankError as e:
            messages.append(f"{e.call}:{e.rank}")
        assert od.all_reduce(1) == world_size
    return messages


def check_join_arguments() -> None:
    """Bad arguments raise at once, naming the argument and what is allowed (any world size)."""
    model = od.auto_model(_net(False))
    cases: list[tuple[Any, str]] = [
        (lambda: od.join(), "needs the model"),
        (lambda: od.join(_optimizer(model)), "needs the model"),
        (lambda: od.join(model, "adam"), "objects[1]"),
        (lambda: od.join(model, divide_by_initial_world_size=1), "divide_by_initial_world_size"),
    ]
    for make, words in cases:
        try:
            make()
        except (od.OnedistValueError, od.OnedistTypeError) as e:
            assert words in str(e), (words, str(e))
        else:
            raise AssertionError(f"no error for {words}")
    with od.join(model):
        if od.get_world_size() > 1:
            try:
                with od.join(model):
                    pass
            except od.OnedistRuntimeError as e:
                assert "do not nest" in str(e)
            else:
                raise AssertionError("nested od.join did not raise")
        for x, _ in batches_of(od.get_rank(), count=2):
            model(x.to(od.device())).sum().backward()


def check_each_collective_over_the_ranks_still_in_their_loops() -> int:
    """Rank r has 2 + r steps; at each step every collective the docs list gives the result over
    the ranks still in their loops (returns the steps this rank made)."""
    rank = od.get_rank()
    model = od.auto_model(_net(False))
    steps = 0
    with od.join(model):
        for step, (x, _) in enumerate(batches_of(rank, count=2 + rank)):
            model(x.to(od.device())).sum().backward()
            active = [r for r in range(od.get_world_size()) if step < 2 + r]
            last = active[-1]
            assert od.all_reduce(float(rank + 1), "PRODUCT") == float(torch.tensor(active).add(1).prod())
            assert od.all_reduce(torch.tensor([rank + 1]), "MIN").item() == active[0] + 1
            assert od.all_reduce(rank + 1, "MAX") == last + 1
            assert od.all_reduce(float(rank), "MEAN") == sum(active) / len(active)
            assert od.reduce_dict({"r": torch.tensor(float(rank))}, average=False)["r"] in (sum(active), rank)
            assert od.all_gather(rank) == active
            assert od.all_gather_object({"r": rank}) == [{"r": r} for r in active]
            gathered = od.gather(rank, dst=last)
            assert gathered == (active if rank == last else []), gathered
            assert od.broadcast(torch.tensor([step * 10 + last]), src=last).item() == step * 10 + last
            assert od.broadcast_object({"from": last} if rank == last else None, src=last) == {"from": last}
            reduce = {"r": "mean", "low": "min"}
            logged = od.log_metrics({"r": float(rank), "low": rank + 1.0}, step, reduce=reduce)
            assert logged == {"r": sum(active) / len(active), "low": active[0] + 1.0}, logged
            od.barrier()
            steps += 1
    return steps


_PRIMITIVES = ("all_reduce_", "reduce_", "broadcast_", "all_gather_into_", "all_gather_uneven_", "barrier_")


def check_even_loop_sends_one_step_check_per_forward_and_nothing_at_the_end(
    sharding: Any = None, uneven: bool = False
) -> dict[str, Any]:
    """Every collective onedist's backend makes in an even loop inside od.join (DDP's gradient
    all_reduce and FSDP2's gathers go through torch's process group, not these): one all_reduce of
    world_size + 4 int64s per forward pass, and at the end only the finished ranks' last step check.
    ``uneven``: rank r has 2 + r batches instead of 5 (see test_join.py for what a sharded model adds)."""
    from onedist.context import current

    backend = current()
    calls: list[tuple[str, int, str]] = []

    def recorded(name: str) -> Any:
        plain = getattr(backend, name)

        def call(t: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append((name, t.numel(), str(t.dtype)))
            return plain(t, *args, **kwargs)

        return call

    for name in _PRIMITIVES:
        setattr(backend, name, recorded(name))  # on the instance: del restores the class's
    try:
        model = od.auto_model(_net(False), sharding=sharding)
        optimizer = _optimizer(model)
        before = len(calls)
        with od.join(model, optimizer):
            for x, y in batches_of(od.get_rank(), count=2 + od.get_rank() if uneven else 5):
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
            in_loop = calls[before:]
            at_end = len(calls)
        after = calls[at_end:]
    finally:
        for name in _PRIMITIVES:
            delattr(backend, name)
    return {"in_loop": in_loop, "at_end": after}


def check_buffers_come_from_the_lowest_rank_in_its_loop() -> list[int]:
    """Rank r has 2 + 2r batches and a BatchNorm whose running mean its own data moves; DDP
    broadcasts buffers before each forward pass: from rank 0, then from the lowest rank still in
    its loop. Returns each rank's number of steps."""
    rank = od.get_rank()
    model = od.auto_model(_net(True))  # a plain BatchNorm1d: each rank's statistics its own
    optimizer = _optimizer(model)
    norm = od.unwrap(model)[1]
    before: list[torch.Tensor] = []
    after: list[torch.Tensor] = []
    norm.register_forward_pre_hook(lambda m, args: before.append(m.running_mean.clone()))
    norm.register_forward_hook(lambda m, args, out: after.append(m.running_mean.clone()))
    with od.join(model, optimizer):
        for x, y in batches_of(rank, count=2 + 2 * rank):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
    gathered = od.all_gather_object(([t.tolist() for t in before], [t.tolist() for t in after]))
    starts, ends = [g[0] for g in gathered], [g[1] for g in gathered]
    for r, mine in enumerate(starts):
        for step in range(1, len(mine)):
            source = min(q for q in range(od.get_world_size()) if step < 2 + 2 * q)
            assert mine[step] == ends[source][step - 1], (r, step, source)
    return [len(s) for s in starts]


def check_sharded_model_without_its_optimizer_and_zero_optimizer_raise_at_the_start() -> None:
    """A sharded model without its optimizer or with od.SyncBatchNorm, and a
    ZeroRedundancyOptimizer, are refused when the block is made, naming them."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    sharded = od.auto_model(_net(False), sharding="fsdp")
    normed = od.auto_model(od.convert_sync_batchnorm(_net(True)), sharding="fsdp")
    model = od.auto_model(_net(False))
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    cases = [
        (
            (sharded,),
            "models[0] is a sharded model (auto_model(sharding='fsdp')), given without its optimizer",
        ),
        ((sharded, _optimizer(model)), "given without its optimizer; allowed: the sharded model with every"),
        ((normed, _optimizer(normed)), "models[0] is a sharded model with od.SyncBatchNorm ('1')"),
        ((model, zero), "objects[1] is a ZeroRedundancyOptimizer"),
    ]
    for objects, words in cases:
        try:
            od.join(*objects)
        except od.OnedistValueError as e:
            assert words in str(e), (words, str(e))
        else:
            raise AssertionError(f"od.join accepted {words}")
    with od.join(sharded, _optimizer(sharded)):  # with its optimizer: accepted
        pass


def check_checkpoint_inside_the_block_once_rank_0_has_left(tmpdir: str) -> dict[str, Any]:
    """Rank 0 has 1 batch, the others 3; each step saves a checkpoint (rank 0 writes, then
    broadcasts the outcome): from the second step on, every rank raises JoinedRankError."""
    import os

    rank = od.get_rank()
    path = os.path.join(tmpdir, "ckpt.pt")
    model = od.auto_model(_net(False))
    saved = []
    try:
        with od.join(model):
            for step, (x, _) in enumerate(batches_of(rank, count=1 if rank == 0 else 3)):
                model(x).sum().backward()
                od.save_checkpoint({"model": model, "step": step}, path)
                saved.append(step)
    except od.JoinedRankError as e:
        error = {"call": e.call, "rank": e.rank}
    else:
        raise AssertionError("a checkpoint inside od.join after rank 0 left was not refused")
    assert od.all_reduce(1) == od.get_world_size()  # the group is whole again
    return {"saved": saved, "error": error, "on_disk": od.load_checkpoint(path)["step"]}


def check_debug_mode_names_a_collective_made_before_the_step_check() -> dict[str, Any]:
    """Rank 0 has 1 batch, the others 3; each step makes an all_reduce before the forward pass,
    that is before its step check. Once rank 0 has left, it answers a step check where the others
    make that all_reduce: debug mode raises CollectiveMismatchError on every rank, naming both."""
    rank = od.get_rank()
    model = od.auto_model(_net(False))
    od.set_debug(True)
    try:
        with od.join(model):
            for x, _ in batches_of(rank, count=1 if rank == 0 else 3):
                od.all_reduce(torch.ones(1))  # before the step check
                model(x).sum().backward()
    except od.CollectiveMismatchError as e:
        message = str(e)
    else:
        raise AssertionError("a collective made before the step check was not named")
    finally:
        od.set_debug(False)
    assert od.all_reduce(1) == od.get_world_size()  # the group is whole again
    return {"message": message}


# ---------------------------------------------------------------------------- a sharded model
class _Blocks(torch.nn.Module):
    """Two residual blocks in a ModuleList (two FSDP2 units, then the root) and a BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(3, 6)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh()) for _ in range(2)
        )
        self.norm = torch.nn.BatchNorm1d(6)
        self.head = torch.nn.Linear(6, 1)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.rand(p.shape, generator=g) - 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x))


def _whole(t: Any) -> torch.Tensor:
    """A tensor, or a DTensor's whole value (a collective: every rank calls it)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def _uneven_adamw_run(sharding: Any, divide_by_world: bool, accumulate: int, empty: bool) -> dict[str, Any]:
    """Rank r with 10 + 3r batches, AdamW with an LR that falls every step, a metric all_reduce
    every step; with ``accumulate`` > 1, od.no_sync for all but every accumulate-th batch; with
    ``empty``, rank 0 without a batch, rank r with 2 + r, and an evaluation forward pass (eval
    mode, no gradients) before every other training step. Returns the whole weights, buffers and
    AdamW state after od.join, by name, and the learning rate."""
    rank = od.get_rank()
    model = od.auto_model(_Blocks(), sharding=sharding)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, eps=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    steps, seen = 0, 0
    with od.join(model, optimizer, scheduler, divide_by_initial_world_size=divide_by_world):
        for i, (x, y) in enumerate(
            batches_of(rank, count=2 + rank if rank else 0) if empty else batches_of(rank)
        ):
            if empty and i % 2:
                model.eval()
                with torch.no_grad():
                    model(x)
                model.train()
            last = (i + 1) % accumulate == 0
            with _nothing() if last else od.no_sync(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
            if last:
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            seen += od.all_reduce(len(x))
            steps += 1
    inner = od.unwrap(model)
    names = {id(p): n for n, p in inner.named_parameters()}
    state = {}
    for p in optimizer.param_groups[0]["params"]:
        held = optimizer.state[p]
        state[names[id(p)]] = [_whole(held["exp_avg"]), _whole(held["exp_avg_sq"]), float(held["step"])]
    return {
        "steps": steps,
        "seen": seen,
        "weights": {n: _whole(p) for n, p in inner.named_parameters()},
        "buffers": {n: b.detach().cpu().clone() for n, b in inner.named_buffers()},
        "state": state,
        "lr": optimizer.param_groups[0]["lr"],
    }


def check_sharded_uneven_loop_equals_ddp_join(
    divide_by_world: bool, accumulate: int, empty: bool = False
) -> dict[str, Any]:
    """The same uneven loop under DDP + od.join and under sharding='fsdp' + od.join: the same
    weights, buffers, AdamW state and learning rate on every rank (within 1e-6)."""
    ddp = _uneven_adamw_run(None, divide_by_world, accumulate, empty)
    start = time.perf_counter()
    fsdp = _uneven_adamw_run("fsdp", divide_by_world, accumulate, empty)
    seconds = time.perf_counter() - start
    assert (fsdp["steps"], fsdp["seen"]) == (ddp["steps"], ddp["seen"]), (fsdp["steps"], ddp["steps"])
    diffs = {}
    # DDP skips its buffer broadcast in the forward pass after a no_sync one, FSDP2's sharding
    # broadcasts rank 0's in each training forward pass (docs/training.md): the same without od.join
    for part in ("weights", "buffers") if accumulate == 1 else ("weights",):
        diffs[part] = max(float((fsdp[part][k] - ddp[part][k]).abs().max()) for k in ddp[part])
    diffs["state"] = max(
        float((a - b).abs().max())
        for k in ddp["state"]
        for a, b in zip(fsdp["state"][k][:2], ddp["state"][k][:2])
    )
    assert all(fsdp["state"][k][2] == ddp["state"][k][2] for k in ddp["state"]), (fsdp["state"], ddp["state"])
    assert fsdp["lr"] == ddp["lr"], (fsdp["lr"], ddp["lr"])
    assert max(diffs.values()) <= 1e-6, diffs
    moved = max(
        float((ddp["weights"][k] - w).abs().max())
        for k, w in _Blocks().state_dict().items()
        if k in ddp["weights"]
    )
    return {
        "steps": fsdp["steps"],
        "diffs": diffs,
        "moved": moved,
        "seconds": seconds,
        "adam_steps": ddp["state"]["head.weight"][2],
    }


def check_clipping_a_sharded_model_inside_join() -> dict[str, Any]:
    """Rank r has 2 + 2r batches; od.clip_grad_norm_ at every step: every rank, in its loop or
    not, clips its shards with the same total norm, and the whole gradient's norm after clipping
    is min(total, max_norm) (up to torch's 1e-6 in the divisor; from each rank's shards, recorded
    inside torch's clip_grads_with_norm_). The model ends with a dropout: a finished rank's shadow
    steps leave its generator as it was."""
    rank, max_norm = od.get_rank(), 0.05
    model = od.auto_model(torch.nn.Sequential(_Blocks(), torch.nn.Dropout(0.5)), sharding="fsdp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    clip = torch.nn.utils.clip_grads_with_norm_
    records: list[tuple[float, float]] = []

    def recorded(params: Any, limit: float, total: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        clip(params, limit, total, *args, **kwargs)
        records.append((float(total), sum(float(p.grad.to_local().double().pow(2).sum()) for p in params)))

    torch.nn.utils.clip_grads_with_norm_ = recorded
    steps = 0
    try:
        with od.join(model, optimizer):
            for x, y in batches_of(rank, count=2 + 2 * rank):
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                od.clip_grad_norm_(model, max_norm=max_norm)
                optimizer.step()
                steps += 1
            generator = torch.random.get_rng_state()
        assert torch.equal(generator, torch.random.get_rng_state())  # no draw in the shadow steps
    finally:
        torch.nn.utils.clip_grads_with_norm_ = clip
    gathered = od.all_gather_object(records)
    assert len({len(g) for g in gathered}) == 1, [len(g) for g in gathered]  # every rank clipped every step
    for step in range(len(records)):
        totals = {g[step][0] for g in gathered}
        assert len(totals) == 1, (step, totals)
        after = sum(g[step][1] for g in gathered) ** 0.5
        total = totals.pop()
        expected = total * min(1.0, max_norm / (total + 1e-6))  # clip_grads_with_norm_'s coefficient
        assert abs(after - expected) <= 1e-5 * expected, (step, after, expected)
    return {"steps": steps, "clipped": len(records)}
