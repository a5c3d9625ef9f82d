"""API compatibility with ``ignite.distributed`` (pytorch-ignite, a test-only dependency).

onedist promises that ``import onedist as idist`` works for ignite's users. Checked here against the
installed pytorch-ignite:

* every public name of ``ignite.distributed`` exists in onedist, except ``NOT_COPIED`` (with reasons);
* every callable (and ``__init__`` / public methods of the classes) accepts every parameter ignite
  accepts, by name and position, with the same defaults, except ``DIFFERENCES`` (with reasons);
* both modules called on the same inputs give the same results, serially and on 2-3 gloo ranks,
  or differ as documented.

Every entry of ``NOT_COPIED`` and ``DIFFERENCES`` is listed in docs/migration/ignite.md (checked).
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import socket
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import RandomSampler, SequentialSampler

ig = pytest.importorskip("ignite.distributed")

import onedist as od  # noqa: E402
from distpool import DistPool  # noqa: E402

DOC = Path(__file__).resolve().parent.parent / "docs" / "migration" / "ignite.md"

# ignite.distributed names onedist does not copy: name -> reason.
NOT_COPIED: dict[str, str] = {
    "auto": "a submodule of ignite.distributed; its public names (auto_*, DistributedProxySampler) "
    "are onedist's",
    "launcher": "a submodule of ignite.distributed; its public name (Parallel) is onedist's",
    "utils": "a submodule of ignite.distributed; its public names are onedist's",
    "comp_models": "ignite's computation-model classes (internal; onedist's backends are onedist.backends)",
    "native": "ignite's torch.distributed computation model module (internal)",
    "xla": "ignite's XLA computation model module (internal; onedist's is onedist.backends.xla)",
    "registered_computation_models": "a tuple of ignite's internal computation-model classes; "
    "onedist's question for it is available_backends()",
}

# Signature differences: qualified name -> {ignite parameter: reason}.
DIFFERENCES: dict[str, dict[str, str]] = {
    "spawn": {
        "**kwargs": "ignite's native-backend kwargs are named parameters of onedist's spawn (nnodes, "
        "node_rank, master_addr, master_port, init_method, timeout, start_method); torch's join / "
        "daemon and Horovod / XLA kwargs are not accepted",
    },
    "Parallel.__exit__": dict.fromkeys(
        ("*args", "**kwargs", "exc_type", "exc", "tb"),
        "onedist's __exit__ takes the (exc_type, exc, tb) that a with statement passes, not *args / **kwargs",
    ),
}

_METHOD_DUNDERS = ("__init__", "__call__", "__enter__", "__exit__", "__iter__", "__len__")
_P = inspect.Parameter
_POSITIONAL = (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)


# ---------------------------------------------------------------------------- enumeration
def ignite_public_names() -> list[str]:
    """ignite.distributed's ``__all__`` if it has one, else its public submodules, its submodules'
    ``__all__`` and the public attributes defined in ignite.distributed.*."""
    if hasattr(ig, "__all__"):
        return sorted(ig.__all__)
    names: set[str] = set()
    for name in dir(ig):
        if name.startswith("_"):
            continue
        value = getattr(ig, name)
        if isinstance(value, types.ModuleType):
            names.add(name)
            names.update(getattr(value, "__all__", ()))
            continue
        module = getattr(value, "__module__", None)
        if isinstance(module, str) and module.startswith("ignite.distributed"):
            names.add(name)
    return sorted(n for n in names if hasattr(ig, n))


NAMES = ignite_public_names()
COPIED = [n for n in NAMES if n not in NOT_COPIED]


def _methods(cls: type) -> list[str]:
    """The public methods of an ignite class (its bases' included, ``object``'s not)."""
    found: list[str] = []
    for klass in cls.__mro__:
        if klass is object:
            continue
        for name, value in vars(klass).items():
            public = not name.startswith("_") or name in _METHOD_DUNDERS
            if public and callable(value) and name not in found:
                found.append(name)
    return sorted(found)


def _callables() -> list[tuple[str, Any, Any]]:
    """(qualified name, ignite callable, onedist callable or None) for every copied callable."""
    out: list[tuple[str, Any, Any]] = []
    for name in COPIED:
        ig_value, od_value = getattr(ig, name), getattr(od, name, None)
        if isinstance(ig_value, type):
            for method in _methods(ig_value):
                od_method = getattr(od_value, method, None) if od_value is not None else None
                out.append((f"{name}.{method}", getattr(ig_value, method), od_method))
        elif callable(ig_value):
            out.append((name, ig_value, od_value))
    return out


CALLABLES = _callables()


# ---------------------------------------------------------------------------- signature check
def _same_default(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def incompatibilities(ig_fn: Callable[..., Any], od_fn: Callable[..., Any]) -> dict[str, str]:
    """ignite parameter (``*args`` / ``**kwargs`` for the variadic ones) -> what onedist lacks.

    Compatible: every call ignite accepts binds the same way in onedist. onedist may have extra
    parameters if they are optional and come after ignite's positional ones.
    """
    a, b = inspect.signature(ig_fn), inspect.signature(od_fn)
    a_pos = [p for p in a.parameters.values() if p.kind in _POSITIONAL]
    b_pos = [p for p in b.parameters.values() if p.kind in _POSITIONAL]
    b_kinds = {p.kind for p in b.parameters.values()}
    problems: dict[str, str] = {}
    for p in a.parameters.values():
        if p.kind is _P.VAR_POSITIONAL:
            if _P.VAR_POSITIONAL not in b_kinds:
                problems["*args"] = f"ignite takes *{p.name}, onedist takes no extra positional arguments"
            elif len(b_pos) != len(a_pos):
                problems["*args"] = f"onedist's extra positional parameters would take ignite's *{p.name}"
            continue
        if p.kind is _P.VAR_KEYWORD:
            if _P.VAR_KEYWORD not in b_kinds:
                problems["**kwargs"] = f"ignite takes **{p.name}, onedist takes no extra keyword arguments"
            continue
        q = b.parameters.get(p.name)
        if p.kind in _POSITIONAL:
            i = a_pos.index(p)
            if i >= len(b_pos) or (p.kind is _P.POSITIONAL_OR_KEYWORD and b_pos[i].name != p.name):
                got = b_pos[i].name if i < len(b_pos) else "nothing"
                problems[p.name] = f"positional #{i} is {got!r} in onedist"
                continue
            q = b_pos[i]
        if p.kind is not _P.POSITIONAL_ONLY:
            if q is None:
                if _P.VAR_KEYWORD not in b_kinds:
                    problems[p.name] = "missing in onedist"
                continue
            if q.kind is _P.POSITIONAL_ONLY:
                problems[p.name] = "positional-only in onedist"
                continue
        if p.default is not _P.empty and (q is None or not _same_default(p.default, q.default)):
            problems[p.name] = f"default {p.default!r} in ignite, {getattr(q, 'default', None)!r} in onedist"
    ig_names = set(a.parameters)
    for q in b.parameters.values():
        required = q.default is _P.empty and q.kind not in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD)
        if q.name not in ig_names and required:
            problems[q.name] = "required in onedist, unknown to ignite"
    return problems


def test_the_checker_itself():
    def ig_fn(x, op="SUM", group=None, *args, **kwargs): ...

    def ok(x, op="SUM", group=None, *args, flag=False, **kwargs): ...

    def ig_short(x, op="SUM"): ...

    def ok_longer(x, op="SUM", group=None, *, flag=False): ...

    def extra_before_varargs(x, op="SUM", group=None, extra=1, *args, **kwargs): ...

    def renamed(y, op="SUM", group=None, *args, **kwargs): ...

    def other_default(x, op="MEAN", group=None, *args, **kwargs): ...

    def no_var(x, op="SUM", group=None): ...

    def reordered(x, group=None, op="SUM", *args, **kwargs): ...

    def extra_required(x, op="SUM", group=None, *args, must, **kwargs): ...

    assert incompatibilities(ig_fn, ok) == {}
    assert incompatibilities(ig_short, ok_longer) == {}
    assert set(incompatibilities(ig_fn, extra_before_varargs)) == {"*args"}
    assert set(incompatibilities(ig_fn, renamed)) == {"x", "y"}
    assert set(incompatibilities(ig_fn, other_default)) == {"op"}
    assert set(incompatibilities(ig_fn, no_var)) == {"*args", "**kwargs"}
    assert set(incompatibilities(ig_fn, reordered)) == {"op", "group"}
    assert set(incompatibilities(ig_fn, extra_required)) == {"must"}


# ---------------------------------------------------------------------------- names
def test_enumeration_finds_ignites_api():
    # guards against an enumeration that silently finds nothing
    for name in ("all_reduce", "all_gather", "broadcast", "Parallel", "spawn", "auto_model", "get_rank"):
        assert name in NAMES


@pytest.mark.parametrize("name", NAMES)
def test_public_name_exists(name):
    if name in NOT_COPIED:
        assert NOT_COPIED[name] and f"`{name}`" in DOC.read_text(), name
        assert not hasattr(od, name) or isinstance(getattr(od, name), types.ModuleType)
        return
    assert hasattr(od, name), f"onedist lacks ignite.distributed.{name}"
    assert name in od.__all__
    ig_value, od_value = getattr(ig, name), getattr(od, name)
    if isinstance(ig_value, type):
        assert isinstance(od_value, type), name
    elif callable(ig_value):
        assert callable(od_value) and not isinstance(od_value, type), name
    else:  # the has_*_support flags
        assert type(od_value) is type(ig_value) and od_value == ig_value, (name, od_value, ig_value)


def test_allow_lists_are_current_and_documented():
    doc = DOC.read_text()
    assert set(NOT_COPIED) <= set(NAMES), set(NOT_COPIED) - set(NAMES)
    qualified = {q for q, _, _ in CALLABLES}
    assert set(DIFFERENCES) <= qualified, set(DIFFERENCES) - qualified
    for name, reason in NOT_COPIED.items():
        assert reason and f"`{name}`" in doc, name
    for name, params in DIFFERENCES.items():
        for param, reason in params.items():
            lines = [line for line in doc.splitlines() if f"`{name}" in line and param in line]
            assert reason and lines, f"docs/migration/ignite.md does not list {name} {param}"


# ---------------------------------------------------------------------------- signatures
@pytest.mark.parametrize(("qualname", "ig_fn", "od_fn"), CALLABLES, ids=[c[0] for c in CALLABLES])
def test_signature_compatible(qualname, ig_fn, od_fn):
    assert od_fn is not None, f"onedist lacks {qualname}"
    problems = incompatibilities(ig_fn, od_fn)
    expected = DIFFERENCES.get(qualname, {})
    unexpected = {k: v for k, v in problems.items() if k not in expected}
    assert not unexpected, f"{qualname}: {unexpected}\n  ignite:  {inspect.signature(ig_fn)}\n" + (
        f"  onedist: {inspect.signature(od_fn)}"
    )
    stale = set(expected) - set(problems)
    assert not stale, (
        f"{qualname}: DIFFERENCES lists {stale}, which now match: remove them here and in the docs"
    )


def test_spawn_and_parallel_take_ignites_native_kwargs():
    # ignite documents these kwargs of spawn for native backends; onedist names them
    params = inspect.signature(od.spawn).parameters
    for name in (
        "nnodes",
        "node_rank",
        "master_addr",
        "master_port",
        "init_method",
        "timeout",
        "start_method",
    ):
        assert name in params, name
    assert params["nnodes"].default == 1 and params["node_rank"].default == 0
    # Parallel passes timeout / start_method on (constructing it starts nothing)
    p = od.Parallel(backend="gloo", nproc_per_node=2, start_method="fork", timeout=30)
    assert p.spawn_kwargs == {"start_method": "fork", "timeout": 30}


# ---------------------------------------------------------------------------- serial smoke
@pytest.fixture
def serial():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("a process group is active in this process")
    ig.sync()  # ignite's module state follows the current (absent) context
    od.sync()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ignite's own deprecation / heuristic warnings
        yield
    ig.sync()


def test_serial_queries_equal(serial):
    for name in (
        "get_rank",
        "get_world_size",
        "get_local_rank",
        "get_nproc_per_node",
        "get_nnodes",
        "get_node_rank",
        "backend",
        "device",
        "model_name",
        "hostname",
    ):
        assert getattr(od, name)() == getattr(ig, name)(), name
    # documented: onedist lists every backend ignite lists, and its own: shm, and mpi over mpi4py
    # (ignite lists mpi only when torch was compiled against MPI)
    ours, theirs = od.available_backends(), ig.available_backends()
    assert set(theirs) <= set(ours) and set(ours) - set(theirs) <= {"shm", "mpi"}, (ours, theirs)


def test_serial_all_reduce(serial):
    for value in (1.5, 3, 0.1):
        assert od.all_reduce(value) == ig.all_reduce(value)
        assert type(od.all_reduce(value)) is type(ig.all_reduce(value))
    assert od.all_reduce(2.0, op="MAX") == ig.all_reduce(2.0, op="MAX")
    t = torch.tensor([1.0, 2.0])
    assert torch.equal(od.all_reduce(t), ig.all_reduce(t.clone()))
    # both reduce a tensor in place and return it; onedist's inplace=False leaves it alone
    assert ig.all_reduce(t) is t and od.all_reduce(t) is t
    assert od.all_reduce(t, inplace=False) is not t


def test_serial_all_gather(serial):
    t = torch.tensor([1.0, 2.0])
    assert torch.equal(od.all_gather(t), ig.all_gather(t))
    assert od.all_gather("ab") == ig.all_gather("ab") == ["ab"]
    assert od.all_gather(1.5) == ig.all_gather(1.5) == [1.5]
    assert od.all_gather(3) == ig.all_gather(3) == [3]
    d = {"a": 1, "b": "x"}
    assert od.all_gather(d) == ig.all_gather(d) == od.all_gather_object(d) == [d]
    # onedist's extra: nested=True gathers leaf by leaf
    assert od.all_gather(d, nested=True)["b"] == ["x"]


def test_serial_all_gather_tensors_with_shapes(serial):
    t = torch.arange(6.0).reshape(2, 3)
    a = od.all_gather_tensors_with_shapes(t, [[2, 3]])
    b = ig.all_gather_tensors_with_shapes(t, [[2, 3]])
    assert len(a) == len(b) == 1 and torch.equal(a[0], b[0])
    assert od.all_gather_tensors_with_shapes(t, [[2, 3]], group=[0])[0].shape == (2, 3)


def test_serial_broadcast(serial):
    for value in (1.5, 3, "text", Path("/tmp/x"), torch.tensor([1, 2])):
        a, b = od.broadcast(value), ig.broadcast(value, src=0)
        assert type(a) is type(b)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    assert od.broadcast(0.1, safe_mode=True) == ig.broadcast(0.1, safe_mode=True)
    for m in (od, ig):  # None on the source: both raise
        with pytest.raises(ValueError):
            m.broadcast(None, safe_mode=True)
    # documented: serially, onedist checks the kind as it does distributed (ignite returns anything)
    assert ig.broadcast([1, 2]) == [1, 2]
    with pytest.raises(TypeError, match="Unhandled input type"):
        od.broadcast([1, 2])
    assert od.broadcast_object([1, 2]) == [1, 2]  # onedist's name for any picklable value


def test_serial_barrier_sync_groups(serial):
    assert od.barrier() is None and ig.barrier() is None
    assert od.sync() is None and ig.sync() is None
    for m in (od, ig):
        assert m.all_reduce(2, group=m.new_group([0])) == 2
        assert m.new_group([0]) == [0] and m.new_group([]) == []  # serially: the ranks themselves


def test_serial_one_rank_helpers(serial):
    for m in (od, ig):
        calls: list[int] = []

        @m.one_rank_only()
        def f(calls=calls):
            calls.append(1)
            return 7

        @m.one_rank_only(rank=0, with_barrier=True)
        def g():
            return 8

        assert f() == 7 and g() == 8 and calls == [1]
        with m.one_rank_first():
            calls.append(2)
        with m.one_rank_first(rank=0, local=True):
            calls.append(3)
        assert calls == [1, 2, 3], m


def test_serial_show_config(serial):
    assert ig.show_config() is None  # documented: onedist also returns the configuration
    config = od.show_config()
    assert config["world_size"] == ig.get_world_size() and config["backend"] == ig.backend()


def test_serial_show_config_logs_under_onedist_config(serial):
    """onedist's show_config logs under the logger ``onedist.config`` (ignite's under its own)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("onedist.config")
    logger.addHandler(handler)
    try:
        od.show_config()
    finally:
        logger.removeHandler(handler)
    lines = [r.getMessage() for r in records if r.name == "onedist.config"]
    assert "distributed configuration: serial" in lines and "world size: 1" in lines, lines


