"""XLA checks on 2 PJRT CPU devices, and the test-only workaround that lets their collectives run.

``xmp.spawn`` on the PJRT CPU device (``CPU_NUM_DEVICES=2``) runs one thread per device in one
process, and torch_xla 2.9 is not built for that with collectives (it is for TPU v2/v3's threads).
Three things make it work here; together they are the test-only workaround, not part of onedist
(../shared/recipes/xla_cpu_devices.py has the first):

1. :func:`ordered_sync` replaces ``torch_xla.sync``: device ``i`` launches its ``k``-th graph after
   device ``i - 1`` launched its own. Two threads that compile the same collective graph at the
   same moment get different op ids, and XLA aborts the collective after 10 s ("Termination
   timeout for ... RendezvousKey").
2. After every device launched graph ``k``, each waits for its own device to finish it, so no graph
   is still running on the few runtime threads of this 2-core machine when the next is launched.
3. ``XLA_ENABLE_PARAM_ALIASING=0`` (set before the devices start): with buffer donation, a step
   that updates BatchNorm statistics in place deadlocks the two device threads (seen with the
   digits example: one device runs its step's all_reduce while the other never launches).

It needs every device to launch the same number of graphs, which onedist's collectives do (each
runs ``torch_xla.sync()`` once when it reads a result back); a device that waits more than
``_TURN_WAIT_S`` raises. Every device must also compile the *same* graph around a collective, so
the checks build per-rank values on the CPU and move them (device data), never
``tensor_on_xla + rank`` (a per-rank constant in the graph).

Run as a script, in a process that has not used XLA (``xmp.spawn`` refuses one that has)::

    PJRT_DEVICE=CPU python tests/checks_xla.py ws2 failure   # one JSON line per mode
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.util
import json
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import checks
import checks_loop
import onedist as od

_TURN_WAIT_S = 120.0
_cv = threading.Condition()
_turn = [0]
_tls = threading.local()


def _wait(predicate: Callable[[], bool], what: str) -> None:
    if not _cv.wait_for(predicate, timeout=_TURN_WAIT_S):
        import torch_xla.runtime as xr

        raise RuntimeError(
            f"ordered_sync (test workaround): device {xr.global_ordinal()} waited {_TURN_WAIT_S:.0f} s "
            f"{what}; "
            "the devices launched different numbers of graphs"
        )


def ordered_sync(wait: bool = False, reset_scope: bool = True) -> None:
    """``torch_xla.sync`` with graph launches in device order (device i's k-th after device i-1's)."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    n, r, k = xr.world_size(), xr.global_ordinal(), getattr(_tls, "k", 0)
    with _cv:
        _wait(lambda: _turn[0] == k * n + r, "for its turn to launch a graph")
    try:
        torch_xla._XLAC._xla_step_marker(
            torch_xla._XLAC._xla_get_default_device(), [], wait=False, reset_scope=reset_scope
        )
    finally:
        _tls.k = k + 1
        with _cv:
            _turn[0] += 1
            _cv.notify_all()
    with _cv:
        _wait(lambda: _turn[0] >= (k + 1) * n, "for the other devices' launches")
    device = xm._run_step_closures().device
    torch_xla._XLAC._set_all_reduce_token(device, None)
    # every device launched graph k: let it finish before this device goes on, so that no graph of a
    # device is still running (holding one of the few runtime threads of this 2-core machine) when
    # the next one is launched
    xm.wait_device_ops(torch_xla._XLAC._xla_real_devices([str(device)]))


def install_ordered_sync() -> None:
    """Route ``torch_xla.sync`` (used by onedist, ``xm.mark_step`` and ``MpDeviceLoader``) through it."""
    import torch_xla

    torch_xla.sync = ordered_sync


def _materialize() -> None:
    import torch_xla

    torch_xla.sync()


# ============================================================================ checks (both devices)
def check_queries() -> dict[str, Any]:
    r, w = od.get_rank(), od.get_world_size()
    assert (od.model_name(), od.backend()) == ("xla-dist", "xla-tpu")
    assert od.device() == torch.device("xla", r)  # one thread per device: the thread's own device
    assert od.get_local_rank() == r and od.get_nproc_per_node() == w == od.get_local_size()
    assert od.get_nnodes() == 1 and od.get_node_rank() == 0
    assert od.is_main_process() == (r == 0)
    assert "xla-tpu" in od.available_backends()
    config = od.show_config()
    assert config["rank"] == r and config["device"] == f"xla:{r}"
    return {"rank": r, "world_size": w, "device": str(od.device())}


