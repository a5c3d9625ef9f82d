"""Models larger than one rank (issue 52, points 1 and 3), run on every rank of a pool and serially:
od.init_module(empty_init=True) and auto_model's allocation of a meta model, activation
checkpointing, precision="bf16-true" and cpu_offload."""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable
from typing import Any

import torch

import onedist as od

WIDTH = 24


class Block(torch.nn.Module):
    """A residual block whose inner activations are 4 times its input (what checkpointing drops)."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(torch.nn.Module):
    """Embedding rows (11) that 2 and 3 ranks split unevenly, blocks in a ModuleList, attention
    (its ``_reset_parameters`` zeroes its child's bias: the children-first order matters)."""

    def __init__(self, width: int = WIDTH, depth: int = 3) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, width)
        self.attention = torch.nn.MultiheadAttention(width, 2, batch_first=True)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.attention(x, x, x, need_weights=False)[0]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _tokens(step: int, rows: int = 6, length: int = 8) -> torch.Tensor:
    """This rank's part of step ``step``'s global batch of token ids."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 11, (rows, length), generator=g)
    per = rows // od.get_world_size()
    return tokens[od.get_rank() * per : (od.get_rank() + 1) * per].to(od.device())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard on this rank


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every rank: the whole state dict (a sharded model's gathered), on the CPU."""
    state = od.unwrap(model).state_dict()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu() for k, v in state.items()}


def check_meta_init_equals_the_serial_init(sharding: Any) -> dict[str, Any]:
    """Built under init_module(empty_init=True) (no random number drawn) and allocated by auto_model:
    the weights are those of ``torch.manual_seed(5); Net()`` in one process, from rank 0's generator
    whatever the other ranks' seeds; rank 0's generator ends where the serial build leaves it, the
    other ranks' where they were (sharded) or where their own build leaves them (unsharded); the
    forward pass gives the serial model's output."""
    torch.manual_seed(5 + 1000 * od.get_rank())  # rank 0: seed 5; the others: anything else
    before = torch.get_rng_state()
    with od.init_module(empty_init=True):
        net = Net()
    assert all(p.is_meta for p in net.parameters()) and torch.equal(torch.get_rng_state(), before)
    model = od.auto_model(net, sharding=sharding)
    after = torch.get_rng_state()
    torch.manual_seed(5)
    with torch.device(od.device()):  # on a GPU, the CUDA generator draws, as auto_model's init
        serial = Net()
    serial_after = torch.get_rng_state()
    got = _full(model)
    assert list(got) == list(serial.state_dict()), list(got)
    differ = [k for k, v in serial.state_dict().items() if not torch.equal(got[k], v.cpu())]
    assert differ == [], differ
    sharded = hasattr(od.unwrap(model).embed.weight, "to_local")
    if od.get_rank() == 0:
        assert torch.equal(after, serial_after)  # as after the serial build
    elif sharded:
        assert torch.equal(after, before)  # drew from a copy of rank 0's: its own is untouched
    else:  # unsharded, each rank drew from its own generator (DDP then took rank 0's weights)
        torch.manual_seed(5 + 1000 * od.get_rank())
        with torch.device(od.device()):
            Net()
        assert torch.equal(after, torch.get_rng_state())
    with torch.no_grad():
        x = _tokens(0)
        worst = float((model(x) - serial(x)).abs().max())
    assert worst <= 1e-6, worst
    return {"sharded": sharded, "output_difference": worst}


class Big(torch.nn.Module):
    """16 bias-free 2048 x 2048 layers: 256 MiB of float32, each layer 16 MiB."""

    def __init__(self, depth: int = 16, width: int = 2048) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS: now, VmHWM: the peak since the last reset)."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024  # type: ignore[union-attr]


