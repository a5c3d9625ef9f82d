"""``onedist run``: start the workers of a script on this node, like torchrun.

    onedist run --nproc-per-node 2 train.py --lr 0.1
    onedist run -n 4 -m mypkg.train
    onedist run --nnodes 2 --node-rank 0 --master-addr node0 --master-port 29500 -n 8 train.py
    srun -n 8 onedist run train.py          # SLURM started the tasks: run in place, no second spawn

Each worker gets torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
GROUP_WORLD_SIZE, ROLE_*, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*), so scripts written for torchrun
run unchanged. As torchrun's agent does, the launcher on node 0 hosts the rendezvous store
(``TORCHELASTIC_USE_AGENT_STORE=True``): every rank, including rank 0, connects to it, so torch's
own ``env://`` path and onedist's both work, and the store outlives any one worker. The port is
bound before any worker starts and held until the end; torch is imported (to serve the store) only
after the workers started, so that their start is not delayed by it.

Output lines are prefixed with ``[rank<N>]: `` (``--output-ranks`` keeps only some ranks). When a
worker fails, the others are stopped (SIGTERM, SIGKILL 3 s later), the failing rank's error is
printed first, and the exit status is non-zero. SIGINT/SIGTERM are forwarded to the workers.

``--max-restarts N``: after a worker failed and the others were stopped, start them all again, up
to N times, each attempt on a fresh port and store, with the attempt number in
``TORCHELASTIC_RESTART_COUNT`` (one line on stderr per restart); the exit status is the last
attempt's. A signal to the launcher is not a failure: it is never restarted. On several nodes the
launchers agree on each restart through a store node 0's launcher hosts on ``--master-port``
(:mod:`.nodes`); the workers' rendezvous then moves to a fresh port per attempt.

``--nnodes MIN:MAX --rdzv-backend c10d`` (an elastic job): the nodes meet through torch's own c10d
rendezvous before each start of the workers, and a node that leaves or joins restarts every node's
workers at the new world size (:mod:`.elastic`).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import IO, Any, Optional

from .._injection import ENV as INJECTION_ENV
from .._net import rendezvous_port
from .._recovery import ENV as RECOVERY_ENV, GENERATION_ENV, LIVE
from ..environments import detect_cluster, kubernetes_job
from ..errors import OnedistValueError
from . import forked
from .arguments import add_flags, rendezvous_conf
from .elastic import Membership
from .launcher import Launcher, restart_verdict, restarts_left
from .nodes import Agents, AgentsError
from .pet import apply_pet_defaults, ignored_variables
from .replacement import LiveRecovery
from .report import Failure, failure_report
from .run_spec import RunSpec, check_run_nproc_against, check_run_values, run_command, visible_gpus
from .supervisor import TERM_S, PopenWorker, Supervisor
from .worker import torchrun_env, worker_threads_env

__all__ = ["RunLauncher", "build_parser", "main", "split_at_target"]


def build_parser(parser: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    """The ``onedist run`` arguments (torchrun's names; dashes and underscores both accepted)."""
    p = parser or argparse.ArgumentParser(prog="onedist run")
    p.description = (
        "Start N workers of a script on this node (torchrun-compatible). As in torchrun, a flag that "
        "is not given defaults to its PET_* variable (--nproc-per-node: PET_NPROC_PER_NODE, ...)."
    )
    add_flags(p)  # torchrun's flags and --backend, as launchers/arguments.py declares them
    p.add_argument(
        "--output-ranks",
        default=None,
        help="comma-separated ranks whose output is shown (default: all)",
    )
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with [rank<N>]:")
    p.add_argument("target", help="the script (or module with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the script")
    return p


def split_at_target(
    parser: argparse.ArgumentParser, argv: list[str]
) -> tuple[list[str], Optional[list[str]]]:
    """``argv`` of ``onedist run`` as (the launcher's options and the target, the script's
    arguments): everything after the script's name is the script's, as ``python script.py`` has
    it, even where it looks like a launcher option (``train.py --nproc 2``: argparse alone read
    ``--nproc`` as an ambiguous abbreviation of ``--nproc-per-node``). None for the script's
    arguments when argparse is to split them itself (after ``--``, or an option it must judge)."""
    takes_value = {o: a.nargs != 0 for a in parser._actions for o in a.option_strings}
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return argv, None
        if not token.startswith("-") or token == "-":  # the target
            return argv[: i + 1], argv[i + 1 :]
        name = token.split("=", 1)[0]
        if name in takes_value:
            matches = {name}
        elif name.startswith("--"):  # an abbreviation
            matches = {o for o in takes_value if o.startswith(name)}
        elif len(name) > 2 and name[:2] in takes_value:  # -n2: the value attached
            i += 1
            continue
        else:
            matches = set()
        if len({takes_value[o] for o in matches}) != 1:  # unknown or ambiguous: argparse says so
            return argv, None
        i += 2 if takes_value[matches.pop()] and "=" not in token else 1
    return argv, None


class _UsageError(Exception):
    pass


def _output_ranks(value: Optional[str]) -> Optional[set[int]]:
    if value is None:
        return None
    try:
        return {int(v) for v in value.split(",") if v.strip()}
    except ValueError:
        raise _UsageError(
            f"--output-ranks={value!r} is not allowed; allowed: comma-separated ranks, e.g. 0,1"
        ) from None


# ============================================================================ workers
_LIBC: list[Any] = []  # loaded in the launcher: after a fork with threads running (the store's,
# the heartbeat's) the child must not take the dynamic loader's lock, which one of them may hold


def _die_with_launcher() -> None:  # runs in the child between fork and exec
    try:
        _LIBC[0].prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die when the launcher dies
    except Exception:
        pass


def _pump(stream: IO[bytes], out: IO[bytes], prefix: bytes, show: bool, lock: threading.Lock) -> None:
    # torch prefixes the lines of an uncaught exception's traceback with the same "[rank<N>]:"
    # (its excepthook once the process group exists): those lines keep theirs only
    own = prefix.rstrip()
    for line in iter(stream.readline, b""):
        if show:
            with lock:
                out.write(line if own and line.startswith(own) else prefix + line)
                out.flush()
    stream.close()


def _base_env(spec: RunSpec) -> dict[str, str]:
    """What every worker of this node gets on top of this environment (before its ranks)."""
    env = dict(os.environ)
    env.update(
        {
            "TORCHELASTIC_RUN_ID": spec.run_id,
            "PYTHONUNBUFFERED": "1",
            **worker_threads_env(spec.nproc_per_node),
        }
    )
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # as torchrun
    if spec.backend:
        env["ONEDIST_BACKEND"] = spec.backend
    if spec.inject_failure:
        env[INJECTION_ENV] = spec.inject_failure
    if spec.recovery == LIVE:
        env[RECOVERY_ENV] = LIVE
    return env


def _start_workers(
    spec: RunSpec,
    port: int,
    tmpdir: str,
    supervisor: Supervisor[PopenWorker],
    attempt: int = 0,
    held: tuple[Any, ...] = (),
) -> None:
    """Start the workers of this node, each added to ``supervisor`` as it starts: forked from
    this process once it imported torch where it runs one thread and sees no GPU (:mod:`.forked`),
    else each a new interpreter. ``held``: what of this process a forked worker must not keep (the
    store's socket)."""
    fork = False
    # no GPU: CUDA's driver, once asked (torch.cuda.is_available() by --backend auto), breaks in a
    # forked child
    if spec.start_method == "fork" and not visible_gpus() and forked.can_fork():
        forked.preload(_base_env(spec).get("OMP_NUM_THREADS"))
        fork = forked.can_fork()  # importing torch started no thread
    start = functools.partial(_fork_worker, spec, supervisor, held) if fork else None
    for local_rank in range(spec.nproc_per_node):
        supervisor.workers.append(_start_worker(spec, local_rank, port, tmpdir, attempt, start=start))


def _fork_worker(
    spec: RunSpec, supervisor: Supervisor[PopenWorker], held: tuple[Any, ...], env: dict[str, str]
) -> forked.ForkedProcess:
    """A worker forked from this process; the pipes of those forked before it, and ``held``, are
    closed in it (a worker holding another's write end would keep that pipe open after it ended)."""
    pipes = [s for w in supervisor.workers for s in (w.popen.stdout, w.popen.stderr) if s is not None]
    return forked.fork_worker(env, spec.command, [*pipes, *held])


def _start_worker(
    spec: RunSpec,
    local_rank: int,
    port: int,
    tmpdir: str,
    attempt: int,
    extra: Optional[dict[str, str]] = None,
    spare: Optional[subprocess.Popen[bytes]] = None,
    start: Optional[Callable[[dict[str, str]], forked.ForkedProcess]] = None,
) -> PopenWorker:
    """Start local rank ``local_rank`` (``extra``: more variables, a live replacement's; ``spare``:
    a started :mod:`.standby` process that becomes this rank, instead of a new process)."""
    nproc = spec.nproc_per_node
    rank = spec.node_rank * nproc + local_rank
    tag = f"-g{extra[GENERATION_ENV]}" if extra and GENERATION_ENV in extra else ""
    error_file = os.path.join(tmpdir, f"error-{rank}{tag}.json")
    env = {
        **_base_env(spec),
        **torchrun_env(local_rank, nproc, spec.node_rank, spec.nnodes, spec.master_addr, port),
        **_agent_env(attempt, spec.max_restarts, spec.role),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(spec.world_size),
        "ONEDIST_ERROR_FILE": error_file,
        # where torch's @record writes (onedist's bootstrap reports the error itself)
        "TORCHELASTIC_ERROR_FILE": os.path.join(tmpdir, f"torchelastic-error-{rank}{tag}.json"),
        **(extra or {}),
    }
    if spare is not None:
        assert spare.stdin is not None
        spare.stdin.write(json.dumps(env).encode() + b"\n")  # it runs the script as this rank now
        spare.stdin.close()
        return PopenWorker(rank, local_rank, spare, error_file, early=False)
    # its report counts once it ended: until then it may still be printing its traceback
    process = _popen("bootstrap", spec, env) if start is None else start(env)
    return PopenWorker(rank, local_rank, process, error_file, early=False)


def _popen(entry: str, spec: RunSpec, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A worker process: ``python -m onedist.launchers.<entry>`` running the script."""
    if not _LIBC:
        _LIBC.append(ctypes.CDLL(None))
    return subprocess.Popen(
        [sys.executable, "-m", f"onedist.launchers.{entry}", *spec.command],
        env=env,
        stdin=subprocess.PIPE if entry == "standby" else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # a terminal's Ctrl-C reaches the launcher only: it forwards once
        preexec_fn=_die_with_launcher,
    )


class _Replacements:
    """``--recovery live``'s workers of one attempt: a spare (:mod:`.standby`) kept warm once the
    group is ready, which becomes the dead rank (a new process when there is none)."""

    def __init__(self, spec: RunSpec, port: int, tmpdir: str, attempt: int, start_pumps: Any) -> None:
        self.spec, self.port, self.tmpdir, self.attempt = spec, port, tmpdir, attempt
        self.start_pumps = start_pumps
        self.spares: list[subprocess.Popen[bytes]] = []

    def warm(self) -> None:
        if not self.spares:
            self.spares.append(_popen("standby", self.spec, _base_env(self.spec)))

    def replace(self, dead: PopenWorker, extra: dict[str, str]) -> PopenWorker:
        spare = self.spares.pop() if self.spares else None
        new = _start_worker(self.spec, dead.local_rank, self.port, self.tmpdir, self.attempt, extra, spare)
        self.start_pumps([new])
        return new

    def close(self) -> None:
        """End the spares left (their input closed: they exit without running anything)."""
        for spare in self.spares:
            if spare.stdin is not None:
                spare.stdin.close()
            try:
                spare.wait(TERM_S)
            except subprocess.TimeoutExpired:
                spare.kill()
                spare.wait()
        self.spares.clear()


def _start_pumps(
    workers: list[PopenWorker], no_prefix: bool, show: Optional[set[int]], lock: threading.Lock
) -> list[threading.Thread]:
    """One thread per output stream of each worker, copying its lines here with the rank prefix."""
    pumps = []
    for w in workers:
        visible = show is None or w.rank in show
        prefix = b"" if no_prefix else f"[rank{w.rank}]: ".encode()
        for stream, out in ((w.popen.stdout, sys.stdout.buffer), (w.popen.stderr, sys.stderr.buffer)):
            assert stream is not None
            t = threading.Thread(target=_pump, args=(stream, out, prefix, visible, lock), daemon=True)
            t.start()
            pumps.append(t)
    return pumps


class RunLauncher(Launcher):
    """``onedist run``: this node's workers (``spec.nproc_per_node``), each running the script
    (torchrun's variables set), restarted while ``--max-restarts`` allows; with several nodes and
    restarts the nodes' launchers agree on each restart (:class:`~.nodes.Agents`). ``show`` and
    ``no_prefix``: whose output is shown, and how (``--output-ranks``, ``--no-prefix``).
    ``[exit status]``; a signal to the launcher is forwarded to the workers and ends the job
    (never restarted)."""

    name = "onedist run"

    def __init__(
        self,
        spec: RunSpec,
        show: Optional[set[int]] = None,
        no_prefix: bool = False,
        membership: Optional[Membership] = None,
    ) -> None:
        super().__init__(spec.max_restarts)
        self.spec, self.show, self.no_prefix = spec, show, no_prefix
        self.received: list[int] = []
        self.supervisor = Supervisor[PopenWorker]()
        self.agents: Optional[Agents] = None
        #: an elastic job's rendezvous (:mod:`.elastic`), and its restarts after this node's failures
        self.membership, self.failed = membership, 0
        self.code = 0
        #: the workers replaced alone (``--recovery live``), over every attempt
        self.replaced: list[PopenWorker] = []

    def attempt(self, number: int) -> list[Failure]:
        self.supervisor = Supervisor()
        self.code, failures = _attempt(
            self.spec, number if self.membership is None else self.failed, self.supervisor, self.received,
            self.agents, self.show, self.no_prefix, self.replaced, self.membership,
        )  # fmt: skip
        return failures

    def restart(self, number: int, failures: list[Failure]) -> Optional[list[Failure]]:
        if self.membership is not None:  # an elastic job: membership changes are not counted
            restarts = (self.failed, self.max_restarts)
            action, counted = self.membership.verdict(failures, self.code, bool(self.received), restarts)
            self.failed += counted
            return [] if action == "restart" else None
        if self.agents is not None:
            verdict = self.agents.verdict(number, failures, self.received[0] if self.received else None)
            if verdict.why:
                sys.stderr.write(verdict.why)
            if verdict.action != "restart":
                self.code = self.code if verdict.action == "done" or self.code != 0 else 1
                return None
            return verdict.failures
        # a signal to the launcher ends the job: only a worker's own failure is restarted
        signalled = bool(self.received)
        # each rank replaced alone (--recovery live) was one of the restarts
        used = number + len(self.replaced)
        action = restart_verdict(used, self.max_restarts, failed=self.code != 0, signalled=signalled)
        return failures if action == "restart" else None

    def finish(self, failures: list[Failure]) -> list[Any]:
        return [self.code]  # the failure's report is printed already (see _wait)

    def results(self) -> list[Any]:
        return [self.code]

    def launch(self) -> list[Any]:
        """The restart loop, with the signals forwarded to the workers and, for several nodes
        with restarts, the nodes' launchers met first."""
        spec = self.spec

        def forward(signum: int, frame: Any) -> None:
            self.received.append(signum)
            self.supervisor.signal_all(signum)
            if self.membership is not None and self.membership.waiting:  # no worker runs: leave
                raise AgentsError(f"stopped by {signal.Signals(signum).name} while waiting for other nodes")

        previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            # several nodes that may restart: their launchers agree on each restart
            if self.membership is None and spec.nnodes > 1 and restarts_left(0, spec.max_restarts):
                assert spec.master_port is not None  # RunSpec.build: required with several nodes
                self.agents = Agents(spec.master_addr, spec.master_port, spec.node_rank, spec.nnodes,
                                     spec.max_restarts, spec.run_id)  # fmt: skip
                # node 0's run id, unless every node was given --rdzv-id
                self.spec = dataclasses.replace(spec, run_id=self.agents.run_id)
            return super().launch()
        except AgentsError as e:
            if self.agents is not None:
                self.agents.abort(e)
            sys.stderr.write(f"onedist run: node {spec.node_rank}: {e}\n")
            if self.membership is not None and self.received:  # left the rendezvous on a signal
                return [128 + self.received[0]]
            return [1]
        finally:
            if self.agents is not None:
                self.agents.close()
            if self.membership is not None:
                self.membership.close()
            for s, handler in previous.items():
                signal.signal(s, handler)


def _attempt(
    spec: RunSpec,
    attempt: int,
    supervisor: Supervisor[PopenWorker],
    received: list[int],
    agents: Optional[Agents] = None,
    show: Optional[set[int]] = None,
    no_prefix: bool = False,
    replaced: Optional[list[PopenWorker]] = None,
    membership: Optional[Membership] = None,
) -> tuple[int, list[Failure]]:
    """Start this node's workers once (attempt ``attempt``) and watch them: the exit status, and
    the failures. ``show``: the ranks whose output is shown (None: all); ``no_prefix``: without
    the ``[rank<N>]:`` prefix. Each attempt gets a fresh store, so no key of a failed
    attempt (a failure report, a counter) is read by the next one; with ``agents``, on the port
    node 0 publishes; with ``membership``, in the next round of an elastic job's rendezvous."""
    if membership is not None:  # this round's node rank, node count and node 0's port
        spec, port, store_sock = membership.begin()
    else:
        port, store_sock = _attempt_port(spec, attempt, agents)
    tmpdir = tempfile.mkdtemp(prefix="onedist-run-")
    pumps: list[threading.Thread] = []
    stores: list[Any] = []  # the agent store, kept until every worker ended
    failures: list[Failure] = []
    peers = None
    if agents is not None:
        peers = lambda: agents.should_stop(  # noqa: E731
            attempt, any(w.failure is not None for w in supervisor.workers), bool(received)
        )
    elif membership is not None:
        peers = membership.should_stop
    lock = threading.Lock()
    spares: Optional[_Replacements] = None
    try:
        if not received:
            _start_workers(spec, port, tmpdir, supervisor, attempt, held=(store_sock,) if store_sock else ())
            pumps = _start_pumps(supervisor.workers, no_prefix, show, lock)
        if store_sock is not None:  # after the last fork: the store runs threads of its own
            stores.append(_agent_store(store_sock, spec.master_addr, spec.world_size))
            store_sock = None
        last = not restarts_left(attempt, spec.max_restarts)
        live = None
        if spec.recovery == LIVE and stores:
            more = lambda ws: pumps.extend(_start_pumps(ws, no_prefix, show, lock))  # noqa: E731
            spares = _Replacements(spec, port, tmpdir, attempt, more)
            done = [] if replaced is None else replaced
            live = LiveRecovery(stores[0], spec.world_size, (attempt, spec.max_restarts), spares.replace,
                                done, lambda: bool(received), spares.warm)  # fmt: skip
        return _wait(supervisor, pumps, received, failures, report=last, peers=peers, live=live), failures
    finally:
        if store_sock is not None:
            store_sock.close()
        if spares is not None:
            spares.close()
        supervisor.stop()
        stores.clear()  # its server stops here, after the workers
        for t in pumps:
            t.join(timeout=1.0)
        shutil.rmtree(tmpdir, ignore_errors=True)


def _attempt_port(
    spec: RunSpec, attempt: int, agents: Optional[Agents]
) -> tuple[int, Optional[socket.socket]]:
    """The workers' rendezvous port of ``attempt``, and on node 0 its bound socket. Node 0 binds
    it here and hands it to rank 0's store: no window for another program to take the port, a
    port in use fails before any worker starts, and one node listens on loopback only. With
    ``agents``, --master-port serves the launchers' store: node 0 binds a fresh port and
    every node reads it from that store once all arrived."""
    host_store = spec.node_rank == 0
    try:
        port, store_sock = rendezvous_port(
            # several nodes: listen on every interface even when node 0 calls itself localhost
            # (TorchX's first pod does: TORCHX_RANK0_HOST=localhost), or the others cannot connect
            spec.master_addr if spec.nnodes == 1 else "",
            spec.master_port if agents is None else None,
            host_store=host_store,
            what="--master-port",
        )
    except OSError as e:
        raise _UsageError(e.strerror or str(e)) from e
    if agents is None:
        return port, store_sock
    try:
        return agents.begin(attempt, port if host_store else None), store_sock
    except BaseException:
        if store_sock is not None:
            store_sock.close()
        raise


def _agent_env(attempt: int, max_restarts: int, role: str = "default") -> dict[str, str]:
    """What torchrun's agent adds to the rendezvous variables (one role, the agent's store)."""
    return {
        "ROLE_NAME": role,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
    }


def _agent_store(sock: Any, master_addr: str, world_size: int) -> Any:
    """Serve the rendezvous store on ``sock`` (bound before the workers started), as torchrun's
    agent does: torch's env:// path then makes every rank a client of it."""
    import torch.distributed as dist

    tcp_store: Any = dist.TCPStore  # type: ignore[attr-defined]  # re-exported without __all__
    return tcp_store(
        master_addr,
        sock.getsockname()[1],
        world_size,
        True,
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
        use_libuv=True,
    )


def _wait(
    supervisor: Supervisor[PopenWorker],
    pumps: list[threading.Thread],
    received: list[int],
    failures_out: list[Failure],
    report: bool = True,
    peers: Optional[Callable[[], bool]] = None,
    live: Optional[LiveRecovery] = None,
) -> int:
    """Watch the workers (5 s after a forwarded signal, stop those left; at once when ``peers()``
    says another node stopped); the exit status. The failures go to ``failures_out``; their
    report is printed only with ``report``."""
    signalled_at: list[float] = []

    def give_up() -> bool:
        if peers is not None and peers():
            return True
        if received and not signalled_at:
            signalled_at.append(time.monotonic())
        return bool(signalled_at) and time.monotonic() >= signalled_at[0] + 5.0

    failures = supervisor.watch(give_up) if live is None else live.watch(supervisor, give_up)
    failures_out.extend(failures)
    for t in pumps:  # let the output of every worker drain before the summary
        t.join(timeout=1.0)
    if received:
        sys.stderr.write(f"onedist run: stopped by signal {signal.Signals(received[0]).name}\n")
        return 128 + received[0]
    if not failures:
        return 0
    if all(f.stopped for f in failures):  # stopped because another node's worker failed
        return 1
    primary, text = failure_report(failures)
    if report:  # a failure that is restarted gets one line instead (:func:`~.report.restart_line`)
        sys.stderr.write(text.replace("onedist: worker", "onedist run: worker", 1) + "\n")
    code = primary.exitcode
    return code if code is not None and 0 < code < 128 else 1


def _run_in_place(args: argparse.Namespace) -> int:
    """Under srun / mpirun / torchrun the processes exist already: run the script here."""
    from .bootstrap import run_target

    if args.backend:
        os.environ["ONEDIST_BACKEND"] = args.backend
    if args.inject_failure:
        os.environ[INJECTION_ENV] = args.inject_failure
    try:
        run_target(list(run_command(args)))
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def main(args: argparse.Namespace) -> int:
    """Run ``onedist run`` with parsed arguments; returns the exit status.

    A flag that was not given (None) takes its ``PET_*`` variable's value, else torchrun's default
    (:mod:`.pet`). A Kubernetes pod that no launcher has started workers in yet (Kubeflow's
    PyTorchJob sets RANK and WORLD_SIZE there, with RANK the pod's index) starts the workers, as
    torchrun does; a process another launcher started runs the script in place.
    """
    try:
        args.from_environment = apply_pet_defaults(args, os.environ)
        nproc = check_run_values(args)
        _check_target(args.target, bool(args.module))
        _report_environment(args)
        show = _output_ranks(args.output_ranks)
        pod = kubernetes_job(os.environ)
        env = None if pod is not None and not pod.workers_started else detect_cluster(os.environ)
        if env is not None:
            check_run_nproc_against(nproc, env)
            return _run_in_place(args)
        spec = RunSpec.build(args, nproc)
        membership = None
        if args.elastic:  # torch's c10d rendezvous numbers the nodes (RunSpec.build checked it)
            membership = Membership(spec, args.max_nnodes, rendezvous_conf(args.rdzv_conf) or {})
        return int(RunLauncher(spec, show, args.no_prefix, membership).launch()[0])
    except (_UsageError, OnedistValueError) as e:
        sys.stderr.write(f"onedist run: {e}\n")
        return 2


def _check_target(target: str, module: bool) -> None:
    """Refuse a script that is not there (or a module whose top-level package is not found) before
    any worker starts, in Python's words: each worker would fail alike, after its start-up."""
    if module:
        import importlib.machinery

        top = target.split(".", 1)[0]  # the rest would need the package imported: left to the workers
        if top not in sys.builtin_module_names and (
            importlib.machinery.PathFinder.find_spec(top, [os.getcwd(), *sys.path[1:]]) is None
        ):
            raise _UsageError(f"No module named {top!r} (target of -m, looked for from {os.getcwd()})")
    elif not os.path.exists(target):
        raise _UsageError(f"can't open file {os.path.abspath(target)!r}: [Errno 2] No such file or directory")


def _report_environment(args: argparse.Namespace) -> None:
    """One stderr line for the flags taken from ``PET_*`` variables, one for those it ignores:
    in a pod, nobody typed them, so the log says where they came from."""
    taken = args.from_environment
    if taken:
        shown = {d: getattr(args, d) for d in taken}
        if "nnodes" in shown and args.max_nnodes != args.nnodes:  # PET_NNODES=min:max, as it was
            shown["nnodes"] = f"{args.nnodes}:{args.max_nnodes}"
        values = ", ".join(f"--{d.replace('_', '-')}={shown[d]} ({var})" for d, var in taken.items())
        sys.stderr.write(f"onedist run: from the environment (as torchrun): {values}\n")
    ignored = ignored_variables(os.environ)
    if ignored:
        sys.stderr.write(
            f"onedist run: ignoring {', '.join(ignored)}: torchrun flags onedist run does not have\n"
        )
