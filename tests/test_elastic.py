"""Elastic membership under `onedist run --nnodes MIN:MAX --rdzv-backend c10d`, for real: three
network-namespace hosts on one bridge, torch's c10d rendezvous hosted by nodeA's launcher.

A node's launcher killed: the other nodes go on at the smaller world size; the node started again:
back to three. The training resumes through ``od.resume`` at each change, and every step's update is
the full-batch gradient summed in sample order (per-sample gradients gathered from every rank), so
the weights do not depend on the world size: the weights loaded at each change and the final ones
are compared bit for bit with one process replaying the same steps. Also: the same job started
from a Kubeflow elastic PyTorchJob's variables alone, a torchrun node and an `onedist run` node in
one job, and the refusals.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from launch_env import clean_env
from run_helpers import onedist_command
from test_kubernetes import pytorchjob_elastic_pod
from test_netns import needs_netns

pytestmark = [pytest.mark.launcher]

CLUSTER = Path(__file__).parent / "cluster"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
_ID = os.getpid() % 10000
_SUBNET = 200 + os.getpid() % 50  # 10.<subnet>.0.0/24, private to these namespaces
#: torch's rendezvous, made quick: a silent node is dropped after 1 s x 3, a round closes 1 s after
#: its minimum arrived (the keep-alive is sent when 1 s old, checked each second: 2 s would drop
#: live nodes)
CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=120"
PORT = 29450

#: full-batch gradient descent on a linear model in float64: each rank computes the per-sample
#: gradients of its contiguous shard of the 24 samples, all ranks gather them in rank (= sample)
#: order and sum the same [24, 5] tensor: the update is bit-identical at every world size. Rank 0
#: writes each step's world size; every rank writes what od.resume gave it; the job stops at the
#: step after the test asks (a file), the ranks agreeing on it through one broadcast.
TRAIN = r"""
import json, os, sys, time
from pathlib import Path
import torch, onedist as od

