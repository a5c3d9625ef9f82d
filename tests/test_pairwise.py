"""onedist's gloo group sends large all-gathers and reduce-scatters (FSDP2's parameters and
gradients) as point-to-point exchanges: equal to gloo's own calls, on the record, 2 and 3 ranks."""

from __future__ import annotations

import checks_pairwise


def test_large_all_gathers_and_reduce_scatters_equal_plain_gloos(multi):
    out = multi(checks_pairwise.check_large_calls_equal_plain_gloos, timeout=120)
    assert all(o["calls"] == 8 for o in out), out


def test_small_and_odd_calls_stay_on_gloos_own(multi):
    multi(checks_pairwise.check_small_and_odd_calls_stay_on_gloos_own)
