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
    f"{_UTILS}/test_serial.py::test_no_distrib": _PRIVATE_CLASS.format("_SerialModel")
    + ", and matches ignite's logger name 'ignite.distributed.utils' in show_config's output",
    f"{_UTILS}/test_serial.py::test_sync_no_dist": _PRIVATE_CLASS.format("_SerialModel") + " after sync()",
    f"{_UTILS}/test_native.py::test_sync_as_native_gloo": _PRIVATE_CLASS.format("_NativeDistModel")
    + " after sync()",
    f"{_COMP}/test_native.py::test__native_dist_model_spawn_gloo": "tests ignite's internal "
    "_NativeDistModel.spawn, whose workers install ignite's model with _set_model and assert "
    + _PRIVATE_CLASS.format("_NativeDistModel"),
    # with Horovod installed (as in CI), the same private checks on ignite's Horovod model
    f"{_UTILS}/test_horovod.py::test_sync_as_hvd_inside_gloo_executor": _PRIVATE_CLASS.format(
        "_HorovodDistModel"
    )
    + " after sync()",
    f"{_COMP}/test_horovod.py::test__hvd_dist_model_spawn": "tests ignite's internal "
    "_HorovodDistModel.spawn, whose workers install ignite's model with _set_model",
    # ignite's limits, where onedist does more: the parts of these tests that apply run on their
    # own (ignite_split/split_horovod.py); onedist's grouped calls on Horovod are
    # checked in tests/checks_horovod.py
    f"{_UTILS}/test_horovod.py::test_idist_all_reduce_hvd": "asserts ignite's NotImplementedError "
    "'all_reduce with group for horovod is not implemented'; onedist reduces over Horovod process sets",
    f"{_UTILS}/test_horovod.py::test_idist_all_gather_hvd": "asserts ignite's NotImplementedError "
    "'all_gather with group for horovod is not implemented' for objects; onedist gathers them",
}

KNOWN_FAILURES: dict[str, str] = {}
