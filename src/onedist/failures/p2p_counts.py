"""The point-to-point check at ``finalize``: every send received, every receive matched.

A send nobody receives does not always block its sender: MPI delivers a small message eagerly
(the send completes into the receiver's buffer at once), and a small ``isend`` on gloo completes
once its bytes are in the socket. The job would end 0 with the message lost. Each recorded group's
call log counts each rank's sends to and receives from every peer
(:meth:`~onedist.backends.recorded.calls.CallLog.record_p2p`); at ``finalize`` each rank publishes
the counts of every group it is in (the default group's and those the program made) before it says
it is done, and once every peer is done it compares them all, group by group. A pair whose counts
differ (more sends from A to B than B received, receives from any source aside, or a receive posted
that no send matched) is a mismatch naming both ranks, the counts and the line of the last send. A
group that one of its members no longer has (destroyed, or an earlier generation of a live
recovery) is not compared. Every rank reads the same counts, so each raises the same verdict.

Reading every rank's counts costs each rank world-size store requests (rank 0's store serves
world size squared), so a rank that made any send or receive also adds 1 to ``P2P_RANKS_KEY``
before it says it is done, and the counts are read only when that counter is not zero: a job
without point-to-point calls reads one key at exit. The counter is never reset: a stale count
left by an earlier group on the same store only costs the full read, never a missed check.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from ..backends.recorded.calls import SEND, logs
from .keys import P2P_KEY, P2P_RANKS_KEY

__all__ = ["p2p_verdict", "publish_counts"]

_ANY = "-1"  # a receive from any source (its peer in the log)


def publish_counts(store: Any, rank: int, default: Any, others: Optional[list[Any]] = None) -> None:
    """This rank's sends and receives on each recorded group (``default``: the default group's
    log; ``others``: the other groups' logs, by default every live one of this process), per peer,
    and each last send's line; a group without any is listed too, so that a peer's sends on it are
    compared with this rank's none."""
    groups: dict[str, dict[str, Any]] = {}
    any_p2p = False
    others = logs() if others is None else others
    for log in [default, *(log for log in others if log is not default)]:
        try:
            ranks = list(log.ranks)
        except Exception:  # a group torch never registered (made and destroyed): nothing to match
            continue
        last_send = {str(e.peer): e.site for e in log.recent() if e.peer >= 0 and e.sig[0] == SEND}
        counts = {"sent": log.sent, "received": log.received, "last_send": last_send}
        groups[log.key] = {"ranks": ranks, "default": log is default, **counts}
        any_p2p = any_p2p or bool(log.sent or log.received)
    store.set(P2P_KEY.format(rank), json.dumps(groups))
    if any_p2p:
        store.add(P2P_RANKS_KEY, 1)


def p2p_verdict(store: Any, rank: int, world_size: int) -> Optional[str]:
    """The mismatch report of the sends and receives every rank published, or None (all matched,
    or a rank published nothing: it left before its check, or records no calls)."""
    if int(store.add(P2P_RANKS_KEY, 0)) == 0:  # nobody sent or received anything
        return None
    published: list[dict[str, Any]] = []
    for r in range(world_size):
        key = P2P_KEY.format(r)
        if not store.check([key]):
            return None
        published.append(json.loads(store.get(key)))
    lines = [line for key in _keys(published) for line in _group_lines(published, key)]
    if not lines:
        return None
    return "\n".join(
        [
            f"onedist: sends and receives that never met (found at finalize by rank {rank}; a small send "
            "completes without its receive on MPI and gloo, so nothing blocked):",
            *lines,
            "HINT: every send needs the receive of the same peer (and every receive a send); "
            "an isend or irecv must be waited on before the program ends",
        ]
    )


def _keys(published: list[dict[str, Any]]) -> list[str]:
    """Every group some rank published, the default group first, then in a fixed order."""
    keys = {key: group["default"] for groups in published for key, group in groups.items()}
    return sorted(keys, key=lambda key: (not keys[key], key))


def _group_lines(published: list[dict[str, Any]], key: str) -> list[str]:
    """The lines of group ``key``'s unmatched pairs, in global ranks; none when a member did not
    publish the group (it destroyed it, or left it behind in a live recovery: nothing to compare)."""
    ranks = next(groups[key]["ranks"] for groups in published if key in groups)
    if not all(0 <= r < len(published) and key in published[r] for r in ranks):
        return []
    counts = {member: published[r][key] for member, r in enumerate(ranks)}
    lines = [line for receiver in counts for line in _unmatched(counts, receiver, ranks)]
    if lines and not published[ranks[0]][key]["default"]:
        lines.insert(0, f"  on the group of ranks {ranks}:")
    return lines


def _unmatched(counts: dict[int, dict[str, Any]], receiver: int, ranks: list[int]) -> list[str]:
    """The lines naming each peer whose sends to ``receiver`` and its receives differ (``counts``
    by rank in the group, whose global ranks are ``ranks``: the lines name those)."""
    received = counts[receiver]["received"]
    from_any = int(received.get(_ANY, 0))
    missing: dict[int, tuple[int, int]] = {}  # sender -> (sent, received)
    lines: list[str] = []
    to = ranks[receiver]
    for sender, theirs in counts.items():
        if sender == receiver:
            continue
        sent = int(theirs["sent"].get(str(receiver), 0))
        got = int(received.get(str(sender), 0))
        if got > sent:
            lines.append(
                f"  rank {to} received {got} message(s) from rank {ranks[sender]}, which sent {sent}: "
                "a receive that no send matched"
            )
        elif sent > got:
            missing[sender] = (sent, got)
    if sum(sent - got for sent, got in missing.values()) <= from_any:  # any-source receives took them
        return lines
    for sender, (sent, got) in missing.items():
        site = counts[sender]["last_send"].get(str(receiver), "<unknown>")
        lines.append(
            f"  rank {ranks[sender]} sent {sent} message(s) to rank {to}, which received {got} from it"
            f"{f' (and {from_any} from any source)' if from_any else ''}: its last send to rank "
            f"{to}, at {site}, was never received"
        )
    return lines
