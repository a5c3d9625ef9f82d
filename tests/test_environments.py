"""Launcher environment parsing, as pure functions of plain dicts."""

from __future__ import annotations

import pytest

from onedist.environments import PartialLayout, launched_externally, layout_from_environ

TORCHRUN_NODE1 = {
    "RANK": "5",
    "WORLD_SIZE": "6",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "2",
    "GROUP_WORLD_SIZE": "3",
    "MASTER_ADDR": "n0",
    "MASTER_PORT": "29500",
}


def test_torchrun_variables_give_the_full_layout():
    assert layout_from_environ(TORCHRUN_NODE1, rank=5, world_size=6) == PartialLayout(1, 2, 2, 3)


def test_uneven_layout_three_plus_one():
    node0 = {
        "RANK": "2",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "2",
        "LOCAL_WORLD_SIZE": "3",
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "2",
    }
    node1 = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
    }
    assert layout_from_environ(node0, 2, 4) == PartialLayout(2, 3, 0, 2)
    assert layout_from_environ(node1, 3, 4) == PartialLayout(0, 1, 1, 2)


def test_stale_environment_of_another_group_is_ignored():
    assert layout_from_environ(TORCHRUN_NODE1, rank=0, world_size=2) == PartialLayout()


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"LOCAL_RANK": "1"}, PartialLayout(1, None, None, None)),
        ({"LOCAL_RANK": "x"}, PartialLayout()),
        ({"LOCAL_RANK": "7"}, PartialLayout()),  # out of range for a world of 4
        ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, PartialLayout(1, 4, 0, 1)),  # all ranks here
        ({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"}, PartialLayout(None, None, None, None)),  # inconsistent
        ({"NODE_RANK": "1", "GROUP_WORLD_SIZE": "2"}, PartialLayout(None, None, 1, 2)),
        ({"GROUP_WORLD_SIZE": "1"}, PartialLayout(None, 4, 0, 1)),
    ],
)
def test_partial_and_bad_values(env, expected):
    assert layout_from_environ(env, rank=1, world_size=4) == expected


def test_launched_externally():
    assert launched_externally(TORCHRUN_NODE1)
    assert not launched_externally({"RANK": "0"})
    assert not launched_externally({"RANK": "", "WORLD_SIZE": "2"})
    assert PartialLayout(0, 1, 0, 1).complete() and not PartialLayout(0).complete()
