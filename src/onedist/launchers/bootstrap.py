"""Worker bootstrap of ``onedist run``: run a script or module as ``__main__``, report its error.

``python -m onedist.launchers.bootstrap script.py args...`` (or ``-m pkg.mod args...``) behaves
like ``python script.py args...`` (same ``sys.argv``, ``sys.path[0]``, ``__main__``), and if the
script raises, writes the exception's type, message, traceback and time as JSON to
``$ONEDIST_ERROR_FILE`` before Python prints the traceback as usual. The launcher reads that file to
show the failing rank's error first (the role of torchelastic's ``@record``, without a decorator).
"""

from __future__ import annotations

import builtins
import importlib.machinery
import io
import os
import runpy
import signal
import sys
import types
import zipfile

from ..errors import user_traceback
from .worker import write_error_file

__all__ = ["main", "run_target"]


def run_target(argv: list[str]) -> None:
    """Run ``argv`` (``[script, *args]`` or ``["-m", module, *args]``) as ``__main__``."""
    if argv and argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit("onedist: -m needs a module name")
        module = argv[1]
        sys.argv = [module, *argv[2:]]  # `python -m` already put the working directory first
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script = os.path.abspath(argv[0])
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(script)
    if os.path.isfile(script) and not zipfile.is_zipfile(script):
        _run_file(script)
    else:  # a directory or zip file with a __main__.py
        runpy.run_path(script, run_name="__main__")


def _run_file(path: str) -> None:
    """Run the script at ``path`` as ``python script.py`` does: in ``__main__``, with an absolute
    ``__file__`` (Python >= 3.9) and ``sys.argv[0]`` as typed. (``runpy.run_path`` gives both the
    path it was given: a relative ``__file__`` broke a script that changes directory first.)"""
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=path,
        __cached__=None,
        __builtins__=builtins,
        __loader__=importlib.machinery.SourceFileLoader("__main__", path),
    )
    _replaced.append(sys.modules.get("__main__"))  # this module, kept alive while its code runs
    sys.modules["__main__"] = main
    with io.open_code(path) as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)  # no __future__ flag of this file
    exec(code, main.__dict__)


_replaced: list[object] = []


def main() -> None:
    """Entry point (see the module docstring)."""
    error_file = os.environ.get("ONEDIST_ERROR_FILE")
    try:
        run_target(sys.argv[1:])
        _settle_gloo_threads()
    except SystemExit as e:
        _settle_gloo_threads()
        if error_file and e.code not in (0, None):
            write_error_file(error_file, e.with_traceback(user_traceback(e.__traceback__)))
        raise
    except BaseException as e:
        e = e.with_traceback(user_traceback(e.__traceback__))
        if error_file:
            write_error_file(error_file, e)
        # printed here, as Python would (through torch's "[rank<N>]:" hook once a group exists),
        # so that the launcher's frames stay out of it
        sys.excepthook(type(e), e, e.__traceback__)
        sys.stderr.flush()
        if isinstance(e, KeyboardInterrupt):  # end as Python does: killed by SIGINT (status 130)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        sys.exit(1)


def _settle_gloo_threads() -> None:
    """Before Python finalizes, let the gloo threads of a group the script's DDP still holds go
    idle: one that takes the GIL during finalization aborts the process (SIGABRT, "terminate called
    without an active exception") after the script succeeded (see backends/_gloo_threads.py).
    torchrun's workers have no such step; a plain DDP script ended so in 2 of 18 runs here."""
    if "torch.distributed" in sys.modules:  # nothing to do for a script that never used it
        from ..backends._gloo_threads import settle

        settle()


if __name__ == "__main__":
    main()
