"""What the migration pages (docs/migration/*.md) say that no other test checks.

detectron2's comm helpers and launch(), raw DDP, Accelerate and Fabric: onedist's side of each
difference the pages state, and, where Accelerate or Lightning is installed, that library's side
as the page describes it (each in a gloo pool of its own: both keep process-wide state).
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import random
import time
import warnings
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import onedist as od
from conftest import TORCHRUN_WORKER_ENV, Runner
from distpool import DistPool
from onedist._net import free_port


def _group_timeout() -> timedelta:
    """The timeout torch gave this process's default group (gloo's options)."""
    group = dist.distributed_c10d._get_default_group()
    return group._get_backend(torch.device("cpu")).options._timeout


# ---------------------------------------------------------------------------- detectron2's comm
def test_synchronize_does_nothing_without_a_process_group():
    """detectron2's ``synchronize()`` returns at once without a process group: so does onedist's,
    without creating one (a barrier there would raise: there is no default group)."""
    if dist.is_initialized():
        pytest.skip("a process group is active in this process")
    assert od.synchronize() is None
    assert not dist.is_initialized() and od.model_name() == "serial"


def check_synchronize_waits_for_every_rank() -> tuple[float, float]:
    """Rank r arrives 0.3 * r s late; returns (arrived, left) on this host's clock."""
    time.sleep(0.3 * od.get_rank())
    arrived = time.time()
    od.synchronize()
    return arrived, time.time()


def test_synchronize_is_a_barrier(multi):
    times = multi(check_synchronize_waits_for_every_rank)
    last_arrival = max(arrived for arrived, _ in times)
    # no rank leaves before the last one arrived (0.3 s after the previous one)
    assert all(left >= last_arrival for _, left in times), times


def check_shared_random_seed_leaves_the_rngs_alone() -> list[int]:
    """Seeding numpy, Python and torch and drawing twice: their states are untouched by the draws,
    and the seeds still differ (detectron2's draw from numpy would repeat after np.random.seed)."""
    seeds = []
    for _ in range(2):
        np.random.seed(0)
        random.seed(0)
        torch.manual_seed(0)
        states = (np.random.get_state(), random.getstate(), torch.get_rng_state())
        seeds.append(od.shared_random_seed())
        after = (np.random.get_state(), random.getstate(), torch.get_rng_state())
        assert all(np.array_equal(a, b) for a, b in zip(states[0], after[0]))
        assert states[1] == after[1] and torch.equal(states[2], after[2])
    assert seeds[0] != seeds[1], seeds  # equal with probability 2**-31
    return seeds


@pytest.mark.parametrize("world", ["serial", 2], ids=["serial", "ws2"])
def test_shared_random_seed_leaves_numpys_rng_alone(world):
    out = Runner(world)(check_shared_random_seed_leaves_the_rngs_alone)
    assert all(seeds == out[0] for seeds in out), out  # the same on every rank


def test_shared_random_seed_is_drawn_from_os_urandom(monkeypatch):
    """Rank 0's draw is os.urandom's 4 bytes, modulo 2**31."""
    if dist.is_initialized():
        pytest.skip("a process group is active in this process")
    monkeypatch.setattr(os, "urandom", lambda n: (0x80000005).to_bytes(4, "little")[:n])
    assert od.shared_random_seed() == 5


def check_reduce_dict_over_a_group() -> None:
    """``reduce_dict(..., group=)`` over the ranks 1..w-1: the mean (or sum) over those ranks only,
    with the group given as a list or as a handle; rank 0, outside it, gets its values back."""
    r, w = od.get_rank(), od.get_world_size()
    ranks = list(range(1, w))
    for group in (ranks, od.new_group(ranks)):
        mean = od.reduce_dict({"loss": torch.tensor(float(r)), "n": r}, group=group)
        total = od.reduce_dict({"n": r}, average=False, group=group)
        if r == 0:
            assert mean["n"] == 0 and torch.equal(mean["loss"], torch.tensor(0.0)) and total == {"n": 0}
        else:
            expected = sum(ranks) / len(ranks)  # over the group's ranks, not the world's
            assert mean["n"] == expected and torch.equal(mean["loss"], torch.tensor(expected)), mean
            assert total == {"n": sum(ranks)}, total


def test_reduce_dict_takes_a_group(multi):
    multi(check_reduce_dict_over_a_group)


# ---------------------------------------------------------------------------- detectron2's launch()
def report_rendezvous(local_rank: int) -> dict[str, Any]:
    """What a worker that Parallel started sees of its rendezvous and group."""
    return {
        "pid": os.getpid(),
        "master": (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])),
        "group": dist.is_initialized(),
        "world_size": od.get_world_size(),
        "sum": od.all_reduce(1),
        "timeout": _group_timeout(),
    }


