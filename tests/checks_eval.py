"""Checks of all_gather_eval and the checkpoints, run on every rank of every world (serial, 1..4).

Each check asserts on its own rank and returns something small for the test to compare across
ranks. The dataset is 100 samples whose input is their own index, so a gathered row says which
sample it is.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler as TorchDistributedSampler, TensorDataset

import onedist as od
from checks import count_primitives, rounds, rw
from onedist.training.checkpoint import CheckpointNotFoundError

N = 100
BATCH = 12  # global: divisible by every world size 1..4


def dataset() -> TensorDataset:
    x = torch.arange(N)
    return TensorDataset(x, (x * 7) % 5)


def predict(x: torch.Tensor) -> torch.Tensor:
    """A deterministic "model": right on about 2 samples in 5."""
    return (x * 3) % 5


def serial_accuracy() -> float:
    x, y = dataset().tensors
    return float((predict(x) == y).double().mean())


def make_loader(kind: str) -> Any:
    r, w = rw()
    ds = dataset()
    if kind == "eval":
        return od.auto_dataloader(ds, batch_size=BATCH, evaluation=True)
    if kind == "padded":  # onedist's DistributedSampler, padded, 2 epochs with auto reshuffle
        return od.auto_dataloader(ds, batch_size=BATCH, shuffle=False)
    if kind == "auto_shuffle":
        return od.auto_dataloader(ds, batch_size=BATCH, shuffle=True)
    if kind == "user_shuffle":  # the user's own loader and torch's sampler, epoch set by hand
        sampler = TorchDistributedSampler(ds, num_replicas=w, rank=r, shuffle=True, seed=3)
        sampler.set_epoch(2)
        return DataLoader(ds, batch_size=BATCH // w, sampler=sampler)
    if kind == "proxy":  # any sampler made distributed
        return od.auto_dataloader(ds, batch_size=BATCH, sampler=torch.utils.data.SequentialSampler(ds))
    raise AssertionError(kind)


def run_eval(loader: Any, epochs: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    for _ in range(epochs):
        xs, preds, labels = [], [], []
        for x, y in loader:
            xs.append(x)
            preds.append(predict(x))
            labels.append(y)
    return torch.cat(xs), torch.cat(preds), torch.cat(labels)


# ============================================================================ all_gather_eval
def check_eval_exact(kind: str) -> float:
    _, w = rw()
    loader = make_loader(kind)
    # one process with shuffle=True: auto_dataloader gives a plain RandomSampler, whose order
    # cannot be replayed: the results come back complete, in the loader's order, with a warning
    unordered = w == 1 and kind == "auto_shuffle"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        xs, preds, labels = run_eval(loader, epochs=2 if kind in ("padded", "auto_shuffle") else 1)
        with count_primitives() as counts:
            out = od.all_gather_eval({"x": xs, "out": (preds, [labels])}, loader)
    messages = [str(c.message) for c in caught]
    if unordered:
        assert any("not in dataset order" in m for m in messages), messages
    else:
        assert not messages, messages  # no warning with any other loader
    # one collective (a size round plus the bytes), whatever the number of tensors
    assert rounds(counts) <= (3 if w > 1 else 0), counts
    assert set(out) == {"x", "out"} and isinstance(out["out"], tuple) and isinstance(out["out"][1], list)
    x, pred, label = out["x"], out["out"][0], out["out"][1][0]
    assert x.shape == (N,) and pred.shape == (N,) and label.shape == (N,)
    if unordered:
        order = torch.argsort(x)
        x, pred, label = x[order], pred[order], label[order]
    assert torch.equal(x, torch.arange(N)), x  # dataset order, each sample once
    assert torch.equal(label, dataset().tensors[1])
    acc = float((pred == label).double().mean())
    assert acc == serial_accuracy(), (acc, serial_accuracy())
    if w > 1 and kind in ("padded", "user_shuffle", "auto_shuffle") and N % w:
        # the naive gather counts the padding: the bug this function exists to prevent
        assert od.all_gather(xs).numel() > N
    return acc


def check_eval_indices() -> list[int]:
    r, w = rw()
    ds = dataset()
    sampler = od.DistributedSampler(ds, shuffle=True, seed=5)
    loader = DataLoader(ds, batch_size=7, sampler=sampler)
    per_batch = [x for x, _ in loader]
    xs = torch.cat(per_batch)
    # a 1-D tensor, a list of ints, a list of per-batch tensors: the same result
    for idx in (xs, xs.tolist(), per_batch):
        out = od.all_gather_eval({"x": xs, "sq": xs.float() ** 2}, indices=idx)
        assert torch.equal(out["x"], torch.arange(N)) and torch.equal(out["sq"], torch.arange(N).float() ** 2)
    # the sampler itself instead of the loader
    assert torch.equal(od.all_gather_eval(xs, sampler), torch.arange(N))
    # a subset of the dataset: one row per index, in increasing index order
    subset = torch.arange(r, 40, w) * 2  # 0, 2, ..., 78, split over the ranks
    out = od.all_gather_eval(subset * 10, indices=subset)
    assert torch.equal(out, torch.arange(0, 80, 2) * 10), out
    # a rank with no rows at all (more ranks than samples)
    few = torch.arange(2)[r::w]
    got = od.all_gather_eval(few.float()[:, None].expand(-1, 3), indices=few)
    assert got.shape == (2, 3) and torch.equal(got[:, 0], torch.tensor([0.0, 1.0]))
    # two dimensions per sample, a namedtuple, and more ranks than samples with a loader
    tiny = TensorDataset(torch.arange(2))
    tl = od.auto_dataloader(tiny, batch_size=w, evaluation=True)
    rows = torch.cat([b[0] for b in tl]) if len(tl) else torch.empty(0, dtype=torch.int64)
    got2 = od.all_gather_eval(rows[:, None].repeat(1, 2), tl)
    assert torch.equal(got2, torch.tensor([[0, 0], [1, 1]])), got2
    return out.tolist()


def check_eval_serial_passthrough_and_errors() -> str:
    _, w = rw()
    values = torch.arange(3)
    if w == 1:
        assert od.all_gather_eval(values) is values  # nothing to reorder
    else:
        with pytest.raises(od.OnedistValueError, match="HINT: .*pass the evaluation loader"):
            od.all_gather_eval(values)
    with pytest.raises(od.OnedistValueError, match="one of loader and indices"):
        od.all_gather_eval(values, DataLoader(dataset()), indices=[0, 1, 2])
    return "ok"


def check_eval_mismatch_raises_everywhere() -> str:
    r, w = rw()
    ds = dataset()
    # 1. the loader drops its last incomplete batch: rows != samples on every rank -> all raise
    loader = od.auto_dataloader(ds, batch_size=BATCH, evaluation=True, drop_last=True)
    xs, _, _ = run_eval(loader)
    with pytest.raises(od.OnedistValueError, match="drop_last=False") as e:
        od.all_gather_eval(xs, loader)
    text = str(e.value)
    assert "loader=DataLoader(" in text and "drop_last=True" in text and "rows" in text
    # 2. the sampler drops samples (torch's drop_last=True) where N % w != 0: coverage error
    if N % w:
        sampler = TorchDistributedSampler(ds, num_replicas=w, rank=r, shuffle=False, drop_last=True)
        dl = DataLoader(ds, batch_size=5, sampler=sampler)
        xs, _, _ = run_eval(dl)
        with pytest.raises(od.OnedistValueError, match=f"cover {N // w * w} of the {N} samples"):
            od.all_gather_eval(xs, dl)
    # 3. one rank passes a row too few: every rank raises the same error, naming it
    loader = make_loader("eval")
    xs, _, _ = run_eval(loader)
    short = xs[:-1] if r == w - 1 else xs
    with pytest.raises(od.OnedistValueError, match=rf"rank {w - 1} has \d+ rows for the \d+ samples"):
        od.all_gather_eval(short, loader)
    # 4. indices that do not match the rows
    with pytest.raises(od.OnedistValueError, match="one dataset index per row of values: rank 0 has"):
        od.all_gather_eval(xs, indices=xs[:-1] if r == 0 else xs)
    if w == 1:
        return "ok"
    # 5. different dtypes across ranks: CollectiveMismatchError on every rank, listing them
    mixed = xs.double() if r == 1 else xs.float()
    with pytest.raises(od.CollectiveMismatchError, match="rank 1: {'v': float64\\[\\]}") as e2:
        od.all_gather_eval({"v": mixed}, loader)
    assert "rank 0: {'v': float32[]}" in str(e2.value)
    # 6. unusable values on one rank: it raises its own error, the others RemoteRankError
    bad: Any = torch.tensor(1.0) if r == 1 else xs
    if r == 1:
        with pytest.raises(od.OnedistValueError, match="0-dim"):
            od.all_gather_eval(bad, loader)
    else:
        with pytest.raises(od.RemoteRankError, match="rank 1 could not prepare") as e3:
            od.all_gather_eval(bad, loader)
        assert e3.value.rank == 1
    # 7. an unknown order (a plain RandomSampler) in a distributed run: every rank raises
    rl = DataLoader(ds, batch_size=4, shuffle=True)
    with pytest.raises(od.OnedistValueError, match="RandomSampler"):
        od.all_gather_eval(xs, rl)
    # still usable afterwards
    assert od.all_gather(r) == list(range(w))
    return "ok"


# ============================================================================ checkpoints
class CountSaves:
    """Counts torch.save calls in this process."""

    def __init__(self) -> None:
        self.calls = 0
        self._orig = torch.save

    def __enter__(self) -> CountSaves:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return self._orig(*args, **kwargs)

        torch.save = wrapper
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.save = self._orig


class Net(torch.nn.Module):
    """Parameters and a buffer (like BatchNorm's running statistics, without its cost)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 8)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += len(x)
        return self.fc(x)


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = od.auto_model(Net())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(6, 4)).pow(2).sum().backward()
        opt.step()
        sched.step()
    return model, opt, sched