def _reset_peak() -> int:
    """Reset this process's peak RSS (Linux: clear_refs 5) and return the RSS now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def check_a_large_meta_model_allocates_only_its_shards() -> dict[str, int]:
    """A 256 MiB model: built under init_module(empty_init=True), the peak RSS grows by < 16 MiB;
    through auto_model(sharding="fsdp") by at most this rank's 1/N of it, plus one layer whole
    (its reset_parameters() runs on the whole layer) and 16 MiB. The shards hold 1/N of the bytes.
    A small model goes the same way first: what importing FSDP2 and DTensor costs once is not
    counted."""
    with od.init_module(empty_init=True):
        od.auto_model(Net(), sharding="fsdp")
    start = _reset_peak()
    torch.manual_seed(0)
    with od.init_module(empty_init=True):
        net = Big()
    built = _status("VmHWM") - start
    total = sum(p.numel() * p.element_size() for p in net.parameters())
    layer = total // len(net.layers)
    assert total >= 250 * 2**20, total
    start = _reset_peak()
    model = od.auto_model(net, sharding="fsdp")
    sharded = _status("VmHWM") - start
    held = sum(_local(p).untyped_storage().nbytes() for p in model.parameters())
    ws = od.get_world_size()
    assert built < 16 * 2**20, built
    assert held <= total / ws * 1.01, (held, total)
    assert sharded <= total / ws + layer + 16 * 2**20, (sharded, total, layer)
    return {
        "total": total,
        "layer": layer,
        "build_peak_growth": built,
        "shard_peak_growth": sharded,
        "held": held,
    }


def check_init_weights_false_leaves_the_memory_for_load_checkpoint(tmpdir: str) -> None:
    """init_weights=False allocates without initialising; od.load_checkpoint of a sharded checkpoint
    then fills it to the saving model's weights."""
    import os

    path = os.path.join(tmpdir, "trained.pt")
    torch.manual_seed(3)
    saved = od.auto_model(Net(), sharding="fsdp")
    od.save_checkpoint({"model": saved}, path)
    with od.init_module(empty_init=True):
        net = Net()
    model = od.auto_model(net, sharding="fsdp", init_weights=False)
    assert not any(p.is_meta for p in model.parameters())
    od.load_checkpoint(path, {"model": model})
    want, got = _full(saved), _full(model)
    assert all(torch.equal(want[k], got[k]) for k in want), [
        k for k in want if not torch.equal(want[k], got[k])
    ]


def _kept_bytes(
    model: torch.nn.Module, blocks: list[torch.nn.Module], step: Callable[[], torch.Tensor]
) -> tuple[torch.Tensor, int]:
    """``step()``'s loss, and the bytes the forward pass keeps for the backward pass: the storages
    autograd saves (torch's saved-tensor hooks) and the inputs each block keeps (a checkpointed
    block keeps only those), each storage counted once."""
    storages: dict[int, int] = {}

    def keep(t: torch.Tensor) -> None:
        storage = _local(t).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        keep(t)
        return t

    def inputs(module: torch.nn.Module, args: Any) -> None:
        for a in args:
            if isinstance(a, torch.Tensor):
                keep(a)

    handles = [b.register_forward_pre_hook(inputs) for b in blocks]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = step()
    finally:
        for h in handles:
            h.remove()
    return loss, sum(storages.values())


def _one_step(sharding: Any, **options: Any) -> dict[str, Any]:
    torch.manual_seed(7)
    model = od.auto_model(Net(width=32), sharding=sharding, **options)
    blocks = list(od.unwrap(model).blocks)
    tokens = _tokens(1, rows=12, length=64)
    target = torch.randn((*tokens.shape, 5), generator=torch.Generator().manual_seed(2)).to(od.device())

    def step() -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(tokens), target)

    loss, kept = _kept_bytes(model, blocks, step)
    od.backward(loss)
    grads = {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).cpu()
        for n, p in model.named_parameters()
    }
    return {"loss": loss.detach().cpu(), "kept": kept, "grads": grads}


