"""Who started this process: the launcher's environment, read without any communication.

"Environment" means what a launcher (torchrun, ``onedist run``, SLURM ``srun``, ``mpirun``,
``horovodrun``, LSF ``jsrun``) left in ``os.environ``. Each launcher has one small class with a
static :meth:`~Environment.matches` and a pure parser of an ``environ`` mapping; :func:`detect_cluster` tries
them in the order below and returns the first match as a :class:`ClusterEnv` with every value it
could derive. Nothing here imports torch or talks to another process.

Detection order (the first that matches wins):

0. ``pytorchjob`` — a Kubeflow PyTorchJob pod's own process (its RANK is the pod's index), when
   the job has one process per pod; with more, no launcher has started this pod's workers yet
   (:func:`pod_start_problem`). Before torchrun's variables, which the operator also sets.
1. ``ray`` — a Ray Train worker (``TorchTrainer``): torchrun's variables in a Ray worker process.
   Before torchrun's, whose variables Ray sets too (all but ``GROUP_*``).
2. ``torchelastic`` — torchrun / ``torch.distributed.launch`` / ``onedist run`` (which sets the same
   variables). Before the rest, because torchrun is often started *inside* an ``srun`` or
   ``mpirun`` step and then the SLURM / MPI variables describe the agents, not the workers.
3. ``horovod`` — horovodrun; before MPI because horovodrun may launch through ``mpirun``.
4. ``openmpi``, ``mvapich``, ``mpich`` (PMI: MPICH, Intel MPI) — before SLURM, because ``mpirun``
   inside an ``salloc`` leaves SLURM variables that describe the allocation, not the ranks. Under
   ``srun --mpi=pmi2`` the PMI variables repeat the task's SLURM ones, which also name the nodes
   (where rank 0 runs): read as ``slurm``.
5. ``slurm`` — a task started by ``srun`` (SLURM_STEP_ID is set); an ``sbatch`` script itself is
   not a distributed run.
6. ``lsf`` — IBM ``jsrun`` (JSM_NAMESPACE_*).

Example:
    >>> from onedist.environments import detect_cluster
    >>> env = detect_cluster({"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3",
    ...               "SLURM_LOCALID": "0", "SLURM_NTASKS": "4", "SLURM_NODEID": "1",
    ...               "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "3,1",
    ...               "SLURM_STEP_NODELIST": "node[07-08]"})
    >>> (env.name, env.rank, env.local_rank, env.nproc_per_node, env.node_rank, env.nnodes)
    ('slurm', 3, 0, 1, 1, 2)
    >>> (env.master_addr, env.master_port)
    ('node07', 24242)
"""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar, Optional

__all__ = [
    "ENVIRONMENTS",
    "TORCHRUN_VARS",
    "TRAINJOB_VARS",
    "ClusterEnv",
    "Environment",
    "KubernetesJob",
    "PartialLayout",
    "detect_cluster",
    "expand_nodelist",
    "expand_tasks_per_node",
    "gpu_index",
    "kubernetes_job",
    "kubernetes_warnings",
    "launched_externally",
    "layout_from_environ",
    "pod_start_problem",
]

#: the variables torchrun sets for each worker (and onedist's launchers too)
TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)

_PORT_BASE, _PORT_SPAN = 20000, 20000  # ports derived from a job id fall in 20000..39999


@dataclass(frozen=True)
class PartialLayout:
    """What is known about this process's place on its node; ``None`` = unknown."""

    local_rank: Optional[int] = None
    nproc_per_node: Optional[int] = None
    node_rank: Optional[int] = None
    nnodes: Optional[int] = None

    def complete(self) -> bool:
        """True when every field is known."""
        return None not in (self.local_rank, self.nproc_per_node, self.node_rank, self.nnodes)


