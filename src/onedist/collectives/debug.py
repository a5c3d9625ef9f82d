"""Debug mode: the ranks check that they make the same collective call before making it.

``ONEDIST_DEBUG=1`` or :func:`onedist.set_debug`: before each collective the ranks of the group
exchange a fingerprint (operation, reduction op, root, value structure with dtypes, shapes and
devices, call site) in one small all_reduce of its digest; when they differ, every rank raises
:class:`~onedist.CollectiveMismatchError` listing each rank's call and its ``file:line``. A
collective called inside :func:`onedist.one_rank_only` or under ``if is_main_process():`` /
``if get_rank() == 0:`` raises at once, naming the line. Debug mode costs one extra small
collective per call.
"""

from __future__ import annotations

import ast
import functools
import json
import linecache
import sys
from types import FrameType
from typing import Any, Optional

from ..context import current
from ..errors import CollectiveMismatchError, OnedistRuntimeError, call_site, user_frame
from ..state import world
from .base import resolve_group
from .exchange import gather_values


def set_debug(enabled: bool = True) -> None:
    """Turn debug mode on or off in this process (every rank must do the same).

    In debug mode the ranks check, before each collective, that they all call the same operation on
    compatible values, and raise :class:`~onedist.CollectiveMismatchError` on every rank (listing
    each rank's call and ``file:line``) instead of hanging. ``ONEDIST_DEBUG=1`` turns it on at start.

    Example:
        >>> import onedist as od
        >>> od.set_debug(True); od.all_reduce(1); od.set_debug(False)
        1
    """
    if not isinstance(enabled, bool):
        from ..errors import bad_type

        raise bad_type("set_debug", "enabled", enabled, "a bool")
    world.debug = enabled


def is_debug() -> bool:
    """Whether debug mode is on in this process."""
    return world.debug


# ---------------------------------------------------------------------------- debug mode
def _signature(value: Any, depth: int = 0) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return ["T", str(value.dtype), list(value.shape), value.device.type]
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if depth > 6:
        return type(value).__name__
    if isinstance(value, dict):
        return {str(k): _signature(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [_signature(v, depth + 1) for v in value[:64]]]
    return type(value).__name__


def _relax_first_dim(sig: Any) -> Any:
    """all_gather / gather accept different first dimensions: compare the rest only."""
    if isinstance(sig, list) and sig and sig[0] == "T":
        return ["T", sig[1], ["*", *sig[2][1:]] if sig[2] else [], sig[3]]
    if isinstance(sig, dict):
        return {k: _relax_first_dim(v) for k, v in sig.items()}
    if isinstance(sig, list) and len(sig) == 2 and isinstance(sig[1], list):
        return [sig[0], [_relax_first_dim(v) for v in sig[1]]]
    return sig


_STRUCTURE_FREE = frozenset({"all_gather_object", "gather", "broadcast", "scatter", "barrier"})


def _fingerprint(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any], site: str, spec: dict[str, Any]
) -> dict[str, Any]:
    value = args[0] if args else kwargs.get("tensor", kwargs.get("data", kwargs.get("obj")))
    fp: dict[str, Any] = {"call": name, "site": site}
    for key, (position, default) in spec.items():
        given = kwargs.get(key, args[position] if len(args) > position else default)
        fp[key] = str(getattr(given, "name", given)).upper() if key == "op" else str(given)
    if name not in _STRUCTURE_FREE:
        sig = _signature(value)
        fp["value"] = _relax_first_dim(sig) if name == "all_gather" else sig
    return fp


def _inside_rank_only_block(frame: Optional[FrameType]) -> Optional[str]:
    """'if is_main_process():' / 'if get_rank() == 0:' around the calling line, if any."""
    if frame is None:
        return None
    return _rank_only_test(frame.f_code.co_filename, frame.f_lineno)


@functools.lru_cache(maxsize=4096)
def _rank_only_test(filename: str, line: int) -> Optional[str]:
    tree = _parsed(filename)
    if tree is None:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and node.body:
            start, end = (
                node.body[0].lineno,
                max(getattr(n, "end_lineno", n.lineno) or n.lineno for n in node.body),
            )
            if start <= line <= end:
                test = ast.unparse(node.test)
                if "is_main_process()" in test or "get_rank() ==" in test or "get_local_rank() ==" in test:
                    return test
    return None


