"""Failures on purpose, to test a recovery path: ``ONEDIST_INJECT_FAILURE=rank=R,step=S``.

Set by ``onedist run --inject-failure rank=R,step=S`` (or by hand, under any launcher), it makes
rank ``R`` kill itself right after its ``S``-th optimizer step (any optimizer's ``step()`` in the
process: torch's global step hook), by SIGKILL unless ``signal=`` names another, on the attempt
``restart=`` gives (0: the first, so that a restarted run, ``--max-restarts``, is not killed
again). One line on stderr says so before the signal. Nothing is installed on the other ranks, or
when the variable is unset.
"""

from __future__ import annotations

import os
import signal as signals
import sys
from typing import Any, Optional

from .._injection import ENV, Injection, parse

__all__ = ["install", "remove"]

_handle: Optional[Any] = None  # the installed step hook's handle


def install(rank: int, restart: int, environ: Any = os.environ) -> Optional[Injection]:
    """Install the injection ``environ`` asks for when it is this ``rank``'s and ``restart``'s
    (the launcher's attempt): the injection, or None when there is none here."""
    remove()
    text = environ.get(ENV, "")
    if not text:
        return None
    injection = parse(text)
    if injection.rank != rank or injection.restart != restart:
        return None
    global _handle
    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps = [0]

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        steps[0] += 1
        if steps[0] == injection.step:
            _die(injection)

    _handle = register_optimizer_step_post_hook(after_step)
    return injection


def remove() -> None:
    """Take the installed injection off (``finalize``)."""
    global _handle
    if _handle is not None:
        _handle.remove()
        _handle = None


def _die(injection: Injection) -> None:
    name = signals.Signals(injection.signal).name
    sys.stdout.flush()
    sys.stderr.write(
        f"onedist: rank {injection.rank} ends itself by {name} after optimizer step {injection.step}, "
        f"as {ENV} asks (a failure injected on purpose)\n"
    )
    sys.stderr.flush()
    os.kill(os.getpid(), injection.signal)