@dataclass(frozen=True)
class ClusterEnv:
    """Everything an environment says about this process.

    ``rank`` and ``world_size`` are always known; the layout fields and the rendezvous address may
    be ``None`` when the launcher does not provide them (they are then completed from what the
    ranks publish once the group exists). ``master_port_derived`` is true when the port was derived
    from a job id rather than given.
    """

    name: str
    rank: int
    world_size: int
    local_rank: Optional[int] = None
    nproc_per_node: Optional[int] = None
    node_rank: Optional[int] = None
    nnodes: Optional[int] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    master_port_derived: bool = False

    @property
    def layout(self) -> PartialLayout:
        return PartialLayout(self.local_rank, self.nproc_per_node, self.node_rank, self.nnodes)

    def rendezvous_env(self) -> dict[str, str]:
        """The torchrun-style variables that describe this process (for ``env://``)."""
        env = {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size)}
        optional = {
            "LOCAL_RANK": self.local_rank,
            "LOCAL_WORLD_SIZE": self.nproc_per_node,
            "GROUP_RANK": self.node_rank,
            "GROUP_WORLD_SIZE": self.nnodes,
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": self.master_port,
        }
        env.update({k: str(v) for k, v in optional.items() if v is not None})
        return env


# ============================================================================ parsing helpers
def _int(environ: Mapping[str, str], *names: str) -> Optional[int]:
    """The first of ``names`` that is set to an integer."""
    for name in names:
        value = environ.get(name)
        if value is not None and value.strip():
            try:
                return int(value)
            except ValueError:
                continue
    return None


def _port(
    environ: Mapping[str, str], job_id: Optional[str], step_id: Optional[str] = None
) -> tuple[Optional[int], bool]:
    """MASTER_PORT when set, else a port derived from the job id and step id (the same on every
    task of a step; two steps of one allocation running at once get different ports)."""
    given = _int(environ, "MASTER_PORT")
    if given is not None:
        return given, False
    if not job_id:
        return None, False
    digits = re.sub(r"\D", "", job_id)
    key = int(digits) if digits else zlib.crc32(job_id.encode())
    if step_id and step_id.isdigit():
        key += int(step_id) * 7919  # step 0 keeps the job's port; a prime stride spreads the others
    return _PORT_BASE + key % _PORT_SPAN, True


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM / LSF host list such as ``gpu-a[01-04,07],cpu9`` (python-hostlist).

    Example:
        >>> expand_nodelist("gpu-a[01-02,07],cpu9")
        ['gpu-a01', 'gpu-a02', 'gpu-a07', 'cpu9']
    """
    import hostlist  # python-hostlist: a dependency of onedist, imported only here

    hosts: list[str] = hostlist.expand_hostlist(nodelist)
    return hosts


def expand_tasks_per_node(spec: str) -> list[int]:
    """Expand SLURM's tasks-per-node syntax, e.g. ``2(x3),1`` → ``[2, 2, 2, 1]``.

    Example:
        >>> expand_tasks_per_node("2(x3),1")
        [2, 2, 2, 1]
    """
    counts: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if match is None:
            raise ValueError(f"cannot parse SLURM tasks-per-node {spec!r} (at {part!r})")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


# ============================================================================ environments
class Environment:
    """One launcher's variables. Subclasses set :attr:`name` and implement :meth:`parse`."""

    name: ClassVar[str]

    @staticmethod
    def matches(environ: Mapping[str, str]) -> bool:
        """True when this launcher started the process (cheap: variable presence)."""
        raise NotImplementedError

    @classmethod
    def parse(cls, environ: Mapping[str, str]) -> Optional[ClusterEnv]:
        """Everything derivable from the variables, or None when they are incomplete."""
        raise NotImplementedError


# ---------------------------------------------------------------------------- Kubernetes pods
# What each operator sets in a pod, from its source (the tests in tests/test_kubernetes.py use
# these exact sets):
# - Kubeflow PyTorchJob, training-operator v1.7-v1.9 (github.com/kubeflow/training-operator,
#   pkg/controller.v1/pytorch/envvar.go and master.go): MASTER_ADDR = PET_MASTER_ADDR =
#   "<job>-master-0", MASTER_PORT = PET_MASTER_PORT, WORLD_SIZE = pods x nprocPerNode (x 1 when
#   nprocPerNode is not a number), RANK = PET_NODE_RANK = the pod's index, PET_NPROC_PER_NODE =
#   nprocPerNode ("auto" by default), PET_NNODES = pods. With an elasticPolicy (elastic.go):
#   PET_RDZV_ENDPOINT, PET_RDZV_BACKEND, PET_NNODES ("min:max" when elastic), PET_MAX_RESTARTS,
#   PET_RDZV_ID, PET_RDZV_CONF, PET_STANDALONE. Before v1.7 only MASTER_*, WORLD_SIZE and RANK,
#   one process per pod: a torchrun-style environment like any other.
# - Kubeflow Trainer v2 TrainJob (github.com/kubeflow/trainer,
#   pkg/runtime/framework/plugins/torch/torch.go): only TRAINJOB_VARS; its runtimes run torchrun.
# - TorchX dist.ddp (github.com/pytorch/torchx, torchx/components/dist.py): torchrun's flags on
#   the command line, TORCHX_TRACKING_EXPERIMENT_NAME and TORCHX_TRACKING_RUN_NAME in the
#   environment, and TORCHX_RANK0_HOST=localhost on the first pod (kubernetes_scheduler.py).