def test_parallel_takes_master_addr_and_port_and_a_timedelta_timeout():
    """detectron2's ``dist_url="tcp://host:port"`` and ``timeout=``: ``master_addr=``,
    ``master_port=`` and a ``timedelta`` reach every worker's rendezvous and group."""
    port = free_port()
    with od.Parallel(
        backend="gloo",
        nproc_per_node=2,
        master_addr="127.0.0.1",
        master_port=port,
        timeout=timedelta(seconds=47),
        start_method="fork",
    ) as parallel:
        out = parallel.run(report_rendezvous)  # local rank 0's
    assert out["master"] == ("127.0.0.1", port) and out["sum"] == 2, out
    assert out["timeout"] == timedelta(seconds=47), out


def test_parallel_auto_with_one_process_starts_one_worker_with_a_group_of_one():
    """``Parallel(backend="auto", nproc_per_node=1)`` starts a worker (not this process) with a
    process group of one, as detectron2's launch() does not; ``timeout`` in seconds also works."""
    with od.Parallel(backend="auto", nproc_per_node=1, timeout=53, start_method="fork") as parallel:
        out = parallel.run(report_rendezvous)
    assert out["pid"] != os.getpid() and out["group"] and out["world_size"] == 1 and out["sum"] == 1, out
    assert out["timeout"] == timedelta(seconds=53), out


@pytest.mark.parametrize(
    ("environ", "kwargs", "message"),
    [
        (  # torchrun's variables of one node of 2 processes
            TORCHRUN_WORKER_ENV,
            {
                "nproc_per_node": 2,
                "nnodes": 2,
                "node_rank": 0,
                "master_addr": "127.0.0.1",
                "master_port": 29555,
            },
            "nnodes=2 is not allowed; allowed: 1, the value the launcher that started this process set",
        ),
        (  # node 1 of 2
            {
                **TORCHRUN_WORKER_ENV,
                "RANK": "2",
                "WORLD_SIZE": "4",
                "GROUP_RANK": "1",
                "GROUP_WORLD_SIZE": "2",
            },
            {
                "nproc_per_node": 2,
                "nnodes": 2,
                "node_rank": 0,
                "master_addr": "127.0.0.1",
                "master_port": 29555,
            },
            "node_rank=0 is not allowed; allowed: 1, the value the launcher that started this process set",
        ),
    ],
    ids=["nnodes", "node_rank"],
)
def test_parallel_under_a_launcher_refuses_nnodes_and_node_rank_it_contradicts(
    monkeypatch, environ, kwargs, message
):
    """Under a launcher, ``nnodes`` and ``node_rank`` must match the launcher's (nproc_per_node
    and master_port: test_launch.py); matching values are accepted. Nothing starts either way."""
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(od.OnedistValueError, match=message):
        od.Parallel(backend="gloo", **kwargs)
    matching = {
        **kwargs,
        "nnodes": int(environ.get("GROUP_WORLD_SIZE", 1)),
        "node_rank": int(environ["GROUP_RANK"]),
    }
    assert od.Parallel(backend="gloo", **matching).mode == "external"


# ---------------------------------------------------------------------------- raw DDP
def check_torchs_sync_batch_norm_does_not_run_on_cpu() -> None:
    """On CPU with gloo, torch's SyncBatchNorm is refused by DDP and by its own forward pass;
    onedist's (od.convert_sync_batchnorm) trains under DDP."""

    def net() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))

    torchs = torch.nn.SyncBatchNorm.convert_sync_batchnorm(net())
    with pytest.raises(ValueError, match="SyncBatchNorm layers only work with GPU modules"):
        torch.nn.parallel.DistributedDataParallel(torchs)
    with pytest.raises(ValueError, match="SyncBatchNorm expected input tensor to be on GPU"):
        torchs(torch.randn(4, 2))
    ours = od.auto_model(od.convert_sync_batchnorm(net()))
    ours(torch.randn(4, 2)).sum().backward()


def test_torchs_sync_batch_norm_does_not_run_on_cpu():
    Runner(2)(check_torchs_sync_batch_norm_does_not_run_on_cpu)


# ---------------------------------------------------------------------------- training helpers
def _gradients(model: torch.nn.Module, enabled: bool) -> torch.Tensor:
    """The weight gradient of one backward pass of this rank's own input inside od.no_sync."""
    model.zero_grad()
    x = torch.full((2, 3), float(od.get_rank() + 1))
    with od.no_sync(model, enabled=enabled):
        model(x).sum().backward()
    return od.unwrap(model).weight.grad.clone()


