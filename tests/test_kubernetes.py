"""Kubernetes job operators: the variables each puts in a pod, and onedist under them, for real.

A Kubernetes pod cannot run here (no cluster, no kubelet). Instead each test gives real processes
the exact variables the operator's source sets in a pod (the functions below quote the file and
the version) and runs the real `onedist run` or plain `python` in them, with real worker
processes and a real gloo group. The multi-node cases run one "pod" per network-namespace host
(see tests/test_netns.py), whose /etc/hosts also carries the operators' pod host names, so the
addresses are the operators' own values. Those skip, saying why, without root or iproute2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import pyfork
from launch_env import clean_env
from onedist._diagnose import warnings as launch_warnings
from onedist._net import free_port
from onedist.environments import (
    ClusterEnv,
    KubernetesJob,
    detect_cluster,
    kubernetes_job,
    kubernetes_warnings,
    pod_start_problem,
)
from onedist.errors import OnedistValueError
from onedist.launchers.pet import apply_pet_defaults
from onedist.launchers.run import build_parser
from onedist.launchers.run_spec import check_run_values
from run_helpers import AGREE_SCRIPT, check_agree, onedist_command
from test_netns import CLUSTER, _both, needs_netns

pytestmark = pytest.mark.launcher


# ============================================================================ the operators' variables
def pytorchjob_pod(index: int, pods: int, nproc: str = "auto", job: str = "pyjob", port: int = 23456) -> dict:
    """A Kubeflow PyTorchJob pod with a Master replica: pod 0 is the Master, pod i is Worker i-1.

    github.com/kubeflow/training-operator v1.9.0, pkg/controller.v1/pytorch/envvar.go (setPodEnv:
    WORLD_SIZE = replicas x getNprocPerNodeInt, which is 1 for "auto"; RANK and PET_NODE_RANK = the
    index, +1 for a Worker; PET_NPROC_PER_NODE; PET_NNODES = replicas) and master.go (MASTER_PORT,
    PET_MASTER_PORT = the "pytorchjob-port" container port, 23456 by default; MASTER_ADDR,
    PET_MASTER_ADDR = replicaName(job, Master, 0)); "auto" is nprocPerNode's default
    (pkg/apis/kubeflow.org/v1/pytorch_defaults.go).
    """
    world = pods * (int(nproc) if nproc.isdigit() else 1)
    master = f"{job}-master-0"
    return {
        "PYTHONUNBUFFERED": "1",
        "MASTER_PORT": str(port),
        "PET_MASTER_PORT": str(port),
        "MASTER_ADDR": master,
        "PET_MASTER_ADDR": master,
        "WORLD_SIZE": str(world),
        "RANK": str(index),
        "PET_NODE_RANK": str(index),
        "PET_NPROC_PER_NODE": nproc,
        "PET_NNODES": str(pods),
    }


def pytorchjob_elastic_pod(job: str = "pyjob", port: int = 23456) -> dict:
    """A PyTorchJob with an elasticPolicy (minReplicas 1, maxReplicas 4) and Workers only.

    training-operator v1.9.0, pkg/controller.v1/pytorch/elastic.go: PET_RDZV_ENDPOINT =
    "<job>-worker-0:<port>", PET_RDZV_BACKEND = "c10d" by default, PET_NNODES = "min:max"; no
    Master replica, so envvar.go sets no RANK, WORLD_SIZE or PET_NODE_RANK.
    """
    return {
        "PYTHONUNBUFFERED": "1",
        "PET_NPROC_PER_NODE": "auto",
        "PET_RDZV_ENDPOINT": f"{job}-worker-0:{port}",
        "PET_RDZV_BACKEND": "c10d",
        "PET_NNODES": "1:4",
    }


def trainjob_pod(index: int, nodes: int, nproc: str, job: str = "tjob") -> dict:
    """A Kubeflow Trainer v2 TrainJob trainer pod: these five variables and no other for torch.

    github.com/kubeflow/trainer, pkg/runtime/framework/plugins/torch/torch.go (EnforceMLPolicy:
    petEnvs and masterEnvVars), names and port in pkg/constants/constants.go (TorchEnv*, Node =
    "node", ContainerTrainerPort = 29500); PET_NODE_RANK is the Job completion index.
    """
    return {
        "PET_NNODES": str(nodes),
        "PET_NPROC_PER_NODE": nproc,
        "PET_NODE_RANK": str(index),
        "PET_MASTER_ADDR": f"{job}-node-0-0.{job}",
        "PET_MASTER_PORT": "29500",
    }


def torchx_ddp(replica: int, nnodes: int, nproc: int, rdzv_backend: str = "c10d") -> tuple[dict, str]:
    """TorchX's ``dist.ddp(script="agree.py", j=f"{nnodes}x{nproc}")`` on Kubernetes: the pod's
    variables, and its command line with ``torchrun`` replaced by ``onedist run`` (a bash -c line).

    github.com/pytorch/torchx, torchx/components/dist.py (ddp: TORCHX_TRACKING_EXPERIMENT_NAME,
    TORCHX_TRACKING_RUN_NAME, the torchrun flags; rdzv_endpoint "localhost:0" on one node, else
    "${<rank0_env>:=localhost}:29500"; --node_rank only with rdzv_backend="static") and
    torchx/schedulers/kubernetes_scheduler.py (rank0_env = TORCHX_RANK0_HOST=localhost on the
    first pod, VC_<ROLE>_0_HOSTS, set by Volcano's svc plugin, on the others).
    """
    env = {"TORCHX_TRACKING_EXPERIMENT_NAME": "default-experiment", "TORCHX_TRACKING_RUN_NAME": "agree"}
    env["LOGLEVEL"] = "WARNING"
    rank0_env = "TORCHX_RANK0_HOST" if replica == 0 else "VC_AGREE_0_HOSTS"
    if replica == 0:
        env["TORCHX_RANK0_HOST"] = "localhost"
    endpoint = "localhost:0" if nnodes == 1 else f"${{{rank0_env}:=localhost}}:29500"
    flags = f"--rdzv_backend {rdzv_backend} --rdzv_endpoint {endpoint} --rdzv_id agree-x1 "
    flags += f"--nnodes {nnodes} --nproc_per_node {nproc} --tee 3 --role ''"
    if rdzv_backend == "static":
        flags += f" --node_rank {replica}"
    return env, flags


def torchrun_worker(rank: int, local_rank: int, nproc: int, node: int, nnodes: int) -> dict:
    """What torchrun (or onedist run) adds for one of its workers, on top of the pod's variables."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(nproc * nnodes),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": str(node),
        "GROUP_WORLD_SIZE": str(nnodes),
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "run",
    }


