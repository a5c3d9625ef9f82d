"""The training loop's checks (gradient accumulation, mixed precision), run on every rank of any
backend: serially, in gloo/shm pools, under mpirun, horovodrun and on XLA devices.

Each rank builds the same data and model from fixed seeds; ``_micro_batch(i)`` is rank r's slice
of micro-batch i, so the ranks together see exactly the batch one process sees.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

import onedist as od

MICRO = 6  # samples in one micro-batch, over all ranks (divisible by 1, 2 and 3)
K = 4  # micro-batches per window


def _net() -> torch.nn.Module:
    """The same weights on every rank and call, from a generator of its own: XLA's devices are
    threads of one process, and torch's global generator would be drawn from by both at once."""
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.rand(p.shape, generator=g) - 0.5)
    return net


def _data(windows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    n = windows * K * MICRO
    return torch.randn(n, 5, generator=g), torch.randn(n, 2, generator=g)


def _micro_batch(x: torch.Tensor, y: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of micro-batch ``i``."""
    ws, rank = od.get_world_size(), od.get_rank()
    per = MICRO // ws
    start = i * MICRO + rank * per
    return x[start : start + per], y[start : start + per]


def _reference(windows: int) -> list[torch.Tensor]:
    """One process, one SGD step per window on the window's whole batch (K micro-batches)."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = _data(windows)
    big = K * MICRO
    for w in range(windows):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[w * big : (w + 1) * big]), y[w * big : (w + 1) * big]).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@contextlib.contextmanager
def _counted(model: torch.nn.Module, optimizer: Any) -> Iterator[list[int]]:
    """Counts the gradient exchanges the backend makes (DDP's buckets, Horovod's allreduces, XLA's
    gradient all_reduce), in place: ``count[0]``."""
    count = [0]
    backend = od.backend()
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        def hook(state, bucket):  # no annotations: DDP checks them as objects (these would be strings)
            count[0] += 1
            return default_hooks.allreduce_hook(state, bucket)

        model.register_comm_hook(None, hook)
        yield count
    elif backend == "horovod":
        plain = optimizer._allreduce_grad_async

        def allreduce(p: Any) -> Any:
            count[0] += 1
            return plain(p)

        optimizer._allreduce_grad_async = allreduce
        try:
            yield count
        finally:
            del optimizer._allreduce_grad_async
    elif backend == "xla-tpu":  # the device threads share xm: each counts its own calls
        calls = _xla_calls()
        before = getattr(calls, "n", 0)
        count = _Since(calls, before)  # type: ignore[assignment]
        yield count
    else:  # one process: nothing is exchanged
        yield count


_xla_lock = threading.Lock()
_xla_local = threading.local()


def _xla_calls() -> threading.local:
    """This thread's count of ``xm.all_reduce`` calls (the wrapper is installed once per process)."""
    import torch_xla.core.xla_model as xm

    with _xla_lock:
        if not getattr(xm.all_reduce, "_counting", False):
            plain = xm.all_reduce

            def all_reduce(*args: Any, **kwargs: Any) -> Any:
                _xla_local.n = getattr(_xla_local, "n", 0) + 1
                return plain(*args, **kwargs)

            all_reduce._counting = True  # type: ignore[attr-defined]
            xm.all_reduce = all_reduce
    return _xla_local


class _Since:
    """``self[0]``: the calls this thread made since it was made (the list interface of a count)."""

    def __init__(self, calls: threading.local, before: int) -> None:
        self.calls, self.before = calls, before

    def __getitem__(self, i: int) -> int:
        return int(getattr(self.calls, "n", 0)) - self.before


def _train(windows: int, accumulate: bool, count: bool) -> tuple[list[torch.Tensor], list[int]]:
    """Train ``windows`` windows of K micro-batches with onedist; the weights, and the exchanges
    counted per window when ``count``."""
    model = od.auto_model(_net())
    opt = od.auto_optim(torch.optim.SGD(model.parameters(), lr=0.5))
    x, y = _data(windows)
    device = od.device()
    per_window: list[int] = []
    with _counted(model, opt) if count else contextlib.nullcontext([0]) as counter:
        for w in range(windows):
            before = counter[0]
            for i in range(K):
                xb, yb = (t.to(device) for t in _micro_batch(x, y, w * K + i))
                if accumulate:  # counted by onedist
                    with od.accumulate(model, every=K) as window:
                        od.backward(torch.nn.functional.mse_loss(model(xb), yb) / window.size)
                    assert window.sync == (i == K - 1) and window.index == i, window
                else:  # counted by the loop
                    with od.no_sync(model, enabled=i < K - 1):
                        od.backward(torch.nn.functional.mse_loss(model(xb), yb) / K)
            opt.step()
            opt.zero_grad()
            per_window.append(counter[0] - before)
    return [p.detach().cpu().clone() for p in od.unwrap(model).parameters()], per_window


def _one_step_exchanges() -> int:
    """How many exchanges one plain backward pass and step make here (the count of a window)."""
    model = od.auto_model(_net())
    opt = od.auto_optim(torch.optim.SGD(model.parameters(), lr=0.5))
    x, y = _data(1)
    with _counted(model, opt) as counter:
        xb, yb = (t.to(od.device()) for t in _micro_batch(x, y, 0))
        od.backward(torch.nn.functional.mse_loss(model(xb), yb))
        opt.step()
        opt.zero_grad()
    return counter[0]


