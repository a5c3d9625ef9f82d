"""One verdict on every rank of a collective mismatch, whichever way a rank learns of it: its own
stall check, the store after a peer broke the group's connections, or a peer's published failure.

The whole path runs for real in test_misuse.py (two processes, gloo, both launchers); these pin the
three pieces that made one rank of four in that test raise RemoteRankError instead, now and then:
the verdict reached the store after the connections broke (a TCP store's ``set`` is not
answered), the rank that wrote it could not always read it back, and a peer's published
CollectiveMismatchError came back as a RemoteRankError.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from onedist.errors import CollectiveMismatchError, RemoteRankError
from onedist.failures import stall
from onedist.failures.explain import _remote_failure
from onedist.failures.keys import READ_KEY, VERDICT_KEY


@pytest.fixture
def stores():
    """A TCP store's server and a second client: the writer's and a reader's connections."""
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    reader = dist.TCPStore("127.0.0.1", server.port, None, False, timeout=timedelta(seconds=10))
    yield server, reader
    stall._known = None


class _GoneStore:
    """A store whose server has left: every request fails."""

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise RuntimeError("Connection reset by peer")

        return fail


def test_a_written_verdict_is_in_the_store_for_the_next_reader_at_once(stores):
    writer, reader = stores
    for seq in range(1, 201):
        writer.delete_key(VERDICT_KEY)
        stall.write_verdict(writer, seq, None, f"verdict {seq}", rank=1)
        assert stall.read_verdict(reader, seq, 2, 3) == f"verdict {seq}"


def test_the_writer_keeps_its_verdict_and_its_receipt(stores):
    writer, _ = stores
    stall.write_verdict(writer, 4, [0, 1], "the ranks are blocked in different collectives", rank=1)
    assert writer.check([READ_KEY.format(1)])  # rank 0 waits for every member's receipt
    # the writer's own guard finds it even when the store no longer answers
    assert stall.read_verdict(_GoneStore(), 4, 1, 2) == "the ranks are blocked in different collectives"
    assert stall.read_verdict(_GoneStore(), 3, 1, 2) is None  # about a later call than this one


def test_a_peer_s_published_mismatch_is_raised_as_that_mismatch():
    verdict = "onedist: the ranks are blocked in different collectives (call 2 on the default group)"
    report = {"type": "CollectiveMismatchError", "message": verdict, "traceback": "...", "time": 1.0}
    err = _remote_failure("barrier", 1, "train.py:9", {0: report})
    assert type(err) is CollectiveMismatchError and str(err) == verdict
    crash = {"type": "ValueError", "message": "boom", "traceback": "ValueError: boom", "time": 1.0}
    err = _remote_failure("barrier", 1, "train.py:9", {0: crash})
    assert isinstance(err, RemoteRankError) and err.rank == 0 and "ValueError: boom" in str(err)
