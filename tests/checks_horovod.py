"""Horovod-specific checks, run on every rank of a real ``horovodrun`` world (tests/test_horovod.py)
or, for :func:`serial_checks`, in one plain process.

The collective checks every backend passes live in checks.py; these cover what is Horovod's own:
groups as process sets, point-to-point through the side store, auto_model's parameter broadcast,
auto_optim's DistributedOptimizer and its state, and the argument errors.
"""

from __future__ import annotations

import copy
import os
import time
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import onedist as od
from checks_auto import GLOBAL_BATCH, _data, _net, _train
from onedist.context import current
from onedist.errors import OnedistRuntimeError, OnedistTypeError, OnedistValueError


def _rw() -> tuple[int, int]:
    return od.get_rank(), od.get_world_size()


def _same_everywhere(tensors: list[torch.Tensor]) -> bool:
    flat = torch.cat([t.detach().reshape(-1).double() for t in tensors]).unsqueeze(0)
    rows = od.all_gather(flat)
    return all(torch.equal(rows[0], row) for row in rows)


# ============================================================================ context and groups
def check_context() -> dict[str, Any]:
    import horovod.torch as hvd

    r, w = _rw()
    assert (od.model_name(), od.backend()) == ("horovod-dist", "horovod")
    assert (r, w) == (hvd.rank(), hvd.size())
    assert od.get_local_rank() == hvd.local_rank() and od.get_nproc_per_node() == hvd.local_size()
    assert "horovod" in od.available_backends()
    assert current().side_store() is not None  # failure reports and send/recv travel there
    with pytest.raises(OnedistRuntimeError, match="already initialized"):
        od.initialize("horovod")
    assert od.new_group(list(range(w))) is None  # the whole world: the global process set
    if w > 1:
        ranks = [0, w - 1] if w > 2 else [1]
        group = od.new_group(ranks)  # every rank creates it (a Horovod rule)
        assert isinstance(group, hvd.ProcessSet) and group.ranks == ranks
        assert od.new_group(list(reversed(ranks))) is group
        expected = ranks.index(r) if r in ranks else -1
        assert current().group_rank(group) == expected
        if r in ranks:
            assert od.all_reduce(torch.tensor([r]), group=group).item() == sum(ranks)
            assert od.all_reduce(torch.tensor([r == 0]), op="OR", group=group).item() is (0 in ranks)
    with pytest.raises(OnedistValueError, match=r"new_group: timeout=5 is not allowed; allowed: no keyword"):
        od.new_group([0], timeout=5)
    with pytest.raises(OnedistValueError, match="Argument group should be list of int or ProcessGroup"):
        od.all_reduce(1, group="world")
    return {"rank": r, "world_size": w, "local_rank": od.get_local_rank()}


def check_widened_and_byte_dtypes() -> None:
    """dtypes Horovod lacks: reductions widened, data moved as bytes; async handles and MEAN."""
    r, w = _rw()
    for dtype in (
        torch.uint16,
        torch.uint32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bfloat16,
        torch.bool,
    ):

        def values(q: int, dtype: torch.dtype = dtype) -> torch.Tensor:
            if dtype == torch.bool:
                return torch.tensor([q % 2 == 0, True, False])
            return torch.tensor([1 + q, 2 + q, 3 + q], dtype=dtype)  # uint16/32 have no "+" in torch

        x = values(r)
        out = od.all_reduce(x, op="MAX", inplace=False)
        expected = values(w - 1 if dtype != torch.bool else 0)
        assert out.dtype == dtype and out.tolist() == expected.tolist(), (dtype, out)
        gathered = od.all_gather(x)
        assert (
            gathered.dtype == dtype and gathered.tolist() == torch.cat([values(q) for q in range(w)]).tolist()
        )
        assert od.broadcast(x, src=w - 1).tolist() == values(w - 1).tolist()
    # sums wrap like the narrow type
    big = od.all_reduce(torch.tensor([200], dtype=torch.uint8))
    assert big.dtype == torch.uint8 and big.item() == (200 * w) % 256
    c = od.all_gather(torch.tensor([complex(r, -r)], dtype=torch.complex128))
    assert c.tolist() == [complex(q, -q) for q in range(w)]
    handles = [od.all_reduce(torch.full((4,), float(r)), op="MIN", async_op=True) for _ in range(5)]
    assert all(torch.equal(h.wait(), torch.zeros(4)) for h in handles)
    with pytest.raises(OnedistTypeError, match="Horovod cannot reduce tensors of dtype torch.uint64"):
        od.all_reduce(torch.ones(2, dtype=torch.uint64))


