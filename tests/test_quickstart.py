"""The quickstart shows what a person sees in a terminal: its runs of the digits example (one
process, two processes the script starts, torchrun) run in a pseudo-terminal, and each line the page
shows is checked against the screen."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from launch_env import clean_env
from onedist.backends.shm import supported

pytest.importorskip("sklearn", reason="the digits example needs scikit-learn (in the test extra)")
pytest.importorskip("tqdm", reason="od.progress draws its bar with tqdm (lightning's dependency)")
pytestmark = pytest.mark.skipif(not supported(), reason="the page's run picks shm (Linux on x86-64)")

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "docs" / "quickstart.md"
#: the page's commands, and how this test runs each
COMMANDS = {
    "python examples/digits.py --backend none": [sys.executable, "examples/digits.py", "--backend", "none"],
    "python examples/digits.py --nproc-per-node 2": [
        sys.executable, "examples/digits.py", "--nproc-per-node", "2",
    ],
    "torchrun --nproc-per-node 2 examples/digits.py": [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "examples/digits.py",
    ],
}  # fmt: skip
COLUMNS = 100  # the width the page's bars were drawn at


def in_a_terminal(argv: list[str], timeout: float = 240.0) -> tuple[int, str]:
    """Run ``argv`` with a pseudo-terminal of :data:`COLUMNS` columns as its stdin, stdout and
    stderr; its exit status and everything it wrote."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, COLUMNS, 0, 0))
    proc = subprocess.Popen(argv, cwd=ROOT, stdin=follower, stdout=follower, stderr=follower, env=clean_env())
    os.close(follower)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([leader], [], [], 0.5)[0]:
                try:
                    data = os.read(leader, 65536)
                except OSError:  # the terminal closed: every writer is gone
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(leader)
    return proc.wait(), b"".join(chunks).decode(errors="replace")


def screen(written: str) -> list[str]:
    """The lines as the terminal shows them once it is done: a carriage return starts the line
    over (tqdm redraws its bar that way), so each line shows its last drawing."""
    lines = []
    for line in written.replace("\r\n", "\n").split("\n"):
        drawings = [d for d in line.split("\r") if d]
        lines.append(drawings[-1] if drawings else "")
    return lines


def shape(line: str) -> str:
    """A line with what changes between runs evened out: numbers (addresses too), a bar's length,
    and the spaces tqdm pads a number with (" 3.53batch/s" beside "35.30batch/s")."""
    line = re.sub(r"█+", "█", re.sub(r"\d+", "9", re.sub(r"0x[0-9a-f]+", "0x9", line)))
    return re.sub(r" +", " ", line).strip()


def page_block(command: str) -> list[str]:
    """The lines of the page's console block that runs ``command`` (without the command)."""
    text = QUICKSTART.read_text(encoding="utf-8")
    block = text.split(f"```console\n$ {command}\n", 1)[1].split("\n```", 1)[0]
    return block.split("\n")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_run_on_the_page_is_what_a_terminal_shows(command):
    """Each line the page shows (besides its "..." cuts) is on the screen, in that order, numbers
    aside: the configuration on rank 0, one progress bar per epoch drawn over itself, the epoch
    lines and the end of the run."""
    shown = page_block(command)
    assert any("100%|" in line for line in shown), shown  # the page shows the bars
    status, written = in_a_terminal(COMMANDS[command])
    assert status == 0, written[-3000:]
    on_screen = [shape(line) for line in screen(written)]
    at = 0
    for line in shown:
        if line == "...":
            continue
        found = next((i for i in range(at, len(on_screen)) if on_screen[i] == shape(line)), None)
        assert found is not None, (line, "\n".join(screen(written)[at:]))
        at = found + 1