def check_activation_checkpointing_same_loss_fewer_kept_bytes(sharding: Any) -> dict[str, Any]:
    """activation_checkpointing=True (the ModuleList's blocks), a block class, a function: the loss
    and every gradient equal the run without, bit for bit; the bytes kept for the backward pass
    drop (the blocks keep only their inputs)."""
    plain = _one_step(sharding)
    out: dict[str, Any] = {"plain": plain["kept"]}
    for name, value in [("true", True), ("class", Block), ("function", lambda m: isinstance(m, Block))]:
        run = _one_step(sharding, activation_checkpointing=value)
        assert torch.equal(run["loss"], plain["loss"]), (name, run["loss"], plain["loss"])
        differ = [k for k, g in plain["grads"].items() if not torch.equal(g, run["grads"][k])]
        assert differ == [], (name, differ)
        out[name] = run["kept"]
    assert out["true"] == out["class"] == out["function"], out
    assert out["true"] <= 0.6 * out["plain"], out
    return out


def _bf16_true_run(sharding: Any, precision: str) -> dict[str, Any]:
    torch.manual_seed(7)
    model = od.auto_model(Net(width=32), sharding=sharding, precision=precision)
    optimizer = od.auto_optim(torch.optim.AdamW(model.parameters(), lr=1e-3))
    losses, kept = [], 0
    for step in range(3):
        tokens = _tokens(step, rows=12, length=16)
        target = torch.randn((*tokens.shape, 5), generator=torch.Generator().manual_seed(step)).to(
            od.device()
        )
        out, kept = _kept_bytes(model, list(od.unwrap(model).blocks), functools.partial(model, tokens))
        assert out.dtype == torch.float32, out.dtype
        loss = torch.nn.functional.mse_loss(out, target)
        od.backward(loss)
        optimizer.step()
        losses.append(float(od.all_reduce(loss.detach().float().clone(), op="MEAN")))
    od.backward(torch.nn.functional.mse_loss(model(tokens), target))  # gradients there to count them
    optimizer.step()
    tensors = [*model.parameters(), *(p.grad for p in model.parameters())]
    tensors += [
        v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()
    ]
    local = [_local(t) for t in tensors]
    return {
        "losses": losses,
        "dtypes": sorted({str(t.dtype) for t in local}),
        "bytes": sum(t.untyped_storage().nbytes() for t in local),
        "kept": kept,
    }


def check_bf16_true_trains_in_bfloat16_on_half_the_bytes(sharding: Any) -> dict[str, Any]:
    """precision="bf16-true": parameters, gradients and AdamW's state bfloat16, outputs float32;
    half the bytes of float32's, and at most 0.6 times the bytes kept for the backward pass; the
    losses of 3 steps within bfloat16's precision of float32's."""
    full = _bf16_true_run(sharding, "32")
    true = _bf16_true_run(sharding, "bf16-true")
    assert full["dtypes"] == ["torch.float32"] and true["dtypes"] == ["torch.bfloat16"], (full, true)
    assert true["bytes"] * 2 == full["bytes"], (true["bytes"], full["bytes"])
    assert true["kept"] <= 0.6 * full["kept"], (true["kept"], full["kept"])
    worst = max(abs(a - b) / abs(b) for a, b in zip(true["losses"], full["losses"]))
    assert worst <= 2**-6, (worst, true["losses"], full["losses"])  # a few of bfloat16's 2**-8 steps
    return {
        "bytes_32": full["bytes"],
        "bytes_bf16_true": true["bytes"],
        "kept_32": full["kept"],
        "kept_bf16_true": true["kept"],
        "loss_relative_difference": worst,
    }