# ============================================================================ point to point
def check_p2p_tags_any_source_and_errors() -> None:
    r, w = _rw()
    if w == 1:
        return
    if r == 0:  # sent as tag 1 then tag 2, received the other way round
        od.send(torch.tensor([1.0]), dst=1, tag=1)
        od.send(torch.tensor([2.0]), dst=1, tag=2)
    elif r == 1:
        assert od.recv(torch.empty(1), src=0, tag=2).item() == 2.0
        assert od.recv(torch.empty(1), src=0, tag=1).item() == 1.0
    last = w - 1
    if r != last:  # recv from any source
        od.send(torch.tensor([r]), dst=last, tag=5)
    else:
        got = sorted(int(od.recv(torch.empty(1, dtype=torch.int64), tag=5).item()) for _ in range(w - 1))
        assert got == list(range(w - 1))
    if r == 0:
        od.send({"obj": [r, "x"]}, dst=last, tag=6)
    elif r == last:
        assert od.recv(tag=6) == {"obj": [0, "x"]}  # an object, from any source
    if r == 1:  # irecv posted before the matching send
        handle = od.irecv(torch.empty(2, dtype=torch.bfloat16), src=0, tag=7)
    od.barrier()
    if r == 0:
        od.send(torch.tensor([1.5, -2.0], dtype=torch.bfloat16), dst=1, tag=7)
        od.send(torch.ones(3), dst=1, tag=9)
    elif r == 1:
        assert handle.wait().tolist() == [1.5, -2.0]
        with pytest.raises(
            OnedistRuntimeError, match="rank 0 sent 12 bytes with tag 9, but the receive buffer holds 8"
        ):
            od.recv(torch.empty(2), src=0, tag=9)
    od.barrier()


# ============================================================================ auto_model / auto_optim
class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.bn = torch.nn.BatchNorm1d(3)
        self.bf16 = torch.nn.Parameter(torch.randn(5, dtype=torch.bfloat16))
        self.tied = self.linear.weight  # a second name for one tensor
        self.register_buffer("mask", torch.rand(6) > 0.5)


def check_auto_model_broadcasts_from_rank_0() -> None:
    r = od.get_rank()
    torch.manual_seed(100 + r)  # every rank starts different
    model = _Model()
    with torch.no_grad():
        model.bn.running_mean.add_(r)
        model.bn.num_batches_tracked.fill_(7 + r)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped = od.auto_model(model)
    assert wrapped is model and od.unwrap(wrapped) is model  # no wrapper on Horovod
    state = model.state_dict()
    assert _same_everywhere([v for v in state.values()])
    if r == 0:
        assert all(torch.equal(state[k], before[k]) for k in before)
    assert model.bn.num_batches_tracked.item() == 7 and model.tied is model.linear.weight
    # DDP keyword arguments are accepted (no effect); DDP communication hooks are not
    od.auto_model(_net(False), find_unused_parameters=True, broadcast_buffers=False)
    with pytest.raises(OnedistValueError, match="(?s)comm_hook='fp16' is not allowed.*compression='fp16'"):
        od.auto_model(_net(False), comm_hook="fp16")
    with pytest.raises(OnedistValueError, match="find_unused_params=True is not allowed"):
        od.auto_model(_net(False), find_unused_params=True)
    sync = od.auto_model(_net(True), sync_bn=True)
    assert isinstance(sync[1], od.SyncBatchNorm)


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.2, momentum=0.9)
    return torch.optim.Adam(params, lr=0.05, weight_decay=0.01)


def check_training_equals_one_process(kind: str, batchnorm: bool) -> float:
    """N ranks, global batch B split by auto_dataloader == one process with batch B (to 1e-5), and
    every rank holds exactly the same parameters. Adam with weight decay shows that no hidden
    optimizer step was taken to create its state (hvd.broadcast_optimizer_state takes one)."""
    data = _data()
    ref_model = _net(batchnorm)
    reference = _train(
        ref_model,
        DataLoader(data, batch_size=GLOBAL_BATCH),
        steps=6,
        opt=_optimizer(kind, ref_model.parameters()),
    )
    model = od.auto_model(_net(batchnorm), sync_bn=batchnorm)
    loader = od.auto_dataloader(data, batch_size=GLOBAL_BATCH, shuffle=False)
    assert loader.batch_size == GLOBAL_BATCH // od.get_world_size()
    opt = od.auto_optim(_optimizer(kind, model.parameters()))
    assert type(opt).__module__ == "horovod.torch.optimizer"  # hvd.DistributedOptimizer's class
    assert isinstance(opt, torch.optim.SGD if kind == "sgd" else torch.optim.Adam)
    _train(model, loader, steps=6, opt=opt)
    assert _same_everywhere(list(model.state_dict().values()))
    ours = model.state_dict()
    worst = 0.0
    for name, value in reference.state_dict().items():
        worst = max(worst, (ours[name].double() - value.double()).abs().max().item())
    assert worst <= 1e-5, worst
    return worst