def test_error_messages_go_on_with_a_hint(serial):
    """After ignite's words and what was given and allowed, a HINT: with the fix, where there is one."""
    with pytest.raises(TypeError) as caught:
        od.broadcast([1, 2])
    assert re.search(
        r"Unhandled input type: tensor has type list \(\[1, 2\]\); allowed: .*\nHINT: od\.broadcast_object",
        str(caught.value),
    )
    with pytest.raises(ValueError) as caught:
        od.Parallel(backend="abc")
    assert re.search(
        r"Unknown backend 'abc'\. Available backends: .*\n  given: backend='abc'; allowed: .*\n"
        r"HINT: `onedist info`",
        str(caught.value),
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"batch_size": 8},
        {"batch_size": 7, "shuffle": False},
        {"batch_size": 8, "shuffle": True},
        {"batch_size": 8, "num_workers": 2},
        {"batch_size": 4, "drop_last": True},
    ],
    ids=str,
)
def test_serial_auto_dataloader(serial, kwargs):
    data = list(range(10))
    a, b = od.auto_dataloader(data, **kwargs), ig.auto_dataloader(data, **kwargs)
    assert (a.batch_size, a.num_workers, a.drop_last) == (b.batch_size, b.num_workers, b.drop_last)
    assert type(a.sampler) is type(b.sampler)
    if not kwargs.get("shuffle"):
        a.num_workers = b.num_workers = 0
        assert [x.tolist() for x in a] == [x.tolist() for x in b]


