"""Seeing a run: od.progress, od.Throughput, od.loggers / od.log_metrics (docs/training.md, "Seeing the run").

Throughput and metric reductions on real gloo and shm groups of 2 and 3 ranks, against hand counts;
the progress stream, the CSV file and the rates of one script under ``python`` and ``onedist run``.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import checks_monitoring
import onedist as od
import pyfork
from conftest import Runner
from launch_env import clean_env
from onedist.backends.shm import supported
from run_helpers import onedist_command

SCRIPT = str(Path(__file__).parent / "scripts" / "monitored.py")
WORLDS = [(2, "gloo"), (3, "gloo")] + ([(2, "shm"), (3, "shm")] if supported() else [])
_ids = [f"{b}-ws{n}" for n, b in WORLDS]


@pytest.mark.parametrize("n, backend", WORLDS, ids=_ids)
def test_throughput_equals_a_hand_count_with_one_collective_per_window(n, backend):
    every = 5
    out = Runner(n, backend)(checks_monitoring.check_throughput_counts, every)
    samples = every * sum(o["batch"] for o in out)  # a window: every rank's batches
    for w in range(2):
        # the window's time: the slowest rank's, from the previous window's end
        elapsed = max(o["ends"][w] - (o["ends"][w - 1] if w else 0.0) for o in out)
        for o in out:
            rates = o["rates"][w]
            assert rates["samples"] == samples and rates["total_samples"] == samples * (w + 1)
            assert rates["steps"] == every
            assert rates["samples_per_s"] == pytest.approx(samples / elapsed, rel=0.01)
            assert rates["tokens_per_s"] == pytest.approx(10 * samples / elapsed, rel=0.01)
            assert rates["flops_per_s"] == pytest.approx(1000 * samples / elapsed, rel=0.01)
            assert rates["utilisation"] == pytest.approx(1000 * samples / elapsed / (1e6 * n), rel=0.01)
    assert all(o["rates"] == out[0]["rates"] for o in out)  # the same numbers on every rank
    for o in out:  # one all_gather of a row of 7 float64s per window, nothing in between
        assert [len(c) for c in o["per_step"]] == ([0] * (every - 1) + [1]) * 2, o["per_step"]
        assert all(c[0][0] == "all_gather_into_" for c in o["per_step"] if c), o["per_step"]


@pytest.mark.parametrize("n, backend", WORLDS, ids=_ids)
def test_log_metrics_reduces_in_one_collective_and_the_csv_holds_the_values(n, backend, tmp_path):
    out = Runner(n, backend)(checks_monitoring.check_log_metrics_reduces, str(tmp_path))
    expected = [
        {
            "loss": 1.0 + (n - 1) / 2 + s,
            "correct": 10.0 * n * (n - 1) / 2 + n * s,
            "worst": float((n - 1) * s),
            "lr": 0.1,
        }
        for s in range(3)
    ]
    assert all(o["logged"] == expected for o in out), out
    # one all_gather a call (of each rank's row: the names' checksum and 3 values)
    assert all([name for name, _ in o["calls"]] == ["all_gather_into_"] * 3 for o in out), out
    rows = list(csv.DictReader(io.StringIO((tmp_path / "metrics.csv").read_text())))
    assert rows == [
        *(
            {"step": str(s), **{k: repr(v) for k, v in e.items()}, "main_only": ""}
            for s, e in enumerate(expected)
        ),
        {"step": "3", "loss": "", "correct": "", "worst": "", "lr": "", "main_only": "0.0"},
    ]
    if not out[0]["tensorboard"]:
        pytest.skip("tensorboard is not installed (pip install tensorboard): its event file is not checked")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    for name in expected[0]:
        scalars = [(e.step, e.value) for e in events.Scalars(name)]
        assert scalars == [(s, pytest.approx(e[name], rel=1e-6)) for s, e in enumerate(expected)], name


def test_tensorboard_logger_without_tensorboard_names_what_to_install(monkeypatch):
    """The test extra installs tensorboard (its event files are checked above); Python's own mark
    of a package that cannot be imported (None in sys.modules) makes it absent here."""
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(od.OnedistRuntimeError, match="pip install tensorboard"):
        od.TensorBoardLogger("unused")


def _serial(out_dir: Path, capsys: pytest.CaptureFixture[str]) -> tuple[list[str], str]:
    """The script's loop in this process, as one plain process runs it: its progress lines and CSV."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("monitored_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    capsys.readouterr()
    script.main(0, str(out_dir))
    od.loggers()  # closes the script's loggers, as the exit of its process does
    lines = [line for line in capsys.readouterr().err.splitlines() if "train: " in line]
    return lines, (out_dir / "metrics.csv").read_text()


TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node")
SHM_OR_GLOO = "shm" if supported() else "gloo"


@pytest.mark.parametrize(
    "n, backend, launcher",
    [(2, "gloo", "onedist run"), (3, SHM_OR_GLOO, "onedist run"), (2, "gloo", "torchrun")],
    ids=["gloo-ws2", "ws3", "torchrun-gloo-ws2"],
)
def test_one_progress_stream_with_the_global_count_and_the_csv_of_a_serial_run(
    n, backend, launcher, tmp_path, capsys
):
    """Under onedist run and torchrun (srun: tests/test_slurm.py), the same script writes the serial
    run's CSV, and its progress is one stream, rank 0's (onedist run prefixes each rank's lines)."""
    serial_lines, serial_csv = _serial(tmp_path / "serial", capsys)
    assert serial_lines and all(line.startswith("train: ") for line in serial_lines)
    assert serial_lines[-1].startswith("train: 10/10 batch 100% | ")
    out_dir = tmp_path / backend
    start = [*TORCHRUN, str(n)] if launcher == "torchrun" else onedist_command("-n", str(n))
    proc = pyfork.run(
        [*start, SCRIPT, str(out_dir), backend], capture_output=True, text=True, timeout=120, env=clean_env()
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert (out_dir / "metrics.csv").read_text() == serial_csv  # the same values at any world size
    assert result["windows"] == [30, 30]  # Throughput: every rank's samples of 5 global batches
    # one stream, rank 0's, whose count is every rank's batches and whose rate is all ranks'
    prefix = "[rank0]: " if launcher == "onedist run" else ""
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "train: " in line]
    assert lines and all(line.startswith(f"{prefix}train: ") for line in lines), lines
    counts = [int(m.group(1)) for m in (re.search(r"train: (\d+)/", line) for line in lines) if m]
    assert counts == sorted(counts) and counts[-1] == 10 * n, lines
    last = re.search(r"train: (\d+)/(\d+) batch 100% \| ([\d.]+) batch/s", lines[-1])
    assert last and int(last.group(2)) == 10 * n, lines[-1]
    assert float(last.group(3)) == pytest.approx(10 * n / result["wall"], rel=0.1)


def test_the_loggers_hold_every_step_logged_before_another_rank_failed(tmp_path):
    """Rank 1 raises at step 6; rank 0 leaves through the RemoteRankError onedist raises in it, and
    the exit of its process closes the loggers the script never closed: steps 1-5 are in the CSV
    file and, when tensorboard is installed, in the event file."""
    proc = pyfork.run(
        [*onedist_command("-n", "2"), SCRIPT, str(tmp_path), "gloo", "fail"],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
    )
    assert proc.returncode != 0 and "rank 1 fails at step 6" in proc.stderr, proc.stderr[-3000:]
    # rank 0 left its loop through the exception: the progress wrote its last line (5 steps of 2 ranks)
    assert re.search(r"^\[rank0\]: train: 10/20 batch 50% ", proc.stdout + proc.stderr, re.M), proc.stderr[
        -3000:
    ]
    rows = list(csv.DictReader(io.StringIO((tmp_path / "metrics.csv").read_text())))
    sums = [sum(range(6 * s, 6 * s + 6)) for s in range(5)]
    assert [(int(r["step"]), float(r["sum"])) for r in rows] == list(zip(range(1, 6), sums))
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        pytest.skip("tensorboard is not installed (pip install tensorboard): its event file is not checked")
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("sum")] == list(zip(range(1, 6), sums))