def check_checkpoint_roundtrip(tmpdir: str) -> int:
    r, w = rw()
    path = os.path.join(tmpdir, "sub", "dir", "ckpt.pt")  # parents created
    model, opt, sched = _trained(seed=0)
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel) == (w > 1)
    with CountSaves() as saves:
        od.save_checkpoint({"model": model, "optimizer": opt, "sched": sched, "epoch": 7}, path)
    assert os.path.isfile(path)  # on return, on every rank
    assert os.listdir(os.path.dirname(path)) == ["ckpt.pt"]  # no temporary file left
    raw = torch.load(path, weights_only=True)
    assert not any(k.startswith("module.") for k in raw["model"]), list(raw["model"])
    # a fresh, unwrapped model on every rank
    fresh = Net()
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1, gamma=0.5)
    ckpt = od.load_checkpoint(path, {"model": fresh, "optimizer": fresh_opt, "sched": fresh_sched})
    assert ckpt["epoch"] == 7
    inner = od.unwrap(model)
    for (n1, a), (n2, b) in zip(inner.state_dict().items(), fresh.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b), n1
    s1, s2 = opt.state_dict(), fresh_opt.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for k in s1["state"]:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s1["state"][k][name], s2["state"][k][name]), (k, name)
    assert fresh_sched.last_epoch == sched.last_epoch == 2
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    # and back into a wrapped (DDP) model: no "module." problem either way
    other, _, _ = _trained(seed=1)
    od.load_checkpoint(path, {"model": other})
    assert all(torch.equal(a, b) for a, b in zip(od.unwrap(other).parameters(), inner.parameters()))
    # another writer rank; the checkpoint then replaces the old file atomically
    with CountSaves() as saves2:
        od.save_checkpoint({"epoch": 8}, path, rank=w - 1)
    assert od.load_checkpoint(path)["epoch"] == 8
    assert os.listdir(os.path.dirname(path)) == ["ckpt.pt"]
    assert saves2.calls == (1 if r == w - 1 else 0)
    return saves.calls  # 1 on rank 0 only