def check_no_sync_disabled_exchanges() -> None:
    """``od.no_sync(model, enabled=False)`` exchanges the gradients as a plain backward pass does
    (every rank gets the mean); enabled, each rank keeps its own."""
    r, w = od.get_rank(), od.get_world_size()
    model = od.auto_model(torch.nn.Linear(3, 1, bias=False))
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
    mean = sum(2.0 * (q + 1) for q in range(w)) / w  # d/dw of sum(x @ w) over 2 rows of q + 1
    assert torch.equal(_gradients(model, enabled=False), torch.full((1, 3), mean))
    assert torch.equal(_gradients(model, enabled=True), torch.full((1, 3), 2.0 * (r + 1)))


def test_no_sync_enabled_false_exchanges_the_gradients(multi):
    multi(check_no_sync_disabled_exchanges)


def check_no_sync_with_one_process() -> None:
    """With one process auto_model returns the model itself (no ``no_sync`` of its own), and
    ``od.no_sync`` around its backward pass changes nothing: the gradient of a plain pass."""
    model = od.auto_model(torch.nn.Linear(3, 1, bias=False))
    assert type(model) is torch.nn.Linear
    for enabled in (True, False):
        assert torch.equal(_gradients(model, enabled), torch.full((1, 3), 2.0)), enabled


@pytest.mark.parametrize("world", ["serial", 1], ids=["serial", "ws1"])
def test_no_sync_with_one_process_does_nothing(world):
    Runner(world)(check_no_sync_with_one_process)


def check_evaluation_loader_batches() -> int:
    """An evaluation loader over 2w + 1 samples, one sample per batch on each rank: rank 0 gets
    3 batches, the others 2 (no padding), and every sample is on exactly one rank."""
    r, w = od.get_rank(), od.get_world_size()
    loader = od.auto_dataloader(list(range(2 * w + 1)), batch_size=w, evaluation=True)
    batches = [b.tolist() for b in loader]
    assert len(batches) == (3 if r == 0 else 2), batches
    seen = sorted(x for part in od.all_gather_object(batches) for b in part for x in b)
    assert seen == list(range(2 * w + 1)), seen
    return len(batches)


def test_an_evaluation_loader_gives_ranks_different_numbers_of_batches(multi):
    assert multi(check_evaluation_loader_batches) == [3] + [2] * (multi.world_size - 1)


def test_clip_grad_norm_does_not_check_for_an_inf_norm():
    """Fabric's DDP clip_gradients raises on a non-finite norm; od.clip_grad_norm_ returns it."""
    model = torch.nn.Linear(3, 1)
    model(torch.ones(2, 3)).sum().backward()
    model.weight.grad[0, 0] = float("inf")
    assert od.clip_grad_norm_(model, max_norm=1.0).item() == float("inf")


