"""ONEDIST_INJECT_FAILURE: a rank fails on purpose after its S-th optimizer step (issue 53, point 3).
The launch under ``onedist run --inject-failure`` that restarts and resumes is in test_restarts.py."""

from __future__ import annotations

import signal

import pytest
import torch

import onedist as od
from onedist import _injection as spec
from onedist.failures import injection


@pytest.mark.parametrize(
    "text",
    ["", "rank=1", "step=3", "rank=1,step=0", "rank=-1,step=3", "rank=1,step=3,signal=SIGFOO",
     "rank=1,step=3,rank=2", "rank=1,step=3,when=now", "rank=one,step=3", "rank=1,step=3,restart=-1"],
)  # fmt: skip
def test_a_bad_injection_is_refused_naming_the_variable_and_what_is_allowed(text):
    with pytest.raises(
        od.OnedistValueError, match=r"ONEDIST_INJECT_FAILURE=.* is not allowed; allowed: rank=R"
    ):
        spec.parse(text)


def test_only_the_named_rank_on_the_named_attempt_gets_it():
    env = {spec.ENV: "rank=1,step=3,restart=1"}
    try:
        assert injection.install(0, 1, env) is None
        assert injection.install(1, 0, env) is None
        assert injection.install(1, 1, env) == spec.Injection(1, 3, signal.SIGKILL, 1)
        assert injection.install(1, 1, {}) is None  # unset: nothing (and the previous one removed)
    finally:
        injection.remove()


def test_the_signal_comes_right_after_the_named_optimizer_step_once(monkeypatch):
    """initialize installs it: SIGUSR1 (caught here) after the 2nd of 4 optimizer steps, and only
    then; finalize takes it off."""
    received: list[int] = []
    steps_done: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(len(steps_done)))
    monkeypatch.setenv(spec.ENV, "rank=0,step=2,signal=SIGUSR1")
    try:
        od.initialize("gloo")
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(4):
            model(torch.ones(1, 2)).sum().backward()
            optimizer.step()
            steps_done.append(1)
        od.finalize()
        optimizer.step()
    finally:
        signal.signal(signal.SIGUSR1, previous)
        injection.remove()
    assert received == [1]  # during step 2 (its post hook), before the loop counted it
