"""Shared-memory collectives for the ranks of one host: the ``shm`` torch.distributed backend.

A process group written in Python (torch lets Python register a backend, and
``DistributedDataParallel`` calls it like any other) that moves CPU tensors through one
shared-memory segment per group instead of loopback TCP:

* **all_reduce**: every rank copies its chunk into its own slot; after a barrier, rank ``r``
  reduces slice ``r`` of the chunk over all slots, in rank order, into the result area; after the
  next barrier every rank copies the result out. Each element is reduced by exactly one rank,
  always in rank order, so every rank gets the same bits, run after run.
* **all_gather / broadcast / reduce_scatter / reduce / barrier / gather / scatter**: the same
  slots and barriers.
* **all_to_all**: each rank writes a head (where its parts start, what it expects from each rank,
  where its input is) and, when they fit, its parts into its slot; after a barrier every rank
  reads every head and takes its parts; larger ones each rank reads straight out of the peers'
  memory (``process_vm_readv``, :mod:`.cma`), or, where the kernel forbids that, they go in
  rounds of a slot per rank (``_exchange``).
* everything else (send/recv, the deprecated all_gather_coalesced, CUDA tensors) goes to a gloo
  group made beside it on the same store, so the backend is complete.

Tensors larger than a slot go in chunks. The segment has two banks (slots and result area each)
and two small mailboxes: a broadcast alternates chunks between the banks, the root writing one
while the others read the other; a collective hands the next one the other bank (or mailbox)
where that saves a barrier at its end (``ShmProcessGroup._phases`` gives the schedule and the
rules that make it safe).

The segment is a ``memfd`` (never a file in ``/dev/shm``): rank 0 of the group creates it, the
other ranks open it through ``/proc/<pid>/fd/<fd>`` (same user only, like the mode 0600 of a
file), and rank 0 closes its descriptor once all have mapped it. The memory is the kernel's to
free when the last rank unmaps it or dies, whatever the way it dies: nothing can leak.

Ordering: barriers are per-rank generation counters (one writer each) in the segment, waited on
with ``futex(2)`` after a short spin. Beside its counter, in the same cache line, each rank writes
what it is calling (collective, reduce op, root, dtype, size, step) before every barrier, and
reads its peers' after it: ranks that called different collectives, or the same one on different
sizes, dtypes, ops or roots, all raise :class:`~onedist.errors.CollectiveMismatchError` at that
barrier, naming each rank's call, and the group stays usable. With gloo such a program hangs, or
silently returns garbage; here it costs about a microsecond per collective, so it is always on.

x86-64 keeps stores in order (TSO), which the protocol needs between the data a rank writes and
the counter it bumps after it: :func:`supported` is False on other architectures and
``backend="shm"`` is refused there.

A group whose ranks are not all on one host, or whose ranks cannot open each other's memfd
(different PID namespaces), runs every collective on its gloo group: ``shm`` is never wrong, at
worst it is gloo.

The package, one job per module: :mod:`.segment` (the memfd and its layout), :mod:`.protocol`
(barriers, the call check, failure marks), :mod:`.reduce_ops` (what each reduce op computes),
:mod:`.phases` (chunks through the banks, copies over helper threads), :mod:`.scatter_gather`
(gather, scatter, all_to_all), :mod:`.cma` (reads from a peer's memory), :mod:`.hosts` (two levels over
several hosts) and :mod:`.group` (the process group and its dense collectives; :mod:`onedist._torch_plugin`
registers it with torch).
"""

from __future__ import annotations

from .group import ShmProcessGroup, create
from .protocol import ShmError
from .segment import DEFAULT_CHUNK, NAME, supported

__all__ = ["DEFAULT_CHUNK", "NAME", "ShmError", "ShmProcessGroup", "create", "supported"]