def check_accumulation_equals_the_big_batch(accumulate: bool) -> dict[str, Any]:
    """K micro-batches accumulated (od.no_sync, or od.accumulate) == one step on the K-fold batch,
    float32, relative difference <= 1e-6; one exchange per window (as many as one plain step)."""
    windows = 3
    reference = _reference(windows)
    weights, _ = _train(windows, accumulate, count=False)  # the default path, no counting hook
    worst = max(float((w - r).norm() / r.norm()) for w, r in zip(weights, reference))
    assert worst <= 1e-6, worst
    _, per_window = _train(windows, accumulate, count=True)
    one_step = _one_step_exchanges()
    assert per_window == [one_step] * windows, (per_window, one_step)
    assert (one_step > 0) == (od.get_world_size() > 1), one_step
    return {"relative_difference": worst, "exchanges_per_window": per_window[0]}


def check_no_sync_and_accumulate_arguments() -> None:
    """Bad arguments raise naming the argument, the value and what is allowed."""
    model = od.auto_model(_net())
    expectations = [
        (lambda: od.no_sync("model"), "no_sync: model has type str"),
        (lambda: od.no_sync(model, enabled=1), "no_sync: enabled has type int"),
        (lambda: od.accumulate(model, every=0), r"accumulate: every=0 is not allowed; allowed: an int >= 1"),
        (lambda: od.accumulate(model, every=2.0), "accumulate: every has type float"),
        (lambda: od.accumulate(model, every=2, loader=iter([1])), "accumulate: loader has type"),
        (lambda: od.accumulate(model, every=2, loader=[]), "loader=.*at least one batch"),
    ]
    import re

    for call, pattern in expectations:
        try:
            with call():
                pass
        except (od.OnedistTypeError, od.OnedistValueError) as e:
            assert re.search(pattern, str(e)), (pattern, str(e))
        else:
            raise AssertionError(f"no error for {pattern}")
    try:
        od.backward(1.0)
    except od.OnedistTypeError as e:
        assert "backward: loss has type float" in str(e), e
    else:
        raise AssertionError("od.backward(1.0) did not raise")


def check_no_sync_looks_through_torch_compile() -> None:
    """od.no_sync on torch.compile's wrapper of the DDP model auto_model returned skips DDP's
    gradient exchange (torch.compile wraps lazily: nothing compiles here)."""
    ddp = od.auto_model(torch.nn.Linear(2, 2))
    assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel), type(ddp)
    compiled = torch.compile(ddp)
    assert od.unwrap(compiled) is od.unwrap(ddp)
    with od.no_sync(compiled):
        assert ddp.require_backward_grad_sync is False
    assert ddp.require_backward_grad_sync is True


def check_bf16_mixed_runs_the_forward_in_bfloat16() -> dict[str, Any]:
    """precision="bf16-mixed": the layers compute in bfloat16, the output, parameters and gradients
    are float32, and training still equals the float32 run closely (same data, 5 steps)."""
    seen: list[torch.dtype] = []
    results = {}
    for precision in ("32", "bf16-mixed"):
        net = _net()
        net[0].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
        model = od.auto_model(net, precision=precision)
        opt = od.auto_optim(torch.optim.SGD(model.parameters(), lr=0.5))
        x, y = _data(1)
        for i in range(5):
            xb, yb = (t.to(od.device()) for t in _micro_batch(x, y, i % K))
            out = model(xb)
            assert out.dtype == torch.float32, out.dtype
            od.backward(torch.nn.functional.mse_loss(out, yb))
            assert all(p.grad.dtype == torch.float32 for p in model.parameters())
            opt.step()
            opt.zero_grad()
        results[precision] = [p.detach().cpu().float() for p in od.unwrap(model).parameters()]
    assert seen[:5] == [torch.float32] * 5 and seen[5:] == [torch.bfloat16] * 5, seen
    diff = max(float((a - b).norm() / b.norm()) for a, b in zip(results["bf16-mixed"], results["32"]))
    assert diff < 0.05, diff  # bfloat16 keeps 8 bits of mantissa: close, not equal
    return {"relative_difference_to_fp32": diff}


def check_precision_arguments() -> None:
    """What the device cannot do raises at auto_model, naming precision, the value and what is allowed."""
    import re

    device = od.device().type
    cases = [
        (
            "16-mixed",
            rf"precision='16-mixed' is not allowed; allowed: '32', 'bf16-mixed'(, 'bf16-true')? on "
            rf"device '{device}'",
        )
    ]
    cases += [("fp8", "precision='fp8' is not allowed"), (16.0, "precision has type float")]
    for value, pattern in cases:
        try:
            od.auto_model(_net(), precision=value)
        except (od.OnedistValueError, od.OnedistTypeError) as e:
            assert re.search(pattern, str(e)), (pattern, str(e))
        else:
            raise AssertionError(f"precision={value!r} did not raise")