def check_cpu_offload_on_the_cpu_warns_once_and_changes_nothing() -> None:
    """cpu_offload=True on the CPU: one warning saying it does nothing, then the same weights."""
    results = []
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for offload in (False, True, True):
            torch.manual_seed(1)
            model = od.auto_model(Net(), sharding="fsdp", cpu_offload=offload)
            od.backward(model(_tokens(0)).pow(2).mean())
            results.append(_full(model))
    texts = [str(w.message) for w in said if "cpu_offload" in str(w.message)]
    if od.get_world_size() > 1:
        assert len(texts) <= 1 and all("does nothing on the CPU" in t for t in texts), texts
    assert all(torch.equal(results[0][k], r[k]) for r in results[1:] for k in results[0])


def check_cpu_offload_keeps_the_shards_on_the_cpu() -> dict[str, float]:
    """On CUDA, cpu_offload=True (FSDP2's CPUOffloadPolicy): the shards and their gradients stay in
    CPU memory, and 3 SGD steps give the weights of the same run without offload (the optimizer
    steps on the CPU instead: float rounding apart); a meta model is allocated on the CPU."""
    runs = []
    for offload in (False, True):
        torch.manual_seed(1)
        model = od.auto_model(Net(), sharding="fsdp", cpu_offload=offload)
        optimizer = od.auto_optim(torch.optim.SGD(model.parameters(), lr=0.1))
        for step in range(3):
            od.backward(model(_tokens(step)).pow(2).mean())
            if offload:
                assert {_local(p.grad).device.type for p in model.parameters()} == {"cpu"}
            optimizer.step()
            optimizer.zero_grad()
        where = {_local(p).device.type for p in model.parameters()}
        assert where == ({"cpu"} if offload else {"cuda"}), (offload, where)
        runs.append(_full(model))
    worst = max(float((runs[0][k] - runs[1][k]).abs().max()) for k in runs[0])
    assert worst <= 1e-5, worst
    with od.init_module(empty_init=True):
        net = Net()
    model = od.auto_model(net, sharding="fsdp", cpu_offload=True)
    assert {_local(p).device.type for p in model.parameters()} == {"cpu"}
    od.backward(model(_tokens(0)).pow(2).mean())
    return {"max_difference": worst}


def check_large_model_arguments() -> None:
    """Bad arguments raise naming the argument, the value and what is allowed."""

    class Bare(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(3))

    with od.init_module(empty_init=True):
        bare = Bare()
        half = torch.nn.Sequential(torch.nn.Linear(2, 2))
    half.append(torch.nn.Linear(2, 2, device="cpu"))
    cases: list[tuple[Callable[[], Any], str]] = [
        (lambda: od.init_module(empty_init=1).__enter__(), r"empty_init has type int \(1\); allowed: a bool"),
        (lambda: od.auto_model(Net(), activation_checkpointing=5), "activation_checkpointing has type int"),
        (
            lambda: od.auto_model(torch.nn.Linear(2, 2), activation_checkpointing=True),
            "activation_checkpointing=True is not allowed; allowed: a choice of blocks that finds at least",
        ),
        (lambda: od.auto_model(Net(), sharding="fsdp", cpu_offload="yes"), "cpu_offload has type str"),
        (lambda: od.auto_model(Net(), cpu_offload=True), r"cpu_offload=True is not allowed"),
        (lambda: od.auto_model(Net(), init_weights="no"), "init_weights has type str"),
        (
            lambda: od.auto_model(Net(), init_weights=False),
            "init_weights=False is not allowed; allowed: True, or False for a model built under od.init_",
        ),
        (
            lambda: od.auto_model(bare),
            r"(?s)model='Bare on the meta device'.*HINT: the model \(Bare\) holds \['weight'\]",
        ),
        (
            lambda: od.auto_model(half),
            r"(?s)model='Sequential, partly on the meta device'.*or none.*'0.weight' is on the meta",
        ),
    ]
    for call, pattern in cases:
        try:
            call()
        except (od.OnedistValueError, od.OnedistTypeError) as e:
            assert re.search(pattern, str(e)), (pattern, str(e))
        else:
            raise AssertionError(f"no error for {pattern}")
