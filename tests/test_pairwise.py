"""onedist's gloo group sends large all-gathers and reduce-scatters (FSDP2's parameters and
gradients) as point-to-point exchanges, or reads them out of a peer's memory on one machine:
equal to gloo's own calls, on the record, 2 and 3 ranks, with the kernel refusing the reads."""

from __future__ import annotations

import pytest

import checks_pairwise
from distpool import CheckFailed, DistPool


def test_large_all_gathers_and_reduce_scatters_equal_plain_gloos(multi):
    out = multi(checks_pairwise.check_large_calls_equal_plain_gloos, timeout=120)
    assert all(o["calls"] == 8 for o in out), out


def test_small_and_odd_calls_stay_on_gloos_own(multi):
    multi(checks_pairwise.check_small_and_odd_calls_stay_on_gloos_own)


def test_exchanges_in_flight_are_waited_on_in_any_order(multi):
    multi(checks_pairwise.check_exchanges_in_flight_are_waited_on_in_any_order)


def test_local_ranks_read_each_other_and_fall_back_to_sockets_when_refused():
    """Needs a kernel that lets a process read its sibling's memory (this project's machines do;
    test_shm's probe decides the same for shm's reads)."""
    from test_shm import _kernel_allows_cross_memory_reads

    if not _kernel_allows_cross_memory_reads():
        pytest.skip("this machine's kernel refuses process_vm_readv between its processes")
    pool = DistPool(3, "gloo", rank_env=[{}, {}, {"ONEDIST_CMA": "0"}])  # its own: rank 1 ends filtered
    try:
        out = pool.run(checks_pairwise.check_reads_between_local_ranks_and_their_fallbacks, timeout=120)
    finally:
        pool.close()
    assert [o["readable"] for o in out] == [[1], [0], []], out
    assert [o["refused"] for o in out] == [[], [0], []], out


def test_a_peer_gone_before_an_exchange_fails_it_instead_of_hanging():
    pool = DistPool(2, "gloo")  # its own: rank 1 ends
    with pytest.raises(CheckFailed) as failed:
        pool.run(checks_pairwise.check_a_peer_gone_before_an_exchange_is_an_error, timeout=60)
    pool.close()
    text = str(failed.value)
    assert "rank 1 died" in text, text
    assert "PeerGone: the exchange failed" in text, text  # rank 0 within the pool's 5 s after it


def test_a_group_made_again_ends_its_reads_thread(multi):
    multi(checks_pairwise.check_a_group_made_again_ends_its_reads_thread)
