"""The failure watcher never stops in silence.

It samples the store once a second; an error from the store means the job is ending, but any other
error is onedist's own, after which hangs and mismatches are no longer reported on that rank. Seen:
a field added to onedist's call record broke the stall check's unpacking of it, and the watcher
returned without a word (no stall report on Horovod or ONEDIST_RECORD=0 any more).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import onedist as od


def _broken_stall_reports(local_rank: int) -> None:
    from onedist.failures import stall_report

    def sample(self: object) -> None:
        raise TypeError("a mistake of onedist's own")

    stall_report.StallReports.sample = sample  # type: ignore[method-assign]
    time.sleep(3.0)  # the watcher samples once a second
    od.barrier()


def test_a_watcher_stopped_by_an_internal_error_says_so_on_each_rank(capfd):
    od.spawn("gloo", _broken_stall_reports, nproc_per_node=2, start_method="fork")
    err = capfd.readouterr().err
    for rank in (0, 1):
        assert (
            f"onedist: rank {rank}'s failure watcher stopped on an internal error; hangs and mismatched "
            "calls are no longer reported on this rank (please report this): TypeError: a mistake of "
            "onedist's own"
        ) in err


def _late_rank_1(local_rank: int) -> None:
    if od.get_rank() == 1:
        time.sleep(5.0)  # the first report: after 1 s of waiting, sampled once a second, 1.5 s to collect
    od.barrier()  # watcher: late barrier


def test_onedist_s_own_call_on_a_group_without_record_is_reported_with_its_wait(capfd, monkeypatch):
    """torch's plain gloo group (``ONEDIST_RECORD=0``; Horovod and XLA likewise): the stall report
    names onedist's call from its own record of it, and how long it has waited."""
    monkeypatch.setenv("ONEDIST_RECORD", "0")
    monkeypatch.setenv("ONEDIST_STALL_REPORT_S", "1")
    od.spawn("gloo", _late_rank_1, nproc_per_node=2, start_method="fork")
    err = capfd.readouterr().err
    lines = Path(__file__).read_text().splitlines()
    line = next(n for n, text in enumerate(lines, 1) if text.endswith("# watcher: late barrier"))
    assert "rank 0 (pid" in err and f"waits in barrier() (call 1) at {__file__}:{line}, for " in err, err
    assert "rank 1 (pid" in err and "not in a collective on record" in err, err


def test_a_sampled_plain_call_keeps_nothing_of_its_callers_alive():
    """The stall check keeps its last sample of a plain torch.distributed call until the next one,
    a second later: that sample must not hold the call's frame, whose callers' locals (here an
    object; in the flaky checkpoint test, a load's memory-mapped tensors) would live on with it."""
    import gc
    import weakref

    import torch

    from onedist.failures.torch_calls import TorchCall

    class Held:
        pass

    def caller() -> tuple[TorchCall, weakref.ref]:
        held = Held()

        def all_reduce(tensor: torch.Tensor, op: str = "SUM", group: object = None) -> TorchCall:
            return TorchCall(sys._getframe(), group, 7)  # what the watcher takes of torch's frame

        return all_reduce(torch.ones(2)), weakref.ref(held)

    call, held = caller()
    gc.collect()
    assert held() is None
    assert (call.name, call.args, call.seq) == ("all_reduce", {"op": "'SUM'", "tensor": "float32[2]"}, 7)
    assert call.same(call) and "test_watcher.py:" in call.site
