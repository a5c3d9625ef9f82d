"""What checksums cost a checkpoint (issue 51): onedist's save and load of a 200 MB checkpoint (a
CRC-32 of every byte computed while writing, checked before reading) against the same steps
without one, interleaved in one process; a sharded checkpoint of 2 ranks (FSDP2) against
torch.distributed.checkpoint's own save and load; and the speed of the candidate hashes.

    python benchmarks/bench_checkpoint.py                  # 200 MB, 7 repetitions, sharded on 2 ranks
    python benchmarks/bench_checkpoint.py --mb 50 --reps 5 --no-sharded
    python benchmarks/bench_checkpoint.py --sharded-only --reps 9

Rows: with checksum / without, the median, the fastest and the median CPU time (of rank 0 for the
sharded rows) of --reps repetitions interleaved in a rotating order, and the three ratios:
  hashes        GB/s of each candidate on the same bytes in memory (xxhash's and ISA-L's when
                installed), and onedist's crc32_of of the file (a memory map, one thread per 32 MiB)
  save          od.save_checkpoint of {"model": model} against torch.save to a temporary file,
                fsync, rename (onedist's write before checksums; torch computes its own zip CRCs)
  load          od.load_checkpoint(path, {"model": model}) against torch.load + load_state_dict
  ... zlib      the same with zlib's CRC-32 (what runs where isal is not installed)
  ... no check  onedist's load with every step but the CRC-32 (the same reads into memory of its
                own, the same unpickling): with checksum / this is what the check itself costs
  A/A           the save without checksum against itself: the noise floor
  sharded       od.save_checkpoint / od.load_checkpoint of an FSDP model on 2 gloo ranks (each rank
                its shards, checksummed) against DCP's save / load (+ set_model_state_dict) of the
                same state dict; the load's "no check" row as above, "DCP's read" onedist's load
                with each tensor read by DCP's own code (torch.load into new memory, then copied)
                instead of straight into the parameter, and "load A/A" DCP's load against itself
The files go to a temporary folder under --dir (default: the system's temporary folder).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
import onedist as od
from onedist.training import checksums, shard_checksums, shard_reader
from onedist.training.checksums import crc32_of
from onedist.training.files import fsync_dir

MIB = 2**20


def layers(mb: int) -> torch.nn.Module:
    """Linear layers of 1024 x 1024 floats (4 MiB each) adding up to ``mb`` MB, in a ModuleList
    (the sharding policy's units)."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList(
        torch.nn.Linear(1024, 1024, bias=False) for _ in range(max(1, round(mb * 1e6 / (4 * MIB))))
    )
    return model


Timing = tuple[float, float, float]  # seconds: the median, the fastest, the median CPU time


def interleaved_seconds(
    variants: dict[str, Callable[[], None]], reps: int, sync: Callable[[], None]
) -> dict[str, Timing]:
    """Each variant's median and fastest seconds over ``reps`` runs, interleaved in a rotating
    order, and its median CPU seconds (of this process, all its threads): on a machine whose other
    work takes the cores, the fastest and the CPU time move least."""
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    names = list(variants)
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            sync()
            start, cpu = time.perf_counter(), time.process_time()
            variants[name]()
            sync()
            samples[name].append((time.perf_counter() - start, time.process_time() - cpu))
    return {
        name: (statistics.median(w for w, _ in v), min(w for w, _ in v), statistics.median(c for _, c in v))
        for name, v in samples.items()
    }


# ============================================================================ hashes
def hash_speeds(mb: int, folder: Path) -> dict[str, float]:
    """GB/s of each candidate hash over ``mb`` MB of random bytes (best of 3)."""
    data = os.urandom(mb * 10**6)
    candidates: dict[str, Callable[[], Any]] = {
        "zlib.crc32": lambda: zlib.crc32(data),
        "zlib.adler32": lambda: zlib.adler32(data),
        "hashlib.sha256": lambda: hashlib.sha256(data).digest(),
        "hashlib.sha1": lambda: hashlib.sha1(data).digest(),
        "hashlib.blake2b": lambda: hashlib.blake2b(data).digest(),
        "hashlib.md5": lambda: hashlib.md5(data).digest(),
    }
    try:
        import xxhash

        candidates["xxhash.xxh3_64"] = lambda: xxhash.xxh3_64(data).digest()
    except ImportError:
        pass
    if checksums.CRC32_BY == "isal":
        candidates["isal crc32"] = lambda: checksums.crc32(data)
    path = folder / "hash-input"
    path.write_bytes(data)
    file = open(path, "rb")  # noqa: SIM115  # closed below, after the timing
    candidates["onedist crc32_of (file)"] = lambda: crc32_of(file, len(data))
    speeds = {}
    for name, run in candidates.items():
        best = min(_seconds(run) for _ in range(3))
        speeds[name] = len(data) / best / 1e9
    file.close()
    path.unlink()
    return speeds


