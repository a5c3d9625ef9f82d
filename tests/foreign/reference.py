"""The control side of a foreign suite, recorded once per environment instead of run every time.

ignite's suite on ignite and torch's suite on gloo are the controls that onedist's runs are judged
against (:mod:`suite_compare`): they do not depend on onedist, yet they took half of each runner's
time (ignite's suite: 5.7 of 11.4 min in CI). Their outcomes are recorded in ``reference/`` under
the facts that decide them (:func:`environment`: the suite's and torch's versions, Python's, the
launchers and optional packages present, the GPUs, and a digest of the runner's files that define
which tests the control runs); a run whose facts match a recorded file judges onedist against it
and runs only onedist's side. Where none matches (another torch, a machine without Horovod, a
changed runner file), the control runs as before and its outcomes are written as a new file,
which a commit makes the reference for that environment. ``--record`` runs the control again and
rewrites the file (a flaky control outcome, a new ignite test).
"""

from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import json
import platform
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Optional

from suite_compare import Outcomes, compare

FOLDER = Path(__file__).resolve().parent / "reference"

#: the launchers and optional packages whose presence changes which control tests run
_LAUNCHERS = ("mpirun", "srun", "scontrol", "horovodrun")
_PACKAGES = ("torch", "pytorch-ignite", "horovod", "torch-xla")


def environment(suite: str, inputs: Iterable[Path], settings: object) -> dict[str, str]:
    """The facts a control's outcomes depend on; ``inputs`` are the runner's files that decide
    which tests run and how, ``settings`` its values that do (the passes' arguments): digested."""
    digest = hashlib.sha256(repr(settings).encode())
    for path in sorted(inputs):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    facts = {
        "suite": suite,
        "python": ".".join(platform.python_version_tuple()[:2]),
        "machine": platform.machine(),
        "launchers": ",".join(name for name in _LAUNCHERS if shutil.which(name)),
        "gpus": str(len(glob.glob("/dev/nvidia[0-9]*"))),
        "inputs": digest.hexdigest()[:16],
    }
    for package in _PACKAGES:
        facts[package] = _version(package)
    return facts


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def path_for(facts: dict[str, str]) -> Path:
    key = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:12]
    return FOLDER / f"{facts['suite']}-{key}.json"


def load(facts: dict[str, str], passes: Iterable[str]) -> Optional[Outcomes]:
    """The recorded outcomes of ``passes`` under ``facts``; None when no file has them all."""
    path = path_for(facts)
    if not path.exists():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    if data["facts"] != facts or not set(passes) <= set(data["passes"]):
        return None
    wanted = set(passes)
    return {k: (o, text) for k, (o, text) in data["outcomes"].items() if k.split("::", 1)[0] in wanted}


def save(facts: dict[str, str], passes: Iterable[str], outcomes: Outcomes) -> Path:
    """Write the control's outcomes (one line per test, for readable diffs); the texts are cut to
    what a verdict reads (a skip's reason, a failure's last line)."""
    path = path_for(facts)
    FOLDER.mkdir(exist_ok=True)
    lines = [f"  {json.dumps(k)}: {json.dumps([o, _short(o, t)])}" for k, (o, t) in sorted(outcomes.items())]
    head = json.dumps({"facts": facts, "passes": sorted(passes)}, sort_keys=True)[:-1]
    path.write_text(head + ', "outcomes": {\n' + ",\n".join(lines) + "\n}}\n", encoding="utf-8")
    return path


def _short(outcome: str, text: str) -> str:
    if outcome == "passed" or not text:
        return ""
    return text.strip().splitlines()[-1][-300:]


def caught(
    control: Outcomes, broken: Outcomes, exempt_reason: Callable[[str], Optional[str]], what: str
) -> bool:
    """The self-check's verdict, printed: whether the tests of ``control`` (the recorded side) that
    a run on a subject broken on purpose (``broken``: see sabotage.py) made fail are found. No
    known failures apply: a broken subject must fail where the real one passes."""
    found = compare(control, broken, exempt_reason, [], "the broken subject")
    passing = sum(1 for outcome, _ in control.values() if outcome == "passed")
    print(
        f"  self-check: {what} broken on purpose fails {len(found)} of the {passing} tests it runs that "
        "pass on the control" + ("" if found else ": NOT CAUGHT, the run is void"),
        flush=True,
    )
    return bool(found)


def describe(path: Path) -> str:
    return str(path.relative_to(FOLDER.parent.parent.parent))
