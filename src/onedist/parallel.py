"""Run a function distributed: :class:`Parallel`, ignite's context manager.

``Parallel`` only decides: serial (``backend=None``), external (a launcher such as torchrun
already started the processes, or a group exists: it initialises on ``__enter__``), or start the
workers (:func:`onedist.spawn`, or the re-exec start method for functions that cannot be
pickled). Its argument checks, in ignite's order and words, are in ``launchers/spec.py`` with
every other launch argument's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from types import TracebackType
from typing import Any, Optional

from .environments import detect_cluster, launched_externally
from .launchers.spec import (
    SPAWN_ARGS,
    LaunchSpec,
    check_against_launcher,
    check_max_restarts,
    check_no_spawn_args,
    check_parallel_args,
    check_parallel_kwargs,
    check_recovery,
    check_serial_args,
    port_number,
)
from .log import setup_logger

__all__ = ["Parallel"]

logger = logging.getLogger("onedist")


# ============================================================================ worker side
def _warn_if_srun_was_skipped() -> None:
    """A one-process run inside a SLURM job of several tasks, not started by srun (``python
    train.py`` in an sbatch script): say so, it would otherwise train on 1 process silently."""
    import shutil

    from ._diagnose import srun_warnings

    for text in srun_warnings(os.environ, detect_cluster(os.environ), shutil.which):
        logger.warning("onedist: %s", text)


class Parallel:
    """Run a function distributed: spawn workers, only initialise under a launcher, or run serially.

    * ``backend=None``: serial; ``run(fn)`` calls ``fn(0, ...)`` here.
    * Under an external launcher (torchrun, srun, ... set RANK and WORLD_SIZE) or with a process
      group already created: initialise (if needed) on ``__enter__``; ``run`` calls
      ``fn(local_rank, ...)`` here. Spawn arguments, if given, must agree with the launcher.
    * Else with ``nproc_per_node``: ``run`` spawns the workers (:func:`spawn`), or with
      ``start_method="subprocess"`` this process becomes local rank 0 and the script re-runs
      itself for local ranks 1..N-1 (below).
    * Else: a group of this one process.

    ``start_method="subprocess"`` (PyTorch Lightning's way) is for functions that cannot be pickled:
    closures, lambdas, functions defined under ``if __name__ == "__main__":``. The command that
    started this process (``python [flags] script.py args`` or ``python -m pkg.mod args``) is run
    again, in the same directory and environment, with torchrun's variables (RANK, LOCAL_RANK,
    WORLD_SIZE, ...): there the same ``Parallel(...)`` only initialises and ``run`` calls
    ``fn(local_rank, ...)``. Here, ``run`` initialises as rank 0, calls ``fn(0, ...)``, waits for
    the others and returns ``fn``'s result. The whole script runs in every process, so code outside
    ``run`` runs N times, and there can be one such run per process. The children share this
    process's stdout / stderr (no rank prefix) and read nothing from stdin. A failing child stops
    the run: the others are stopped and :class:`WorkerFailedError` is raised here with its traceback
    first; if this process is stuck in a collective it cannot leave, the report is printed and the
    process exits with status 1 within a few seconds. Not possible from ``python -c``, a REPL or a
    notebook: use "spawn" or "fork" there.

    Args:
        backend: "gloo", "nccl", "shm", "mpi" (under ``mpirun``), "horovod", "xla-tpu", "auto",
            or None for serial (see :func:`onedist.spawn` for what "auto" picks).
        nproc_per_node: workers to start on this node.
        nnodes: nodes (spawn mode).
        node_rank: this node's index (spawn mode).
        master_addr: node 0's address (spawn mode).
        master_port: rendezvous port (spawn mode; None picks a free one on one node).
        init_method: "env://", "tcp://..." or "file://...".
        **spawn_kwargs: ``timeout`` (see :func:`spawn`), ``start_method``: "spawn" (default; fn
            must be importable), "fork", "forkserver" (see :func:`spawn`) or "subprocess" (re-run
            the script; any fn), ``hosts`` for backend "horovod" (see :func:`spawn`), and
            ``max_restarts``: an int >= 0 (default 0), how many times the workers are all started
            again after one fails (spawn mode, one node, not with "subprocess"; see :func:`spawn`).
            Under an external launcher, that launcher's restarts apply (``onedist run
            --max-restarts N``, ``torchrun --max-restarts N``) and this one is not used. And
            ``recovery``: "restart" (default) or, under ``onedist run --recovery live`` only,
            "live" (see :func:`onedist.steps`); spawn mode refuses "live".

    Example:
        >>> import onedist as od
        >>> def training(local_rank, config):
        ...     print(od.get_rank(), od.get_world_size(), config["lr"])
        >>> if __name__ == "__main__":
        ...     with od.Parallel(backend="gloo", nproc_per_node=2) as parallel:
        ...         parallel.run(training, {"lr": 0.1})

        The same script under ``torchrun --nproc-per-node 2 script.py`` only initialises.

        A worker that dies (a crash, the OOM killer) with ``max_restarts``: every worker is
        stopped and started again, the attempt in :func:`onedist.restart_count` (pair it with
        :func:`onedist.resume` to continue from the last checkpoint):

        >>> import os
        >>> def flaky(local_rank):
        ...     if od.restart_count() == 0 and od.get_rank() == 1:
        ...         os._exit(1)  # rank 1 dies on the first attempt
        ...     return od.all_reduce(od.restart_count())
        >>> if __name__ == "__main__":
        ...     with od.Parallel(backend="gloo", nproc_per_node=2, max_restarts=2) as parallel:
        ...         print(parallel.run(flaky))  # stderr: "rank 1 failed ...; restarting the workers"
        2

        A function that cannot be pickled, with the script re-run for rank 1 (a script of its
        own: it re-runs the command that started it; tests/test_reexec.py runs such scripts):

            if __name__ == "__main__":
                scale = 10

                def train(local_rank):
                    return od.all_reduce(scale * (od.get_rank() + 1))

                with od.Parallel(backend="gloo", nproc_per_node=2, start_method="subprocess") as p:
                    print(p.run(train))                             # 30 (only rank 0 returns here)
    """

    def __init__(
        self,
        backend: Optional[str] = None,
        nproc_per_node: Optional[int] = None,
        nnodes: Optional[int] = None,
        node_rank: Optional[int] = None,
        master_addr: Optional[str] = None,
        master_port: Optional[int] = None,
        init_method: Optional[str] = None,
        **spawn_kwargs: Any,
    ) -> None:
        check_parallel_kwargs(spawn_kwargs)
        check_max_restarts(
            "Parallel",
            spawn_kwargs.get("max_restarts", 0),
            nnodes=1 if nnodes is None else nnodes,
            start_method=spawn_kwargs.get("start_method", "spawn"),
        )
        self.backend = backend
        self.nproc_per_node = nproc_per_node
        self.nnodes = nnodes
        self.node_rank = node_rank
        self.master_addr = master_addr
        self.master_port = port_number("Parallel", master_port)
        self.init_method = init_method
        self.spawn_kwargs = spawn_kwargs
        launcher = detect_cluster(os.environ)
        check_recovery("Parallel", spawn_kwargs.get("recovery", "restart"), launched=launcher is not None)
        hosts_rank0 = (node_rank or 0) == 0 and (launcher is None or launcher.rank == 0)
        check_parallel_args(backend, init_method, self._named(SPAWN_ARGS), hosts_rank0)
        self._initialized_here = False
        self._log = setup_logger("onedist.Parallel")
        self.mode = self._choose_mode({k: v for k, v in self._named(SPAWN_ARGS).items() if v is not None})

    def _named(self, names: tuple[str, ...]) -> dict[str, Any]:
        """The launch arguments ``names`` as this object holds them (None: not given)."""
        return {name: getattr(self, name) for name in names}

    def _choose_mode(self, given: dict[str, Any]) -> str:
        """The mode: "serial", "external" (only initialise), "subprocess" or "spawn"; ``given``:
        the spawn arguments that are not None."""
        if self.backend is None:
            check_serial_args(self.init_method)
            _warn_if_srun_was_skipped()
            return "serial"
        if launched_externally(os.environ) or _context_active():
            check_against_launcher(given, detect_cluster(os.environ))
            return "external"
        if self.nproc_per_node is not None and self.spawn_kwargs.get("start_method") == "subprocess":
            from .launchers.reexec import command_line

            command_line()  # fails now when there is no command to re-run (python -c, notebook)
            return "subprocess"
        if self.nproc_per_node is not None:
            return "spawn"
        check_no_spawn_args(given)
        _warn_if_srun_was_skipped()
        return "external"

    def __enter__(self) -> Parallel:
        if self.mode == "external" and not _context_active():
            from .context import initialize
            from .launchers.reexec import child_init_args, record_error

            try:
                initialize(
                    self.backend,  # type: ignore[arg-type]
                    timeout=self.spawn_kwargs.get("timeout"),
                    init_method=self.init_method,
                    **child_init_args(self.init_method),
                )
            except BaseException as e:
                record_error(e)  # a child of start_method="subprocess": tell the parent
                raise
            self._initialized_here = True
        self._log_start()
        return self

    def _log_start(self) -> None:
        """What ignite's Parallel logs on entry (rank 0, INFO, to stderr): scripts and their tests
        read these lines."""
        if self.backend is None:
            return
        if self.mode not in ("spawn", "subprocess"):
            self._log.info(f"Initialized processing group with backend: '{self.backend}'")
            return
        self._log.info(f"Initialized distributed launcher with backend: '{self.backend}'")
        params = {**self._named((*SPAWN_ARGS, "init_method")), **self.spawn_kwargs}
        params.update(nnodes=self.nnodes or 1, node_rank=self.node_rank or 0)  # as ignite shows them
        shown = "\n\t".join(f"{k}: {v}" for k, v in params.items() if v is not None)
        self._log.info(f"- Parameters to spawn processes: \n\t{shown}")

    def run(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``func(local_rank, *args, **kwargs)`` in the mode this object chose.

        Args:
            func: the function (named ``func`` as in ignite, so ``parallel.run(func=...)`` works);
                it cannot take a keyword argument named ``func`` through ``kwargs``.
            *args: positional arguments after ``local_rank``.
            **kwargs: keyword arguments.

        Returns:
            ``func``'s return value (in spawn and subprocess modes: local rank 0's).

        Example:
            >>> import onedist as od
            >>> with od.Parallel(backend=None) as parallel:
            ...     parallel.run(lambda local_rank, x: x + local_rank, 1)
            1
        """
        if self.mode in ("spawn", "subprocess"):
            self._log.info(f"Spawn function '{func}' in {self.nproc_per_node} processes")
        else:
            from .context import get_world_size

            self._log.info(f"- Run '{func}' in {get_world_size()} processes")
        result = self._run(func, *args, **kwargs)
        self._log.info("End of run")
        return result

    def _run(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.mode == "serial":
            return func(0, *args, **kwargs)
        if self.mode == "external":
            from .context import get_local_rank
            from .launchers.reexec import record_error

            try:
                return func(get_local_rank(), *args, **kwargs)
            except BaseException as e:
                record_error(e)  # a child of start_method="subprocess": tell the parent
                raise
        named = self._named(("backend", *SPAWN_ARGS, "init_method"))
        # not given (None, or ignite's empty master_addr): the declared default
        given = {name: value for name, value in named.items() if value is not None and value != ""}
        spec = LaunchSpec.build(
            {**given, "fn": func, "args": args, "kwargs": kwargs, **self.spawn_kwargs},
            caller="Parallel" if self.mode == "subprocess" else "spawn",
        )
        from .launchers.spawn import launch

        return launch(spec)[0]  # local rank 0's result

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        if self._initialized_here:
            from .context import finalize_context

            self._log.info(f"Finalized processing group with backend: '{self.backend}'")
            if exc is not None:
                from .failures import let_failed_rank_exit_first, report_and_release

                report_and_release(exc, tb)  # before the group goes: this rank's error is printed first
                let_failed_rank_exit_first(exc)
            self._initialized_here = False
            finalize_context(check_last_call=exc is None)  # an error on the way out must not hide exc


def _context_active() -> bool:
    from .backends import external_context_active

    return external_context_active()
