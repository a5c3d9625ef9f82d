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
from typing import Any, Optional

import torch

from ..errors import LaunchArgumentError, OnedistRuntimeError, WorkerFailedError, bad_type, bad_value
from .checks import check_one_host_launch
from .report import reported_failure_error
from .spec import LaunchSpec
from .worker import call_worker_fn, exit_failed, worker_threads_env, write_failure_report

__all__ = ["launch"]

logger = logging.getLogger("onedist")


def launch(spec: LaunchSpec) -> Optional[list[Any]]:
    """Start ``nproc_per_node`` workers through ``horovod.run`` (Gloo controller), on this host or,
    with ``hosts`` ("host1:slots,host2:slots", as ignite passes it), over those hosts.

    Each worker runs ``fn(local_rank, *args, **kwargs)`` inside an initialised horovod context;
    the results come back in rank order. A failing worker ends the run (Horovod stops the
    others) and :class:`~onedist.WorkerFailedError` is raised with its rank and traceback.
    """
    fn, args, kwargs, hosts, timeout = spec.fn, spec.args, spec.kwargs, spec.hosts, spec.timeout
    nproc_per_node, nnodes = spec.nproc_per_node, spec.nnodes
    hint = (
        "spawn('horovod', ...) starts the processes through horovod.run, which picks its own "
        "rendezvous; for several hosts pass hosts='host1:n1,host2:n2' (nproc_per_node is then "
        "the total), or run `horovodrun -np N -H host1:n1,host2:n2 python script.py` "
        "(Parallel(backend='horovod') then only initialises)"
    )
    if nnodes != 1:  # (node_rank < nnodes is checked already) ignite's words and error type
        raise bad_value(
            "spawn",
            "nnodes",
            nnodes,
            "1 with backend 'horovod'",
            hint=hint,
            says="For multi-node configuration, please set 'hosts' argument instead",
            error=LaunchArgumentError,
        )
    host_list = _check_hosts(hosts, nproc_per_node) if hosts is not None else f"localhost:{nproc_per_node}"
    check_one_host_launch(spec, hint)
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


def _check_hosts(hosts: Any, nproc: int) -> str:
    """``hosts`` as horovod.run takes it: "host:slots" items, comma-separated, with at least
    ``nproc`` slots in all."""
    allowed = "a str 'host1:slots,host2:slots' (slots: an int >= 1)"
    if not isinstance(hosts, str):
        raise bad_type("spawn", "hosts", hosts, allowed)
    slots = 0
    for item in hosts.split(","):
        name, _, count = item.strip().rpartition(":")
        if not name or not count.isdigit() or int(count) < 1:
            raise bad_value("spawn", "hosts", hosts, allowed)
        slots += int(count)
    if slots < nproc:
        raise bad_value(
            "spawn",
            "hosts",
            hosts,
            f"hosts with at least nproc_per_node={nproc} slots in all (these have {slots})",
            hint="with hosts, nproc_per_node is the number of processes over all hosts",
        )
    return hosts


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
