"""The variables torchrun gives a worker, as a script reads them (ids, ports and paths vary)."""

import os


def say(text: str) -> None:
    """One line in one write: lines of ranks sharing the terminal do not interleave."""
    os.write(1, f"rank {os.environ['RANK']}: {text}\n".encode())


SAME = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "OMP_NUM_THREADS",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
]
PRESENT = ["TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "MASTER_ADDR", "MASTER_PORT"]
rank = os.environ["RANK"]
for name in SAME:
    say(f"{name}={os.environ.get(name)}")
for name in PRESENT:
    say(f"{name} set: {bool(os.environ.get(name))}")