def test_serial_auto_model_and_optim(serial):
    model = torch.nn.Linear(2, 2)
    assert od.auto_model(model) is model and ig.auto_model(model) is model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert od.auto_optim(opt) is opt and ig.auto_optim(opt) is opt


@pytest.mark.parametrize(("n", "replicas", "rank"), [(5, 1, 0), (5, 2, 0), (5, 2, 1), (7, 3, 2), (4, 4, 3)])
def test_proxy_sampler_same_shares(serial, n, replicas, rank):
    a = od.DistributedProxySampler(SequentialSampler(range(n)), num_replicas=replicas, rank=rank)
    b = ig.DistributedProxySampler(SequentialSampler(range(n)), num_replicas=replicas, rank=rank)
    assert len(a) == len(b) and list(a) == list(b)
    a.set_epoch(2)
    b.set_epoch(2)
    assert list(a) == list(b)
    assert (a.num_replicas, a.rank, a.num_samples, a.total_size) == (
        b.num_replicas,
        b.rank,
        b.num_samples,
        b.total_size,
    )


def test_proxy_sampler_documented_differences(serial):
    # onedist's needs no process group when serial; ignite's asks torch for one
    assert list(od.DistributedProxySampler(SequentialSampler(range(3)))) == [0, 1, 2]
    with pytest.raises(ValueError):
        ig.DistributedProxySampler(SequentialSampler(range(3)))
    # not a torch DistributedSampler subclass (ignite's is)
    s = od.DistributedProxySampler(SequentialSampler(range(3)), num_replicas=1, rank=0)
    assert not isinstance(s, torch.utils.data.DistributedSampler)


