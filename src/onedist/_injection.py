"""What ``ONEDIST_INJECT_FAILURE`` (``onedist run --inject-failure``) asks for, read without torch:
the launcher checks it before it imports torch and starts its workers. The
failure itself is :mod:`onedist.failures.injection`'s."""

from __future__ import annotations

import signal as signals
from dataclasses import dataclass

from .errors import OnedistValueError

__all__ = ["ALLOWED", "ENV", "Injection", "parse"]

#: the variable the workers read (``onedist run --inject-failure`` sets it)
ENV = "ONEDIST_INJECT_FAILURE"
#: what the variable (and ``onedist run --inject-failure``) allows
ALLOWED = "rank=R,step=S[,signal=NAME][,restart=N]: R, N ints >= 0, S an int >= 1, NAME e.g. SIGKILL"


@dataclass(frozen=True)
class Injection:
    """Which rank dies, after which optimizer step, by which signal, on which attempt."""

    rank: int
    step: int
    signal: int = signals.SIGKILL
    restart: int = 0


def parse(text: str, name: str = ENV) -> Injection:
    """``text`` (``rank=1,step=35``) as an :class:`Injection`; ``name`` is what an error names
    (the variable, or the flag).

    Example:
        >>> parse("rank=1,step=35,signal=SIGTERM")
        Injection(rank=1, step=35, signal=<Signals.SIGTERM: 15>, restart=0)
    """
    fields: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key not in ("rank", "step", "signal", "restart") or key in fields:
            raise _refused(name, text)
        fields[key] = value.strip()
    if "rank" not in fields or "step" not in fields:
        raise _refused(name, text)
    try:
        rank, step, restart = int(fields["rank"]), int(fields["step"]), int(fields.get("restart", "0"))
        signal = signals.Signals[fields.get("signal", "SIGKILL").upper()]
    except (KeyError, ValueError):
        raise _refused(name, text) from None
    if rank < 0 or step < 1 or restart < 0:
        raise _refused(name, text)
    return Injection(rank, step, signal, restart)


def _refused(name: str, text: str) -> OnedistValueError:
    return OnedistValueError(f"{name}={text!r} is not allowed; allowed: {ALLOWED}")