#: what Kubeflow Trainer v2 sets in a trainer pod, and nothing else for torch
TRAINJOB_VARS = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")


def _workers_started(environ: Mapping[str, str]) -> bool:
    """True in a worker that torchrun, ``onedist run`` or ``od.spawn`` started: they set these,
    no operator does (the worker inherits the pod's PET_* variables too)."""
    return "TORCHELASTIC_RUN_ID" in environ or "LOCAL_RANK" in environ


def _pytorchjob_pod(environ: Mapping[str, str]) -> bool:
    """A PyTorchJob (v1.7+, with a Master replica) pod's own process: RANK is the pod's index."""
    return (
        not _workers_started(environ)
        and "PET_NODE_RANK" in environ
        and "PET_NNODES" in environ
        and _int(environ, "RANK") is not None
        and _int(environ, "WORLD_SIZE") is not None
    )


class PyTorchJob(Environment):
    """The process a Kubeflow PyTorchJob pod started (plain ``python``), one process per pod."""

    name = "pytorchjob"

    @staticmethod
    def matches(environ: Mapping[str, str]) -> bool:
        return _pytorchjob_pod(environ)

    @classmethod
    def parse(cls, environ: Mapping[str, str]) -> Optional[ClusterEnv]:
        node, world = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
        if node is None or world is None or world != _int(environ, "PET_NNODES"):
            return None  # nprocPerNode > 1: this process is not a rank (see pod_start_problem)
        return ClusterEnv(
            cls.name,
            node,
            world,
            local_rank=0,
            nproc_per_node=1,
            node_rank=node,
            nnodes=world,
            master_addr=environ.get("MASTER_ADDR") or None,
            master_port=_int(environ, "MASTER_PORT"),
        )


class TorchElastic(Environment):
    """torchrun / torch.distributed.launch / ``onedist run`` / :func:`onedist.spawn` workers."""

    name = "torchelastic"

    @staticmethod
    def matches(environ: Mapping[str, str]) -> bool:
        has_ranks = _int(environ, "RANK") is not None and _int(environ, "WORLD_SIZE") is not None
        return has_ranks and not _pytorchjob_pod(environ)  # a PyTorchJob pod's RANK is a node rank

    @classmethod
    def parse(cls, environ: Mapping[str, str]) -> Optional[ClusterEnv]:
        rank, world = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
        if rank is None or world is None:
            return None
        return ClusterEnv(
            cls.name,
            rank,
            world,
            local_rank=_int(environ, "LOCAL_RANK"),
            nproc_per_node=_int(environ, "LOCAL_WORLD_SIZE"),
            node_rank=_int(environ, "GROUP_RANK", "NODE_RANK"),
            nnodes=_int(environ, "GROUP_WORLD_SIZE"),
            master_addr=environ.get("MASTER_ADDR") or None,
            master_port=_int(environ, "MASTER_PORT"),
        )


