"""The parts of ignite's exempt Horovod tests that do apply to a replacement, run on their own.

ignite_suite.py copies this file into ignite's ``tests/ignite/distributed/utils/`` (as
``test_onedist_split_horovod.py``) for both runs, so it is compared like ignite's own tests.
``test_idist_all_reduce_hvd`` and ``test_idist_all_gather_hvd`` are exempt as a whole
(ignite_expected.py) because one helper in each asserts ignite's ``NotImplementedError`` for a
grouped call onedist implements; the other helpers they call are ignite's unchanged checks, run
here under the same executor.
"""

import os

import pytest
import torch
from ignite.distributed.utils import has_hvd_support
from tests.ignite.distributed.utils import (
    _test_distrib_all_gather,
    _test_distrib_all_reduce,
    _test_idist_all_gather_tensors_with_shapes,
    _test_idist_all_gather_tensors_with_shapes_group,
)


def _np_device():
    return (4, "cpu") if not torch.cuda.is_available() else (torch.cuda.device_count(), "cuda")


@pytest.mark.parametrize(
    "helper",
    [
        _test_distrib_all_reduce,
        _test_distrib_all_gather,
        _test_idist_all_gather_tensors_with_shapes,
        _test_idist_all_gather_tensors_with_shapes_group,
    ],
    ids=lambda helper: helper.__name__,
)
@pytest.mark.distributed
@pytest.mark.skipif(not has_hvd_support, reason="Skip if no Horovod dist support")
@pytest.mark.skipif("WORLD_SIZE" in os.environ, reason="Skip if launched as multiproc")
def test_ungrouped_part_of_exempt_hvd_test(gloo_hvd_executor, helper):
    np, device = _np_device()
    gloo_hvd_executor(helper, (device,), np=np, do_init=True)