def _share_drawn_under(seed: int, n: int, replicas: int, rank: int) -> list[int]:
    """Rank ``rank``'s share of a RandomSampler over ``n`` drawn under ``seed``, padded with the
    first items of the same draw."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drawn = list(RandomSampler(range(n)))
    total = -(-n // replicas) * replicas
    return (drawn + drawn[: total - n])[rank:total:replicas]


def test_proxy_sampler_draws_under_seed_plus_epoch_and_leaves_the_global_rng(serial):
    """Each pass draws the wrapped sampler under seed ``seed + epoch``, the global RNG untouched;
    the epoch advances by itself on each pass and set_epoch still wins. ignite's sampler calls
    torch.manual_seed(epoch) on the global RNG."""
    s = od.DistributedProxySampler(RandomSampler(range(5)), num_replicas=2, rank=1, seed=7)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    first, second = list(s), list(s)
    assert torch.equal(torch.get_rng_state(), before)
    assert first == _share_drawn_under(7, 5, 2, 1) and second == _share_drawn_under(8, 5, 2, 1)
    assert s.epoch == 1 and first != second
    s.set_epoch(5)
    assert list(s) == _share_drawn_under(12, 5, 2, 1)
    list(ig.DistributedProxySampler(RandomSampler(range(5)), num_replicas=2, rank=1))
    assert not torch.equal(torch.get_rng_state(), before)


def _master_port(local_rank: int) -> tuple[int, int]:
    return int(os.environ["MASTER_PORT"]), od.all_reduce(1)


def test_spawn_without_master_port_picks_a_free_port(monkeypatch):
    """ignite's spawn takes $MASTER_PORT or 2222; onedist's picks a free port: here $MASTER_PORT
    names a port this test holds, and the workers meet on another one, not 2222."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        monkeypatch.setenv("MASTER_PORT", str(port))
        out = od.spawn("gloo", _master_port, nproc_per_node=2, start_method="fork")
    assert out[0] == out[1] and out[0][1] == 2 and out[0][0] not in (port, 2222), (out, port)