class RayTrain(Environment):
    """A Ray Train worker: ``TorchTrainer`` runs the training function in a Ray worker process.

    Ray Train (2.x, ``ray/train/torch/config.py``: ``_set_torch_distributed_env_vars`` and
    ``_TorchBackend.on_start``) sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (no ``GROUP_*``), and
    creates the default process group before the function runs: onedist adopts that group. Every
    Ray worker process has ``RAY_JOB_ID``; torchrun started inside a Ray task sets
    ``TORCHELASTIC_RUN_ID``, and is torchrun's.

    Example:
        >>> from onedist.environments import detect_cluster
        >>> env = detect_cluster({"RAY_JOB_ID": "01000000", "RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
        ...               "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "0", "MASTER_ADDR": "10.0.0.5",
        ...               "MASTER_PORT": "43483"})
        >>> (env.name, env.rank, env.local_rank, env.nproc_per_node, env.node_rank, env.nnodes)
        ('ray', 1, 1, 2, 0, None)
    """

    name = "ray"

    @staticmethod
    def matches(environ: Mapping[str, str]) -> bool:
        return (
            "RAY_JOB_ID" in environ and "TORCHELASTIC_RUN_ID" not in environ and TorchElastic.matches(environ)
        )

    @classmethod
    def parse(cls, environ: Mapping[str, str]) -> Optional[ClusterEnv]:
        env = TorchElastic.parse(environ)
        return None if env is None else replace(env, name=cls.name)


class Horovod(Environment):
    """horovodrun (gloo or MPI controller)."""

    name = "horovod"

    @staticmethod
    def matches(environ: Mapping[str, str]) -> bool:
        return "HOROVOD_RANK" in environ and "HOROVOD_SIZE" in environ

    @classmethod
    def parse(cls, environ: Mapping[str, str]) -> Optional[ClusterEnv]:
        rank, world = _int(environ, "HOROVOD_RANK"), _int(environ, "HOROVOD_SIZE")
        if rank is None or world is None:
            return None
        single_node = _int(environ, "HOROVOD_CROSS_SIZE") == 1
        return ClusterEnv(
            cls.name,
            rank,
            world,
            local_rank=_int(environ, "HOROVOD_LOCAL_RANK"),
            nproc_per_node=_int(environ, "HOROVOD_LOCAL_SIZE"),
            node_rank=_int(environ, "HOROVOD_CROSS_RANK"),
            nnodes=_int(environ, "HOROVOD_CROSS_SIZE"),
            master_addr=environ.get("MASTER_ADDR") or ("127.0.0.1" if single_node else None),
            master_port=_int(environ, "MASTER_PORT"),
        )


class _Mpi(Environment):
    """An MPI launcher: rank, size, local rank and local size; the node layout is not given."""

    RANK: ClassVar[tuple[str, ...]]
    SIZE: ClassVar[tuple[str, ...]]
    LOCAL_RANK: ClassVar[tuple[str, ...]]
    LOCAL_SIZE: ClassVar[tuple[str, ...]]
    JOB_ID: ClassVar[tuple[str, ...]]

    @classmethod
    def parse(cls, environ: Mapping[str, str]) -> Optional[ClusterEnv]:
        rank, world = _int(environ, *cls.RANK), _int(environ, *cls.SIZE)
        if rank is None or world is None:
            return None
        local_rank, local_size = _int(environ, *cls.LOCAL_RANK), _int(environ, *cls.LOCAL_SIZE)
        single_node = local_size is not None and local_size == world
        job = next((environ[k] for k in cls.JOB_ID if environ.get(k)), None)
        if job is None and single_node:
            # MPICH's hydra (4.x) names no job, but on one node every rank is a child of the same
            # process, its proxy: the port comes from that process's pid
            job = f"parent {os.getppid()}"
        port, derived = _port(environ, job)
        return ClusterEnv(
            cls.name,
            rank,
            world,
            local_rank=local_rank,
            nproc_per_node=local_size,
            node_rank=0 if single_node else None,
            nnodes=1 if single_node else None,
            # rank 0's host is not in an MPI environment; on one node it is this host
            master_addr=environ.get("MASTER_ADDR") or ("127.0.0.1" if single_node else None),
            master_port=port,
            master_port_derived=derived,
        )


class OpenMpi(_Mpi):
    """Open MPI's ``mpirun`` / ``mpiexec``."""

    name = "openmpi"
    RANK, SIZE = ("OMPI_COMM_WORLD_RANK",), ("OMPI_COMM_WORLD_SIZE",)
    LOCAL_RANK, LOCAL_SIZE = ("OMPI_COMM_WORLD_LOCAL_RANK",), ("OMPI_COMM_WORLD_LOCAL_SIZE",)
    JOB_ID = ("OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid", "PMIX_NAMESPACE")

    @staticmethod
    def matches(environ: Mapping[str, str]) -> bool:
        return "OMPI_COMM_WORLD_SIZE" in environ