out = Path(sys.argv[1])
ckpt = out / "ckpt"
od.initialize("gloo")
rank, world = od.get_rank(), od.get_world_size()
model, opt = make()
start = od.resume(ckpt, model=model, optimizer=opt)
with open(out / f"resumed-{os.getpid()}.json", "w") as f:
    json.dump({"rank": rank, "world": world, "step": int(start), "state": state(model, opt),
               "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]), "host": od.hostname()}, f)
x, y = data()
lo, hi = rank * len(x) // world, (rank + 1) * len(x) // world
step = int(start)
while True:
    grads = od.all_gather(per_sample(model, x[lo:hi], y[lo:hi]))
    update(model, opt, grads)
    step += 1
    od.save_training_state(ckpt, step, model=model, optimizer=opt)
    stop = od.broadcast(int((out / "stop").exists()) if rank == 0 else 0, src=0)
    if rank == 0:
        with open(out / "steps.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "world": world}) + "\n")
    if stop:
        break
    time.sleep(0.2)
if rank == 0:
    (out / "final.json").write_text(json.dumps({"step": step, "state": state(model, opt)}))
od.finalize()
"""

COMMON = r"""
import torch


def make():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).double()
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(24, 4, generator=g, dtype=torch.float64)
    return x, x @ torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64) + 0.25


def per_sample(model, x, y):
    # column by column, so that each sample's value does not depend on how many rows there are
    w, b = model.weight[0].detach(), model.bias.detach()
    pred = b.expand(len(x)).clone()
    for j in range(x.shape[1]):
        pred = pred + x[:, j] * w[j]
    err = 2 * (pred - y)
    return torch.cat([err[:, None] * x, err[:, None]], dim=1)


def update(model, opt, grads):
    g = grads.sum(dim=0)
    model.weight.grad, model.bias.grad = g[None, :4].clone(), g[4:].clone()
    opt.step()


def state(model, opt):
    bufs = [opt.state[p].get("momentum_buffer") for p in model.parameters()]
    return [t.flatten().tolist() for t in [*model.parameters(), *[b for b in bufs if b is not None]]]
"""


def _replay(steps: int) -> list:
    """The state after each step 0..steps, from one process (the expectation at every change)."""
    space: dict = {}
    exec(COMMON, space)
    model, opt = space["make"]()
    x, y = space["data"]()
    states = [space["state"](model, opt)]
    for _ in range(steps):
        space["update"](model, opt, space["per_sample"](model, x, y))
        states.append(space["state"](model, opt))
    return states


@pytest.fixture(scope="module")
def bridge():
    """Three namespace hosts (nodeA, nodeB, nodeC) on one bridge; ``on(node, cmd, log)`` starts
    ``cmd`` there, its output in the file ``log`` (a pipe nobody reads could fill and block it)."""
    prefix = f"oe{_ID}"
    work = Path(tempfile.mkdtemp(prefix="onedist-elastic-"))
    started: list[subprocess.Popen] = []
    try:
        up = subprocess.run(
            ["bash", str(CLUSTER / "netns_bridge.sh"), "up", prefix, str(_SUBNET), str(work), "3"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if up.returncode != 0:
            pytest.skip(f"`ip netns` is not usable here: {up.stderr.strip()[-300:]}")

        def on(node: str, cmd: list[str], log: Path, hostname: str = "") -> subprocess.Popen:
            ns = f"{prefix}{node[-1]}"
            with open(log, "ab") as out:
                proc = subprocess.Popen(
                    ["bash", str(CLUSTER / "netns_exec.sh"), ns, hostname or node, str(work / "hosts"), *cmd],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=clean_env(),
                )
            started.append(proc)
            return proc

        yield on
    finally:
        for p in started:  # only the launchers this fixture started, by their process
            if p.poll() is None:
                p.kill()
                p.wait()
        subprocess.run(["bash", str(CLUSTER / "netns_bridge.sh"), "down", prefix, "3"], timeout=60)
        shutil.rmtree(work, ignore_errors=True)


def _script(tmp_path: Path) -> Path:
    script = tmp_path / "train.py"
    script.write_text(COMMON + TRAIN)
    return script


def _steps(out: Path) -> list[dict]:
    path = out / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _count(out: Path, world: int, since: int = 0) -> int:
    """How many steps rank 0 logged at world size ``world`` (from the ``since``-th on)."""
    return sum(s["world"] == world for s in _steps(out)[since:])


def _wait(what: str, ok, procs: list[subprocess.Popen], logs: list[Path], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            shown = "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs if log.exists())
            pytest.fail(f"{what}: not seen within {timeout:.0f} s\n{shown}")
        time.sleep(0.2)


def _check_resumes(out: Path) -> list[tuple[int, int]]:
    """Every od.resume of the run gave the replay's state of its step, bit for bit; the
    (step, world size) of each start, in order."""
    final = json.loads((out / "final.json").read_text())
    expected = _replay(final["step"])
    assert final["state"] == expected[-1]
    resumes = [json.loads(p.read_text()) for p in out.glob("resumed-*.json")]
    for r in resumes:
        assert r["state"] == expected[r["step"]], r
    return sorted({(r["step"], r["world"]) for r in resumes})


def _node(script: Path, out: Path, *flags: str) -> list[str]:
    return [
        "env",
        "OMP_NUM_THREADS=1",
        *onedist_command("--nnodes", "2:3", "-n", "1", "--rdzv-backend", "c10d", "--rdzv-id", "job",
                         "--rdzv-endpoint", f"nodeA:{PORT}", "--rdzv-conf", CONF, "--max-restarts", "1",
                         *flags, str(script), str(out)),
    ]  # fmt: skip


@pytest.mark.slow
@needs_netns
def test_a_node_leaves_and_joins_again(bridge, tmp_path):
    """3 nodes, nodeC's launcher SIGKILLed: nodes A and B go on as a world of 2 (no restart of
    --max-restarts used); nodeC started again: back to 3; all end with 0 and the replay's weights."""
    script, out = _script(tmp_path), tmp_path / "out"
    out.mkdir()
    logs = {n: tmp_path / f"{n}.log" for n in ("nodeA", "nodeB", "nodeC", "nodeC2")}
    began = time.monotonic()
    procs = {n: bridge(n, _node(script, out), logs[n]) for n in ("nodeA", "nodeB", "nodeC")}
    running, shown = list(procs.values()), list(logs.values())
    _wait("5 steps at world size 3", lambda: _count(out, 3) >= 5, running, shown)
    procs["nodeC"].kill()  # the launcher: its worker dies with it (PR_SET_PDEATHSIG)
    procs["nodeC"].wait()
    killed = time.monotonic()
    running.remove(procs["nodeC"])
    _wait("3 steps at world size 2", lambda: _count(out, 2) >= 3, running, shown)
    shrunk = time.monotonic()
    running.append(bridge("nodeC", _node(script, out), logs["nodeC2"]))
    seen = len(_steps(out))
    _wait("3 steps at world size 3 again", lambda: _count(out, 3, seen) >= 3, running, shown)
    grown = time.monotonic()
    (out / "stop").write_text("")
    for p in running:
        p.wait(timeout=60)
    texts = {n: log.read_text() for n, log in logs.items() if log.exists()}
    assert [p.returncode for p in running] == [0, 0, 0], texts
    worlds = [s["world"] for s in _steps(out)]
    changes = [w for i, w in enumerate(worlds) if i == 0 or worlds[i - 1] != w]
    # (nodeC may arrive after A and B made a first round of 2: then 2, 3, 2, 3)
    assert changes[-3:] == [3, 2, 3] and len(changes) <= 4, worlds
    starts = _check_resumes(out)
    shrink = next(step for step, w in starts if w == 2 and step >= 5)
    assert any(w == 3 and step > shrink for step, w in starts), starts
    for n in ("nodeA", "nodeB"):  # no restart of --max-restarts 1 was used for a node leaving
        assert "not counted in --max-restarts" in texts[n] and "restart 1 of 1" not in texts[n], texts[n]
        assert "c10d rendezvous 'job': 2 nodes (was 3)" in texts[n], texts[n]
        assert "c10d rendezvous 'job': 3 nodes (was 2)" in texts[n], texts[n]
    print(
        f"elastic: 3 -> 2 nodes {shrunk - killed:.1f} s after the kill (3 steps at 2 included), "
        f"2 -> 3 {grown - shrunk:.1f} s after the start of nodeC (3 steps included), "
        f"{time.monotonic() - began:.0f} s in all"
    )