def _seconds(run: Callable[[], Any]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


# ============================================================================ one file
def plain_save(state: Any, path: Path) -> None:
    """onedist's write before checksums: torch.save to a temporary file, fsync, rename."""
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "xb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    fsync_dir(path.parent)


def one_file(mb: int, reps: int, folder: Path) -> dict[str, Any]:
    model = layers(mb)
    plain, aa, checked = folder / "plain.pt", folder / "plain-again.pt", folder / "checked.pt"

    def od_save(path: Path = checked) -> None:
        od.save_checkpoint({"model": model}, path)

    def od_load() -> None:
        od.load_checkpoint(checked, {"model": model}, map_location="cpu")

    save_variants: dict[str, Callable[[], None]] = {
        "plain": lambda: plain_save({"model": model.state_dict()}, plain),
        "A/A": lambda: plain_save({"model": model.state_dict()}, aa),
        "onedist": od_save,
        "onedist zlib": lambda: with_zlib(lambda: od_save(folder / "checked-zlib.pt")),
    }
    saves = interleaved_seconds(save_variants, reps, lambda: None)
    load_variants: dict[str, Callable[[], None]] = {
        "plain": lambda: model.load_state_dict(
            torch.load(plain, map_location="cpu", weights_only=True)["model"]
        ),
        "onedist": od_load,
        "onedist zlib": lambda: with_zlib(od_load),
        "onedist no check": lambda: without_check(od_load),
    }
    loads = interleaved_seconds(load_variants, reps, lambda: None)
    size = checked.stat().st_size
    return {
        "bytes": size,
        **{f"save {k}": v for k, v in saves.items()},
        **{f"load {k}": v for k, v in loads.items()},
    }


def with_zlib(run: Callable[[], None]) -> None:
    """``run()`` with zlib's CRC-32, as where isal is not installed."""
    fastest = checksums.crc32
    checksums.crc32 = zlib.crc32
    try:
        run()
    finally:
        checksums.crc32 = fastest


def without_check(run: Callable[[], None]) -> None:
    """``run()`` (a load) with every step of onedist's but the CRC-32 and its comparison: the same
    reads into memory of its own (of each file a share for a sharded one), the same unpickling."""
    with _unchecked():
        run()


@contextlib.contextmanager
def _unchecked() -> Iterator[None]:
    def unchecked(path: Path, crc_of: Callable[[Any, int], int]) -> bool:
        with open(path, "rb") as f:
            crc_of(f, os.fstat(f.fileno()).st_size - checksums.RECORD_SIZE)
        return True

    saved = checksums._check, checksums.crc32, shard_checksums._fault_of
    checksums._check, checksums.crc32 = unchecked, lambda data, value=0: value
    shard_checksums._fault_of = lambda path, crc, size: None  # each shard file: intact, unread
    try:
        yield
    finally:
        checksums._check, checksums.crc32, shard_checksums._fault_of = saved


def with_dcps_read(run: Callable[[], None]) -> None:
    """``run()`` (a sharded load) with each tensor read by DCP's own code (``torch.load`` of each
    saved tensor into new memory, then copied into the parameter) instead of straight into it."""
    straight = shard_reader.read_straight
    shard_reader.read_straight = lambda *args: False  # type: ignore[assignment]
    try:
        run()
    finally:
        shard_reader.read_straight = straight  # type: ignore[assignment]


# ============================================================================ sharded, 2 ranks
def sharded(local_rank: int, mb: int, reps: int, folder: str) -> dict[str, Timing]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "Detected an existing checkpoint")
    model = od.auto_model(layers(mb), sharding="fsdp")
    ours, theirs = os.path.join(folder, "od.pt"), os.path.join(folder, "dcp")

    def dcp_load() -> None:
        state = get_model_state_dict(model)
        dcp.load({"model": state}, storage_reader=dcp.FileSystemReader(theirs))
        set_model_state_dict(model, state)

    variants: dict[str, Callable[[], None]] = {
        "save plain": lambda: dcp.save(
            {"model": get_model_state_dict(model)}, storage_writer=dcp.FileSystemWriter(theirs)
        ),
        "save onedist": lambda: od.save_checkpoint({"model": model}, ours),
    }
    seconds = interleaved_seconds(variants, reps, od.barrier)

    def od_load() -> None:
        od.load_checkpoint(ours, {"model": model})

    loads: dict[str, Callable[[], None]] = {
        "load plain": dcp_load,
        "load plain again": dcp_load,
        "load onedist": od_load,
        "load onedist no check": lambda: without_check(od_load),
        "load onedist dcp read": lambda: with_dcps_read(od_load),
    }
    seconds.update(interleaved_seconds(loads, reps, od.barrier))
    return seconds


