"""The shm collectives whose ranks each send or take a different part: gather, scatter and
all_to_all (and the check at a barrier before gloo runs all_gather_coalesced)."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from functools import partial
from itertools import accumulate
from typing import Any, Optional

import torch
import torch._C._distributed_c10d as _c10d

from ...errors import CollectiveMismatchError
from .. import cma
from .._pygroup import ArgCheck, all_cpu, flat as _flat, for_each
from .phases import SPLIT_BYTES, ChunkMover, bytes_of
from .protocol import (
    KIND_ALL_GATHER_COALESCED,
    KIND_ALL_TO_ALL,
    KIND_GATHER,
    KIND_NAMES,
    KIND_SCATTER,
    dtype_code,
)
from .segment import NAME, SMALL_BYTES, Bank, round_up

_VOTE = struct.Struct("<q")


class Head:
    """An all_to_all head: the int64 fields each rank writes at the start of its slot, and where
    each sits in the unpacked tuple (see :meth:`Exchanges._exchange`)."""

    __slots__ = ("addr", "expects", "layout", "may_read", "starts", "vote_at")

    def __init__(self, size: int) -> None:
        self.starts = slice(0, size + 1)  #: where its part for each rank starts, and the end
        self.expects = slice(size + 1, 2 * size + 1)  #: the bytes it expects from each rank
        self.addr = 2 * size + 1  #: its input tensor's address
        self.may_read = 2 * size + 2  #: 1: it may read the peers' inputs directly (see cma)
        self.layout = struct.Struct(f"<{2 * size + 4}q")
        self.vote_at = self.layout.size - 8  #: byte offset of its vote on its direct reads


class Exchanges(ChunkMover):
    """gather, scatter and all_to_all of :class:`~.group.ShmProcessGroup`, and the chunked gather
    (:meth:`_gather_chunks`) that its all_gather shares with gather."""

    _gloo: Any
    _mail: int
    _head: Head
    _cma: bool

    # ------------------------------------------------------------------ gather, scatter, all_to_all
    # (arguments checked first as for the others: gloo names less, hangs a peer on some wrong
    # lists, and silently drops the rest of an all_to_all_single that does not split evenly).
    # Through gloo a small one took 200-500 us here and, unchecked, hung until the timeout when
    # the ranks called different collectives.
    def _agree(self, kind: int, tensors: Sequence[torch.Tensor]) -> None:
        """Before gloo runs a collective for this group (all_gather_coalesced): check at one barrier
        that every rank calls it (see _barrier), with the same dtype and number of elements of
        ``tensors`` (bytes when their dtypes differ); gloo would wait until the timeout when one
        rank calls it and another an all_reduce. Collectives queued before this one finish first.
        Without a segment (over several hosts, or no shared memory) gloo runs it unchecked."""
        if self._seg is None:
            return
        dtypes = {t.dtype for t in tensors}
        dtype = dtype_code(tensors[0].dtype) if len(dtypes) == 1 else 0  # 0: count in bytes
        count = sum(t.numel() * (1 if dtype else t.element_size()) for t in tensors)

        def check() -> None:
            self._begin(kind, count, dtype)
            self._barrier(KIND_NAMES[kind])

        self._poisoning(lambda: self._run(check, [], None).wait())

    def gather(self, outputs: Any, inputs: Any, opts: Any) -> Any:
        root = opts.rootRank
        check = ArgCheck(NAME, "gather", self._size)
        bad = check.at_root(root, self._rank, outputs, inputs, "output")
        if self._seg is None or not all_cpu(inputs + [t for ts in outputs for t in ts]):
            if bad is not None:  # the peers' parts land in scratch tensors, then the root raises
                scratch = [[torch.empty_like(i) for _ in range(self._size)] for i in inputs]
                self._gloo.gather(scratch, inputs, opts).wait()
                raise bad
            return self._gloo.gather(outputs, inputs, opts)
        lists = outputs if self._rank == root and bad is None else [None] * len(inputs)
        job = partial(for_each, partial(self._gather_one, root=root), lists, inputs)
        work = self._poisoning(self._run, job, inputs, outputs)
        if bad is not None:  # the root took no part in, but the others' parts moved: all in step
            work.wait()
            raise bad
        return work

    def _gather_one(self, outs: Optional[list[torch.Tensor]], inp: torch.Tensor, root: int) -> None:
        """``inp`` of every rank into ``outs`` on the root (None: this rank takes nothing)."""
        raw = bytes_of(inp)[0]
        self._begin(KIND_GATHER, inp.numel(), dtype_code(inp.dtype), root=root)
        self._gather_chunks(raw, outs or [], [raw.numel()] * self._size, "gather", root)

    def _gather_chunks(
        self, raw: torch.Tensor, outs: list[torch.Tensor], sizes: list[int], what: str, root: int = -1
    ) -> None:
        """Every rank's bytes ``raw`` (``sizes[r]`` of them from rank ``r``) into ``outs[r]``, in
        chunks through the slots, on every rank (all_gather), or with ``root`` on the root only
        (gather: the others pass no ``outs``; the root puts nothing and takes its own part straight
        from ``raw``). The caller has recorded the call (_begin)."""
        seg, me = self._seg, self._rank
        assert seg is not None
        cap = seg.chunk
        targets = [(o, *bytes_of(o)) for o in outs]

        def put(k: int, bank: Bank) -> None:
            lo = k * cap
            if lo < sizes[me]:
                self._copy(bank.slots[me][: min(cap, sizes[me] - lo)], raw[lo : lo + cap])

        def take(k: int, bank: Bank) -> None:
            # a rank that put its own part takes it back from its slot, in the cache: copying it
            # from the input instead (in put, or all at once) was 0.84x at 16 and 128 MB here
            lo = k * cap
            for j, ((_, dst, _, _), n) in enumerate(zip(targets, sizes)):
                if lo < n:
                    c = min(cap, n - lo)
                    self._copy(dst[lo : lo + c], raw[lo : lo + c] if j == root else bank.slots[j][:c])

        stages = [None if me == root else put, take if targets else None]
        self._phases(-(-max(sizes) // cap), stages, what)
        for o, _, flat, writeback in targets:
            if writeback:
                o.copy_(flat.view(o.shape))

    def scatter(self, outputs: Any, inputs: Any, opts: Any) -> Any:
        root = opts.rootRank
        check = ArgCheck(NAME, "scatter", self._size)
        bad = check.at_root(root, self._rank, inputs, outputs, "input")
        if self._seg is None or not all_cpu(outputs + [t for ts in inputs for t in ts]):
            # the root's verdict on its inputs first, so that every rank raises or none does
            ok = torch.tensor([bad is None], dtype=torch.uint8)
            verdict = _c10d.BroadcastOptions()
            verdict.rootRank = root
            self._gloo.broadcast([ok], verdict).wait()
            if not ok.item():
                raise bad if bad is not None else check.refused(root)
            return self._gloo.scatter(outputs, inputs, opts)
        refused = [False]

        def ask() -> None:
            refused[0] = self._root_refuses(root, bad is not None, outputs[0])

        self._poisoning(self._run, ask, [], None).wait()
        if refused[0]:
            raise bad if bad is not None else check.refused(root)
        lists = inputs if self._rank == root else [None] * len(outputs)
        job = partial(for_each, partial(self._scatter_one, root=root), outputs, lists)
        return self._poisoning(self._run, job, outputs, outputs)

    def _root_refuses(self, root: int, refuses: bool, like: torch.Tensor) -> bool:
        """Whether the root of a scatter (into ``like``) refused its inputs: it says so in its
        mailbox slot before one barrier, which also compares the ranks' calls. Every rank then
        raises, and none waits for the root."""
        seg = self._seg
        assert seg is not None
        box = seg.mailboxes[self._mail]
        if self._rank == root:
            box.slots[root][0] = int(refuses)
        self._begin(KIND_SCATTER, like.numel(), dtype_code(like.dtype), root=root)
        self._barrier("scatter")
        self._mail ^= 1  # read after the barrier, with none behind it (see _all_reduce_small)
        return bool(box.slots[root][0])

    def _scatter_one(self, out: torch.Tensor, ins: Optional[list[torch.Tensor]], root: int) -> None:
        """Part ``r`` of the root's ``ins`` into ``out`` on rank ``r``."""
        seg, me = self._seg, self._rank
        assert seg is not None
        raw, flat, writeback = bytes_of(out)
        n, cap = raw.numel(), seg.chunk
        self._begin(KIND_SCATTER, out.numel(), dtype_code(out.dtype), root=root)
        parts = [bytes_of(i)[0] for i in ins] if ins is not None else []

        def put(k: int, bank: Bank) -> None:  # the root: rank j's part into slot j
            lo = k * cap
            for j, part in enumerate(parts):
                if j != me:
                    self._copy(bank.slots[j][: min(cap, n - lo)], part[lo : lo + cap])

        def take(k: int, bank: Bank) -> None:
            lo = k * cap
            self._copy(
                raw[lo : lo + cap], parts[me][lo : lo + cap] if parts else bank.slots[me][: min(cap, n - lo)]
            )

        self._phases(-(-n // cap), [put if parts else None, take], "scatter")
        if writeback:
            out.copy_(flat.view(out.shape))

    def alltoall(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        check = ArgCheck(NAME, "all_to_all", self._size)
        check.count(inputs, "input")
        check.count(outputs, "output")
        if self._seg is None or not all_cpu(list(inputs) + list(outputs)):
            return self._gloo.alltoall(outputs, inputs, opts or _c10d.AllToAllOptions())
        dtypes = {t.dtype for t in inputs}
        code = dtype_code(inputs[0].dtype) if len(dtypes) == 1 else 0

        def job() -> None:  # one exchange of bytes: the parts may differ in size and dtype
            raws = [_flat(t)[0].view(torch.uint8) for t in inputs]
            sizes = [o.numel() * o.element_size() for o in outputs]
            got = torch.empty(sum(sizes), dtype=torch.uint8)
            self._exchange(got, sizes, torch.cat(raws), [r.numel() for r in raws], code)
            for o, part in zip(outputs, got.split_with_sizes(sizes)):
                of, writeback = _flat(o)
                of.view(torch.uint8).copy_(part)  # bytes: a part may start at any offset
                if writeback:
                    o.copy_(of.view(o.shape))

        return self._poisoning(self._run, job, list(inputs), outputs)

    def all_to_all_single(
        self, output: Any, input: Any, out_splits: Any, in_splits: Any, opts: Any = None
    ) -> Any:
        check = ArgCheck(NAME, "all_to_all_single", self._size)
        check.splits(input, in_splits, "input")
        check.splits(output, out_splits, "output")
        if self._seg is None or not all_cpu([output, input]):
            return self._gloo.alltoall_base(
                output, input, out_splits, in_splits, opts or _c10d.AllToAllOptions()
            )

        def job() -> None:
            src, _ = _flat(input)
            dst, writeback = _flat(output)
            raw_out, raw_in = dst.view(torch.uint8), src.view(torch.uint8)
            self._exchange(
                raw_out,
                _byte_sizes(raw_out, output, out_splits, self._size),
                raw_in,
                _byte_sizes(raw_in, input, in_splits, self._size),
                dtype_code(input.dtype),
            )
            if writeback:
                output.copy_(dst.view(output.shape))

        return self._poisoning(self._run, job, [input], output)

    def alltoall_base(
        self, output: Any, input: Any, out_splits: Any, in_splits: Any, opts: Any = None
    ) -> Any:
        return self.all_to_all_single(output, input, out_splits, in_splits, opts)

    def _exchange(
        self, out: torch.Tensor, out_sizes: list[int], inp: torch.Tensor, in_sizes: list[int], dtype: int
    ) -> None:
        """all_to_all of bytes: ``inp`` holds this rank's part for each rank in rank order,
        ``in_sizes`` bytes each; ``out`` gets each rank's part for this one, ``out_sizes`` bytes each.

        Each rank writes a head in its slot (where its parts start, and the end; then what it
        expects from each rank), and its parts after it when they fit. After the barrier every rank
        reads all heads, so all make the same choices: raise CollectiveMismatchError when a rank
        sends another a size it does not expect (every rank alike, nothing changed), take their
        parts from the slots when every rank's fitted (one step), else read them straight out of
        the peers' inputs when every rank may (see _read_parts), else move them in rounds (see
        _exchange_rounds)."""
        seg = self._seg
        assert seg is not None
        me, mm = self._rank, seg.mm
        fields = self._head
        heads = fields.layout
        head = round_up(heads.size, 64)
        room = seg.chunk - head
        starts = list(accumulate(in_sizes, initial=0))
        self._begin(KIND_ALL_TO_ALL, -1, dtype)  # the ranks may send different amounts
        told: list[tuple[int, ...]] = []
        where: list[Any] = []  # the peers' input addresses, whether all may read them, the bank

        def put(k: int, bank: Bank) -> None:
            heads.pack_into(mm, bank.at[me], *starts, *out_sizes, inp.data_ptr(), int(self._cma), 0)
            total = starts[-1]
            if not 0 < total <= room:
                return
            slot = bank.slots[me]
            if total <= SMALL_BYTES:  # all of it in one copy, this rank's own part too
                self._copy(slot[head : head + total], inp)
                return
            for j in range(self._size):  # the peers' parts: this rank takes its own from inp
                a, b = starts[j], starts[j + 1]
                if j != me and b > a:
                    self._copy(slot[head + a : head + b], inp[a:b])

        def take(k: int, bank: Bank) -> None:
            full = [heads.unpack_from(mm, at) for at in bank.at]
            told.extend(f[fields.starts] for f in full)
            where.extend(([f[fields.addr] for f in full], all(f[fields.may_read] for f in full), bank))
            wrong = [
                (p, q, told[p][q + 1] - told[p][q], expect)
                for q, f in enumerate(full)
                for p, expect in enumerate(f[fields.expects])
                if told[p][q + 1] - told[p][q] != expect
            ]
            if wrong:  # every rank sees it: all raise here, in step, and hand on the bank as at the end
                self._bank ^= 1
                raise self._split_mismatch(wrong)
            if any(h[-1] > room for h in told):
                return  # in rounds, after this step
            lo = 0
            for j, h in enumerate(told):
                want = out_sizes[j]
                if want:
                    part = (
                        inp[starts[me] : starts[me + 1]]
                        if j == me
                        else bank.slots[j][head + h[me] : head + h[me + 1]]
                    )
                    self._copy(out[lo : lo + want], part)
                lo += want

        self._phases(1, [put, take], "all_to_all")
        if any(h[-1] > room for h in told):
            at = list(accumulate((h[me + 1] - h[me] for h in told), initial=0))  # each rank's part in out
            if at[me + 1] > at[me]:  # this rank's own part, whichever way the others' come
                self._copy(out[at[me] : at[me + 1]], inp[starts[me] : starts[me + 1]])
            addrs, all_may, bank = where
            if not (all_may and self._read_parts(out, told, at, addrs, bank)):
                self._exchange_rounds(out, inp, starts, told, at)

    def _read_parts(
        self, out: torch.Tensor, told: list[tuple[int, ...]], at: list[int], addrs: list[int], bank: Bank
    ) -> bool:
        """The rest of an all_to_all too large for one step, each rank reading its parts straight
        out of the peers' inputs (``addrs``, from their heads; :mod:`.cma`) to ``at`` in ``out``
        (this rank's own part is there already): one copy per byte and
        one barrier, where the rounds take two copies and a barrier per slot-full. Each rank then
        votes in its head whether its reads succeeded, and after the barrier (no rank leaves, so
        no input changes, before every read is done) all see the same votes: True when every
        rank has its parts; else the rounds move them all again, and this group stops trying.
        16 MB on 2 cores, against the rounds in the same session: 1.05x / 1.2x / 1.55x their
        speed at 2 / 4 / 8 ranks (1.6-3.0x gloo's)."""
        seg = self._seg
        assert seg is not None
        size, me = self._size, self._rank
        base = out.data_ptr()
        pieces = [
            (seg.pids[p], base + at[p], addrs[p] + told[p][me], at[p + 1] - at[p])
            for p in range(size)
            if p != me and at[p + 1] > at[p]
        ]
        ok = cma.read_pieces(pieces, self._helpers, self._parts, SPLIT_BYTES)
        vote = self._head.vote_at
        _VOTE.pack_into(seg.mm, bank.at[me] + vote, 1 if ok else 2)
        self._barrier("all_to_all")
        if all(_VOTE.unpack_from(seg.mm, a + vote)[0] == 1 for a in bank.at):
            return True
        self._cma = False  # every rank saw the same votes: the group's ranks stop trying alike
        return False

    def _split_mismatch(self, wrong: list[tuple[int, int, int, int]]) -> CollectiveMismatchError:
        """The error of an all_to_all whose ranks disagree on sizes: (sender, receiver, bytes sent,
        bytes expected) for each pair that disagrees."""
        lines = ["onedist shm: all_to_all: the ranks' split sizes do not agree:"]
        lines += [
            f"  rank {p} sends rank {q} {sent} bytes; rank {q} expects {want} (its output split for rank {p})"
            for p, q, sent, want in wrong
        ]
        lines.append(
            "HINT: each rank's output_split_sizes must match what the others send it (their "
            "input_split_sizes); no tensor was changed, and the group is still usable."
        )
        return CollectiveMismatchError("\n".join(lines))

    def _exchange_rounds(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        starts: list[int],
        told: list[tuple[int, ...]],
        at: list[int],
    ) -> None:
        """The rest of an all_to_all too large for one step (``told``: where each rank's parts
        start, ``starts`` this rank's, ``at`` where each rank's part goes in ``out``; this rank's
        own part is there already): in round ``k`` each rank puts bytes ``[k*c, (k+1)*c)`` of its
        part for each peer into its slot (``c``: a slot over the number of peers; a rank's own part
        needs no room), and in the next phase each rank
        takes its pieces from every slot while the ranks put round ``k + 1`` into the other bank:
        one barrier per round. As many rounds as the largest part needs. Against a barrier after
        each put and each take (16 MB, 8 ranks on 2 cores, two runs each): 1.12-1.16x gloo's
        speed instead of 0.97-1.03x; 2 and 4 ranks, where copies weigh more than barriers: the
        same within noise."""
        seg = self._seg
        assert seg is not None
        size, me = self._size, self._rank
        peers = max(size - 1, 1)
        c = seg.chunk // peers // 64 * 64 or seg.chunk // peers  # cache lines, unless ranks are very many
        lens = [[h[q + 1] - h[q] for q in range(size)] for h in told]  # lens[p][q]: p sends q
        most = max(lens[p][q] for p in range(size) for q in range(size) if p != q)

        def put(k: int, bank: Bank) -> None:
            slot = bank.slots[me]
            for q in range(size):
                n = min(c, lens[me][q] - k * c)
                if q != me and n > 0:
                    lo, to = starts[q] + k * c, (q - (q > me)) * c  # peers in order, me left out
                    self._copy(slot[to : to + n], inp[lo : lo + n])

        def take(k: int, bank: Bank) -> None:
            for p in range(size):
                n = min(c, lens[p][me] - k * c)
                if p != me and n > 0:
                    lo, fro = at[p] + k * c, (me - (me > p)) * c  # where rank p put this rank's piece
                    self._copy(out[lo : lo + n], bank.slots[p][fro : fro + n])

        self._phases(-(-most // c), [put, take], "all_to_all", overlap=True)

    def allgather_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        self._agree(KIND_ALL_GATHER_COALESCED, inputs)
        return self._gloo.allgather_coalesced(outputs, inputs, opts or _c10d.AllgatherOptions())


def _byte_sizes(raw: torch.Tensor, t: torch.Tensor, splits: Sequence[int], size: int) -> list[int]:
    """The bytes ``raw`` of ``t`` as one part per rank, in bytes: ``splits`` rows each (of ``t``'s
    first dimension), or equal parts when there are none."""
    if not splits:
        return [raw.numel() // size] * size
    rows = t.shape[0] if t.dim() else t.numel()
    per_row = raw.numel() // rows if rows else 0
    return [s * per_row for s in splits]
