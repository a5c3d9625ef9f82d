"""``spawn("horovod", fn, nproc_per_node=N)``: N workers started through ``horovod.run``.

``horovod.run`` (Gloo controller) starts the workers on this host, or with ``hosts``
("host1:slots,host2:slots", as ignite passes it) over those hosts, and picks its own rendezvous.
It runs in a short-lived child process: it leaves its driver service listening and its signal
handlers installed in the process that calls it. Each worker initialises onedist's Horovod
context, runs ``fn(local_rank, ...)`` and finalises; a failing worker writes its report, and
:class:`~onedist.WorkerFailedError` is raised with its rank and traceback first.
"""

from __future__ import annotations

import logging
import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch

from ..errors import OnedistRuntimeError, WorkerFailedError
from .launcher import SingleAttemptLauncher
from .report import reported_failure_error
from .spec import LaunchSpec
from .worker import call_worker_fn, exit_failed, worker_threads_env, write_failure_report

__all__ = ["HorovodrunLauncher"]

logger = logging.getLogger("onedist")


class HorovodrunLauncher(SingleAttemptLauncher):
    """``nproc_per_node`` workers started through ``horovod.run`` (Gloo controller), on this host
    or, with ``hosts`` ("host1:slots,host2:slots", as ignite passes it), over those hosts.

    Each worker runs ``fn(local_rank, *args, **kwargs)`` inside an initialised horovod context;
    the results come back in rank order. A failing worker ends the run (Horovod stops the
    others) and :class:`~onedist.WorkerFailedError` is raised with its rank and traceback first.
    Not restarted: restart the whole job from outside.
    """

    name = "onedist.spawn (horovod.run)"

    def run(self) -> list[Any]:
        return _run(self.spec)


def _run(spec: LaunchSpec) -> list[Any]:
    """horovod.run in a child process; the workers' results, or their failure raised."""
    fn, args, kwargs, timeout = spec.fn, spec.args, spec.kwargs, spec.timeout
    nproc_per_node = spec.nproc_per_node
    host_list = spec.hosts if spec.hosts is not None else f"localhost:{nproc_per_node}"
    try:
        import horovod
    except ImportError as e:  # reported as unavailable before this; kept for a broken install
        raise OnedistRuntimeError(f"onedist.spawn: horovod does not import ({e})") from e
    del horovod  # imported here only to fail early; horovod.run runs in a child (below)
    import multiprocessing

    import cloudpickle

    report_dir = tempfile.mkdtemp(prefix="onedist-horovod-")
    cfg = {"timeout": timeout, "env": worker_threads_env(nproc_per_node), "report_dir": report_dir}
    # horovod.run leaves its driver service listening on 0.0.0.0 in the calling process, and
    # installs signal handlers there: it runs in a short-lived child process instead, so this
    # process keeps nothing of it (cloudpickle carries fn, as horovod.run would)
    payload = cloudpickle.dumps((fn, args, kwargs, cfg))
    ctx = multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_horovod_run, args=(payload, nproc_per_node, host_list, writer))
    try:
        child.start()
        writer.close()
        try:
            status, value = reader.recv()
        except EOFError:
            status, value = "error", f"the horovod.run process died (exit code {child.exitcode})"
        child.join()
        if status == "ok":
            return cloudpickle.loads(value)  # type: ignore[no-any-return]
        if status == "failed":
            raise _launch_failure(report_dir, nproc_per_node, RuntimeError(value))
        raise OnedistRuntimeError(f"onedist.spawn: horovod.run failed:\n{value}")
    finally:
        if child.is_alive():
            child.kill()
            child.join()
        reader.close()
        import shutil

        shutil.rmtree(report_dir, ignore_errors=True)


# ============================================================================ spawn's workers
def _worker(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], cfg: dict[str, Any]
) -> Any:
    """What ``horovod.run`` runs in each worker: initialise, ``fn(local_rank, ...)``, finalise.

    A failure is written to ``cfg["report_dir"]`` (the parent turns it into WorkerFailedError) and
    published to the other ranks, then the worker exits 1, so that Horovod stops the others.
    """
    os.environ.update(cfg["env"])
    if "OMP_NUM_THREADS" in cfg["env"]:
        torch.set_num_threads(int(cfg["env"]["OMP_NUM_THREADS"]))
    from ..context import finalize, get_local_rank, initialize

    try:
        initialize("horovod", timeout=cfg["timeout"])
        result = call_worker_fn(fn, get_local_rank(), args, kwargs)
        finalize()
    except BaseException as e:
        _report_failure(e, cfg["report_dir"])
        exit_failed()
    try:
        import importlib

        importlib.import_module("cloudpickle").dumps(result)  # how horovod.run returns it
    except Exception as e:
        logger.warning(
            "onedist.spawn: the return value of rank %s cannot be pickled (%s); returning None",
            os.environ.get("HOROVOD_RANK"),
            e,
        )
        result = None
    return result


def _report_failure(exc: BaseException, report_dir: str) -> None:
    rank = int(os.environ.get("HOROVOD_RANK", "0"))
    write_failure_report(exc, report_dir, rank, int(os.environ.get("HOROVOD_LOCAL_RANK", str(rank))))


def _horovod_run(payload: bytes, nproc: int, hosts: str, conn: Any) -> None:
    """The child process of :func:`launch`: ``horovod.run`` and its results."""
    import cloudpickle
    import horovod

    fn, args, kwargs, cfg = cloudpickle.loads(payload)
    try:
        results = horovod.run(
            _worker,
            args=(fn, args, kwargs, cfg),
            num_proc=nproc,
            hosts=hosts,
            use_gloo=True,
        )
        conn.send(("ok", cloudpickle.dumps(results)))
    except RuntimeError as e:  # a worker failed: the parent reads the reports
        conn.send(("failed", str(e)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def _launch_failure(report_dir: str, nproc: int, error: RuntimeError) -> WorkerFailedError:
    """WorkerFailedError from the workers' reports (the failing rank's traceback first)."""
    reported = reported_failure_error(
        [os.path.join(report_dir, f"rank-{rank}.json") for rank in range(nproc)]
    )
    if reported is None:
        return WorkerFailedError(
            f"onedist.spawn: a horovod worker failed before onedist could run your function:\n{error}\n"
            "(its output above shows why)",
            -1,
            -1,
            None,
            None,
        )
    return reported
