"""The calls on record (onedist.backends.recorded) in one process: what torch sees of onedist's
gloo group, the switch that turns it off, and the call log's numbering, hashes and rollback."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import onedist as od
from launch_env import strip_launcher_vars
from onedist.backends.recorded.calls import RECV, SEND, CallLog, signature
from onedist.backends.recorded.gloo import RecordedGloo


@pytest.fixture(autouse=True)
def _serial_after():
    strip_launcher_vars()
    yield
    od.finalize()


def test_gloo_is_on_record_and_torch_still_calls_it_gloo():
    """``dist.get_backend()`` says "gloo" (ignite's suite checks it), DDP's and every call's
    collectives go through the recording group, numbered in its log."""
    od.initialize("gloo", timeout=30)
    group = dist.distributed_c10d._get_default_group()
    assert isinstance(group, RecordedGloo) and dist.get_backend() == "gloo"
    before = group.calls.seq
    dist.all_reduce(torch.ones(2))
    od.all_reduce(torch.ones(2))
    dist.barrier()
    assert group.calls.seq == before + 3
    assert [e.sig[0] for e in group.calls.recent()[-3:]] == [1, 1, 0]  # all_reduce, all_reduce, barrier
    assert group.calls.recent()[-1].site.endswith(f"test_recorded.py:{_line('dist.barrier()')}")


def test_groups_made_with_dist_new_group_are_on_record_unless_gloo_is_named():
    """dist.new_group and DeviceMesh without a backend give recorded groups (torch still calls
    them gloo); backend="gloo" given by name gives torch's plain group."""
    from torch.distributed.device_mesh import init_device_mesh

    od.initialize("gloo", timeout=30)
    made = dist.new_group([0])
    assert isinstance(made, RecordedGloo) and dist.get_backend(made) == "gloo"
    assert isinstance(init_device_mesh("cpu", (1,)).get_group(), RecordedGloo)
    plain = dist.new_group([0], backend="gloo")
    assert not isinstance(plain, RecordedGloo) and dist.get_backend(plain) == "gloo"
    dist.all_reduce(torch.ones(1), group=made)
    assert made.calls.seq == 1


def test_onedist_record_0_gives_torchs_plain_gloo_group(monkeypatch):
    monkeypatch.setenv("ONEDIST_RECORD", "0")
    od.initialize("gloo", timeout=30)
    group = dist.distributed_c10d._get_default_group()
    assert not isinstance(group, RecordedGloo) and dist.get_backend() == "gloo"


def test_a_call_refused_before_it_starts_is_taken_off_the_record():
    """A ValueError from gloo (a wrong root) leaves the log as it was: a rank that catches it and
    goes on stays numbered like its peers."""
    od.initialize("gloo", timeout=30)
    log = dist.distributed_c10d._get_default_group().calls
    seq, chain, count = log.seq, log.chain, len(log.recent())
    with pytest.raises((ValueError, RuntimeError)):
        dist.broadcast(torch.ones(1), src=5)
    assert (log.seq, log.chain, len(log.recent())) == (seq, chain, count)


def test_the_running_hash_tells_calls_apart_and_agrees_across_processes():
    """Signatures are ints (a string's hash differs per process): two logs of the same calls end
    with the same hash, one call's reduction or size apart differs from there on; sends and
    receives are counted per peer, apart from the collectives."""
    t = [torch.ones(4)]
    a, b = CallLog(0, (0, 1), 1), CallLog(1, (0, 1), 1)
    for log, op in ((a, dist.ReduceOp.SUM), (b, dist.ReduceOp.MAX)):
        log.record(signature("barrier"), None)
        log.record(signature("all_reduce", t, op), None)
    assert a.recent()[0].chain == b.recent()[0].chain and a.chain != b.chain
    assert signature("all_reduce", t, dist.ReduceOp.SUM) == (1, 0, 1, 4, -1)
    a.record_p2p(SEND, 1, t, None)
    a.record_p2p(SEND, 1, t, None)
    a.record_p2p(RECV, 1, t, None)
    assert (a.seq, a.sent, a.received) == (2, {1: 2}, {1: 1})


def _line(text: str) -> int:
    with open(__file__) as f:
        return next(n for n, source in enumerate(f, 1) if source.strip() == text)


def test_a_failed_call_takes_its_group_out_of_the_history_comparison():
    """A call that timed out is complete but failed: its group's calls are no longer published for
    the comparison of completed calls (the timeout's own path explains it; compared, a failed
    all_reduce and the barrier a peer was in read as a mismatch that completed)."""
    from datetime import timedelta
    from threading import Thread

    from onedist.failures.history import HistoryCheck
    from onedist.failures.keys import HISTORY_KEY

    store, groups = dist.HashStore(), [None, None]

    def make(rank: int) -> None:  # two gloo ranks in one process: threads on one store
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("g", store), rank, 2, timedelta(seconds=0.5))

    threads = [Thread(target=make, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    log = CallLog(0, (0, 1), 1)
    check = HistoryCheck(store, 0)
    log.record(signature("barrier"), None)  # completed
    check.sample()
    assert store.check([HISTORY_KEY.format(log.key, 0)])  # published while nothing failed
    store.delete_key(HISTORY_KEY.format(log.key, 0))
    t = [torch.ones(3)]
    work = groups[0].allreduce(t)  # rank 1 never joins: times out after 0.5 s
    log.record(signature("all_reduce", t, dist.ReduceOp.SUM), work)
    with pytest.raises(RuntimeError, match="[Tt]imed out"):
        work.wait()
    log.record(signature("barrier"), None)  # the caller's next call lets go of the failed work
    assert all(w is not work for _, w in log.pending) and not log.failed  # not asked there (_prune)
    assert check.sample() is None and log.failed
    assert not store.check([HISTORY_KEY.format(log.key, 0)])


def test_receives_from_any_source_are_never_waited_on_again():
    """A completed receive is let go of without asking its work again: gloo's wait() of a receive
    waits for one more message each time (an any-source receive, whose peer is -1 like a
    collective's, hung the next call; torch's send_recv_any_source tests on shm)."""
    from datetime import timedelta
    from threading import Thread

    store, groups, got = dist.HashStore(), [None, None], []

    def run(rank: int) -> None:
        group = groups[rank] = RecordedGloo(store, rank, 2, timedelta(seconds=20), (0, 1))
        for i in range(3):
            t = torch.full((2,), float(i))
            if rank == 1:
                group.send([t], 0, 0).wait()
            else:
                work = group.recv_anysource([t], 0)
                work.wait()
                got.append((work._source_rank(), t.tolist()))
        group.barrier().wait()

    threads = [Thread(target=run, args=(r,), daemon=True) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join(timeout=30) for t in threads]
    assert not any(t.is_alive() for t in threads), "hung"
    assert got == [(1, [0.0, 0.0]), (1, [1.0, 1.0]), (1, [2.0, 2.0])], got


@pytest.mark.filterwarnings("ignore::FutureWarning")  # reduce_scatter_tensor: the name older torch has
def test_a_waited_reduce_scatter_is_complete_and_coalesced_ones_run():
    """gloo's reduce-scatter work never says it completed (torch 2.13): once waited on (torch's
    synchronous call, FSDP2's backward) it counts as complete, where it looked pending forever and
    an idle job printed a stall report after FSDP2 steps. Its coalesced form, which has no future
    to collect, runs too."""
    od.initialize("gloo", timeout=30)
    log = dist.distributed_c10d._get_default_group().calls
    out = torch.zeros(3)
    dist.reduce_scatter_tensor(out, torch.ones(3))
    dist.reduce_scatter(out, [torch.ones(3)])
    assert log.waiting() == [] and out.tolist() == [1.0, 1.0, 1.0]
    pending = dist.reduce_scatter_tensor(out, torch.ones(3), async_op=True)
    outs = [torch.zeros(2), torch.zeros(3)]
    with dist._coalescing_manager(async_ops=True) as coalesced:
        for o in outs:
            dist.reduce_scatter_tensor(o, torch.full_like(o, 2.0))
    coalesced.wait()
    assert [o.tolist() for o in outs] == [[2.0, 2.0], [2.0, 2.0, 2.0]]
    assert [e.sig[0] for e in log.waiting()] == [9]  # the asynchronous one, not waited on yet
    pending.wait()
    assert log.waiting() == []


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_reduce_scatter_is_waited_on_once_and_its_output_left_alone_after():
    """gloo's reduce-scatter copies its chunk into the output inside wait(): the failure watcher,
    which asks a completed call whether it failed, must not wait on it again. It did, and copied
    the sum back over FSDP2's gradients after they were divided (3 gloo ranks with clipping trained
    differently from DDP in 1 run of 2)."""
    od.initialize("gloo", timeout=30)
    log = dist.distributed_c10d._get_default_group().calls
    out = torch.zeros(3)
    dist.reduce_scatter_tensor(out, torch.full((3,), 4.0))
    out.div_(2)  # what FSDP2 does with it next
    dist.all_reduce(torch.ones(1))  # lets the reduce-scatter go as the last completed call
    log.waiting()  # the watcher's look: whether the completed calls succeeded
    assert out.tolist() == [2.0, 2.0, 2.0]


@pytest.fixture
def one_cpu():
    """This process bound to one CPU (as ``mpirun`` binds a rank) while the test runs; the threads
    made meanwhile (the group's) stay bound and end with it."""
    import os

    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, allowed)


def test_a_rank_bound_to_one_cpu_yields_it_to_gloo_once_a_call_it_waits_for_has_started(one_cpu, monkeypatch):
    """Bound to one CPU, the caller shares it with gloo's threads, which a wake-up does not
    preempt it for: a call the caller waits for (torch's synchronous function) is followed by a
    yield, an asynchronous one (DDP's buckets, ``async_op=True``) is not. Unbound, no yield."""
    import os

    yields: list[int] = []
    yield_cpu = os.sched_yield
    monkeypatch.setattr(os, "sched_yield", lambda: yields.append(1) or yield_cpu())
    od.initialize("gloo", timeout=30)
    group = dist.distributed_c10d._get_default_group()
    assert group.yields
    dist.all_reduce(torch.ones(1))
    assert len(yields) == 1
    dist.all_reduce(torch.ones(1), async_op=True).wait()
    assert len(yields) == 1
    group.yields = False  # what an unbound rank's group has
    dist.all_reduce(torch.ones(1))
    assert len(yields) == 1


def test_calls_are_numbered_in_the_order_gloo_gets_them_though_recorded_after(one_cpu, monkeypatch):
    """A call is numbered before it starts and recorded after: a second thread's call made while
    the first is between the two (here: in its yield) gets the next number, the order gloo got
    them in, though its entry is written first. The ranks compare the numbers and hashes."""
    import os
    from threading import Thread

    od.initialize("gloo", timeout=30)
    log = dist.distributed_c10d._get_default_group().calls
    first = log.seq + 1
    yield_cpu, threads = os.sched_yield, []

    def another_call_meanwhile() -> None:
        if not threads:  # the first call's yield: a second thread calls now
            threads.append(Thread(target=dist.all_reduce, args=(torch.ones(2),)))
            threads[0].start()
            threads[0].join()
        yield_cpu()

    monkeypatch.setattr(os, "sched_yield", another_call_meanwhile)
    dist.all_reduce(torch.ones(1), group=None)
    by_seq = {e.seq: e for e in log.recent()[-2:]}
    assert [e.seq for e in log.recent()[-2:]] == [first + 1, first]  # the thread's written first
    assert by_seq[first].sig[3] == 1 and by_seq[first + 1].sig[3] == 2  # 1 float, then 2
    line = _line("dist.all_reduce(torch.ones(1), group=None)")
    assert by_seq[first].site.endswith(f"test_recorded.py:{line}")


def test_a_call_started_but_not_yet_written_is_published_once_written():
    """The comparison of completed calls publishes a call once its record is written: a call
    numbered as it started and written just after was, sampled in between, left out of the report
    for good (the report is made again only when the last completed number moves)."""
    import json

    from onedist.failures.history import HistoryCheck
    from onedist.failures.keys import HISTORY_KEY

    store, log = dist.HashStore(), CallLog(0, (0, 1), 1)
    check, key = HistoryCheck(store, 0), HISTORY_KEY.format(log.key, 0)
    log.record(signature("barrier"), None)
    numbered = log.number(signature("barrier"))  # started; its record not written yet
    check.sample()
    assert [item[0] for item in json.loads(store.get(key))["recent"]] == [1]
    log.started(log.begin(signature("barrier"), 0, numbered), None)
    check.sample()
    assert [item[0] for item in json.loads(store.get(key))["recent"]] == [1, 2]