def test_serial_parallel_run(serial):
    def fn(local_rank, x, y=0):
        calls.append((local_rank, x, y))
        return x + y

    calls: list[Any] = []
    with ig.Parallel(backend=None) as p:
        ig_result = p.run(fn, 2, y=3)
    with od.Parallel(backend=None) as p:
        od_result = p.run(fn, 2, y=3)
    with od.Parallel(backend=None) as p:
        od_kw = p.run(func=fn, x=1)  # ignite's parameter name works by keyword too
    assert calls == [(0, 2, 3), (0, 2, 3), (0, 1, 0)]
    assert ig_result is None and od_result == 5 and od_kw == 1  # documented: run returns fn's value


# ---------------------------------------------------------------------------- on 2-3 gloo ranks
def check_collectives_match() -> dict[str, Any]:
    """Runs on every rank of a onedist pool: the same calls through both modules."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ignite's local-rank heuristic warning
        return _collectives_match()


def _collectives_match() -> dict[str, Any]:
    r, ws = od.get_rank(), od.get_world_size()
    for name in ("get_rank", "get_world_size", "get_local_rank", "get_nproc_per_node", "get_nnodes"):
        assert getattr(od, name)() == getattr(ig, name)(), name
    assert (od.backend(), od.model_name(), od.device()) == (ig.backend(), ig.model_name(), ig.device())

    for m in (od, ig):
        assert m.all_reduce(1.5 + r) == 1.5 * ws + ws * (ws - 1) / 2
    assert od.all_reduce(3 + r) == ig.all_reduce(3 + r)
    assert od.all_reduce(2.0 + r, op="MAX") == ig.all_reduce(2.0 + r, op="MAX")
    assert od.all_reduce(0.1 * (r + 1), group=[0, 1]) == ig.all_reduce(0.1 * (r + 1), group=[0, 1])
    t = torch.tensor([1.0 + r, 2.0])
    a, b = t.clone(), t.clone()
    assert od.all_reduce(a) is a and ig.all_reduce(b) is b and torch.equal(a, b)  # both in place

    assert torch.equal(od.all_gather(t), ig.all_gather(t))
    assert torch.equal(od.all_gather(torch.tensor(float(r))), ig.all_gather(torch.tensor(float(r))))
    assert od.all_gather("ab" * (r + 1)) == ig.all_gather("ab" * (r + 1))
    assert od.all_gather(1.5 + r) == ig.all_gather(1.5 + r)
    assert od.all_gather(3 + r) == ig.all_gather(3 + r)
    assert od.all_gather({"a": r}) == ig.all_gather({"a": r}) == od.all_gather_object({"a": r})

    parts = [
        m.all_gather_tensors_with_shapes(torch.full((r + 1, 2), float(r)), [[k + 1, 2] for k in range(ws)])
        for m in (od, ig)
    ]
    assert all(torch.equal(a, b) for a, b in zip(*parts))
    sub = [
        m.all_gather_tensors_with_shapes(torch.full((r + 1, 2), float(r)), [[1, 2], [2, 2]], group=[0, 1])
        for m in (od, ig)
    ]
    assert len(sub[0]) == len(sub[1]) and all(torch.equal(a, b) for a, b in zip(*sub))
    # onedist: a rank whose tensor does not match ``shapes`` makes every rank raise (none hangs)
    with pytest.raises(od.CollectiveMismatchError, match="not what the ranks sent"):
        od.all_gather_tensors_with_shapes(torch.ones(r + 1 + (r == 1), 2), [[k + 1, 2] for k in range(ws)])

    assert od.broadcast("xy" if r == 0 else "z") == ig.broadcast("xy" if r == 0 else "z")
    assert torch.equal(od.broadcast(t, src=1), ig.broadcast(t, src=1))
    assert od.broadcast("hi" if r == 0 else None, safe_mode=True) == ig.broadcast(
        "hi" if r == 0 else None, safe_mode=True
    )
    # documented: ignite sends numbers as float32 (0.1 comes back rounded, 3 as 3.0); onedist exactly
    assert od.broadcast(0.1) == 0.1 and ig.broadcast(0.1) == float(torch.tensor(0.1, dtype=torch.float32))
    assert od.broadcast(3) == 3 and type(od.broadcast(3)) is int and type(ig.broadcast(3)) is float

    assert od.barrier() is None and ig.barrier() is None
    results = []
    for m in (od, ig):

        @m.one_rank_only(rank=1, with_barrier=True)
        def f():
            return r

        results.append(f())
        with m.one_rank_first(rank=1):
            results.append(r)
    assert results[:2] == results[2:]
    return {"rank": r}


def check_auto_match() -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _auto_match()


def _auto_match() -> dict[str, Any]:
    data = list(range(10))
    for kwargs in ({"batch_size": 8, "shuffle": False}, {"batch_size": 8, "num_workers": 4, "shuffle": True}):
        a, b = od.auto_dataloader(data, **kwargs), ig.auto_dataloader(data, **kwargs)
        assert (a.batch_size, a.num_workers) == (b.batch_size, b.num_workers), kwargs
        assert isinstance(a.sampler, torch.utils.data.DistributedSampler)
        assert isinstance(b.sampler, torch.utils.data.DistributedSampler)
        assert a.sampler.shuffle == b.sampler.shuffle
        if not kwargs["shuffle"]:
            a.num_workers = b.num_workers = 0
            assert [x.tolist() for x in a] == [x.tolist() for x in b]
    # both shuffle unless told not to
    a, b = od.auto_dataloader(data, batch_size=8), ig.auto_dataloader(data, batch_size=8)
    assert a.sampler.shuffle is True and b.sampler.shuffle is True
    # documented: a global batch size the world size does not divide warns (ignite floors silently)
    ws = od.get_world_size()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = od.auto_dataloader(data, batch_size=ws * 3 + 1, shuffle=False)
    assert a.batch_size == ig.auto_dataloader(data, batch_size=ws * 3 + 1, shuffle=False).batch_size == 3
    assert any("batch_size" in str(w.message) for w in caught)
    # a global batch size below the world size is kept per rank by both; onedist says so
    assert ig.auto_dataloader(data, batch_size=1).batch_size == 1
    with pytest.warns(UserWarning, match="smaller than the world size"):
        assert od.auto_dataloader(data, batch_size=1).batch_size == 1

    model = torch.nn.Linear(2, 2)
    assert type(od.auto_model(model)) is type(ig.auto_model(torch.nn.Linear(2, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert od.auto_optim(opt) is opt and ig.auto_optim(opt) is opt

    n = 5
    a = od.DistributedProxySampler(SequentialSampler(range(n)))
    b = ig.DistributedProxySampler(SequentialSampler(range(n)))
    assert (len(a), list(a), a.num_replicas, a.rank) == (len(b), list(b), b.num_replicas, b.rank)
    return {"rank": od.get_rank()}


def check_documented_differences() -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _documented_differences()


def _documented_differences() -> dict[str, Any]:
    r, ws = od.get_rank(), od.get_world_size()
    # ignite's all_reduce takes no dict (every rank raises before communicating); onedist's does
    metrics = {"loss": torch.tensor(1.0 + r), "n": 2}
    with pytest.raises(TypeError, match="Unhandled input type <class 'dict'>"):
        ig.all_reduce(dict(metrics))
    reduced = od.all_reduce(dict(metrics))
    assert torch.equal(reduced["loss"], torch.tensor(ws + ws * (ws - 1) / 2)) and reduced["n"] == 2 * ws

    # sync_bn=True on CPU raises in both (torch's SyncBatchNorm is CUDA only); onedist's names its own
    def net() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))

    with pytest.raises(ValueError, match="SyncBatchNorm layers only work with GPU modules"):
        ig.auto_model(net(), sync_bn=True)
    with pytest.raises(
        ValueError,
        match=r"(?s)SyncBatchNorm layers only work with GPU modules.*"
        r"HINT: model = od\.convert_sync_batchnorm",
    ):
        od.auto_model(net(), sync_bn=True)

    # safe_mode=True: a non-source rank's value is ignored, whatever its type
    for placeholder in (None, [1, 2], object(), torch.ones(3), 7, "other"):
        assert od.broadcast("from 0" if r == 0 else placeholder, safe_mode=True) == "from 0", placeholder
    got = od.broadcast(torch.arange(3.0) if r == 0 else {"not": "a tensor"}, safe_mode=True)
    assert torch.equal(got, torch.arange(3.0))
    return {"rank": r}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"ws{w}")
def ignite_pool(request: pytest.FixtureRequest):
    """A gloo pool of this module's own: ignite keeps module state (its model, a helper group) in
    each worker once used, which the pools shared with other tests should not inherit."""
    pool = DistPool(request.param)
    yield pool
    pool.close()


def test_distributed_collectives_match(ignite_pool):
    ranks = [o["rank"] for o in ignite_pool.run(check_collectives_match)]
    assert ranks == list(range(ignite_pool.world_size))


def test_distributed_auto_match(ignite_pool):
    ranks = [o["rank"] for o in ignite_pool.run(check_auto_match)]
    assert ranks == list(range(ignite_pool.world_size))


def test_distributed_documented_differences(ignite_pool):
    ranks = [o["rank"] for o in ignite_pool.run(check_documented_differences)]
    assert ranks == list(range(ignite_pool.world_size))