def test_a_job_ended_by_sigterm_closes_its_loggers_first(tmp_path):
    """A preempted job (SIGTERM to every process, as SLURM sends it): each rank prints where it was
    and ends by the signal, without Python's exit handlers, which used to lose what a logger buffers
    until it is closed (here one that writes only then, as Lightning's CSVLogger buffers until
    save). onedist closes the loggers first: steps 1-5 are in its file, and in the CSV file, whose
    rows the script's CSVLogger(flush_s=3600) queues until it is closed."""
    proc = subprocess.Popen(
        [*onedist_command("-n", "2"), SCRIPT, str(tmp_path), "gloo", "preempted"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(), start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "waiting").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0 and "rank 0 got SIGTERM" in err, err[-3000:]
    sums = [float(sum(range(6 * s, 6 * s + 6))) for s in range(5)]
    logged = json.loads((tmp_path / "buffered-0.json").read_text())  # the main process's
    assert logged == [[s, v] for s, v in zip(range(1, 6), sums)]
    # the CSV logger's queued rows too (its writer thread waits an hour: only the close wrote them)
    rows = list(csv.DictReader(io.StringIO((tmp_path / "metrics.csv").read_text())))
    assert [(int(r["step"]), float(r["sum"])) for r in rows] == list(zip(range(1, 6), sums))


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_tqdm_bar_on_a_terminal_and_plain_lines_elsewhere():
    pytest.importorskip("tqdm", reason="the bar is tqdm's")
    terminal, pipe = _Terminal(), io.StringIO()
    for file in (terminal, pipe):
        bar = od.progress(range(3), desc="fit", file=file)
        for _ in bar:
            bar.set_postfix(loss=0.5)
    assert "fit: 100%" in terminal.getvalue() and "3/3" in terminal.getvalue()  # tqdm's own format
    assert "loss=0.5" in terminal.getvalue()
    assert (
        pipe.getvalue().splitlines()[-1].startswith("fit: 3/3 it 100% | ")
    )  # every_s=10: the last line only
    assert len(pipe.getvalue().splitlines()) == 1


def test_progress_lines_every_s_and_an_unknown_total():
    out = io.StringIO()
    for _ in od.progress(iter(range(5)), every_s=0, style="lines", file=out, unit="sample"):
        pass
    lines = out.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines] == [f"{i} sample" for i in range(1, 6)]
    assert all("ETA" not in line for line in lines)  # no total: no percentage, no ETA


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: od.progress(3), r"onedist.progress: iterable has type int \(3\); allowed: an iterable"),
        (
            lambda: od.progress([], total=-1),
            r"onedist.progress: total=-1 is not allowed; allowed: None or an int >= 0",
        ),
        (
            lambda: od.progress([], every_s=-1),
            r"every_s=-1 is not allowed; allowed: a number of seconds >= 0",
        ),
        (
            lambda: od.progress([], style="fancy"),
            r"style='fancy' is not allowed; allowed: 'auto', 'bar', 'lines'",
        ),
        (lambda: od.progress([], desc=3), r"onedist.progress: desc has type int"),
        (
            lambda: od.Throughput(every=0),
            r"onedist.Throughput: every=0 is not allowed; allowed: None or an int >= 1",
        ),
        (lambda: od.Throughput(peak_flops=0), r"peak_flops=0 is not allowed; allowed: None or a number > 0"),
        (
            lambda: od.Throughput().update(2.5),
            r"Throughput.update: samples=2.5 is not allowed; allowed: an int >= 0",
        ),
        (lambda: od.Throughput().update(2, tokens=-1), r"tokens=-1 is not allowed"),
        (lambda: od.measure_flops("net"), r"onedist.measure_flops: model has type str"),
        (lambda: od.log_metrics([1.0], 0), r"onedist.log_metrics: metrics has type list"),
        (lambda: od.log_metrics({"a": "x"}, 0), r"metrics\['a'\] has type str \('x'\); allowed: a number"),
        (lambda: od.log_metrics({"a": 1.0}, -1), r"onedist.log_metrics: step=-1 is not allowed"),
        (
            lambda: od.log_metrics({"a": 1.0}, 0, reduce="avg"),
            r"reduce='avg' is not allowed; allowed: 'None', 'mean'",
        ),
        (
            lambda: od.log_metrics({"a": 1.0}, 0, reduce={"b": "sum"}),
            r"reduce=\{'b': 'sum'\} is not allowed; allowed: names",
        ),
        (lambda: od.log_metrics({"a": 1.0}, 0, reduce={"a": "avg"}), r"reduce\['a'\]='avg' is not allowed"),
        (lambda: od.loggers(object()), r"onedist.loggers: targets\[0\] has type object"),
        (lambda: od.CSVLogger(3), r"onedist.CSVLogger: directory has type int"),
        (lambda: od.CSVLogger(".", name="a/b.csv"), r"onedist.CSVLogger: name='a/b.csv' is not allowed"),
        (
            lambda: od.CSVLogger(".", flush_s=-1),
            r"onedist.CSVLogger: flush_s=-1 is not allowed; allowed: a number",
        ),
        (lambda: od.peak_flops(dtype="bf16"), r"onedist.peak_flops: dtype has type str"),
    ],
)
def test_bad_arguments_raise_naming_them(call, match):
    with pytest.raises((od.OnedistValueError, od.OnedistTypeError), match=match):
        call()


