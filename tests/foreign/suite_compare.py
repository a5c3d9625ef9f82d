"""What the foreign-suite runners (ignite_suite.py, torch_suite.py) share: reading the outcomes a
run wrote, and comparing a subject's outcomes with its control's, test by test.

Outcomes are ``key -> (outcome, failure text)``, outcome one of ``passed``, ``xfailed``,
``skipped``, ``failed``, ``not run``; a key names the pass and the test, the same in both runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

Outcomes = dict[str, tuple[str, str]]

# when one test has several reports (phases, xdist workers, ranks), the worst one counts
_SEVERITY = {"passed": 0, "xfailed": 0, "skipped": 1, "failed": 2}


def fold(records: Iterable[dict[str, str]], key: str) -> Outcomes:
    """One outcome per ``record[key]``: failed if any report of it failed, else skipped if any
    was skipped, else passed."""
    result: Outcomes = {}
    for rec in records:
        outcome = rec["outcome"]
        old = result.get(rec[key])
        if old is None or _SEVERITY[outcome] > _SEVERITY[old[0]]:
            result[rec[key]] = (outcome, rec.get("longrepr") or rec.get("text") or "")
    return result


def read_jsonl(path: Path) -> list[dict[str, str]]:
    """The records of a JSON-lines file (none when it does not exist)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def compare(
    control: Outcomes,
    subject: Outcomes,
    exempt_reason: Callable[[str], str | None],
    known_failures: Iterable[str],
    name: str,
) -> list[str]:
    """The surprises: a test that passes on the control and not on the subject (``name``) without
    being exempt or listed as a known failure, a listed failure that passes now, and a listed
    failure that does not pass on the control (a stale entry)."""
    known = set(known_failures)
    problems = []
    for key, (outcome, _) in sorted(control.items()):
        if outcome != "passed" or exempt_reason(key):
            continue
        got, text = subject.get(key, ("not run", ""))
        if key in known:
            if got == "passed":
                problems.append(f"PASSES NOW (remove from KNOWN_FAILURES): {key}")
            continue
        if got != "passed":
            last = text.strip().splitlines()[-1:] or [""]
            problems.append(f"{got.upper()} on {name}, passes on the control: {key}\n      {last[0][:300]}")
    ran = {key.split("::", 1)[0] for key in control}  # the passes of this run
    for key in sorted(known):
        if key.split("::", 1)[0] in ran and control.get(key, ("",))[0] != "passed":
            problems.append(f"LISTED but does not pass on the control (stale entry): {key}")
    return problems