# ============================================================================ report
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=int, default=200, help="checkpoint size in MB")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where the temporary folder goes")
    parser.add_argument("--no-sharded", action="store_true", help="skip the 2-rank sharded rows")
    parser.add_argument("--sharded-only", action="store_true", help="only the 2-rank sharded rows")
    args = parser.parse_args()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU benchmark, also on a GPU machine
    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp(prefix="bench-checkpoint-", dir=args.dir))
    try:
        print(
            f"onedist {od.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs; {args.mb} MB "
            f"checkpoints in {folder}; {args.reps} interleaved repetitions; CRC-32 by "
            f"{checksums.CRC32_BY}; load average {os.getloadavg()[0]:.1f}"
        )
        if not args.sharded_only:
            _one_file_rows(args.mb, args.reps, folder)
        if not args.no_sharded:
            out = od.spawn("gloo", sharded, args=(args.mb, args.reps, str(folder)), nproc_per_node=2)[0]
            for kind in ("save", "load"):
                _row(
                    f"sharded {kind}",
                    out[f"{kind} onedist"],
                    out[f"{kind} plain"],
                    "2 gloo ranks, FSDP2, vs DCP",
                )
            _row(
                "... no check", out["load onedist"], out["load onedist no check"], "onedist's load without it"
            )
            dcp_read = out["load onedist dcp read"]
            _row("... DCP's read", dcp_read, out["load plain"], "each tensor via torch.load")
            _row("load A/A", out["load plain again"], out["load plain"], "DCP's load against itself")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _one_file_rows(mb: int, reps: int, folder: Path) -> None:
    speeds = hash_speeds(mb, folder)
    print("  hashes (GB/s): " + ", ".join(f"{name} {gbs:.2f}" for name, gbs in speeds.items()))
    got = one_file(mb, reps, folder)
    _row("save", got["save onedist"], got["save plain"], f"{got['bytes'] / 1e6:.0f} MB, one file")
    _row("... zlib", got["save onedist zlib"], got["save plain"], "zlib's CRC-32, as without isal")
    _row("load", got["load onedist"], got["load plain"], "into the live model")
    _row("... zlib", got["load onedist zlib"], got["load plain"], "zlib's CRC-32, as without isal")
    _row("... no check", got["load onedist"], got["load onedist no check"], "onedist's load without it")
    _row("A/A", got["save A/A"], got["save plain"], "the plain save against itself")


def _row(name: str, onedist: Timing, plain: Timing, what: str) -> None:
    ratios = "/".join(f"{a / b:.2f}" for a, b in zip(onedist, plain))
    print(
        f"  {name:14s} {onedist[0] * 1e3:6.1f} / {plain[0] * 1e3:6.1f} ms, fastest {onedist[1] * 1e3:6.1f} / "
        f"{plain[1] * 1e3:6.1f}, CPU {onedist[2] * 1e3:6.1f} / {plain[2] * 1e3:6.1f}: x{ratios}  ({what})"
    )


if __name__ == "__main__":
    main()