@functools.lru_cache(maxsize=64)
def _parsed(filename: str) -> Optional[ast.AST]:
    source = "".join(linecache.getlines(filename))
    if not source:
        return None
    try:
        return ast.parse(source)
    except SyntaxError:
        return None


def _exchange(fp: dict[str, Any], b: Any, handle: Any, group: Any) -> Optional[list[dict[str, Any]]]:
    """None when every group rank's fingerprint (without the call site) equals this one, else all of them.

    One all_reduce (MAX) of ``[d, -d]`` for a 124-bit digest ``d`` per call: every rank equal iff the
    maximum of ``d`` equals minus the maximum of ``-d`` (the minimum). The full fingerprints travel
    only on a mismatch (every rank sees it, so every rank takes the second round).
    """
    import hashlib

    import torch

    comparable = json.dumps({k: v for k, v in fp.items() if k != "site"}, sort_keys=True).encode()
    raw = hashlib.blake2b(comparable, digest_size=16).digest()
    mask = (1 << 62) - 1
    d = [int.from_bytes(raw[:8], "little") & mask, int.from_bytes(raw[8:], "little") & mask]
    device = b.comm_device(torch.device("cpu"), "all_reduce")
    t = torch.tensor([d[0], d[1], -d[0], -d[1]], dtype=torch.int64, device=device)
    b.all_reduce_(t, "MAX", b.object_group(handle), False)
    top = t.tolist()
    if top[0] == d[0] and top[1] == d[1] and -top[2] == d[0] and -top[3] == d[1]:
        return None
    every = gather_values("debug check", json.dumps(fp, sort_keys=True), group, False, False)
    return [json.loads(f) for f in every]


def debug_check(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any], group: Any, spec: dict[str, Any]
) -> None:
    frame = user_frame(sys._getframe(2))
    site = call_site(frame)
    if world.one_rank_depth > 0:
        raise OnedistRuntimeError(
            f"onedist.{name} at {site} is called inside a one_rank_only function: the other ranks do not run "
            "it, so they never join this collective (deadlock).\nHINT: move the collective out of the "
            "one_rank_only function, or call it on every rank"
        )
    block = _inside_rank_only_block(frame)
    if block is not None:
        raise OnedistRuntimeError(
            f"onedist.{name} at {site} is inside `if {block}:`, which only some ranks enter: the others "
            "never join this collective (deadlock).\nHINT: call the collective on every rank, before the `if`"
        )
    b = current()
    handle, me, ranks = resolve_group(name, b, group)
    if me < 0:  # not a member: the collective does not communicate here, nothing to compare
        return
    mine = _fingerprint(name, args, kwargs, site, spec)
    decoded = _exchange(mine, b, handle, group)
    if decoded is not None:
        lines = [f"onedist debug mode: the ranks of group {list(ranks)} called different collectives:"]
        for r, fp in zip(ranks, decoded):
            lines.append(f"  rank {r}: {_call_text(fp)} at {fp['site']}")
        lines.append(
            "HINT: every rank of a group must call the same collectives, in the same order, on values of "
            "the same type, dtype and shape (all_gather: any first dimension)"
        )
        raise CollectiveMismatchError("\n".join(lines))


def describe_call(call: tuple[Any, ...]) -> dict[str, Any]:
    """What the ranks compare of a collective that blocks (the failure watcher's stall check):
    its call site, its group's ranks, and its fingerprint as debug mode makes it, without the site.
    ``group`` is None when this rank is not a member (it does not wait there)."""
    name, args, kwargs, spec, frame, _, group = call[:7]
    site = call_site(user_frame(frame))
    b = current()
    if group is None:
        ranks: Any = range(b.world_size)
    elif isinstance(group, (list, tuple, range)):  # not resolve_group: it may create the group
        ranks = sorted(group)
    else:
        ranks = b.group_ranks(group)
    fp = _fingerprint(name, args, kwargs, site, spec)
    comparable = json.dumps({k: v for k, v in fp.items() if k != "site"}, sort_keys=True)
    members = list(ranks) if b.rank in ranks else None
    return {"call": _call_text(fp), "site": site, "sig": comparable, "group": members}


def _call_text(fp: dict[str, Any]) -> str:
    """``all_reduce(op=SUM, value [...])``: a fingerprint as one rank's line of a mismatch report."""
    parts = [f"{k}={fp[k]}" for k in ("op", "src", "dst") if k in fp]
    if "value" in fp:
        parts.append(f"value {json.dumps(fp['value'])[:200]}")
    return f"{fp['call']}({', '.join(parts)})"
