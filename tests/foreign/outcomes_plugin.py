"""A pytest plugin for the foreign-suite runners: one JSON line per test report.

Loaded with ``-p outcomes_plugin`` (its folder on ``PYTHONPATH``); writes to the file named by
``ONEDIST_OUTCOMES``. Under pytest-xdist the controller sees every worker's reports, so each
line carries the worker that ran it (``--dist=each`` runs every test once per worker).
"""

from __future__ import annotations

import json
import os
from typing import Any


def pytest_runtest_logreport(report: Any) -> None:
    path = os.environ.get("ONEDIST_OUTCOMES")
    if not path or (report.when != "call" and report.outcome == "passed"):
        return
    worker = getattr(getattr(report, "node", None), "gateway", None)
    line = {
        "nodeid": report.nodeid,
        "when": report.when,
        "outcome": "xfailed" if hasattr(report, "wasxfail") else report.outcome,
        "worker": getattr(worker, "id", "main"),
        "seconds": round(float(getattr(report, "duration", 0.0)), 2),
        # a failure's text, or a skip's reason (the runners print why a part did not apply here)
        "longrepr": str(report.longrepr)[-4000:] if report.failed or report.skipped else "",
    }
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")


def pytest_collectreport(report: Any) -> None:
    """A module skipped as a whole (``pytest.skip(..., allow_module_level=True)``, as ignite's Horovod
    tests do without Horovod): one record for the file, with the reason."""
    path = os.environ.get("ONEDIST_OUTCOMES")
    if not path or not report.skipped:
        return
    line = {"nodeid": report.nodeid, "when": "collect", "outcome": "skipped", "worker": "main"}
    line["longrepr"] = str(report.longrepr)[-4000:]
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")
