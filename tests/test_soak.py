"""Soak: >= 10,000 mixed collectives on 3 ranks, every result checked, no growth in memory or fds.

The soak runs in a fresh pool of its own (not the shared one): its RSS baseline is then its own,
and its groups are made in a known order (see checks_props.SAFE_GROUP_ORDER).
"""

from __future__ import annotations

import pytest

import checks_soak
from distpool import DistPool

SEED = 20240611
WARMUP = 300  # steps before the first RSS/fd measurement
STEPS = 10_200  # timed steps: > 10,000 collectives (an async pair is two)
MAX_RSS_GROWTH_KB = 30 * 1024  # a leak of ~3 KB per collective would exceed it
MAX_FD_GROWTH = 2


@pytest.mark.slow
def test_soak_mixed_collectives_on_3_ranks():
    pool = DistPool(3)
    try:
        results = pool.run(checks_soak.check_soak, SEED, STEPS, WARMUP, timeout=600)
    finally:
        pool.close()
    lines = []
    for res in results:
        (rss0, rss1), (fd0, fd1) = res["rss_kb"], res["fds"]
        lines.append(
            f"rank {res['rank']}: {res['timed_collectives']} collectives timed ({res['collectives']} in all, "
            f"{res['member_collectives']} as a member) in {res['seconds']:.1f} s = {res['ops_per_s']:.0f}/s; "
            f"RSS {rss0 / 1024:.1f} -> {rss1 / 1024:.1f} MiB ({(rss1 - rss0) / 1024:+.1f}); "
            f"fds {fd0} -> {fd1}; mismatches {res['mismatches']}"
        )
    lines.append(f"by kind (rank 0): {results[0]['by_kind']}")
    report = "\n".join(lines)
    print(report)
    for res in results:
        assert res["mismatches"] == 0, f"rank {res['rank']}:\n" + "\n".join(res["examples"]) + "\n" + report
        assert res["timed_collectives"] >= 10_000, report
        assert res["fds"][1] - res["fds"][0] <= MAX_FD_GROWTH, report
        assert res["rss_kb"][1] - res["rss_kb"][0] < MAX_RSS_GROWTH_KB, report
    assert len({tuple(sorted(r["by_kind"].items())) for r in results}) == 1  # the same ops everywhere


@pytest.mark.slow
def test_bug_overlapping_list_groups_deadlock():
    """od.all_reduce(1, group=[0, 1]) then od.all_reduce(1, group=[0, 2]), on every rank of 3.

    List groups are made lazily by their members only, with use_local_synchronization=True; torch
    names such a group after the number of groups this process made before it, so rank 0 (one
    group made: [0, 1]) and rank 2 (none) disagreed on the name of [0, 2] and waited for each other
    forever. onedist now names them from the ranks (backends/native.py, _new_local_group).
    """
    pool = DistPool(3)  # fresh: its group history must be exactly the one above
    try:
        pool.run(checks_soak.check_overlapping_list_groups, timeout=6)
    finally:
        pool.close()