# ============================================================================ detection (plain dicts)
def test_pytorchjob_pod_with_one_process_per_pod_is_that_rank():
    pod = pytorchjob_pod(1, pods=2)
    assert detect_cluster(pod) == ClusterEnv("pytorchjob", 1, 2, 0, 1, 1, 2, "pyjob-master-0", 23456)
    assert kubernetes_job(pod) == KubernetesJob("pytorchjob", False, "2", 1, "auto", "pyjob-master-0", 23456)
    assert pod_start_problem(pod) is None and kubernetes_warnings(pod) == []


def test_a_pre_1_7_pytorchjob_pod_is_a_torchrun_style_rank():
    """Before v1.7 the operator set only MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK (one process
    per pod): plain python is rank RANK of WORLD_SIZE, at the operator's master, with no error and
    no warning (the local layout is then completed from the nodes the ranks publish)."""
    pod = {"PYTHONUNBUFFERED": "1", "MASTER_ADDR": "pyjob-master-0", "MASTER_PORT": "23456",
           "WORLD_SIZE": "2", "RANK": "1"}  # fmt: skip
    assert detect_cluster(pod) == ClusterEnv(
        "torchelastic", 1, 2, None, None, None, None, "pyjob-master-0", 23456
    )
    assert pod_start_problem(pod) is None and kubernetes_warnings(pod) == []
    assert launch_warnings(pod, network={}) == []