def check_optimizer_state_from_rank_0_and_round_trip() -> None:
    r = od.get_rank()
    model = od.auto_model(_net(False))
    base = torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1), momentum=0.9)
    if r == 0:  # only rank 0 has state (a checkpoint it loaded, say): everyone gets it
        params = [p.detach().clone() for p in model.parameters()]
        torch.nn.functional.cross_entropy(model(torch.randn(4, 6)), torch.tensor([0, 1, 0, 1])).backward()
        base.step()
        base.zero_grad()
        with torch.no_grad():  # the parameters stay as broadcast: only the state differs
            for p, saved in zip(model.parameters(), params):
                p.copy_(saved)
    rank0_state = copy.deepcopy(base.state_dict()) if r == 0 else None
    opt = od.auto_optim(base)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)  # rank 0's hyperparameters
    buffers = [s["momentum_buffer"] for s in opt.state_dict()["state"].values()]
    assert len(buffers) == 4 and _same_everywhere(buffers)
    if rank0_state is not None:
        assert all(
            torch.equal(opt.state_dict()["state"][k]["momentum_buffer"], v["momentum_buffer"])
            for k, v in rank0_state["state"].items()
        )
    # a step, then state_dict -> load_state_dict on a new wrapped optimizer gives the same state
    x, y = torch.randn(6, 6, generator=torch.Generator().manual_seed(r)), torch.tensor([0, 1] * 3)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    again = od.auto_optim(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    again.load_state_dict(saved)
    assert again.param_groups[0]["lr"] == pytest.approx(0.1)
    for k, v in saved["state"].items():
        assert torch.equal(again.state_dict()["state"][k]["momentum_buffer"], v["momentum_buffer"])
    assert _same_everywhere([p for p in model.parameters()])


def check_auto_optim_arguments() -> None:
    model = od.auto_model(_net(False))
    params = list(model.parameters())
    fp16 = od.auto_optim(
        torch.optim.SGD(params, lr=0.1),
        compression="fp16",
        backward_passes_per_step=2,
        op="average",
        gradient_predivide_factor=2.0,
    )
    assert fp16.backward_passes_per_step == 2
    for kwargs, match in (
        (
            {"foo": 1},
            r"auto_optim: foo=1 is not allowed; allowed: keyword arguments of hvd.DistributedOptimizer",
        ),
        ({"compression": "zip"}, r"compression='zip' is not allowed; allowed: 'none', 'fp16'"),
        ({"op": "max"}, r"op='max' is not allowed; allowed: 'average', 'sum', 'adasum'"),
        ({"backward_passes_per_step": 0}, r"backward_passes_per_step=0 is not allowed; allowed: an int >= 1"),
        ({"op": "sum", "gradient_predivide_factor": 2.0}, r"gradient_predivide_factor=2.0 is not allowed"),
    ):
        with pytest.raises(OnedistValueError, match=match):
            od.auto_optim(torch.optim.SGD(params, lr=0.1), **kwargs)
    with pytest.raises(OnedistTypeError, match="compression has type int"):
        od.auto_optim(torch.optim.SGD(params, lr=0.1), compression=3)
    with pytest.raises(OnedistTypeError, match="optimizer not wrapped by horovod yet"):
        od.auto_optim(fp16)


def check_no_sync_with_adasum_and_od_join_raise() -> None:
    """od.no_sync on a model whose DistributedOptimizer uses Adasum raises (Adasum combines each
    step's parameter changes, not gradients), naming the fix; od.join raises when its block
    starts, naming the backend, before anything inside runs; both leave the ranks in step."""
    adasum = od.auto_model(_net(False))
    od.auto_optim(torch.optim.SGD(adasum.parameters(), lr=0.1), op="adasum")
    with pytest.raises(OnedistValueError) as raised:
        with od.no_sync(adasum):
            raise AssertionError("od.no_sync with Adasum entered its block")
    assert "a model whose optimizer is hvd.DistributedOptimizer with op 'average' or 'sum'" in str(
        raised.value
    )
    assert "accumulate with auto_optim(..., backward_passes_per_step=k) instead" in str(raised.value)
    model = od.auto_model(_net(False))
    od.auto_optim(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(
        OnedistValueError, match=r"onedist.join: backend='horovod' is not supported; allowed: "
    ):
        with od.join(model):
            raise AssertionError("od.join entered its block on Horovod")
    with od.no_sync(model):  # op 'average' (the default): held back, as usual
        model(torch.randn(2, 6)).sum().backward()
    assert od.all_reduce(1) == od.get_world_size()


# ============================================================================ spawn's workers
def worker_report(local_rank: int, scale: int, offset: int = 0) -> dict[str, Any]:
    return {
        "local_rank": local_rank,
        "rank": od.get_rank(),
        "world_size": od.get_world_size(),
        "backend": od.backend(),
        "sum": od.all_reduce(scale * (od.get_rank() + 1)) + offset,
        "threads": torch.get_num_threads(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
    }


def worker_layout(local_rank: int) -> tuple[int, ...]:
    """Where this worker is: (rank, local_rank, node_rank, nnodes, nproc_per_node), and a sum."""
    layout = (od.get_rank(), local_rank, od.get_node_rank(), od.get_nnodes(), od.get_nproc_per_node())
    return (*layout, od.all_reduce(od.get_rank() + 1))


def worker_timeout(local_rank: int) -> str:
    """Rank 1 stays away from a collective longer than the timeout: rank 0's call raises."""
    if od.get_rank() == 1:
        time.sleep(6)
        return "slept"
    try:
        od.all_reduce(torch.ones(1))
    except od.OnedistTimeoutError as e:
        return str(e)
    return "no timeout"


def worker_fails_on_rank_1(local_rank: int) -> None:
    if od.get_rank() == 1:
        raise KeyError("no such shard on rank 1")
    time.sleep(60)  # stopped by Horovod when rank 1 fails


# ============================================================================ one plain process
def serial_checks() -> None:
    """Run in a fresh process with no launcher (test_horovod.py starts it): world size 1 through
    ``initialize("horovod")``, a context made by ``hvd.init()``, and initialize's argument errors."""
    import sys

    import horovod.torch as hvd

    assert od.model_name() == "serial"
    for kwargs, match in (
        ({"rank": 1}, r"rank=1 is not allowed; allowed: None or 0, the value horovodrun gave"),
        ({"world_size": 2}, r"world_size=2 is not allowed; allowed: None or 1"),
        ({"init_method": "tcp://127.0.0.1:1234"}, r"init_method='tcp://127.0.0.1:1234' is not allowed"),
        ({"pg_options": None}, r"pg_options=None is not allowed"),
    ):
        with pytest.raises(OnedistValueError, match=match):
            od.initialize("horovod", **kwargs)
    os.environ.update({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})  # as torchrun sets them
    with pytest.raises(OnedistValueError, match="started by torchelastic .* Horovod only joins processes"):
        od.initialize("horovod")
    del os.environ["LOCAL_WORLD_SIZE"]  # RANK and WORLD_SIZE alone (by hand): ignored, as ignite does
    od.initialize("horovod")
    assert (od.get_world_size(), od.get_rank()) == (1, 0)
    od.finalize()
    del os.environ["RANK"], os.environ["WORLD_SIZE"]
    assert not hvd.is_initialized()

    od.initialize("horovod")
    assert (od.model_name(), od.backend(), od.get_world_size(), od.get_rank()) == (
        "horovod-dist",
        "horovod",
        1,
        0,
    )
    assert os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] == "1"
    assert od.all_reduce({"a": 1.5, "b": torch.ones(2, dtype=torch.int8)}, op="MEAN")["a"] == 1.5
    assert od.all_gather("x") == ["x"] and od.broadcast(torch.tensor([3])).item() == 3
    assert od.new_group([0]) is None and od.get_local_process_group() is not None
    model = od.auto_model(_net(False))
    opt = od.auto_optim(torch.optim.Adam(model.parameters()))
    state = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(state)
    with pytest.raises(OnedistValueError, match="other than"):
        od.send(torch.ones(1), dst=0)
    od.finalize()
    assert od.model_name() == "serial" and not hvd.is_initialized()
    assert "HOROVOD_DYNAMIC_PROCESS_SETS" not in os.environ  # restored

    hvd.init()  # the user's own context is picked up, without any onedist call to set it up
    assert od.model_name() == "horovod-dist" and od.get_world_size() == 1
    with pytest.raises(OnedistRuntimeError, match="Horovod was initialised without dynamic process sets"):
        current().new_group((0, 1))
    with pytest.raises(OnedistRuntimeError, match=r"already initialized by your code \(hvd.init\(\)\)"):
        od.initialize("horovod")
    od.finalize()
    assert not hvd.is_initialized()
    print("serial checks passed", file=sys.stderr)
