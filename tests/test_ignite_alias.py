"""onedist.ignite_alias: ``import ignite.distributed`` gives onedist; ignite's internals stay ignite's.

Each check runs in a fresh interpreter (the alias changes what ``import ignite...`` finds for the
whole process). The suite-level proof is tests/foreign/ignite_suite.py (ignite's own tests).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("ignite")


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_public_modules_resolve_to_onedist_and_internals_stay_ignites():
    done = _run(
        """
        from onedist import ignite_alias
        ignite_alias.install()
        import onedist
        import ignite.distributed as idist
        from ignite.distributed import utils, auto, launcher
        from ignite.distributed.comp_models.base import _SerialModel
        from ignite.engine import Engine
        assert ignite_alias.installed()
        assert idist.all_reduce is onedist.all_reduce and utils.get_rank is onedist.get_rank
        assert auto.auto_model is onedist.auto_model and launcher.Parallel is onedist.Parallel
        assert _SerialModel.__module__ == "ignite.distributed.comp_models.base"  # ignite's own
        assert Engine.__module__.startswith("ignite.engine")
        from ignite.distributed.utils import _model  # what ignite's tests read: onedist's answers
        assert (_model.name, _model.get_world_size(), _model.get_rank()) == ("serial", 1, 0)
        assert _model._get_max_length("abc", "cpu") == 3
        from ignite.distributed.utils import _rank_not_in_group
        assert not _rank_not_in_group(None) and _rank_not_in_group([1, 2])
        print("ok")
        """
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_only_when_asked():
    code = """
        from onedist import ignite_alias
        ignite_alias.install_if_asked()
        import ignite.distributed as idist, onedist
        print(idist.all_reduce is onedist.all_reduce)
        """
    assert _run(code, ONEDIST_AS_IGNITE="1").stdout.strip() == "True"
    assert _run(code, ONEDIST_AS_IGNITE="0").stdout.strip() == "False"