class Mvapich(_Mpi):
    """MVAPICH2's ``mpirun_rsh`` / ``mpiexec``."""

    name = "mvapich"
    RANK, SIZE = ("MV2_COMM_WORLD_RANK",), ("MV2_COMM_WORLD_SIZE",)
    LOCAL_RANK, LOCAL_SIZE = ("MV2_COMM_WORLD_LOCAL_RANK",), ("MV2_COMM_WORLD_LOCAL_SIZE",)
    JOB_ID = ("MPIRUN_ID", "SLURM_JOB_ID")

    @staticmethod
    def matches(environ: Mapping[str, str]) -> bool:
        return "MV2_COMM_WORLD_SIZE" in environ


class Mpich(_Mpi):
    """PMI launchers: MPICH / Intel MPI (hydra). Not ``srun --mpi=pmi2``, whose PMI variables
    repeat the task's SLURM ones: those also name the nodes (see :func:`_srun_ran_pmi`)."""

    name = "mpich"
    RANK, SIZE = ("PMI_RANK", "PMIX_RANK"), ("PMI_SIZE",)
    LOCAL_RANK, LOCAL_SIZE = ("MPI_LOCALRANKID",), ("MPI_LOCALNRANKS",)
    JOB_ID = ("PMI_KVSNAME", "PMIX_NAMESPACE", "SLURM_JOB_ID")

    @staticmethod
    def matches(environ: Mapping[str, str]) -> bool:
        has_pmi = "PMI_SIZE" in environ and ("PMI_RANK" in environ or "PMIX_RANK" in environ)
        return has_pmi and not _srun_ran_pmi(environ)


def _srun_ran_pmi(environ: Mapping[str, str]) -> bool:
    """Whether srun itself gave this task its PMI rank (``--mpi=pmi2``): the PMI rank and size are
    the task's SLURM_PROCID and step size. ``mpirun`` inside an allocation leaves SLURM variables of
    the allocation or of hydra's proxies instead, which differ (or agree with the ranks exactly:
    one rank per node, in node order)."""
    if not Slurm.matches(environ):
        return False
    pmi_rank = environ.get("PMI_RANK", environ.get("PMIX_RANK"))
    tasks = environ.get("SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS"))
    return pmi_rank == environ["SLURM_PROCID"] and environ.get("PMI_SIZE") == tasks