def test_peak_flops_table_and_measured_flops():
    import torch

    from onedist.training.peak_flops import table_peak

    assert table_peak("NVIDIA H100 80GB HBM3", torch.bfloat16, tf32=False) == 989.4e12
    assert table_peak("NVIDIA H100 PCIe", torch.float32, tf32=True) == 378e12
    assert table_peak("NVIDIA A100-SXM4-80GB", torch.float32, tf32=False) == 19.5e12
    assert table_peak("Tesla T4", torch.bfloat16, tf32=False) is None
    assert table_peak("Some GPU", torch.float32, tf32=False) is None
    assert od.peak_flops("cpu") is None and od.Throughput().peak is None  # a CPU: no utilisation
    model = torch.nn.Linear(8, 4)
    model.weight.grad = torch.ones_like(model.weight)
    flops = od.measure_flops(model, torch.ones(16, 8), loss_fn=lambda out: out.sum())
    assert flops == 2 * 16 * 8 * 4 * 2  # forward, and the backward's weight gradient
    assert torch.equal(model.weight.grad, torch.ones_like(model.weight)) and model.bias.grad is None


@pytest.mark.parametrize("n", [2, 3])
def test_reducing_metrics_of_different_names_raises_on_every_rank(n):
    out = Runner(n, "gloo")(checks_monitoring.check_log_metrics_names_must_match)
    assert all("the ranks reduce metrics of different names" in o for o in out), out
    ranks = Runner(n, "gloo")(checks_monitoring.check_other_ranks_iterate_the_iterable_itself)
    assert ranks == ["generator"] + ["list_iterator"] * (n - 1)


def test_a_loop_left_early_writes_its_last_line_and_loggers_replace_each_other(tmp_path):
    out = io.StringIO()
    for i in od.progress(range(10), every_s=60, style="lines", file=out):
        if i == 3:
            break
    assert out.getvalue().startswith("3/10 it 30% | ")
    first, second = od.CSVLogger(tmp_path, "a.csv", flush_s=0), od.CSVLogger(tmp_path, "b.csv")
    od.loggers(first)
    assert od.log_metrics({"x": 1}, 1) == {"x": 1.0}
    assert first.file is not None and (tmp_path / "a.csv").read_text() == "step,x\n1,1.0\n"  # flush_s=0
    od.loggers(second)  # closes the first
    assert first.file is None
    od.log_metrics({"x": 2}, 2)
    od.loggers()
    assert (tmp_path / "b.csv").read_text() == "step,x\n2,2.0\n" and second.file is None