def test_pytorchjob_rank_is_a_node_index_when_nproc_per_node_is_2():
    """Lightning-AI #13374: with nprocPerNode 2, RANK=1 is pod 1, not process 1 of WORLD_SIZE=4."""
    pod = pytorchjob_pod(1, pods=2, nproc="2")
    assert detect_cluster(pod) is None  # this process is no rank: a launcher must start the pod's workers
    problem = pod_start_problem(pod)
    assert problem is not None and "RANK=1 is the pod's index" in problem and "WORLD_SIZE=4" in problem
    assert "HINT: start the container's script with `onedist run train.py`" in problem
    found = launch_warnings(pod, network={})
    assert any("Lightning-AI issue #13374" in w and "; HINT:" in w for w in found), found


def test_a_worker_in_a_pod_has_its_launchers_ranks():
    """torchrun / onedist run overwrite RANK and WORLD_SIZE; the pod's PET_* are inherited."""
    worker = {**pytorchjob_pod(1, pods=2, nproc="2"), **torchrun_worker(3, 1, 2, 1, 2)}
    assert detect_cluster(worker) == ClusterEnv("torchelastic", 3, 4, 1, 2, 1, 2, "10.0.0.1", 29500)
    job = kubernetes_job(worker)
    assert job is not None and job.operator == "pytorchjob" and job.workers_started
    assert pod_start_problem(worker) is None


def test_trainjob_pod():
    pod = trainjob_pod(1, nodes=2, nproc="2")
    assert detect_cluster(pod) is None  # only PET_*: torchrun (or onedist run) makes the ranks
    assert kubernetes_job(pod) == KubernetesJob("trainjob", False, "2", 1, "2", "tjob-node-0-0.tjob", 29500)
    problem = pod_start_problem(pod)
    assert problem is not None and "would train alone" in problem
    worker = {**pod, **torchrun_worker(2, 0, 2, 1, 2)}
    assert detect_cluster(worker) == ClusterEnv("torchelastic", 2, 4, 0, 2, 1, 2, "10.0.0.1", 29500)
    assert pod_start_problem(worker) is None
    assert pod_start_problem(trainjob_pod(0, nodes=1, nproc="1")) is None  # one process: nothing to start


def test_torchx_worker():
    env, _ = torchx_ddp(0, nnodes=2, nproc=2)
    job = kubernetes_job({**env, **torchrun_worker(1, 1, 2, 0, 2)})
    assert job is not None and job.operator == "torchx" and job.workers_started
    assert detect_cluster({**env, **torchrun_worker(1, 1, 2, 0, 2)}).name == "torchelastic"


def test_elastic_pytorchjob_is_named_and_warned_about_only_without_c10d():
    """`onedist run` starts an elastic PyTorchJob's pods (c10d, Kubeflow's default: tests/test_elastic.py);
    another rendezvous backend (etcd) is named in a warning."""
    pod = pytorchjob_elastic_pod()
    assert kubernetes_job(pod).operator == "pytorchjob" and detect_cluster(pod) is None
    assert kubernetes_warnings(pod) == []
    (warning,) = kubernetes_warnings({**pod, "PET_RDZV_BACKEND": "etcd"})
    assert "PET_NNODES=1:4" in warning and "needs PET_RDZV_BACKEND=c10d" in warning and "HINT:" in warning


# ============================================================================ PET_* defaults
def _parse(*argv: str, environ: dict) -> argparse.Namespace:
    """What `onedist run` does with its command line first: the PET_* defaults, each value checked."""
    args = build_parser().parse_args([*argv, "train.py"])
    args.from_environment = apply_pet_defaults(args, environ)
    check_run_values(args)
    return args