def check_xla_tensors_results_on_their_device() -> list[float]:
    r, w = od.get_rank(), od.get_world_size()
    dev = od.device()
    x = torch.tensor([float(r), 1.0]).to(dev)
    total = od.all_reduce(x, inplace=False)
    mean = od.all_reduce(x, op="MEAN", inplace=False)
    biggest = od.all_reduce(x, op="MAX", inplace=False)
    same = od.broadcast(x, src=w - 1)
    gathered = od.all_gather(x)
    inplace = torch.tensor([2.0]).to(dev)
    assert od.all_reduce(inplace) is inplace  # in place by default, as in ignite
    for t in (total, mean, biggest, same, gathered):
        assert t.device == dev, t.device
    _materialize()
    s = float(sum(range(w)))
    assert total.cpu().tolist() == [s, float(w)] and mean.cpu().tolist() == [s / w, 1.0]
    assert biggest.cpu().tolist() == [float(w - 1), 1.0] and same.cpu().tolist() == [float(w - 1), 1.0]
    assert gathered.cpu().tolist() == [v for q in range(w) for v in (float(q), 1.0)]
    assert inplace.cpu().tolist() == [2.0 * w] and x.cpu().tolist() == [float(r), 1.0]
    return total.cpu().tolist()


def check_broadcast_bit_exact() -> list[str]:
    r, w = od.get_rank(), od.get_world_size()
    src = w - 1
    special = torch.tensor([-0.0, float("nan"), float("inf"), 1e-45, -2.5])
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        want = special.to(dtype)
        t = want.clone() if r == src else torch.full((5,), 7.0, dtype=dtype)
        out = od.broadcast(t, src=src)
        as_int = bits[want.element_size()]
        assert torch.equal(out.view(as_int), want.view(as_int)), (dtype, out)
    for dtype in (torch.bool, torch.uint8, torch.int64, torch.complex64):
        t = torch.ones(3, dtype=dtype) if r == src else torch.zeros(3, dtype=dtype)
        assert torch.equal(od.broadcast(t, src=src), torch.ones(3, dtype=dtype)), dtype
    got = od.broadcast_object({"cfg": {"lr": 0.1}, "w": torch.arange(4), "s": "x" * 9000} if r == 0 else None)
    assert got["cfg"] == {"lr": 0.1} and torch.equal(got["w"], torch.arange(4)) and len(got["s"]) == 9000
    big = torch.arange(100_000, dtype=torch.float64) if r == 0 else None
    assert torch.equal(od.broadcast(big, safe_mode=True), torch.arange(100_000, dtype=torch.float64))
    return [str(d) for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16)]


def check_all_gather_tensors_and_objects() -> None:
    r, w = od.get_rank(), od.get_world_size()
    out = od.all_gather(torch.full((2, 3), float(r)))
    assert torch.equal(out, torch.cat([torch.full((2, 3), float(q)) for q in range(w)]))
    uneven = torch.arange((r + 1) * 3, dtype=torch.int64).view(r + 1, 3) + 100 * r
    expected = torch.cat([torch.arange((q + 1) * 3).view(q + 1, 3) + 100 * q for q in range(w)])
    assert torch.equal(od.all_gather(uneven), expected)
    assert od.all_gather(torch.ones(0 if r == 0 else 2, 4)).shape == (2 * (w - 1), 4)
    big = torch.full((100_000,), float(r))  # beyond the inline slot
    assert torch.equal(od.all_gather(big), torch.cat([torch.full((100_000,), float(q)) for q in range(w)]))
    mid_uneven = torch.full((20_000 * (r + 1),), r, dtype=torch.int16)  # uneven, < 256 KiB: all_to_all
    assert torch.equal(
        od.all_gather(mid_uneven),
        torch.cat([torch.full((20_000 * (q + 1),), q, dtype=torch.int16) for q in range(w)]),
    )
    assert torch.equal(od.all_gather(torch.tensor(r)), torch.arange(w))
    for dtype in (torch.bool, torch.bfloat16, torch.complex64, torch.uint8, torch.float16):
        v = od.all_gather(torch.ones(2, dtype=dtype))
        assert v.dtype == dtype and v.shape == (2 * w,)
    assert od.all_gather(0.1 * r) == [0.1 * q for q in range(w)]
    assert od.all_gather(2**40 + r) == [2**40 + q for q in range(w)]
    assert od.all_gather(f"rank-{r}-é") == [f"rank-{q}-é" for q in range(w)]
    assert od.all_gather(None) == [None] * w
    assert od.all_gather("x" * (10_000 + r)) == ["x" * (10_000 + q) for q in range(w)]
    nested = {"preds": torch.full((r + 1,), r), "n": r, "name": f"r{r}"}
    assert [d["n"] for d in od.all_gather(nested)] == list(range(w))  # one entry per rank (ignite's)
    out = od.all_gather(nested, nested=True)
    assert torch.equal(out["preds"], torch.cat([torch.full((q + 1,), q) for q in range(w)]))
    assert out["n"].tolist() == list(range(w)) and out["name"] == [f"r{q}" for q in range(w)]