def test_csv_rows_are_queued_and_written_by_a_thread_every_flush_s_and_at_close(tmp_path):
    """The training thread only queues a row: an hour's flush_s writes nothing until flush() or the
    close; a short one's thread writes the rows without either; a row with a new metric, queued
    behind others, rewrites the file with its column."""
    late = od.CSVLogger(tmp_path, "late.csv", flush_s=3600)
    with od.loggers(late):
        od.log_metrics({"x": 1}, 1)
        od.log_metrics({"x": 2}, 2)
        assert not (tmp_path / "late.csv").exists() and len(late.queued) == 2  # nothing written yet
        late.flush()
        assert (tmp_path / "late.csv").read_text() == "step,x\n1,1.0\n2,2.0\n"
        od.log_metrics({"x": 3, "y": 0.5}, 3)
        od.log_metrics({"y": 0.25}, None)
    assert (tmp_path / "late.csv").read_text() == "step,x,y\n1,1.0,\n2,2.0,\n3,3.0,0.5\n,,0.25\n"
    soon = od.CSVLogger(tmp_path, "soon.csv", flush_s=0.05)
    with od.loggers(soon):
        od.log_metrics({"x": 1}, 1)
        assert "onedist-csv-writer" in [t.name for t in threading.enumerate()]
        deadline = time.monotonic() + 30
        while not (tmp_path / "soon.csv").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert soon.file is not None  # written by the thread, the loggers still open
    assert (tmp_path / "soon.csv").read_text() == "step,x\n1,1.0\n"


def test_csv_rows_queued_are_written_at_a_normal_exit_and_a_writer_error_is_raised(tmp_path):
    """A process that ends without closing its loggers (od.loggers' or a CSVLogger used alone)
    has every row in the files; a row the thread cannot write raises at the next log_metrics."""
    code = (
        "import sys, onedist as od\n"
        "od.loggers(od.CSVLogger(sys.argv[1], 'a.csv', flush_s=3600))\n"
        "alone = od.CSVLogger(sys.argv[1], 'b.csv', flush_s=3600)\n"
        "for step in range(3):\n"
        "    od.log_metrics({'x': step}, step)\n"
        "    alone.log_metrics({'x': float(step)}, step)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    for name in ("a.csv", "b.csv"):
        assert (tmp_path / name).read_text() == "step,x\n0,0.0\n1,1.0\n2,2.0\n", name
    (tmp_path / "taken").write_text("a file where the logger's directory should be")
    broken = od.CSVLogger(tmp_path / "taken", flush_s=0.01)
    broken.log_metrics({"x": 1.0}, 1)
    deadline = time.monotonic() + 30
    while broken.failed is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(OSError):
        broken.log_metrics({"x": 2.0}, 2)


def test_digits_logs_its_epochs_to_csv(tmp_path):
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn (in the test extra)")
    digits = str(Path(__file__).parent.parent / "examples" / "digits.py")
    argv = [
        "--backend",
        "none",
        "--epochs",
        "2",
        "--max-steps",
        "3",
        "--target",
        "0",
        "--log-dir",
        str(tmp_path),
    ]
    proc = pyfork.run(
        [sys.executable, digits, *argv], capture_output=True, text=True, timeout=120, env=clean_env()
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(csv.DictReader(io.StringIO((tmp_path / "metrics.csv").read_text())))
    assert [r["step"] for r in rows] == ["1", "2"]
    assert set(rows[0]) == {"step", "train_loss", "test_accuracy", "samples_per_s", "flops_per_s"}
    printed = re.findall(r"^epoch +\d+ +train loss ([\d.]+) .* ([\d.]+) samples/s\)$", proc.stdout, re.M)
    assert [float(loss) for loss, _ in printed] == [round(float(r["train_loss"]), 4) for r in rows]
    assert re.search(r"^epoch 2: 3/23 batch 13% \| ", proc.stderr, re.M), proc.stderr  # od.progress
