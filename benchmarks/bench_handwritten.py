"""onedist against what a torch user writes by hand, in the same processes, on one process group.

    python benchmarks/bench_handwritten.py                  # 2 gloo ranks, 60 rounds
    python benchmarks/bench_handwritten.py --rounds 25 --json out.json
    python benchmarks/bench_handwritten.py --backend shm --cases dict

Every variant runs in the same spawned worker processes on the same default process group. A
*round* times every case once, and inside a case every variant once (a sample: the median of
3-20 calls timed one by one, 3 for 128 MB, ranks in step after a barrier; for the broadcast,
whose root may run ahead, the mean of the loop; the 16 and 64 MiB objects only every 2nd and 4th
round), the variants' order rotating from round to round; the ratio
of a variant to ``raw`` is taken **per round** (both timed within milliseconds), and the report
gives the median of those ratios. ``raw again (A/A)`` is the raw baseline run a second time:
its ratio is the noise floor of the others (a quiet machine gives 0.95-1.05). 60 rounds by
default: on a busy 2-core machine a round's ratio of the small cases spreads over +-15 %, and
with 30 rounds the median itself still moved by +-5 % from run to run (60: +-3 %). A variant
more than 5x slower than raw (ignite's leaf-by-leaf dict) is timed over 3 calls a sample: its
ratio is far from 1 either way, and its long samples would only stretch each round.

The baselines (``raw``), as a torch user writes them by hand:

  all_reduce 1 float     ``dist.all_reduce(t)`` on a 1-element float32 tensor; onedist's default
                         call ``od.all_reduce(t)`` (in place, as raw and ignite).
  all_reduce 16/128 MB   the same on 16 and 128 MB of float32; the ratio is raw's time over the
                         variant's, i.e. the fraction of raw's bandwidth.
  all_gather 1 element   ``out = [torch.empty_like(t) for _ in range(w)]; dist.all_gather(out, t);
                         torch.cat(out)`` (onedist returns the concatenation); ``od.all_gather(t)``.
  uneven all_gather      rank r holds a (1000 + 37 r) x 16 float32 tensor. By hand: all_gather the
                         row counts (``dist.all_gather`` of a 1-element tensor), pad to the
                         largest with ``torch.zeros``, ``dist.all_gather`` the padded tensors,
                         trim each and ``torch.cat``; ``od.all_gather(x)``.
                         "raw into_tensor" does the same with ``all_gather_into_tensor`` for
                         both collectives (one output buffer instead of a list).
  object broadcast       ``box = [obj or None]; dist.broadcast_object_list(box, src=0)`` of a small
                         dict; ``od.broadcast_object(obj or None, src=0)``.
  object all_gather      ``out = [None] * w; dist.all_gather_object(out, obj)``;
                         ``od.all_gather_object(obj)``.
  dict of 100 metrics    100 0-dim float32 tensors. By hand: ``torch.stack`` them in sorted key
                         order, one ``dist.all_reduce``, ``unbind`` back into a dict;
                         ``od.all_reduce(metrics)``.
  all_reduce Python float  ``t = torch.tensor([x], dtype=torch.float64); dist.all_reduce(t);
                         t.item()`` (a logged metric, ``loss.item()``); ``od.all_reduce(x)``.
  object broadcast / all_gather N MiB  a ``bytes`` object of 1, 16 and 64 MiB (a vocabulary, a
                         small state dict, a list of file names): ``broadcast_object_list`` /
                         ``all_gather_object`` against ``od.broadcast_object`` / ``od.all_gather_object``.

``--memory`` measures instead each rank's peak memory over the call for the large objects: the
peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``) above the resident set
before the call, beyond the object itself, median of 5 calls; rank 0 sends the broadcast.

Peers' columns (ignite, accelerate, Lightning Fabric) are added for the cases they cover when
they are installed, and left out silently when they are not.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
import onedist as od

Variants = dict[str, Callable[[], Any]]
_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _peers() -> dict[str, Any]:
    """The peer libraries that are installed, attached to the process group onedist made."""
    peers: dict[str, Any] = {}
    try:
        import ignite.distributed as idist

        idist.sync()
        peers["ignite"] = idist
    except Exception:
        pass
    try:
        from accelerate import PartialState
        from accelerate.utils import operations

        PartialState(cpu=True)
        peers["accelerate"] = operations
    except Exception:
        pass
    return peers


# ---------------------------------------------------------------------------- the hand-written baselines
def raw_all_gather(t: torch.Tensor, world: int) -> torch.Tensor:
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t)
    return torch.cat(out)


def raw_uneven(x: torch.Tensor, world: int) -> torch.Tensor:
    n = torch.tensor([x.shape[0]])
    counts = [torch.empty_like(n) for _ in range(world)]
    dist.all_gather(counts, n)
    sizes = [int(c) for c in counts]
    m = max(sizes)
    padded = torch.zeros((m, *x.shape[1:]), dtype=x.dtype)
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:s] for p, s in zip(parts, sizes)])


def raw_uneven_into(x: torch.Tensor, world: int) -> torch.Tensor:
    n = torch.tensor([x.shape[0]])
    counts = torch.empty(world, dtype=n.dtype)
    _into(counts, n)
    sizes = counts.tolist()
    m = max(sizes)
    padded = torch.zeros((m, *x.shape[1:]), dtype=x.dtype)
    padded[: x.shape[0]] = x
    out = torch.empty((world * m, *x.shape[1:]), dtype=x.dtype)
    _into(out, padded)
    return torch.cat([out[i * m : i * m + s] for i, s in enumerate(sizes)])


def raw_broadcast_object(obj: Any, rank: int, group: Any = None) -> Any:
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def raw_all_gather_object(obj: Any, world: int, group: Any = None) -> list[Any]:
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def raw_number(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()


def big_object(mib: int, rank: int) -> bytes:
    """``mib`` MiB of bytes, different per rank, every page written (calloc'd zeros would not count)."""
    return bytes([rank + 1]) * (mib * 2**20)


def _object_cases(rank: int, world: int) -> dict[str, tuple[Variants, int, int]]:
    """The large objects; on a backend other than gloo also raw torch on a gloo group of the same
    ranks ("raw on gloo": what onedist's shm is measured against)."""
    gloo = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
    cases: dict[str, tuple[Variants, int, int]] = {}
    for mib in OBJECT_MIB:
        obj = big_object(mib, rank)
        src_obj = obj if rank == 0 else None
        calls = 5 if mib < 64 else 3
        v: Variants = {
            "raw": functools.partial(raw_broadcast_object, obj, rank),
            "onedist": functools.partial(od.broadcast_object, src_obj),
        }
        if gloo is not None:
            v["raw on gloo"] = functools.partial(raw_broadcast_object, obj, rank, gloo)
        cases[f"object broadcast {mib} MiB"] = (v, calls, 0)
        v = {
            "raw": functools.partial(raw_all_gather_object, obj, world),
            "onedist": functools.partial(od.all_gather_object, obj),
        }
        if gloo is not None:
            v["raw on gloo"] = functools.partial(raw_all_gather_object, obj, world, gloo)
        cases[f"object all_gather {mib} MiB"] = (v, calls, 0)
    return cases


OBJECT_MIB = (1, 16, 64)


def _every(case: str) -> int:
    """Sample a case every this many rounds: a 64 MiB all_gather takes ~1 s a call here, and their
    ratios spread far less than the small cases' (60 rounds would take 10 minutes)."""
    return 4 if "64 MiB" in case else 2 if "16 MiB" in case else 1


def raw_stacked(metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    keys = sorted(metrics)
    buf = torch.stack([metrics[k] for k in keys])
    dist.all_reduce(buf)
    return dict(zip(keys, buf.unbind()))


# ---------------------------------------------------------------------------- the cases
def _cases(rank: int, world: int, peers: dict[str, Any]) -> dict[str, tuple[Variants, int, int]]:
    """case -> (variants, calls per timing, bytes per call for a bandwidth; 0: none)."""
    ig = peers.get("ignite")
    ac = peers.get("accelerate")
    cases: dict[str, tuple[Variants, int, int]] = {}
    t = torch.ones(1)
    v: Variants = {"raw": lambda: dist.all_reduce(t), "onedist": lambda: od.all_reduce(t)}
    if ig:
        v["ignite"] = lambda: ig.all_reduce(t)
    if ac:
        v["accelerate"] = lambda: ac.reduce(t, reduction="sum")
    cases["all_reduce 1 float"] = (v, 20, 0)
    for mb in (16, 128):
        x = torch.ones(mb * 2**20 // 4)
        v = {"raw": lambda x=x: dist.all_reduce(x), "onedist": lambda x=x: od.all_reduce(x)}
        if ig:
            v["ignite"] = lambda x=x: ig.all_reduce(x)
        cases[f"all_reduce {mb} MB"] = (v, 5 if mb == 16 else 3, mb * 2**20)
    one = torch.tensor([float(rank)])
    v = {"raw": lambda: raw_all_gather(one, world), "onedist": lambda: od.all_gather(one)}
    if ig:
        v["ignite"] = lambda: ig.all_gather(one)
    if ac:
        v["accelerate"] = lambda: ac.gather(one)
    cases["all_gather 1 element"] = (v, 20, 0)
    mine = torch.full((1000 + 37 * rank, 16), float(rank))
    v = {
        "raw": lambda: raw_uneven(mine, world),
        "onedist": lambda: od.all_gather(mine),
        "raw into_tensor": lambda: raw_uneven_into(mine, world),
    }
    if ig:
        shapes = [[1000 + 37 * r, 16] for r in range(world)]
        v["ignite (shapes given)"] = lambda: torch.cat(ig.all_gather_tensors_with_shapes(mine, shapes))
    cases["uneven all_gather (1000+37r)x16"] = (v, 10, 0)
    obj = {"rank": rank, "name": f"worker-{rank}", "stats": [0.1 * i for i in range(20)]}
    src_obj = obj if rank == 0 else None
    v = {"raw": lambda: raw_broadcast_object(obj, rank), "onedist": lambda: od.broadcast_object(src_obj)}
    if ac:
        v["accelerate"] = lambda: ac.broadcast_object_list([src_obj])
    cases["object broadcast"] = (v, 20, 0)
    v = {"raw": lambda: raw_all_gather_object(obj, world), "onedist": lambda: od.all_gather_object(obj)}
    if ig:
        v["ignite"] = lambda: ig.all_gather(obj)
    if ac:
        v["accelerate"] = lambda: ac.gather_object([obj])
    cases["object all_gather"] = (v, 20, 0)
    metrics = {f"metric_{i:03d}": torch.tensor(float(i + rank)) for i in range(100)}
    v = {"raw": lambda: raw_stacked(metrics), "onedist": lambda: od.all_reduce(metrics)}
    if ig:
        v["ignite (leaf by leaf)"] = lambda: {k: ig.all_reduce(m.clone()) for k, m in metrics.items()}
    cases["dict of 100 metrics"] = (v, 20, 0)
    x = 0.25 * (rank + 1)
    v = {"raw": lambda: raw_number(x), "onedist": lambda: od.all_reduce(x)}
    cases["all_reduce Python float"] = (v, 20, 0)
    cases.update(_object_cases(rank, world))
    for variants, _, _ in cases.values():
        variants["raw again (A/A)"] = variants["raw"]
    return cases


def _check_results(rank: int, world: int) -> None:
    """The variants compute the same thing (a benchmark of wrong answers proves nothing)."""
    one = torch.tensor([float(rank)])
    assert torch.equal(od.all_gather(one), raw_all_gather(one, world))
    mine = torch.full((1000 + 37 * rank, 16), float(rank))
    assert torch.equal(od.all_gather(mine), raw_uneven(mine, world))
    assert torch.equal(od.all_gather(mine), raw_uneven_into(mine, world))
    obj = {"rank": rank, "stats": [0.5, 1.5]}
    assert od.broadcast_object(obj if rank == 0 else None) == raw_broadcast_object(obj, rank)
    assert od.all_gather_object(obj) == raw_all_gather_object(obj, world)
    metrics = {f"m{i}": torch.tensor(float(i + rank)) for i in range(10)}
    assert od.all_reduce(metrics) == raw_stacked(metrics)
    assert od.all_reduce(0.25 * (rank + 1)) == raw_number(0.25 * (rank + 1))
    big = big_object(1, rank)
    assert od.broadcast_object(big if rank == 0 else None) == raw_broadcast_object(big, rank)
    assert od.all_gather_object(big) == raw_all_gather_object(big, world)


def _time(fn: Callable[[], Any], iters: int, per_call: bool) -> float:
    """Seconds per call, ranks starting together; rank 0's clock.

    ``per_call``: each call timed on its own and the sample is their median (on a shared 2-core
    machine a neighbour's burst lands on a call or two, which a mean would carry into the
    ratio); else the mean of the loop, for a broadcast, whose root may run calls ahead of the
    receivers. One call untimed first: a sample's first call paid for the case or variant before
    it (about 10 % on this machine's small cases, whichever variant came first in a round).
    """
    fn()
    dist.barrier()
    clock = time.perf_counter
    if not per_call:
        t0 = clock()
        for _ in range(iters):
            fn()
        return (clock() - t0) / iters
    times = []
    for _ in range(iters):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def _calls_per_sample(cases: dict[str, tuple[Variants, int, int]]) -> dict[tuple[str, str], int]:
    """Calls per sample of each (case, variant): the case's, or 3 for a variant more than 5x
    slower than raw. Rank 0's timings decide for all (the ranks must make the same calls)."""
    calls = {}
    for case, (variants, iters, _) in cases.items():
        raw = _time(variants["raw"], 3, False)
        for name, fn in variants.items():
            calls[case, name] = min(iters, 3) if _time(fn, 3, False) > 5 * raw else iters
    box = [calls]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def run(local_rank: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    rank, world = od.get_rank(), od.get_world_size()
    _check_results(rank, world)
    cases = {
        k: c
        for k, c in _cases(rank, world, _peers()).items()
        if not args.cases or any(s in k for s in args.cases)
    }
    for variants, iters, _ in cases.values():  # warm-up: first calls build groups, caches, pages
        for fn in variants.values():
            for _ in range(min(iters, 3)):
                fn()
    calls = _calls_per_sample(cases)
    samples: dict[str, dict[str, list[float]]] = {c: {v: [] for v in cases[c][0]} for c in cases}
    for rnd in range(args.rounds):
        for case, (variants, _, _) in cases.items():
            if rnd % _every(case):
                continue
            names = list(variants)
            shift = rnd % len(names)
            for name in names[shift:] + names[:shift]:
                n = calls[case, name]
                samples[case][name].append(_time(variants[name], n, "broadcast" not in case))
    return {"samples": samples, "bytes": {c: cases[c][2] for c in cases}}


def _status(field: str) -> int:
    """A ``/proc/self/status`` memory field, in bytes."""
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    assert match, field
    return int(match.group(1)) * 1024


def _peak_extra(fn: Callable[[], Any], obj: bytes) -> int:
    """The peak resident bytes one call of ``fn`` adds, beyond the new objects it returns."""
    dist.barrier()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident set (VmHWM) starts again from the current one
    before = _status("VmRSS")
    result = fn()
    peak = _status("VmHWM") - before
    values = result if isinstance(result, list) else [result]
    return peak - sum(len(v) for v in values if isinstance(v, bytes) and v is not obj)


def memory(local_rank: int, mib: int, case: str, variant: str) -> int:
    """This rank's peak extra bytes for one call, in fresh workers (memory a call before freed
    but kept resident would hide the next one's peak): a small call first, as a warm-up."""
    rank, world = od.get_rank(), od.get_world_size()
    _object_call(case, variant, b"warm-up", rank, world)()
    obj = big_object(mib, rank)
    return _peak_extra(_object_call(case, variant, obj, rank, world), obj)


def _object_call(case: str, variant: str, obj: bytes, rank: int, world: int) -> Callable[[], Any]:
    if case == "broadcast":
        if variant == "raw":
            return functools.partial(raw_broadcast_object, obj, rank)
        return functools.partial(od.broadcast_object, obj if rank == 0 else None)
    if variant == "raw":
        return functools.partial(raw_all_gather_object, obj, world)
    return functools.partial(od.all_gather_object, obj)


def report_memory(args: argparse.Namespace) -> None:
    """Each (size, call, variant) measured in a fresh pair of workers, ``--memory-runs`` times
    (median)."""
    print(
        "peak memory one call adds beyond the objects it returns (MiB; median of "
        f"{args.memory_runs} fresh runs), per rank; rank 0 sends the broadcast"
    )
    for mib in OBJECT_MIB[1:]:
        for case in ("broadcast", "all_gather"):
            cells = {}
            for variant in ("raw", "onedist"):
                runs = [
                    od.spawn(args.backend, memory, args=(mib, case, variant), nproc_per_node=args.world_size)
                    for _ in range(args.memory_runs)
                ]
                cells[variant] = [
                    statistics.median(r[rank] for r in runs) / 2**20 for rank in range(args.world_size)
                ]
            text = "  ".join(
                f"rank {r}: raw {cells['raw'][r]:6.1f}, onedist {cells['onedist'][r]:6.1f}"
                for r in range(args.world_size)
            )
            print(f"  {case} {mib} MiB".ljust(24) + text)


def report(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (case, variant): median time, median per-round ratio to raw, their spread."""
    rows = []
    for case, variants in result["samples"].items():
        raw = variants["raw"]
        nbytes = result["bytes"][case]
        for name, times in variants.items():
            ratios = [t / r for t, r in zip(times, raw)]
            if nbytes:  # bandwidth: raw's time over the variant's
                ratios = [1 / q for q in ratios]
            qs = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
            rows.append(
                {
                    "case": case,
                    "variant": name,
                    "median_s": statistics.median(times),
                    "ratio": statistics.median(ratios),
                    "ratio_q1": qs[0],
                    "ratio_q3": qs[2],
                    "bandwidth": bool(nbytes),
                    "GB/s": nbytes / statistics.median(times) / 1e9 if nbytes else None,
                }
            )
        if "raw on gloo" in variants:  # onedist on this backend against raw torch on gloo
            ratios = [t / r for t, r in zip(variants["onedist"], variants["raw on gloo"])]
            qs = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
            row = {
                "case": case,
                "variant": "onedist / raw on gloo",
                "median_s": statistics.median(variants["onedist"]),
            }
            row.update(ratio=statistics.median(ratios), ratio_q1=qs[0], ratio_q3=qs[2], bandwidth=False)
            rows.append({**row, "GB/s": None})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--cases", nargs="*", help="only the cases whose name contains one of these")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--memory", action="store_true", help="peak memory of the large objects instead")
    parser.add_argument("--memory-runs", type=int, default=3, help="fresh runs per --memory cell")
    args = parser.parse_args()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU benchmark, also on a GPU machine
    if args.memory:
        # every large block mmapped and given back when freed: else glibc's heap keeps a freed block
        # resident, and the next call's allocations reuse it without raising the peak
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
        report_memory(args)
        return
    load = os.getloadavg()[0]
    result = od.spawn(args.backend, run, args=(args,), nproc_per_node=args.world_size)[0]
    rows = report(result)
    print(
        f"onedist {od.__version__}, torch {torch.__version__}, {args.backend}, world size "
        f"{args.world_size}, {os.cpu_count()} CPUs (load average {load:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after), {args.rounds} rounds; ratio = median of per-round "
        "ratios to raw (time ratio; for MB rows: fraction of raw's bandwidth), [quartiles]"
    )
    case = None
    for r in rows:
        if r["case"] != case:
            case = r["case"]
            print(f"\n{case}")
        t = r["median_s"]
        when = f"{t * 1e6:9.1f} us" if t < 1e-2 else f"{t * 1e3:9.2f} ms"
        bw = f"  {r['GB/s']:.2f} GB/s" if r["GB/s"] else ""
        what = "of raw bandwidth" if r["bandwidth"] else "x raw"
        print(
            f"  {r['variant']:24s} {when}   {r['ratio']:.3f} {what} "
            f"[{r['ratio_q1']:.2f}-{r['ratio_q3']:.2f}]{bw}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "world_size": args.world_size, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
