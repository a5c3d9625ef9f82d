"""Worker bootstrap of ``onedist run``: run a script or module as ``__main__``, report its error.

``python -m onedist.launchers.bootstrap script.py args...`` (or ``-m pkg.mod args...``) behaves
like ``python script.py args...`` (same ``sys.argv``, ``sys.path[0]``, ``__main__``), and if the
script raises, writes the exception's type, message, traceback and time as JSON to
``$ONEDIST_ERROR_FILE`` before Python prints the traceback as usual. The launcher reads that file to
show the failing rank's error first (the role of torchelastic's ``@record``, without a decorator).
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

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
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


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