@pytest.mark.slow
@needs_netns
def test_kubeflow_elastic_pytorchjob_variables_start_it(bridge, tmp_path):
    """The variables an elastic PyTorchJob's pods get (training-operator's elastic.go: the
    endpoint <job>-worker-0:<port>, c10d, PET_NNODES=min:max, PET_RDZV_CONF from rdzvConf) and no
    flag: two pods named as Kubernetes names them train together; pod 0 hosts the rendezvous."""
    script, out = _script(tmp_path), tmp_path / "out"
    out.mkdir()
    pod = {**pytorchjob_elastic_pod("pyjob", PORT + 1), "PET_NNODES": "2:3", "PET_RDZV_CONF": CONF}
    variables = [f"{k}={v}" for k, v in pod.items()]
    logs = [tmp_path / f"pod{k}.log" for k in range(2)]
    procs = [
        bridge(node, ["env", "OMP_NUM_THREADS=1", *variables, *onedist_command(str(script), str(out))], log,
               hostname=f"pyjob-worker-{k}")
        for k, (node, log) in enumerate(zip(("nodeA", "nodeB"), logs))
    ]  # fmt: skip
    _wait("3 steps at world size 2", lambda: _count(out, 2) >= 3, procs, logs)
    (out / "stop").write_text("")
    for p in procs:
        p.wait(timeout=60)
    assert [p.returncode for p in procs] == [0, 0], [log.read_text()[-3000:] for log in logs]
    assert "--nnodes=2:3 (PET_NNODES)" in logs[0].read_text() and "(PET_RDZV_CONF)" in logs[0].read_text()
    assert [w for _, w in _check_resumes(out)] == [2]
    hosts = sorted(json.loads(p.read_text())["host"] for p in out.glob("resumed-*.json"))
    assert hosts == ["pyjob-worker-0", "pyjob-worker-1"]


