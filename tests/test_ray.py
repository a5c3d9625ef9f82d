"""Ray Train as a launcher, for real: one local Ray cluster for the module (2 CPUs, its own temp
dir, no dashboard), ``TorchTrainer`` with 2 CPU workers running tests/scripts/ray_train.py, an
onedist script whose training function is the one it runs without Ray (auto_model,
auto_dataloader, collectives, ``od.Parallel(backend="gloo")``, ``od.resume``).

Ray Train makes the gloo group itself and sets torchrun's variables before the training function
runs; onedist adopts that group (docs/launchers/ray.md). Skipped, saying why, without ``ray[train]``
(in the test extra).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from launch_env import clean_env
from onedist.environments import detect_cluster

# the module's cluster starts inside the first test's timeout; a loaded 2-core machine is slow
pytestmark = [pytest.mark.launcher, pytest.mark.slow, pytest.mark.timeout(900)]

SCRIPTS = Path(__file__).parent / "scripts"
SRC = Path(__file__).parent.parent / "src"
EPOCHS = 4  # 6 steps an epoch on 2 ranks: 24 steps, a checkpoint every 4
KILL_AFTER = 8  # mid-epoch: the resumed sampler continues inside epoch 2
# set for the cluster's processes (they inherit the driver's environment), restored afterwards:
# workers import onedist and the script from this checkout; no token file in ~/.ray; no preemption
# watcher actor (one process less on 2 cores); a worker group may start slowly on a loaded machine
RAY_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "300",
    "RAY_DEDUP_LOGS": "0",
}


def _ray_missing() -> str | None:
    if importlib.util.find_spec("ray") is None:
        return "ray is not installed (pip install -e '.[test]' installs ray[train])"
    try:
        import ray.train.torch  # noqa: F401  (ray.train needs the [train] extra: pandas, pyarrow)
    except ImportError as e:
        return f"ray.train cannot be imported ({e}); pip install -e '.[test]'"
    return None


@pytest.fixture(scope="module")
def cluster() -> Iterator[Path]:
    """A local Ray cluster of this module's own; yields a folder for the runs' files."""
    missing = _ray_missing()
    if missing:
        print(f"skipping: {missing}")  # visible in CI's log, not only with -rs
        pytest.skip(missing)
    import ray

    tmp = Path(tempfile.mkdtemp(prefix="od-ray-"))  # short: Ray's socket paths must fit 107 bytes
    pythonpath = os.pathsep.join(filter(None, [str(SRC), str(SCRIPTS), os.environ.get("PYTHONPATH")]))
    env = {**RAY_ENV, "PYTHONPATH": pythonpath}
    saved = {k: os.environ.get(k) for k in [*env, "RAY_ADDRESS"]}
    os.environ.pop("RAY_ADDRESS", None)  # a new cluster, never one that happens to run here
    os.environ.update(env)
    sys.path.insert(0, str(SCRIPTS))
    try:
        _start(ray, tmp / "ray")
        yield tmp
    finally:
        ray.shutdown()
        sys.path.remove(str(SCRIPTS))
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(tmp, ignore_errors=True)


def _start(ray: Any, temp_dir: Path) -> None:
    """ray.init, tried twice: Ray gives its node 30 s to register (ray/_private/node.py, not
    configurable), which a loaded 2-core machine can miss."""
    for attempt in (1, 2):
        try:
            ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(temp_dir))
            return
        except Exception as e:
            ray.shutdown()
            if attempt == 2 or "timed out during startup" not in str(e):
                raise
            print(f"ray.init failed ({e}); trying once more")


def _fit(tmp: Path, name: str, max_failures: int = 0, **config: Any) -> Path:
    """TorchTrainer(ray_train.train_loop) on 2 CPU workers, through launchpage_ray.train_loop (which
    records what a worker sees before and after it); the folder the ranks wrote to."""
    import launchpage_ray  # tests/scripts, on sys.path while the cluster runs
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = tmp / name
    out.mkdir()
    trainer = TorchTrainer(
        launchpage_ray.train_loop,
        train_loop_config={"out": str(out), "epochs": EPOCHS, **config},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(
            name=name,
            storage_path=str(tmp / "ray-results"),
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    )
    trainer.fit()
    return out


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def _identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def uninterrupted(cluster: Path) -> Path:
    """One run without failures (checkpoints on): the reference of the tests below."""
    return _fit(cluster, "uninterrupted", checkpoint_dir=str(cluster / "uninterrupted-ckpt"), info=True)


@pytest.fixture(scope="module")
def killed(cluster: Path) -> Path:
    """Rank 1 SIGKILLed after step 8's checkpoint (first attempt only); FailureConfig(max_failures=1)."""
    return _fit(
        cluster,
        "killed",
        max_failures=1,
        checkpoint_dir=str(cluster / "killed-ckpt"),
        kill_after=KILL_AFTER,
    )


