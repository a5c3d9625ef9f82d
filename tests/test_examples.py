"""The examples run for real: the digits CNN trains to >= 0.95 test accuracy serially and on 2 processes."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import pyfork
from launch_env import clean_env
from onedist.backends.shm import supported

DIGITS = str(Path(__file__).parent.parent / "examples" / "digits.py")

pytest.importorskip("sklearn", reason="the digits example needs scikit-learn (in the test extra)")


# the training loop's options run 4 epochs (the schedule spans them; bfloat16 on this CPU is ~3x
# slower than float32), the plain runs the example's 10
_OPTIONS = ["--nproc-per-node", "2", "--epochs", "4"]


@pytest.mark.launcher
@pytest.mark.parametrize(
    "args, world",
    [
        (["--backend", "none"], 1),
        (["--nproc-per-node", "2"], 2),
        # the training loop's options: bfloat16 autocast, and windows of 2 batches on shm
        ([*_OPTIONS, "--backend", "gloo", "--precision", "bf16-mixed"], 2),
        pytest.param(
            [*_OPTIONS, "--backend", "shm", "--precision", "bf16-mixed", "--accumulate", "2"],
            2,
            marks=pytest.mark.skipif(not supported(), reason="the shm backend needs Linux on x86-64"),
        ),
        # FSDP2 in its own bf16 mixed precision (BatchNorm units in float32)
        ([*_OPTIONS, "--backend", "gloo", "--sharding", "fsdp", "--precision", "bf16-mixed"], 2),
    ],
    ids=["serial", "gloo", "gloo-bf16", "shm-bf16-accumulate2", "gloo-fsdp-bf16"],
)
def test_digits_trains_to_95_percent(args, world):
    proc = pyfork.run(
        [sys.executable, DIGITS, *args], capture_output=True, text=True, timeout=300, env=clean_env()
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    final = re.search(r"final test accuracy (\d\.\d+) over (\d+) process", proc.stdout)
    assert final, proc.stdout[-2000:]
    assert float(final.group(1)) >= 0.95 and int(final.group(2)) == world
    epochs = int(args[args.index("--epochs") + 1]) if "--epochs" in args else 10  # the example's default
    assert len(re.findall(r"^epoch +\d+ +train loss", proc.stdout, re.M)) == epochs  # rank 0 prints, once


def test_digits_reads_the_arrays_load_digits_gives():
    """The example reads scikit-learn's bundled file itself (importing sklearn.datasets costs each
    worker ~2 CPU-s): the same images and labels as ``sklearn.datasets.load_digits()``."""
    import importlib.util

    import numpy as np
    from sklearn.datasets import load_digits

    spec = importlib.util.spec_from_file_location("digits_example", DIGITS)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    images, labels = example.load_digits()
    expected = load_digits()
    assert images.shape == (1797, 8, 8) and np.array_equal(images, expected.images)
    assert np.array_equal(labels, expected.target)