# ---------------------------------------------------------------- refused at once
C10D = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1"]


@pytest.mark.parametrize(
    "flags, environ, says",
    [
        (["--nnodes", "1:4"], {},
         "--nnodes=1:4 is not allowed with --rdzv-backend=static; allowed: N, or MIN:MAX with"),
        ([], {"PET_NNODES": "1:4"}, "PET_NNODES=1:4 is not allowed with --rdzv-backend=static"),
        (["--nnodes", "3:2"], {}, "--nnodes='3:2' is not allowed; allowed: N or MIN:MAX with 1 <= MIN"),
        (["--nnodes", "2:3", "--rdzv-backend", "c10d"], {},
         "--rdzv-endpoint=None is not allowed; allowed: HOST:PORT"),
        (["--nnodes", "2:3", *C10D, "--node-rank", "1"], {},
         "--node-rank=1 is not allowed; allowed: none with --rdzv-backend c10d"),
        (["--nnodes", "1:3", *C10D, "--recovery", "live", "--max-restarts", "1"], {},
         "--recovery='live' is not allowed; allowed: 'restart' with --rdzv-backend c10d"),
        (["--nnodes", "1:3", *C10D, "--rdzv-conf", "timeout"], {},
         "--rdzv-conf='timeout' is not allowed; allowed: KEY=VALUE,..."),
        (["--nnodes", "1:3", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:0"], {},
         "--rdzv-endpoint='h:0' is not allowed; allowed: HOST[:PORT]"),
    ],
    ids=["static", "pet-static", "min-above-max", "no-endpoint", "node-rank", "live", "conf", "port-0"],
)  # fmt: skip
def test_refused_at_once(flags, environ, says, tmp_path):
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('started')\n")
    began = time.monotonic()
    env = clean_env(**environ)
    cmd = onedist_command(*flags, str(script))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert "started" not in proc.stderr and time.monotonic() - began < 10


# ---------------------------------------------------------------- a torchrun node beside an onedist run node
@pytest.mark.slow
@needs_netns
@pytest.mark.parametrize("on_a", ["onedist run", "torchrun"])
def test_torchrun_and_onedist_run_nodes_in_one_job(bridge, tmp_path, on_a):
    """The two speak one protocol (torch's c10d rendezvous, torchrun's rank assignment and the
    round's MASTER_ADDR/MASTER_PORT keys). nodeA (either) hosts the rendezvous and trains alone
    (--nnodes 1:2); nodeB (the other) joins: both restart as a world of 2. torch 2.13's torchrun
    needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 to restart on a join at all (its store shared
    across rounds keeps the first round's keys: it hangs without, torchrun alone too)."""
    script, out = _script(tmp_path), tmp_path / "out"
    out.mkdir()
    port = str(PORT + 2 + (on_a == "torchrun"))
    rdzv = ["--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"nodeA:{port}"]
    rdzv += ["--rdzv-conf", CONF]
    torchrun = ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", TORCHRUN, "--nproc-per-node", "1", *rdzv]
    onedist = onedist_command("-n", "1", *rdzv)
    commands = [onedist, torchrun] if on_a == "onedist run" else [torchrun, onedist]
    logs = [tmp_path / f"node{n}.log" for n in "AB"]
    began = time.monotonic()
    procs = [bridge("nodeA", ["env", "OMP_NUM_THREADS=1", *commands[0], str(script), str(out)], logs[0])]
    _wait("2 steps at world size 1", lambda: _count(out, 1) >= 2, procs, logs)
    alone = time.monotonic()
    procs.append(bridge("nodeB", ["env", "OMP_NUM_THREADS=1", *commands[1], str(script), str(out)], logs[1]))
    _wait("2 steps at world size 2", lambda: _count(out, 2) >= 2, procs, logs)
    joined = time.monotonic()
    (out / "stop").write_text("")
    for p in procs:
        p.wait(timeout=60)
    print(f"{on_a} on nodeA: 2 steps alone {alone - began:.1f} s, the join and 2 steps "
          f"{joined - alone:.1f} s, the end {time.monotonic() - joined:.1f} s")  # fmt: skip
    assert [p.returncode for p in procs] == [0, 0], [log.read_text()[-3000:] for log in logs]
    assert [w for _, w in _check_resumes(out)] == [1, 2]
    started = [json.loads(p.read_text()) for p in out.glob("resumed-*")]
    assert sorted((r["world"], r["rank"], r["host"]) for r in started) == [
        (1, 0, "nodeA"),
        (2, 0, "nodeA"),
        (2, 1, "nodeB"),
    ]


@pytest.mark.slow
def test_a_signal_while_waiting_for_nodes_ends_the_wait(tmp_path):
    """A node alone below MIN waits in the rendezvous (up to join_timeout); SIGTERM ends the wait
    at once, without closing the rendezvous (the node only leaves)."""
    import onedist._net as net

    script = _script(tmp_path)
    port = net.free_port()
    endpoint = f"127.0.0.1:{port}"
    cmd = onedist_command(
        "--nnodes", "2:3", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, str(script), "x"
    )
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:  # the rendezvous store is up:
            with socket.socket() as probe:  # its handler comes next, after the signal handlers
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)
        time.sleep(1)
        proc.terminate()
        sent = time.monotonic()
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM while waiting for other nodes" in err, err
    assert time.monotonic() - sent < 10


# ---------------------------------------------------------------- the decision after an attempt
class _Handler:
    closed = False

    def shutdown(self) -> bool:
        self.closed = True
        return True


def _membership(joining: bool = False):
    from torch.distributed import HashStore

    from onedist.launchers.elastic import Membership
    from onedist.launchers.run_spec import RunSpec

    m = Membership(RunSpec(command=("t.py",), nproc_per_node=1, run_id="job"), 3, {})
    m.handler, m.store, m.nodes, m.joining = _Handler(), HashStore(), 1, joining
    return m


def _failure(rank: int, secondary: bool):
    from onedist.launchers.report import Failure

    if secondary:
        return Failure(rank, 0, 1, 0.0, exc_type="RemoteRankError", message="a peer closed its connection")
    return Failure(rank, 0, 1, 0.0, exc_type="ValueError", message="bad batch")


@pytest.mark.parametrize(
    "joining, failures, code, signalled, restarts, expected, closed",
    [
        (True, [], 1, False, (0, 0), ("restart", False), False),  # a node joins: not counted
        (False, [_failure(0, True)], 1, False, (0, 0), ("restart", False), False),  # a node left
        (False, [_failure(0, False)], 1, False, (0, 1), ("restart", True), False),  # its own: counted
        (False, [_failure(0, False)], 1, False, (1, 1), ("end", False), True),  # none left: closed
        (False, [], 0, False, (0, 0), ("done", False), True),  # every node done: closed
        (False, [], 143, True, (0, 3), ("end", False), False),  # a signal: this node leaves
    ],
    ids=["join", "left", "own-failure", "no-restart-left", "done", "signal"],
)  # fmt: skip
def test_the_decision_after_an_attempt(
    joining, failures, code, signalled, restarts, expected, closed, capsys
):
    m = _membership(joining)
    handler = m.handler
    assert m.verdict(failures, code, signalled, restarts) == expected
    assert handler.closed == closed
    if expected[0] == "restart":
        assert (
            "restart 1 of 1" if expected[1] else "not counted in --max-restarts"
        ) in capsys.readouterr().err