def _after(out: Path) -> list[dict[str, Any]]:
    """What each rank saw once the script's function had returned (tests/scripts/launchpage_ray.py)."""
    return [json.loads((out / f"after{r}.json").read_text()) for r in (0, 1)]


def test_ray_train_worker_environment_is_detected() -> None:
    """The variables Ray Train sets (ray/train/torch/config.py) plus a Ray worker's RAY_JOB_ID."""
    ray_worker = {
        "RAY_JOB_ID": "01000000",
        "RAY_RAYLET_PID": "6837",
        "MASTER_ADDR": "192.0.2.2",
        "MASTER_PORT": "43483",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "NODE_RANK": "0",
        "RANK": "1",
        "WORLD_SIZE": "2",
        "ACCELERATE_TORCH_DEVICE": "cpu",
    }
    env = detect_cluster(ray_worker)
    assert env is not None
    assert (env.name, env.rank, env.world_size, env.local_rank, env.nproc_per_node) == ("ray", 1, 2, 1, 2)
    assert (env.node_rank, env.nnodes, env.master_addr, env.master_port) == (0, 1, "192.0.2.2", 43483)
    # torchrun inside a Ray task is torchrun's; a Ray worker without RANK is not a rank
    torchrun = detect_cluster({**ray_worker, "TORCHELASTIC_RUN_ID": "x"})
    assert torchrun is not None and torchrun.name == "torchelastic"
    assert detect_cluster({"RAY_JOB_ID": "01000000", "RAY_RAYLET_PID": "6837"}) is None


