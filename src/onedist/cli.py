"""The ``onedist`` command: ``onedist run``, ``onedist info`` and ``onedist --version``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from typing import Any, Optional

from ._version import __version__
from .environments import TORCHRUN_VARS, TRAINJOB_VARS

__all__ = ["main"]

# environment variables worth showing; never dump the whole environment (it may hold secrets)
_LAUNCHER_VARS = (
    *TORCHRUN_VARS,
    "TORCHELASTIC_RUN_ID",
    *TRAINJOB_VARS,  # the Kubernetes operators' (torchrun's PET_* flag defaults)
    "PET_RDZV_ENDPOINT",
    "PET_RDZV_BACKEND",
    "TORCHX_RANK0_HOST",
    "SLURM_JOB_ID",
    "SLURM_PROCID",
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
    "HOROVOD_RANK",
    "CUDA_VISIBLE_DEVICES",
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "ONEDIST_BACKEND",
)


def _info() -> dict[str, Any]:
    import importlib.util

    import torch

    import onedist

    from ._diagnose import network_report, warnings as launch_warnings
    from .environments import detect_cluster, kubernetes_job

    env = detect_cluster(os.environ)
    job = kubernetes_job(os.environ)
    optional = {}
    for module in ("horovod", "torch_xla", "mpi4py", "hostlist"):
        optional[module] = importlib.util.find_spec(module) is not None
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backends = list(onedist.available_backends())
    # every probe has a short timeout: info stays fast even with an unroutable MASTER_ADDR
    network = network_report(os.environ)
    return {
        "onedist": __version__,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "gpus": gpus,
        "available_backends": backends,
        "detected_environment": asdict(env) if env is not None else None,
        # the job operator (Kubeflow PyTorchJob / TrainJob, TorchX) whose variables this pod has
        "kubernetes": asdict(job) if job is not None else None,
        "optional_packages": optional,
        "launcher_environment": {k: os.environ[k] for k in _LAUNCHER_VARS if k in os.environ},
        "network": network,
        # advice, not errors: `onedist info` still exits 0
        "warnings": launch_warnings(os.environ, network=network, available_backends=backends, gpu_count=gpus),
    }


def _print_human(data: dict[str, Any]) -> None:
    """``key: value`` lines, the network report indented, and the warnings last."""
    for key, value in data.items():
        if key == "warnings":
            continue
        if key == "network" and isinstance(value, dict):
            print(f"{key}:")
            for sub, item in value.items():
                print(f"  {sub}: {item}")
            continue
        print(f"{key}: {value}")
    for warning in data.get("warnings", []):
        print(f"WARNING: {warning}")


def main(argv: Optional[list[str]] = None) -> int:
    """Run the ``onedist`` command line.

    Example:
        >>> from onedist.cli import main
        >>> try:
        ...     main(["--version"])
        ... except SystemExit as done:                              # argparse's --version exits
        ...     print("exit status", done.code)
        onedist ...
        exit status 0
    """
    parser = argparse.ArgumentParser(
        prog="onedist", description="One PyTorch script, every backend and launcher."
    )
    parser.add_argument("--version", action="version", version=f"onedist {__version__}")
    sub = parser.add_subparsers(dest="command")
    info = sub.add_parser("info", help="what is installed, which backends work here, what launcher set")
    info.add_argument("--json", action="store_true", help="print JSON")
    from .launchers.run import build_parser, split_at_target

    run = build_parser(sub.add_parser("run", help="start the workers of a script (torchrun-compatible)"))
    argv = sys.argv[1:] if argv is None else list(argv)
    script_args = None
    if argv[:1] == ["run"]:
        head, script_args = split_at_target(run, argv[1:])
        argv = ["run", *head]
    args = parser.parse_args(argv)
    if script_args is not None:
        args.args = script_args
    if args.command == "run":
        from .launchers.run import main as run_main

        return run_main(args)
    if args.command == "info":
        data = _info()
        if args.json:
            print(json.dumps(data, indent=2))
        else:
            _print_human(data)
        return 0
    parser.print_help()
    return 0
