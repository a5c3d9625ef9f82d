"""A model sharded on the CPU: each step's gathered parameters and buffers come from glibc's heap,
warm, rather than fresh from the kernel (onedist.training.cpu_heap)."""

from __future__ import annotations

import platform

import pytest

import checks_cpu_heap
from distpool import DistPool
from onedist import OnedistValueError
from onedist.training import cpu_heap

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")


@glibc
def test_a_sharded_step_on_the_cpu_reuses_warm_memory():
    pool = DistPool(2, "gloo")  # its own: the setting stays raised in these processes
    try:
        out = pool.run(checks_cpu_heap.check_a_sharded_step_reuses_warm_memory, timeout=120)
    finally:
        pool.close()
    for rank in out:  # page faults of a step, per page it gathers (measured: ~3.2 and 0-0.3)
        assert rank["off"] > 2, out  # the gathers, their copies and the gradients, fresh each step
        assert rank["on"] < 1, out


def test_the_setting_is_checked_and_a_users_own_is_left_alone(monkeypatch):
    monkeypatch.setenv("ONEDIST_CPU_HEAP", "yes")
    with pytest.raises(OnedistValueError, match="ONEDIST_CPU_HEAP.*'yes'"):
        cpu_heap.keep_freed_buffers(1 << 30)
    monkeypatch.setenv("ONEDIST_CPU_HEAP", "1")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1048576")
    assert not cpu_heap.keep_freed_buffers(1 << 30)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=1048576")
    assert not cpu_heap.keep_freed_buffers(1 << 30)