def test_every_pet_flag_torchrun_reads_is_a_default_here():
    environ = {**trainjob_pod(1, nodes=2, nproc="4"), "PET_MAX_RESTARTS": "2", "PET_RDZV_ID": "job"}
    args = _parse(environ=environ)
    assert (args.nproc_per_node, args.nnodes, args.node_rank) == ("4", 2, 1)  # --nnodes checked: an int
    assert (args.master_addr, args.master_port) == ("tjob-node-0-0.tjob", 29500)
    assert (args.max_restarts, args.rdzv_id, args.module) == (2, "job", False)
    explicit = _parse("-n", "1", "--node_rank", "0", "--master-addr", "other", environ=environ)
    assert (explicit.nproc_per_node, explicit.node_rank, explicit.master_addr) == ("1", 0, "other")
    assert set(explicit.from_environment) == {"nnodes", "master_port", "rdzv_id", "max_restarts"}
    empty = _parse(environ={})
    defaults = (empty.nproc_per_node, empty.nnodes, empty.master_addr, empty.rdzv_backend)
    assert defaults == ("1", 1, "127.0.0.1", "static")


@pytest.mark.parametrize(
    "visible, workers",
    [("0,1,2", 3), ("GPU-5f1c,GPU-77a0", 2), ("0", 1), ("", 1), ("-1", 1)],
    ids=["three-gpus", "two-by-uuid", "one-gpu", "none", "hidden"],
)
def test_pet_nproc_per_node_auto_is_one_worker_per_visible_gpu_else_1(visible, workers, monkeypatch):
    """PyTorchJob's default nprocPerNode "auto": the number of workers `onedist run` starts
    (check_run_values' answer) is the count of GPUs CUDA_VISIBLE_DEVICES shows, and 1 without any."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    args = build_parser().parse_args(["train.py"])
    args.from_environment = apply_pet_defaults(args, {"PET_NPROC_PER_NODE": "auto"})
    assert args.nproc_per_node == "auto"
    assert check_run_values(args) == workers


def test_torchrun_pet_flags_are_all_known():
    """Every flag torchrun reads from PET_* is mapped or listed as ignored (torch/distributed/run.py)."""
    from torch.distributed.argparse_util import check_env, env
    from torch.distributed.run import get_args_parser

    from onedist.launchers.pet import IGNORED, PET_FLAGS

    actions = get_args_parser()._actions
    torchrun = {f"PET_{a.dest.upper()}" for a in actions if isinstance(a, (env, check_env))}
    ours = {flag.variable for flag in PET_FLAGS.values()} | set(IGNORED) | {"PET_NO_PYTHON"}
    assert torchrun <= ours, torchrun - ours


@pytest.mark.parametrize(
    "name, value, allowed",
    [
        ("PET_NPROC_PER_NODE", "two", "an int >= 1, 'auto', 'cpu' or 'gpu'"),
        ("PET_NPROC_PER_NODE", "0", "an int >= 1"),
        ("PET_NNODES", "3:2", "N or MIN:MAX with 1 <= MIN <= MAX"),
        ("PET_NODE_RANK", "-1", "an int >= 0"),
        ("PET_MASTER_PORT", "70000", "an int in 1..65535"),
        ("PET_RDZV_BACKEND", "etcd", "'static', 'c10d'"),
        ("PET_MAX_RESTARTS", "x", "an int >= 0"),
        ("PET_STANDALONE", "yes", "an int (0 = off"),
        ("PET_NO_PYTHON", "1", "0 or unset"),
    ],
)
def test_a_bad_pet_value_names_the_variable(name, value, allowed):
    with pytest.raises(OnedistValueError) as caught:
        _parse(environ={name: value})
    shown = int(value) if name in ("PET_NODE_RANK", "PET_MASTER_PORT") else repr(value)  # ints as numbers
    assert str(caught.value).startswith(f"{name}={shown} is not allowed; allowed: {allowed}")
    if name != "PET_NO_PYTHON":  # the flag wins: the variable is not even read
        flag = "--" + name[4:].lower().replace("_", "-")
        explicit = [flag] if name == "PET_STANDALONE" else [flag, "1" if "PORT" not in name else "29500"]
        if name == "PET_RDZV_BACKEND":
            explicit = [flag, "static"]
        _parse(*explicit, environ={name: value})


def test_rdzv_endpoint_and_master_flags_against_variables():
    pod = {**pytorchjob_elastic_pod(), "PET_NNODES": "2"}  # no minReplicas/maxReplicas: not elastic
    assert _parse(environ=pod).rdzv_endpoint == "pyjob-worker-0:23456"
    # a flag the user typed wins over the pod's variable for the same address
    typed = _parse("--master-addr", "n0", "--master-port", "1234", environ=pod)
    assert (typed.rdzv_endpoint, typed.master_addr, typed.master_port) == (None, "n0", 1234)
    both = _parse(environ={**pytorchjob_pod(0, pods=2), "PET_RDZV_ENDPOINT": "ep:5"})
    assert (both.rdzv_endpoint, both.master_addr, both.master_port) == ("ep:5", "127.0.0.1", None)


def _run(cmd: list[str], env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=clean_env(**env))
    return proc


def test_bad_pet_value_from_the_command_line():
    proc = _run(onedist_command(AGREE_SCRIPT, "/nonexistent"), {"PET_NNODES": "1:4"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("onedist run: PET_NNODES=1:4 is not allowed with --rdzv-backend=static")


# ============================================================================ real processes, one host
def test_pet_nproc_per_node_starts_two_workers(tmp_path):
    """The acceptance line: `PET_NPROC_PER_NODE=2 onedist run ws.py` starts 2 workers, as torchrun."""
    proc = _run(onedist_command(AGREE_SCRIPT, str(tmp_path)), {"PET_NPROC_PER_NODE": "2"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check_agree(tmp_path, 2)
    assert "--nproc-per-node=2 (PET_NPROC_PER_NODE)" in proc.stderr


def test_pytorchjob_pods_with_plain_python_fail_at_once_with_the_fix(tmp_path):
    """nprocPerNode 2, the script started with plain python in both pods (on this host): a clear
    error in each, not a hang; pod 0, the rendezvous host, ends once pod 1 told it its failure."""
    port = free_port()
    pods = [
        {
            **pytorchjob_pod(k, pods=2, nproc="2", port=port),
            "MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_ADDR": "127.0.0.1",
        }
        for k in (0, 1)
    ]
    started = time.monotonic()
    procs = [
        pyfork.popen([sys.executable, AGREE_SCRIPT, str(tmp_path)], env=clean_env(**pod),
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for pod in pods
    ]  # fmt: skip
    errors = [proc.communicate(timeout=60)[1] for proc in procs]
    assert time.monotonic() - started < 8.0  # not pod 0's 10 s hold for a reader
    for proc, err in zip(procs, errors):
        assert proc.returncode != 0
        assert "onedist.initialize: this Kubeflow PyTorchJob pod's process was started without" in err, err
    pod = pods[0]
    info = _run([sys.executable, "-m", "onedist", "info", "--json"], pod, timeout=60)
    data = json.loads(info.stdout)
    assert data["kubernetes"]["operator"] == "pytorchjob" and data["detected_environment"] is None
    assert any("RANK=0 is the pod's index" in w for w in data["warnings"]), data["warnings"]


def test_torchx_single_node_command_line(tmp_path):
    """dist.ddp with j=1x2: c10d on localhost:0 (a free port), --tee 3 --role ''."""
    env, flags = torchx_ddp(0, nnodes=1, nproc=2)
    cmd = f"{' '.join(onedist_command())} {flags} {AGREE_SCRIPT} {tmp_path}"
    proc = _run(["bash", "-c", cmd], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check_agree(tmp_path, 2)


# ============================================================================ two network-namespace "pods"
@pytest.fixture(scope="module")
def pods():
    """Two namespace hosts, nodeA and nodeB, on which /etc/hosts also names the operators' pods:
    PyTorchJob's master (pyjob-master-0) and TrainJob's first node (tjob-node-0-0.tjob) are nodeA."""
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2 (ip) for network namespaces")
    prefix, work = f"ok{os.getpid() % 10000}", Path(tempfile.mkdtemp(prefix="onedist-k8s-"))
    try:
        up = subprocess.run(["bash", str(CLUSTER / "netns_hosts.sh"), "up", prefix, "77", str(work)],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
        if up.returncode != 0:
            pytest.skip(f"`ip netns` is not usable here: {up.stderr.strip()[-300:]}")
        with open(work / "hosts", "a") as hosts:
            hosts.write("10.77.0.1 pyjob-master-0 tjob-node-0-0.tjob\n")

        def on(node: str, variables: dict, cmd: list[str]) -> subprocess.Popen:
            pod = ["env", *(f"{k}={v}" for k, v in variables.items())]
            where = [prefix + node[-1], node, str(work / "hosts")]
            return subprocess.Popen(
                ["bash", str(CLUSTER / "netns_exec.sh"), *where, *pod, *cmd],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
            )  # fmt: skip

        yield on
    finally:
        subprocess.run(["bash", str(CLUSTER / "netns_hosts.sh"), "down", prefix], timeout=60)
        shutil.rmtree(work, ignore_errors=True)


@needs_netns
def test_pytorchjob_two_pods_nproc_2_under_onedist_run(pods, tmp_path):
    """RANK is the pod's index and WORLD_SIZE counts processes: onedist run starts 2 workers per pod
    (as torchrun would) and the 4 ranks are right."""
    _both([pods(node, pytorchjob_pod(k, 2, "2"), [*onedist_command(), AGREE_SCRIPT, str(tmp_path)])
           for k, node in enumerate(("nodeA", "nodeB"))])  # fmt: skip
    check_agree(tmp_path, 4, nnodes=2)


@needs_netns
def test_pytorchjob_two_pods_one_process_each_with_plain_python(pods, tmp_path):
    """nprocPerNode left at "auto" (one process per pod): plain python, the pod's RANK is the rank."""
    _both([pods(node, pytorchjob_pod(k, 2), [sys.executable, AGREE_SCRIPT, str(tmp_path)])
           for k, node in enumerate(("nodeA", "nodeB"))])  # fmt: skip
    check_agree(tmp_path, 2, nnodes=2)


@needs_netns
def test_trainjob_two_nodes_under_onedist_run(pods, tmp_path):
    _both([pods(node, trainjob_pod(k, 2, "1"), [*onedist_command(), AGREE_SCRIPT, str(tmp_path)])
           for k, node in enumerate(("nodeA", "nodeB"))])  # fmt: skip
    check_agree(tmp_path, 2, nnodes=2)


@needs_netns
def test_torchx_static_two_nodes_command_line(pods, tmp_path):
    """dist.ddp(j="2x1", rdzv_backend="static"): the first pod's endpoint is localhost, the other's
    the first pod's host name (VC_AGREE_0_HOSTS)."""
    procs = []
    for k, node in enumerate(("nodeA", "nodeB")):
        env, flags = torchx_ddp(k, nnodes=2, nproc=1, rdzv_backend="static")
        env.update({} if k == 0 else {"VC_AGREE_0_HOSTS": "nodeA"})
        procs.append(
            pods(
                node, env, ["bash", "-c", f"{' '.join(onedist_command())} {flags} {AGREE_SCRIPT} {tmp_path}"]
            )
        )
    _both(procs)
    check_agree(tmp_path, 2, nnodes=2)