def test_unchanged_script_under_torchtrainer(uninterrupted: Path, tmp_path: Path) -> None:
    """Each rank's view and collectives are right, and the weights are bit for bit those of the
    same training function spawned without Ray (od.Parallel(nproc_per_node=2))."""
    seen = [json.loads((uninterrupted / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, s in enumerate(seen):
        assert (s["rank"], s["world_size"], s["local_rank"], s["nproc_per_node"], s["nnodes"]) == (
            rank, 2, rank, 2, 1,
        )  # fmt: skip
        assert (s["backend"], s["environment"]) == ("gloo", "ray")
        assert s["main_thread"] is False  # Ray Train runs the function in a thread of the actor
        assert s["reduced"] == {"n": 3, "t": [1.0, 2.0]}  # a dict of an int and a tensor, summed
        assert s["gathered"] == [0.0, 1.0, 1.0]  # uneven first dimensions, no padding
        assert s["words"] == ["r0", "r1"]
    plain = subprocess.run(
        [sys.executable, str(SCRIPTS / "ray_train.py"), str(tmp_path), str(EPOCHS)],
        capture_output=True,
        text=True,
        timeout=240,
        env=clean_env("RAY_"),
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert json.loads((tmp_path / "rank1.json").read_text())["environment"] == "torchelastic"
    assert _identical(_weights(uninterrupted / "final.pt"), _weights(tmp_path / "final.pt"))


def test_a_raising_worker_fails_the_run_with_its_error(cluster: Path) -> None:
    """Rank 1 raises while rank 0 waits in a collective: the run ends (no hang) and the exception
    the driver gets carries rank 1's error and traceback."""
    with pytest.raises(Exception) as failed:
        _fit(cluster, "raises", raise_at=2)
    elapsed = time.time() - float((cluster / "raises" / "raised").read_text())  # since the raise
    print(f"the run ended {elapsed:.1f} s after rank 1 raised")
    text = str(failed.value)
    assert "ValueError: rank 1 failed on purpose at step 2" in text, text
    assert "Rank 1" in text and "ray_train.py" in text, text  # which rank, and where
    assert type(failed.value).__name__ in ("WorkerGroupError", "TrainingFailedError"), repr(failed.value)
    assert elapsed < 120, f"the run ended {elapsed:.0f} s after rank 1 raised"  # Ray's gloo timeout: 30 min
    assert not (cluster / "raises" / "final.pt").exists()


def test_a_killed_worker_resumes_to_the_uninterrupted_weights(killed: Path, uninterrupted: Path) -> None:
    """Rank 1 SIGKILLed after step 8's checkpoint; FailureConfig(max_failures=1) starts the workers
    again, od.resume loads step 8 on both ranks, and the final weights equal the uninterrupted
    run's bit for bit."""
    out = killed
    assert (out / "killed").exists()  # the first attempt's rank 1 was killed
    assert [(out / f"resumed{r}").read_text() for r in (0, 1)] == [str(KILL_AFTER)] * 2
    assert _identical(_weights(out / "final.pt"), _weights(uninterrupted / "final.pt"))


def test_parallel_leaves_rays_group_alive(uninterrupted: Path) -> None:
    """od.Parallel adopted Ray's group and, leaving, did not destroy it: after the script's function
    returned, the group is still initialised and an all_reduce over it sums both ranks."""
    for seen in _after(uninterrupted):
        assert seen["group_alive"] is True and seen["all_reduce"] == 2.0, seen


def test_restart_count_stays_0_under_ray(uninterrupted: Path, killed: Path) -> None:
    """Ray sets no TORCHELASTIC_RESTART_COUNT: 0 in a run without failures, and 0 again in the
    attempt Ray started after rank 1 was killed (the only one that returned), which resumed at step 8."""
    assert (killed / "killed").exists() and (killed / "resumed0").read_text() == str(KILL_AFTER)
    assert [seen["restart_count"] for seen in _after(uninterrupted) + _after(killed)] == [0] * 4


def test_onedist_info_in_a_ray_worker(uninterrupted: Path) -> None:
    """`python -m onedist info --json` started from rank 0's training function names the
    environment `ray`, with Ray's rank, sizes and local layout."""
    info = _after(uninterrupted)[0]["info"]
    assert isinstance(info, dict), info  # else the command's stderr
    detected = info["detected_environment"]
    assert (detected["name"], detected["rank"], detected["world_size"]) == ("ray", 0, 2), detected
    assert (detected["local_rank"], detected["nproc_per_node"], detected["nnodes"]) == (0, 2, 1), detected


def test_the_function_runs_in_the_runs_artifact_folder(uninterrupted: Path, cluster: Path) -> None:
    """Ray Train (V2) starts the function in the run's artifact folder of its session
    (``<temp dir>/session_*/artifacts/<run name>``), not in the driver's working directory: a
    relative path in the script would land there (ray.md: give absolute paths)."""
    for seen in _after(uninterrupted):
        cwd = Path(seen["cwd"])
        session = cwd.parent.parent
        assert cwd.parts[-2:] == ("artifacts", "uninterrupted") and session.name.startswith("session_"), seen
        assert session.parent == cluster / "ray" and cwd != Path.cwd(), seen


def test_what_ray_sets_up_in_a_worker(uninterrupted: Path) -> None:
    """Before the script runs: torchrun's variables but GROUP_RANK / GROUP_WORLD_SIZE (NODE_RANK
    instead, and ACCELERATE_TORCH_DEVICE), and a process group with a 30-minute timeout (its gloo
    backend: test_unchanged_script_under_torchtrainer)."""
    for r in (0, 1):
        setup = json.loads((uninterrupted / f"setup{r}.json").read_text())
        assert setup["variables"] == [
            "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
            "ACCELERATE_TORCH_DEVICE",
        ], setup  # fmt: skip
        assert setup["timeout_s"] == 1800, setup


def test_the_peer_of_a_killed_worker_fails_at_once(killed: Path) -> None:
    """Rank 1 SIGKILLed: rank 0, in a collective, raises gloo's broken-connection error at once
    (within seconds, not at the group's 30-minute timeout)."""
    failed = json.loads((killed / "failed0.json").read_text())  # the first attempt's rank 0
    assert (failed["type"], failed["module"]) == ("RuntimeError", "builtins"), failed
    assert re.search(r"Connection (closed|reset) by peer", failed["message"]), failed
    after = failed["time"] - (killed / "killed").stat().st_mtime  # the marker is written just before the kill
    print(f"rank 0 failed {after:.2f} s after rank 1 was killed")
    assert after < 60, after