def check_checkpoint_prefix_and_single_object(tmpdir: str) -> None:
    r, _ = rw()
    torch.manual_seed(0)
    src = torch.nn.Linear(3, 2)
    # a checkpoint written by another tool from a DDP model: every key has "module."
    foreign = os.path.join(tmpdir, "foreign.pt")
    with od.one_rank_first():
        if r == 0:
            torch.save({"model": {f"module.{k}": v for k, v in src.state_dict().items()}}, foreign)
    fresh = torch.nn.Linear(3, 2)
    od.load_checkpoint(foreign, {"model": fresh})
    assert torch.equal(fresh.weight, src.weight) and torch.equal(fresh.bias, src.bias)
    # a wrapper's own state dict (with its per-module _metadata), saved as is
    wrapped = os.path.join(tmpdir, "wrapped.pt")
    with od.one_rank_first():
        if r == 0:
            torch.save({"net": torch.nn.DataParallel(src).state_dict()}, wrapped)
    assert "module" in od.load_checkpoint(wrapped)["net"]._metadata
    fresh2 = torch.nn.Linear(3, 2)
    od.load_checkpoint(wrapped, {"net": fresh2})
    assert torch.equal(fresh2.weight, src.weight)
    # torch.compile's and DDP's prefixes together, loaded into a DDP-wrapped target
    both = os.path.join(tmpdir, "both.pt")
    with od.one_rank_first():
        if r == 0:
            torch.save({f"module._orig_mod.{k}": v for k, v in src.state_dict().items()}, both)
    target = od.auto_model(torch.nn.Linear(3, 2))
    od.load_checkpoint(both, target)  # a single object, not a dict
    assert torch.equal(od.unwrap(target).weight, src.weight)
    # a module whose own keys start with "module.": nothing is stripped
    holder = torch.nn.Module()
    holder.module = torch.nn.Linear(3, 2)
    single = os.path.join(tmpdir, "single.pt")
    od.save_checkpoint(holder, single)  # a single object: its state dict
    assert list(od.load_checkpoint(single)) == ["module.weight", "module.bias"]
    holder2 = torch.nn.Module()
    holder2.module = torch.nn.Linear(3, 2)
    od.load_checkpoint(single, holder2)
    assert torch.equal(holder2.module.weight, holder.module.weight)
    # map_location: default onedist.device(); explicit is honoured
    assert od.load_checkpoint(single, map_location="cpu")["module.weight"].device.type == "cpu"