# ---------------------------------------------------------------------------- Accelerate, Fabric
def _torchrun_env(rank: int, world_size: int, nnodes: int) -> None:
    """torchrun's variables for ``rank`` of ``world_size`` over ``nnodes`` nodes, set in this worker
    of a pool of the test's own (the group exists: Accelerate and Fabric adopt it)."""
    from onedist.launchers.worker import torchrun_env

    per_node = world_size // nnodes
    # MASTER_PORT 1: never used, the group exists
    os.environ.update(torchrun_env(rank % per_node, per_node, rank // per_node, nnodes, "127.0.0.1", 1))
    os.environ["TORCHELASTIC_RUN_ID"] = "migration-pages"


@pytest.fixture(scope="module")
def accelerate_pool():
    """Two gloo ranks of this module's own, forked after Accelerate's import: it keeps its state
    (PartialState) for the life of the process."""
    pytest.importorskip("accelerate")
    pool = DistPool(2)
    yield pool
    pool.close()


def check_accelerate_as_the_page_states() -> dict[str, Any]:
    """Accelerate on 2 CPU processes, 201 samples, ``batch_size=64``: ``gather_for_metrics`` per
    batch gives the 201 rows in dataset order; once after the loop, and ``gather`` per batch,
    256 rows (the last round padded with the first 55 samples). A shuffling loader reshuffles
    every epoch without ``set_epoch``."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    warnings.simplefilter("ignore")  # Accelerate's warnings, in this worker
    _torchrun_env(od.get_rank(), od.get_world_size(), nnodes=1)
    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == 2
    loader = accelerator.prepare(DataLoader(torch.arange(201), batch_size=64))
    per_batch, gathered, mine = [], [], []
    for x in loader:
        per_batch.append(accelerator.gather_for_metrics(x))
        gathered.append(accelerator.gather(x))
        mine.append(x)
    assert torch.cat(per_batch).tolist() == list(range(201))
    once = accelerator.gather_for_metrics(torch.cat(mine)).tolist()
    twice = {i for i, n in collections.Counter(once).items() if n == 2}
    assert len(once) == 256 and twice == set(range(55)) and sorted(set(once)) == list(range(201))
    assert len(torch.cat(gathered)) == 256
    shuffled = accelerator.prepare(DataLoader(torch.arange(64), batch_size=8, shuffle=True))
    first, second = (od.all_gather_object(torch.cat(list(shuffled)).tolist()) for _ in range(2))
    assert sorted(first[0] + first[1]) == sorted(second[0] + second[1]) == list(range(64))
    assert first != second
    return {"rows_once": len(once)}


def test_accelerate_gather_for_metrics_as_the_page_states(accelerate_pool):
    out = accelerate_pool.run(check_accelerate_as_the_page_states, timeout=120)
    assert out == [{"rows_once": 256}] * 2


@pytest.fixture(scope="module")
def fabric_pool():
    """Two gloo ranks of this module's own, forked after Lightning's import (5 s, done once): Fabric
    keeps process-wide state (rank_zero_only's rank, its accelerator)."""
    pytest.importorskip("lightning.fabric")
    pool = DistPool(2)
    yield pool
    pool.close()


def check_fabric_as_the_page_states(tmpdir: str) -> dict[str, Any]:
    """Fabric (``strategy="ddp"``, CPU) on 2 processes, each on a machine of its own (torchrun's
    variables say so): what docs/migration/fabric.md says Fabric does."""
    from lightning.fabric import Fabric
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
    from torch.utils.data import DataLoader, DistributedSampler, WeightedRandomSampler

    warnings.simplefilter("ignore")  # Lightning's deprecation warnings, in this worker
    r, w = od.get_rank(), od.get_world_size()
    _torchrun_env(r, w, nnodes=w)
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=1, num_nodes=w)
    fabric.launch()
    assert (fabric.global_rank, fabric.local_rank, fabric.world_size) == (r, 0, w)
    # all_gather stacks: (world_size, *shape); a 0-dim tensor or a number gives (world_size,)
    assert fabric.all_gather(torch.ones(3, 2)).shape == (w, 3, 2)
    assert fabric.all_gather(torch.tensor(1.0)).shape == (w,) and fabric.all_gather(5).shape == (w,)
    # all_reduce averages by default, and a number comes back as a tensor on fabric.device
    mean = fabric.all_reduce(float(r))
    assert isinstance(mean, torch.Tensor) and mean.device == fabric.device and mean.item() == (w - 1) / 2
    # broadcast: any picklable object, the others pass None
    assert fabric.broadcast({"config": [1, "a"]} if r == 0 else None, src=0) == {"config": [1, "a"]}
    # a sequential loader gets torch's DistributedSampler, which repeats samples: 101 each of 201
    test_loader = fabric.setup_dataloaders(DataLoader(torch.arange(201), batch_size=64))
    assert type(test_loader.sampler) is DistributedSampler
    rows = od.all_gather_object(torch.cat(list(test_loader)).tolist())
    assert [len(part) for part in rows] == [101, 101] and len(set(rows[0] + rows[1])) == 201
    # a shuffling loader is reshuffled every epoch without set_epoch
    train_loader = fabric.setup_dataloaders(DataLoader(torch.arange(64), batch_size=8, shuffle=True))
    first, second = (od.all_gather_object(torch.cat(list(train_loader)).tolist()) for _ in range(2))
    assert sorted(first[0] + first[1]) == sorted(second[0] + second[1]) == list(range(64))
    assert first != second  # torch's DistributedSampler alone repeats its order
    # a sampler of one's own is wrapped (use_distributed_sampler=True, the default)
    weighted = DataLoader(torch.arange(8), batch_size=2, sampler=WeightedRandomSampler([1.0] * 8, 8))
    assert isinstance(fabric.setup_dataloaders(weighted).sampler, DistributedSamplerWrapper)
    # fabric.print prints on local rank 0: once per machine (here: on both ranks)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        fabric.print("hello")
    assert printed.getvalue() == "hello\n" and fabric.is_global_zero == (r == 0)
    # save stores the model without DDP's "module." prefix; load restores the objects, copies plain
    # values back into the state and returns what it did not restore
    net = torch.nn.Linear(2, 1)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    path = os.path.join(tmpdir, "fabric.ckpt")
    fabric.save(path, {"model": model, "epoch": 3, "note": "kept"})
    assert sorted(torch.load(path, weights_only=False)["model"]) == ["bias", "weight"]
    state = {"model": model, "epoch": 0}
    assert fabric.load(path, state) == {"note": "kept"} and state["epoch"] == 3
    # clip_gradients on DDP raises on a non-finite norm (error_if_nonfinite=True)
    model(torch.ones(2, 2)).sum().backward()
    net.weight.grad[0, 0] = float("inf")
    with pytest.raises(RuntimeError, match="non-finite"):
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
    return {"rank": r}


def test_fabric_as_the_page_states(fabric_pool, tmp_path):
    out = fabric_pool.run(check_fabric_as_the_page_states, str(tmp_path), timeout=120)
    assert out == [{"rank": 0}, {"rank": 1}]