def check_uneven_all_gather_over_256kib() -> None:
    """Blocks of 256 KiB or more, uneven: over all_to_all (other backends use send/recv there)."""
    r, w = od.get_rank(), od.get_world_size()
    out = od.all_gather(torch.full((150_000 * (r + 1),), r, dtype=torch.int16))
    assert torch.equal(
        out, torch.cat([torch.full((150_000 * (q + 1),), q, dtype=torch.int16) for q in range(w)])
    )


def check_groups_world_and_single_rank() -> None:
    r, w = od.get_rank(), od.get_world_size()
    assert od.new_group(list(range(w))) is None
    assert od.all_reduce(5, group=[r]) == 5  # a group of one: no collective, no other device involved
    assert od.new_group([r]) is od.new_group([r])
    assert od.get_local_process_group() is None
    assert od.all_reduce(1, group=od.get_local_process_group()) == w
    od.barrier()
    od.barrier(async_op=True).wait()


def check_p2p_raises_clearly() -> None:
    r, w = od.get_rank(), od.get_world_size()
    with pytest.raises(od.OnedistRuntimeError, match="no point-to-point send/recv"):
        od.send(torch.ones(1), dst=(r + 1) % w)
    with pytest.raises(od.OnedistRuntimeError, match="no point-to-point send/recv"):
        od.recv(torch.ones(1), src=(r + 1) % w)