def check_checkpoint_errors_everywhere(tmpdir: str) -> str:
    r, w = rw()
    missing = os.path.join(tmpdir, "does-not-exist.pt")
    with pytest.raises(CheckpointNotFoundError, match="does-not-exist.pt") as e:
        od.load_checkpoint(missing)
    assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, od.OnedistError)
    good = os.path.join(tmpdir, "good.pt")
    od.save_checkpoint({"model": torch.nn.Linear(2, 2), "epoch": 1}, good)
    # a key that the checkpoint lacks: every rank raises
    with pytest.raises(od.OnedistValueError, match="missing: \\['opt'\\]"):
        od.load_checkpoint(
            good,
            {
                "model": torch.nn.Linear(2, 2),
                "opt": torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1),
            },
        )
    with pytest.raises(od.OnedistTypeError, match="has type int"):
        od.load_checkpoint(good, {"epoch": 0})
    # the writer cannot write (its parent is a file): it raises, the others do not hang
    blocker = os.path.join(tmpdir, "a-file")
    with od.one_rank_first():
        if r == 0:
            open(blocker, "w").close()
    with pytest.raises(od.OnedistValueError, match="rank"):
        od.save_checkpoint({"x": 1}, os.path.join(tmpdir, "y.pt"), rank=w)
    bad_path = os.path.join(blocker, "ckpt.pt")
    if w == 1 or r == w - 1:
        with pytest.raises(OSError):
            od.save_checkpoint({"x": 1}, bad_path, rank=w - 1)
    else:
        with pytest.raises(od.RemoteRankError, match=f"rank {w - 1} could not write") as e2:
            od.save_checkpoint({"x": 1}, bad_path, rank=w - 1)
        assert e2.value.rank == w - 1
    assert sorted(os.listdir(tmpdir)) == ["a-file", "good.pt"]
    if w == 1:
        return "ok"
    # missing on one rank only: it raises its own error, the others RemoteRankError
    path = missing if r == 1 else good
    if r == 1:
        with pytest.raises(CheckpointNotFoundError):
            od.load_checkpoint(path)
    else:
        with pytest.raises(od.RemoteRankError, match="rank 1 could not load"):
            od.load_checkpoint(path)
    assert od.all_gather(r) == list(range(w))  # still usable
    return "ok"
