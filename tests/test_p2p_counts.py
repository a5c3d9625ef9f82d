"""The point-to-point check at finalize, on a real store and real call logs, in one process.

The jobs that make sends and receives are in tests/test_unseen.py (real ranks on gloo, shm and
MPI); these pin what the check reads from the store: one key when no rank sent or received
anything, and the same verdict with a stale counter left by an earlier group on the store.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from onedist.backends.recorded.calls import RECV, SEND, CallLog
from onedist.failures.p2p_counts import p2p_verdict, publish_counts


class _CountingStore:
    """A real in-process store that counts the reads it serves."""

    def __init__(self) -> None:
        self.store = dist.HashStore()
        self.gets = 0

    def get(self, key: str) -> bytes:
        self.gets += 1
        return self.store.get(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def _logs(world_size: int, ranks: tuple[int, ...] = (), nonce: int = 7) -> list[CallLog]:
    """Each member's log of one group (the default group's: every rank), in one process."""
    ranks = ranks or tuple(range(world_size))
    return [CallLog(r, ranks, nonce) for r in range(len(ranks))]


def _post(log: CallLog, kind: int, peer: int) -> None:
    """What a recorded group's send or receive does (the user's line is its caller's)."""
    log.record_p2p(kind, peer, [torch.ones(2)], None)


def _publish(store: Any, logs: list[CallLog], *groups: list[CallLog]) -> None:
    """Each rank publishes its default group's log ``logs[rank]`` and its logs of ``groups``."""
    for rank, log in enumerate(logs):
        mine = [g[g_rank] for g in groups for g_rank, r in enumerate(g[0].ranks) if r == rank]
        publish_counts(store, rank, log, mine)


def test_a_job_without_sends_or_receives_reads_no_rank_s_counts() -> None:
    store, logs = _CountingStore(), _logs(8)
    _publish(store, logs)
    assert [p2p_verdict(store, r, 8) for r in range(8)] == [None] * 8
    assert store.gets == 0  # 8 ranks x 8 counts were read before the counter


def test_a_send_never_received_names_both_ranks_and_the_line() -> None:
    store, logs = _CountingStore(), _logs(3)
    _post(logs[1], SEND, 2)
    _publish(store, logs)
    verdicts = [p2p_verdict(store, r, 3) for r in range(3)]
    assert all(v is not None and f"found at finalize by rank {r}" in v for r, v in enumerate(verdicts))
    assert len({str(v).replace(f"by rank {r}", "") for r, v in enumerate(verdicts)}) == 1
    verdict = str(verdicts[2])
    assert "rank 1 sent 1 message(s) to rank 2, which received 0 from it" in verdict
    assert f"{__file__}:" in verdict


def test_a_stale_counter_from_an_earlier_group_only_costs_the_full_read() -> None:
    store = _CountingStore()
    store.add("onedist/p2p-ranks", 5)  # an earlier group's ranks on the same store
    logs = _logs(2)
    _post(logs[0], SEND, 1)
    _post(logs[1], RECV, 0)
    _publish(store, logs)
    assert p2p_verdict(store, 0, 2) is None
    assert store.gets == 2


def test_a_send_on_a_group_the_program_made_is_compared_in_global_ranks() -> None:
    """3 ranks; on the group of ranks 0 and 2, global rank 2 (the group's rank 1) sends to the
    group's rank 0 twice and it receives once: the verdict names global ranks and the group. The
    default group's counts of the same pair are matched and named by nobody."""
    store, world = _CountingStore(), _logs(3)
    pair = _logs(3, ranks=(0, 2), nonce=11)
    _post(world[2], SEND, 0)
    _post(world[0], RECV, 2)
    for _ in range(2):
        _post(pair[1], SEND, 0)
    _post(pair[0], RECV, 1)
    _publish(store, world, pair)
    verdicts = [p2p_verdict(store, r, 3) for r in range(3)]
    assert len({str(v).replace(f"by rank {r}", "") for r, v in enumerate(verdicts)}) == 1
    verdict = str(verdicts[0])
    assert (
        "  on the group of ranks [0, 2]:\n  rank 2 sent 2 message(s) to rank 0, which received 1" in verdict
    )
    assert verdict.count("message(s)") == 1, verdict


def test_a_group_one_member_no_longer_has_is_not_compared() -> None:
    """Rank 0 destroyed the group (its log is gone): rank 1's unreceived send on it is not
    judged against counts rank 0 cannot give any more."""
    store, world = _CountingStore(), _logs(2)
    pair = _logs(2, nonce=11)
    _post(pair[1], SEND, 0)
    publish_counts(store, 0, world[0], [])
    publish_counts(store, 1, world[1], [pair[1]])
    assert p2p_verdict(store, 0, 2) is None
    assert store.gets == 2
