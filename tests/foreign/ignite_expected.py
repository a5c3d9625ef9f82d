"""What ignite's own distributed tests may not pass on onedist, each with its reason.

``EXEMPT``: tests that cannot apply to a replacement of ignite.distributed, keyed by test function
(``<file>::<function>``, every pass and parameter): they assert on ignite's private computation
model (``ignite.distributed.utils._model``: its class, its private methods, or ignite's
``_NativeDistModel.spawn``) or on ignite's logger names. onedist answers ``_model``'s public
queries (rank, world size, ...) so that the other tests' sanity checks still run.

``KNOWN_FAILURES``: failures not yet fixed, keyed by ``<pass>::<node id>`` (passes: serial, ws2,
spawn; see ignite_suite.py). Strict: a listed test that passes fails the run, so this list only
shrinks.
"""

from __future__ import annotations

_UTILS = "tests/ignite/distributed/utils"
_COMP = "tests/ignite/distributed/comp_models"
_PRIVATE_CLASS = "asserts isinstance(ignite.distributed.utils._model, {}), ignite's private model class"

EXEMPT: dict[str, str] = {
    f"{_COMP}/test_base.py::test__setup_placeholder": "calls _model._setup_placeholder, a private method "
    "of ignite's computation model",
    f"{_UTILS}/test_serial.py::test_idist__model_methods_no_dist": "calls _model._get_max_length, a private "
    "method of ignite's computation model",
    f"{_UTILS}/test_native.py::test_idist__model_methods_gloo": "calls _model._get_max_length, a private "
    "method of ignite's computation model",
    f"{_UTILS}/test_serial.py::test_no_distrib": _PRIVATE_CLASS.format("_SerialModel")
    + ", and matches ignite's logger name 'ignite.distributed.utils' in show_config's output",
    f"{_UTILS}/test_serial.py::test_sync_no_dist": _PRIVATE_CLASS.format("_SerialModel") + " after sync()",
    f"{_UTILS}/test_native.py::test_sync_as_native_gloo": _PRIVATE_CLASS.format("_NativeDistModel")
    + " after sync()",
    f"{_COMP}/test_native.py::test__native_dist_model_spawn_gloo": "tests ignite's internal "
    "_NativeDistModel.spawn, whose workers install ignite's model with _set_model and assert "
    + _PRIVATE_CLASS.format("_NativeDistModel"),
    # with Horovod installed (as in CI), the same private checks on ignite's Horovod model
    f"{_UTILS}/test_horovod.py::test_idist__model_methods_hvd": "calls _model._get_max_length, a private "
    "method of ignite's computation model",
    f"{_UTILS}/test_horovod.py::test_sync_as_hvd_inside_gloo_executor": _PRIVATE_CLASS.format(
        "_HorovodDistModel"
    )
    + " after sync()",
    f"{_COMP}/test_horovod.py::test__hvd_dist_model_spawn": "tests ignite's internal "
    "_HorovodDistModel.spawn, whose workers install ignite's model with _set_model",
}

# Found on 2026-11-25 once Horovod and SLURM were installed as in CI (the first runs here had
# neither): ignite's Horovod tests under its gloo_hvd_executor (horovod.run, 4 processes).
_HVD = "not fixed yet: ignite's Horovod tests were first run here at the end of the session"
KNOWN_FAILURES: dict[str, str] = {
    f"spawn::{_UTILS}/test_horovod.py::test_idist_all_reduce_hvd": f"{_HVD}; a worker exits 1",
    f"spawn::{_UTILS}/test_horovod.py::test_idist_all_gather_hvd": f"{_HVD}; a worker exits 1",
    f"spawn::{_UTILS}/test_horovod.py::test_idist_new_group_hvd": f"{_HVD}; a worker exits 1",
    f"spawn::{_UTILS}/test_horovod.py::test_hvd_distrib_multi_node_spawn_raise_error": f"{_HVD}; "
    "spawn('horovod', nnodes=2) without master_port raises onedist's ValueError before ignite's",
    f"ws2::{_UTILS}/test_horovod.py::test_hvd_distrib_single_node_single_device": f"{_HVD}; "
    "initialize('horovod') refuses a process that torchrun's variables (WORLD_SIZE=2) describe, where "
    "ignite initialises Horovod as a world of one",
}
