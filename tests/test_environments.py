"""Launcher environments, parsed from plain dicts (the real launchers run in test_launchers.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from launch_env import SLURM_MPI_PREFIXES, strip_launcher_vars
from onedist.environments import (
    ClusterEnv,
    PartialLayout,
    detect_cluster,
    expand_nodelist,
    expand_tasks_per_node,
    gpu_index,
    launched_externally,
    layout_from_environ,
)

TORCHRUN_NODE1 = {
    "RANK": "5",
    "WORLD_SIZE": "6",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "2",
    "GROUP_WORLD_SIZE": "3",
    "MASTER_ADDR": "n0",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "abc",
}

# rank 3 of 4 in `srun -N2 -n4` with 3 tasks on the first node and 1 on the second
SRUN_3_PLUS_1 = {
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "0",
    "SLURM_NTASKS": "4",
    "SLURM_NODEID": "1",
    "SLURM_NNODES": "2",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_TASKS_PER_NODE": "3,1",
    "SLURM_STEP_TASKS_PER_NODE": "3,1",
    "SLURM_JOB_NODELIST": "gpu-a[01-02]",
    "SLURM_STEP_NODELIST": "gpu-a[01-02]",
}


def test_torchrun_variables_give_the_full_layout():
    env = detect_cluster(TORCHRUN_NODE1)
    assert env == ClusterEnv("torchelastic", 5, 6, 1, 2, 2, 3, "n0", 29500)
    assert layout_from_environ(TORCHRUN_NODE1, rank=5, world_size=6) == PartialLayout(1, 2, 2, 3)


def test_uneven_torchrun_layout_three_plus_one():
    node0 = {
        "RANK": "2",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "2",
        "LOCAL_WORLD_SIZE": "3",
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "2",
    }
    node1 = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
    }
    assert layout_from_environ(node0, 2, 4) == PartialLayout(2, 3, 0, 2)
    assert layout_from_environ(node1, 3, 4) == PartialLayout(0, 1, 1, 2)


def test_stale_environment_of_another_group_is_ignored():
    assert layout_from_environ(TORCHRUN_NODE1, rank=0, world_size=2) == PartialLayout()


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"LOCAL_RANK": "1"}, PartialLayout(1, None, None, None)),
        ({"LOCAL_RANK": "x"}, PartialLayout()),
        ({"LOCAL_RANK": "7"}, PartialLayout()),  # out of range for a world of 4
        ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, PartialLayout(1, 4, 0, 1)),  # all ranks here
        ({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"}, PartialLayout(None, None, None, None)),  # inconsistent
        ({"NODE_RANK": "1", "GROUP_WORLD_SIZE": "2"}, PartialLayout(None, None, 1, 2)),
        ({"GROUP_WORLD_SIZE": "1"}, PartialLayout(None, 4, 0, 1)),
    ],
)
def test_partial_and_bad_values(env, expected):
    assert layout_from_environ(env, rank=1, world_size=4) == expected


def test_launched_externally():
    assert launched_externally(TORCHRUN_NODE1)
    assert launched_externally(SRUN_3_PLUS_1)
    assert not launched_externally({"RANK": "0"})
    assert not launched_externally({"RANK": "", "WORLD_SIZE": "2"})
    assert PartialLayout(0, 1, 0, 1).complete() and not PartialLayout(0).complete()


# ---------------------------------------------------------------------------- SLURM
@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("gpu-a[01-04,07],cpu9", ["gpu-a01", "gpu-a02", "gpu-a03", "gpu-a04", "gpu-a07", "cpu9"]),
        ("node[001-002],big[8-9]", ["node001", "node002", "big8", "big9"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("single", ["single"]),
    ],
)
def test_nodelists_with_several_bracket_groups_and_padding(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize(
    "spec, counts",
    [("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1,3(x2)", [1, 3, 3]), (" 2(x2) , 5 ", [2, 2, 5])],
)
def test_tasks_per_node_repetition_syntax(spec, counts):
    assert expand_tasks_per_node(spec) == counts


def test_tasks_per_node_garbage_names_the_value():
    with pytest.raises(ValueError, match=r"'2\(y3\)'"):
        expand_tasks_per_node("2(y3)")


def test_srun_uneven_three_plus_one():
    env = detect_cluster(SRUN_3_PLUS_1)
    assert env is not None and env.name == "slurm"
    assert (env.rank, env.world_size, env.local_rank, env.nproc_per_node, env.node_rank, env.nnodes) == (
        3,
        4,
        0,
        1,
        1,
        2,
    )
    assert env.master_addr == "gpu-a01"
    assert env.master_port == 20000 + 123456 % 20000 and env.master_port_derived
    rank1 = detect_cluster({**SRUN_3_PLUS_1, "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0"})
    assert rank1 is not None and (rank1.local_rank, rank1.nproc_per_node, rank1.node_rank) == (1, 3, 0)
    assert rank1.master_port == env.master_port  # every task derives the same port
    step2 = detect_cluster({**SRUN_3_PLUS_1, "SLURM_STEP_ID": "2"})  # a second step running at once
    assert step2.master_port == 20000 + (123456 + 2 * 7919) % 20000 != env.master_port


def test_srun_respects_master_port_and_repetition_counts():
    env = detect_cluster(
        {
            **SRUN_3_PLUS_1,
            "MASTER_PORT": "29400",
            "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
            "SLURM_NTASKS": "4",
            "SLURM_NODEID": "1",
            "SLURM_LOCALID": "1",
        }
    )
    assert env is not None and env.master_port == 29400 and not env.master_port_derived
    assert (env.local_rank, env.nproc_per_node) == (1, 2)
    assert env.rendezvous_env()["MASTER_PORT"] == "29400"


def test_sbatch_script_itself_is_not_a_distributed_run():
    batch = {k: v for k, v in SRUN_3_PLUS_1.items() if k != "SLURM_STEP_ID"}
    assert detect_cluster(batch) is None


def test_torchrun_inside_srun_uses_torchrun_values():
    inside = {**SRUN_3_PLUS_1, **TORCHRUN_NODE1}
    env = detect_cluster(inside)
    assert env is not None and env.name == "torchelastic" and env.rank == 5


# ---------------------------------------------------------------------------- MPI, Horovod, LSF
def test_open_mpi_single_node():
    env = detect_cluster(
        {
            "OMPI_COMM_WORLD_RANK": "1",
            "OMPI_COMM_WORLD_SIZE": "3",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
            "OMPI_MCA_ess_base_jobid": "98765",
        }
    )
    assert env == ClusterEnv("openmpi", 1, 3, 1, 3, 0, 1, "127.0.0.1", 20000 + 98765 % 20000, True)


def test_open_mpi_multi_node_needs_rank_zero_host():
    env = detect_cluster(
        {
            "OMPI_COMM_WORLD_RANK": "3",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
        }
    )
    assert env is not None and env.master_addr is None and env.node_rank is None and env.nproc_per_node == 1
    with_master = detect_cluster(
        {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "MASTER_ADDR": "h0"}
    )
    assert with_master is not None and with_master.master_addr == "h0"


def test_open_mpi_inside_salloc_wins_over_slurm():
    env = detect_cluster({**SRUN_3_PLUS_1, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"})
    assert env is not None and env.name == "openmpi" and env.world_size == 2


def test_mpich_intel_pmi_and_mvapich():
    pmi = detect_cluster(
        {
            "PMI_RANK": "2",
            "PMI_SIZE": "4",
            "MPI_LOCALRANKID": "0",
            "MPI_LOCALNRANKS": "2",
            "PMI_KVSNAME": "kvs_77_0",
        }
    )
    assert pmi is not None and (pmi.name, pmi.rank, pmi.world_size, pmi.local_rank, pmi.nproc_per_node) == (
        "mpich",
        2,
        4,
        0,
        2,
    )
    assert pmi.master_port == 20000 + 770 % 20000
    mv = detect_cluster(
        {
            "MV2_COMM_WORLD_RANK": "0",
            "MV2_COMM_WORLD_SIZE": "2",
            "MV2_COMM_WORLD_LOCAL_RANK": "0",
            "MV2_COMM_WORLD_LOCAL_SIZE": "2",
        }
    )
    assert mv is not None and mv.name == "mvapich" and mv.nnodes == 1 and mv.master_addr == "127.0.0.1"


# task 1 of `srun -N1 -n2 --mpi=pmi2` (the variables detection reads; the real run: tests/test_slurm.py)
SRUN_PMI2_TASK_1 = {
    **{"SLURM_JOB_ID": "12", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "1"},
    **{"SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NODEID": "0", "SLURM_STEP_NUM_NODES": "1"},
    **{"SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "node7"},
    **{"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": "5"},
}


def test_srun_pmi2_tasks_are_slurm_tasks_and_mpirun_in_an_allocation_is_mpi():
    """`srun --mpi=pmi2`: the PMI rank and size repeat the task's SLURM ones, which also say where
    rank 0 runs (the node list): read as slurm. `mpirun` (hydra) inside an allocation leaves the
    SLURM variables of the batch step, which differ from the PMI ranks: read as mpich."""
    task = detect_cluster(SRUN_PMI2_TASK_1)
    assert task is not None and (task.name, task.rank, task.world_size, task.local_rank) == ("slurm", 1, 2, 1)
    assert (task.master_addr, task.nproc_per_node, task.nnodes) == ("node7", 2, 1)
    batch_step = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1"}
    hydra = {"PMI_KVSNAME": "kvs_9_0", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    ranks = detect_cluster({**SRUN_PMI2_TASK_1, **batch_step, **hydra})
    assert ranks is not None and (ranks.name, ranks.rank, ranks.world_size, ranks.local_rank) == (
        "mpich",
        1,
        2,
        1,
    )


def test_pmi_variables_without_the_layout_do_not_claim_several_nodes(monkeypatch):
    """PMI variables that name neither the local ranks nor rank 0's host: initialize says it cannot
    find rank 0, without claiming the ranks are on several nodes (it does not know)."""
    from onedist.backends._rendezvous import prepare_env_rendezvous
    from onedist.errors import OnedistValueError

    strip_launcher_vars(*SLURM_MPI_PREFIXES, monkeypatch=monkeypatch)
    monkeypatch.setenv("PMI_RANK", "1")
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # not installed: nobody to ask
    with pytest.raises(OnedistValueError) as raised:
        prepare_env_rendezvous(None, None, {})
    assert "the mpich environment (rank 1 of 2) does not say where rank 0 runs" in str(raised.value)


def test_mpich_hydra_without_a_job_name():
    """What MPICH 4.0.2's mpiexec.hydra -n 2 set here (no PMI_KVSNAME): on one node the port comes
    from the ranks' parent, the hydra proxy (the same for every rank of the node)."""
    hydra = {"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    env = detect_cluster(hydra)
    assert env is not None and (env.name, env.rank, env.world_size, env.nnodes) == ("mpich", 1, 2, 1)
    assert env.master_addr == "127.0.0.1" and env.master_port_derived
    assert env.master_port == 20000 + os.getppid() % 20000
    two_nodes = detect_cluster({**hydra, "PMI_SIZE": "4"})  # several nodes: each has its own proxy
    assert two_nodes is not None and two_nodes.master_port is None and two_nodes.master_addr is None


def test_horovodrun():
    env = detect_cluster(
        {
            "HOROVOD_RANK": "3",
            "HOROVOD_SIZE": "4",
            "HOROVOD_LOCAL_RANK": "1",
            "HOROVOD_LOCAL_SIZE": "2",
            "HOROVOD_CROSS_RANK": "1",
            "HOROVOD_CROSS_SIZE": "2",
            "OMPI_COMM_WORLD_RANK": "3",
            "OMPI_COMM_WORLD_SIZE": "4",
        }
    )
    assert env is not None and env.name == "horovod"
    assert (env.local_rank, env.nproc_per_node, env.node_rank, env.nnodes) == (1, 2, 1, 2)


def test_lsf_jsrun():
    env = detect_cluster(
        {
            "LSB_JOBID": "5555",
            "JSM_NAMESPACE_RANK": "1",
            "JSM_NAMESPACE_SIZE": "8",
            "JSM_NAMESPACE_LOCAL_RANK": "1",
            "JSM_NAMESPACE_LOCAL_SIZE": "4",
            "LSB_MCPU_HOSTS": "batch1 1 c01 42 c02 42",
        }
    )
    assert env is not None and (env.name, env.rank, env.local_rank, env.nproc_per_node) == ("lsf", 1, 1, 4)
    assert env.master_addr == "c01" and env.master_port == 25555


def test_rank_outside_world_is_not_trusted():
    assert detect_cluster({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "4"}) is None


@pytest.mark.parametrize(
    "local_rank, visible, exclusive, index",
    [
        (3, 1, True, 0),  # per-task binding (--gpus-per-task=1): every task uses cuda:0
        (0, 4, True, 0),
        (3, 4, True, 3),
        (5, 4, True, None),  # NCCL: no GPU of its own
        (5, 4, False, 1),  # gloo may share
        (0, 0, False, None),
    ],
)
def test_gpu_binding(local_rank, visible, exclusive, index):
    assert gpu_index(local_rank, visible, exclusive) == index


def test_one_gpu_seen_by_several_processes_is_none_for_nccl_only():
    # no per-task binding: every local rank sees the same one GPU; NCCL cannot share it, gloo can
    assert [gpu_index(r, 1, exclusive=True, sharing=2) for r in (0, 1)] == [None, None]
    assert [gpu_index(r, 1, exclusive=False, sharing=2) for r in (0, 1)] == [0, 0]
    assert gpu_index(0, 1, exclusive=True, sharing=1) == 0  # alone on the node: its GPU


# ---------------------------------------------------------------------------- no torch
def test_detection_imports_no_torch():
    """Detecting each launcher's environment, and the layout, in a fresh interpreter leaves torch
    unimported."""
    envs = [TORCHRUN_NODE1, SRUN_3_PLUS_1, {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3"},
            {"MV2_COMM_WORLD_RANK": "0", "MV2_COMM_WORLD_SIZE": "2"}, {"PMI_RANK": "1", "PMI_SIZE": "2"},
            {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}, {"RANK": "1", "WORLD_SIZE": "2", "RAY_JOB_ID": "01"},
            {"RANK": "1", "WORLD_SIZE": "2", "PET_NODE_RANK": "1", "PET_NNODES": "2"},
            {"LSB_JOBID": "5", "JSM_NAMESPACE_RANK": "1", "JSM_NAMESPACE_SIZE": "2"}]  # fmt: skip
    code = (
        "import sys\n"
        "from onedist.environments import detect_cluster, layout_from_environ\n"
        f"names = [detect_cluster(e).name for e in {envs!r}]\n"
        f"layout_from_environ({TORCHRUN_NODE1!r}, rank=5, world_size=6)\n"
        "print(names, 'torch' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    names = ["torchelastic", "slurm", "openmpi", "mvapich", "mpich", "horovod", "ray", "pytorchjob", "lsf"]
    assert proc.stdout.strip() == f"{names} False", proc.stdout