class Slurm(Environment):
    """A task started by ``srun`` (also inside ``sbatch`` / ``salloc``)."""

    name = "slurm"

    @staticmethod
    def matches(environ: Mapping[str, str]) -> bool:
        # an sbatch script has SLURM_PROCID=0 too, but no step: it is not one of N tasks
        return "SLURM_PROCID" in environ and "SLURM_STEP_ID" in environ and "SLURM_NTASKS" in environ

    @classmethod
    def parse(cls, environ: Mapping[str, str]) -> Optional[ClusterEnv]:
        rank = _int(environ, "SLURM_PROCID")
        world = _int(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        if rank is None or world is None:
            return None
        node_rank = _int(environ, "SLURM_NODEID")
        nnodes = _int(environ, "SLURM_STEP_NUM_NODES", "SLURM_NNODES")
        per_node_spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
        nproc = None
        if per_node_spec and node_rank is not None:
            per_node = expand_tasks_per_node(per_node_spec)
            if node_rank < len(per_node):
                nproc = per_node[node_rank]
        nodelist = (
            environ.get("SLURM_STEP_NODELIST")
            or environ.get("SLURM_JOB_NODELIST")
            or environ.get("SLURM_NODELIST")
        )
        master = environ.get("MASTER_ADDR") or (expand_nodelist(nodelist)[0] if nodelist else None)
        port, derived = _port(
            environ, environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID"), environ.get("SLURM_STEP_ID")
        )
        return ClusterEnv(
            cls.name,
            rank,
            world,
            local_rank=_int(environ, "SLURM_LOCALID"),
            nproc_per_node=nproc,
            node_rank=node_rank,
            nnodes=nnodes,
            master_addr=master,
            master_port=port,
            master_port_derived=derived,
        )


class Lsf(Environment):
    """IBM Spectrum LSF with ``jsrun`` (JSM)."""

    name = "lsf"

    @staticmethod
    def matches(environ: Mapping[str, str]) -> bool:
        return "LSB_JOBID" in environ and "JSM_NAMESPACE_SIZE" in environ and "JSM_NAMESPACE_RANK" in environ

    @classmethod
    def parse(cls, environ: Mapping[str, str]) -> Optional[ClusterEnv]:
        rank, world = _int(environ, "JSM_NAMESPACE_RANK"), _int(environ, "JSM_NAMESPACE_SIZE")
        if rank is None or world is None:
            return None
        master = environ.get("MASTER_ADDR")
        hosts = environ.get("LSB_MCPU_HOSTS", "").split()
        if master is None and len(hosts) >= 4:
            master = hosts[2]  # "launch-node N compute1 N ...": the first compute host
        port, derived = _port(environ, environ.get("LSB_JOBID"))
        return ClusterEnv(
            cls.name,
            rank,
            world,
            local_rank=_int(environ, "JSM_NAMESPACE_LOCAL_RANK"),
            nproc_per_node=_int(environ, "JSM_NAMESPACE_LOCAL_SIZE"),
            master_addr=master,
            master_port=port,
            master_port_derived=derived,
        )


#: the detection order (see the module docstring for why)
ENVIRONMENTS: tuple[type[Environment], ...] = (
    PyTorchJob,
    RayTrain,
    TorchElastic,
    Horovod,
    OpenMpi,
    Mvapich,
    Mpich,
    Slurm,
    Lsf,
)


def detect_cluster(environ: Mapping[str, str]) -> Optional[ClusterEnv]:
    """The environment of the launcher that started this process, or None (a plain process).

    Values that contradict each other (a rank outside the world, a local rank outside its node)
    are dropped, not trusted.
    """
    for cls in ENVIRONMENTS:
        if cls.matches(environ):
            env = cls.parse(environ)
            if env is not None and 0 <= env.rank < env.world_size:
                return _sanitize(env)
    return None


def _sanitize(env: ClusterEnv) -> ClusterEnv:
    local_rank, nproc, node_rank, nnodes = env.local_rank, env.nproc_per_node, env.node_rank, env.nnodes
    world = env.world_size
    if local_rank is not None and not 0 <= local_rank < world:
        local_rank = None
    if nproc is not None and not 1 <= nproc <= world:
        nproc = None
    if local_rank is not None and nproc is not None and local_rank >= nproc:
        local_rank = nproc = None
    if nnodes is not None and not 1 <= nnodes <= world:
        nnodes = None
    if node_rank is not None and (node_rank < 0 or (nnodes is not None and node_rank >= nnodes)):
        node_rank = None
    if (nproc is not None and nproc == world) or nnodes == 1:
        # every rank is on this node: the rest follows without asking anyone
        nproc, nnodes, node_rank = world, 1, 0
    return replace(env, local_rank=local_rank, nproc_per_node=nproc, node_rank=node_rank, nnodes=nnodes)


def gpu_index(local_rank: int, visible_gpus: int, exclusive: bool, sharing: int = 1) -> Optional[int]:
    """The CUDA device index for a process with this local rank, or None when there is none.

    A process that sees exactly one GPU (SLURM ``--gpus-per-task``, a per-task
    ``CUDA_VISIBLE_DEVICES``) uses ``cuda:0``, whatever its local rank, unless ``sharing``
    processes of the node see that same GPU (no per-task binding) and ``exclusive``: then None.
    Otherwise local rank ``i`` uses ``cuda:i``; with more processes than GPUs, ``exclusive``
    (NCCL: one rank per GPU) gives None, else ranks share GPUs round-robin.

    Example:
        >>> gpu_index(local_rank=3, visible_gpus=1, exclusive=True)
        0
        >>> print(gpu_index(local_rank=0, visible_gpus=1, exclusive=True, sharing=2))
        None
        >>> gpu_index(local_rank=3, visible_gpus=8, exclusive=True)
        3
        >>> gpu_index(local_rank=3, visible_gpus=2, exclusive=False)
        1
    """
    if visible_gpus < 1:
        return None
    if visible_gpus == 1:
        return None if exclusive and sharing > 1 else 0
    if local_rank < visible_gpus:
        return local_rank
    return None if exclusive else local_rank % visible_gpus


def launched_externally(environ: Mapping[str, str]) -> bool:
    """True when some launcher started this process (:func:`detect_cluster` finds an environment).

    Example:
        >>> launched_externally({"RANK": "0", "WORLD_SIZE": "2"})
        True
        >>> launched_externally({})
        False
    """
    return detect_cluster(environ) is not None


def layout_from_environ(environ: Mapping[str, str], rank: int, world_size: int) -> PartialLayout:
    """This process's node layout from the launcher's variables.

    Only trusted when the environment's rank and world size match the live process group, so a
    stale environment (a group built by hand with other ranks) is ignored instead of producing
    wrong local ranks.

    Args:
        environ: the environment, usually ``os.environ``.
        rank: rank of this process in the live default group.
        world_size: size of the live default group.

    Example:
        >>> layout_from_environ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, rank=1, world_size=2)
        PartialLayout(local_rank=1, nproc_per_node=None, node_rank=None, nnodes=None)
    """
    env = detect_cluster(environ)
    if env is None:
        # torchrun-style variables without RANK/WORLD_SIZE (a lone LOCAL_RANK from
        # torch.distributed.launch --use_env, a node rank set by a job script) are still hints
        hints = TorchElastic.parse({**environ, "RANK": str(rank), "WORLD_SIZE": str(world_size)})
        assert hints is not None
        return _sanitize(hints).layout
    if env.rank != rank or env.world_size != world_size:
        return PartialLayout()
    return env.layout


# ============================================================================ Kubernetes jobs
@dataclass(frozen=True)
class KubernetesJob:
    """What a job operator told this pod about the job; ``None``: not said.

    ``operator``: ``"pytorchjob"`` (Kubeflow training-operator v1), ``"trainjob"`` (Kubeflow
    Trainer v2) or ``"torchx"`` (TorchX ``dist.ddp``, which sets the same variables on every
    scheduler). ``workers_started``: torchrun / ``onedist run`` already started this process as
    one worker (its RANK is then a process rank). The other fields are the ``PET_*`` values.
    """

    operator: str
    workers_started: bool
    nnodes: Optional[str] = None
    node_rank: Optional[int] = None
    nproc_per_node: Optional[str] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None


def kubernetes_job(environ: Mapping[str, str]) -> Optional[KubernetesJob]:
    """The job operator whose variables this process has, or None.

    Example:
        >>> job = kubernetes_job({"PET_NNODES": "2", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "1",
        ...                       "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29500"})
        >>> (job.operator, job.workers_started, job.nnodes, job.node_rank, job.nproc_per_node)
        ('trainjob', False, '2', 1, '4')
        >>> (job.master_addr, job.master_port)
        ('job-node-0-0.job', 29500)
    """
    if "TORCHX_TRACKING_RUN_NAME" in environ or "TORCHX_RANK0_HOST" in environ:
        operator = "torchx"
    elif (
        _pytorchjob_pod(environ)
        or "PET_RDZV_ENDPOINT" in environ  # an elasticPolicy; Trainer v2 never sets it
        or environ.get("PET_MASTER_ADDR", "").endswith("-master-0")  # v1's name for the master pod
    ):
        operator = "pytorchjob"
    elif all(name in environ for name in TRAINJOB_VARS):
        operator = "trainjob"
    else:
        return None
    return KubernetesJob(
        operator,
        _workers_started(environ),
        nnodes=environ.get("PET_NNODES"),
        node_rank=_int(environ, "PET_NODE_RANK"),
        nproc_per_node=environ.get("PET_NPROC_PER_NODE"),
        master_addr=environ.get("PET_MASTER_ADDR") or environ.get("MASTER_ADDR") or None,
        master_port=_int(environ, "PET_MASTER_PORT", "MASTER_PORT"),
    )


_START_WITH_A_LAUNCHER = (
    "HINT: start the container's script with `onedist run train.py` (or torchrun): it reads "
    "PET_NPROC_PER_NODE, PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT and starts "
    "this pod's workers"
)


def pod_start_problem(environ: Mapping[str, str]) -> Optional[str]:
    """Why this pod's process cannot take part as it was started, or None.

    A job of several processes per pod, or of several pods, needs torchrun or ``onedist run`` in
    each pod; started with plain ``python``, a PyTorchJob pod's process would wait forever for a
    group whose WORLD_SIZE counts processes that never start (RANK is the pod's index, the trap of
    Lightning-AI issue #13374), and a TrainJob pod's process would train alone.

    Example:
        >>> print(pod_start_problem({"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456",
        ...     "WORLD_SIZE": "4", "RANK": "1", "PET_NODE_RANK": "1", "PET_NNODES": "2",
        ...     "PET_NPROC_PER_NODE": "2"}))  # doctest: +ELLIPSIS
        this Kubeflow PyTorchJob pod's process was started without torchrun or onedist run: RANK=1 ...
    """
    job = kubernetes_job(environ)
    if job is None or job.workers_started:
        return None
    if job.operator == "pytorchjob" and _pytorchjob_pod(environ) and PyTorchJob.parse(environ) is None:
        return (
            "this Kubeflow PyTorchJob pod's process was started without torchrun or onedist run: "
            f"RANK={environ['RANK']} is the pod's index (its node rank), not a process rank, and "
            f"WORLD_SIZE={environ['WORLD_SIZE']} counts the processes of PET_NNODES={job.nnodes} pods "
            f"with PET_NPROC_PER_NODE={job.nproc_per_node}: one process per pod cannot form that group "
            f"(Lightning-AI issue #13374)\n{_START_WITH_A_LAUNCHER}"
        )
    if job.operator == "trainjob" and "RANK" not in environ:
        nnodes, nproc = _int(environ, "PET_NNODES") or 1, _int(environ, "PET_NPROC_PER_NODE") or 1
        if nnodes > 1 or nproc > 1:
            return (
                "this Kubeflow TrainJob pod's process was started without torchrun or onedist run: the "
                f"job has PET_NNODES={job.nnodes} nodes of PET_NPROC_PER_NODE={job.nproc_per_node} "
                f"processes, and this one would train alone\n{_START_WITH_A_LAUNCHER}"
            )
    return None


def kubernetes_warnings(environ: Mapping[str, str]) -> list[str]:
    """``onedist info``'s warnings about this pod, each one line ending in a ``HINT:``.

    Example:
        >>> kubernetes_warnings({"PET_RDZV_ENDPOINT": "job-worker-0:23456", "PET_RDZV_BACKEND": "etcd",
        ...                      "PET_NNODES": "1:4"})  # doctest: +ELLIPSIS
        ['this elastic Kubeflow PyTorchJob (PET_NNODES=1:4, PET_RDZV_BACKEND=etcd) needs...']
    """
    found = []
    problem = pod_start_problem(environ)
    if problem is not None:
        found.append(problem.replace("\nHINT:", "; HINT:"))
    job = kubernetes_job(environ)
    # onedist run meets the nodes of an elastic job through torch's c10d rendezvous (Kubeflow's default)
    c10d = environ.get("PET_RDZV_BACKEND") == "c10d"
    if job is not None and not job.workers_started and "PET_RDZV_ENDPOINT" in environ and not c10d:
        low, _, high = (job.nnodes or "1").partition(":")
        elastic = bool(high) and high != low
        if elastic or (job.node_rank is None and (high or low) != "1"):
            found.append(
                f"this elastic Kubeflow PyTorchJob (PET_NNODES={job.nnodes}, "
                f"PET_RDZV_BACKEND={environ.get('PET_RDZV_BACKEND')}) needs PET_RDZV_BACKEND=c10d: "
                "onedist run numbers the nodes of an elasticPolicy without a Master replica through the "
                "c10d rendezvous only; HINT: set rdzvBackend in the elasticPolicy to c10d (its "
                "default), or drop the elasticPolicy and give the job a Master replica"
            )
    return found
