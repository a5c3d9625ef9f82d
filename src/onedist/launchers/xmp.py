"""``spawn("xla-tpu", fn, nproc_per_node=N)``: N XLA replicas started through ``xmp.spawn``.

``nproc_per_node=1`` runs ``fn`` in this process, on its one XLA device. More needs as many XLA
devices on this host: on the PJRT CPU device onedist sets ``CPU_NUM_DEVICES`` for the run and
``xmp.spawn`` starts one process with a thread per device; on a TPU host the number is the host's
device count. Each replica writes its result or its failure to a private folder, which the
parent reads (the failing rank's traceback first).
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from ..backends import xla as xla_backend
from ..errors import OnedistRuntimeError, WorkerFailedError
from .checks import check_picklable
from .launcher import SingleAttemptLauncher
from .report import Failure, failure_report, reported_failure_error
from .spec import LaunchSpec, check_xla_device_count
from .worker import call_worker_fn, exit_failed, write_failure_report, write_result

__all__ = ["XmpLauncher"]


class XmpLauncher(SingleAttemptLauncher):
    """``fn(local_rank, *args, **kwargs)`` on ``nproc_per_node`` XLA devices via ``xmp.spawn``.

    ``nproc_per_node=1`` runs ``fn`` here, on this process's one device. More needs as many
    XLA devices on this host: on the PJRT CPU device onedist sets ``CPU_NUM_DEVICES`` to
    ``nproc_per_node`` for the run (unless set) and ``xmp.spawn`` starts one process with a
    thread per device; on a TPU host the number must be the host's device count. A failing
    worker ends the run within seconds and :class:`~onedist.WorkerFailedError` is raised with
    its rank and traceback first. Not restarted: restart the whole job from outside.
    """

    name = "onedist.spawn (xmp.spawn)"

    def run(self) -> list[Any]:
        return _run(self.spec)


def _run(spec: LaunchSpec) -> list[Any]:
    """The replicas' results in rank order, or their failure raised."""
    fn, args, kwargs = spec.fn, spec.args, spec.kwargs
    nproc_per_node, start_method = spec.nproc_per_node, spec.start_method
    xla_backend.import_torch_xla("spawn")
    import torch_xla
    import torch_xla.runtime as xr

    if nproc_per_node == 1:
        return [_run_here(fn, args, kwargs)]
    if start_method != "fork":
        check_picklable(fn, f"xmp.spawn with start_method={start_method!r}")
    env_set = xla_backend.device_count_env(nproc_per_node, str(xr.device_type()))
    report_dir = None
    try:
        if torch_xla._XLAC._xla_runtime_is_initialized():
            raise OnedistRuntimeError(
                f"onedist.spawn: nproc_per_node={nproc_per_node} needs xmp.spawn, which torch_xla allows "
                "only in a process that has not used XLA yet, and this one has (an XLA tensor, "
                "initialize('xla-tpu') or a spawn with nproc_per_node=1 ran before).\n"
                "HINT: call onedist.spawn / Parallel before anything touches the XLA device (first "
                'thing under `if __name__ == "__main__":`)'
            )
        import torch_xla.distributed.xla_multiprocessing as xmp

        report_dir = tempfile.mkdtemp(prefix="onedist-xla-")
        try:
            xmp.spawn(
                _worker,
                args=(fn, args, kwargs, report_dir, nproc_per_node),
                nprocs=None,
                start_method=start_method,
            )
        except Exception as e:  # a worker's failure, or BrokenProcessPool when XLA aborted it
            raise _launch_failure(report_dir, nproc_per_node, e) from None
        return _results(report_dir, nproc_per_node)
    finally:
        for name, previous in env_set.items():
            if previous is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = previous
        if report_dir is not None:
            shutil.rmtree(report_dir, ignore_errors=True)


def _run_here(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``nproc_per_node=1``: ``fn(0, ...)`` in this process, on its one XLA device (xmp.spawn(nprocs=1))."""
    import torch_xla.distributed.xla_multiprocessing as xmp

    out: dict[str, Any] = {}

    def body(index: int) -> None:
        with xla_backend.launched_worker():
            out["result"] = call_worker_fn(fn, 0, args, kwargs)

    try:
        xmp.spawn(body, nprocs=1)
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            raise
        failure = Failure(
            0,
            0,
            os.getpid(),
            time.time(),
            exc_type=type(e).__name__,
            message=str(e),
            traceback=traceback.format_exc(),
        )
        _, message = failure_report([failure])
        raise WorkerFailedError(message, 0, 0, None, failure.traceback) from e
    return out.get("result")


def _worker(
    index: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    report_dir: str,
    nproc: int,
) -> None:
    """What xmp.spawn runs on each device: ``fn(local_rank, ...)``, its result or failure to a file.

    A failure ends this worker's whole process at once (``os._exit``): the other devices' threads
    may be waiting in a collective that will never complete, and the parent then reports the
    failure from its file.
    """
    import torch_xla.runtime as xr

    with xla_backend.launched_worker():
        rank, local_rank = int(xr.global_ordinal()), int(xr.local_ordinal())
        try:
            check_xla_device_count(nproc, int(xr.local_device_count()), str(xr.device_type()))
            result = call_worker_fn(fn, local_rank, args, kwargs)
        except BaseException as e:
            write_failure_report(
                e, report_dir, rank, local_rank, name=f"failure-{local_rank}.json", announce=False
            )
            exit_failed()
    write_result(os.path.join(report_dir, f"result-{local_rank}.pkl"), result, rank)


def _results(report_dir: str, nproc: int) -> list[Any]:
    results = []
    for local_rank in range(nproc):
        with open(os.path.join(report_dir, f"result-{local_rank}.pkl"), "rb") as f:
            results.append(pickle.load(f))
    return results


def _launch_failure(report_dir: str, nproc: int, error: BaseException) -> WorkerFailedError:
    """WorkerFailedError from the workers' reports (the failing rank's traceback first)."""
    reported = reported_failure_error(
        [os.path.join(report_dir, f"failure-{r}.json") for r in range(nproc)],
        finished=lambda r: os.path.exists(os.path.join(report_dir, f"result-{r}.pkl")),
    )
    if reported is None:
        return WorkerFailedError(
            "onedist.spawn: the XLA worker process ended before its devices finished "
            f"({type(error).__name__}: {error}); its output above shows why.\n"
            "HINT: an XLA abort such as 'Termination timeout for ... RendezvousKey' means a device waited "
            "10 s for a collective that another device did not run: every rank must call the same "
            "collectives in the same order (on the PJRT CPU devices, graph launches of the device threads "
            "also race; see the XLA page of onedist's documentation)",
            -1,
            -1,
            None,
            None,
        )
    return reported