def check_training_equals_one_process() -> list[float]:
    """auto_model / auto_optim / auto_dataloader on 2 devices == one CPU process on the global batch."""
    r, w = od.get_rank(), od.get_world_size()

    def linear(seed: int) -> torch.nn.Linear:
        # a generator of its own: torch's global RNG is one per process, shared by the device threads
        g = torch.Generator().manual_seed(seed)
        layer = torch.nn.Linear(4, 1)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        return layer

    with pytest.raises(od.OnedistValueError, match=r"sync_bn=True is not allowed; .*no SyncBatchNorm"):
        od.auto_model(torch.nn.BatchNorm1d(2), sync_bn=True)
    model = od.auto_model(linear(100 + r))  # each replica starts differently: auto_model broadcasts rank 0's
    reference = linear(100)
    _materialize()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.device == od.device() and torch.equal(p.detach().cpu(), q.detach()), "auto_model broadcast"
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
    loader = od.auto_dataloader(data, batch_size=8, shuffle=False)  # global batch 8: 4 per device
    assert len(loader) == 2 and loader.sampler.num_replicas == w and loader.sampler.rank == r
    optimizer = od.auto_optim(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert isinstance(optimizer, torch.optim.SGD)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        for x, y in loader:
            assert x.device == od.device() and x.shape == (4, 4)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        for start in (0, 8):
            ref_opt.zero_grad()
            x, y = data[start : start + 8]
            torch.nn.functional.mse_loss(reference(x), y).backward()
            ref_opt.step()
    got = torch.cat([p.detach().cpu().flatten() for p in model.parameters()])
    want = torch.cat([p.detach().flatten() for p in reference.parameters()])
    assert torch.allclose(got, want, atol=1e-5), (got, want)
    state = optimizer.state_dict()
    assert len(state["state"]) == 2 and "momentum_buffer" in state["state"][0]
    optimizer.load_state_dict(copy.deepcopy(state))
    return got.tolist()


_models: dict[int, torch.nn.Module] = {}
_import_lock = threading.Lock()


def _spy_auto_model() -> None:
    """Keep the model the example makes (to compare its parameters across devices afterwards)."""
    if getattr(od.auto_model, "_spy", False):
        return
    real = od.auto_model

    def auto_model(model: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        out = real(model, *args, **kwargs)
        _models[od.get_rank()] = out
        return out

    auto_model._spy = True  # type: ignore[attr-defined]
    od.auto_model = auto_model  # type: ignore[assignment]


def check_digits_example_trains() -> dict[str, Any]:
    """examples/digits.py's training function, 8 steps on both devices: identical parameters after."""
    if importlib.util.find_spec("sklearn") is None:
        return {"skipped": "the digits example needs scikit-learn"}
    path = Path(__file__).resolve().parent.parent / "examples" / "digits.py"
    spec = importlib.util.spec_from_file_location("digits_example", path)
    assert spec is not None and spec.loader is not None
    with _import_lock:  # the device threads would race to import it
        digits = sys.modules.get("digits_example")
        if digits is None:
            digits = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(digits)
            sys.modules["digits_example"] = digits
        _spy_auto_model()
    args = argparse.Namespace(
        seed=0,
        batch_size=64,
        lr=0.01,
        epochs=1,
        max_steps=8,
        sync_bn=False,
        target=0.0,
        nproc_per_node=2,
        checkpoint_dir=None,
        checkpoint_every=0,
        save_final=None,
        accumulate=1,
        precision="32",
        sharding=None,
        uneven=False,
    )
    accuracy = digits.training(od.get_local_rank(), args)
    _materialize()
    params = torch.cat([p.detach().cpu().flatten() for p in _models[od.get_rank()].parameters()])
    return {"accuracy": accuracy, "params_sha256": hashlib.sha256(params.numpy().tobytes()).hexdigest()}


def check_loop_no_sync() -> dict[str, Any]:
    return checks_loop.check_accumulation_equals_the_big_batch(False)


def check_loop_accumulate() -> dict[str, Any]:
    return checks_loop.check_accumulation_equals_the_big_batch(True)


def check_loop_bf16_mixed() -> dict[str, Any]:
    return checks_loop.check_bf16_mixed_runs_the_forward_in_bfloat16()


# checks written once for gloo (tests/checks.py) that run unchanged here: they use CPU values,
# which onedist moves through the XLA devices; those counting primitive calls (count_primitives
# patches the backend object, which the device threads share) are rewritten above
SHARED = (
    "check_all_reduce_ops_and_dtypes",
    "check_all_reduce_layout_device_inplace_async",
    "check_all_reduce_numbers_exact",
    "check_reduce",
    "check_all_gather_object",
    "check_all_gather_mismatch_raises_everywhere",
    "check_broadcast_source_error",
    "check_gather",
    "check_scatter",
    "check_argument_errors",
    "check_one_element_strided_tensors",
)
LOCAL = (
    "check_queries",
    "check_xla_tensors_results_on_their_device",
    "check_broadcast_bit_exact",
    "check_all_gather_tensors_and_objects",
    "check_uneven_all_gather_over_256kib",
    "check_groups_world_and_single_rank",
    "check_p2p_raises_clearly",
    "check_training_equals_one_process",
    "check_loop_no_sync",
    "check_loop_accumulate",
    "check_loop_bf16_mixed",
    "check_digits_example_trains",
)


def run_checks(local_rank: int, names: list[str], tmpdir: str) -> dict[str, Any]:
    """Every check in ``names``, in order, on this device; returns {name: (result, seconds)}."""
    install_ordered_sync()
    out: dict[str, Any] = {}
    for name in names:
        fn = globals().get(name) or getattr(checks, name)
        print(f"rank {od.get_rank()}: {name}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        value = fn(tmpdir) if name == "check_helpers" else fn()
        out[name] = [
            value if isinstance(value, (str, int, float, list, dict, type(None))) else repr(value),
            round(time.perf_counter() - start, 2),
        ]
    return out


def fail_on_rank_1(local_rank: int) -> int:
    install_ordered_sync()
    od.all_reduce(1.0)
    if od.get_rank() == 1:
        raise ValueError("deliberate failure on rank 1")
    od.all_reduce(2.0)  # rank 0 waits here for rank 1, which never comes: onedist ends it
    return od.get_rank()


def main() -> None:
    import os
    import tempfile

    os.environ.setdefault("XLA_ENABLE_PARAM_ALIASING", "0")  # part 3 of the workaround (see above)

    for mode in sys.argv[1:]:
        start = time.perf_counter()
        try:
            if mode == "ws2":
                with tempfile.TemporaryDirectory() as tmp:
                    names = [*LOCAL[:1], *SHARED, "check_helpers", *LOCAL[1:]]
                    result: Any = od.spawn("xla-tpu", run_checks, args=(names, tmp), nproc_per_node=2)
            elif mode == "failure":
                result = od.spawn("xla-tpu", fail_on_rank_1, nproc_per_node=2)
            else:
                raise SystemExit(f"unknown mode {mode!r}")
            report = {"mode": mode, "ok": True, "result": result}
        except od.WorkerFailedError as e:
            report = {
                "mode": mode,
                "ok": False,
                "type": type(e).__name__,
                "message": str(e),
                "rank": e.rank,
                "local_rank": e.local_rank,
            }
        except Exception as e:
            report = {"mode": mode, "ok": False, "type": type(e).__name__, "message": traceback.format_exc()}
        report["seconds"] = round(time.perf_counter() - start, 1)
        print("XLA-RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
